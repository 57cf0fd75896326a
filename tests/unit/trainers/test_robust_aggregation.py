"""Robust aggregation: coordinate-wise median and trimmed mean, the per-update norm bound,
and how BSP, the ASP server and the ADSP server use them against Byzantine workers."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from edgestream.trainers.aggregation import (
    RobustAggregation,
    UpdateWindow,
    coordinate_median,
    krum_select,
    trimmed_mean,
    update_norm,
    weighted_mean,
)
from edgestream.trainers.byzantine import ATTACKS, byzantine, corrupt
from edgestream.trainers.errors import AggregationError, StrategyError
from edgestream.trainers.evaluation import evaluate
from edgestream.trainers.messages import UpdateMessage
from tests.unit.trainers.fakes import (
    BatchStream,
    FakeBus,
    FakeClock,
    build_node,
    drive_async,
    drive_bsp,
    pump,
)

FIVE = ("w0", "w1", "w2", "w3", "w4")


def _column(*values: float) -> list[dict[str, torch.Tensor]]:
    """One contribution per value, each a 1-entry tensor ``x`` (one coordinate)."""
    return [{"x": torch.tensor([v])} for v in values]


# -- the pure rules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "expected"),
    [((3.0, -1.0, 7.0), 3.0), ((3.0, -1.0, 7.0, 100.0), 5.0), ((2.0,), 2.0), ((4.0, 4.0, -9.0), 4.0)],
)
def test_coordinate_median_is_the_middle_value_or_the_mean_of_the_two_middle_ones(values, expected):
    assert coordinate_median(_column(*values))["x"].item() == expected


def test_median_and_trimmed_mean_work_coordinate_by_coordinate():
    contributions = [
        {"w": torch.tensor([1.0, 50.0]), "b": torch.tensor([[0.0]])},
        {"w": torch.tensor([2.0, -7.0]), "b": torch.tensor([[-1.0]])},
        {"w": torch.tensor([900.0, 3.0]), "b": torch.tensor([[9.0]])},
    ]

    median = coordinate_median(contributions)
    trimmed = trimmed_mean(contributions, trim=1)

    assert median["w"].tolist() == [2.0, 3.0] and median["b"].tolist() == [[0.0]]
    assert trimmed["w"].tolist() == [2.0, 3.0] and trimmed["b"].tolist() == [[0.0]]


def test_trimmed_mean_drops_trim_values_at_each_end_and_averages_the_rest():
    assert trimmed_mean(_column(1.0, 2.0, 3.0, 100.0, -50.0), trim=1)["x"].item() == 2.0
    assert trimmed_mean(_column(1.0, 2.0, 6.0, 100.0, -50.0), trim=2)["x"].item() == 2.0
    assert trimmed_mean(_column(1.0, 2.0, 6.0, 100.0, -50.0), trim=0)["x"].item() == pytest.approx(59.0 / 5)


def test_weighted_trimmed_mean_weights_only_the_values_it_keeps():
    # Kept: 2 (weight 1) and 6 (weight 3); the trimmed ends carry huge weights and count for nothing.
    result = trimmed_mean(_column(-40.0, 2.0, 6.0, 90.0), trim=1, weights=[1000.0, 1.0, 3.0, 1000.0])

    assert result["x"].item() == pytest.approx((2.0 * 1 + 6.0 * 3) / 4)


def test_weighted_trimmed_mean_breaks_ties_by_contribution_order():
    # Three equal values: which one is kept decides the weight; the stable order keeps the middle one.
    result = trimmed_mean(_column(5.0, 5.0, 5.0), trim=1, weights=[1.0, 2.0, 3.0])

    assert result["x"].item() == 5.0


@pytest.mark.parametrize(("count", "trim"), [(2, 1), (4, 2), (1, 1), (5, 3)])
def test_a_trim_that_leaves_no_contribution_is_a_clear_error(count, trim):
    with pytest.raises(AggregationError, match=f"needs at least {2 * trim + 1} contributions"):
        trimmed_mean(_column(*range(count)), trim=trim)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: trimmed_mean(_column(1.0, 2.0, 3.0), trim=-1), "trim must be"),
        (lambda: trimmed_mean(_column(1.0, 2.0, 3.0), trim=1, weights=[1.0, 0.0, 1.0]), "weights"),
        (lambda: trimmed_mean(_column(1.0, 2.0, 3.0), trim=1, weights=[1.0]), "weights"),
        (lambda: coordinate_median([]), "no contributions"),
        (lambda: coordinate_median([{"x": torch.zeros(2)}, {"y": torch.zeros(2)}]), "names"),
        (lambda: coordinate_median([{"x": torch.zeros(2)}, {"x": torch.zeros(3)}]), "shape"),
    ],
)
def test_the_robust_rules_reject_inputs_that_do_not_line_up(call, message):
    with pytest.raises(AggregationError, match=message):
        call()


def test_robust_rules_leave_their_inputs_alone_and_are_bitwise_reproducible():
    generator = torch.Generator().manual_seed(3)
    contributions = [{"w": torch.randn(40, generator=generator)} for _ in range(5)]
    copies = [{k: v.clone() for k, v in c.items()} for c in contributions]

    for rule in (lambda c: coordinate_median(c), lambda c: trimmed_mean(c, 2), lambda c: trimmed_mean(c, 1, [1, 2, 3, 4, 5])):
        assert torch.equal(rule(contributions)["w"], rule(copies)["w"])
    assert all(torch.equal(c["w"], k["w"]) for c, k in zip(contributions, copies, strict=True))


def test_update_norm_is_the_l2_norm_over_every_tensor_whatever_the_name_order():
    a = {"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([[4.0]])}
    b = {"b": torch.tensor([[4.0]]), "w": torch.tensor([3.0, 0.0])}

    assert update_norm(a) == update_norm(b) == 5.0


def test_the_norm_bound_clips_to_the_bound_or_rejects_and_keeps_what_is_within():
    update = {"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}  # norm 5
    clip = RobustAggregation.from_params(max_update_norm=2.0, norm_policy="clip")
    reject = RobustAggregation.from_params(max_update_norm=2.0, norm_policy="reject")
    loose = RobustAggregation.from_params(max_update_norm=5.0, norm_policy="reject")

    clipped, rejected, kept = clip.bound(update), reject.bound(update), loose.bound(update)

    assert clipped.action == "clipped" and clipped.norm == 5.0
    assert update_norm(clipped.tensors) == pytest.approx(2.0)
    torch.testing.assert_close(clipped.tensors["w"], torch.tensor([1.2, 0.0]))
    assert rejected.action == "rejected" and rejected.tensors is None
    assert kept.action == "kept" and kept.tensors["w"] is update["w"]
    assert update["w"].tolist() == [3.0, 0.0]  # the input is left alone


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"aggregation": "geomedian"}, "aggregation must be one of"),
        ({"aggregation": "median", "krum_f": 1}, "krum_f applies to aggregation=krum"),
        ({"aggregation": "krum", "krum_f": -1}, "krum_f must be an int >= 0"),
        ({"aggregation": "krum", "krum_f": 1.5}, "krum_f must be an int >= 0"),
        ({"aggregation": "median", "trim": 1}, "trim applies to aggregation=trimmed_mean"),
        ({"aggregation": "trimmed_mean", "trim": 0}, "trim must be an int >= 1"),
        ({"aggregation": "trimmed_mean", "trim": True}, "trim must be an int >= 1"),
        ({"max_update_norm": 0}, "max_update_norm must be finite and > 0"),
        ({"max_update_norm": math.inf}, "max_update_norm must be finite and > 0"),
        ({"max_update_norm": "10"}, "max_update_norm must be a number"),
        ({"norm_policy": "drop"}, "norm_policy must be one of"),
    ],
)
def test_robust_parameters_are_checked(params, message):
    with pytest.raises(AggregationError, match=message):
        RobustAggregation.from_params(**params)


def test_trimmed_mean_defaults_to_trim_1_and_trims_less_when_fewer_contributions_are_there():
    rule = RobustAggregation.from_params(aggregation="trimmed_mean")

    assert (rule.trim, rule.min_contributions) == (1, 3)
    assert [rule.effective_trim(n) for n in (1, 2, 3, 7)] == [0, 0, 1, 1]
    assert rule.combine(_column(1.0, 5.0), [1, 1])["x"].item() == 3.0  # two left: their mean


def test_krum_leaves_out_whole_updates_that_point_away_from_the_others():
    torch.manual_seed(0)
    direction = torch.randn(50)
    honest = [{"w": direction + 0.3 * torch.randn(50), "b": torch.randn(3)} for _ in range(5)]
    flipped = [{name: -t for name, t in honest[0].items()}, {name: -t for name, t in honest[1].items()}]
    contributions = [flipped[0], *honest[:3], flipped[1], *honest[3:]]  # attackers at 0 and 4

    assert krum_select(contributions, 2) == [1, 2, 3, 5, 6]
    rule = RobustAggregation.from_params(aggregation="krum", krum_f=2)
    expected = trimmed_mean(honest, 0)
    torch.testing.assert_close(rule.combine(contributions, [64] * 7)["w"], expected["w"])


def test_krum_takes_the_buffers_of_the_updates_it_keeps():
    contributions = _column(1.0, 1.1, 0.9, 1.05, 50.0)
    buffers = [{"running_mean": torch.tensor([float(i)])} for i in range(5)]
    rule = RobustAggregation.from_params(aggregation="krum")  # krum_f 1: keeps 4 of 5

    tensors, combined = rule.aggregate(contributions, buffers, [8] * 5)

    assert rule.select(contributions) == [0, 1, 2, 3]
    assert tensors["x"].item() == pytest.approx(1.0125)
    assert combined["running_mean"].item() == pytest.approx(1.5)  # the mean of buffers 0-3
    # Only the kept updates' buffers count: the left-out one may lack them, a kept one may not.
    assert rule.aggregate(contributions, [*buffers[:4], None], [8] * 5)[1]["running_mean"].item() == 1.5
    assert rule.aggregate(contributions, [buffers[0], None, *buffers[2:]], [8] * 5)[1] is None


def test_krum_needs_2f_plus_3_updates_keeps_all_below_3_and_breaks_ties_by_order():
    rule = RobustAggregation.from_params(aggregation="krum", krum_f=2)

    assert (rule.krum_f, rule.min_contributions, rule.requirement) == (2, 7, "aggregation=krum with krum_f=2")
    assert [rule.effective_krum_f(n) for n in (1, 2, 3, 4, 5, 7, 9)] == [-1, -1, 0, 0, 1, 2, 2]
    assert rule.select(_column(1.0, 9.0)) == [0, 1]
    assert rule.combine(_column(1.0, 9.0), [1, 1])["x"].item() == 5.0
    assert krum_select(_column(2.0, 2.0, 2.0, 2.0), 0) == [0, 1, 2, 3]
    assert krum_select(_column(2.0, 2.0, 2.0, 2.0, 2.0), 1) == [0, 1, 2, 3]  # ties: the earlier ones
    with pytest.raises(AggregationError, match="needs at least 7 contributions, got 6"):
        krum_select(_column(*range(6)), 2)
    assert RobustAggregation.from_params(aggregation="krum").describe()["krum_f"] == 1


def test_the_robust_global_batch_ignores_one_inflated_batch_size_claim():
    mean = RobustAggregation.from_params()
    median = RobustAggregation.from_params(aggregation="median")
    trimmed = RobustAggregation.from_params(aggregation="trimmed_mean")
    claims = [64, 60, 70, 10**6]

    assert mean.global_batch(claims) == sum(claims)
    assert median.global_batch(claims) == 4 * 67
    assert trimmed.global_batch(claims) == 4 * 67
    assert median.global_batch([]) == 0


@pytest.mark.parametrize(("fold", "expected"), [("mean", 3.0), ("sum", 6.0)])
def test_an_update_window_folds_a_senders_updates_into_one_slot(fold, expected):
    window = UpdateWindow(fold)
    window.add("w1", {"x": torch.tensor([2.0])}, None, base_version=4, samples=8)
    window.add("w0", {"x": torch.tensor([9.0])}, None, base_version=5, samples=8)
    window.add("w1", {"x": torch.tensor([4.0])}, None, base_version=6, samples=16)

    assert len(window) == 2
    slots = window.take()

    assert [s.sender for s in slots] == ["w0", "w1"]
    assert slots[1].tensors["x"].item() == expected
    assert (slots[1].count, slots[1].base_versions, slots[1].samples) == (2, [4, 6], 24)
    assert len(window) == 0


def test_an_update_window_round_trips_through_its_state():
    window = UpdateWindow("sum")
    window.add("w0", {"x": torch.tensor([1.5])}, {"m": torch.tensor([0.5])}, base_version=1, samples=3)
    copy = UpdateWindow("sum")

    copy.load_state_dict(window.state_dict())

    (slot,) = copy.take()
    assert (slot.sender, slot.tensors["x"].item(), slot.buffers["m"].item(), slot.samples) == ("w0", 1.5, 0.5, 3)


# -- the attacker --------------------------------------------------------------------------


@pytest.mark.parametrize("attack", ATTACKS)
def test_every_attack_stays_finite_and_shaped(attack):
    gradient = {"w": torch.tensor([[0.3, -0.4], [1.0, 0.0]]), "b": torch.tensor([2.0])}

    corrupted = corrupt(gradient, attack, torch.Generator().manual_seed(0))

    assert {n: t.shape for n, t in corrupted.items()} == {n: t.shape for n, t in gradient.items()}
    assert all(torch.isfinite(t).all() for t in corrupted.values())
    norm = update_norm(gradient)
    expected = {"sign_flip": norm, "scale100": 100 * norm, "noise": norm}[attack]
    assert update_norm(corrupted) == pytest.approx(expected, rel=1e-5)
    if attack == "sign_flip":
        assert torch.equal(corrupted["w"], -gradient["w"])


def test_a_byzantine_worker_corrupts_only_its_own_outgoing_gradients(make_node, digits):
    node = make_node("w0", "bsp", members=("w0",), data=digits.shards(1)[0])
    attacker = byzantine(node.strategy, "sign_flip")
    result = node.trainer.compute_gradient(*next(node.batches))

    (out,) = attacker.on_local_step(result)

    assert out.message.sender == "w0" and out.message.kind == "gradient"
    for name, tensor in result.gradients.items():
        assert torch.equal(out.message.tensors[name], -tensor)
    (view,) = attacker.on_membership(["w0", "w1"])  # a control message: passed on as it is
    assert view.message.kind == "control" and view.message.meta["members"] == ["w0", "w1"]
    assert attacker.stats()["counters"]["byzantine_corrupted"] == 1
    assert attacker.can_train() is False  # everything else is the wrapped strategy's


# -- BSP ---------------------------------------------------------------------------------------


def _bsp_cluster(make_node, digits, names=FIVE, *, byzantine_workers=(), attack="scale100", **params):
    shards = digits.shards(len(names))
    nodes = [make_node(n, "bsp", members=names, data=shards[i], **params) for i, n in enumerate(names)]
    for node in nodes:
        if node.name in byzantine_workers:
            node.driver.strategy = byzantine(node.driver.strategy, attack)
    return nodes


def _one_bsp_step(bus, nodes):
    """Every node computes one gradient; all messages go round. Returns the results by worker."""
    results = {}
    for node in nodes:
        results[node.name] = node.trainer.compute_gradient(*next(node.batches))
        bus.publish(node.name, node.strategy.on_local_step(results[node.name]))
    for node in nodes:
        pump(bus, node)
    return results


@pytest.mark.parametrize("aggregation", ["median", "trimmed_mean"])
def test_a_bsp_step_applies_the_robust_aggregate_in_sorted_worker_order(bus, make_node, digits, aggregation):
    nodes = _bsp_cluster(make_node, digits, ("w2", "w0", "w1"), momentum=0.0, lr=0.1, aggregation=aggregation)
    start = nodes[0].trainer.get_parameters()

    results = _one_bsp_step(bus, nodes)

    ordered = [results[name].gradients for name in ("w0", "w1", "w2")]
    expected = coordinate_median(ordered) if aggregation == "median" else trimmed_mean(ordered, 1)
    for node in nodes:
        assert node.trainer.version == 1
        for name, param in node.trainer.get_parameters().items():
            torch.testing.assert_close(param, start[name] - 0.1 * expected[name])
    assert len({n.trainer.parameter_digest() for n in nodes}) == 1


def test_bsp_clips_every_update_above_the_bound_and_counts_it_per_sender(bus, make_node, digits):
    nodes = _bsp_cluster(make_node, digits, ("w0", "w1", "w2"), momentum=0.0, lr=0.1, max_update_norm=1e-3)
    start = nodes[0].trainer.get_parameters()

    results = _one_bsp_step(bus, nodes)

    clipped = [{n: g * (1e-3 / update_norm(r.gradients)) for n, g in r.gradients.items()}
               for r in (results[w] for w in ("w0", "w1", "w2"))]
    expected = weighted_mean(clipped, [results[w].batch_size for w in ("w0", "w1", "w2")])
    for node in nodes:
        counters = node.strategy.stats()["counters"]
        assert counters["updates_clipped"] == 3
        assert all(counters[f"updates_clipped:{w}"] == 1 for w in ("w0", "w1", "w2"))
        for name, param in node.trainer.get_parameters().items():
            torch.testing.assert_close(param, start[name] - 0.1 * expected[name])


def test_a_rejected_bsp_update_counts_as_absent_and_the_step_still_completes(bus, make_node, digits):
    # The scaled attacker's gradient is far above the bound, the honest ones far below it.
    nodes = _bsp_cluster(make_node, digits, ("w0", "w1", "w2"), byzantine_workers=("w2",), momentum=0.0,
                         lr=0.1, max_update_norm=5.0, norm_policy="reject")
    start = nodes[0].trainer.get_parameters()

    results = _one_bsp_step(bus, nodes)

    expected = weighted_mean([results["w0"].gradients, results["w1"].gradients],
                             [results["w0"].batch_size, results["w1"].batch_size])
    for node in nodes:
        stats = node.strategy.stats()
        assert node.trainer.version == 1 and node.strategy.can_train()
        assert stats["counters"]["updates_rejected"] == stats["counters"]["updates_rejected:w2"] == 1
        assert stats["staleness"]["count"] == 2  # only the applied contributions
        for name, param in node.trainer.get_parameters().items():
            torch.testing.assert_close(param, start[name] - 0.1 * expected[name])
    assert len({n.trainer.parameter_digest() for n in nodes}) == 1


def test_a_bsp_step_whose_updates_are_all_rejected_moves_only_the_version(bus, make_node, digits):
    nodes = _bsp_cluster(make_node, digits, ("w0", "w1"), max_update_norm=1e-9, norm_policy="reject")
    start = nodes[0].trainer.parameter_digest()

    _one_bsp_step(bus, nodes)

    for node in nodes:
        assert node.trainer.version == 1 and node.trainer.parameter_digest() == start
        assert node.strategy.stats()["counters"]["steps_without_update"] == 1


def test_a_trimmed_mean_over_too_few_kept_updates_trims_less_and_counts_it(bus, make_node, digits):
    nodes = _bsp_cluster(make_node, digits, ("w0", "w1", "w2"), byzantine_workers=("w2",), momentum=0.0,
                         lr=0.1, aggregation="trimmed_mean", max_update_norm=5.0, norm_policy="reject")
    start = nodes[0].trainer.get_parameters()

    results = _one_bsp_step(bus, nodes)

    expected = trimmed_mean([results["w0"].gradients, results["w1"].gradients], 0)
    for node in nodes:
        assert node.strategy.stats()["counters"]["trim_reduced"] == 1
        for name, param in node.trainer.get_parameters().items():
            torch.testing.assert_close(param, start[name] - 0.1 * expected[name])


@pytest.mark.parametrize("strategy", ["bsp", "scadles"])
@pytest.mark.parametrize("params", [{"aggregation": "median"}, {"aggregation": "krum"},
                                    {"aggregation": "trimmed_mean", "max_update_norm": 5.0, "norm_policy": "reject"}])
def test_bsp_replicas_stay_bitwise_identical_under_robust_aggregation_and_attack(
    bus, make_node, digits, strategy, params
):
    shards = digits.shards(len(FIVE))
    nodes = [make_node(n, strategy, members=FIVE, data=shards[i], batch_size=16 + 8 * i, **params)
             for i, n in enumerate(FIVE)]
    nodes[4].driver.strategy = byzantine(nodes[4].driver.strategy, "scale100")

    drive_bsp(bus, nodes, target_version=12, rng=np.random.default_rng(7))

    assert len({n.trainer.parameter_digest() for n in nodes}) == 1
    counters = [n.strategy.stats()["counters"] for n in nodes]
    decisions = [{k: v for k, v in c.items() if k.startswith(("updates_", "trim_", "steps"))} for c in counters]
    assert all(d == decisions[0] for d in decisions)  # the same decisions on every replica
    if "max_update_norm" in params:
        assert decisions[0]["updates_rejected:w4"] == 12  # the attacker, every step


def test_bsp_replicas_stay_identical_under_duplicated_and_reordered_delivery(make_trainer, digits):
    bus = FakeBus(jitter=0.7, duplicate=True, seed=5)
    shards = digits.shards(len(FIVE))
    nodes = [build_node(bus, n, "bsp", make_trainer(), members=FIVE, aggregation="trimmed_mean",
                        max_update_norm=5.0, norm_policy="clip",
                        batches=BatchStream(*shards[i], 16 + 8 * i, seed=i)) for i, n in enumerate(FIVE)]
    nodes[0].driver.strategy = byzantine(nodes[0].driver.strategy, "scale100")

    drive_bsp(bus, nodes, target_version=10, rng=np.random.default_rng(11))

    assert len({n.trainer.parameter_digest() for n in nodes}) == 1
    assert all(n.strategy.stats()["counters"]["updates_clipped:w0"] == 10 for n in nodes)
    assert all(n.strategy.stats()["counters"]["duplicates"] > 0 for n in nodes)


def test_bsp_refuses_a_trim_the_job_cannot_satisfy(make_node):
    with pytest.raises(StrategyError, match="needs at least 5 workers per step, the job starts with 3"):
        make_node("w0", "bsp", members=("w0", "w1", "w2"), aggregation="trimmed_mean", trim=2)
    with pytest.raises(StrategyError, match="krum with krum_f=1 needs at least 5 workers per step"):
        make_node("w0", "bsp", members=("w0", "w1", "w2"), aggregation="krum")


def _bsp_accuracy(bus, make_node, digits, **params):
    nodes = _bsp_cluster(make_node, digits, byzantine_workers=("w4",), attack="scale100", **params)
    drive_bsp(bus, nodes, target_version=30)
    return evaluate(nodes[0].trainer.model, digits.x_test, digits.y_test).accuracy


def test_a_scaled_byzantine_worker_ruins_the_bsp_mean(bus, make_node, digits):
    assert _bsp_accuracy(bus, make_node, digits) < 0.3


@pytest.mark.parametrize("params", [{"aggregation": "trimmed_mean"}, {"aggregation": "median"},
                                    {"aggregation": "krum"}, {"max_update_norm": 1.0}])
def test_bsp_with_a_robust_rule_learns_despite_a_scaled_byzantine_worker(
    bus, make_node, digits, params, record_property
):
    accuracy = _bsp_accuracy(bus, make_node, digits, **params)
    record_property("held_out_accuracy", accuracy)
    assert accuracy >= 0.85


# -- the ASP server -------------------------------------------------------------------------


def _asp_job(make_node, digits, names=FIVE, **server_params):
    server = make_node("server", "asp", role="server", members=names, lr=0.1, momentum=0.0, **server_params)
    shards = digits.shards(len(names))
    workers = [make_node(n, "asp", data=shards[i], lr=0.1, momentum=0.0) for i, n in enumerate(names)]
    return server, workers


def _asp_gradient(worker, step):
    result = worker.trainer.compute_gradient(*next(worker.batches))
    msg = worker.strategy.on_local_step(result)[0].message
    return dataclasses.replace(msg, step=step)


@pytest.mark.parametrize("aggregation", ["median", "trimmed_mean"])
def test_the_asp_server_applies_one_robust_aggregate_per_full_window(make_node, digits, aggregation):
    server, workers = _asp_job(make_node, digits, ("w0", "w1", "w2"), aggregation=aggregation)
    start = server.trainer.get_parameters()
    first = [_asp_gradient(w, 0) for w in workers]
    again = _asp_gradient(workers[0], 1)

    assert server.strategy.on_message(first[0]) == [] and server.strategy.on_message(again) == []
    assert server.strategy.on_message(first[1]) == []
    assert server.trainer.version == 0  # two slots of three
    out = server.strategy.on_message(first[2])

    w0_slot = {n: (first[0].tensors[n] + again.tensors[n]) / 2 for n in first[0].tensors}
    slots = [w0_slot, first[1].tensors, first[2].tensors]
    expected = coordinate_median(slots) if aggregation == "median" else trimmed_mean(slots, 1)
    assert server.trainer.version == 1 and [o.channel for o in out] == ["models"]
    for name, param in server.trainer.get_parameters().items():
        torch.testing.assert_close(param, start[name] - 0.1 * 3 * expected[name])
    stats = server.strategy.stats()
    assert stats["counters"]["applied"] == stats["staleness"]["count"] == 4
    assert stats["counters"]["windows"] == 1 and stats["window_senders"] == []


def test_the_asp_server_clips_and_rejects_updates_over_the_bound_and_counts_them(make_node, digits):
    clip_server, workers = _asp_job(make_node, digits, ("w0", "w1"), max_update_norm=1e-3)
    reject_server, _ = _asp_job(make_node, digits, ("w0", "w1"), max_update_norm=1e-3, norm_policy="reject")
    msg = _asp_gradient(workers[1], 0)

    clip_server.strategy.on_message(msg)
    before = reject_server.trainer.parameter_digest()
    out = reject_server.strategy.on_message(msg)

    assert clip_server.trainer.version == 1
    assert clip_server.strategy.stats()["counters"]["updates_clipped:w1"] == 1
    assert out == [] and reject_server.trainer.version == 0 and reject_server.trainer.parameter_digest() == before
    assert reject_server.strategy.stats()["counters"]["updates_rejected:w1"] == 1


def test_a_checkpoint_taken_mid_window_gives_the_same_continuation(make_node, digits):
    server, workers = _asp_job(make_node, digits, ("w0", "w1", "w2"), aggregation="median")
    copy, _ = _asp_job(make_node, digits, ("w0", "w1", "w2"), aggregation="median")
    messages = [_asp_gradient(w, 0) for w in workers]
    server.strategy.on_message(messages[0])
    copy.strategy.load_state_dict(server.strategy.state_dict())

    for target in (server, copy):
        target.strategy.on_message(messages[1])
        target.strategy.on_message(messages[2])

    assert copy.trainer.version == server.trainer.version == 1
    assert copy.trainer.parameter_digest() == server.trainer.parameter_digest()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"aggregation": "trimmed_mean", "trim": 3}, "needs at least 7 senders per aggregate, aggregate_window is 5"),
        ({"aggregation": "median", "aggregate_window": 0}, "aggregate_window must be an int >= 1"),
        ({"aggregation": "median", "mystery": 1}, "unknown asp parameters"),
    ],
)
def test_the_asp_server_refuses_robust_settings_it_cannot_honour(make_node, params, message):
    with pytest.raises(StrategyError, match=message):
        make_node("server", "asp", role="server", members=FIVE, **params)


def _asp_accuracy(bus, make_node, digits, attack, **server_params):
    server, workers = _asp_job(make_node, digits, **server_params)
    workers[4].driver.strategy = byzantine(workers[4].driver.strategy, attack)
    windowed = server_params.get("aggregation", "mean") != "mean"
    drive_async(bus, server, workers, [1, 1, 2, 2, 1], clock=FakeClock(), target_updates=40 if windowed else 150)
    return evaluate(server.trainer.model, digits.x_test, digits.y_test).accuracy


def test_a_scaled_byzantine_worker_ruins_plain_asp(bus, make_node, digits):
    assert _asp_accuracy(bus, make_node, digits, "scale100") < 0.3


@pytest.mark.parametrize("aggregation", ["trimmed_mean", "median", "krum"])
@pytest.mark.parametrize("attack", ["sign_flip", "scale100"])
def test_the_robust_asp_server_learns_despite_a_byzantine_worker(
    bus, make_node, digits, aggregation, attack, record_property
):
    accuracy = _asp_accuracy(bus, make_node, digits, attack, aggregation=aggregation)
    record_property("held_out_accuracy", accuracy)
    assert accuracy >= 0.85


# -- the ADSP server -------------------------------------------------------------------------


def _delta(sender: str, step: int, value: float, base_version: int = 0) -> UpdateMessage:
    shapes = {"w": (2,)}
    return UpdateMessage(kind="delta", sender=sender, step=step, base_version=base_version, batch_size=4,
                         tensors={n: torch.full(s, value) for n, s in shapes.items()}, meta={"loss": 1.0})


@pytest.fixture
def adsp_server():
    from edgestream.trainers.local import LocalTrainer
    from edgestream.trainers.strategies import StrategyContext, create

    def factory(**params):
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.zeros(2))
        trainer = LocalTrainer(model, lr=0.1, momentum=0.0)
        ctx = StrategyContext("server", trainer, role="server", members=("w0", "w1", "w2"))
        return create("adsp", ctx, search=False, **params)

    return factory


def test_the_adsp_server_sums_a_committers_deltas_and_applies_the_median_per_full_window(adsp_server):
    server = adsp_server(aggregation="median")

    assert server.on_message(_delta("w0", 0, 1.0)) == []
    assert server.on_message(_delta("w0", 1, 2.0)) == []  # w0's slot: 3
    assert server.on_message(_delta("w2", 0, 900.0)) == []
    out = server.on_message(_delta("w1", 0, 0.5))

    # slots 3, 0.5, 900: the median is 3; three of three workers: W += (3 / 3) * 3
    assert server.trainer.get_parameters()["w"].tolist() == [3.0, 3.0]
    assert server.trainer.version == 1
    assert sorted(o.to for o in out) == ["w0", "w1", "w2"] and {o.channel for o in out} == {"models"}
    assert server.stats()["counters"]["applied"] == 4


def test_the_adsp_server_rejects_a_commit_over_the_bound_and_answers_with_the_model(adsp_server):
    server = adsp_server(max_update_norm=1.0, norm_policy="reject")

    out = server.on_message(_delta("w1", 0, 100.0))

    assert server.trainer.version == 0 and server.trainer.get_parameters()["w"].tolist() == [0.0, 0.0]
    assert [(o.channel, o.to) for o in out] == [("models", "w1")]
    assert server.stats()["counters"]["updates_rejected:w1"] == 1


def test_the_adsp_server_clips_a_commit_over_the_bound(adsp_server):
    server = adsp_server(max_update_norm=math.sqrt(2) * 3)

    server.on_message(_delta("w1", 0, 30.0))

    # clipped to norm 3 sqrt(2) = (3, 3), divided by N = 3
    torch.testing.assert_close(server.trainer.get_parameters()["w"], torch.tensor([1.0, 1.0]))
    assert server.stats()["counters"]["updates_clipped"] == 1


def test_an_adsp_server_restored_mid_window_gives_the_same_continuation(adsp_server):
    server, copy = adsp_server(aggregation="median"), adsp_server(aggregation="median")
    server.on_message(_delta("w0", 0, 1.0))
    server.on_message(_delta("w2", 0, 4.0))
    copy.load_state_dict(server.state_dict())

    for target in (server, copy):
        target.on_message(_delta("w1", 0, 2.0))

    assert server.trainer.version == copy.trainer.version == 1
    assert copy.trainer.get_parameters()["w"].tolist() == server.trainer.get_parameters()["w"].tolist() == [2.0, 2.0]


def test_norm_bound_counts_reach_the_observations_per_sender():
    from collections import Counter

    from edgestream.trainers.strategies.base import Observations, norm_bound_observations

    counters = Counter({"updates_clipped": 3, "updates_clipped:w0": 2, "updates_clipped:w2": 1,
                        "updates_rejected:w1": 4, "steps": 9})
    observed = norm_bound_observations(counters)
    assert observed == {"updates_clipped": {"w0": 2.0, "w2": 1.0}, "updates_norm_rejected": {"w1": 4.0}}
    assert norm_bound_observations(Counter({"steps": 1})) == {"updates_clipped": None, "updates_norm_rejected": None}
    Observations(**observed)  # the vocabulary has the fields
