"""The end-of-run drain: waits while anything moves, gives up when stuck or at its cap."""

from __future__ import annotations

import pytest

from edgestream.pipeline.drain import OVER_MAX, STALLED, WAIT, DrainProgress, waiting_for


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_progress_keeps_the_drain_waiting_past_the_stall_bound(clock):
    drain = DrainProgress(stall_s=30, max_s=600, clock=clock)
    drain.observe({"w0": 1})
    for version in range(2, 40):  # a version every 5 s: 190 s, far past 30 s
        clock.now += 5
        assert drain.observe({"w0": version})
        assert drain.verdict() == WAIT
    assert drain.moves == 38


def test_no_progress_for_the_stall_bound_is_stalled(clock):
    drain = DrainProgress(stall_s=30, max_s=600, clock=clock)
    drain.observe({"w0": 1})
    clock.now += 29.9
    assert not drain.observe({"w0": 1})
    assert drain.verdict() == WAIT
    clock.now += 0.1
    assert drain.verdict() == STALLED
    assert "no progress for run.drain_timeout_s=30s while waiting for 5 unread" in drain.timeout_reason("5 unread")


def test_the_cap_ends_a_drain_that_still_moves(clock):
    drain = DrainProgress(stall_s=30, max_s=60, clock=clock)
    for step in range(13):
        drain.observe({"w0": step})
        clock.now += 5
    assert drain.verdict() == OVER_MAX
    assert "run.drain_max_s=60s (last progress 5s ago)" in drain.timeout_reason("x")


def test_a_process_that_became_ready_counts_as_progress(clock):
    drain = DrainProgress(stall_s=30, max_s=600, clock=clock)
    drain.observe({"w0": 1})
    clock.now += 25
    drain.restarted(clock.now)
    clock.now += 25
    assert drain.verdict() == WAIT  # 50 s without a figure moving, 25 s since the restart
    drain.restarted(clock.now - 100)  # an older readiness changes nothing
    clock.now += 5
    assert drain.verdict() == STALLED


def test_status_says_what_it_waits_for_and_its_bounds(clock):
    drain = DrainProgress(stall_s=30, max_s=600, clock=clock)
    drain.observe([1])
    clock.now += 4
    assert drain.status("w") == ("draining 4s: waiting for w; no progress yet "
                                 "(gives up after 30s without progress, at most 600s)")
    drain.observe([2])
    clock.now += 2
    assert "last progress 2s ago" in drain.status("w")


def test_waiting_for_counts_unread_and_pending_devices():
    rows = {"a": {"read": 90, "pending": 3}, "b": {"read": 50, "pending": 0}, "c": {"read": 10, "pending": 0}}
    assert waiting_for(rows, {"a": 100, "b": 50, "c": 10}) == (
        "10 unread record(s) on 1 device(s), 3 pending record(s) on 1 device(s)")
    assert waiting_for({"a": {"read": 5, "pending": 0}}, {"a": 5}) == "the workers to settle (lag, versions)"


@pytest.mark.parametrize("stall_s,max_s", [(0, 10), (10, 0), (-1, 5)])
def test_bounds_must_be_positive(stall_s, max_s):
    with pytest.raises(ValueError):
        DrainProgress(stall_s, max_s)
