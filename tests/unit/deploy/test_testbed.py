"""The testbed's pure parts: link specs, names, the address plan, tc and ip commands, config."""

from __future__ import annotations

import ipaddress

import pytest

from edgestream.deploy.testbed.links import LinkSpec, parse_link, tbf_params
from edgestream.deploy.testbed.plan import (
    IFNAMSIZ,
    LINK_RE,
    NETNS_RE,
    check_subnet,
    down_commands,
    host_commands,
    id_hash,
    kind_of,
    make_plan,
    partition_commands,
    shaping_commands,
    up_commands,
)
from edgestream.deploy.testbed.proxy import toxics
from edgestream.job.config import ConfigError, load_config


# --- link specs -----------------------------------------------------------------------
@pytest.mark.parametrize("text, spec", [
    ("", LinkSpec(None)),
    ("10mbit", LinkSpec(10_000_000)),
    ("256kbit", LinkSpec(256_000)),
    ("1gbit", LinkSpec(1_000_000_000)),
    ("1.5mbit", LinkSpec(1_500_000)),
    ("1mbit 80ms", LinkSpec(1_000_000, 80)),
    ("5mbit 40ms 10ms", LinkSpec(5_000_000, 40, 10)),
    ("5MBIT 0.04s 10000us", LinkSpec(5_000_000, 40, 10)),
    ("80ms", LinkSpec(None, 80)),
    ("2mbit 1%", LinkSpec(2_000_000, loss_pct=1)),
    ("2mbit 20ms 0.5%", LinkSpec(2_000_000, 20, loss_pct=0.5)),
])
def test_parse_good_links(text, spec):
    assert parse_link(text) == spec
    assert parse_link(str(spec)) == spec  # the canonical text reads back


@pytest.mark.parametrize("text, message", [
    ("fast", "cannot read 'fast'"),
    ("-1mbit", "negative"),
    ("10 mbits", "write rates as tc does"),
    ("10mbps", "write rates as tc does"),
    ("10", "write rates as tc does"),
    ("0mbit", "outside"),
    ("100gbit", "outside"),
    ("1bit", "outside"),
    ("1mbit 20s", "above"),
    ("1mbit 10ms 20ms", "jitter 20 ms is larger than the delay 10 ms"),
    ("1mbit 1ms 1ms 1ms", "at most two times"),
    ("80ms 1mbit", "must come first"),
    ("1mbit 100%", "partition"),
    ("1mbit 1% 10ms", "before the loss"),
])
def test_parse_bad_links(text, message):
    with pytest.raises(ValueError, match=message):
        parse_link(text)


@pytest.mark.parametrize("rate", [256_000, 1_000_000, 8_000_000, 100_000_000, 1_000_000_000])
def test_tbf_parameters_are_sane_across_rates(rate):
    p = tbf_params(rate)
    assert p.burst_bytes >= 2 * 1514  # a bucket always holds two full frames
    assert p.burst_bytes <= max(2 * 1514, rate / 8 * 0.01)  # bursts above the rate stay short
    assert p.limit_bytes > p.burst_bytes  # a queue beyond one bucket
    assert p.limit_bytes <= p.burst_bytes + rate / 8 * 0.1 + 16 * 1024  # ~100 ms of queue
    assert p.args()[:3] == ["tbf", "rate", f"{rate}bit"]


# --- names and addresses --------------------------------------------------------------
HOSTS = [("w0", "worker", parse_link("8mbit")), ("w1", "worker", LinkSpec()),
         ("server", "server", LinkSpec()), ("devices", "devices", parse_link("1mbit 80ms")),
         ("b0", "broker", LinkSpec()), ("b1", "broker", LinkSpec()), ("b2", "broker", LinkSpec())]


def test_names_fit_ifnamsiz_carry_the_id_and_differ_per_id():
    plan = make_plan("a-very-long-job-name-for-a-testbed-that-keeps-going", HOSTS * 1 + [
        (f"w{i}", "worker", LinkSpec()) for i in range(2, 200)])
    links = [plan.bridge, *(h.bridge_if for h in plan.hosts)]
    assert all(len(name) <= IFNAMSIZ for name in links)
    assert len(set(links)) == len(links)
    assert all(LINK_RE.match(name).group(1) == plan.hash for name in links)
    assert all(NETNS_RE.match(h.netns).group(1) == plan.hash for h in plan.hosts)
    other = make_plan("another-job", HOSTS)
    assert other.hash != plan.hash and id_hash("another-job") == other.hash
    assert not {h.netns for h in other.hosts} & {h.netns for h in plan.hosts}
    assert other.bridge != plan.bridge


def test_address_plan():
    plan = make_plan("job", HOSTS, "10.77.0.0/24")
    assert plan.controller_address == "10.77.0.1"
    assert [h.address for h in plan.hosts] == [f"10.77.0.{i}" for i in range(2, 9)]
    assert plan.alias_subnet == ipaddress.ip_network("10.77.1.0/24")
    assert [h.alias for h in plan.hosts] == [None] * 4 + ["10.77.1.6", "10.77.1.7", "10.77.1.8"]
    assert [h.kind for h in plan.hosts] == ["worker", "worker", "server", "devices", "broker", "broker", "broker"]
    small = make_plan("job", HOSTS[:2], "192.168.50.16/28")
    assert small.alias_subnet == ipaddress.ip_network("192.168.50.32/28")
    assert small.hosts[1].address == "192.168.50.19"


@pytest.mark.parametrize("hosts, subnet, message", [
    (HOSTS, "8.8.8.0/24", "private"),
    (HOSTS, "10.77.0.0/29", "/28 or larger"),
    (HOSTS, "10.77.0.1/24", "host bits"),
    (HOSTS, "fd00::/64", "IPv4"),
    ([(f"w{i}", "worker", LinkSpec()) for i in range(14)], "10.77.0.0/28", "do not fit"),
    ([("w0", "worker", LinkSpec())] * 2, "10.77.0.0/24", "unique"),
    ([("w 0", "worker", LinkSpec())], "10.77.0.0/24", "host name"),
    ([("x", "router", LinkSpec())], "10.77.0.0/24", "kind"),
    ([("b0", "broker", parse_link("1mbit 10ms"))], "10.77.0.0/24", "cannot have a delay"),
    ([], "10.77.0.0/24", "at least one host"),
    ([("w0", "worker", parse_link("1mbit 80ms"))], "10.77.0.0/24", "no broker host"),
])
def test_plan_refuses_bad_input(hosts, subnet, message):
    with pytest.raises(ValueError, match=message):
        make_plan("job", hosts, subnet)


def test_kind_from_name():
    assert [kind_of(n) for n in ("w3", "server", "devices", "b0", "b12", "bx")] == [
        "worker", "server", "devices", "broker", "broker", "worker"]


def test_check_subnet_returns_the_network():
    assert check_subnet("10.77.8.0/24") == ipaddress.ip_network("10.77.8.0/24")


# --- commands -------------------------------------------------------------------------
def test_host_commands_build_namespace_veth_addresses_and_alias_route():
    plan = make_plan("job", HOSTS)
    b0 = plan.host("b0")
    cmds = [" ".join(c) for c in host_commands(plan, b0)]
    ns, br = b0.netns, b0.bridge_if
    assert cmds[0] == f"ip netns add {ns}"
    assert f"ip -n {ns} link set lo up" in cmds
    assert f"ip link add {br} type veth peer name eth0 netns {ns}" in cmds
    assert f"ip link set {br} master {plan.bridge} up" in cmds
    assert f"ip -n {ns} addr add 10.77.0.6/24 dev eth0" in cmds
    assert f"ip -n {ns} addr add 10.77.1.6/32 dev eth0" in cmds
    assert f"ip -n {ns} route add 10.77.1.0/24 dev eth0 scope link" in cmds
    assert not any("default" in c for c in cmds)  # nothing is routed off the machine
    w1 = [" ".join(c) for c in host_commands(plan, plan.host("w1"))]
    assert not any("10.77.1." in c and "addr add" in c for c in w1)  # no alias outside brokers
    assert any("route add 10.77.1.0/24" in c for c in w1)  # but the route to the aliases


def test_shaping_both_ends_with_tbf_and_none_when_unshaped():
    plan = make_plan("job", HOSTS)
    w0 = plan.host("w0")
    cmds = shaping_commands(w0, w0.link)
    assert [c[:4] for c in cmds] == [["tc", "-n", w0.netns, "qdisc"], ["tc", "qdisc", "replace", "dev"]]
    upload, download = cmds
    assert upload[upload.index("dev") + 1] == "eth0" and download[download.index("dev") + 1] == w0.bridge_if
    for cmd in cmds:
        assert cmd[cmd.index("root"):][:3] == ["root", "handle", "1:"]
        assert cmd[cmd.index("rate") + 1] == "8000000bit"
    unshaped = shaping_commands(w0, LinkSpec())
    assert [c[-4:] for c in unshaped] == [["del", "dev", "eth0", "root"], ["del", "dev", w0.bridge_if, "root"]]
    lossy = shaping_commands(w0, parse_link("8mbit 1%"), loss_qdisc=True)
    assert any("netem" in c and "1%" in c for c in lossy)


def test_up_partition_and_down_commands():
    plan = make_plan("job", HOSTS)
    up = up_commands(plan)
    assert up[0][:4] == ["ip", "link", "add", plan.bridge]
    assert ["ip", "addr", "add", "10.77.0.1/24", "dev", plan.bridge] in up
    assert sum(c[:3] == ["ip", "netns", "add"] for c in up) == len(HOSTS)
    w0 = plan.host("w0")
    assert partition_commands(w0, cut=True) == [["bridge", "link", "set", "dev", w0.bridge_if, "state", "0"]]
    assert partition_commands(w0, cut=False)[0][-1] == "3"
    down = down_commands(plan)
    assert down[-1] == ["ip", "link", "del", plan.bridge]
    assert {c[-1] for c in down} == {plan.bridge, *(h.bridge_if for h in plan.hosts), *(h.netns for h in plan.hosts)}


def test_proxy_toxics_split_the_delay():
    assert toxics(LinkSpec(1_000_000)) == []
    up, down = toxics(parse_link("1mbit 80ms 10ms"))
    assert {up["stream"], down["stream"]} == {"upstream", "downstream"}
    assert up["attributes"] == down["attributes"] == {"latency": 40, "jitter": 5}


# --- config ---------------------------------------------------------------------------
def test_testbed_section_from_toml_flags_and_env(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[workers]\ncount = 2\n[testbed]\nbrokers = 3\ndefault_link = "10mbit"\n'
                   '[testbed.links]\nw1 = "1mbit 80ms"\n')
    cfg = load_config(job, ["testbed.links.devices=5mbit"], env={"EDGESTREAM__TESTBED__LINKS__W0": "2mbit"})
    tb = cfg.testbed
    assert tb.enabled and tb.brokers == 3 and tb.subnet == "10.77.0.0/24"
    assert tb.links == {"w1": "1mbit 80ms", "w0": "2mbit", "devices": "5mbit"}
    assert not load_config(env={}).testbed.enabled  # no [testbed] table: off
    job.write_text("[testbed]\nenabled = false\n")
    assert not load_config(job, env={}).testbed.enabled


def test_testbed_section_survives_the_json_handed_to_workers(tmp_path):
    from edgestream.job.config import dump_config

    cfg = load_config(overrides=["workers.count=2", "testbed.enabled=true", "testbed.links.w1=1mbit"], env={})
    path = tmp_path / "job.json"
    path.write_text(dump_config(cfg))
    assert load_config(path, env={}).testbed == cfg.testbed


def test_for_job_hosts_and_links():
    from edgestream.deploy.testbed import Testbed

    cfg = load_config(overrides=["workers.count=2", "testbed.brokers=3", "testbed.default_link=10mbit",
                                 "testbed.links.w1=1mbit 80ms", "testbed.links.b2=100mbit",
                                 "job.name=tbjob"], env={})
    bed = Testbed.for_job(cfg)
    assert list(bed.hosts) == ["w0", "w1", "server", "devices", "b0", "b1", "b2"]
    assert {n: str(h.link) for n, h in bed.hosts.items()} == {
        "w0": "10mbit", "w1": "1mbit 80ms", "server": "10mbit", "devices": "10mbit",
        "b0": "", "b1": "", "b2": "100mbit"}
    assert bed.exec_prefix("w1") == ["ip", "netns", "exec", bed.hosts["w1"].netns]
    assert bed.broker_alias("b1") == "10.77.1.7" and bed.controller_address == "10.77.0.1"
    assert str(bed.state_dir).endswith(".edgestream/testbed/tbjob")


@pytest.mark.parametrize("override, message", [
    ("testbed.links.w5=1mbit", "names w5, not hosts of this job; hosts: w0, server, devices, b0"),
    ("testbed.links.w0=fast", "testbed.links.w0: link 'fast'"),
    ("testbed.default_link=10 mbits", "testbed.default_link"),
    ("testbed.links.b0=1mbit 10ms", "cannot have a delay"),
    ("testbed.brokers=2", "1 or 3"),
    ("testbed.subnet=8.8.8.0/24", "private"),
    ("testbed.links=w0", "table of name = value"),
    ("buffer.capacity.x=1", "only table keys"),
])
def test_testbed_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override], env={})
