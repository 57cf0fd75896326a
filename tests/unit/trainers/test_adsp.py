"""ADSP on the fake bus with a fake clock: workers of different speeds commit equally often,
the server applies delta / N and records staleness, C from the server sets the workers'
commit interval, duplicates are dropped, pulls keep local progress, and it learns digits."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch

from edgestream.trainers.errors import StrategyError
from edgestream.trainers.evaluation import evaluate
from edgestream.trainers.messages import UpdateMessage
from edgestream.trainers.strategies import StrategyContext, create
from edgestream.trainers.strategies.adsp import COMMIT_RATE_OP
from edgestream.trainers.strategies.base import snapshot_message
from tests.unit.trainers.fakes import FakeClock, drive_ticks

WORKERS = ("w0", "w1", "w2")
COMPUTE_TICKS = {"w0": 1, "w1": 2, "w2": 4}  # seconds per local step: H = 2.33


@pytest.fixture
def make_job(make_node, digits):
    def factory(**params):
        params = {"period_s": 24.0, "commit_rate": 4, "min_interval_s": 1.0, **params}
        server = make_node("server", "adsp", role="server", members=WORKERS, lr=0.1, momentum=0.5, **params)
        shards = digits.shards(len(WORKERS))
        workers = [make_node(name, "adsp", members=WORKERS, data=shards[i], lr=0.1, momentum=0.5, **params)
                   for i, name in enumerate(WORKERS)]
        return server, workers

    return factory


def _run(bus, server, workers, seconds: int, clock: FakeClock) -> None:
    drive_ticks(bus, server, workers, seconds, clock, COMPUTE_TICKS)


def test_workers_of_different_speeds_commit_equally_often_and_learn(bus, make_job, digits, record_property):
    server, workers = make_job(search=False)

    _run(bus, server, workers, 240, FakeClock())

    stats = server.strategy.stats()
    commits = [stats["commits_per_worker"][w] for w in WORKERS]
    steps_per_commit = [w.strategy.stats()["local_steps_per_commit"] for w in workers]
    accuracy = evaluate(server.trainer.model, digits.x_test, digits.y_test).accuracy
    record_property("commits_per_worker", commits)
    record_property("held_out_accuracy", accuracy)
    # interval 24 / 4 = 6 s (longer than the slowest step): about 40 commits each, whatever the speed
    assert all(38 <= c <= 40 for c in commits), commits
    assert statistics.pstdev(commits) / statistics.mean(commits) <= 0.05
    # ... and the fast worker puts about 4x the local steps into each commit
    assert steps_per_commit[0] == pytest.approx(6.0, abs=0.2)
    assert steps_per_commit[2] == pytest.approx(1.5, abs=0.1)
    assert stats["counters"]["applied"] == sum(commits) == server.trainer.version
    assert stats["staleness"]["count"] == sum(commits) and stats["staleness"]["max"] >= 1
    assert accuracy >= 0.9, accuracy
    for worker in workers:
        assert evaluate(worker.trainer.model, digits.x_test, digits.y_test).accuracy >= 0.85


def test_the_server_search_sets_c_on_every_worker(bus, make_job):
    server, workers = make_job(search=True, period_s=8.0, commit_rate=1, max_commit_rate=3)

    _run(bus, server, workers, 120, FakeClock())

    c = server.strategy.search.c
    assert server.strategy.stats()["counters"]["commit_rate_changes"] >= 2  # it tried C = 2 at least
    assert server.strategy.search.searches >= 1
    for worker in workers:
        assert worker.strategy.c == c
        assert worker.strategy.scheduler.interval_s == max(1.0, 8.0 / c)


# -- the server, message by message ----------------------------------------------------------


def _delta(server, sender: str, step: int, value: float, *, base_version: int = 0, loss: float = 1.0):
    tensors = {n: torch.full_like(p, value) for n, p in server.trainer.get_parameters().items()}
    return UpdateMessage(kind="delta", sender=sender, step=step, base_version=base_version, batch_size=8,
                         tensors=tensors, meta={"loss": loss, "local_steps": 2})


def test_the_server_applies_delta_over_n_records_staleness_and_answers_the_committer(make_node):
    server = make_node("server", "adsp", role="server", members=WORKERS)
    before = server.trainer.get_parameters()
    server.strategy.on_message(_delta(server, "w1", 0, 0.3))  # version 0 -> 1

    out = server.strategy.on_message(_delta(server, "w0", 0, 0.6, base_version=0))  # one version stale

    after = server.trainer.get_parameters()
    for name in before:
        torch.testing.assert_close(after[name], before[name] + 0.1 + 0.2)
    assert server.trainer.version == 2
    assert server.strategy.staleness.summary()["histogram"] == {"0": 1, "1": 1}
    assert [(o.channel, o.to, o.message.kind, o.message.base_version) for o in out] == [("models", "w0", "model", 2)]
    assert out[0].message.meta == {"worker": "w0", "last_step": 0}


def test_n_follows_the_live_workers(make_node):
    server = make_node("server", "adsp", role="server", members=WORKERS)
    out = server.strategy.on_membership(["w0", "w1", "w2", "w3"])  # a joiner: N = 4
    assert [(o.channel, o.to) for o in out] == [("models", "w3"), ("control", "w3")]
    before = server.trainer.get_parameters()
    server.strategy.on_message(_delta(server, "w3", 0, 0.4))
    server.strategy.on_membership(["w0"])  # two left, one joined earlier left too: N = 1

    server.strategy.on_message(_delta(server, "w0", 0, 0.5, base_version=1))

    after = server.trainer.get_parameters()
    for name in before:
        torch.testing.assert_close(after[name], before[name] + 0.1 + 0.5)
    assert server.strategy.n == 1


def test_duplicate_and_out_of_order_commits_are_counted_and_dropped(make_node):
    server = make_node("server", "adsp", role="server", members=WORKERS)
    server.strategy.on_message(_delta(server, "w1", 3, 0.3))
    digest = server.trainer.parameter_digest()

    assert server.strategy.on_message(_delta(server, "w1", 3, 0.3)) == []
    assert server.strategy.on_message(_delta(server, "w1", 2, 0.3)) == []
    assert server.strategy.on_message(_delta(server, "w2", 0, 0.3, base_version=7)) == []  # future base

    assert server.trainer.parameter_digest() == digest and server.trainer.version == 1
    counters = server.strategy.stats()["counters"]
    assert counters["duplicates"] == 2 and counters["rejected_future"] == 1 and counters["applied"] == 1
    assert server.strategy.staleness.summary()["count"] == 1


def test_server_momentum_carries_the_previous_step(make_node):
    server = make_node("server", "adsp", role="server", members=("w0",), server_momentum=0.5)
    before = server.trainer.get_parameters()
    server.strategy.on_message(_delta(server, "w0", 0, 1.0))

    server.strategy.on_message(_delta(server, "w0", 1, 1.0, base_version=1))

    after = server.trainer.get_parameters()
    for name in before:  # steps 1.0 and 0.5 * 1.0 + 1.0
        torch.testing.assert_close(after[name], before[name] + 2.5)


# -- the worker, message by message ------------------------------------------------------------


def _step(worker, times: int = 1) -> None:
    for _ in range(times):
        worker.step(*next(worker.batches))


def test_a_worker_commits_its_delta_on_schedule_and_never_waits(make_node, digits):
    worker = make_node("w0", "adsp", members=WORKERS, data=digits.shards(1)[0], period_s=10.0, commit_rate=2)
    start = worker.trainer.get_parameters()
    assert worker.strategy.poll(0.0) == []  # the timer starts
    _step(worker, 3)
    assert worker.driver.can_train()

    assert worker.strategy.poll(4.9) == []
    out = worker.strategy.poll(5.0)

    [commit] = out
    msg = commit.message
    assert (commit.channel, commit.to, msg.kind, msg.step, msg.base_version) == ("gradients", None, "delta", 0, 0)
    assert msg.meta["local_steps"] == 3 and msg.batch_size == 96 and msg.meta["loss"] > 0
    now = worker.trainer.get_parameters()
    for name in now:
        torch.testing.assert_close(msg.tensors[name], now[name] - start[name])
    assert worker.strategy.poll(10.0) == []  # due, but nothing new to commit
    _step(worker)
    assert worker.strategy.poll(10.5)[0].message.step == 1


def test_a_pull_keeps_the_progress_made_since_the_commit(make_node, digits):
    worker = make_node("w0", "adsp", members=WORKERS, data=digits.shards(1)[0], period_s=10.0, commit_rate=10)
    worker.strategy.poll(0.0)
    _step(worker, 2)
    worker.strategy.poll(1.0)  # commit 0
    at_commit = worker.trainer.get_parameters()
    _step(worker, 2)
    progress = {n: p - at_commit[n] for n, p in worker.trainer.get_parameters().items()}
    model = {n: torch.full_like(p, 0.01) for n, p in at_commit.items()}
    snapshot = dataclasses.replace(
        snapshot_message(worker.trainer, "server", meta={"worker": "w0", "last_step": 0}),
        tensors=model, step=5, base_version=5,
    )

    worker.strategy.on_message(snapshot)

    for name, value in worker.trainer.get_parameters().items():
        torch.testing.assert_close(value, model[name] + progress[name])
    assert worker.trainer.version == 5
    _step(worker)
    [commit] = worker.strategy.poll(2.0)
    assert (commit.message.base_version, commit.message.step, commit.message.meta["local_steps"]) == (5, 1, 3)
    # an older (or repeated) snapshot changes nothing
    digest = worker.trainer.parameter_digest()
    worker.strategy.on_message(dataclasses.replace(snapshot, step=4, base_version=4))
    worker.strategy.on_message(snapshot)
    assert worker.trainer.parameter_digest() == digest
    assert worker.strategy.stats()["counters"]["snapshots_ignored"] == 2


def test_a_worker_restored_behind_its_commits_drops_the_progress_they_carried(make_node, digits):
    # Restored from a checkpoint taken before commits 1 and 2: the server's answer names
    # commit 2, so the progress the checkpoint holds uncommitted is already in its model.
    worker = make_node("w0", "adsp", members=WORKERS, data=digits.shards(1)[0], period_s=10.0, commit_rate=10)
    worker.strategy.poll(0.0)
    _step(worker, 2)
    worker.strategy.poll(1.0)  # commit 0
    _step(worker, 2)  # uncommitted at the checkpoint (the lost life committed it as commit 1)
    restored = make_node("w0", "adsp", members=WORKERS, data=digits.shards(1)[0], period_s=10.0, commit_rate=10)
    restored.strategy.load_state_dict(worker.strategy.state_dict())
    restored.trainer.load_state_dict(worker.trainer.state_dict())
    model = {n: torch.full_like(p, 0.01) for n, p in worker.trainer.get_parameters().items()}
    answer = dataclasses.replace(
        snapshot_message(worker.trainer, "server", meta={"worker": "w0", "last_step": 2}),
        tensors=model, step=7, base_version=7,
    )

    restored.strategy.on_message(answer)

    for name, value in restored.trainer.get_parameters().items():
        torch.testing.assert_close(value, model[name])  # the model as it is, nothing added twice
    assert restored.strategy.stats()["counters"]["uncommitted_progress_dropped"] == 1
    assert restored.strategy.poll(3.0) == []  # nothing left to commit
    _step(restored)
    [commit] = restored.strategy.poll(4.0)
    assert (commit.message.step, commit.message.base_version, commit.message.meta["local_steps"]) == (3, 7, 1)


def test_c_from_the_server_changes_the_commit_interval(make_node):
    worker = make_node("w0", "adsp", members=WORKERS, period_s=60.0, commit_rate=4, min_interval_s=2.0)
    assert worker.strategy.scheduler.interval_s == 15.0

    def control(seq: int, c: int) -> UpdateMessage:
        return UpdateMessage(kind="control", sender="server", step=seq, base_version=0,
                             meta={"op": COMMIT_RATE_OP, "c": c, "seq": seq})

    worker.strategy.on_message(control(1, 10))
    assert (worker.strategy.c, worker.strategy.scheduler.interval_s) == (10, 6.0)
    worker.strategy.on_message(control(1, 3))  # duplicate
    worker.strategy.on_message(control(0, 3))  # older
    assert worker.strategy.c == 10
    worker.strategy.on_message(control(2, 100))
    assert worker.strategy.scheduler.interval_s == 2.0  # the floor
    worker.strategy.on_message(UpdateMessage(kind="control", sender="server", step=3, base_version=0,
                                             meta={"op": COMMIT_RATE_OP, "c": 0, "seq": 3}))
    assert worker.strategy.c == 100 and worker.strategy.stats()["counters"]["bad_control"] == 1


def test_a_joining_worker_waits_for_the_model(make_node):
    worker = make_node("w3", "adsp", members=WORKERS, joining=True)
    assert not worker.driver.can_train()
    model = snapshot_message(worker.trainer, "server", meta={"worker": "w3", "last_step": 6})

    worker.strategy.on_message(dataclasses.replace(model, step=9, base_version=9))

    assert worker.driver.can_train() and worker.trainer.version == 9
    assert worker.strategy.state_dict()["commit"] == 7  # goes on after the server's last


@pytest.mark.parametrize(("role", "params"), [
    ("worker", {"commit_rate": 0}), ("worker", {"period_s": -1.0}), ("worker", {"bogus": 1}),
    ("worker", {"min_interval_s": "abc"}), ("worker", {"overhead_s": True}),
    ("server", {"server_momentum": 1.0}), ("server", {"jump_ratio": 0.0}), ("server", {"max_commit_rate": 0}),
])
def test_bad_parameters_are_refused(make_trainer, role, params):
    ctx = StrategyContext("x", make_trainer(), role=role, members=WORKERS)
    with pytest.raises(StrategyError):
        create("adsp", ctx, **params)


def test_leaving_commits_the_uncommitted_steps_at_once_and_nothing_twice(make_node, digits):
    worker = make_node("w0", "adsp", members=WORKERS, data=digits.shards(1)[0], period_s=10.0, commit_rate=2)
    start = worker.trainer.get_parameters()
    assert worker.strategy.poll(0.0) == []  # the timer starts
    _step(worker, 2)
    [commit] = worker.strategy.on_leave()  # long before the schedule's 5 s
    msg = commit.message
    assert (msg.kind, msg.step, msg.meta["local_steps"]) == ("delta", 0, 2)
    now = worker.trainer.get_parameters()
    for name in now:
        torch.testing.assert_close(msg.tensors[name], now[name] - start[name])
    counters = worker.strategy.counters
    assert counters["committed_local_steps"] == counters["local_steps"] == 2
    assert worker.strategy.on_leave() == []  # nothing left to commit
    assert worker.driver.leave() == []
    assert worker.strategy.poll(5.0) == []  # the schedule did not move, and nothing is pending

