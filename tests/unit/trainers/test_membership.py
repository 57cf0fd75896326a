"""The liveness table behind live membership (trainers/membership.py), on a fake clock:
join, timeout, leave, re-join, the listening period, reports only on change."""

from __future__ import annotations

import pytest

from edgestream.trainers.membership import HEARTBEAT, LEAVE, Liveness, is_stale
from tests.unit.trainers.fakes import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(100.0)


def started(clock: FakeClock, me: str | None = "w0", timeout_s: float = 3.0) -> Liveness:
    """A table that has listened already (its first report is due)."""
    table = Liveness(me, timeout_s)
    table.start(clock.now)
    clock.advance(timeout_s)
    return table


def test_nothing_is_reported_before_the_process_reads_its_own_heartbeat_and_listened(clock):
    table = Liveness("w0", 3.0)
    table.observe("w1", clock.now)
    assert table.report(clock.now) is None  # not started: the control topic is not read live yet
    table.start(clock.now)
    table.start(clock.advance(1.0))  # idempotent: the first start counts
    assert table.report(clock.now) is None  # still listening
    table.observe("w1", clock.advance(1.9))
    assert table.report(clock.advance(0.1)) == ("w0", "w1")  # 3 s after start


def test_a_worker_joins_when_heard_and_times_out_when_silent(clock):
    table = started(clock)
    assert table.report(clock.now) == ("w0",)
    table.observe("w2", clock.now, HEARTBEAT)
    assert table.report(clock.now) == ("w0", "w2")
    assert table.report(clock.advance(1.0)) is None  # no change, no report
    table.observe("w2", clock.now)
    assert table.report(clock.advance(3.0)) is None  # heard 3 s ago: still live (within the timeout)
    assert table.report(clock.advance(0.01)) == ("w0",)  # silent for longer: gone
    assert table.last_heard("w2") == pytest.approx(101.0 + 3.0)


def test_a_leave_drops_the_worker_at_once_and_a_later_heartbeat_brings_it_back(clock):
    table = started(clock)
    table.observe("w1", clock.now)
    table.observe("w2", clock.now)
    assert table.report(clock.now) == ("w0", "w1", "w2")
    table.observe("w1", clock.advance(0.5), LEAVE)
    assert table.report(clock.now) == ("w0", "w2")
    assert table.left() == ("w1",)
    table.observe("w1", clock.advance(10.0))  # restarted: heard again
    table.observe("w2", clock.now)
    assert table.report(clock.now) == ("w0", "w1", "w2")
    assert table.left() == ()


def test_the_process_itself_is_always_live_and_a_server_is_not_a_worker(clock):
    worker = started(clock, me="w3")
    worker.observe("w3", clock.now, LEAVE)  # its own leave never drops it from its own view
    assert worker.live(clock.advance(100.0)) == ("w3",)
    server = started(clock, me=None)
    assert server.report(clock.now) == ()
    server.observe("w0", clock.now)
    assert server.report(clock.now) == ("w0",)


def test_a_configured_worker_never_heard_is_not_live_after_listening(clock):
    table = Liveness("w0", 3.0)
    table.start(clock.now)
    table.observe("w1", clock.advance(1.0))
    assert table.report(clock.advance(2.0)) == ("w0", "w1")  # w2 (configured, never started) is not in it


def test_a_leave_read_before_the_heartbeats_of_a_new_incarnation_does_not_hide_it(clock):
    table = started(clock)
    table.observe("w1", clock.now, LEAVE)
    table.observe("w1", clock.advance(0.1), HEARTBEAT)
    assert "w1" in table.live(clock.now)


@pytest.mark.parametrize(("op", "worker"), [("vanish", "w1"), (HEARTBEAT, "")])
def test_unknown_ops_and_empty_ids_are_refused(clock, op, worker):
    table = started(clock)
    with pytest.raises(ValueError):
        table.observe(worker, clock.now, op)


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("inf"), float("nan")])
def test_the_timeout_must_be_a_positive_finite_number(timeout):
    with pytest.raises(ValueError):
        Liveness("w0", timeout)


def test_stale_messages_are_replays_of_the_log():
    assert not is_stale(1000.0, 1002.0, 3.0)
    assert not is_stale(1000.0, 1003.0, 3.0)
    assert is_stale(1000.0, 1003.5, 3.0)
    assert not is_stale(1005.0, 1000.0, 3.0)  # a sender's clock slightly ahead: not stale
