"""ScaDLES strategy: weighted aggregation of unequal window batches, linear LR scaling,
the replicated compression vote, restart, and data injection's class selection."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from edgestream.compression.controllers.scadles import ScadlesSignal, majority_compress
from edgestream.trainers.aggregation import linear_lr_scale, sample_weights, weighted_mean
from edgestream.trainers.errors import AggregationError, StrategyError
from edgestream.trainers.evaluation import evaluate
from edgestream.trainers.injection import DataInjector, Pool, shared_pool
from edgestream.trainers.strategies import StrategyContext, create
from tests.unit.trainers.fakes import drive_bsp, pump

NAMES = ("w0", "w1", "w2")


def _cluster(make_node, digits, *, names=NAMES, batch_sizes=(8, 24, 56), **params):
    if params.get("adaptive_compression"):
        # The driver refuses the vote without a compressing codec on its links.
        params.setdefault("codec", "topk")
        params.setdefault("codec_params", {"ratio": 0.1})
    shards = digits.shards(len(names))
    return [
        make_node(name, "scadles", members=tuple(names), data=shards[i], batch_size=batch_sizes[i], **params)
        for i, name in enumerate(names)
    ]


def _step_all(bus, nodes, signals=None):
    """One synchronous step: every node trains, reports its gradient's signal (as the
    pipeline does, before handing over the step), publishes, then reads the log."""
    for index, node in enumerate(nodes):
        features, labels = next(node.batches)
        result = node.trainer.compute_gradient(features, labels)
        if signals is not None:
            node.strategy.observe_signal(signals[index])
        bus.publish(node.name, node.strategy.on_local_step(result))
    for node in nodes:
        pump(bus, node)


# -- the shared rules -----------------------------------------------------------------------

def test_weights_are_batch_size_over_global_batch():
    assert sample_weights([8, 24, 56]) == pytest.approx([8 / 88, 24 / 88, 56 / 88])
    with pytest.raises(AggregationError):
        sample_weights([8, 0])


@pytest.mark.parametrize(("global_batch", "reference", "expected"), [(88, 88, 1.0), (44, 88, 0.5), (176, 88, 2.0),
                                                                     (50, None, 1.0)])
def test_linear_lr_scaling(global_batch, reference, expected):
    assert linear_lr_scale(global_batch, reference) == pytest.approx(expected)


def test_linear_lr_scaling_rejects_a_non_positive_reference():
    with pytest.raises(AggregationError):
        linear_lr_scale(10, 0)


def test_reference_per_worker_makes_b_ref_times_n(make_trainer):
    ctx = StrategyContext("w0", make_trainer(), members=NAMES)
    assert create("scadles", ctx, reference_per_worker=32).reference_batch == 96
    with pytest.raises(StrategyError):
        create("scadles", ctx, reference_per_worker=32, reference_batch=64)
    with pytest.raises(StrategyError):
        create("scadles", ctx, epoch_steps=0)


# -- one step: weighting and scaling ------------------------------------------------------

def test_a_step_applies_the_weighted_mean_of_unequal_windows_with_scaled_lr(bus, make_node, digits):
    nodes = _cluster(make_node, digits, momentum=0.0, lr=0.1, reference_batch=64)
    start = nodes[0].trainer.get_parameters()
    results = []
    for node in nodes:
        results.append(node.trainer.compute_gradient(*next(node.batches)))
        bus.publish(node.name, node.strategy.on_local_step(results[-1]))
    for node in nodes:
        pump(bus, node)

    expected = weighted_mean([r.gradients for r in results], [8, 24, 56])
    lr = 0.1 * (8 + 24 + 56) / 64
    for name, param in nodes[0].trainer.get_parameters().items():
        torch.testing.assert_close(param, start[name] - lr * expected[name])
    assert len({n.trainer.parameter_digest() for n in nodes}) == 1
    assert all(n.trainer.version == 1 for n in nodes)


def test_three_workers_with_unequal_windows_learn_digits(bus, make_node, digits):
    nodes = _cluster(make_node, digits, reference_per_worker=32)
    drive_bsp(bus, nodes, target_version=60)
    accuracy = evaluate(nodes[0].trainer.model, digits.x_test, digits.y_test).accuracy
    assert accuracy >= 0.88, accuracy
    assert len({n.trainer.parameter_digest() for n in nodes}) == 1


# -- the vote ----------------------------------------------------------------------------

def test_majority_rule_counts_ties_as_compress():
    assert majority_compress([True, False]) is True
    assert majority_compress([True, False, False]) is False
    assert majority_compress([]) is False


def test_signal_votes_on_the_epoch_mean_and_falls_back_to_the_previous_epoch():
    signal = ScadlesSignal(delta=0.2)
    assert signal.vote() is False  # nothing observed: dense
    for c in (0.1, 0.25):
        signal.observe(c)
    assert signal.epoch_mean == pytest.approx(0.175) and signal.vote() is True
    signal.new_epoch()
    assert signal.vote() is True  # previous epoch's mean until this one has data
    signal.observe(0.5)
    assert signal.vote() is False


def test_first_step_is_dense_then_every_replica_follows_the_majority(bus, make_node, digits):
    nodes = _cluster(make_node, digits, adaptive_compression=True, delta=0.3, epoch_steps=100)
    seen_flags = []

    # Step 0 is dense; its gradients carry votes from their own signals: 2 of 3 <= 0.3.
    _step_all(bus, nodes, signals=[0.1, 0.1, 0.9])
    assert all(n.strategy.compress_next is True for n in nodes)
    # Step 1 carries compress=True; votes from step 1 are (yes, yes, no) again.
    for node in nodes:
        features, labels = next(node.batches)
        out = node.strategy.on_local_step(node.trainer.compute_gradient(features, labels))
        seen_flags.append(out[0].message.meta["compress"])
        bus.publish(node.name, out)
    for node in nodes:
        pump(bus, node)
    assert seen_flags == [True, True, True]
    stats = [n.strategy.stats() for n in nodes]
    assert {s["counters"]["compressed_steps"] for s in stats} == {1}
    assert {s["compressed_fraction"] for s in stats} == {0.5}


def test_a_minority_of_compress_votes_keeps_steps_dense(bus, make_node, digits):
    nodes = _cluster(make_node, digits, adaptive_compression=True, delta=0.2, epoch_steps=100)
    for _ in range(3):
        _step_all(bus, nodes, signals=[0.1, 0.5, 0.6])
    assert all(n.strategy.compress_next is False for n in nodes)
    assert {n.strategy.stats()["counters"].get("compressed_steps", 0) for n in nodes} == {0}


def test_vote_uses_the_epoch_mean_over_epoch_steps(bus, make_node, digits):
    nodes = _cluster(make_node, digits, adaptive_compression=True, delta=0.2, epoch_steps=2)
    _step_all(bus, nodes, signals=[0.1, 0.1, 0.1])
    _step_all(bus, nodes, signals=[0.5, 0.5, 0.5])  # epoch ends after 2 steps: mean 0.3 > delta
    assert all(n.strategy.compress_next is False for n in nodes)


def test_without_adaptive_compression_messages_carry_no_decision(bus, make_node, digits):
    nodes = _cluster(make_node, digits)
    out = nodes[0].strategy.on_local_step(nodes[0].trainer.compute_gradient(*next(nodes[0].batches)))
    assert "compress" not in out[0].message.meta
    assert nodes[0].strategy.compress_next is True  # the codec alone decides


def test_state_round_trip_keeps_the_decision_and_the_signal(bus, make_node, make_trainer, digits):
    nodes = _cluster(make_node, digits, adaptive_compression=True, delta=0.3, epoch_steps=100)
    _step_all(bus, nodes, signals=[0.1, 0.2, 0.9])
    state = nodes[0].strategy.state_dict()
    fresh = create("scadles", StrategyContext("w0", make_trainer(), members=NAMES),
                   adaptive_compression=True, delta=0.3, epoch_steps=100)
    fresh.load_state_dict(state)
    assert fresh.compress_next is nodes[0].strategy.compress_next is True
    assert fresh.stats()["signal_epoch_mean"] == pytest.approx(0.1)


def test_signal_rejects_non_finite_values():
    signal = ScadlesSignal(0.2)
    with pytest.raises(Exception, match="finite"):
        signal.observe(math.nan)


# -- injection ------------------------------------------------------------------------------

def _pool(classes=10, per_class=5):
    labels = np.repeat(np.arange(classes), per_class)
    features = np.repeat(np.arange(classes, dtype=np.float32), per_class)[:, None] * np.ones((1, 4), np.float32)
    return Pool(features, labels)


def test_injection_picks_ceil_alpha_classes_the_device_does_not_own():
    injector = DataInjector(_pool(), 10, alpha=0.25, beta=0.5, seed=0)
    y = np.array([0, 1, 1, 0, 2, 2, 2, 0], dtype=np.int64)
    x = np.zeros((8, 4), np.float32)
    x2, y2, injection = injector.augment(x, y)
    assert len(injection.classes) == math.ceil(0.25 * 10) == 3
    assert not set(injection.classes) & {0, 1, 2}
    assert injection.samples == 3 * math.ceil(0.5 * 8)
    assert y2.shape[0] == x2.shape[0] == 8 + injection.samples
    extra = y2[8:]
    assert set(extra.tolist()) == set(injection.classes)
    # features come from the pool rows of the same class (the pool encodes its class in x)
    assert np.all(x2[8:, 0] == extra.astype(np.float32))


def test_injection_never_picks_owned_classes_and_stops_when_all_are_owned():
    injector = DataInjector(_pool(), 10, alpha=0.5, beta=0.25, seed=3)
    injector.observe(np.arange(8))
    for _ in range(20):
        assert set(injector.choose_classes()) <= {8, 9}
    injector.observe(np.array([8, 9]))
    x, y = np.zeros((4, 4), np.float32), np.array([0, 1, 2, 3])
    x2, y2, injection = injector.augment(x, y)
    assert injection.samples == 0 and x2 is x and y2 is y


def test_injection_is_deterministic_per_seed():
    a = DataInjector(_pool(), 10, alpha=0.25, beta=0.25, seed=7)
    b = DataInjector(_pool(), 10, alpha=0.25, beta=0.25, seed=7)
    y = np.array([0, 0, 1, 1])
    assert [a.choose_classes() for _ in range(5)] == [b.choose_classes() for _ in range(5)]
    a.observe(y)
    b.observe(y)
    assert a.augment(np.zeros((4, 4), np.float32), y)[2] == b.augment(np.zeros((4, 4), np.float32), y)[2]


def test_shared_pool_takes_per_class_samples_from_the_given_split():
    labels = np.array([0] * 10 + [1] * 3 + [2] * 7)
    features = np.arange(20, dtype=np.float32)[:, None]
    pool = shared_pool(features, labels, per_class=4, seed=0)
    counts = np.bincount(pool.labels, minlength=3)
    assert counts.tolist() == [4, 3, 4]
    assert np.all(labels[pool.features[:, 0].astype(int)] == pool.labels)


def test_injection_rejects_bad_parameters():
    with pytest.raises(StrategyError):
        DataInjector(_pool(), 10, alpha=1.5, beta=0.25)
    with pytest.raises(StrategyError):
        Pool(np.zeros((3, 2), np.float32), np.zeros(4, np.int64))
