"""benchmarks/ddp_peer.py ``wait_ready``: a rank that dies during start-up ends the start-up
at once; the ranks left waiting for it in the rendezvous are stopped, not left to time out."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from edgestream.benchmarks import ddp_peer


def _waiter() -> subprocess.Popen:
    """A stand-in for a rank blocked in the rendezvous: it only ends on a signal."""
    return subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"],
                            start_new_session=True, stdin=subprocess.DEVNULL)


def test_a_rank_dead_at_start_up_stops_the_waiting_ranks_and_is_named(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    waiting = [_waiter(), _waiter()]
    procs = [waiting[0], dead, waiting[1]]
    try:
        assert dead.wait(timeout=30) == 3
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] exited during start-up"):
            ddp_peer.wait_ready(tmp_path, procs, timeout_s=120)
        # Stopped by the call, not left for the rendezvous timeout (120 s here).
        deadline = time.monotonic() + 30
        while any(p.poll() is None for p in waiting) and time.monotonic() < deadline:
            time.sleep(0.05)  # poll interval of a deadline wait
        assert [p.poll() for p in waiting] == [-15, -15]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_ranks_all_ready_return_without_touching_them(tmp_path):
    waiting = [_waiter(), _waiter()]
    try:
        for i in range(len(waiting)):
            (tmp_path / f"ready-{i}").write_text("")
        ddp_peer.wait_ready(tmp_path, waiting, timeout_s=5)
        assert [p.poll() for p in waiting] == [None, None]
    finally:
        for p in waiting:
            p.kill()
            p.wait()
