"""The step guard: whether a local step's result may reach the model and the wire.

A batch of records that are finite and inside their declared ranges can still make a
step go wrong (a feature at 1e38 passes every per-value check of a stream without a
range and gives a finite but enormous gradient; one such gradient spread by BSP is
enough to wreck every replica). The guard looks at each step's outcome before the
strategy sees it: a step whose loss or gradient is non-finite, or whose gradient norm
is above an absolute bound or far above the recent norms, is rejected. The caller
then neither applies nor publishes it and dead-letters the step's records with the
rejection's ``reason``; the worker goes on with its next batch.

A refused step need not cost every record in it: :class:`CulpritSearch` finds the
records that make it unsound (the batch split by device, then halves within a suspect
group, down to single records, at most ``max_probes`` judged sub-steps), so only those
are dead-lettered and the rest are trained.

Pure and synchronous: no clock, no I/O; deterministic given the sequence of steps.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from edgestream.trainers.errors import BatchError
from edgestream.trainers.local import StepResult

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

    def judge(self, result: StepResult) -> StepRejection | None:
        """What :meth:`check` would say of ``result``, counting and remembering nothing (a
        sub-step of the culprit search, judged against the same recent norms)."""
        return self._judge(result)

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


@dataclass(frozen=True)
class Culprits:
    """Records of a refused batch to dead-letter, with why.

    ``indices``: positions in the batch, ascending. ``resolved`` is False for a group the
    search did not narrow down (its probe budget ran out, or only the group as a whole is
    unsound): it is dead-lettered whole, innocent records included, and counted as such.
    """

    indices: np.ndarray
    rejection: StepRejection
    resolved: bool = True


@dataclass(frozen=True)
class SearchOutcome:
    """What :meth:`CulpritSearch.run` found: the records to train (``clean``, positions in
    the batch, ascending), those to dead-letter (``culprits``), and the sub-steps it judged."""

    clean: np.ndarray
    culprits: tuple[Culprits, ...]
    probes: int

    @property
    def unresolved_records(self) -> int:
        return sum(len(c.indices) for c in self.culprits if not c.resolved)


class CulpritSearch:
    """Finds the records that make a refused step unsound, with a bounded number of probes.

    A *probe* judges a step on a subset of the batch (``probe(indices)`` returns the
    rejection, or None when that subset alone would be accepted). Order of work:

    1. With records of more than one group (device), one probe per group, groups in
       sorted order: a group that passes is clean.
    2. Each failing group (or the whole batch, when it holds one group) is halved, first
       half first, and each half probed; failing halves are halved again (breadth first),
       down to single records, which are the culprits, dead-lettered with their own
       rejection.
    3. At most ``max_probes`` probes per search: a suspect group the budget cannot split
       any more is dead-lettered whole (``resolved=False``), as is a group whose halves
       both pass although the group fails (only the combination is unsound).

    Invariant: ``clean`` and the culprits' indices partition the batch; the outcome
    depends only on the groups, the rejection and the probes' verdicts, so any process
    that sees the same batch and verdicts finds the same culprits.
    """

    def __init__(self, max_probes: int = 128) -> None:
        if max_probes < 0:
            raise ValueError(f"max_probes must be >= 0, got {max_probes}")
        self.max_probes = max_probes

    def run(
        self,
        groups: Sequence[object] | np.ndarray,
        rejection: StepRejection,
        probe: Callable[[np.ndarray], StepRejection | None],
    ) -> SearchOutcome:
        """Search a batch whose records belong to ``groups`` (one key per record) and whose
        whole step was refused with ``rejection``."""
        keys = np.asarray(groups)
        everything = np.arange(len(keys))
        probes = 0
        clean: list[np.ndarray] = []
        culprits: list[Culprits] = []
        suspects: deque[tuple[np.ndarray, StepRejection]] = deque()
        distinct = sorted(set(keys.tolist()), key=str)
        if len(distinct) > 1:
            for key in distinct:
                members = everything[keys == key]
                if probes >= self.max_probes:
                    culprits.append(Culprits(members, rejection, resolved=False))
                    continue
                probes += 1
                verdict = probe(members)
                if verdict is None:
                    clean.append(members)
                else:
                    suspects.append((members, verdict))
        elif len(keys):
            suspects.append((everything, rejection))
        while suspects:
            members, verdict = suspects.popleft()
            if len(members) == 1:
                culprits.append(Culprits(members, verdict))
                continue
            if probes + 2 > self.max_probes:
                culprits.append(Culprits(members, verdict, resolved=False))
                continue
            half = len(members) // 2
            parts = (members[:half], members[half:])
            verdicts = [probe(part) for part in parts]
            probes += 2
            if all(v is None for v in verdicts):
                culprits.append(Culprits(members, verdict, resolved=False))
                continue
            for part, part_verdict in zip(parts, verdicts, strict=True):
                if part_verdict is None:
                    clean.append(part)
                else:
                    suspects.append((part, part_verdict))
        kept = np.sort(np.concatenate(clean)) if clean else np.zeros(0, dtype=np.int64)
        culprits.sort(key=lambda c: int(c.indices[0]))
        return SearchOutcome(kept.astype(np.int64), tuple(culprits), probes)
