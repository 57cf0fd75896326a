"""Per-feature value bounds learned from a stream that declares no range (``data.value_range=none``).

A stream without a declared range lets any finite value through the decoder. A record at
300 or 100,000 times the usual scale need not make its step unsound (a saturated unit
gives it a zero gradient), so the step guard cannot be relied on to see it; this class
does, from what the stream itself has shown: the smallest and largest value of each
feature among the records trained so far.

Pure and synchronous: no clock, no I/O, no torch; its state is a JSON-able dict that the
worker keeps in its checkpoint, so a restart does not forget the bounds.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: Dead-letter reason of a record outside the learned bounds.
REASON = "outside_observed_range"


class ObservedRange:
    """Running per-feature ``[lo, hi]`` of the trained records, and the band records must fall in.

    Until ``warmup`` records were observed nothing is refused (the bounds are still being
    learned; the step guard and its culprit search stand alone). After that a record is
    *outside* when any feature lies beyond ``[lo - margin * span, hi + margin * span]``,
    where ``span`` is the feature's ``hi - lo`` but at least the median span of the features
    that vary (a feature seen constant so far, such as a digit's corner pixel, gets the
    band of a typical feature, not a point).

    Drift: every trained record widens ``lo`` / ``hi`` to include it, so a stream whose
    range moves by less than ``margin`` spans at a time is followed; a jump beyond that is
    refused. The price: values that creep outwards step by step (each inside the band) are
    followed too; the bound is on sudden outliers, not on slow manipulation.

    Invariant: ``lo <= hi`` elementwise and both finite once anything was observed; only
    records the caller trained on (:meth:`observe`) move them.
    """

    def __init__(self, margin: float = 1.0, warmup: int = 512) -> None:
        if not (math.isfinite(margin) and margin >= 0):
            raise ValueError(f"margin must be a finite number >= 0, got {margin}")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1, got {warmup}")
        self.margin = float(margin)
        self.warmup = int(warmup)
        self.observed = 0
        self.lo: np.ndarray | None = None
        self.hi: np.ndarray | None = None

    @property
    def active(self) -> bool:
        """True once ``warmup`` records were observed: :meth:`outside` refuses records."""
        return self.observed >= self.warmup and self.lo is not None

    def band(self) -> tuple[np.ndarray, np.ndarray]:
        """The per-feature interval a record must fall in (flattened features, float64)."""
        if self.lo is None or self.hi is None:
            raise ValueError("no record observed yet")
        spans = self.hi - self.lo
        varying = spans[spans > 0]
        floor = float(np.median(varying)) if len(varying) else max(float(np.abs(self.hi).max()), 1.0)
        span = np.maximum(spans, floor)
        return self.lo - self.margin * span, self.hi + self.margin * span

    def outside(self, features: np.ndarray) -> np.ndarray:
        """Per record of ``features`` (``[N, ...]``), True if it must be refused."""
        count = len(features)
        if not self.active or count == 0:
            return np.zeros(count, dtype=bool)
        flat = np.asarray(features, dtype=np.float64).reshape(count, -1)
        if self.lo is None or flat.shape[1] != self.lo.shape[0]:
            return np.zeros(count, dtype=bool)  # another feature shape: the trainer refuses it itself
        lo, hi = self.band()
        # NaN compares False both ways: a non-finite value is outside too.
        inside = (flat >= lo) & (flat <= hi)
        return ~inside.all(axis=1)

    def describe(self, features: np.ndarray) -> str:
        """One line on why the first record of ``features`` is outside (for the dead letter)."""
        lo, hi = self.band()
        flat = np.asarray(features, dtype=np.float64).reshape(len(features), -1)[0]
        bad = np.flatnonzero(~((flat >= lo) & (flat <= hi)))
        index = int(bad[0]) if len(bad) else 0
        return (f"feature {index} = {flat[index]:.4g} is outside [{lo[index]:.4g}, {hi[index]:.4g}], the range "
                f"observed in {self.observed} trained records widened by data.value_margin={self.margin:g} "
                f"(the stream declares none: data.value_range=none)")

    def observe(self, features: np.ndarray) -> None:
        """Widen the bounds to include ``features`` (records the caller trained on)."""
        count = len(features)
        if count == 0:
            return
        flat = np.asarray(features, dtype=np.float64).reshape(count, -1)
        if not np.isfinite(flat).all():
            return  # not trainable in the first place; never let it into the bounds
        lo, hi = flat.min(axis=0), flat.max(axis=0)
        if self.lo is None or self.hi is None or self.lo.shape != lo.shape:
            self.lo, self.hi = lo, hi
        else:
            self.lo, self.hi = np.minimum(self.lo, lo), np.maximum(self.hi, hi)
        self.observed += count

    # -- checkpoint -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-able state (finite floats only), for the worker's checkpoint."""
        return {
            "observed": self.observed,
            "lo": None if self.lo is None else [float(v) for v in self.lo],
            "hi": None if self.hi is None else [float(v) for v in self.hi],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a malformed state raises ``ValueError``."""
        try:
            observed = int(state["observed"])
            lo, hi = state["lo"], state["hi"]
            if (lo is None) != (hi is None):
                raise ValueError("lo and hi must both be set or both be empty")
            lo_arr = None if lo is None else np.asarray(lo, dtype=np.float64)
            hi_arr = None if hi is None else np.asarray(hi, dtype=np.float64)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"observed range state is malformed: {exc}") from None
        if observed < 0:
            raise ValueError(f"observed range state counts {observed} records")
        if lo_arr is not None and hi_arr is not None:
            if lo_arr.ndim != 1 or lo_arr.shape != hi_arr.shape or not (
                    np.isfinite(lo_arr).all() and np.isfinite(hi_arr).all()) or (lo_arr > hi_arr).any():
                raise ValueError("observed range state needs finite per-feature bounds with lo <= hi")
        self.observed, self.lo, self.hi = observed, lo_arr, hi_arr
