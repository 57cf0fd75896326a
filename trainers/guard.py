"""The step guard: whether a local step's result may reach the model and the wire.

A batch of records that are finite and inside their declared ranges can still make a
step go wrong (a feature at 1e38 passes every per-value check of a stream without a
range and gives a finite but enormous gradient; one such gradient spread by BSP is
enough to wreck every replica). The guard looks at each step's outcome before the
strategy sees it: a step whose loss or gradient is non-finite, or whose gradient norm
is above an absolute bound or far above the recent norms, is rejected. The caller
then neither applies nor publishes it and dead-letters the step's records with the
rejection's ``reason``; the worker goes on with its next batch.

Pure and synchronous: no clock, no I/O; deterministic given the sequence of steps.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from trainers.errors import BatchError
from trainers.local import StepResult

#: ``reason`` values of a rejected step (metric label, dead-letter header).
REASONS = ("bad_batch", "non_finite_loss", "non_finite_gradient", "gradient_norm", "gradient_spike")


@dataclass(frozen=True)
class StepRejection:
    """Why a step must not be applied: a ``REASONS`` slug and one line for humans."""

    reason: str
    detail: str
    norm: float | None = None


def gradient_norm(tensors: dict[str, torch.Tensor]) -> float:
    """L2 norm over every tensor (accumulated in float64; inf or nan if any value is)."""
    total = 0.0
    for tensor in tensors.values():
        total += float(torch.linalg.vector_norm(tensor.detach(), dtype=torch.float64)) ** 2
    return math.sqrt(total)


class StepGuard:
    """Accepts or rejects local steps; remembers the norms of recent accepted steps.

    Rules, in order: the loss is finite; every gradient and buffer delta is finite;
    the gradient norm is at most ``max_norm`` (0: no bound); once ``warmup`` steps
    were accepted, the norm is at most ``spike_factor`` times the median norm of the
    last ``window`` accepted steps (0: off). A synthetic gradient (``StepResult.synthetic``:
    a prediction whose scale grows as its predictor learns) is held to the first three
    rules only and does not enter the window.

    Invariant: only accepted steps enter the window, so a burst of bad batches cannot
    raise the bar for the next one.
    """

    def __init__(
        self, max_norm: float = 1.0e4, spike_factor: float = 100.0, *, window: int = 64, warmup: int = 16
    ) -> None:
        if max_norm < 0 or not math.isfinite(max_norm):
            raise ValueError(f"max_norm must be finite and >= 0, got {max_norm}")
        if spike_factor != 0 and not spike_factor > 1:
            raise ValueError(f"spike_factor must be > 1 or 0 (off), got {spike_factor}")
        if window < 1 or warmup < 1:
            raise ValueError("window and warmup must be >= 1")
        self.max_norm = max_norm
        self.spike_factor = spike_factor
        self.warmup = warmup
        self._norms: deque[float] = deque(maxlen=window)
        self._last_norm = 0.0
        self.accepted = 0
        self.rejected = 0

    def check(self, result: StepResult) -> StepRejection | None:
        """None if ``result`` may be used; otherwise why not (and it is not remembered)."""
        rejection = self._judge(result)
        if rejection is None:
            self.accepted += 1
            # A step without a gradient (a stage's forward-only step) or with an all-zero one (a
            # stage whose synthetic gradient is still zero) says nothing of the scale to expect.
            if self._last_norm > 0 and not result.synthetic:
                self._norms.append(self._last_norm)
        else:
            self.rejected += 1
        return rejection

    def reject_batch(self, exc: BatchError) -> StepRejection:
        """The rejection of a batch the trainer could not even compute a step on."""
        self.rejected += 1
        return StepRejection(getattr(exc, "reason", "bad_batch"), str(exc))

    def median_norm(self) -> float | None:
        """Median gradient norm of the remembered accepted steps (None before any)."""
        if not self._norms:
            return None
        ordered = sorted(self._norms)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])

    def _judge(self, result: StepResult) -> StepRejection | None:
        if not math.isfinite(result.loss):
            return StepRejection("non_finite_loss", f"training loss is {result.loss}")
        for part, tensors in (("gradient", result.gradients), ("buffer delta", result.buffer_deltas)):
            for name, tensor in tensors.items():
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    bad = int((~torch.isfinite(tensor)).sum())
                    return StepRejection("non_finite_gradient", f"{part} {name!r} has {bad} non-finite values")
        norm = gradient_norm(result.gradients)
        self._last_norm = norm
        if not math.isfinite(norm):
            # Finite values whose squares overflow: certainly beyond any sane bound.
            return StepRejection("gradient_norm", "gradient norm overflows float64", norm)
        if self.max_norm and norm > self.max_norm:
            return StepRejection(
                "gradient_norm", f"gradient norm {norm:.4g} exceeds train.max_grad_norm={self.max_norm:g}", norm
            )
        median = self.median_norm()
        if (self.spike_factor and not result.synthetic and self.accepted >= self.warmup and median
                and norm > self.spike_factor * median):
            return StepRejection(
                "gradient_spike",
                f"gradient norm {norm:.4g} is {norm / median:.0f}x the median {median:.4g} of recent steps "
                f"(train.grad_norm_spike={self.spike_factor:g})",
                norm,
            )
        return None
