"""Running the planned commands, and what the machine has: privileges, leftovers, netns entry."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from edgestream.deploy.kafka.broker import pid_alive
from edgestream.deploy.testbed.plan import LINK_RE, NETNS_RE, Cmd

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21


class TestbedError(RuntimeError):
    """The testbed cannot do what was asked; the message says what to do."""

    __test__ = False  # not a pytest test class


class NeedsRoot(TestbedError):
    """This process may not create namespaces and links (not root), or iproute2 is missing."""


def need_root() -> None:
    """TestbedError unless this process may create namespaces and links."""
    caps = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                caps = int(line.split()[1], 16)
    except OSError:
        pass
    if not (caps >> _CAP_NET_ADMIN & 1 and caps >> _CAP_SYS_ADMIN & 1):
        raise NeedsRoot("the testbed needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN to create network "
                           "namespaces, links and qdiscs): run as root or with sudo")
    for tool in ("ip", "tc", "bridge"):
        if not _which(tool):
            raise NeedsRoot(f"`{tool}` is not installed: install iproute2 (apt-get install iproute2, "
                               "or scripts/system-deps.sh)")


def _which(tool: str) -> bool:
    from shutil import which

    return which(tool) is not None


def run(cmd: Cmd, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise TestbedError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def run_json(cmd: Cmd) -> list:
    proc = run(cmd, check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        return []
    return json.loads(proc.stdout)


def netns_list() -> list[str]:
    """Every namespace name ``ip netns`` knows."""
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir())
    except FileNotFoundError:
        return []


def root_links() -> list[str]:
    return [entry["ifname"] for entry in run_json(["ip", "-j", "link", "show"])]


def root_addresses() -> list[tuple[str, str, int]]:
    """(interface, address, prefix length) of every IPv4 address in the root namespace."""
    out = []
    for entry in run_json(["ip", "-j", "-4", "addr", "show"]):
        for info in entry.get("addr_info", []):
            out.append((entry["ifname"], info["local"], int(info["prefixlen"])))
    return out


def leftovers(hash_: str | None = None) -> list[str]:
    """Namespaces (``netns:NAME``) and root-namespace links (``link:NAME``) with the
    testbed prefix, of one testbed (its id hash) or of all of them."""
    found = [f"netns:{n}" for n in netns_list()
             if (m := NETNS_RE.match(n)) and (hash_ is None or m.group(1) == hash_)]
    found += [f"link:{n}" for n in root_links()
              if (m := LINK_RE.match(n)) and (hash_ is None or m.group(1) == hash_)]
    return found


def netns_pids(netns: str) -> list[int]:
    proc = run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def stop_pids(pids: list[int], timeout_s: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL whatever is left at the deadline; returns the pids signalled."""
    signalled = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            signalled.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in signalled) and time.monotonic() < deadline:
        _reap(signalled)
        time.sleep(0.05)
    for pid in signalled:
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    _reap(signalled)
    return signalled


def _reap(pids: list[int]) -> None:
    """Collect our own children among ``pids`` (others' exit is seen by pid_alive)."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


_libc = None


def setns(netns: str) -> None:
    """Move the calling thread into network namespace ``netns`` (setns(2), CLONE_NEWNET).

    Only this thread moves; threads it starts afterwards start in the same namespace.
    Sockets keep the namespace they were created in."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    path = NETNS_DIR / netns
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise TestbedError(f"namespace {netns} does not exist: is the testbed up? "
                           "(edgestream testbed status)") from None
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise TestbedError(f"setns({path}) failed: {os.strerror(err)} (needs root)")
    finally:
        os.close(fd)
