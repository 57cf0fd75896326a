"""SyncStrategy.observations: the fixed vocabulary the live runtime exports as metrics, and
the values ADSP (worker, server), SSP (worker, server) and local SGD report, checked on the
in-memory bus with a fake clock against what the test itself counted."""

from __future__ import annotations

import dataclasses

import pytest

from edgestream.monitoring.metrics import OBSERVATIONS
from edgestream.trainers.strategies.base import Observations
from tests.unit.trainers.fakes import FakeClock, drive_bsp, drive_ticks, poll, pump, train_once

WORKERS = ("w0", "w1", "w2")


def _values(obs: Observations) -> dict[str, object]:
    return {k: v for k, v in dataclasses.asdict(obs).items() if v is not None}


def test_the_vocabulary_is_the_one_the_metrics_export():
    assert tuple(f.name for f in dataclasses.fields(Observations)) == OBSERVATIONS
    assert _values(Observations()) == {}


@pytest.mark.parametrize("strategy", ["bsp", "asp", "scadles"])
def test_strategies_without_numbers_of_their_own_report_nothing(make_node, strategy):
    node = make_node("w0", strategy, members=("w0",))
    assert node.strategy.observations() == Observations()


# -- ADSP ----------------------------------------------------------------------------------------

COMPUTE_TICKS = {"w0": 1, "w1": 2, "w2": 4}  # seconds per local step


@pytest.fixture
def adsp_job(make_node, digits):
    params = {"period_s": 8.0, "commit_rate": 1, "max_commit_rate": 3, "min_interval_s": 1.0}
    server = make_node("server", "adsp", role="server", members=WORKERS, **params)
    shards = digits.shards(len(WORKERS))
    workers = [make_node(name, "adsp", members=WORKERS, data=shards[i], **params) for i, name in enumerate(WORKERS)]
    return server, workers


def _run_adsp(bus, server, workers, seconds: int, clock: FakeClock) -> None:
    drive_ticks(bus, server, workers, seconds, clock, COMPUTE_TICKS)


def test_adsp_reports_c_committed_local_steps_and_the_fitted_curve(bus, adsp_job):
    server, workers = adsp_job
    clock = FakeClock()
    assert _values(server.strategy.observations()) == {"commit_target": 1}  # no period ended: no fit
    assert _values(workers[0].strategy.observations()) == {"commit_target": 1, "committed_local_steps": 0,
                                                           "steps_awaiting_commit": 0}

    _run_adsp(bus, server, workers, 80, clock)
    for worker in workers:  # the steps since each worker's last commit await its next timed one
        obs = worker.strategy.observations()
        assert obs.steps_awaiting_commit == worker.steps_trained - obs.committed_local_steps
    for worker in workers:  # commit whatever is left: every local step is now in a commit
        poll(bus, worker, clock.advance(100.0))

    search = server.strategy.search
    fit = search.last_fit
    assert fit is not None and search.c > 1  # the search moved C at least once
    assert server.strategy.observations() == Observations(
        commit_target=search.c, fit_a2=fit.a2, fit_b=fit.b, fit_c0=fit.c0, fit_rmse=fit.rmse)
    assert fit.a2 >= 0 and fit.rmse >= 0
    per_commit = {}
    for worker in workers:
        obs = worker.strategy.observations()
        assert obs.commit_target == search.c  # the broadcast C reached every worker
        assert obs.committed_local_steps == worker.steps_trained > 0
        assert obs.steps_awaiting_commit == 0
        per_commit[worker.name] = obs.committed_local_steps / worker.strategy.counters["commits"]
    assert per_commit["w0"] > 2 * per_commit["w2"]  # the fast worker puts more steps in a commit


def test_observations_leave_the_strategy_as_it_was(bus, adsp_job):
    server, workers = adsp_job
    _run_adsp(bus, server, workers, 30, FakeClock())
    for node in (server, *workers):
        before = node.strategy.stats()
        first = node.strategy.observations()
        assert node.strategy.observations() == first
        assert node.strategy.stats() == before


# -- SSP -----------------------------------------------------------------------------------------


def test_ssp_reports_the_blocked_time_of_a_fast_worker_and_the_servers_clock_gap(bus, make_node, digits):
    names = ("w0", "w1")
    server = make_node("server", "ssp", role="server", members=names, staleness=0)
    shards = digits.shards(2)
    fast, slow = (make_node(n, "ssp", members=names, data=shards[i], staleness=0) for i, n in enumerate(names))
    clock = FakeClock()
    free_at = {"w0": 0, "w1": 0}
    # ticks a worker is busy after a step (its gradient is on the bus at once): w0 waits for
    # w1 about 3 ticks in 4
    compute = {"w0": 1, "w1": 4}
    gaps = []
    ticks = 80
    for tick in range(ticks):
        now = clock.now
        pump(bus, server, now=now)
        gaps.append(server.strategy.observations().clock_gap_steps)
        for worker in (fast, slow):
            pump(bus, worker, now=now)
            poll(bus, worker, now)
            if tick >= free_at[worker.name] and train_once(bus, worker, now=now):
                free_at[worker.name] = tick + compute[worker.name]
        clock.advance(1.0)

    blocked = {w.name: w.strategy.observations().blocked_seconds for w in (fast, slow)}
    assert blocked["w0"] == fast.strategy.blocked_seconds
    assert blocked["w1"] == 0.0  # the slowest worker never waits
    assert 0.5 * ticks <= blocked["w0"] < ticks  # about 3/4 of the time
    assert slow.steps_trained >= 15 and fast.steps_trained <= slow.steps_trained + 1  # lockstep (s = 0)
    assert set(gaps) <= {0, 1} and 1 in gaps  # at most s + 1, and the fast one does get ahead
    clocks = server.strategy.clocks()
    assert server.strategy.observations().clock_gap_steps == max(clocks.values()) - min(clocks.values())


def test_ssp_blocked_time_grows_only_while_blocked(make_node, digits):
    worker = make_node("w0", "ssp", members=("w0", "w1"), data=digits.shards(1)[0], staleness=0)
    worker.strategy.poll(0.0)
    worker.step(*next(worker.batches))  # clock 1 > min clock 0 + s: blocked from now on
    worker.strategy.poll(10.0)
    worker.strategy.poll(12.5)
    assert worker.strategy.observations().blocked_seconds == pytest.approx(2.5)
    worker.strategy.poll(20.0)
    assert worker.strategy.observations().blocked_seconds == pytest.approx(10.0)


# -- local SGD -----------------------------------------------------------------------------------


def test_localsgd_reports_period_steps_per_delta(bus, make_node, digits):
    shards = digits.shards(2)
    nodes = [make_node(n, "localsgd", members=("w0", "w1"), data=shards[i], period_steps=3)
             for i, n in enumerate(("w0", "w1"))]

    drive_bsp(bus, nodes, target_version=4 * (3 + 1))  # four rounds of 3 local steps and an average

    for node in nodes:
        assert node.strategy.counters["deltas_sent"] == 4
        # nothing reported as awaiting a commit: a partial round needs more steps first
        assert node.strategy.observations() == Observations(committed_local_steps=12)
        assert node.steps_trained == 12
