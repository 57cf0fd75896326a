"""ADSP commit-rate control on a fake clock: the interval, the commit timer, the loss-curve
fit, and the search for C on synthetic loss curves whose best C is known."""

from __future__ import annotations

import math

import pytest

from edgestream.trainers.commit_rate import (
    CommitRateSearch,
    CommitScheduler,
    LossCurve,
    commit_interval,
    fit_loss_curve,
)
from tests.unit.trainers.fakes import FakeClock

# -- the interval and the scheduler ---------------------------------------------------------


def test_commit_interval_is_period_over_c_minus_overhead_with_a_floor():
    assert commit_interval(60.0, 4) == 15.0
    assert commit_interval(60.0, 4, overhead_s=2.5) == 12.5
    assert commit_interval(60.0, 100, min_interval_s=1.0) == 1.0
    assert commit_interval(60.0, 10, min_interval_s=1.0, overhead_s=10.0) == 1.0


@pytest.mark.parametrize(
    "args",
    [(0.0, 1), (-1.0, 1), (math.nan, 1), (60.0, 0), (60.0, 1.5), (60.0, True), (60.0, 2, -1.0), (60.0, 2, 0.0, -1.0)],
)
def test_commit_interval_refuses_bad_parameters(args):
    with pytest.raises(ValueError):
        commit_interval(*args)


def test_the_scheduler_starts_at_the_first_poll_and_resets_on_commit():
    clock = FakeClock(100.0)
    scheduler = CommitScheduler(5.0)

    assert scheduler.next_due is None
    assert not scheduler.due(clock.now)  # starts the timer
    assert scheduler.next_due == 105.0
    assert not scheduler.due(clock.advance(4.9))
    assert scheduler.due(clock.advance(0.1))
    scheduler.committed(clock.advance(1.0))  # committed a little late, at 106: the cadence holds
    assert scheduler.next_due == 110.0
    assert not scheduler.due(clock.advance(3.9))
    assert scheduler.due(clock.advance(0.1))
    scheduler.committed(clock.advance(6.0))  # more than an interval late (116): no catch-up burst
    assert scheduler.next_due == 121.0


def test_a_scheduler_restored_from_another_clock_starts_afresh():
    # Checkpointed at t = 10,000 s on one host, restored where monotonic time reads 50 s:
    # waiting until 10,005 would stop the worker committing for hours.
    scheduler = CommitScheduler(5.0)
    scheduler.committed(10_000.0)
    restored = CommitScheduler(5.0)
    restored.load_state_dict(scheduler.state_dict())

    assert not restored.due(50.0)  # the timer restarts here
    assert restored.next_due == 55.0 and restored.due(55.0)


def test_a_new_interval_counts_from_the_last_commit():
    scheduler = CommitScheduler(10.0)
    scheduler.due(0.0)
    scheduler.committed(2.0)

    scheduler.set_interval(3.0)

    assert scheduler.next_due == 5.0 and scheduler.due(5.0)
    restored = CommitScheduler(1.0)
    restored.load_state_dict(scheduler.state_dict())
    assert restored.next_due == 5.0 and restored.interval_s == 3.0
    with pytest.raises(ValueError):
        scheduler.set_interval(0.0)


# -- the fit ------------------------------------------------------------------------------------


def _curve(a2: float, b: float, c0: float):
    return lambda t: 1.0 / (a2 * t + b) + c0


@pytest.mark.parametrize(("a2", "b", "c0", "times"), [
    (0.02, 0.5, 0.3, [0.0, 30.0, 60.0]),
    (0.02, 0.5, 0.3, [0.0, 10.0, 20.0, 40.0, 60.0]),
    (0.5, 2.0, 0.05, [0.0, 1.0, 2.0]),
    (0.001, 0.25, 1.2, [5.0, 35.0, 65.0, 95.0]),
])
def test_the_fit_recovers_known_parameters(a2, b, c0, times):
    loss = _curve(a2, b, c0)

    fit = fit_loss_curve(times, [loss(t) for t in times])

    assert fit.c0 == pytest.approx(c0, rel=1e-3)
    assert fit.a2 == pytest.approx(a2, rel=1e-2)
    assert fit.b == pytest.approx(b, rel=1e-2)
    assert fit.rmse < 1e-4
    assert fit(17.0) == pytest.approx(loss(17.0), rel=1e-3)


def test_the_fitted_curve_predicts_the_time_to_a_target():
    curve = LossCurve(a2=0.02, b=0.5, c0=0.3, rmse=0.0)

    # 1 / (0.02 t + 0.5) + 0.3 = 0.8  <=>  0.02 t + 0.5 = 2  <=>  t = 75
    assert curve.predicted_time_to(0.8) == pytest.approx(75.0)
    # from the level 1.3 (t = 25) to 0.8 (t = 75)
    assert curve.predicted_time_to(0.8, from_loss=1.3) == pytest.approx(50.0)
    assert curve.predicted_time_to(0.3) == math.inf  # the floor is never reached
    assert LossCurve(0.0, 1.0, 0.0, 0.0).predicted_time_to(0.5) == math.inf  # flat


def test_a_rising_loss_fits_a_flat_curve():
    fit = fit_loss_curve([0.0, 1.0, 2.0], [1.0, 1.2, 1.4])

    assert fit.a2 == 0.0
    assert fit.predicted_time_to(0.5) == math.inf


@pytest.mark.parametrize(("ts", "losses"), [
    ([0.0, 1.0], [1.0, 0.5]),
    ([0.0, 1.0, 2.0], [1.0, 0.5]),
    ([1.0, 1.0, 1.0], [1.0, 0.9, 0.8]),
    ([0.0, 1.0, 2.0], [1.0, math.nan, 0.8]),
])
def test_the_fit_refuses_unusable_samples(ts, losses):
    with pytest.raises(ValueError):
        fit_loss_curve(ts, losses)


# -- the search ------------------------------------------------------------------------------------


class SyntheticTraining:
    """Global loss of a job whose speed depends on C alone: the excess loss ``e = l - c0``
    follows ``de/dt = -k(C) e^2`` (exactly the curve family the search fits, with
    ``a^2 = k(C)``), and ``k`` peaks at ``BEST_C``."""

    C0 = 0.2

    def __init__(self, excess: float = 2.0) -> None:
        self.excess = excess

    @staticmethod
    def rate(c: int) -> float:
        return 0.05 / (1.0 + (c - BEST_C) ** 2)

    def advance(self, c: int, seconds: float) -> float:
        self.excess = 1.0 / (1.0 / self.excess + self.rate(c) * seconds)
        return self.loss

    @property
    def loss(self) -> float:
        return self.excess + self.C0


BEST_C = 4
PERIOD = 60.0


def _run(search: CommitRateSearch, job: SyntheticTraining, clock: FakeClock, seconds: int) -> list[int]:
    """Poll once a second for ``seconds``; the loss is observed every second. Returns the Cs announced."""
    announced = []
    for _ in range(seconds):
        search.observe_loss(clock.now, job.loss)
        changed = search.poll(clock.now)
        if changed is not None:
            announced.append(changed)
        job.advance(search.c, 1.0)
        clock.advance(1.0)
    return announced


@pytest.mark.parametrize("target_loss", [0.25, None])
def test_the_search_climbs_to_the_best_c_and_settles_there(target_loss):
    search = CommitRateSearch(PERIOD, initial_c=1, target_loss=target_loss, research_every_periods=100)

    announced = _run(search, SyntheticTraining(), FakeClock(), seconds=int(7 * PERIOD) + 5)

    assert announced == [2, 3, 4, 5, 4]  # C = 5 scored worse than 4: back to the best
    assert not search.searching and search.c == BEST_C == search.best_c
    assert search.last_fit is not None and search.last_fit.c0 == pytest.approx(SyntheticTraining.C0, rel=1e-2)


def test_the_search_stops_at_max_c():
    search = CommitRateSearch(PERIOD, initial_c=1, max_c=3, target_loss=0.25)

    announced = _run(search, SyntheticTraining(), FakeClock(), seconds=int(4 * PERIOD) + 5)

    assert announced == [2, 3]
    assert not search.searching and search.c == 3


def test_a_loss_jump_of_30_percent_starts_a_new_search():
    clock, job = FakeClock(), SyntheticTraining()
    search = CommitRateSearch(PERIOD, initial_c=1, target_loss=0.25, research_every_periods=100)
    _run(search, job, clock, seconds=int(7 * PERIOD) + 5)
    assert not search.searching and search.searches == 1

    job.excess += 0.35 * job.loss  # new data: the loss jumps by more than 30 %
    announced = _run(search, job, clock, seconds=1)

    assert announced == [BEST_C - 1]  # the new search starts one below the old C
    assert search.searching and search.searches == 2
    announced = _run(search, job, clock, seconds=int(3 * PERIOD) + 5)
    assert announced == [4, 5, 4]
    assert search.c == BEST_C and not search.searching


def test_a_smaller_rise_does_not_restart_the_search():
    clock, job = FakeClock(), SyntheticTraining()
    search = CommitRateSearch(PERIOD, initial_c=3, target_loss=0.25, research_every_periods=100)
    _run(search, job, clock, seconds=int(3 * PERIOD) + 5)
    assert not search.searching

    job.excess += 0.2 * job.loss

    assert _run(search, job, clock, seconds=int(PERIOD)) == []
    assert search.searches == 1


def test_the_search_runs_again_every_research_every_periods():
    clock, job = FakeClock(), SyntheticTraining()
    search = CommitRateSearch(PERIOD, initial_c=3, target_loss=0.25, research_every_periods=2)

    announced = _run(search, job, clock, seconds=int(5 * PERIOD) + 5)

    # periods: C=3, C=4, C=5 (worse: settle on 4), two settled periods, then a new search from 3
    assert announced == [4, 5, 4, 3]
    assert search.searching and search.searches == 2


def test_no_period_starts_before_a_loss_is_known():
    search = CommitRateSearch(10.0)

    assert all(search.poll(float(t)) is None for t in range(100))
    assert search.stats()["fit"] is None and search.c == 1


def test_the_state_round_trips_mid_search_and_continues_identically():
    clock, job = FakeClock(), SyntheticTraining()
    search = CommitRateSearch(PERIOD, initial_c=1, target_loss=0.25)
    _run(search, job, clock, seconds=int(2.5 * PERIOD))
    restored = CommitRateSearch(PERIOD, initial_c=1, target_loss=0.25)
    restored.load_state_dict(search.state_dict())
    twin_job, twin_clock = SyntheticTraining(job.excess), FakeClock(clock.now)

    assert _run(restored, twin_job, twin_clock, 300) == _run(search, job, clock, 300)
    assert restored.state_dict() == search.state_dict()


@pytest.mark.parametrize("kwargs", [
    {"period_s": 0.0}, {"period_s": math.inf}, {"initial_c": 0}, {"initial_c": 5, "max_c": 4},
    {"min_c": 2, "initial_c": 1}, {"research_every_periods": 0}, {"jump_ratio": 0.0},
    {"target_loss": math.nan},
])
def test_the_search_refuses_bad_parameters(kwargs):
    params = {"period_s": 60.0, **kwargs}
    with pytest.raises(ValueError):
        CommitRateSearch(params.pop("period_s"), **params)


def test_the_search_refuses_non_finite_losses():
    with pytest.raises(ValueError):
        CommitRateSearch(60.0).observe_loss(0.0, math.inf)
