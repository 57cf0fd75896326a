"""StepGuard: which local steps may reach the model and the wire."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from edgestream.trainers import LocalTrainer, build_model
from edgestream.trainers.errors import BatchError
from edgestream.trainers.guard import REASONS, StepGuard, gradient_norm
from edgestream.trainers.local import StepResult


def result(scale: float = 1.0, loss: float = 0.5, **overrides) -> StepResult:
    grads = {"w": torch.full((3, 4), scale), "b": torch.full((3,), scale)}
    grads.update(overrides)
    return StepResult(gradients=grads, loss=loss, batch_size=8, base_version=0)


def test_norm_is_the_l2_norm_over_every_tensor():
    assert gradient_norm(result(2.0).gradients) == pytest.approx(2.0 * math.sqrt(15))
    # float32 values whose squares overflow float32 still give the right norm
    assert gradient_norm({"x": torch.tensor([3e38, 3e38])}) == pytest.approx(3e38 * math.sqrt(2), rel=1e-6)


@pytest.mark.parametrize("bad, reason", [
    (result(loss=float("nan")), "non_finite_loss"),
    (result(loss=float("inf")), "non_finite_loss"),
    (result(b=torch.tensor([1.0, float("nan"), 0.0])), "non_finite_gradient"),
    (result(w=torch.full((3, 4), float("-inf"))), "non_finite_gradient"),
    (result(5e3), "gradient_norm"),
    (result(3e38), "gradient_norm"),
])
def test_bad_steps_are_rejected_with_their_reason(bad, reason):
    guard = StepGuard(max_norm=1e4)

    rejection = guard.check(bad)

    assert rejection is not None and rejection.reason == reason and rejection.reason in REASONS
    assert rejection.detail
    assert (guard.accepted, guard.rejected) == (0, 1)


def test_a_non_finite_buffer_delta_is_rejected_too():
    bad = StepResult(gradients=result().gradients, loss=0.1, batch_size=8, base_version=0,
                     buffer_deltas={"bn.running_mean": torch.tensor([float("nan")])})
    assert StepGuard().check(bad).reason == "non_finite_gradient"


def test_no_absolute_bound_when_max_norm_is_zero():
    assert StepGuard(max_norm=0, spike_factor=0).check(result(1e30)) is None


def test_a_spike_far_above_recent_norms_is_rejected_only_after_warmup():
    guard = StepGuard(max_norm=0, spike_factor=100, warmup=4, window=8)
    assert guard.check(result(1000.0)) is None  # before warm-up anything finite passes
    for _ in range(3):
        assert guard.check(result(1.0)) is None
    median = guard.median_norm()

    rejection = guard.check(result(200.0))

    assert rejection is not None and rejection.reason == "gradient_spike"
    assert guard.median_norm() == median  # rejected steps do not move the bar
    assert guard.check(result(50.0)) is None  # 50x the median: below the factor


def test_a_burst_of_bad_steps_cannot_raise_the_bar():
    guard = StepGuard(max_norm=0, spike_factor=10, warmup=2, window=4)
    for _ in range(4):
        guard.check(result(1.0))
    for _ in range(20):
        assert guard.check(result(100.0)).reason == "gradient_spike"
    assert guard.median_norm() == pytest.approx(math.sqrt(15))


def test_batch_errors_map_to_a_rejection_with_their_reason():
    guard = StepGuard()
    assert guard.reject_batch(BatchError("labels shape (3,) does not match 4 samples")).reason == "bad_batch"
    assert guard.reject_batch(BatchError("loss nan", reason="non_finite_loss")).reason == "non_finite_loss"


def test_the_record_that_crashed_bsp_is_rejected_by_the_guard():
    # One digits-like record with a feature at 1e38 (a corrupted message that still decoded).
    trainer = LocalTrainer(build_model("mlp", (64,), 10, seed=0), lr=0.1)
    rng = np.random.default_rng(0)
    x = rng.random((32, 64), dtype=np.float32)
    y = rng.integers(0, 10, 32)
    x[5, 17] = 1e38
    guard = StepGuard()

    try:
        rejection = guard.check(trainer.compute_gradient(x, y))
    except BatchError as exc:
        rejection = guard.reject_batch(exc)

    assert rejection is not None and rejection.reason in ("non_finite_loss", "non_finite_gradient", "gradient_norm")
    clean = x.copy()
    clean[5, 17] = 0.5
    assert guard.check(trainer.compute_gradient(clean, y)) is None


def test_a_synthetic_gradient_is_not_held_to_the_spike_rule_nor_remembered():
    import dataclasses

    guard = StepGuard(max_norm=1e4, spike_factor=10.0, warmup=2)
    tiny = _result_of_norm(1e-8)
    for _ in range(4):  # a synthesiser's first predictions: tiny gradients
        assert guard.check(dataclasses.replace(tiny, synthetic=True)) is None
    assert guard.median_norm() is None  # none of them entered the window

    # Its predictions grew 10^6-fold as it learned: still accepted ...
    assert guard.check(dataclasses.replace(_result_of_norm(1e-2), synthetic=True)) is None
    # ... but the absolute bound holds for it, and a loss-driven step is judged as before.
    assert guard.check(dataclasses.replace(_result_of_norm(1e5), synthetic=True)).reason == "gradient_norm"
    for _ in range(2):
        assert guard.check(_result_of_norm(1.0)) is None
    assert guard.check(_result_of_norm(100.0)).reason == "gradient_spike"


def _result_of_norm(norm: float) -> StepResult:
    return StepResult(gradients={"w": torch.tensor([norm])}, loss=0.5, batch_size=4, base_version=0)
