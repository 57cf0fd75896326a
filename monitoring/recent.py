"""The most recent values of a quantity, kept for exact percentiles at the end of a run.

Prometheus histograms answer quantiles only to a bucket; a run's summary (and the
benchmarks that read it) wants the exact p50/p99 of, say, how old each record was when it
was trained. ``RecentValues`` keeps the last ``capacity`` values in a ring: memory stays
bounded however long the run, and the percentiles are of the most recent values.
"""

from __future__ import annotations

import numpy as np


class RecentValues:
    """A ring of the last ``capacity`` float values, and how many were ever added."""

    def __init__(self, capacity: int = 65_536) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {capacity})")
        self._ring = np.empty(capacity, dtype=np.float64)
        self._next = 0
        self.count = 0

    def add(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64).ravel()
        capacity = len(self._ring)
        if len(values) >= capacity:
            self._ring[:] = values[-capacity:]
            self._next = 0
        else:
            end = self._next + len(values)
            if end <= capacity:
                self._ring[self._next : end] = values
            else:
                split = capacity - self._next
                self._ring[self._next :] = values[:split]
                self._ring[: end - capacity] = values[split:]
            self._next = end % capacity
        self.count += len(values)

    def values(self) -> np.ndarray:
        """The values kept, oldest first."""
        if self.count < len(self._ring):
            return self._ring[: self.count].copy()
        return np.concatenate([self._ring[self._next :], self._ring[: self._next]])

    def summary(self, quantiles: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, float | int]:
        """``{"count": N, "kept": n, "p50": ..., "max": ...}`` over the values kept
        (``{"count": 0}`` before any)."""
        kept = self.values()
        if not len(kept):
            return {"count": self.count}
        out: dict[str, float | int] = {"count": self.count, "kept": len(kept)}
        for q, v in zip(quantiles, np.quantile(kept, quantiles).tolist(), strict=True):
            out[f"p{round(q * 100):g}"] = v
        out["max"] = float(kept.max())
        return out
