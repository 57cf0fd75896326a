"""The edge testbed: hosts as network namespaces on one bridge, shaped links, faults.

See ``deploy.testbed.plan`` for the layout and ``deploy.testbed.proxy`` for delay. Every
change is recorded in ``<state_dir>/testbed.json`` so that ``down`` and ``status`` work
from another process, and after a crash (or, without the file, by name prefix).
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from edgestream.deploy.testbed import proxy
from edgestream.deploy.testbed.links import LinkSpec, parse_link
from edgestream.deploy.testbed.plan import (
    BROKER_PORT,
    HOST_IF,
    LINK_RE,
    NETNS_RE,
    HostPlan,
    Plan,
    alias_subnet_of,
    bridge_commands,
    down_commands,
    host_commands,
    id_hash,
    kind_of,
    make_plan,
    partition_commands,
    shaping_commands,
)
from edgestream.deploy.testbed.system import (
    TestbedError,
    need_root,
    netns_list,
    netns_pids,
    root_addresses,
    root_links,
    run,
    run_json,
    setns,
    stop_pids,
)
from edgestream.deploy.testbed.system import (
    leftovers as _leftovers,
)

STATE_FILE = "testbed.json"
DEFAULT_STATE_ROOT = Path(".edgestream/testbed")
#: Serialises the subnet check and bridge creation of concurrent `up`s on one machine.
LOCK_FILE = Path("/run/lock/edgestream-testbed.lock")
FAULT_ACTIONS = ("partition", "heal", "degrade")
#: In the state dir: serialises faults of one testbed across processes.
FAULT_LOCK = ".fault.lock"


@dataclass(frozen=True)
class Host:
    name: str
    kind: str  # worker | server | devices | broker
    netns: str
    address: str
    link: LinkSpec


def default_state_dir(testbed_id: str) -> Path:
    return DEFAULT_STATE_ROOT / testbed_id


_netem: bool | None = None


def netem_available() -> bool:
    """Whether this kernel has netem (probed once, in a scratch namespace)."""
    global _netem
    if _netem is None:
        scratch = f"edgestream-probe-{os.getpid()}"
        try:
            run(["ip", "netns", "add", scratch])
            run(["ip", "-n", scratch, "link", "add", "probe0", "type", "dummy"])
            _netem = run(["tc", "-n", scratch, "qdisc", "add", "dev", "probe0", "root", "netem", "delay", "1ms"],
                         check=False).returncode == 0
        except TestbedError:
            _netem = False
        finally:
            run(["ip", "netns", "del", scratch], check=False)
    return _netem


class Testbed:
    """Hosts (name, kind, link) as network namespaces on a bridge; see the module docs."""

    __test__ = False  # not a pytest test class

    def __init__(self, testbed_id: str, hosts: list[tuple[str, str, LinkSpec]], subnet: str = "10.77.0.0/24",
                 state_dir: Path | None = None) -> None:
        try:
            self.plan: Plan = make_plan(testbed_id, hosts, subnet)
        except ValueError as exc:
            raise TestbedError(str(exc)) from None
        self.testbed_id = testbed_id
        self.subnet = subnet
        self.state_dir = Path(state_dir) if state_dir is not None else default_state_dir(testbed_id)
        self.hosts: dict[str, Host] = {
            h.name: Host(h.name, h.kind, h.netns, h.address, h.link) for h in self.plan.hosts
        }
        self.controller_address = self.plan.controller_address
        self.faults: dict[str, dict] = {}  # host -> {"partitioned": bool, "link": str | None}
        self.proxies: dict[str, int] = {}  # host -> pid of its Toxiproxy

    # --- construction -------------------------------------------------------------------
    @classmethod
    def for_job(cls, cfg) -> Testbed:
        """The testbed of a job: its workers, "server", "devices" and brokers b0..b{n-1}.

        ``cfg.testbed.default_link`` shapes worker, server and devices hosts not listed in
        ``cfg.testbed.links``; broker hosts are unshaped unless listed."""
        section = cfg.testbed
        default = parse_link(section.default_link)
        names = [*cfg.worker_names(), "server", "devices", *(f"b{i}" for i in range(section.brokers))]
        hosts = []
        for name in names:
            kind = kind_of(name)
            if name in section.links:
                link = parse_link(section.links[name])
            else:
                link = LinkSpec() if kind == "broker" else default
            hosts.append((name, kind, link))
        return cls(cfg.job.name, hosts, section.subnet)

    @classmethod
    def load(cls, state_dir: Path) -> Testbed:
        """The testbed recorded in ``state_dir`` (TestbedError if there is none)."""
        path = Path(state_dir) / STATE_FILE
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            raise TestbedError(f"no testbed state in {state_dir} (is it up? `edgestream testbed status` "
                               "lists leftovers)") from None
        hosts = [(h["name"], h["kind"], parse_link(h["link"])) for h in state["hosts"]]
        bed = cls(state["id"], hosts, state["subnet"], state_dir)
        bed.faults = state.get("faults", {})
        bed.proxies = {k: int(v) for k, v in state.get("proxies", {}).items()}
        return bed

    def _save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "id": self.testbed_id, "hash": self.plan.hash, "subnet": self.subnet,
            "bridge": self.plan.bridge, "controller_address": self.controller_address,
            "hosts": [{"name": h.name, "kind": h.kind, "netns": h.netns, "address": h.address,
                       "alias": h.alias, "bridge_if": h.bridge_if, "link": str(h.link)} for h in self.plan.hosts],
            "faults": self.faults, "proxies": self.proxies,
        }
        tmp = self.state_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_dir / STATE_FILE)

    # --- access ---------------------------------------------------------------------------
    def host(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise TestbedError(f"no host {name!r} in testbed {self.testbed_id}; hosts: "
                               f"{', '.join(self.hosts)}") from None

    def exec_prefix(self, name: str) -> list[str]:
        """The command prefix that runs a program inside host ``name``."""
        return ["ip", "netns", "exec", self.host(name).netns]

    def enter(self, name: str) -> None:
        """Move the CALLING THREAD into host ``name``'s network namespace (setns(2)).

        Only this thread moves; threads it starts afterwards inherit the namespace, others
        (and sockets made before) stay where they were. There is no way back but entering
        another namespace: do it in a thread made for the purpose."""
        setns(self.host(name).netns)

    def broker_alias(self, name: str) -> str:
        """The second address of broker host ``name`` (alias subnet), where proxies forward to."""
        alias = self._plan_host(name).alias
        if alias is None:
            raise TestbedError(f"host {name} is not a broker host (brokers: "
                               f"{', '.join(h.name for h in self.plan.brokers) or 'none'})")
        return alias

    def link_in_force(self, name: str) -> LinkSpec:
        fault = self.faults.get(name) or {}
        return parse_link(fault["link"]) if fault.get("link") is not None else self.host(name).link

    def _plan_host(self, name: str) -> HostPlan:
        self.host(name)
        return self.plan.host(name)

    # --- up / down ---------------------------------------------------------------------
    def up(self) -> Testbed:
        """Create every namespace, link, address, qdisc and proxy; TestbedError if this
        testbed is already up or its subnet is taken. Undoes what it made if it fails."""
        need_root()
        links = [h.link for h in self.plan.hosts]
        if any(link.loss_pct for link in links) and not netem_available():
            lossy = [h.name for h in self.plan.hosts if h.link.loss_pct]
            raise TestbedError(f"packet loss on {', '.join(lossy)} needs the kernel's netem qdisc, which this "
                               "kernel does not have (and a TCP proxy cannot drop packets): drop the loss % "
                               "from the link, or cut the host with `edgestream testbed fault HOST partition`")
        if any(h.link.delayed for h in self.plan.hosts if h.kind != "broker") and self.plan.brokers:
            proxy.ensure_binary()  # before anything exists: the first build takes a minute
        LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
        with open(LOCK_FILE, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._refuse_if_taken()
            try:
                self._save()  # first: a crash from here on leaves a state file for `down`
                for cmd in bridge_commands(self.plan):
                    run(cmd)
                for host in self.plan.hosts:
                    for cmd in host_commands(self.plan, host):
                        run(cmd)
                    self._apply_shaping(host, host.link)
            except BaseException:
                self.down()
                raise
        try:
            for host in self.plan.hosts:
                self._sync_proxy(host)
            self._save()
        except BaseException:
            self.down()
            raise
        return self

    def _refuse_if_taken(self) -> None:
        mine = _leftovers(self.plan.hash)
        if mine or (self.state_dir / STATE_FILE).exists():
            found = (f"{sum(e.startswith('netns:') for e in mine)} namespaces, "
                     f"{sum(e.startswith('link:') for e in mine)} links with its prefix edgestream-"
                     f"{self.plan.hash}-/{self.plan.bridge[:-2]}" if mine else f"state file {self.state_dir / STATE_FILE}")
            raise TestbedError(f"testbed {self.testbed_id} is already up (found {found}): take it down first "
                               f"with `edgestream testbed down --job <its job file>` (or "
                               f"`edgestream testbed down --all`)")
        wanted = [self.plan.subnet, self.plan.alias_subnet]
        for ifname, address, prefixlen in root_addresses():
            net = ipaddress.ip_network(f"{address}/{prefixlen}", strict=False)
            if any(net.overlaps(w) for w in wanted):
                raise TestbedError(f"subnet {self.plan.subnet} (or its broker alias block {self.plan.alias_subnet}) "
                                   f"overlaps {address}/{prefixlen} on {ifname} (another testbed?): set another "
                                   "testbed.subnet, e.g. --set testbed.subnet=10.77.8.0/24")

    def down(self) -> list[str]:
        """Remove everything this testbed made (processes left in its hosts included, the
        proxies first); returns what was removed. Safe to call twice or after a crash."""
        need_root()
        return _teardown(self.plan.hash, self.plan, self.state_dir)

    # --- shaping, proxies, faults ---------------------------------------------------------
    def _apply_shaping(self, host: HostPlan, link: LinkSpec) -> None:
        if link.loss_pct and not netem_available():
            raise TestbedError(f"packet loss on {host.name} needs the kernel's netem qdisc, which this kernel "
                               "does not have: leave the loss % out, or use `partition` for a total cut")
        for cmd in shaping_commands(host, link, loss_qdisc=bool(link.loss_pct)):
            # deleting a root qdisc that is not there fails harmlessly
            run(cmd, check=cmd[cmd.index("qdisc") + 1] != "del")

    def _sync_proxy(self, host: HostPlan) -> None:
        """Start, configure or retune host's proxy for the link in force (no proxy while
        the host has never been delayed; a proxy once started stays, with no toxics)."""
        link = self.link_in_force(host.name)
        if host.kind == "broker" or not self.plan.brokers:
            return
        if host.name not in self.proxies:
            if not link.delayed:
                return
            for broker in self.plan.brokers:
                run(["ip", "-n", host.netns, "addr", "replace", f"{broker.address}/32", "dev", "lo"])
            pid = proxy.start(host.netns, self.state_dir / f"toxiproxy-{host.name}.log")
            self.proxies[host.name] = pid
            self._save()
            routes = [(b.name, f"{b.address}:{BROKER_PORT}", f"{b.alias}:{BROKER_PORT}") for b in self.plan.brokers]
            proxy.configure(host.netns, routes, link)
        else:
            proxy.set_link(host.netns, link)

    def fault(self, name: str, action: str, spec: LinkSpec | None = None) -> None:
        """``partition``: cut the host's bridge port (silent drops both ways); ``heal``:
        reconnect it and restore its configured link; ``degrade``: replace its rate (both
        directions) and delay (proxy toxics) by ``spec`` at once, partition unchanged."""
        need_root()
        host = self._plan_host(name)
        if action not in FAULT_ACTIONS:
            raise TestbedError(f"fault {action!r} is not one of {', '.join(FAULT_ACTIONS)}")
        if not (self.state_dir / STATE_FILE).exists() or host.netns not in netns_list():
            raise TestbedError(f"testbed {self.testbed_id} is not up: `edgestream testbed up --job ...` first")
        with open(self.state_dir / FAULT_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process (the CLI, a run) may change faults too
            self._reload()
            self._fault(host, action, spec)

    def _reload(self) -> None:
        """Faults and proxies as the state file has them (another process may have changed them)."""
        try:
            state = json.loads((self.state_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return
        self.faults = state.get("faults", {})
        self.proxies = {k: int(v) for k, v in state.get("proxies", {}).items()}

    def _fault(self, host: HostPlan, action: str, spec: LinkSpec | None) -> None:
        name = host.name
        fault = dict(self.faults.get(name) or {"partitioned": False, "link": None})
        if action == "partition":
            for cmd in partition_commands(host, cut=True):
                run(cmd)
            fault["partitioned"] = True
        elif action == "heal":
            for cmd in partition_commands(host, cut=False):
                run(cmd)
            fault = {"partitioned": False, "link": None}
            self._set_fault(name, fault)
            self._apply_shaping(host, host.link)
            self._sync_proxy(host)
        else:
            if spec is None:
                raise TestbedError("degrade needs a link, e.g. \"1mbit 80ms\"")
            if host.kind == "broker" and spec.delayed:
                raise TestbedError(f"broker host {name}: delay is added in front of the brokers, in the client "
                                   "hosts; degrade a worker or devices host with a delay instead")
            if spec.delayed and not self.plan.brokers:
                raise TestbedError("a delay needs broker hosts in the testbed (the proxy sits in front of them)")
            self._apply_shaping(host, spec)
            fault["link"] = str(spec)
            self._set_fault(name, fault)
            self._sync_proxy(host)
        self._set_fault(name, fault)

    def _set_fault(self, name: str, fault: dict) -> None:
        if fault.get("partitioned") or fault.get("link") is not None:
            self.faults[name] = fault
        else:
            self.faults.pop(name, None)
        self._save()

    # --- status ---------------------------------------------------------------------------
    def status(self) -> dict:
        """Hosts with address, configured link, link in force (faults and proxies as the state
        file has them), tc qdiscs as read back (both ends), partition state, proxy (pid,
        toxics); ``leftovers``: whatever else with
        the testbed prefix is on the machine (other testbeds, crashed ones, stray proxies)."""
        need_root()
        self._reload()
        present = set(netns_list())
        links = set(root_links())
        hosts = []
        for h in self.plan.hosts:
            entry = {
                "name": h.name, "kind": h.kind, "netns": h.netns, "address": h.address, "alias": h.alias,
                "bridge_if": h.bridge_if, "link": str(h.link), "in_force": str(self.link_in_force(h.name)),
                "up": h.netns in present and h.bridge_if in links,
                "partitioned": bool((self.faults.get(h.name) or {}).get("partitioned")),
            }
            if entry["up"]:
                entry["upload"] = read_qdisc(["tc", "-n", h.netns], HOST_IF)
                entry["download"] = read_qdisc(["tc"], h.bridge_if)
                entry["port_state"] = bridge_port_state(h.bridge_if)
            if h.name in self.proxies:
                pid = self.proxies[h.name]
                entry["proxy"] = {"pid": pid, "alive": proxy.is_proxy_pid(pid)}
                if entry["proxy"]["alive"]:
                    try:
                        entry["proxy"]["proxies"] = proxy.listed(h.netns)
                    except (OSError, TestbedError) as exc:
                        entry["proxy"]["error"] = str(exc)
            hosts.append(entry)
        return {
            "id": self.testbed_id, "bridge": self.plan.bridge, "subnet": str(self.plan.subnet),
            "alias_subnet": str(self.plan.alias_subnet), "controller_address": self.controller_address,
            "up": self.plan.bridge in links, "state_file": str(self.state_dir / STATE_FILE),
            "hosts": hosts, "faults": self.faults,
            "leftovers": [e for e in leftovers() if e not in self._own_entries()],
        }

    def _own_entries(self) -> set[str]:
        own = {f"link:{self.plan.bridge}"}
        for h in self.plan.hosts:
            own |= {f"netns:{h.netns}", f"link:{h.bridge_if}"}
        own |= {f"process:{pid}" for pid in self.proxies.values()}
        return own


def read_qdisc(tc: list[str], dev: str) -> dict:
    """The root qdisc of ``dev`` as tc reports it: kind, rate/burst/limit (tbf), counters."""
    for q in run_json([*tc, "-s", "-j", "qdisc", "show", "dev", dev]):
        if q.get("root"):
            options = q.get("options", {})
            out = {"kind": q["kind"]}
            if "rate" in options:  # tc reports bytes per second
                out["rate_bps"] = int(options["rate"]) * 8
            for key in ("burst", "limit", "lat"):
                if key in options:
                    out[key] = options[key]
            for key in ("bytes", "packets", "drops", "overlimits", "requeues"):
                if key in q:
                    out[key] = q[key]
            return out
    return {"kind": "none"}


def bridge_port_state(dev: str) -> str:
    for entry in run_json(["bridge", "-j", "link", "show", "dev", dev]):
        return str(entry.get("state", "?"))
    return "?"


def _teardown(hash_: str, plan: Plan | None, state_dir: Path | None) -> list[str]:
    """Stop processes in the testbed's namespaces (proxies included), delete its veths,
    namespaces and bridge (those of ``plan`` and any found by the id-hash prefix), and its
    state file. Returns what was removed."""
    removed: list[str] = []
    state = {}
    if state_dir is not None and (state_dir / STATE_FILE).exists():
        try:
            state = json.loads((state_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            state = {}
    proxies = [int(p) for p in state.get("proxies", {}).values() if proxy.is_proxy_pid(int(p))]
    namespaces = {h.netns for h in plan.hosts} if plan else set()
    namespaces |= {n.split(":", 1)[1] for n in _leftovers(hash_) if n.startswith("netns:")}
    present = set(netns_list())
    pids = set(proxies)
    for ns in namespaces & present:
        pids |= set(netns_pids(ns))
    pids.discard(os.getpid())
    for pid in stop_pids(sorted(pids)):
        removed.append(f"process:{pid}")
    cmds = down_commands(plan) if plan else []
    for entry in _leftovers(hash_):
        kind, name = entry.split(":", 1)
        cmd = ["ip", "link", "del", name] if kind == "link" else ["ip", "netns", "del", name]
        if cmd not in cmds:
            cmds.insert(0 if kind == "link" else len(cmds), cmd)
    links = set(root_links())
    for cmd in cmds:
        target = cmd[-1]
        exists = target in links if cmd[1] == "link" else target in present
        if exists and run(cmd, check=False).returncode == 0:
            removed.append(f"{cmd[1]}:{target}")
    if state_dir is not None:
        for name in (STATE_FILE, STATE_FILE + ".tmp", FAULT_LOCK):
            (state_dir / name).unlink(missing_ok=True)
    still = _leftovers(hash_)
    if still:
        raise TestbedError(f"could not remove {', '.join(still)}: a process may still hold a namespace "
                           "(`ip netns pids NAME`); stop it and run `edgestream testbed down` again")
    return removed


def leftovers() -> list[str]:
    """Everything with the testbed prefix on this machine: namespaces, links, and the
    Toxiproxy processes of the cached binary."""
    found = _leftovers()
    for pid_dir in Path("/proc").iterdir():
        if pid_dir.name.isdigit() and proxy.is_proxy_pid(int(pid_dir.name)):
            found.append(f"process:{pid_dir.name}")
    return found


def down_by_id(testbed_id: str, state_dir: Path | None = None) -> list[str]:
    """Take down testbed ``testbed_id`` from its state file (default location unless given)
    or, without one, by its name prefix."""
    need_root()
    state_dir = Path(state_dir) if state_dir is not None else default_state_dir(testbed_id)
    plan = None
    if (state_dir / STATE_FILE).exists():
        try:
            plan = Testbed.load(state_dir).plan
        except (TestbedError, ValueError, KeyError):
            plan = None
    return _teardown(id_hash(testbed_id), plan, state_dir)


def down_all() -> list[str]:
    """Take down every testbed on the machine (by prefix), and stray proxies."""
    need_root()
    hashes = set()
    for entry in _leftovers():
        name = entry.split(":", 1)[1]
        m = NETNS_RE.match(name) or LINK_RE.match(name)
        if m:
            hashes.add(m.group(1))
    removed = []
    for h in sorted(hashes):
        removed += _teardown(h, None, None)
    strays = [int(e.split(":")[1]) for e in leftovers() if e.startswith("process:")]
    removed += [f"process:{p}" for p in stop_pids(strays)]
    return removed


def free_subnet(first: str = "10.77.0.0/24", tries: int = 64, rng=None) -> str:
    """A subnet like ``first`` whose block and alias block (the next one) no interface in
    the root namespace uses: ``first``, then every second block after it (two blocks per
    testbed), in random order with ``rng`` (a ``random.Random``) for concurrent tests.
    ``up`` still refuses one taken in the meantime."""
    base = ipaddress.ip_network(first)
    used = [ipaddress.ip_network(f"{a}/{p}", strict=False) for _, a, p in root_addresses()]
    candidates = []
    for k in range(tries):
        start = int(base.network_address) + 2 * k * base.num_addresses
        net = ipaddress.ip_network((start, base.prefixlen))
        if net.is_private and alias_subnet_of(net).is_private:
            candidates.append(net)
    if rng is not None:
        rng.shuffle(candidates)
    for net in candidates:
        if not any(u.overlaps(net) or u.overlaps(alias_subnet_of(net)) for u in used):
            return str(net)
    raise TestbedError(f"no free testbed subnet among {tries} blocks from {first}: take old testbeds down "
                       "(`edgestream testbed down --all`)")


def wait_until(condition, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``condition`` until it is true or ``timeout_s`` passed; its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
