"""The edge testbed on the real kernel: namespaces, shaped veths, partition, proxy delay, teardown.

Needs root (network namespaces); without it every test here FAILS with the reason (no
skip). The first run builds Toxiproxy with `go install` (about a minute, once; cached).
Nothing here asserts wall time: shaping is checked from tc's own counters, delay from the
proxy's toxics and a lower bound on a round trip.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from edgestream.deploy.testbed import (
    LinkSpec,
    Testbed,
    TestbedError,
    down_by_id,
    leftovers,
    parse_link,
)
from edgestream.deploy.testbed.proxy import is_proxy_pid
from edgestream.deploy.testbed.system import NeedsRoot, need_root, netns_list, root_links
from edgestream.deploy.testbed.testbed import free_subnet

SINK = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    n = 0
    while chunk := c.recv(65536):
        n += len(chunk)
    c.sendall(str(n).encode())
    c.close()
"""
SEND = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
s.sendall(b"x" * int(sys.argv[3]))
s.shutdown(socket.SHUT_WR)
print(s.recv(100).decode())
"""
ECHO = """
import socket, threading
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9092))
s.listen()
print("ready", flush=True)
def serve(c):
    while data := c.recv(65536):
        c.sendall(data)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""
PORT = 5001
MB2 = 2_000_000


@pytest.fixture
def testbed_id() -> str:
    return f"it-{uuid.uuid4().hex[:8]}"


def require_root() -> None:
    """Not root (no CAP_NET_ADMIN): the test fails, saying so (never a skip)."""
    try:
        need_root()
    except NeedsRoot as exc:
        pytest.fail(f"the testbed tests need root: {exc}")


@pytest.fixture
def subnet() -> str:
    return free_subnet(rng=random.Random())


def start_in(bed: Testbed, host: str, script: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([*bed.exec_prefix(host), sys.executable, "-c", script, *args],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def send(bed: Testbed, host: str, to: str, size: int) -> int:
    out = subprocess.run([*bed.exec_prefix(host), sys.executable, "-c", SEND, to, str(PORT), str(size)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def in_host(bed: Testbed, host: str, fn):
    """Run ``fn()`` in a thread that entered ``host`` (Testbed.enter); its result or exception."""
    result: dict = {}

    def target():
        try:
            bed.enter(host)
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(60)
    if "error" in result:
        raise result["error"]
    return result["value"]


def connect_outcome(address: str, port: int, timeout: float) -> str:
    try:
        socket.create_connection((address, port), timeout=timeout).close()
        return "connected"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return f"error: {exc.strerror}"


def round_trip_ms(address: str, port: int, rounds: int = 5) -> float:
    with socket.create_connection((address, port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            s.sendall(b"ping")
            got = b""
            while len(got) < 4:
                got += s.recv(4 - len(got))
            times.append((time.perf_counter() - start) * 1000)
    return min(times)


def nothing_left(bed: Testbed) -> list[str]:
    names = set(netns_list()) | set(root_links())
    mine = [bed.plan.bridge, *(h.bridge_if for h in bed.plan.hosts), *(h.netns for h in bed.plan.hosts)]
    return [n for n in mine if n in names] + [f"pid {p}" for p in bed.proxies.values() if is_proxy_pid(p)]


def test_hosts_links_faults_and_teardown(testbed_id, subnet, tmp_path):
    require_root()
    hosts = [("w0", "worker", parse_link("8mbit")), ("w1", "worker", parse_link("1gbit")),
             ("b0", "broker", LinkSpec())]
    bed = Testbed(testbed_id, hosts, subnet, state_dir=tmp_path / "tb").up()
    procs = []
    try:
        w0, w1, b0 = (bed.host(n) for n in ("w0", "w1", "b0"))
        with pytest.raises(TestbedError, match="already up"):
            Testbed(testbed_id, hosts, subnet, state_dir=tmp_path / "tb").up()

        # reachable, and the bytes went through w0's 8 Mbit/s tbf (upload), which held
        # packets back; the 1 Gbit/s tbf of w1 never had to
        procs.append(start_in(bed, "w1", SINK, str(PORT)))
        assert send(bed, "w0", w1.address, MB2) == MB2
        status = {h["name"]: h for h in bed.status()["hosts"]}
        assert status["w0"]["upload"]["kind"] == status["w0"]["download"]["kind"] == "tbf"
        assert status["w0"]["upload"]["rate_bps"] == status["w0"]["download"]["rate_bps"] == 8_000_000
        assert status["w0"]["upload"]["bytes"] >= MB2
        assert status["w0"]["upload"]["overlimits"] > 0
        assert status["w1"]["download"]["bytes"] >= MB2
        assert status["w1"]["download"]["overlimits"] == status["w1"]["upload"]["overlimits"] == 0
        assert status["b0"]["upload"]["kind"] == "noqueue"  # unshaped

        # partition: a connect to the cut host gets no answer (no RST), heal: it works again
        bed.fault("w1", "partition")
        assert bed.status()["faults"] == {"w1": {"partitioned": True, "link": None}}
        start = time.monotonic()
        outcome = in_host(bed, "w0", lambda: connect_outcome(w1.address, PORT, timeout=2.0))
        assert outcome in ("timeout", "error: No route to host"), outcome
        assert time.monotonic() - start < 10
        bed.fault("w1", "heal")
        assert bed.status()["faults"] == {}
        assert send(bed, "w0", w1.address, 100_000) == 100_000

        # degrade with a delay: w0's proxy fronts b0 (its advertised address, on w0's lo)
        procs.append(start_in(bed, "b0", ECHO))
        assert in_host(bed, "w0", lambda: round_trip_ms(b0.address, 9092)) < 40  # no proxy yet
        bed.fault("w0", "degrade", parse_link("4mbit 60ms 4ms"))
        status = {h["name"]: h for h in bed.status()["hosts"]}
        proxy = status["w0"]["proxy"]
        assert proxy["alive"] and is_proxy_pid(proxy["pid"])
        route = proxy["proxies"]["b0"]
        assert route["listen"] == f"{b0.address}:9092" and route["upstream"] == f"{bed.broker_alias('b0')}:9092"
        assert {(t["stream"], t["attributes"]["latency"], t["attributes"]["jitter"]) for t in route["toxics"]} == {
            ("upstream", 30, 2), ("downstream", 30, 2)}
        assert status["w0"]["upload"]["rate_bps"] == 4_000_000 and status["w0"]["in_force"] == "4mbit 60ms 4ms"
        assert in_host(bed, "w0", lambda: round_trip_ms(b0.address, 9092)) >= 60 - 4
        # w1 has no proxy: straight to the broker
        assert "proxy" not in status["w1"]
        assert in_host(bed, "w1", lambda: round_trip_ms(b0.address, 9092)) < 40
        bed.fault("w0", "heal")  # back to 8mbit without delay; the proxy stays, toxics gone
        status = {h["name"]: h for h in bed.status()["hosts"]}
        assert status["w0"]["proxy"]["proxies"]["b0"]["toxics"] == []
        assert status["w0"]["upload"]["rate_bps"] == 8_000_000
    finally:
        removed = bed.down()
        for proc in procs:
            proc.wait(10)  # down stopped them: they ran in the testbed's namespaces
    assert f"link:{bed.plan.bridge}" in removed
    assert nothing_left(bed) == []
    assert not (tmp_path / "tb" / "testbed.json").exists()
    assert bed.down() == []  # twice is fine


def test_crashed_testbed_is_found_and_removed(testbed_id, subnet, tmp_path):
    """A testbed whose owner died (state file left, object gone), then one with no state file."""
    require_root()
    hosts = [("w0", "worker", parse_link("1mbit 80ms")), ("b0", "broker", LinkSpec())]
    bed = Testbed(testbed_id, hosts, subnet, state_dir=tmp_path / "tb").up()
    try:
        pid = bed.proxies["w0"]
        assert is_proxy_pid(pid)
        expected = {f"netns:{h.netns}" for h in bed.plan.hosts} | {f"link:{bed.plan.bridge}", f"process:{pid}"}
        del bed  # "crash"
        assert expected <= set(leftovers())
        status = Testbed.load(tmp_path / "tb").status()  # from the state file
        assert status["up"] and status["hosts"][0]["proxy"]["alive"]
        removed = down_by_id(testbed_id, tmp_path / "tb")
        assert f"process:{pid}" in removed and not is_proxy_pid(pid)
        assert not expected & set(leftovers())

        # no state file at all: by name prefix
        bed = Testbed(f"{testbed_id}-b", [("w0", "worker", LinkSpec())], subnet, state_dir=tmp_path / "tb2").up()
        (tmp_path / "tb2" / "testbed.json").unlink()
        assert f"netns:{bed.host('w0').netns}" in leftovers()
        assert f"netns:{bed.host('w0').netns}" in down_by_id(f"{testbed_id}-b", tmp_path / "tb2")
        assert nothing_left(bed) == []
    finally:
        down_by_id(testbed_id, tmp_path / "tb")
        down_by_id(f"{testbed_id}-b", tmp_path / "tb2")


def test_cli_without_privileges_says_root_is_needed(testbed_id):
    assert shutil.which("setpriv"), "needs setpriv (util-linux) to drop privileges"
    out = subprocess.run(["setpriv", "--bounding-set", "-net_admin,-sys_admin", sys.executable, "-m", "edgestream",
                          "testbed", "status"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "needs root" in out.stderr and "run as root or with sudo" in out.stderr
