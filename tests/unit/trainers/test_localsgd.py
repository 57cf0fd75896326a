"""Local SGD: H local steps per worker, then the same sample-weighted average of the
deltas on every replica; BSP's views for membership."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from edgestream.trainers.errors import StrategyError
from edgestream.trainers.evaluation import evaluate
from edgestream.trainers.messages import Outgoing
from tests.unit.trainers.fakes import drive_bsp, pump, train_once

NAMES = ("w0", "w1", "w2")
H = 4


@pytest.fixture
def make_cluster(make_node, digits):
    def factory(names=NAMES, strategy="localsgd", batch_sizes=None, **params):
        shards = digits.shards(len(names))
        sizes = batch_sizes or {}
        return [
            make_node(name, strategy, members=tuple(names), data=shards[i], batch_size=sizes.get(name, 32), **params)
            for i, name in enumerate(names)
        ]

    return factory


def _digests(nodes) -> set[str]:
    return {n.trainer.parameter_digest() for n in nodes}


def _round_version(rounds: int, period: int = H) -> int:
    """Version after ``rounds`` averages: each round is ``period`` local steps plus the average."""
    return rounds * (period + 1)


@pytest.mark.parametrize("delivery", ["in_order", "interleaved"])
def test_replicas_are_bitwise_identical_after_every_round(bus, make_cluster, delivery):
    nodes = make_cluster(period_steps=H, batch_sizes={"w0": 16, "w1": 32, "w2": 48})
    rng = np.random.default_rng(2) if delivery == "interleaved" else None

    for rounds in range(1, 6):
        drive_bsp(bus, nodes, target_version=_round_version(rounds), rng=rng)
        assert len(_digests(nodes)) == 1, rounds
        assert all(n.strategy.round == rounds and n.strategy.local_steps == 0 for n in nodes)
        # the digest each replica reports for its last averaged round is that common model's
        assert {n.strategy.stats()["round_digest"] for n in nodes} == _digests(nodes)

    for node in nodes:
        stats = node.strategy.stats()
        assert stats["staleness"]["count"] == 5 * len(NAMES) and stats["staleness"]["max"] == 0
        assert stats["counters"]["rounds"] == 5


def test_a_worker_takes_exactly_h_local_steps_per_round(bus, make_cluster):
    nodes = make_cluster(period_steps=H)
    first = nodes[0]
    sent: list[Outgoing] = []
    for _ in range(H):
        assert first.strategy.can_train()
        sent += first.strategy.on_local_step(first.trainer.compute_gradient(*next(first.batches)))

    assert len(sent) == 1 and sent[0].message.kind == "delta"  # only after the H-th step
    delta = sent[0].message
    assert (delta.step, delta.base_version, delta.batch_size) == (0, 0, H * 32)
    assert delta.meta["local_steps"] == H
    assert not first.strategy.can_train()
    assert "round 0 waits for" in first.strategy.stats()["waiting"]
    with pytest.raises(StrategyError):
        first.strategy.on_local_step(first.trainer.compute_gradient(*next(first.batches)))

    bus.publish(first.name, sent)
    drive_bsp(bus, nodes, target_version=_round_version(3))
    for node in nodes:
        assert node.steps_trained == 3 * H - (H if node is first else 0)
        assert node.strategy.stats()["counters"]["local_steps"] == 3 * H
        assert node.strategy.stats()["counters"]["deltas_sent"] == 3


def test_the_average_is_the_sample_weighted_mean_of_the_deltas(bus, make_cluster):
    nodes = make_cluster(names=("w0", "w1"), period_steps=2, batch_sizes={"w0": 16, "w1": 48})
    start = nodes[0].trainer.get_parameters()
    deltas = {}
    for node in nodes:
        for _ in range(2):
            out = node.strategy.on_local_step(node.trainer.compute_gradient(*next(node.batches)))
        deltas[node.name] = out[0].message.tensors
        bus.publish(node.name, out)
    for node in nodes:
        pump(bus, node)

    for name, param in nodes[0].trainer.get_parameters().items():
        expected = start[name] + (32 * deltas["w0"][name] + 96 * deltas["w1"][name]) / 128
        torch.testing.assert_close(param, expected)
    assert len(_digests(nodes)) == 1
    assert all(n.trainer.version == _round_version(1, 2) for n in nodes)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_one_local_step_per_round_matches_bsp(bus, make_cluster, momentum):
    sizes = {"w0": 16, "w1": 32, "w2": 48}  # constant per worker: local momenta average to BSP's
    local = make_cluster(period_steps=1, batch_sizes=sizes, momentum=momentum)
    drive_bsp(bus, local, target_version=_round_version(6, 1))
    bsp = make_cluster(strategy="bsp", batch_sizes=sizes, momentum=momentum)
    drive_bsp(bus, bsp, target_version=6)

    for name, param in bsp[0].trainer.get_parameters().items():
        torch.testing.assert_close(local[0].trainer.get_parameters()[name], param, rtol=1e-4, atol=1e-6)


def test_a_removed_worker_releases_the_round(bus, make_cluster):
    nodes = make_cluster(period_steps=H)
    drive_bsp(bus, nodes, target_version=_round_version(1))
    leaver = nodes.pop()
    for _ in range(H - 1):  # dies one step before its round-1 delta
        assert train_once(bus, leaver)
    for node in nodes:  # the survivors finish their round 1 and wait for it
        for _ in range(H):
            assert train_once(bus, node)
    for node in nodes:
        pump(bus, node)
    assert all(n.strategy.round == 1 and not n.strategy.can_train() for n in nodes)
    bus.unsubscribe(leaver.name)

    for node in nodes:
        bus.publish(node.name, node.strategy.on_membership(["w0", "w1"]))
    for node in nodes:
        pump(bus, node)

    assert all(n.strategy.round == 2 and n.strategy.members == ("w0", "w1") for n in nodes)
    assert len(_digests(nodes)) == 1
    drive_bsp(bus, nodes, target_version=_round_version(4))
    assert len(_digests(nodes)) == 1


def test_a_joiner_gets_the_round_anchor_and_then_averages_with_the_others(bus, make_cluster, make_node, digits):
    nodes = make_cluster(names=("w0", "w1"), period_steps=H)
    drive_bsp(bus, nodes, target_version=_round_version(2), rng=np.random.default_rng(5))
    joiner = make_node("w2", "localsgd", joining=True, data=digits.shards(3)[2], seed=42, period_steps=H)
    assert not joiner.strategy.can_train()
    for node in nodes:
        bus.publish(node.name, node.strategy.on_membership(["w0", "w1", "w2"]))
    nodes.append(joiner)

    drive_bsp(bus, nodes, target_version=_round_version(5), rng=np.random.default_rng(6))

    assert len(_digests(nodes)) == 1
    assert joiner.strategy.synced and joiner.steps_trained > 0
    assert all(n.strategy.members == NAMES and n.strategy.round == 5 for n in nodes)
    assert nodes[0].strategy.stats()["counters"]["snapshots_sent"] >= 1  # again if the joiner asked
    assert joiner.strategy.stats()["counters"]["snapshots_adopted"] == 1


def test_duplicate_late_and_inconsistent_deltas_change_nothing(bus, make_cluster):
    nodes = make_cluster(names=("w0", "w1"), period_steps=2)
    sent = []
    for node in nodes:
        for _ in range(2):
            sent += node.strategy.on_local_step(node.trainer.compute_gradient(*next(node.batches)))
    w0 = nodes[0]
    for out in (sent[0], sent[0], sent[1]):  # w0's delta twice, then w1's completes round 0
        w0.strategy.on_message(out.message)
    digest = w0.trainer.parameter_digest()

    for out in sent:  # round 0 is averaged: these are late now
        w0.strategy.on_message(out.message)
    w0.strategy.on_message(dataclasses.replace(sent[1].message, step=1, base_version=99))  # unknown anchor
    w0.strategy.on_message(dataclasses.replace(sent[1].message, step=9))  # too far ahead

    counters = w0.strategy.stats()["counters"]
    assert counters["duplicates"] == 1 and counters["late_deltas"] == 2
    assert counters["rejected_inconsistent"] == 1 and counters["rejected_future"] == 1
    assert w0.trainer.parameter_digest() == digest
    assert w0.strategy.staleness.summary()["count"] == 2


def test_momentum_reset_clears_the_optimizer_state_at_every_average(bus, make_cluster):
    nodes = make_cluster(names=("w0", "w1"), period_steps=2, momentum=0.9, momentum_policy="reset")
    drive_bsp(bus, nodes, target_version=_round_version(1, 2))

    assert all(n.trainer.get_momentum() == {} for n in nodes)


def test_local_sgd_learns_digits(bus, make_cluster, digits):
    nodes = make_cluster(period_steps=H)

    drive_bsp(bus, nodes, target_version=_round_version(20), rng=np.random.default_rng(1))

    accuracy = evaluate(nodes[0].trainer.model, digits.x_test, digits.y_test).accuracy
    assert accuracy >= 0.90, accuracy
    assert len(_digests(nodes)) == 1


@pytest.mark.parametrize("params", [{"period_steps": 0}, {"period_steps": 1.5}, {"momentum_policy": "global"}])
def test_bad_parameters_are_refused(make_node, params):
    with pytest.raises(StrategyError):
        make_node("w0", "localsgd", members=("w0",), **params)
