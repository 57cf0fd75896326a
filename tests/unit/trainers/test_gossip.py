"""Serverless gossip (``gossip``) and EdgeGossip (``edgegossip``): consensus, messages,
balancing, accuracy-aware mixing, plateau decay and checkpoints (trainers/strategies/gossip.py).

Clusters run on the unit tests' bus (``fakes.FakeBus``, real wire bytes, every worker behind
a ``TrainingDriver``); single-worker checks call the strategy directly.
"""

from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
import torch

from edgestream.trainers.driver import DriverConfig, TrainingDriver
from edgestream.trainers.errors import StrategyError
from edgestream.trainers.local import LocalTrainer
from edgestream.trainers.messages import UpdateMessage
from edgestream.trainers.models import build_model
from edgestream.trainers.strategies import StrategyContext, create
from edgestream.trainers.strategies.gossip import (
    EdgeGossipStrategy,
    GossipStrategy,
    balanced_batch_size,
)
from edgestream.trainers.topology import build_graph
from tests.unit.trainers.fakes import BatchStream, FakeBus, Node, announce, build_node, drive
from tests.unit.trainers.test_checkpoint import _assert_same_tree

FEATURES, CLASSES = 4, 2
TOLERANCE = 1e-5


def _trainer(seed: int = 0, momentum: float = 0.0) -> LocalTrainer:
    return LocalTrainer(build_model("mlp", (FEATURES,), CLASSES, seed=seed, hidden=(8,)), lr=0.1, momentum=momentum)


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(96, FEATURES)).astype(np.float32)
    return features, (features[:, 0] > 0).astype(np.int64)


def _names(count: int) -> tuple[str, ...]:
    return tuple(f"n{k:02d}" for k in range(count))


def _cluster(bus: FakeBus, strategy: str, count: int, *, batch: int | list[int] = 8, **params) -> list[Node]:
    """``count`` workers, each from its own seed (different initial models), one shard each."""
    names = _names(count)
    features, labels = _data()
    batches = batch if isinstance(batch, list) else [batch] * count
    return [
        build_node(bus, name, strategy, _trainer(seed=k), members=names,
                   batches=BatchStream(features, labels, batches[k], seed=k), **params)
        for k, name in enumerate(names)
    ]


def _flat(parameters: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([parameters[name].flatten().double() for name in sorted(parameters)])


def _models(nodes: list[Node]) -> torch.Tensor:
    return torch.stack([_flat(n.trainer.get_parameters()) for n in nodes])


def _max_distance(nodes: list[Node], target: torch.Tensor) -> float:
    return float((_models(nodes) - target).abs().max())


def _strategy(name: str = "gossip", worker: str = "a", members: tuple[str, ...] = ("a", "b", "c"), *,
              seed: int = 0, joining: bool = False, **params) -> GossipStrategy:
    ctx = StrategyContext(worker_id=worker, trainer=_trainer(seed), members=members, joining=joining)
    strategy = create(name, ctx, **params)
    assert isinstance(strategy, GossipStrategy)
    return strategy


def _step(strategy: GossipStrategy, batch: int = 8, seed: int = 0) -> list:
    features, labels = _data(seed)
    return strategy.on_local_step(strategy.trainer.compute_gradient(features[:batch], labels[:batch]))


def _model_from(sender: str, seed: int, *, step: int = 0, meta: dict | None = None) -> UpdateMessage:
    trainer = _trainer(seed)
    return UpdateMessage(kind="model", sender=sender, step=step, base_version=step,
                         tensors=trainer.get_parameters(), buffers=trainer.get_buffers(), meta=dict(meta or {}))


def _delta_from(sender: str, step: int, value: float = 0.01, *, batch: int = 8) -> UpdateMessage:
    tensors = {n: torch.full_like(p, value) for n, p in _trainer().get_parameters().items()}
    return UpdateMessage(kind="delta", sender=sender, step=step, base_version=step, batch_size=batch, tensors=tensors)


def _assert_valid_row(strategy: GossipStrategy, row: dict[str, float]) -> None:
    base = strategy.graph.weights[strategy.worker_id]
    assert set(row) <= {strategy.worker_id, *strategy.neighbours}
    assert all(weight >= 0 for weight in row.values())
    assert math.fsum(row.values()) == pytest.approx(1.0, abs=1e-12)
    for name, weight in row.items():
        if name != strategy.worker_id:
            assert weight <= base[name] + 1e-15


# -- consensus: lr = 0 ----------------------------------------------------------------------------

#: (strategy, topology, workers, local steps): steps measured to reach 1e-5, with margin.
CONSENSUS = [
    ("gossip", "ring", 8, 80),
    ("gossip", "torus", 9, 30),
    ("gossip", "torus", 8, 30),
    ("gossip", "regular", 8, 50),
    ("gossip", "complete", 8, 10),
    ("edgegossip", "ring", 8, 80),
    ("edgegossip", "regular", 8, 50),
]


@pytest.mark.parametrize(("strategy", "topology", "count", "steps"), CONSENSUS)
def test_with_lr_zero_every_worker_converges_to_the_average_of_the_initial_models(strategy, topology, count, steps):
    bus = FakeBus()
    nodes = _cluster(bus, strategy, count, topology=topology, lr_scale=0.0)
    average = _models(nodes).mean(dim=0)
    assert _max_distance(nodes, average) > 0.1  # they start far apart

    drive(bus, nodes, steps=steps)

    assert _max_distance(nodes, average) < TOLERANCE
    assert all(n.strategy.staleness.summary()["max"] == 0 for n in nodes)  # lockstep: no lag


def test_after_a_worker_is_removed_the_rest_converge_to_their_average():
    bus = FakeBus()
    nodes = _cluster(bus, "gossip", 6, topology="ring", lr_scale=0.0)
    drive(bus, nodes, steps=5)
    removed, survivors = nodes[3], nodes[:3] + nodes[4:]
    # What mixing conserves is the sum of the workers' own models x_i (the trainers hold mixes).
    start = torch.stack([_flat(n.strategy.own_model()) for n in survivors])
    assert float((start - start.mean(dim=0)).abs().max()) > 0.01

    bus.unsubscribe(removed.name)
    for node in survivors:
        announce(bus, node, [n.name for n in survivors], now=5.0)
    drive(bus, survivors, steps=5 + 80)

    assert _max_distance(survivors, start.mean(dim=0)) < TOLERANCE
    assert survivors[2].strategy.neighbours == ("n01", "n04")  # the ring closed over the gap
    assert all(removed.name not in n.strategy.stats()["neighbour_lag"] for n in survivors)


def test_under_reordering_and_duplicates_workers_still_reach_consensus():
    bus = FakeBus(jitter=3.0, duplicate=True, seed=1)
    nodes = _cluster(bus, "gossip", 8, topology="ring", lr_scale=0.0)

    drive(bus, nodes, steps=150)

    models = _models(nodes)
    assert float((models - models.mean(dim=0)).abs().max()) < TOLERANCE
    assert all(n.strategy.counters["duplicate_deltas"] > 0 for n in nodes)
    assert max(n.strategy.staleness.summary()["max"] for n in nodes) > 0  # lagging models were mixed


def test_with_compressed_deltas_workers_still_reach_consensus():
    # Each link's top-k codec keeps its own error-feedback residual: a neighbour's copy is
    # the sender's model minus that residual. Consensus holds; the exact average does not
    # (the copies lag by the residuals, so mixing no longer conserves the sum).
    bus = FakeBus()
    nodes = _cluster(bus, "gossip", 8, topology="ring", lr_scale=0.0, codec="topk", codec_params={"ratio": 0.5})

    drive(bus, nodes, steps=100)  # within TOLERANCE / 100 from step 80 on (measured)

    models = _models(nodes)
    assert float((models - models.mean(dim=0)).abs().max()) < TOLERANCE
    assert all(n.driver.compressed_steps > 0 for n in nodes)


def test_data_weighted_mixing_drives_to_the_sample_weighted_mean():
    bus = FakeBus()
    batches = [8, 8, 16, 32]
    nodes = _cluster(bus, "edgegossip", 4, batch=batches, topology="ring", lr_scale=0.0, accuracy_bias=0.0,
                     min_link_share=0.0)  # the pure Metropolis-Hastings chain
    weights = torch.tensor(batches, dtype=torch.float64) / sum(batches)
    target = (weights[:, None] * _models(nodes)).sum(dim=0)
    plain = _models(nodes).mean(dim=0)

    drive(bus, nodes, steps=80)

    assert _max_distance(nodes, target) < TOLERANCE
    assert _max_distance(nodes, plain) > 100 * TOLERANCE


# -- messages -------------------------------------------------------------------------------------


def test_first_contact_sends_the_model_then_deltas_one_per_neighbour():
    strategy = _strategy(topology="ring", members=("a", "b", "c", "d"))
    before = strategy.own_model()

    first = _step(strategy)
    middle = strategy.own_model()
    second = _step(strategy)

    assert [(o.to, o.channel, o.message.kind, o.message.step) for o in first] == [
        ("b", "inbox", "model", 1), ("d", "inbox", "model", 1)]
    assert [(o.to, o.message.kind, o.message.step, o.message.batch_size) for o in second] == [
        ("b", "delta", 2, 8), ("d", "delta", 2, 8)]
    for name, tensor in second[0].message.tensors.items():
        assert torch.equal(tensor, strategy.own_model()[name] - middle[name])
    assert not torch.equal(_flat(before), _flat(middle))


def test_a_neighbour_copy_follows_the_sender_through_its_deltas():
    bus = FakeBus()
    nodes = _cluster(bus, "gossip", 4, topology="ring")

    drive(bus, nodes, steps=12)

    for node in nodes:
        for name in node.strategy.neighbours:
            sender = next(n for n in nodes if n.name == name)
            copy = node.strategy.neighbour_model(name)
            assert copy is not None
            assert float((_flat(copy) - _flat(sender.strategy.own_model())).abs().max()) < 1e-6


def test_duplicates_old_models_and_foreign_messages_change_nothing():
    strategy = _strategy()
    strategy.on_message(_model_from("b", seed=1, step=0))
    strategy.on_message(_delta_from("b", step=1))
    digest, version = strategy.trainer.parameter_digest(), strategy.trainer.version

    strategy.on_message(_delta_from("b", step=1))
    strategy.on_message(_model_from("b", seed=2, step=1))
    strategy.on_message(_delta_from("x", step=5))
    strategy.on_message(_delta_from("a", step=5))
    strategy.on_message(_delta_from("c", step=1))  # no model of c yet

    assert (strategy.trainer.parameter_digest(), strategy.trainer.version) == (digest, version)
    assert strategy.counters["duplicate_deltas"] == 1
    assert strategy.counters["old_models"] == 1
    assert strategy.counters["not_neighbour"] == 1
    assert strategy.counters["own_messages"] == 1
    assert strategy.counters["delta_without_model"] == 1
    assert strategy.staleness.summary()["count"] == 1


def test_deltas_arriving_out_of_order_give_the_same_copy():
    in_order, shuffled = _strategy(), _strategy()
    deltas = [_delta_from("b", step=k, value=0.01 * k) for k in range(1, 6)]
    for strategy, order in ((in_order, deltas), (shuffled, [deltas[k] for k in (3, 0, 4, 2, 1)])):
        strategy.on_message(_model_from("b", seed=1))
        for msg in order:
            strategy.on_message(msg)

    # Deltas commute up to float rounding.
    assert float((_flat(in_order.neighbour_model("b")) - _flat(shuffled.neighbour_model("b"))).abs().max()) < 1e-6
    assert in_order.neighbour_model("b")["3.bias"][0] != _trainer(1).get_parameters()["3.bias"][0]
    assert in_order.staleness.summary()["count"] == shuffled.staleness.summary()["count"] == 5


def test_a_missing_neighbour_gives_its_weight_to_the_worker_itself():
    strategy = _strategy(topology="ring", members=("a", "b", "c", "d"))
    own = strategy.own_model()
    strategy.on_message(_model_from("b", seed=1))

    row = strategy.mixing_row()

    assert row == pytest.approx({"b": 1 / 3, "a": 2 / 3})
    expected = {n: own[n] * row["a"] + strategy.neighbour_model("b")[n] * row["b"] for n in own}
    assert float((_flat(strategy.trainer.get_parameters()) - _flat(expected)).abs().max()) < 1e-6


def test_a_lag_bound_blocks_the_next_iteration_until_every_neighbour_is_close_enough():
    strategy = _strategy(max_lag=1, lr_scale=0.0)

    assert not strategy.can_train()  # nothing of b and c yet
    out = strategy.poll(0.0)
    assert sorted((o.to, o.message.kind, o.message.step) for o in out) == [("b", "model", 0), ("c", "model", 0)]
    strategy.on_message(_model_from("b", seed=1))
    assert not strategy.can_train()
    strategy.on_message(_model_from("c", seed=2))
    assert strategy.can_train()
    _step(strategy)
    assert strategy.can_train()  # iteration 1: b and c at 0 lag 1
    _step(strategy)
    assert not strategy.can_train() and strategy.lag_blocked()  # iteration 2: they lag 2
    strategy.poll(1.0)
    strategy.poll(3.5)  # 2.5 s blocked
    strategy.on_message(_delta_from("b", step=1))
    assert not strategy.can_train()
    strategy.on_message(_delta_from("c", step=1))
    assert strategy.can_train()
    assert strategy.observations().blocked_seconds == pytest.approx(2.5)


def test_with_a_lag_bound_deltas_beyond_the_own_iteration_wait_until_it_gets_there():
    strategy = _strategy(max_lag=0, lr_scale=0.0)
    strategy.on_message(_model_from("b", seed=1))
    strategy.on_message(_model_from("c", seed=2))
    digest, copy_before = strategy.trainer.parameter_digest(), strategy.neighbour_model("b")

    strategy.on_message(_delta_from("b", step=1))  # b's iteration 1; we are at 0

    assert strategy.trainer.parameter_digest() == digest  # the mix still uses b at 0
    assert torch.equal(_flat(strategy.neighbour_model("b")), _flat(copy_before))
    assert strategy.counters["deltas_deferred"] == 1
    assert strategy.observations().neighbour_lag == {"b": 0, "c": 0}
    _step(strategy)  # now at 1: b's delta folds in
    assert float((_flat(strategy.neighbour_model("b")) - _flat(copy_before) - 0.01).abs().max()) < 1e-6
    assert strategy.on_message(_delta_from("b", step=1)) == [] and strategy.counters["duplicate_deltas"] == 1


#: (topology, local steps): the slowest worker's steps after which the distance stayed below
#: TOLERANCE / 10 in a 60-step run (ring 60, torus 20, regular 33, complete 1), with margin.
EXACT_AVERAGE = [("ring", 60), ("torus", 30), ("regular", 45), ("complete", 10)]


@pytest.mark.parametrize(("topology", "steps"), EXACT_AVERAGE)
def test_with_max_lag_zero_the_average_is_exact_whatever_the_speeds_and_delivery_order(topology, steps):
    bus = FakeBus(jitter=3.0, duplicate=True, seed=2)
    nodes = _cluster(bus, "gossip", 8, topology=topology, lr_scale=0.0, max_lag=0)
    average = _models(nodes).mean(dim=0)
    periods = {n.name: 1 + k % 3 for k, n in enumerate(nodes)}

    drive(bus, nodes, steps=steps, periods=periods, rng=np.random.default_rng(4))

    own = torch.stack([_flat(n.strategy.own_model()) for n in nodes])
    assert float((own - average).abs().max()) < TOLERANCE
    if topology != "complete":  # on the complete graph every worker waits for all: none runs ahead
        assert sum(n.strategy.counters["deltas_deferred"] for n in nodes) > 0  # some arrived early


def test_a_restored_worker_is_a_new_incarnation_its_neighbours_replace_their_copy():
    a = _strategy(max_lag=0, lr_scale=0.0)
    a.on_message(_model_from("b", seed=1))
    a.on_message(_model_from("c", seed=2))
    saved = a.state_dict()
    for _ in range(3):  # progress after the checkpoint, then a crash
        a.on_message(_delta_from("b", step=a.iteration + 1))
        a.on_message(_delta_from("c", step=a.iteration + 1))
        _step(a)
    b = _strategy(worker="b", seed=1, lr_scale=0.0)
    b.on_message(UpdateMessage(kind="model", sender="a", step=3, base_version=3,
                               tensors=a.own_model(), meta={"incarnation": 0}))

    restored = _strategy(max_lag=0, lr_scale=0.0, seed=7)
    restored.load_state_dict(saved)
    out = restored.on_restore()

    assert sorted((o.to, o.message.kind, o.message.step, o.message.meta["incarnation"]) for o in out) == [
        ("b", "model", 0, 1), ("c", "model", 0, 1)]
    b.on_message(next(o.message for o in out if o.to == "b"))  # older iteration, newer incarnation
    assert torch.equal(_flat(b.neighbour_model("a")), _flat(restored.own_model()))
    b.on_message(UpdateMessage(kind="delta", sender="a", step=4, base_version=4, batch_size=8,
                               tensors=_delta_from("a", 4).tensors, meta={"incarnation": 0}))
    assert b.counters["old_incarnation"] == 1
    assert torch.equal(_flat(b.neighbour_model("a")), _flat(restored.own_model()))


def test_a_model_from_a_neighbour_ahead_moves_the_clock_and_resends_the_model():
    strategy = _strategy(lr_scale=0.0)
    strategy.on_message(_model_from("b", seed=1))
    _step(strategy)
    _step(strategy)

    out = strategy.on_message(_model_from("c", seed=2, step=9))

    assert strategy.iteration == 9 and strategy.counters["clock_jumps"] == 1
    assert sorted((o.to, o.message.kind, o.message.step) for o in out) == [("b", "model", 9), ("c", "model", 9)]
    assert strategy.observations().neighbour_lag == {"b": 9, "c": 0}


def test_observations_carry_the_gossip_numbers():
    strategy = _strategy(max_lag=1)
    strategy.on_message(_model_from("b", seed=1))
    strategy.on_message(_model_from("c", seed=2))
    for now in (0.0, 1.0, 2.5):
        strategy.poll(now)
        _step(strategy)
    strategy.poll(4.0)

    obs = strategy.observations()

    assert obs.mixing_weights == strategy.mixing_row() and math.fsum(obs.mixing_weights.values()) == pytest.approx(1)
    assert obs.iteration_time_s == pytest.approx(1.25) and obs.iteration_time_cv == pytest.approx(0.2)
    assert obs.idle_fraction == pytest.approx(0.0)  # a step in every interval
    assert obs.neighbour_lag == {"b": 3, "c": 3}
    assert len(obs.model_sketch) == 32
    assert _strategy(seed=3).observations().model_sketch == _strategy(worker="b", seed=3).observations().model_sketch
    assert _strategy(seed=3).observations().model_sketch != _strategy(seed=4).observations().model_sketch


def test_init_noise_gives_each_worker_its_own_reproducible_initial_model():
    a1, a2 = _strategy(init_noise=0.1), _strategy(init_noise=0.1)
    b = _strategy(worker="b", init_noise=0.1)
    plain = _strategy()

    assert torch.equal(_flat(a1.own_model()), _flat(a2.own_model()))
    assert torch.equal(_flat(a1.trainer.get_parameters()), _flat(a1.own_model()))
    assert not torch.equal(_flat(a1.own_model()), _flat(b.own_model()))
    spread = float((_flat(a1.own_model()) - _flat(plain.own_model())).std())
    assert 0.08 < spread < 0.12


def test_a_joiner_waits_for_a_model_and_starts_from_it():
    joiner = _strategy(worker="c", joining=True, seed=9)

    assert not joiner.can_train()
    assert joiner.on_message(_delta_from("a", step=3)) == []
    out = joiner.on_message(_model_from("a", seed=1, step=7))

    assert joiner.can_train()
    assert joiner.iteration == 7
    assert torch.equal(_flat(joiner.trainer.get_parameters()), _flat(_trainer(1).get_parameters()))
    assert sorted((o.to, o.message.kind) for o in out) == [("a", "model"), ("b", "model")]


def test_membership_change_sends_the_model_to_new_neighbours_only():
    strategy = _strategy(topology="ring", members=("a", "b", "c", "d", "e"))
    _step(strategy)
    strategy.on_message(_model_from("b", seed=1))
    strategy.on_message(_model_from("e", seed=2))

    out = strategy.on_membership(["a", "c", "d", "e"])

    assert strategy.neighbours == ("c", "e")
    assert [(o.to, o.message.kind) for o in out] == [("c", "model")]
    assert strategy.neighbour_model("b") is None and strategy.neighbour_model("e") is not None
    assert strategy.on_membership(["e", "d", "c", "a"]) == []


@pytest.mark.parametrize("bad", [{"topology": "star"}, {"max_lag": -1}, {"lr_scale": -1.0}, {"batch_size": 0},
                                 {"rate_alpha": 0.0}, {"topology": "regular", "degree": 1}])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(StrategyError):
        _strategy(members=_names(5), worker="n00", **bad)


# -- balanced iterations ----------------------------------------------------------------------------


@pytest.mark.parametrize(("rate", "known", "members", "expected"), [
    (10.0, [10.0, 20.0, 30.0], 3, 16),       # 96 * 10 / 60
    (30.0, [10.0, 20.0, 30.0], 3, 48),
    (10.0, [10.0, 30.0], 4, 12),             # unknown members count at the mean: sum ~ 80
    (1.0, [1.0, 1000.0], 2, 4),              # clamped below
    (1000.0, [1000.0, 1.0], 2, 64),          # clamped above
    (0.0, [], 3, 32),                        # nothing measured: B_total / N
])
def test_balancing_rule_is_proportional_to_throughput_and_clamped(rate, known, members, expected):
    assert balanced_batch_size(96, rate, known, members, min_batch=4, max_batch=64) == expected


def test_throughput_idle_fraction_and_iteration_time_come_from_poll_times():
    strategy = _strategy("edgegossip", total_batch=60, rate_alpha=0.5)
    for second in range(7):
        strategy.poll(float(second))
        if second % 2 == 0:
            _step(strategy, batch=10)
    strategy.poll(7.0)

    stats = strategy.stats()
    assert strategy.rate == pytest.approx(5.0)  # 10 samples every 2 s
    assert stats["idle_fraction"] == pytest.approx(3 / 7)  # busy [0,1], [2,3], [4,5], [6,7]
    assert stats["iteration_time_mean_s"] == pytest.approx(2.0) and stats["iteration_time_cv"] == 0.0
    assert strategy.batch_size_wanted() == 20  # only its own rate known: B_total / N


def test_time_held_back_by_the_lag_bound_does_not_count_against_throughput():
    # 10 samples per step; 1 s computing, then 1 s blocked by a lagging neighbour: the
    # worker's capacity is 10 samples/s, not 5 (else balancing could never move batches).
    strategy = _strategy("edgegossip", members=("a", "b"), max_lag=0, rate_alpha=1.0)
    strategy.on_message(_model_from("b", seed=1))
    for k in range(3):
        strategy.poll(2.0 * k)
        _step(strategy, batch=10)
        strategy.poll(2.0 * k + 1)  # the step ran in [2k, 2k + 1]
        assert strategy.lag_blocked()  # b is still at iteration k
        strategy.on_message(_delta_from("b", step=k + 1))  # arrives at 2k + 2
    strategy.poll(6.0)

    assert strategy.rate == pytest.approx(10.0)
    assert strategy.observations().blocked_seconds == pytest.approx(3.0)
    assert strategy.idle_fraction() == pytest.approx(0.5)


def test_iteration_time_variation_is_reported():
    strategy = _strategy()
    for now in (0.0, 1.0, 4.0, 5.0, 8.0):
        strategy.poll(now)
        _step(strategy)

    mean, cv = strategy.iteration_time_stats()
    assert mean == pytest.approx(2.0) and cv == pytest.approx(0.5)


def test_rates_spread_through_metadata_and_set_the_batch():
    bus = FakeBus()
    nodes = _cluster(bus, "edgegossip", 5, batch=32, topology="ring", total_batch=100, max_batch=64)

    drive(bus, nodes, steps=12, periods={"n00": 1, "n01": 2, "n02": 1, "n03": 4, "n04": 1})

    for node in nodes:
        strategy = node.strategy
        assert isinstance(strategy, EdgeGossipStrategy)
        known = strategy.stats()["known_rates"]
        assert set(known) == set(_names(5))  # also of non-neighbours, through the tables
        expected = balanced_batch_size(100, strategy.rate, list(known.values()), 5, 4, 64)
        assert strategy.batch_size_wanted() == expected
    wanted = {n.name: n.strategy.batch_size_wanted() for n in nodes}
    assert wanted["n03"] < wanted["n01"] < wanted["n00"]  # slower workers take smaller batches


def test_the_baseline_keeps_its_fixed_batch_and_shares_no_rates():
    strategy = _strategy(batch_size=24)
    strategy.poll(0.0)
    _step(strategy)
    strategy.poll(1.0)
    out = _step(strategy)

    assert strategy.batch_size_wanted() == 24
    assert all(o.message.meta == {"incarnation": 0} for o in out)


# -- accuracy-aware mixing and plateau ---------------------------------------------------------------


def _edge_with_neighbours(batches: dict[str, int], scores: dict[str, float], own_score: float | None,
                          own_batch: int = 8, **params) -> EdgeGossipStrategy:
    members = ("a", *sorted(batches))
    strategy = _strategy("edgegossip", members=members, topology="complete", **{"min_link_share": 0.0, **params})
    assert isinstance(strategy, EdgeGossipStrategy)
    for seed, name in enumerate(sorted(batches), start=1):
        meta = {"batch": batches[name]} | ({"accuracy": scores[name]} if name in scores else {})
        strategy.on_message(_model_from(name, seed, meta=meta))
    _step(strategy, batch=own_batch)
    if own_score is not None:
        strategy.on_evaluation(own_score, 0.5)
    return strategy


def test_accuracy_bias_keeps_every_row_a_valid_averaging_step():
    rng = random.Random(4)
    for _ in range(100):
        names = [f"p{k}" for k in range(rng.randint(1, 6))]
        batches = {n: rng.randint(1, 64) for n in names}
        scores = {n: rng.random() for n in names if rng.random() < 0.8}
        strategy = _edge_with_neighbours(batches, scores, rng.choice([None, rng.random()]),
                                         own_batch=rng.randint(1, 64), accuracy_bias=rng.choice([0.0, 4.0, 50.0]))

        _assert_valid_row(strategy, strategy.mixing_row())


def test_neighbours_less_accurate_than_the_worker_weigh_less_and_the_rest_keep_w():
    biased = _edge_with_neighbours({"b": 8, "c": 8, "d": 8}, {"b": 0.9, "c": 0.5, "d": 0.7}, 0.7)
    neutral = _edge_with_neighbours({"b": 8, "c": 8, "d": 8}, {"b": 0.9, "c": 0.5, "d": 0.7}, 0.7,
                                    accuracy_bias=0.0)
    base = build_graph("complete", "abcd").weights["a"]

    row = biased.mixing_row()

    assert row["b"] == row["d"] == base["b"] > row["c"]  # Metropolis-Hastings: min(1, pi_c / pi_a) < 1
    assert row["c"] == pytest.approx(base["c"] * math.exp(4.0 * (0.5 - 0.7)))
    assert neutral.mixing_row() == pytest.approx(dict(base))
    assert row["a"] > neutral.mixing_row()["a"]  # bounded: what the worse one loses stays home


def test_a_floor_keeps_every_link_at_least_its_share_of_w_and_the_row_valid():
    floored = _edge_with_neighbours({"b": 4, "c": 8, "d": 256}, {"b": 0.2, "c": 0.9, "d": 0.9}, 0.9, own_batch=256,
                                    min_link_share=0.5)
    bare = _edge_with_neighbours({"b": 4, "c": 8, "d": 256}, {"b": 0.2, "c": 0.9, "d": 0.9}, 0.9, own_batch=256)
    base = build_graph("complete", "abcd").weights["a"]

    row = floored.mixing_row()

    _assert_valid_row(floored, row)
    assert row["b"] == row["c"] == pytest.approx(0.5 * base["b"])  # far below the floor without it
    assert bare.mixing_row()["b"] < 0.1 * base["b"] and bare.mixing_row()["c"] < 0.1 * base["c"]
    assert row["d"] == pytest.approx(base["d"])
    with pytest.raises(StrategyError):
        _strategy("edgegossip", min_link_share=1.5)


def test_with_lr_zero_accuracy_aware_mixing_drives_to_the_accuracy_weighted_mean():
    bus = FakeBus()
    nodes = _cluster(bus, "edgegossip", 4, topology="ring", lr_scale=0.0, score_every=1, accuracy_bias=4.0,
                     min_link_share=0.0)
    accuracies = [0.9, 0.5, 0.6, 0.7]
    for node, accuracy in zip(nodes, accuracies, strict=True):
        node.strategy.on_evaluation(accuracy, 0.5)
    pi = torch.tensor([math.exp(4.0 * a) for a in accuracies], dtype=torch.float64)
    target = ((pi / pi.sum())[:, None] * _models(nodes)).sum(dim=0)
    plain = _models(nodes).mean(dim=0)
    assert float((target - plain).abs().max()) > 100 * TOLERANCE

    drive(bus, nodes, steps=80)

    assert _max_distance(nodes, target) < TOLERANCE


def test_the_rows_of_two_workers_with_the_same_knowledge_are_in_detailed_balance():
    # pi ~ samples * exp(beta * accuracy): pi_a P_ab = pi_b P_ba, the chain is reversible.
    a = _edge_with_neighbours({"b": 32}, {"b": 0.6}, 0.8, own_batch=8)
    b = _strategy("edgegossip", worker="b", members=("a", "b"), topology="complete", seed=1)
    b.on_message(_model_from("a", 0, meta={"batch": 8, "accuracy": 0.8}))
    _step(b, batch=32)
    b.on_evaluation(0.6, 0.5)

    pi_a, pi_b = 8 * math.exp(4.0 * 0.8), 32 * math.exp(4.0 * 0.6)
    assert pi_a * a.mixing_row()["b"] == pytest.approx(pi_b * b.mixing_row()["a"])


def test_scores_ride_in_metadata_every_k_iterations():
    strategy = _strategy("edgegossip", score_every=3)
    strategy.on_evaluation(0.75, 0.4)

    shared = [any("accuracy" in o.message.meta for o in _step(strategy)) for _ in range(6)]

    assert shared == [False, False, True, False, False, True]


def test_a_plateau_decays_the_learning_rate_and_the_step_uses_it(monkeypatch):
    strategy = _strategy("edgegossip", plateau_patience=2, plateau_eps=0.01, lr_decay=0.5, min_lr_scale=0.2)
    scales: list[float] = []
    apply = strategy.trainer.apply_gradient

    def spy(grads, lr_scale=1.0, buffer_deltas=None):
        scales.append(lr_scale)
        return apply(grads, lr_scale=lr_scale, buffer_deltas=buffer_deltas)

    monkeypatch.setattr(strategy.trainer, "apply_gradient", spy)
    accuracies = [0.50, 0.60, 0.605, 0.61, 0.70, 0.69, 0.70, 0.70, 0.70, 0.70, 0.70]
    decays = []
    for accuracy in accuracies:
        strategy.on_evaluation(accuracy, 1.0)
        decays.append(strategy.decays)
        _step(strategy)

    # No gain above 0.01 after 0.60 twice -> decay; 0.70 is a gain; then every second stall decays.
    assert decays == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4]
    assert scales == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.2, 0.2, 0.2]
    assert strategy.stats()["lr_scale"] == 0.2


def test_training_stops_after_the_configured_number_of_decays():
    strategy = _strategy("edgegossip", plateau_patience=1, stop_after_decays=2)
    for accuracy in (0.5, 0.5):
        strategy.on_evaluation(accuracy, 1.0)
    assert strategy.can_train()

    strategy.on_evaluation(0.5, 1.0)

    assert not strategy.can_train()


def test_malformed_metadata_is_ignored_and_counted():
    strategy = _strategy("edgegossip")
    meta = {"rates": {"b": ["fast", 1], "c": [5.0, 2], "zz": [1.0, 1]}, "batch": -3, "accuracy": 7}
    strategy.on_message(_model_from("b", seed=1, meta=meta))

    assert strategy.stats()["known_rates"] == {"c": 5.0}
    assert strategy.counters["bad_rate_entries"] == 1
    _assert_valid_row(strategy, strategy.mixing_row())


# -- checkpoints ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gossip", "edgegossip"])
def test_state_round_trips_and_the_restored_worker_continues_identically(name):
    bus = FakeBus()
    nodes = _cluster(bus, name, 3, topology="ring", batch=[8, 16, 8])

    def evaluate(round_index: int) -> None:
        for node in nodes:
            node.strategy.on_evaluation(0.5 + 0.01 * (round_index % 3), 0.7)

    drive(bus, nodes, steps=6, periods={"n00": 1, "n01": 2, "n02": 1}, on_round=evaluate)
    original = nodes[1]
    buffer = io.BytesIO()
    torch.save({"trainer": original.trainer.state_dict(), "strategy": original.strategy.state_dict()}, buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    trainer = _trainer(seed=5)
    trainer.load_state_dict(saved["trainer"])
    fresh = create(name, StrategyContext(worker_id=original.name, trainer=trainer, members=_names(3)),
                   topology="ring")
    fresh.load_state_dict(saved["strategy"])
    copy = TrainingDriver(original.name, trainer, fresh, DriverConfig(job="test"))

    _assert_same_tree(fresh.state_dict(), original.strategy.state_dict())

    features, labels = _data(3)
    for driver in (original.driver, copy):
        driver.poll(10.0)
    outputs = [[o.value for o in d.step(features[:8], labels[:8]).outbound] for d in (original.driver, copy)]

    assert outputs[0] == outputs[1] and outputs[0]
    assert fresh.stats() == original.strategy.stats()
    assert trainer.parameter_digest() == original.trainer.parameter_digest()
    # After a real restart the driver calls on_restore: a new incarnation re-bases every neighbour.
    rebase = copy.restored()
    assert [(o.to, o.kind) for o in rebase] == [(n, "model") for n in fresh.neighbours]
    assert fresh.state_dict()["incarnation"] == 1 and fresh.counters["restores"] == 1


def test_a_dense_model_to_a_neighbour_voids_the_residual_its_delta_link_owed_it():
    trainer = _trainer()
    strategy = create("gossip", StrategyContext(worker_id="a", trainer=trainer, members=("a", "b", "c")))
    driver = TrainingDriver("a", trainer, strategy, DriverConfig(job="test", codec="topk", codec_params={"ratio": 0.1}))
    features, labels = _data()
    for _ in range(3):
        driver.step(features[:8], labels[:8])
    owed = driver._codec("b", "delta").memory
    assert any(owed.residual(name) is not None and owed.residual(name).abs().sum() > 0 for name in trainer.get_parameters())

    rebase = driver.restored()

    assert [(o.to, o.kind, o.codec) for o in rebase] == [("b", "model", "dense"), ("c", "model", "dense")]
    assert all(owed.residual(name) is None for name in trainer.get_parameters())
