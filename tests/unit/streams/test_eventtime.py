"""EventTimeCheck: event times against the broker's timestamps, with a fake broker clock."""

from __future__ import annotations

import numpy as np
import pytest

from edgestream.streams.eventtime import EventTimeCheck

NOW = 1_795_000_000.0  # 2026-11-18
YEAR = 365 * 86400.0


class FakeBrokerClock:
    """The timestamps a broker would stamp messages with: advanced by the test only."""

    def __init__(self, start: float = NOW) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def times(*seconds: float) -> np.ndarray:
    return np.array(seconds, dtype=np.float64)


@pytest.fixture
def broker() -> FakeBrokerClock:
    return FakeBrokerClock()


@pytest.mark.parametrize("event_time, word", [
    (0.0, "1970-01-01"),  # a clock never set
    (-1_000_000_000.0, "1938-04-24"),  # a sign error
    (NOW + YEAR, "2027-11-18"),  # a year ahead
], ids=["1970", "1938", "a-year-ahead"])
def test_an_event_time_off_the_broker_clock_is_bad_and_named(broker, event_time, word):
    check = EventTimeCheck(600)

    verdict = check.verdict(times(broker() - 1, event_time, broker()), broker())

    assert verdict.bad.tolist() == [False, True, False] and verdict.count == 1
    assert word in verdict.detail and "max_timestamp_skew_s = 600" in verdict.detail
    assert "clock" in verdict.detail


def test_within_the_skew_either_way_and_out_of_order_is_accepted(broker):
    assert not EventTimeCheck(600).verdict(times(broker() + 599), broker()).bad.any()
    assert not EventTimeCheck(600).verdict(times(broker() - 599), broker()).bad.any()
    verdict = EventTimeCheck(600).verdict(times(broker() + 300, broker() - 250, broker() - 10, broker() + 5), broker())
    assert not verdict.bad.any() and verdict.detail == ""


def test_going_back_within_the_skew_is_accepted_beyond_it_is_bad(broker):
    check = EventTimeCheck(600)
    check.accept(times(broker() + 500))
    broker.advance(1)

    verdict = check.verdict(times(broker() - 50, broker() - 500), broker())

    # Both lie within 600 s of the broker, but the second is 999 s behind the newest.
    assert verdict.bad.tolist() == [False, True]
    assert "going back in time" in verdict.detail and "999 s before" in verdict.detail


def test_going_back_is_judged_against_earlier_records_of_the_same_message(broker):
    check = EventTimeCheck(100)
    verdict = check.verdict(times(broker() + 90, broker() - 90, broker() - 5), broker())
    assert verdict.bad.tolist() == [False, True, False]


def test_rejected_records_do_not_move_the_newest(broker):
    check = EventTimeCheck(100)
    verdict = check.verdict(times(broker() + YEAR, broker()), broker())
    assert verdict.bad.tolist() == [True, False]
    check.accept(times(broker()))
    assert check.newest_s == broker()


def test_verdict_changes_nothing_accept_moves_the_newest(broker):
    check = EventTimeCheck(100)
    check.verdict(times(broker() + 50), broker())
    assert check.newest_s is None
    check.accept(times(broker() + 50, broker() + 20))
    check.accept(times(broker()))
    assert check.newest_s == broker() + 50


def test_each_record_is_judged_against_its_own_message_timestamp(broker):
    check = EventTimeCheck(10)
    first = broker()
    broker.advance(3600)
    verdict = check.verdict(times(first, first, broker()), times(first, broker(), broker()))
    assert verdict.bad.tolist() == [False, True, False]


@pytest.mark.parametrize("skew", [0, -1, float("nan"), float("inf")])
def test_the_skew_must_be_positive_and_finite(skew):
    with pytest.raises(ValueError, match="skew"):
        EventTimeCheck(skew)


def test_verdicts_match_a_record_by_record_reading_under_random_traffic(broker):
    rng = np.random.default_rng(5)
    check, newest = EventTimeCheck(100), None
    for _ in range(300):
        broker.advance(float(rng.uniform(0, 20)))
        event_time = broker() + rng.choice([0, 0, 0, 1], size=int(rng.integers(1, 8))) * rng.normal(0, 150, 1)[0] \
            + rng.normal(0, 30, 1)[0]
        expected = []
        for t in event_time.tolist():
            bad = abs(t - broker()) > 100 or (newest is not None and t < newest - 100)
            expected.append(bad)
            if not bad:
                newest = t if newest is None else max(newest, t)

        verdict = check.verdict(event_time, broker())
        check.accept(event_time[~verdict.bad])

        assert verdict.bad.tolist() == expected
        assert check.newest_s == newest


def test_run_passes_only_when_no_reference_within_the_bounds_could_reject_a_record(broker):
    """The run's shortcut: true means ``verdict`` rejects nothing for references anywhere
    in the bounds; it is false whenever ``verdict`` would reject one."""
    rng = np.random.default_rng(8)
    check = EventTimeCheck(100)
    passed = failed = 0
    for _ in range(400):
        broker.advance(float(rng.uniform(0, 20)))
        event_time = broker() + rng.normal(0, 60, int(rng.integers(1, 10)))
        references = broker() + rng.uniform(-40, 40, len(event_time))
        if check.run_passes(event_time, float(references.min()), float(references.max())):
            passed += 1
            assert not check.verdict(event_time, references).bad.any()
            assert not check.verdict(event_time, float(references.min())).bad.any()
            assert not check.verdict(event_time, float(references.max())).bad.any()
        else:
            failed += 1
        verdict = check.verdict(event_time, references)
        check.accept(event_time[~verdict.bad])
    assert passed > 50 and failed > 50
    assert not check.run_passes(np.array([broker(), float("nan")]), broker(), broker())
    assert check.run_passes(np.array([]), broker(), broker())


def test_accept_if_clean_accepts_exactly_what_verdict_would_pass_whole(broker):
    """The one-message shortcut: true (and the newest moved, as ``accept`` would) only
    when ``verdict`` rejects no record, and whenever it rejects one false, leaving the
    check as it was."""
    rng = np.random.default_rng(9)
    check, twin = EventTimeCheck(100), EventTimeCheck(100)
    clean = dirty = 0
    for _ in range(400):
        broker.advance(float(rng.uniform(0, 20)))
        event_time = broker() + rng.normal(0, 60, int(rng.integers(1, 10)))
        verdict = twin.verdict(event_time, broker())
        before = check.newest_s
        if check.accept_if_clean(event_time, broker()):
            clean += 1
            assert not verdict.bad.any()
        else:
            dirty += 1
            assert check.newest_s == before
            check.accept(event_time[~verdict.bad])
        twin.accept(event_time[~verdict.bad])
        assert check.newest_s == twin.newest_s
    assert clean > 50 and dirty > 50
    assert not check.accept_if_clean(np.array([broker(), float("nan")]), broker())
    assert check.accept_if_clean(np.array([]), broker())
