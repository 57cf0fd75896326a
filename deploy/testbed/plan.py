"""The testbed as data: names, addresses and the iproute2/tc commands that build it.

Pure (nothing runs here), so every name, address and command is unit-tested without root.

Layout (one testbed, id hash ``h`` = 6 hex digits of sha256(id)):

- bridge ``edg<h>br`` in the root namespace, address ``<subnet>.1`` (the controller);
- per host ``i`` (0-based, in the order given) a namespace ``edgestream-<h>-<name>`` and a
  veth pair: ``eth0`` inside the host, ``edg<h>v<i>`` on the bridge; the host's address is
  ``<subnet>.(i + 2)``;
- broker hosts get a second address, the same offset in the alias subnet (the next block
  of the same size: 10.77.0.0/24 -> 10.77.1.0/24), as a /32 on their ``eth0``; every host
  has an on-link route to the alias subnet. Delay proxies forward to these aliases;
- loopback up in every namespace; no default route anywhere (nothing leaves the machine).
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from dataclasses import dataclass

from edgestream.deploy.testbed.links import LinkSpec, tbf_params

#: Every namespace the testbed makes starts with this.
NETNS_PREFIX = "edgestream-"
#: Every interface in the root namespace starts with this (then 6 hex digits of the id hash).
LINK_PREFIX = "edg"
HOST_IF = "eth0"
IFNAMSIZ = 15
HOST_KINDS = ("worker", "server", "devices", "broker")
NETNS_RE = re.compile(r"^edgestream-([0-9a-f]{6})-(.+)$")
LINK_RE = re.compile(r"^edg([0-9a-f]{6})(br|v\d+)$")
_HOST_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
#: Kafka ports of a broker host in testbed mode (clients, KRaft controller).
BROKER_PORT = 9092
CONTROLLER_PORT = 9093


def id_hash(testbed_id: str) -> str:
    return hashlib.sha256(testbed_id.encode()).hexdigest()[:6]


def kind_of(name: str) -> str:
    """A host's kind from its name: server, devices, b<i> (broker), otherwise worker."""
    if name in ("server", "devices"):
        return name
    if re.fullmatch(r"b\d+", name):
        return "broker"
    return "worker"


@dataclass(frozen=True)
class HostPlan:
    name: str
    kind: str
    index: int
    netns: str
    address: str  # without prefix length
    alias: str | None  # brokers only
    bridge_if: str  # the bridge-side veth end (root namespace)
    link: LinkSpec


@dataclass(frozen=True)
class Plan:
    testbed_id: str
    hash: str
    subnet: ipaddress.IPv4Network
    alias_subnet: ipaddress.IPv4Network
    bridge: str
    controller_address: str
    hosts: tuple[HostPlan, ...]

    def host(self, name: str) -> HostPlan:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    @property
    def brokers(self) -> list[HostPlan]:
        return [h for h in self.hosts if h.kind == "broker"]


def alias_subnet_of(subnet: ipaddress.IPv4Network) -> ipaddress.IPv4Network:
    """The block of the same size right after ``subnet``."""
    start = int(subnet.network_address) + subnet.num_addresses
    return ipaddress.IPv4Network((start, subnet.prefixlen))


def check_subnet(text: str) -> ipaddress.IPv4Network:
    """A private IPv4 subnet for the hosts (ValueError otherwise)."""
    try:
        subnet = ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise ValueError(f"testbed subnet {text!r}: {exc} (e.g. 10.77.0.0/24)") from None
    if not isinstance(subnet, ipaddress.IPv4Network) or not subnet.is_private or subnet.prefixlen > 28:
        raise ValueError(f"testbed subnet {text!r} must be a private IPv4 block of /28 or larger "
                         "(e.g. 10.77.0.0/24): its addresses never leave the machine")
    if not alias_subnet_of(subnet).is_private:
        raise ValueError(f"testbed subnet {text!r}: the block after it (broker aliases) is not private; "
                         "pick another, e.g. 10.77.0.0/24")
    return subnet


def make_plan(testbed_id: str, hosts: list[tuple[str, str, LinkSpec]], subnet: str = "10.77.0.0/24") -> Plan:
    """Names and addresses for ``hosts`` (name, kind, link); ValueError on bad input."""
    if not testbed_id or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", testbed_id):
        raise ValueError(f"testbed id {testbed_id!r}: use 1-64 letters, digits, '_', '.', '-'")
    net = check_subnet(subnet)
    alias = alias_subnet_of(net)
    if not hosts:
        raise ValueError("a testbed needs at least one host")
    if len(hosts) > net.num_addresses - 3:
        raise ValueError(f"{len(hosts)} hosts do not fit in {net} (it has {net.num_addresses - 3} host addresses "
                         "besides the controller); use a larger testbed subnet")
    names = [name for name, _, _ in hosts]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"host names must be unique (repeated: {duplicated})")
    h = id_hash(testbed_id)
    plans = []
    for index, (name, kind, link) in enumerate(hosts):
        if not _HOST_NAME_RE.fullmatch(name):
            raise ValueError(f"host name {name!r}: use 1-32 letters, digits, '_', '.', '-'")
        if kind not in HOST_KINDS:
            raise ValueError(f"host {name}: kind {kind!r} is not one of {', '.join(HOST_KINDS)}")
        if kind == "broker" and link.delayed:
            raise ValueError(f"broker host {name}: a broker's link cannot have a delay (delay is added in front "
                             "of the brokers, in the delayed client hosts); give it a rate only")
        offset = index + 2
        plans.append(HostPlan(
            name=name, kind=kind, index=index, netns=f"{NETNS_PREFIX}{h}-{name}",
            address=str(net[offset]), alias=str(alias[offset]) if kind == "broker" else None,
            bridge_if=f"{LINK_PREFIX}{h}v{index}", link=link,
        ))
    delayed = [p.name for p in plans if p.link.delayed]
    if delayed and not any(p.kind == "broker" for p in plans):
        raise ValueError(f"{', '.join(delayed)}: a delay is added by a proxy in front of the brokers, and this "
                         "testbed has no broker host; add one or give the link a rate only")
    return Plan(testbed_id, h, net, alias, f"{LINK_PREFIX}{h}br", str(net[1]), tuple(plans))


# --- commands -------------------------------------------------------------------------
Cmd = list[str]


def bridge_commands(plan: Plan) -> list[Cmd]:
    prefix = plan.subnet.prefixlen
    return [
        ["ip", "link", "add", plan.bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0"],
        ["ip", "link", "set", plan.bridge, "addrgenmode", "none"],
        ["ip", "addr", "add", f"{plan.controller_address}/{prefix}", "dev", plan.bridge],
        ["ip", "link", "set", plan.bridge, "up"],
    ]


def host_commands(plan: Plan, host: HostPlan) -> list[Cmd]:
    """Namespace, veth pair, addresses and routes of one host (no shaping)."""
    ns = host.netns
    cmds = [
        ["ip", "netns", "add", ns],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        # answer ARP only for addresses on the asking interface: a delayed host also holds
        # the brokers' addresses (on lo, for its proxy) and must not claim them on the bridge
        ["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.conf.all.arp_ignore=1",
         "net.ipv4.conf.all.arp_announce=2"],
        ["ip", "link", "add", host.bridge_if, "type", "veth", "peer", "name", HOST_IF, "netns", ns],
        ["ip", "link", "set", host.bridge_if, "addrgenmode", "none"],
        ["ip", "-n", ns, "link", "set", HOST_IF, "addrgenmode", "none"],
        ["ip", "link", "set", host.bridge_if, "master", plan.bridge, "up"],
        ["ip", "-n", ns, "addr", "add", f"{host.address}/{plan.subnet.prefixlen}", "dev", HOST_IF],
    ]
    if host.alias:
        cmds.append(["ip", "-n", ns, "addr", "add", f"{host.alias}/32", "dev", HOST_IF])
    cmds += [
        ["ip", "-n", ns, "link", "set", HOST_IF, "up"],
        ["ip", "-n", ns, "route", "add", str(plan.alias_subnet), "dev", HOST_IF, "scope", "link"],
    ]
    return cmds


def up_commands(plan: Plan) -> list[Cmd]:
    cmds = bridge_commands(plan)
    for host in plan.hosts:
        cmds += host_commands(plan, host)
        cmds += shaping_commands(host, host.link)
    return cmds


def shaping_commands(host: HostPlan, link: LinkSpec, loss_qdisc: bool = False) -> list[Cmd]:
    """tbf at the root of both ends of the host's veth (host side: upload, bridge side:
    download), or no root qdisc at all for an unshaped link. ``tc qdisc replace`` makes a
    change (degrade, heal) one command per end; removing shaping is ``del`` (which fails
    harmlessly when there is none: run with check=False). With ``loss_qdisc`` (only where
    the kernel has netem) a netem child under the tbf drops ``link.loss_pct`` percent."""
    ends = (["tc", "-n", host.netns], HOST_IF), (["tc"], host.bridge_if)
    cmds: list[Cmd] = []
    for tc, dev in ends:
        if link.rate_bps is None:
            cmds.append([*tc, "qdisc", "del", "dev", dev, "root"])
            continue
        cmds.append([*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", *tbf_params(link.rate_bps).args()])
        if loss_qdisc and link.loss_pct:
            cmds.append([*tc, "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                         "loss", f"{link.loss_pct:g}%"])
    return cmds


def partition_commands(host: HostPlan, cut: bool) -> list[Cmd]:
    """Cut (or restore) the host's bridge port: the port is disabled, so frames in either
    direction are dropped silently, the veth stays up and nothing answers with an error
    (no RST, no ICMP): open connections time out; a new connection from a peer that knew
    the host's MAC times out, one from a peer that did not fails with "No route to host"
    once ARP gives up (about 3 s), as on a pulled cable."""
    state = "0" if cut else "3"  # 0 = disabled, 3 = forwarding (bridge(8))
    return [["bridge", "link", "set", "dev", host.bridge_if, "state", state]]


def down_commands(plan: Plan) -> list[Cmd]:
    """Delete every veth (both ends go), namespace and the bridge; each may already be gone."""
    cmds = [["ip", "link", "del", h.bridge_if] for h in plan.hosts]
    cmds += [["ip", "netns", "del", h.netns] for h in plan.hosts]
    cmds.append(["ip", "link", "del", plan.bridge])
    return cmds
