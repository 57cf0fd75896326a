"""Arrival-rate estimation from counted arrivals (pure; the clock is passed in)."""

from __future__ import annotations

import math


class RateEstimator:
    """Exponentially-weighted arrival rate in records per second.

    Keeps an exponentially decayed count of arrivals with time constant ``tau_s``; the
    rate is that count divided by the effective window, which is ``tau_s`` once the
    estimator is older than that and the elapsed time before (so early estimates are
    not biased low). Invariant: with a constant rate ``r`` the estimate converges to ``r``.
    """

    def __init__(self, tau_s: float = 5.0, start: float = 0.0) -> None:
        if tau_s <= 0:
            raise ValueError("tau_s must be positive")
        self.tau_s = tau_s
        self.start = start
        self._last = start
        self._weighted = 0.0  # decayed count, as of self._last
        self._weight_norm = 0.0  # integral of the decay kernel over observed time
        self.total = 0

    def _advance(self, now: float) -> None:
        dt = now - self._last
        if dt <= 0:
            return
        decay = math.exp(-dt / self.tau_s)
        self._weighted *= decay
        self._weight_norm = self._weight_norm * decay + self.tau_s * (1.0 - decay)
        self._last = now

    def observe(self, count: int, now: float) -> None:
        """Record ``count`` arrivals at time ``now`` (monotonic seconds)."""
        self._advance(now)
        self._weighted += count
        self.total += count

    def rate_hz(self, now: float) -> float:
        self._advance(now)
        if self._weight_norm <= 0:
            return 0.0
        return self._weighted / self._weight_norm
