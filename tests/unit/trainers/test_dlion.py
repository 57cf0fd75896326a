"""DLion (``dlion``): weighted dynamic batching, per-link prioritised exchange, direct
knowledge transfer, restarts (trainers/strategies/dlion.py).

Single-worker checks call the strategy directly with a fake clock (times handed to
``poll``); cluster checks run on the unit tests' bus (real wire bytes, every worker behind
a ``TrainingDriver``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from edgestream.trainers.errors import StrategyError
from edgestream.trainers.evaluation import evaluate
from edgestream.trainers.local import LocalTrainer
from edgestream.trainers.messages import UpdateMessage
from edgestream.trainers.models import build_model
from edgestream.trainers.strategies import StrategyContext, create
from edgestream.trainers.strategies.dlion import (
    DENSE_ENTRY_BYTES,
    CapacityBalancer,
    DLionStrategy,
    LinkEstimate,
    LinkResidual,
    StepSet,
    entries_for_budget,
)
from tests.unit.trainers.fakes import BatchStream, FakeBus, Node, build_node, drive

FEATURES, CLASSES = 4, 2


def _trainer(seed: int = 0, momentum: float = 0.0, hidden: int = 8) -> LocalTrainer:
    return LocalTrainer(build_model("mlp", (FEATURES,), CLASSES, seed=seed, hidden=(hidden,)), lr=0.1,
                        momentum=momentum)


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(96, FEATURES)).astype(np.float32)
    return features, (features[:, 0] > 0).astype(np.int64)


def _strategy(worker: str = "a", members: tuple[str, ...] = ("a", "b", "c"), *, seed: int = 0,
              joining: bool = False, hidden: int = 8, **params) -> DLionStrategy:
    ctx = StrategyContext(worker_id=worker, trainer=_trainer(seed, hidden=hidden), members=members,
                          joining=joining)
    strategy = create("dlion", ctx, **params)
    assert isinstance(strategy, DLionStrategy)
    return strategy


def _step(strategy: DLionStrategy, batch: int = 8, seed: int = 0) -> list:
    features, labels = _data(seed)
    return strategy.on_local_step(strategy.trainer.compute_gradient(features[:batch], labels[:batch]))


def _gradient_from(sender: str, step: int, value: float = 0.01, *, batch: int = 8, hidden: int = 8,
                   **meta) -> UpdateMessage:
    tensors = {n: torch.full_like(p, value) for n, p in _trainer(hidden=hidden).get_parameters().items()}
    return UpdateMessage(kind="gradient", sender=sender, step=step, base_version=step, batch_size=batch,
                         tensors=tensors, meta=dict(meta))


def _model_from(sender: str, seed: int, *, step: int = 0, **meta) -> UpdateMessage:
    trainer = _trainer(seed)
    return UpdateMessage(kind="model", sender=sender, step=step, base_version=step,
                         tensors=trainer.get_parameters(), buffers=trainer.get_buffers(), meta=dict(meta))


def _flat(parameters: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([parameters[name].flatten().double() for name in sorted(parameters)])


# -- per-link residual, budget, bandwidth estimate ----------------------------------------------


def test_a_link_sends_the_largest_entries_and_loses_nothing_over_iterations():
    rng = torch.Generator().manual_seed(0)
    shapes = {"w1": (6, 5), "b1": (6,), "w2": (3, 6)}
    link = LinkResidual()
    given = {name: torch.zeros(shape, dtype=torch.float64) for name, shape in shapes.items()}
    sent_total = {name: torch.zeros(shape, dtype=torch.float64) for name, shape in shapes.items()}
    for iteration, k in enumerate([1, 5, 0, 20, 3, 200, 7, 2]):
        gradient = {name: torch.randn(shape, generator=rng) for name, shape in shapes.items()}
        owed = {name: link.residual.get(name, torch.zeros(shape)) + gradient[name] for name, shape in shapes.items()}
        sent, count = link.select(gradient, k)
        total = sum(math.prod(s) for s in shapes.values())
        assert count == min(k, total), iteration
        # Exactly the count largest magnitudes of residual + gradient travel; the rest stays.
        flat = torch.cat([owed[n].reshape(-1) for n in sorted(shapes)]).abs()
        carried = torch.cat([sent.get(n, torch.zeros(shapes[n])).reshape(-1) for n in sorted(shapes)])
        assert int((carried != 0).sum()) == count
        if 0 < count < total:
            assert float(flat[carried != 0].min()) >= float(flat[carried == 0].max())
        # A tensor without a selected entry is left out of the message (a partial message).
        assert all(bool((t != 0).any()) for t in sent.values())
        for name in shapes:
            given[name] += gradient[name].double()
            sent_total[name] += sent.get(name, torch.zeros(shapes[name])).double()
    for name in shapes:  # nothing lost: everything sent plus what is still owed
        assert torch.allclose(sent_total[name] + link.residual[name].double(), given[name], atol=1e-5)


def test_a_budget_buys_entries_at_least_the_minimum_and_all_once_dense_is_no_larger():
    assert entries_for_budget(0, 10_000, 4, min_entries=10) == 10
    small, large = entries_for_budget(20_000, 100_000, 4, 10), entries_for_budget(60_000, 100_000, 4, 10)
    assert 10 < small < large < 100_000
    # 6 bytes per sparse entry: from 2/3 of the entries on, the dense message is no larger.
    assert entries_for_budget(10_000_000, 100_000, 4, 10) == 100_000
    assert entries_for_budget(DENSE_ENTRY_BYTES * 100_000 + 4096, 100_000, 4, 10) == 100_000


def test_a_bandwidth_estimate_sized_by_itself_settles_at_the_bandwidth_with_latency_pipelined():
    bandwidth, latency, compute = 1e6, 0.05, 0.02  # latency longer than a step
    for start in (1e9, 100.0):  # wildly optimistic, or pessimistic
        estimate = LinkEstimate(alpha=0.3, value=start)
        estimate.observe(100, latency + 100 / bandwidth)  # a small message shows the latency
        for _ in range(60):
            size = estimate.value * compute
            estimate.observe(int(size), latency + size / bandwidth)
        assert estimate.value == pytest.approx(bandwidth, rel=0.02), start
    assert estimate.observe(0, 1.0) == estimate.value and estimate.observe(10, 0.0) == estimate.value
    assert estimate.observe(10, math.nan) == estimate.value


def test_a_transfer_hardly_longer_than_the_floor_raises_the_estimate_at_most_16_fold():
    estimate = LinkEstimate(alpha=1.0)
    estimate.observe(1000, 0.1)
    assert estimate.value == pytest.approx(10_000.0)  # the first: plainly
    estimate.observe(1000, 0.3)  # 0.2 s on the wire beyond the 0.1 s floor
    assert estimate.value == pytest.approx(5000.0)
    estimate.observe(1000, 0.1)
    assert estimate.value == pytest.approx(160_000.0)  # 1000 B / (0.1 s / 16)


def test_steps_seen_keep_a_floor_and_refuse_repeats_in_any_order():
    seen = StepSet()
    assert [seen.add(s) for s in (2, 1, 2, 4, 3, 1)] == [True, True, False, True, True, False]
    assert seen.floor == 4 and not seen.above and seen.newest == 4
    assert seen.add(7) and seen.newest == 7
    seen.raise_floor(6)
    assert seen.floor == 7 and not seen.above and not seen.add(5)


# -- weighted dynamic batching ----------------------------------------------------------------


def test_the_balancer_sets_batches_proportional_to_capacity_and_only_on_a_large_move():
    balancer = CapacityBalancer(total_batch=120, min_batch=4, max_batch=256, every=10, threshold=0.1, initial=40)
    assert not balancer.maybe_rebalance(5, "a", {"a": 10.0, "b": 20.0, "c": 30.0}, 3)  # not a multiple of K
    assert balancer.maybe_rebalance(10, "a", {"a": 10.0, "b": 20.0, "c": 30.0}, 3) and balancer.batch == 20
    assert not balancer.maybe_rebalance(20, "a", {"a": 10.5, "b": 19.0, "c": 30.0}, 3)  # < 10 % each
    assert balancer.batch == 20
    assert balancer.maybe_rebalance(30, "a", {"a": 30.0, "b": 20.0, "c": 30.0}, 3) and balancer.batch == 45
    assert balancer.rebalances == 2


def test_capacity_comes_from_poll_times_without_the_time_the_lag_bound_held_the_worker():
    # 10 samples per step (all it asks for), 1 s computing then 1 s blocked by b:
    # capacity 10 samples/s.
    strategy = _strategy(members=("a", "b"), max_lag=0, rate_alpha=1.0, batch_size=10)
    for k in range(3):
        strategy.poll(2.0 * k)
        _step(strategy, batch=10)
        strategy.poll(2.0 * k + 1)
        assert strategy.lag_blocked()  # b is still at iteration k
        strategy.on_message(_gradient_from("b", step=k + 1))
    strategy.poll(6.0)
    stats = strategy.stats()
    assert stats["capacity_samples_per_s"] == pytest.approx(10.0)
    assert stats["blocked_seconds"] == pytest.approx(3.0)
    assert stats["iteration_time_s"] == pytest.approx(2.0)


def test_a_stream_slower_than_the_compute_caps_the_capacity_until_batches_fill_again():
    strategy = _strategy(members=("a", "b"), max_lag=None, rate_alpha=1.0, batch_size=32)
    for k in range(3):  # 8 of the 32 records it asks for every 2 s; computing takes 0.5 s
        strategy.poll(2.0 * k)
        _step(strategy, batch=8)
    strategy.poll(4.5)
    stats = strategy.stats()
    assert stats["compute_samples_per_s"] == pytest.approx(4.0)  # nothing held it back
    assert stats["stream_samples_per_s"] == pytest.approx(4.0)
    strategy.poll(5.0)
    _step(strategy, batch=32)
    # A full batch: the stream delivers at least 32 in that 1 s, the bound rises to it.
    assert strategy.stats()["stream_samples_per_s"] == pytest.approx(32.0)
    assert strategy.capacity == pytest.approx(32.0)


def test_capacities_ride_in_metadata_and_set_the_batch_every_k_iterations():
    strategy = _strategy(members=("a", "b"), batch_size=30, rebalance_every=4, rate_alpha=1.0, max_lag=None)
    for second in range(5):  # 10 samples a second on a
        strategy.poll(float(second))
        strategy.on_message(_gradient_from("b", step=second + 1, capacity=30.0, batch=30))
        _step(strategy, batch=10)
    assert strategy.batch_size_wanted() == 15  # B_total 60 x 10 / (10 + 30), set at iteration 4
    out = _step(strategy, batch=10)
    assert out[0].message.meta["capacity"] == pytest.approx(10.0) and out[0].message.meta["batch"] == 15
    fixed = _strategy(members=("a", "b"), batch_size=30, rebalance_every=1, weighted_batching=False)
    fixed.poll(0.0)
    _step(fixed)
    fixed.poll(1.0)
    _step(fixed)
    assert fixed.batch_size_wanted() == 30 and fixed.counters["rebalances"] == 0


# -- per-link prioritised exchange ----------------------------------------------------------------


def test_each_link_carries_what_its_bandwidth_allows_and_follows_a_degraded_link():
    strategy = _strategy(max_lag=None, initial_iteration_s=1.0, min_ratio=0.01, hidden=512)
    total = sum(p.numel() for p in strategy.trainer.get_parameters().values())
    tensors = len(strategy.trainer.get_parameters())

    def expected(bandwidth: float) -> float:  # budget: 0.9 x bandwidth x 1 s iteration
        return entries_for_budget(0.9 * bandwidth, total, tensors, strategy.min_entries(total)) / total

    # b measured our link to it as fast, c as slow (their on_arrival estimates, reported back).
    strategy.on_message(_gradient_from("b", step=1, link_bw=1e6, hidden=512))
    strategy.on_message(_gradient_from("c", step=1, link_bw=5000.0, hidden=512))
    out = {o.to: o.message for o in _step(strategy)}
    assert out["b"].meta.get("compress") is False and sum(t.numel() for t in out["b"].tensors.values()) == total
    assert out["c"].meta["sparse"] is True
    ratios = strategy.observations().link_ratio
    assert ratios["b"] == 1.0 and ratios["c"] == pytest.approx(expected(5000.0)) and 0 < ratios["c"] < 0.5
    # c's link degrades further: its share follows at the next iteration; b's stays.
    strategy.on_message(_gradient_from("c", step=2, link_bw=3000.0, hidden=512))
    strategy.on_message(_gradient_from("b", step=2, link_bw=1e6, hidden=512))
    _step(strategy)
    after = strategy.observations().link_ratio
    assert after["c"] == pytest.approx(expected(3000.0)) and after["c"] < ratios["c"] and after["b"] == 1.0
    assert strategy.observations().link_bandwidth == {"b": 1e6, "c": 3000.0}


def test_a_link_whose_peer_is_behind_on_our_messages_carries_only_the_minimum():
    strategy = _strategy(max_in_flight=3, min_ratio=0.1, initial_bandwidth=1e9, hidden=512)
    for step in range(1, 5):
        strategy.on_message(_gradient_from("c", step=step, ack=step - 1, hidden=512))  # c keeps up
        ratios = (_step(strategy), strategy.observations().link_ratio)[1]
    assert ratios == {"b": pytest.approx(0.1, abs=0.01), "c": 1.0}  # 4 of ours unconfirmed by b
    assert strategy.stats()["links"]["b"]["in_flight"] == 4 and strategy.counters["window_full"] == 1
    strategy.on_message(_gradient_from("b", step=1, ack=4, hidden=512))  # b caught up
    _step(strategy)
    assert strategy.observations().link_ratio["b"] == 1.0
    out = {o.to: o.message for o in _step(strategy)}
    assert out["b"].meta["ack"] == 1 and out["c"].meta["ack"] == 4  # what we got of each


def test_the_links_of_a_host_share_its_uplink():
    strategy = _strategy(initial_iteration_s=1.0, min_ratio=0.01, hidden=64, link_alpha=1.0)
    total = sum(p.numel() for p in strategy.trainer.get_parameters().values())
    for peer in ("b", "c"):  # each link on its own could take the whole gradient
        strategy.on_message(_gradient_from(peer, step=1, link_bw=1e6, hidden=64))
    _step(strategy)
    assert set(strategy.observations().link_ratio.values()) == {1.0}
    # Our own uplink: the step's messages left 0.1 s (100 bytes: about the latency) and
    # 1.1 s (2,500 bytes more) after it: 2,600 bytes in the 1 s beyond the latency.
    strategy.on_transfer("b", 100, 0.1)
    strategy.on_transfer("c", 2500, 1.1)
    assert strategy.stats()["uplink_bytes_per_s"] == pytest.approx(2600.0)
    _step(strategy)
    ratios = strategy.observations().link_ratio
    share = entries_for_budget(0.9 * 2600 / 2, total, 4, strategy.min_entries(total)) / total
    assert ratios == {"b": pytest.approx(share), "c": pytest.approx(share)} and share < 1
    assert strategy.counters["uplink_capped"] == 1


def test_before_a_report_the_produce_time_and_then_the_default_size_the_link():
    strategy = _strategy(initial_bandwidth=1e9)
    assert strategy.link_bandwidth("b") == 1e9
    strategy.on_transfer("b", 1000, 0.5)
    assert strategy.link_bandwidth("b") == pytest.approx(2000.0)
    strategy.on_message(_gradient_from("b", step=1, link_bw=5000.0))
    assert strategy.link_bandwidth("b") == 5000.0  # the receiver's end-to-end measurement wins
    strategy.on_transfer(None, 10, 1.0)  # a broadcast, not a link
    strategy.on_transfer("stranger", 10, 1.0)
    assert strategy.stats()["links"]["b"]["bytes_sent"] == 1000


def test_arrivals_measure_the_inbound_link_and_the_estimate_goes_back_to_the_sender():
    strategy = _strategy(link_alpha=1.0)
    strategy.on_arrival("b", 4000, 0.5)
    strategy.on_arrival("stranger", 4000, 0.5)
    out = {o.to: o.message for o in _step(strategy)}
    assert out["b"].meta["link_bw"] == pytest.approx(8000.0) and "link_bw" not in out["c"].meta


def test_without_prioritised_exchange_every_peer_gets_the_whole_gradient_dense():
    strategy = _strategy(prioritised=False, initial_bandwidth=1.0)
    out = _step(strategy)
    assert all(o.message.meta["compress"] is False and "sparse" not in o.message.meta for o in out)
    assert set(strategy.observations().link_ratio.values()) == {1.0}


# -- aggregation, lag bound, duplicates ----------------------------------------------------------


def test_peer_gradients_are_applied_at_once_weighted_by_their_batch_share():
    strategy = _strategy(members=("a", "b"), batch_size=8)
    before = _flat(strategy.trainer.get_parameters())
    strategy.on_message(_gradient_from("b", step=1, value=1.0, batch=24))
    moved = before - _flat(strategy.trainer.get_parameters())
    # lr 0.1 x 24 / (24 + 8): b's latest batch and ours.
    assert torch.allclose(moved, torch.full_like(moved, 0.1 * 24 / 32), atol=1e-6)
    assert strategy.staleness.summary()["count"] == 1
    strategy.on_message(_gradient_from("b", step=1, value=1.0, batch=24))  # a duplicate
    strategy.on_message(_gradient_from("z", step=1))  # not a member
    strategy.on_message(_gradient_from("a", step=1))  # our own
    assert strategy.counters["duplicate_gradients"] == 1 and strategy.counters["not_peer"] == 1
    assert torch.allclose(before - _flat(strategy.trainer.get_parameters()), moved)


def test_a_partial_gradient_moves_only_the_entries_it_carries():
    strategy = _strategy(members=("a", "b"))
    before = strategy.trainer.get_parameters()
    name = sorted(before)[0]
    partial = UpdateMessage(kind="gradient", sender="b", step=1, base_version=1, batch_size=8,
                            tensors={name: torch.ones_like(before[name])})
    strategy.on_message(partial)
    after = strategy.trainer.get_parameters()
    assert not torch.equal(after[name], before[name])
    assert all(torch.equal(after[n], before[n]) for n in before if n != name)
    assert strategy.accepts_partial("gradient") and not strategy.accepts_partial("model")


def test_the_lag_bound_blocks_until_every_peer_is_close_enough():
    strategy = _strategy(max_lag=1)
    _step(strategy)
    assert strategy.can_train()
    _step(strategy)
    assert strategy.lag_blocked() and not strategy.can_train()
    strategy.on_message(_gradient_from("b", step=1))
    assert not strategy.can_train()  # c is still at 0
    strategy.on_message(_gradient_from("c", step=1))
    assert strategy.can_train()
    assert strategy.observations().neighbour_lag == {"b": 1, "c": 1}


# -- knowledge transfer ------------------------------------------------------------------------


def test_the_best_worker_sends_its_model_to_peers_well_below_it_every_k_iterations():
    strategy = _strategy(transfer_every=2, transfer_gap=0.05, max_lag=None)
    strategy.on_evaluation(0.9, 0.3)
    strategy.on_message(_gradient_from("b", step=1, score=0.88))
    strategy.on_message(_gradient_from("c", step=1, score=0.5))
    assert [o.message.kind for o in _step(strategy)] == ["gradient", "gradient"]  # iteration 1: no round
    out = _step(strategy)
    models = [o for o in out if o.message.kind == "model"]
    assert [(o.to, o.message.meta["transfer"], o.message.meta["score"]) for o in models] == [("c", 1, 0.9)]
    assert strategy.stats()["transfers_out"] == {"c": 1}
    # Not the best: sends nothing.
    other = _strategy(transfer_every=1, max_lag=None)
    other.on_evaluation(0.5, 1.0)
    other.on_message(_gradient_from("b", step=1, score=0.9))
    assert all(o.message.kind == "gradient" for o in _step(other))


def test_score_ties_go_to_the_smallest_id():
    a = _strategy("a", transfer_every=1, max_lag=None)
    b = _strategy("b", transfer_every=1, max_lag=None)
    for strategy, peer in ((a, "b"), (b, "a")):
        strategy.on_evaluation(0.9, 0.1)
        strategy.on_message(_gradient_from(peer, step=1, score=0.9))
        strategy.on_message(_gradient_from("c", step=1, score=0.2))
    assert [o.to for o in _step(a) if o.message.kind == "model"] == ["c"]
    assert [o.to for o in _step(b) if o.message.kind == "model"] == []


def test_a_transferred_model_is_merged_with_lambda_once_and_only_if_it_is_better():
    strategy = _strategy(transfer_lambda=0.25)
    strategy.on_evaluation(0.4, 1.0)
    own = _flat(strategy.trainer.get_parameters())
    best = _model_from("b", seed=3, step=5, transfer=2, score=0.9)
    version = strategy.trainer.version
    strategy.on_message(best)
    assert torch.allclose(_flat(strategy.trainer.get_parameters()), 0.75 * own + 0.25 * _flat(best.tensors), atol=1e-6)
    assert strategy.trainer.version == version + 1
    merged = _flat(strategy.trainer.get_parameters())
    strategy.on_message(best)  # a duplicate of that round
    assert torch.equal(_flat(strategy.trainer.get_parameters()), merged)
    strategy.on_evaluation(0.95, 0.1)  # we got better meanwhile: a later transfer is declined
    strategy.on_message(_model_from("b", seed=3, step=9, transfer=3, score=0.9))
    assert torch.equal(_flat(strategy.trainer.get_parameters()), merged)
    assert strategy.counters["transfers_merged"] == 1 and strategy.counters["transfers_declined"] == 1
    assert strategy.counters["duplicate_transfers"] == 1
    assert strategy.observations().knowledge_transfers == {"b": 1.0}
    strategy.on_message(_model_from("c", seed=1))  # neither a transfer nor an adoption
    assert strategy.counters["ignored_models"] == 1


def test_without_knowledge_transfer_no_model_is_sent():
    strategy = _strategy(knowledge_transfer=False, transfer_every=1, max_lag=None)
    strategy.on_evaluation(0.9, 0.1)
    strategy.on_message(_gradient_from("c", step=1, score=0.1))
    assert all(o.message.kind == "gradient" for o in _step(strategy))


# -- restarts, joiners, membership ----------------------------------------------------------------


def test_a_restored_worker_asks_one_peer_for_its_model_and_adopts_it():
    a = _strategy(max_lag=2)
    _step(a)
    saved = a.state_dict()
    restored = _strategy(seed=5, max_lag=2)
    restored.load_state_dict(saved)
    hellos = restored.on_restore()
    assert sorted((o.to, o.message.kind, o.message.meta["op"], o.message.meta["ask"], o.message.meta["incarnation"])
                  for o in hellos) == [("b", "control", "hello", "b", 1), ("c", "control", "hello", "b", 1)]
    b, c = _strategy("b", seed=1, max_lag=None), _strategy("c", seed=2, max_lag=None)
    for _ in range(4):
        _step(b)
    b.on_message(_gradient_from("a", step=1, incarnation=0))  # before the restart
    answers = [b.on_message(next(o.message for o in hellos if o.to == "b")),
               c.on_message(next(o.message for o in hellos if o.to == "c"))]
    assert answers[1] == [] and [o.message.meta["adopt"] for o in answers[0]] == [True]
    assert b.counters["peer_restarts"] == 1 and "a" not in b._links
    b.on_message(_gradient_from("a", step=2, incarnation=0))  # a late one of the old incarnation
    assert b.counters["old_incarnation"] == 1
    restored.on_message(answers[0][0].message)
    assert torch.equal(_flat(restored.trainer.get_parameters()), _flat(b.trainer.get_parameters()))
    assert restored.iteration == 4 and restored.counters["adopted_models"] == 1
    # Peers' older gradients are in the adopted model: it does not wait for them (max_lag 2).
    assert restored.stats()["iteration"] == 4 and all(restored._peers[p].steps.floor >= 2 for p in ("b", "c"))
    restored.on_message(answers[0][0].message)  # a second copy is not adopted again
    assert restored.counters["adopted_models"] == 1


def test_a_joiner_asks_for_a_model_and_waits_for_it():
    joiner = _strategy("d", members=("a", "b", "d"), joining=True, max_lag=None)
    assert not joiner.can_train()
    out = joiner.poll(0.0)
    assert [(o.to, o.message.meta["ask"]) for o in out] == [("a", "a")]
    assert joiner.poll(1.0) == []  # asked once
    joiner.on_message(_gradient_from("a", step=3))  # before the model: its model will hold it
    assert joiner.counters["gradients_before_model"] == 1
    joiner.on_message(_model_from("a", seed=4, step=3, adopt=True))
    assert joiner.can_train() and joiner.iteration == 3


def test_a_worker_far_behind_a_peer_asks_it_for_its_model_once():
    strategy = _strategy(max_lag=2)
    assert strategy.on_message(_gradient_from("b", step=3)) == []  # within max_lag + 1
    out = strategy.on_message(_gradient_from("b", step=9))
    assert [(o.to, o.message.kind, o.message.meta["ask"]) for o in out] == [("b", "control", "b")]
    assert strategy.on_message(_gradient_from("c", step=12)) == []  # asked already
    strategy.on_message(_model_from("b", seed=3, step=9, adopt=True))
    assert strategy.iteration == 9 and strategy.counters["adopted_models"] == 1 and strategy.can_train()


def test_membership_changes_drop_departed_peers_and_scale_the_total_batch():
    strategy = _strategy(batch_size=10)
    strategy.on_transfer("c", 100, 1.0)
    _step(strategy)
    strategy.on_membership(["a", "b"])
    assert strategy.peers == ("b",) and "c" not in strategy.observations().link_ratio
    assert strategy.balancer.total_batch == 20
    assert strategy.on_membership(["a", "b"]) == []


@pytest.mark.parametrize("bad", [
    {"max_lag": -1}, {"lr_scale": 0.0}, {"batch_size": 0}, {"min_batch": 9, "max_batch": 8},
    {"rebalance_every": 0}, {"transfer_every": 0}, {"link_alpha": 0.0}, {"budget_safety": 1.5},
    {"min_ratio": 0.0}, {"transfer_lambda": 2.0}, {"max_in_flight": 0}, {"rebalance_threshold": -0.1}, {"initial_bandwidth": math.inf},
])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(StrategyError):
        _strategy(**bad)


# -- on the bus: learns, partial messages on the wire, state ----------------------------------------


def _cluster(bus: FakeBus, count: int = 3, **params) -> list[Node]:
    names = tuple(f"n{k}" for k in range(count))
    features, labels = _data()
    return [build_node(bus, name, "dlion", _trainer(seed=0, momentum=0.5, hidden=64), members=names,
                       batches=BatchStream(features, labels, 8, seed=k), **params)
            for k, name in enumerate(names)]


def test_a_cluster_with_narrow_links_learns_and_sends_partial_messages():
    bus = FakeBus(seed=3)
    # 1 kB/s for a 1.8 kB gradient: messages carry part of the entries (at least 10 %).
    nodes = _cluster(bus, initial_bandwidth=1000.0, initial_iteration_s=1.0, min_ratio=0.1)
    drive(bus, nodes, steps=40, periods={"n0": 1, "n1": 1, "n2": 2}, rng=np.random.default_rng(0))
    features, labels = _data(seed=9)
    for node in nodes:
        assert evaluate(node.trainer.model, features, labels).accuracy >= 0.8, node.name
        ratios = node.strategy.observations().link_ratio
        assert ratios and all(0.1 <= r < 1 for r in ratios.values()), (node.name, ratios)
