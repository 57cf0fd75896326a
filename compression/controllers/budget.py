"""Byte-budget control: pick density or rank per link so a message fits what the link can carry."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from edgestream.compression import wire
from edgestream.compression.base import Compressor, LayerContext
from edgestream.compression.errors import CompressorConfigError


class BandwidthEstimator:
    """EWMA of a link's observed throughput in bytes/s; the caller measures time and passes it in."""

    def __init__(self, alpha: float = 0.3, initial_bytes_per_s: float | None = None) -> None:
        if not 0 < alpha <= 1:
            raise CompressorConfigError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = float(alpha)
        self._estimate = initial_bytes_per_s

    def observe(self, nbytes: int, seconds: float) -> float:
        """Fold in one transfer of ``nbytes`` that took ``seconds``; returns the new estimate."""
        if nbytes < 0 or not seconds > 0:
            raise CompressorConfigError(
                f"need nbytes >= 0 and seconds > 0, got {nbytes}, {seconds}"
            )
        rate = nbytes / seconds
        self._estimate = (
            rate
            if self._estimate is None
            else self.alpha * rate + (1 - self.alpha) * self._estimate
        )
        return self._estimate

    @property
    def bytes_per_s(self) -> float | None:
        return self._estimate


@dataclass(frozen=True)
class BudgetDecision:
    """The chosen setting; ``fits`` is False when even the minimum exceeds the budget."""

    knob: str
    value: float | int
    budget_bytes: int
    predicted_bytes: int
    fits: bool

    def context(self, name: str) -> LayerContext:
        if self.knob == "ratio":
            return LayerContext(name=name, ratio=float(self.value))
        return LayerContext(name=name, rank=int(self.value))

    def contexts(self, names: Iterable[str]) -> dict[str, LayerContext]:
        """Per-layer contexts to pass to ``GradientCodec.encode(..., contexts=...)``."""
        return {name: self.context(name) for name in names}


class ByteBudgetController:
    """Chooses the largest ratio (top-k, random-k) or rank (PowerSGD) whose message fits a budget.

    Sizes come from the compressor's exact ``frame_nbytes``, so a chosen setting
    fits by construction. One uniform setting for all layers of a message;
    one controller call per link (DLion-style links each get their own budget).
    Invariant: with ``fits`` True, ``predicted_bytes <= budget_bytes``.
    """

    def __init__(
        self,
        compressor: Compressor,
        *,
        min_value: float | None = None,
        max_value: float | None = None,
        safety: float = 0.9,
    ) -> None:
        knob = compressor.budget_knob
        if knob is None:
            raise CompressorConfigError(f"compressor {compressor.name!r} has no size knob")
        if not 0 < safety <= 1:
            raise CompressorConfigError(f"safety must be in (0, 1], got {safety}")
        self.compressor = compressor
        self.knob = knob
        self.safety = float(safety)
        if knob == "ratio":
            self.min_value: float = 1e-4 if min_value is None else float(min_value)
            self.max_value: float = 1.0 if max_value is None else float(max_value)
            if not 0 < self.min_value <= self.max_value <= 1:
                raise CompressorConfigError("ratios need 0 < min_value <= max_value <= 1")
        else:
            self.min_value = 1 if min_value is None else int(min_value)
            self.max_value = 64 if max_value is None else int(max_value)
            if not 1 <= self.min_value <= self.max_value:
                raise CompressorConfigError("ranks need 1 <= min_value <= max_value")

    def budget_bytes(
        self, bandwidth_bytes_per_s: float, interval_s: float, backlog_bytes: int = 0
    ) -> int:
        """Bytes one message may take: what the link carries in ``interval_s`` at ``safety``,
        minus the backlog already queued for the consumer (consumer lag, in bytes)."""
        if not (
            math.isfinite(bandwidth_bytes_per_s) and bandwidth_bytes_per_s >= 0 and interval_s >= 0
        ):
            raise CompressorConfigError("bandwidth and interval must be finite and >= 0")
        return max(
            0, math.floor(self.safety * bandwidth_bytes_per_s * interval_s - max(0, backlog_bytes))
        )

    def predicted_bytes(self, shapes: Mapping[str, Sequence[int]], value: float | int) -> int:
        """Exact message length at setting ``value``."""
        total = wire.MESSAGE_HEADER_SIZE
        for name, shape in shapes.items():
            ctx = (
                LayerContext(name=name, ratio=float(value))
                if self.knob == "ratio"
                else LayerContext(name=name, rank=int(value))
            )
            frame = self.compressor.frame_nbytes(name, shape, ctx)
            if frame is None:
                raise CompressorConfigError(f"{self.compressor.name!r} cannot predict its size")
            total += frame
        return total

    def choose(self, shapes: Mapping[str, Sequence[int]], budget_bytes: int) -> BudgetDecision:
        """Largest setting in [min_value, max_value] whose message is <= ``budget_bytes``."""

        def decision(value: float | int, fits: bool) -> BudgetDecision:
            return BudgetDecision(
                self.knob, value, budget_bytes, self.predicted_bytes(shapes, value), fits
            )

        if self.predicted_bytes(shapes, self.max_value) <= budget_bytes:
            return decision(self.max_value, True)
        if self.predicted_bytes(shapes, self.min_value) > budget_bytes:
            return decision(self.min_value, False)
        # Size is non-decreasing in the setting; keep lo fitting, hi not.
        lo, hi = self.min_value, self.max_value
        if self.knob == "rank":
            while hi - lo > 1:
                mid = (int(lo) + int(hi)) // 2
                lo, hi = (
                    (mid, hi) if self.predicted_bytes(shapes, mid) <= budget_bytes else (lo, mid)
                )
        else:
            for _ in range(60):
                mid = (lo + hi) / 2
                lo, hi = (
                    (mid, hi) if self.predicted_bytes(shapes, mid) <= budget_bytes else (lo, mid)
                )
        return decision(lo, True)

    def choose_for_link(
        self,
        shapes: Mapping[str, Sequence[int]],
        bandwidth_bytes_per_s: float,
        interval_s: float,
        backlog_bytes: int = 0,
    ) -> BudgetDecision:
        """``choose`` with the budget derived from the link's bandwidth estimate and backlog."""
        return self.choose(
            shapes, self.budget_bytes(bandwidth_bytes_per_s, interval_s, backlog_bytes)
        )
