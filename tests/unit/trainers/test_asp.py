"""ASP: a server and workers of different speeds converge on digits; staleness is
recorded, and bounded when max_staleness is set; duplicates and old snapshots are inert."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from edgestream.trainers.errors import StrategyError
from edgestream.trainers.evaluation import evaluate
from edgestream.trainers.messages import UpdateMessage
from edgestream.trainers.strategies.base import snapshot_message
from tests.unit.trainers.fakes import FakeClock, drive_async, pump, train_once

WORKERS = ("w0", "w1", "w2")
COMPUTE_TICKS = [1, 2, 4]  # heterogeneity H = (1 + 1/2 + 1/4) / (3 * 1/4) = 2.33


@pytest.fixture
def make_job(make_node, digits):
    def factory(lr=0.1, momentum=0.5, **server_params):
        server = make_node("server", "asp", role="server", members=WORKERS, lr=lr, momentum=momentum,
                           **server_params)
        shards = digits.shards(len(WORKERS))
        workers = [make_node(name, "asp", data=shards[i], lr=lr, momentum=momentum)
                   for i, name in enumerate(WORKERS)]
        return server, workers

    return factory


@pytest.mark.parametrize("max_staleness", [None, 2])
def test_server_and_workers_of_different_speeds_reach_88_percent(
    bus, make_job, digits, max_staleness, record_property
):
    server, workers = make_job(max_staleness=max_staleness)

    drive_async(bus, server, workers, COMPUTE_TICKS, clock=FakeClock(), target_updates=150)

    accuracy = evaluate(server.trainer.model, digits.x_test, digits.y_test).accuracy
    stats = server.strategy.stats()
    record_property("held_out_accuracy", accuracy)
    record_property("staleness", {k: stats["staleness"][k] for k in ("mean", "max", "p99")})
    assert accuracy >= 0.88, accuracy
    assert stats["staleness"]["count"] == stats["counters"]["applied"] == server.trainer.version
    assert stats["staleness"]["mean"] > 0
    assert all(w.steps_trained > 0 and 0 < w.trainer.version <= server.trainer.version for w in workers)
    if max_staleness is None:
        assert stats["staleness"]["max"] > 2  # slow workers really were stale
        assert "rejected_stale" not in stats["counters"]
    else:
        assert stats["staleness"]["max"] <= max_staleness
        assert stats["staleness"]["p99"] <= max_staleness
        assert stats["counters"]["rejected_stale"] > 0
        assert stats["rejected_staleness"]["count"] == stats["counters"]["rejected_stale"]
        assert min(int(s) for s in stats["rejected_staleness"]["histogram"]) > max_staleness


def _gradient(worker, step=None):
    result = worker.trainer.compute_gradient(*next(worker.batches))
    msg = worker.strategy.on_local_step(result)[0].message
    return msg if step is None else dataclasses.replace(msg, step=step)


def test_a_rejected_stale_gradient_is_never_applied_and_its_sender_gets_the_model(make_job):
    server, workers = make_job(max_staleness=1)
    slow = _gradient(workers[2])
    for _ in range(2):
        server.strategy.on_message(_gradient(workers[0]))
    before = server.trainer.parameter_digest()

    out = server.strategy.on_message(slow)

    assert server.trainer.parameter_digest() == before and server.trainer.version == 2
    assert [(o.channel, o.to, o.message.base_version) for o in out] == [("models", "w2", 2)]
    assert server.strategy.stats()["counters"]["rejected_stale"] == 1


def test_duplicate_gradients_are_applied_once(make_job):
    server, workers = make_job()
    msg = _gradient(workers[0])

    server.strategy.on_message(msg)
    server.strategy.on_message(msg)

    assert server.trainer.version == 1
    assert server.strategy.stats()["counters"]["duplicates"] == 1


def test_gradients_from_a_version_the_server_never_had_are_rejected(make_job):
    server, workers = make_job()
    future = dataclasses.replace(_gradient(workers[0]), base_version=5)

    server.strategy.on_message(future)

    assert server.trainer.version == 0
    assert server.strategy.stats()["counters"]["rejected_future"] == 1


def test_workers_adopt_only_newer_snapshots(make_job):
    server, workers = make_job()
    worker = workers[0]
    old = snapshot_message(server.trainer, "server")
    server.strategy.on_message(_gradient(worker))
    new = snapshot_message(server.trainer, "server")

    worker.strategy.on_message(new)
    worker.strategy.on_message(old)
    worker.strategy.on_message(new)

    assert worker.trainer.version == 1
    assert worker.trainer.parameter_digest() == server.trainer.parameter_digest()
    counters = worker.strategy.stats()["counters"]
    assert (counters["snapshots_adopted"], counters["snapshots_ignored"]) == (1, 2)


@pytest.mark.parametrize("publish_every", [1, 3])
def test_snapshots_are_published_every_n_updates(make_job, publish_every):
    server, workers = make_job(publish_every=publish_every)

    published = [
        o for _ in range(6) for o in server.strategy.on_message(_gradient(workers[0]))
    ]

    assert [o.message.base_version for o in published] == list(range(publish_every, 7, publish_every))
    assert all(o.channel == "models" and o.to is None for o in published)


def test_timer_publishes_only_when_something_changed_and_the_interval_passed(make_job):
    server, workers = make_job(publish_every=0, publish_interval_s=10.0)
    clock = FakeClock(100.0)

    idle = server.strategy.poll(clock.now)
    server.strategy.on_message(_gradient(workers[0]))
    first = server.strategy.poll(clock.now)
    server.strategy.on_message(_gradient(workers[0]))
    too_soon = server.strategy.poll(clock.advance(5.0))
    later = server.strategy.poll(clock.advance(5.0))

    assert (idle, too_soon) == ([], [])
    assert [o.message.base_version for o in first + later] == [1, 2]


def test_inverse_staleness_damping_shrinks_stale_steps(make_job):
    server, workers = make_job(momentum=0.0, staleness_lr="inverse")
    stale = _gradient(workers[1])
    server.strategy.on_message(_gradient(workers[0]))
    before = server.trainer.get_parameters()

    server.strategy.on_message(stale)

    for name, param in server.trainer.get_parameters().items():
        torch.testing.assert_close(param, before[name] - 0.1 / 2 * stale.tensors[name])


def test_a_joining_worker_waits_for_the_snapshot_the_server_sends_it(bus, make_job, make_node, digits):
    server, workers = make_job()
    server.strategy.on_message(_gradient(workers[0]))
    joiner = make_node("w3", "asp", joining=True, data=digits.shards(4)[3], seed=5)
    assert not joiner.strategy.can_train()
    assert not train_once(bus, joiner)

    bus.publish("server", server.strategy.on_membership([*WORKERS, "w3"]))
    pump(bus, joiner)

    assert joiner.strategy.can_train()
    assert joiner.trainer.parameter_digest() == server.trainer.parameter_digest()
    assert joiner.trainer.version == 1


def test_roles_are_enforced(make_job):
    server, workers = make_job()

    assert not server.strategy.can_train()
    with pytest.raises(StrategyError):
        server.strategy.on_local_step(workers[0].trainer.compute_gradient(*next(workers[0].batches)))
    assert server.strategy.on_message(UpdateMessage(kind="control", sender="x", step=0, base_version=0)) == []


@pytest.mark.parametrize("bad", [{"publish_every": -1}, {"max_staleness": -2}, {"staleness_lr": "sqrt"}])
def test_bad_server_parameters_are_refused(make_job, bad):
    with pytest.raises(StrategyError):
        make_job(**bad)
