"""Adaptive controllers on scripted inputs: they switch exactly where they should."""

from __future__ import annotations

import math

import pytest
import torch

from edgestream.compression import registry
from edgestream.compression.controllers import (
    AccordionSwitch,
    BandwidthEstimator,
    ByteBudgetController,
    ScadlesSignal,
    ScadlesVote,
    compression_signal,
    scadles_signal,
    topk_norm,
)
from edgestream.compression.errors import CompressorConfigError
from edgestream.compression.memory import ErrorFeedback
from edgestream.compression.pipeline import GradientCodec

# ---- ScaDLES ----------------------------------------------------------------------


def test_signal_is_relative_gap_between_summed_norms():
    assert compression_signal([3.0, 4.0], [2.0, 4.0]) == pytest.approx(1 / 7)
    assert compression_signal([0.0, 0.0], [0.0, 0.0]) == 0.0


def test_topk_norm_keeps_the_largest_entries():
    assert topk_norm(torch.tensor([3.0, -4.0, 1.0, 0.5]), 0.5) == pytest.approx(5.0)
    assert topk_norm(torch.tensor([3.0, -4.0]), 1.0) == pytest.approx(5.0)


def test_signal_is_small_for_concentrated_and_large_for_spread_gradients():
    spiky = torch.zeros(1000)
    spiky[::100] = 10.0  # 10 entries carry everything; top-1% keeps them all
    flat = torch.ones(1000)
    assert scadles_signal({"w": spiky}, None, 0.01) == pytest.approx(0.0, abs=1e-6)
    assert scadles_signal({"w": flat}, None, 0.01) == pytest.approx(
        1 - math.sqrt(10) / math.sqrt(1000)
    )


def test_signal_uses_the_compensated_gradient():
    grads = {"w": torch.tensor([1.0, 0.0, 0.0, 0.0])}
    compensated = {"w": torch.tensor([1.0, 0.0, 0.0, 2.0])}
    # ||g|| = 1, ||top1(v)|| = 2
    assert scadles_signal(grads, compensated, 0.25) == pytest.approx(1.0)


def test_worker_votes_on_the_running_mean_of_the_epoch():
    signal = ScadlesSignal(delta=0.2)
    assert signal.vote() is False  # nothing observed yet: stay dense
    signal.observe(0.1)
    signal.observe(0.2)
    assert signal.epoch_mean == pytest.approx(0.15) and signal.vote() is True
    signal.observe(0.6)
    assert signal.epoch_mean == pytest.approx(0.3) and signal.vote() is False

    signal.new_epoch()
    assert signal.epoch_steps == 0
    assert (
        signal.epoch_mean == pytest.approx(0.3) and signal.vote() is False
    )  # falls back to last epoch
    signal.observe(0.05)
    assert signal.vote() is True  # the new epoch's mean alone decides
    assert signal.history() == [0.1, 0.2, 0.6, 0.05]


def test_mean_exactly_at_delta_votes_compress():
    signal = ScadlesSignal(delta=0.25)
    signal.observe(0.25)
    assert signal.vote() is True


@pytest.mark.parametrize(
    ("ballots", "compress"),
    [
        ([True, False], True),
        ([True, False, False], False),
        ([True, True, False], True),
        ([], False),
        ([False], False),
    ],
)
def test_majority_of_at_least_half_decides(ballots, compress):
    assert ScadlesVote().decide(ballots) is compress


def test_scripted_epoch_switches_on_the_expected_steps():
    # Per-step signals of three workers; running means cross delta = 0.25 at
    # different steps, and the decision flips when two of three agree.
    script = {
        "a": [0.4, 0.1, 0.1, 0.1],  # means .4 .25 .2 .175 -> F T T T
        "b": [0.1, 0.5, 0.5, 0.1],  # means .1 .3 .367 .3  -> T F F F
        "c": [0.3, 0.3, 0.0, 0.0],  # means .3 .3 .2 .15   -> F F T T
    }
    vote = ScadlesVote(delta=0.25)
    decisions = []
    for step in range(4):
        for worker, signals in script.items():
            vote.observe(worker, signals[step])
        decisions.append(vote.step())
    assert decisions == [False, False, True, True]
    assert (vote.compressed_steps, vote.total_steps, vote.compressed_fraction) == (2, 4, 0.5)

    vote.new_epoch()
    for worker in script:
        vote.observe(worker, 0.9)
    assert vote.step() is False
    assert vote.compressed_fraction == pytest.approx(2 / 5)


def test_decide_accepts_votes_from_remote_workers_by_id():
    vote = ScadlesVote()
    assert vote.decide({"w0": True, "w1": True, "w2": False}) is True
    assert vote.compressed_fraction == 1.0


def test_delta_calibrates_to_a_target_compressed_fraction():
    signals = [0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0]
    delta = ScadlesVote.calibrate_delta(signals, 0.5)
    assert sum(s <= delta for s in signals) == 5
    with pytest.raises(CompressorConfigError):
        ScadlesVote.calibrate_delta([], 0.5)


def test_signal_from_a_real_codec_run_drives_the_vote(gradient):
    # Error feedback makes the residual grow when compression drops a lot,
    # which the signal (on v = g + e) sees.
    codec = GradientCodec(registry.create("topk", ratio=0.01), ErrorFeedback())
    worker = ScadlesSignal(delta=0.2)
    for step in range(3):
        grads = {"w": gradient((200, 50), seed=step)}
        compensated = {"w": codec.memory.compensate("w", grads["w"])}
        worker.observe(scadles_signal(grads, compensated, 0.01))
        codec.encode(grads)
    assert worker.epoch_mean is not None and worker.epoch_mean > 0.2
    assert worker.vote() is False


def test_bad_signals_are_refused():
    with pytest.raises(CompressorConfigError):
        ScadlesSignal(delta=-1)
    with pytest.raises(CompressorConfigError):
        ScadlesSignal().observe(float("nan"))


# ---- Accordion ----------------------------------------------------------------------


def test_accordion_starts_critical_then_follows_norm_changes():
    switch = AccordionSwitch(eta=0.5, gentle=0.1, aggressive=0.01)
    assert switch.is_critical("a") and switch.setting("a") == 0.1

    assert switch.end_interval({"a": 10.0, "b": 10.0}) == {"a": True, "b": True}
    # a drops 60 % (critical), b 20 % (not)
    assert switch.end_interval({"a": 4.0, "b": 8.0}) == {"a": True, "b": False}
    assert switch.contexts(["a", "b"])["a"].ratio == 0.1
    assert switch.contexts(["a", "b"])["b"].ratio == 0.01
    # a settles (2.5 % change), b doubles (critical again)
    assert switch.end_interval({"a": 3.9, "b": 16.0}) == {"a": False, "b": True}
    # exactly eta counts as critical
    assert switch.end_interval({"a": 1.95, "b": 16.0}) == {"a": True, "b": False}


def test_accordion_layers_not_seen_keep_their_regime_and_new_ones_start_critical():
    switch = AccordionSwitch()
    switch.end_interval({"a": 1.0})
    switch.end_interval({"a": 1.0})
    assert switch.end_interval({"c": 1.0}) == {"c": True}
    assert switch.is_critical("a") is False


def test_accordion_zero_norm_followed_by_signal_is_critical():
    switch = AccordionSwitch()
    switch.end_interval({"a": 0.0})
    assert switch.end_interval({"a": 0.0}) == {"a": False}
    assert switch.end_interval({"a": 1.0}) == {"a": True}


def test_accordion_uses_the_norm_of_the_accumulated_gradient():
    switch = AccordionSwitch(eta=0.5)
    switch.accumulate({"w": torch.tensor([3.0, 4.0])})
    switch.accumulate({"w": torch.tensor([3.0, 4.0])})
    switch.end_interval()  # ||sum|| = 10
    # Gradients that cancel within the interval: norm of the sum is 1 -> 90 % change.
    switch.accumulate({"w": torch.tensor([3.0, 4.0])})
    switch.accumulate({"w": torch.tensor([-3.0, -3.0])})
    assert switch.end_interval() == {"w": True}
    switch.accumulate({"w": torch.tensor([0.0, 1.2])})
    assert switch.end_interval() == {"w": False}  # 20 % change


def test_accordion_rank_knob_yields_rank_contexts():
    switch = AccordionSwitch(knob="rank", gentle=4, aggressive=1)
    switch.end_interval({"w": 1.0})
    switch.end_interval({"w": 1.0})
    assert switch.context("w").rank == 1 and switch.context("w").ratio is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"eta": 0},
        {"knob": "bits"},
        {"gentle": 0.01, "aggressive": 0.1},
        {"knob": "rank", "gentle": 2.5, "aggressive": 1},
    ],
)
def test_accordion_rejects_bad_configuration(kwargs):
    with pytest.raises(CompressorConfigError):
        AccordionSwitch(**kwargs)


# ---- byte budget ----------------------------------------------------------------------

SHAPES = {"fc1.weight": (256, 64), "fc1.bias": (256,), "fc2.weight": (10, 256), "fc2.bias": (10,)}


def test_budget_comes_from_bandwidth_interval_and_backlog():
    controller = ByteBudgetController(registry.create("topk"), safety=0.9)
    assert controller.budget_bytes(1_000_000, 0.1) == 90_000
    assert controller.budget_bytes(1_000_000, 0.1, backlog_bytes=50_000) == 40_000
    assert controller.budget_bytes(1_000_000, 0.1, backlog_bytes=10**9) == 0


@pytest.mark.parametrize("budget", [2_000, 5_000, 20_000, 60_000])
def test_chosen_ratio_is_the_largest_that_fits(budget, gradient):
    topk = registry.create("topk")
    controller = ByteBudgetController(topk)
    decision = controller.choose(SHAPES, budget)

    assert decision.fits and decision.knob == "ratio"
    assert decision.predicted_bytes <= budget
    assert controller.predicted_bytes(SHAPES, min(1.0, decision.value * 1.001 + 1e-6)) > budget
    grads = {n: gradient(s, seed=i) for i, (n, s) in enumerate(SHAPES.items())}
    data = GradientCodec(topk).encode(grads, contexts=decision.contexts(SHAPES))
    assert len(data) == decision.predicted_bytes


def test_budget_extremes():
    controller = ByteBudgetController(registry.create("topk"), min_value=0.001, max_value=0.5)
    assert controller.choose(SHAPES, 10**9).value == 0.5
    tiny = controller.choose(SHAPES, 10)
    assert (tiny.value, tiny.fits) == (0.001, False)
    assert tiny.predicted_bytes > 10


def test_rank_is_chosen_for_powersgd():
    controller = ByteBudgetController(registry.create("powersgd"), max_value=32)
    decision = controller.choose(SHAPES, 12_000)
    assert decision.knob == "rank" and isinstance(decision.value, int)
    assert (
        decision.predicted_bytes <= 12_000 < controller.predicted_bytes(SHAPES, decision.value + 1)
    )
    assert decision.contexts(["fc1.weight"])["fc1.weight"].rank == decision.value


def test_shrinking_bandwidth_lowers_the_density_monotonically():
    controller = ByteBudgetController(registry.create("topk"))
    estimator = BandwidthEstimator(alpha=0.5)
    ratios = []
    for transfer_s in [0.01, 0.02, 0.04, 0.08, 0.16]:  # the same 10 kB takes longer each time
        bandwidth = estimator.observe(10_000, transfer_s)
        ratios.append(controller.choose_for_link(SHAPES, bandwidth, interval_s=0.05).value)
    assert ratios == sorted(ratios, reverse=True) and ratios[0] > ratios[-1]


def test_bandwidth_estimator_is_an_ewma():
    estimator = BandwidthEstimator(alpha=0.5)
    assert estimator.bytes_per_s is None
    assert estimator.observe(1000, 1.0) == 1000
    assert estimator.observe(3000, 1.0) == 2000
    with pytest.raises(CompressorConfigError):
        estimator.observe(10, 0.0)


def test_compressor_without_a_size_knob_is_refused():
    with pytest.raises(CompressorConfigError):
        ByteBudgetController(registry.create("threshold"))
