"""Staleness bookkeeping: an exact histogram of versions-behind with mean, max and p99."""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import Any


class StalenessTracker:
    """Exact integer histogram of staleness values (model versions behind).

    Invariant: memory is bounded by the number of distinct staleness values, not by
    the number of updates, so it can run for the life of a worker.
    """

    def __init__(self) -> None:
        self._histogram: Counter[int] = Counter()
        # Values recorded since the last ``take_new`` (bounded: an owner that never
        # drains them loses only this view, never the histogram).
        self._new: deque[int] = deque(maxlen=100_000)

    def record(self, staleness_versions: int) -> None:
        """Count one update that was ``staleness_versions`` versions behind (>= 0)."""
        if staleness_versions < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness_versions}")
        self._histogram[int(staleness_versions)] += 1
        self._new.append(int(staleness_versions))

    def take_new(self) -> list[int]:
        """The values recorded since the previous call (the driver exports them as metrics)."""
        values = list(self._new)
        self._new.clear()
        return values

    @property
    def count(self) -> int:
        """Number of recorded updates."""
        return sum(self._histogram.values())

    def quantile(self, q: float) -> int:
        """Nearest-rank quantile (0 < q <= 1); 0 when nothing was recorded."""
        total = self.count
        if total == 0:
            return 0
        rank = max(1, math.ceil(q * total))
        seen = 0
        for value in sorted(self._histogram):
            seen += self._histogram[value]
            if seen >= rank:
                return value
        return max(self._histogram)

    def summary(self) -> dict[str, Any]:
        """``count``, ``mean``, ``max``, ``p50``, ``p99`` and the ``histogram`` (str keys, JSON-able)."""
        total = self.count
        mean = sum(v * n for v, n in self._histogram.items()) / total if total else 0.0
        return {
            "count": total,
            "mean": mean,
            "max": max(self._histogram) if total else 0,
            "p50": self.quantile(0.5),
            "p99": self.quantile(0.99),
            "histogram": {str(v): n for v, n in sorted(self._histogram.items())},
        }

    def state_dict(self) -> dict[str, int]:
        """Histogram with string keys (JSON- and weights_only-safe)."""
        return {str(v): n for v, n in self._histogram.items()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._histogram = Counter({int(v): int(n) for v, n in state.items()})
