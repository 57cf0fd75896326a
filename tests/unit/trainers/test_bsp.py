"""BSP: converges on digits with bitwise-identical replicas, tolerates duplicates, late
messages, any delivery interleaving, and workers joining and leaving."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from edgestream.trainers.aggregation import weighted_mean
from edgestream.trainers.errors import StrategyError
from edgestream.trainers.evaluation import evaluate
from edgestream.trainers.messages import Outgoing, UpdateMessage
from edgestream.trainers.strategies.base import snapshot_message
from tests.unit.trainers.fakes import drive_bsp, pump, train_once

NAMES = ("w0", "w1", "w2")


@pytest.fixture
def make_cluster(make_node, digits):
    def factory(names=NAMES, model="mlp", **params):
        shards = digits.shards(len(names))
        return [
            make_node(name, "bsp", members=tuple(names), data=shards[i], model=model, **params)
            for i, name in enumerate(names)
        ]

    return factory


def _digests(nodes) -> set[str]:
    return {n.trainer.parameter_digest() for n in nodes}


@pytest.mark.parametrize("model", ["mlp", "digits_cnn"])
@pytest.mark.parametrize("delivery", ["in_order", "interleaved"])
def test_three_workers_reach_90_percent_with_bitwise_identical_replicas(
    bus, make_cluster, digits, model, delivery, record_property
):
    nodes = make_cluster(model=model)
    rng = np.random.default_rng(1) if delivery == "interleaved" else None

    drive_bsp(bus, nodes, target_version=80, rng=rng)

    accuracy = evaluate(nodes[0].trainer.model, digits.x_test, digits.y_test).accuracy
    record_property("held_out_accuracy", accuracy)
    assert accuracy >= 0.90, accuracy
    assert len(_digests(nodes)) == 1
    for node in nodes:
        stats = node.strategy.stats()
        assert node.trainer.version == 80
        assert stats["staleness"]["count"] == 80 * 3 and stats["staleness"]["max"] == 0
        assert stats["counters"]["steps"] == 80


def test_one_step_applies_the_sample_weighted_mean_with_linear_lr_scaling(bus, make_node, digits):
    # Different batch sizes per worker: the b_i / B_t weighting is visible.
    shards = digits.shards(2)
    nodes = [
        make_node("w0", "bsp", members=("w0", "w1"), data=shards[0], batch_size=16, momentum=0.0,
                  lr=0.1, reference_batch=32),
        make_node("w1", "bsp", members=("w0", "w1"), data=shards[1], batch_size=48, momentum=0.0,
                  lr=0.1, reference_batch=32),
    ]
    start = nodes[0].trainer.get_parameters()
    results = {}
    for node in nodes:
        batch = next(node.batches)
        results[node.name] = node.trainer.compute_gradient(*batch)
        bus.publish(node.name, node.strategy.on_local_step(results[node.name]))

    for node in nodes:
        pump(bus, node)

    expected_grad = weighted_mean([results["w0"].gradients, results["w1"].gradients], [16, 48])
    lr_scale = (16 + 48) / 32
    for name, param in nodes[0].trainer.get_parameters().items():
        torch.testing.assert_close(param, start[name] - 0.1 * lr_scale * expected_grad[name])
    assert len(_digests(nodes)) == 1
    assert nodes[0].strategy.stats()["last_global_batch"] == 64


def test_a_worker_cannot_train_again_until_its_step_is_aggregated(bus, make_cluster):
    nodes = make_cluster()
    first = nodes[0]

    assert train_once(bus, first)

    assert not first.strategy.can_train()
    assert "waits for" in first.strategy.stats()["waiting"]
    with pytest.raises(StrategyError):
        first.strategy.on_local_step(first.trainer.compute_gradient(*next(first.batches)))


def test_result_from_an_outdated_model_is_refused(bus, make_cluster):
    node = make_cluster()[0]
    result = node.trainer.compute_gradient(*next(node.batches))
    stale = dataclasses.replace(result, base_version=result.base_version + 1)

    with pytest.raises(StrategyError, match="version"):
        node.strategy.on_local_step(stale)


def test_duplicate_and_late_gradients_change_nothing(bus, make_cluster):
    nodes = make_cluster()
    sent: list[Outgoing] = []
    for node in nodes:
        out = node.strategy.on_local_step(node.trainer.compute_gradient(*next(node.batches)))
        sent += out
        bus.publish(node.name, out)
        bus.publish(node.name, out)  # at-least-once delivery: the same gradient again
    for node in nodes:
        pump(bus, node)
    after_step = _digests(nodes)

    bus.publish("w0", sent)  # a late redelivery of step 0 after it was aggregated
    for node in nodes:
        pump(bus, node)

    assert len(after_step) == 1 and _digests(nodes) == after_step
    for node in nodes:
        counters = node.strategy.stats()["counters"]
        assert node.trainer.version == 1
        # Log: w0 w0 w1 w1 w2 w2 | w0 w1 w2. Step 0 completes at the first w2, so the
        # second w2 is already late: 2 duplicates while pending, 4 late copies.
        assert counters["duplicates"] == 2
        assert counters["late_gradients"] == 4


def test_gradients_too_far_ahead_or_with_a_mismatched_base_are_dropped(bus, make_cluster):
    node = make_cluster()[0]
    result = node.trainer.compute_gradient(*next(node.batches))
    far = UpdateMessage(kind="gradient", sender="w1", step=50, base_version=50, batch_size=32,
                        tensors=result.gradients)
    mismatched = dataclasses.replace(far, step=0, base_version=3)

    node.strategy.on_message(far)
    node.strategy.on_message(mismatched)

    counters = node.strategy.stats()["counters"]
    assert (counters["rejected_future"], counters["rejected_inconsistent"]) == (1, 1)
    assert node.trainer.version == 0


@pytest.mark.parametrize("delivery", ["in_order", "interleaved"])
def test_a_joining_worker_gets_the_model_and_then_trains_in_lockstep(
    bus, make_cluster, make_node, digits, delivery
):
    nodes = make_cluster(names=("w0", "w1"))
    rng = np.random.default_rng(7) if delivery == "interleaved" else None
    drive_bsp(bus, nodes, target_version=5, rng=rng)
    joiner = make_node("w2", "bsp", members=("w0", "w1", "w2"), joining=True, data=digits.shards(3)[2], seed=42)
    assert not joiner.strategy.can_train()
    for node in nodes:
        bus.publish(node.name, node.strategy.on_membership(["w0", "w1", "w2"]))
    nodes.append(joiner)

    drive_bsp(bus, nodes, target_version=25, rng=rng)

    assert len(_digests(nodes)) == 1
    assert joiner.strategy.synced and joiner.steps_trained > 0
    assert joiner.trainer.version == 25
    assert all(n.strategy.members == ("w0", "w1", "w2") for n in nodes)
    assert nodes[0].strategy.stats()["counters"]["snapshots_sent"] == 1
    assert nodes[1].strategy.stats()["counters"].get("snapshots_sent", 0) == 0


def test_a_joiner_that_reads_gradients_before_its_snapshot_replays_them(bus, make_cluster, make_node, digits):
    nodes = make_cluster(names=("w0", "w1"))
    joiner = make_node("w2", "bsp", joining=True, data=digits.shards(3)[2], seed=42)
    for node in nodes:
        bus.publish(node.name, node.strategy.on_membership(["w0", "w1", "w2"]))
    for node in nodes:  # view lands at step 0; the old members finish step 0 and w0 sends the snapshot
        pump(bus, node)
        train_once(bus, node)
    for node in nodes:
        pump(bus, node)
    for node in nodes:  # members already publish step 1, which now also waits for w2
        train_once(bus, node)

    buffered = pump(bus, joiner, channel="gradients")  # gradients first, snapshot afterwards
    pump(bus, joiner, channel="models")

    assert buffered > 0
    assert joiner.strategy.synced and joiner.trainer.version == 1
    assert joiner.strategy.can_train()
    nodes.append(joiner)
    drive_bsp(bus, nodes, target_version=4)
    assert len(_digests(nodes)) == 1


@pytest.mark.parametrize("crash_point", ["before_publishing", "after_publishing"])
@pytest.mark.parametrize("delivery", ["in_order", "interleaved"])
def test_a_leaving_worker_does_not_deadlock_the_others(bus, make_cluster, crash_point, delivery):
    nodes = make_cluster()
    rng = np.random.default_rng(3) if delivery == "interleaved" else None
    drive_bsp(bus, nodes, target_version=4, rng=rng)
    leaver = nodes.pop()
    if crash_point == "after_publishing":
        assert train_once(bus, leaver)  # its step-4 gradient is in the log, then it dies
    bus.unsubscribe(leaver.name)
    for node in nodes:
        bus.publish(node.name, node.strategy.on_membership(["w0", "w1"]))

    drive_bsp(bus, nodes, target_version=12, rng=rng)

    assert len(_digests(nodes)) == 1
    assert all(n.trainer.version == 12 and n.strategy.members == ("w0", "w1") for n in nodes)


def test_a_removed_worker_stops_training_and_ignores_the_job(bus, make_cluster):
    nodes = make_cluster()
    for node in nodes:
        bus.publish(node.name, node.strategy.on_membership(["w0", "w1"]))

    for node in nodes:
        pump(bus, node)

    removed = nodes[2].strategy
    assert not removed.active and not removed.can_train()
    assert "removed" in removed.stats()["waiting"]


def test_only_one_view_proposal_per_view_is_applied(bus, make_cluster):
    nodes = make_cluster()
    proposal = nodes[0].strategy.on_membership(["w0", "w1"])
    competing = UpdateMessage(kind="control", sender="w1", step=0, base_version=0,
                              meta={"op": "view", "view_id": 1, "members": ["w0", "w1", "w2", "w3"]})
    bus.publish("w0", proposal)
    bus.publish("w1", [Outgoing("gradients", competing)])

    for node in nodes:
        pump(bus, node)

    for node in nodes[:2]:
        assert node.strategy.view_id == 1
        assert node.strategy.members == ("w0", "w1")
        assert node.strategy.stats()["counters"]["views_ignored"] == 1


def test_a_joiner_whose_coordinator_died_asks_again_and_gets_the_model(bus, make_cluster, make_node, digits):
    nodes = make_cluster()
    drive_bsp(bus, nodes, target_version=2)
    joiner = make_node("w3", "bsp", joining=True, data=digits.shards(4)[3], seed=42)
    for node in nodes:
        bus.publish(node.name, node.strategy.on_membership(["w0", "w1", "w2", "w3"]))
    coordinator, survivors = nodes[0], nodes[1:]
    pump(bus, coordinator)
    assert train_once(bus, coordinator)  # its step-2 gradient is out; it dies before it
    bus.unsubscribe(coordinator.name)  # sees step 2 complete, so it never sends the snapshot
    for node in survivors:
        pump(bus, node)
        train_once(bus, node)
    for node in survivors:
        pump(bus, node)
    assert all(n.trainer.version == 3 for n in survivors) and not joiner.strategy.synced
    for node in survivors:
        bus.publish(node.name, node.strategy.on_membership(["w1", "w2", "w3"]))

    drive_bsp(bus, [*survivors, joiner], target_version=8)

    assert joiner.strategy.synced and joiner.strategy.stats()["counters"]["sync_requests"] >= 1
    assert survivors[0].strategy.stats()["counters"]["snapshots_sent"] == 1
    assert len(_digests([*survivors, joiner])) == 1


@pytest.mark.parametrize(
    "meta",
    [
        {"op": "view", "view_id": "1", "members": ["w0", "w1"]},
        {"op": "view", "view_id": True, "members": ["w0", "w1"]},
        {"op": "view", "view_id": 1, "members": "w0,w1"},
        {"op": "view", "view_id": 1, "members": []},
        {"op": "view", "view_id": 1, "members": ["w0", 7]},
    ],
)
def test_malformed_view_proposals_are_ignored(make_cluster, meta):
    node = make_cluster()[0]

    out = node.strategy.on_message(UpdateMessage(kind="control", sender="w1", step=0, base_version=0, meta=meta))

    assert out == []
    assert node.strategy.view_id == 0 and node.strategy.members == NAMES
    assert node.strategy.stats()["counters"]["views_ignored"] == 1


@pytest.mark.parametrize(
    "meta",
    [{}, {"members": ["w3"], "view_id": 1}, {"members": ["w0", "w3"], "view_id": "1", "veterans": ["w0"]}],
)
def test_a_joiner_ignores_snapshots_without_a_usable_view(make_cluster, make_node, meta):
    source = make_cluster()[0]
    joiner = make_node("w3", "bsp", joining=True, seed=4)
    snapshot = dataclasses.replace(snapshot_message(source.trainer, "w0", include_momentum=True), meta=meta)

    joiner.strategy.on_message(snapshot)

    assert not joiner.strategy.synced
    assert joiner.strategy.stats()["counters"]["snapshots_ignored"] == 1
