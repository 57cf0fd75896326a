"""The ScaDLES adaptive-compression vote: per-worker signal, epoch mean, majority decision."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from edgestream.compression.errors import CompressorConfigError
from edgestream.compression.memory import Memory
from edgestream.compression.sparse import keep_count, select_topk


def compression_signal(grad_norms: Iterable[float], sent_norms: Iterable[float]) -> float:
    """ScaDLES signal ``c = | sum ||g_l|| - sum ||topk(v_l)|| | / sum ||g_l||`` from per-layer norms.

    Small c means top-k of the compensated gradient keeps about the gradient's
    magnitude, so compressing loses little. A zero gradient gives 0.
    """
    grad_total = math.fsum(grad_norms)
    sent_total = math.fsum(sent_norms)
    if grad_total <= 0.0:
        return 0.0
    return abs(grad_total - sent_total) / grad_total


def topk_norm(tensor: torch.Tensor, ratio: float) -> float:
    """L2 norm of the ``ceil(ratio * numel)`` largest-magnitude entries of ``tensor``."""
    flat = tensor.detach().reshape(-1).float().numpy()
    kept = flat[select_topk(np.abs(flat), keep_count(flat.size, ratio))].astype(np.float64)
    return math.sqrt(float(kept @ kept))


def scadles_signal(
    grads: Mapping[str, torch.Tensor], compensated: Mapping[str, torch.Tensor] | None, ratio: float
) -> float:
    """The signal for one step: true gradients ``g`` and error-compensated ``v = g + e`` per layer.

    ``compensated=None`` uses ``g`` itself (no error feedback).
    """
    source = grads if compensated is None else compensated
    grad_norms = [float(torch.linalg.vector_norm(g.detach().float())) for g in grads.values()]
    sent_norms = [topk_norm(source[name], ratio) for name in grads]
    return compression_signal(grad_norms, sent_norms)


class ScadlesSignal:
    """One worker's side of the vote: running mean of the signal over the current epoch.

    Votes "compress" when that mean is ``<= delta``. Before any observation in
    an epoch it uses the previous epoch's mean; before any observation at all it
    votes dense (the safe choice early in training). Keeps the last ``history``
    signals for calibrating ``delta``.
    """

    def __init__(self, delta: float = 0.2, history: int = 10_000) -> None:
        if not math.isfinite(delta) or delta < 0:
            raise CompressorConfigError(f"delta must be a finite non-negative number, got {delta}")
        self.delta = float(delta)
        self._sum = 0.0
        self._count = 0
        self._previous_mean: float | None = None
        self._history: deque[float] = deque(maxlen=history)

    def observe(self, signal: float) -> None:
        """Add one step's signal ``c`` (finite, >= 0)."""
        if not math.isfinite(signal) or signal < 0:
            raise CompressorConfigError(f"signal must be finite and >= 0, got {signal}")
        self._sum += signal
        self._count += 1
        self._history.append(signal)

    @property
    def epoch_mean(self) -> float | None:
        """Mean signal of the current epoch, else the previous epoch's, else None."""
        return self._sum / self._count if self._count else self._previous_mean

    @property
    def epoch_steps(self) -> int:
        return self._count

    def vote(self) -> bool:
        """True = compress."""
        mean = self.epoch_mean
        return mean is not None and mean <= self.delta

    def new_epoch(self) -> None:
        """Start a new epoch; the finished epoch's mean is kept as the fallback."""
        if self._count:
            self._previous_mean = self._sum / self._count
        self._sum = 0.0
        self._count = 0

    def history(self) -> list[float]:
        return list(self._history)

    def state_dict(self) -> dict[str, float | int | None]:
        """The epoch sums and the previous epoch's mean (the history is not kept)."""
        return {"sum": self._sum, "count": self._count, "previous_mean": self._previous_mean}

    def load_state_dict(self, state: Mapping[str, float | int | None]) -> None:
        count = int(state["count"] or 0)
        total = float(state["sum"] or 0.0)
        previous = state["previous_mean"]
        if count < 0 or not math.isfinite(total) or (previous is not None and not math.isfinite(previous)):
            raise CompressorConfigError(f"bad ScaDLES signal state {dict(state)}")
        self._sum, self._count = total, count
        self._previous_mean = None if previous is None else float(previous)


def majority_compress(ballots: Iterable[bool]) -> bool:
    """The ScaDLES rule: compress when at least half of the ballots say so; none means dense."""
    votes = [bool(b) for b in ballots]
    return bool(votes) and 2 * sum(votes) >= len(votes)


class ScadlesVote:
    """The decision of a step: compress iff at least half of the workers vote to.

    Holds one ``ScadlesSignal`` per worker id (fed with ``observe``) for
    single-process use; with remote workers, call ``decide`` on the votes they
    send. Invariant: ``compressed_steps <= total_steps`` count every decision.
    """

    def __init__(self, delta: float = 0.2) -> None:
        self.delta = float(delta)
        self._signals: dict[str, ScadlesSignal] = {}
        self.compressed_steps = 0
        self.total_steps = 0

    def signal(self, worker: str) -> ScadlesSignal:
        tracker = self._signals.get(worker)
        if tracker is None:
            tracker = self._signals[worker] = ScadlesSignal(self.delta)
        return tracker

    def observe(self, worker: str, signal: float) -> None:
        self.signal(worker).observe(signal)

    def vote(self, worker: str) -> bool:
        return self.signal(worker).vote()

    def votes(self) -> dict[str, bool]:
        return {worker: tracker.vote() for worker, tracker in self._signals.items()}

    def decide(self, votes: Mapping[str, bool] | Iterable[bool]) -> bool:
        """Majority (>= half) of ``votes`` say compress; no votes means dense. Records the outcome."""
        ballots = list(votes.values()) if isinstance(votes, Mapping) else list(votes)
        compress = majority_compress(ballots)
        self.total_steps += 1
        self.compressed_steps += int(compress)
        return compress

    def step(self) -> bool:
        """Decide from the votes of every worker observed so far."""
        return self.decide(self.votes())

    def new_epoch(self) -> None:
        for tracker in self._signals.values():
            tracker.new_epoch()

    @property
    def compressed_fraction(self) -> float:
        return self.compressed_steps / self.total_steps if self.total_steps else 0.0

    @staticmethod
    def calibrate_delta(signals: Iterable[float], compress_fraction: float) -> float:
        """The delta under which ``compress_fraction`` of the observed signals fall.

        ScaDLES's delta is the critical knob; calibrate it from a warm-up run's
        signal history rather than guessing.
        """
        values = np.asarray(list(signals), dtype=np.float64)
        if values.size == 0 or not 0.0 <= compress_fraction <= 1.0:
            raise CompressorConfigError("need signals and a compress_fraction in [0, 1]")
        return float(np.quantile(values, compress_fraction))


def link_signal(memory: Memory, grads: Mapping[str, torch.Tensor], ratio: float) -> float:
    """The signal of a gradient about to go out on a link whose error feedback is ``memory``.

    Uses ``v = g + e`` from the link's current residuals without changing them
    (``Memory.compensate`` is pure), so call it before the gradient is encoded.
    """
    compensated = {name: memory.compensate(name, grad) for name, grad in grads.items()}
    return scadles_signal(grads, compensated, ratio)
