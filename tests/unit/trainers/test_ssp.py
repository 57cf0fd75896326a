"""SSP: fast workers block s clocks ahead of the slowest and resume when it catches up;
s = 0 is lockstep; the version staleness bound holds as measured; membership releases
and admits workers; blocked time comes from poll(now); it learns digits."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from edgestream.trainers.errors import StrategyError
from edgestream.trainers.evaluation import evaluate
from edgestream.trainers.strategies.ssp import staleness_bound
from tests.unit.trainers.fakes import FakeBus, FakeClock, Node, announce, poll, pump, train_once

WORKERS = ("w0", "w1", "w2")


@pytest.fixture
def make_job(make_node, digits):
    def factory(workers=WORKERS, lr=0.1, momentum=0.5, **params):
        server = make_node("server", "ssp", role="server", members=tuple(workers), lr=lr, momentum=momentum,
                           **params)
        shards = digits.shards(len(workers))
        nodes = [make_node(name, "ssp", data=shards[i], lr=lr, momentum=momentum, members=tuple(workers), **params)
                 for i, name in enumerate(workers)]
        return server, nodes

    return factory


def run(bus: FakeBus, server: Node, workers: list[Node], compute: list[int], *, clock: FakeClock, steps: int,
        max_ticks: int = 20_000) -> int:
    """Every tick: the server reads and polls; each worker reads, polls and, when its previous
    step's compute time (``compute[i]`` ticks) is over and SSP lets it, starts a step whose
    gradient lands when the compute time has passed. Ends when every worker did ``steps``."""
    free_at = [0] * len(workers)
    for tick in range(max_ticks):
        if all(w.steps_trained >= steps for w in workers) and bus.in_flight() == 0 and bus.backlog("server") == 0:
            return tick
        now = clock.now
        pump(bus, server, now=now)
        poll(bus, server, now)
        for i, (worker, ticks) in enumerate(zip(workers, compute, strict=True)):
            pump(bus, worker, now=now)
            poll(bus, worker, now)
            if tick >= free_at[i] and worker.steps_trained < steps and train_once(
                bus, worker, now=now, delay=float(ticks)
            ):
                free_at[i] = tick + ticks
        clock.advance(1.0)
    raise AssertionError(f"not done in {max_ticks} ticks: {server.strategy.stats()}")


def _step(bus: FakeBus, worker: Node, server: Node) -> bool:
    """One step of ``worker`` if allowed; the server reads it; everyone reads the snapshot."""
    trained = train_once(bus, worker)
    pump(bus, server)
    return trained


def test_a_fast_worker_blocks_s_steps_ahead_and_resumes_when_the_slow_one_catches_up(bus, make_job):
    server, (fast, slow) = make_job(workers=("w0", "w1"), staleness=2)

    trained = 0
    while _step(bus, fast, server):
        pump(bus, fast)
        trained += 1
    poll(bus, fast, 10.0)
    poll(bus, fast, 15.0)

    assert trained == 3  # clocks 0, 1, 2 are within s = 2 of the slow worker's 0
    assert fast.strategy.blocked and not fast.driver.can_train()
    assert (fast.strategy.clock, fast.strategy.min_clock) == (3, 0)
    assert server.strategy.clocks() == {"w0": 3, "w1": 0}

    _step(bus, slow, server)
    pump(bus, fast)
    assert fast.strategy.min_clock == 1 and fast.driver.can_train()
    poll(bus, fast, 17.0)

    stats = fast.strategy.stats()
    assert stats["counters"]["blocked_polls"] == 2
    assert stats["counters"]["blocked_episodes"] == 1
    assert stats["blocked_seconds"] == pytest.approx(7.0)  # 10 -> 17, measured by polls only
    assert _step(bus, fast, server)
    pump(bus, fast)
    assert not fast.driver.can_train()  # clock 4 > min 1 + 2


def test_zero_staleness_is_lockstep(bus, make_job):
    server, workers = make_job(staleness=0)

    run(bus, server, workers, [1, 3, 5], clock=FakeClock(), steps=12)

    applied = [r for r in server.receipts if r.recorded]
    assert len(applied) == 12 * len(WORKERS)
    # Nobody starts step t + 1 before every worker's step t reached the server.
    assert [r.step for r in applied] == sorted(r.step for r in applied)
    assert server.strategy.max_clock_gap <= 1
    assert server.strategy.staleness.summary()["max"] <= staleness_bound(0, len(WORKERS)) == len(WORKERS) - 1
    assert workers[0].strategy.blocked_seconds > 0


@pytest.mark.parametrize("staleness", [1, 3])
def test_the_staleness_bound_holds_over_a_heterogeneous_run(bus, make_node, digits, staleness, record_property):
    names = ("w0", "w1", "w2", "w3")
    server = make_node("server", "ssp", role="server", members=names, lr=0.1, momentum=0.5, staleness=staleness)
    shards = digits.shards(len(names))
    workers = [make_node(n, "ssp", data=shards[i], members=names, staleness=staleness, lr=0.1, momentum=0.5)
               for i, n in enumerate(names)]

    run(bus, server, workers, [1, 2, 3, 7], clock=FakeClock(), steps=30)

    stats = server.strategy.stats()
    record_property("staleness", {k: stats["staleness"][k] for k in ("mean", "max", "p99")})
    assert stats["staleness"]["count"] == 30 * len(names)
    assert stats["staleness"]["max"] <= staleness_bound(staleness, len(names)) == stats["version_staleness_bound"]
    assert stats["staleness"]["mean"] > 0
    assert stats["max_clock_gap"] <= staleness + 1
    fast = workers[0].strategy.stats()
    assert fast["counters"]["blocked_polls"] > 0 and fast["blocked_seconds"] > 0
    assert workers[-1].strategy.stats()["counters"].get("blocked_polls", 0) == 0  # the slowest never waits


def test_a_larger_bound_blocks_less(make_node, digits):
    blocked = {}
    for staleness in (0, 40):
        bus = FakeBus()
        server = make_node("server", "ssp", role="server", members=WORKERS, staleness=staleness)
        server_bus_workers = [
            make_node(n, "ssp", data=digits.shards(3)[i], members=WORKERS, staleness=staleness)
            for i, n in enumerate(WORKERS)
        ]
        # make_node subscribed them to the fixture's bus; move them to this one.
        for node in (server, *server_bus_workers):
            bus.subscribe(node.name, node.strategy.subscribes)
        run(bus, server, server_bus_workers, [1, 2, 4], clock=FakeClock(), steps=20)
        blocked[staleness] = server_bus_workers[0].strategy.blocked_seconds

    assert blocked[40] == 0 < blocked[0]


def test_a_removed_worker_releases_the_others_and_a_joiner_starts_at_the_min_clock(bus, make_job, make_node, digits):
    server, (fast, gone) = make_job(workers=("w0", "w1"), staleness=1)
    while _step(bus, fast, server):
        pump(bus, fast)
    assert fast.strategy.blocked and fast.strategy.clock == 2
    stale = gone.strategy.on_local_step(gone.trainer.compute_gradient(*next(gone.batches)))

    announce(bus, server, ["w0"])
    pump(bus, fast)

    assert server.strategy.min_clock == 2 and fast.driver.can_train()
    assert server.strategy.on_message(stale[0].message) == []
    assert server.strategy.stats()["counters"]["not_member"] == 1
    assert _step(bus, fast, server) and _step(bus, fast, server)  # clocks 2 and 3 alone: min follows w0

    joiner = make_node("w2", "ssp", joining=True, data=digits.shards(3)[2], members=("w0",), staleness=1)
    assert not joiner.driver.can_train()
    announce(bus, server, ["w0", "w2"])
    pump(bus, joiner)

    assert server.strategy.clocks() == {"w0": 4, "w2": 4}
    assert joiner.strategy.clock == 4 and joiner.strategy.min_clock == 4
    assert joiner.trainer.version == server.trainer.version and joiner.driver.can_train()
    assert _step(bus, joiner, server)
    assert server.strategy.clocks()["w2"] == 5


def test_the_reported_bound_is_the_one_the_run_was_held_to_after_a_worker_leaves(bus, make_job, make_node):
    server, _ = make_job(workers=("w0", "w1", "w2"), staleness=1)
    assert server.strategy.stats()["version_staleness_bound"] == staleness_bound(1, 3)

    announce(bus, server, ["w0", "w1"])  # w2 leaves (e.g. stopped first at the end of a run)

    assert server.strategy.stats()["version_staleness_bound"] == staleness_bound(1, 3) > staleness_bound(1, 2)
    fresh = make_node("server", "ssp", role="server", members=("w0", "w1"), staleness=1, seed=1)
    fresh.strategy.load_state_dict(copy.deepcopy(server.strategy.state_dict()))
    assert fresh.strategy.stats()["version_staleness_bound"] == staleness_bound(1, 3)


def test_a_returning_worker_goes_on_at_the_min_clock_and_its_old_steps_are_duplicates(bus, make_job):
    server, (fast, slow) = make_job(workers=("w0", "w1"), staleness=1)
    announce(bus, server, ["w0"])
    for _ in range(5):
        _step(bus, fast, server)
        pump(bus, fast)

    announce(bus, server, ["w0", "w1"])
    pump(bus, slow)

    assert server.strategy.clocks() == {"w0": 5, "w1": 5} and slow.strategy.clock == 5
    assert _step(bus, slow, server)
    assert server.strategy.clocks()["w1"] == 6


def test_duplicates_are_dropped_and_counted(make_job):
    server, workers = make_job()
    result = workers[0].trainer.compute_gradient(*next(workers[0].batches))
    msg = workers[0].strategy.on_local_step(result)[0].message

    server.strategy.on_message(msg)
    server.strategy.on_message(msg)
    server.strategy.on_message(dataclasses.replace(msg, step=0))

    assert server.trainer.version == 1
    assert server.strategy.stats()["counters"]["duplicates"] == 2
    assert server.strategy.clocks()["w0"] == 1


def test_every_snapshot_carries_the_min_clock_and_older_ones_cannot_lower_it(bus, make_job):
    server, (w0, w1, w2) = make_job(staleness=0)
    for worker in (w0, w1, w2):
        _step(bus, worker, server)
    snapshots = [m for m in bus.deliver("w0") if m.kind == "model"]

    assert [m.meta["min_clock"] for m in snapshots] == [0, 0, 1]
    for msg in reversed(snapshots):
        w0.strategy.on_message(msg)
    assert w0.strategy.min_clock == 1 and w0.driver.can_train()


def test_a_step_while_blocked_is_refused(bus, make_job):
    server, (w0, _w1, _w2) = make_job(staleness=0)
    _step(bus, w0, server)
    pump(bus, w0)

    with pytest.raises(StrategyError):
        w0.strategy.on_local_step(w0.trainer.compute_gradient(*next(w0.batches)))


def test_state_round_trips_with_clocks_and_blocked_time(bus, make_job, make_node):
    server, (fast, slow) = make_job(workers=("w0", "w1"), staleness=0)
    _step(bus, fast, server)
    pump(bus, fast)
    poll(bus, fast, 3.0)
    poll(bus, fast, 4.5)

    for node in (server, fast):
        fresh = make_node(node.name, "ssp", role=node.strategy.role, members=("w0", "w1"), staleness=0, seed=1)
        fresh.strategy.load_state_dict(copy.deepcopy(node.strategy.state_dict()))
        assert fresh.strategy.state_dict() == node.strategy.state_dict()
    restored = make_node("w0", "ssp", members=("w0", "w1"), staleness=0)
    restored.strategy.load_state_dict(fast.strategy.state_dict())
    restored.strategy.poll(6.5)
    assert restored.strategy.blocked_seconds == pytest.approx(3.5)


def test_learns_digits_with_heterogeneous_workers(bus, make_job, digits, record_property):
    server, workers = make_job(staleness=3)

    run(bus, server, workers, [1, 2, 4], clock=FakeClock(), steps=50)

    accuracy = evaluate(server.trainer.model, digits.x_test, digits.y_test).accuracy
    record_property("held_out_accuracy", accuracy)
    assert accuracy >= 0.88, accuracy
    assert all(0 < w.trainer.version <= server.trainer.version for w in workers)


@pytest.mark.parametrize("bad", [{"staleness": -1}, {"staleness": 1.5}, {"staleness": True}, {"max_staleness": 2},
                                 {"publish_every": -1}])
def test_bad_parameters_are_refused(make_job, bad):
    with pytest.raises(StrategyError):
        make_job(**bad)
