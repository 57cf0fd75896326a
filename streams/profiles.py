"""Device arrival-rate profiles: how many records a simulated device emits per interval."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np

__all__ = [
    "SCADLES_RATES",
    "Bursty",
    "Constant",
    "Poisson",
    "Ramp",
    "RateProfile",
    "parse_profile",
    "profile_names",
]

# Per-device sample rates (samples/s) of the ten streams in the ScaDLES paper;
# the time-to-accuracy benchmark scales them by one common factor.
SCADLES_RATES: tuple[int, ...] = (92, 38, 62, 42, 48, 88, 90, 22, 44, 28)


def _check_rate(name: str, value: float) -> float:
    rate = float(value)
    if not math.isfinite(rate) or rate < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return rate


def _check_interval(t0: float, t1: float) -> None:
    if not (math.isfinite(t0) and math.isfinite(t1)) or t0 < 0 or t1 < t0:
        raise ValueError(f"interval must satisfy 0 <= t0 <= t1, got [{t0}, {t1})")


class RateProfile(ABC):
    """How a device's arrival rate evolves over stream time (seconds since the stream started).

    Profiles never read a clock: callers pass the times. Deterministic profiles
    keep a running remainder, so one instance should serve one device and be
    asked about consecutive intervals.
    """

    @abstractmethod
    def rate_hz(self, t: float) -> float:
        """Nominal instantaneous arrival rate at time `t`, in records per second."""

    @abstractmethod
    def expected_arrivals(self, t0: float, t1: float) -> float:
        """Integral of `rate_hz` over [t0, t1): the mean number of arrivals in that interval."""

    @abstractmethod
    def arrivals(self, t0: float, t1: float, rng: np.random.Generator) -> int:
        """Number of records arriving in [t0, t1)."""

    def reset(self) -> None:  # noqa: B027 - stateless profiles have nothing to reset
        """Forget any state carried between intervals, as if the stream restarted."""


class _DeterministicProfile(RateProfile):
    """A fluid profile whose counts are the running integral, rounded, with the remainder carried.

    Invariant: after any sequence of intervals of total length T, the total count
    equals round(integral of the rate over those intervals).
    """

    def __init__(self) -> None:
        self._expected_total = 0.0
        self._emitted_total = 0

    def arrivals(self, t0: float, t1: float, rng: np.random.Generator) -> int:
        del rng  # deterministic: the generator is accepted for a uniform interface
        self._expected_total += self.expected_arrivals(t0, t1)
        count = max(int(math.floor(self._expected_total + 0.5)) - self._emitted_total, 0)
        self._emitted_total += count
        return count

    def reset(self) -> None:
        self._expected_total = 0.0
        self._emitted_total = 0


class Constant(_DeterministicProfile):
    """A steady `rate` records per second, with exact long-run counts (no randomness)."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = _check_rate("constant rate", rate)

    def rate_hz(self, t: float) -> float:
        return self.rate

    def expected_arrivals(self, t0: float, t1: float) -> float:
        _check_interval(t0, t1)
        return self.rate * (t1 - t0)

    def __repr__(self) -> str:
        return f"Constant(rate={self.rate})"


class Poisson(RateProfile):
    """A Poisson process of `rate` records per second: counts per interval are Poisson."""

    def __init__(self, rate: float) -> None:
        self.rate = _check_rate("poisson rate", rate)

    def rate_hz(self, t: float) -> float:
        return self.rate

    def expected_arrivals(self, t0: float, t1: float) -> float:
        _check_interval(t0, t1)
        return self.rate * (t1 - t0)

    def arrivals(self, t0: float, t1: float, rng: np.random.Generator) -> int:
        return int(rng.poisson(self.expected_arrivals(t0, t1)))

    def __repr__(self) -> str:
        return f"Poisson(rate={self.rate})"


class Bursty(_DeterministicProfile):
    """An on/off square wave starting with `on_s` seconds on, then `off_s` seconds off, repeating.

    During the on phase the rate is `on_factor * rate`; the off-phase rate is
    whatever keeps the mean over each period equal to `rate`. The default
    `on_factor` puts every arrival in the on phase (the device is silent when
    off). Invariant: the integral over each whole period is `rate * (on_s + off_s)`.
    """

    def __init__(
        self, rate: float, on_s: float = 1.0, off_s: float = 1.0, on_factor: float | None = None
    ) -> None:
        super().__init__()
        self.rate = _check_rate("bursty rate", rate)
        self.on_s = _check_rate("bursty on_s", on_s)
        self.off_s = _check_rate("bursty off_s", off_s)
        if self.on_s <= 0:
            raise ValueError(f"bursty on_s must be > 0, got {on_s}")
        period_s = self.on_s + self.off_s
        max_factor = period_s / self.on_s
        factor = max_factor if on_factor is None else float(on_factor)
        # Tolerate rounding when a caller passes the maximum factor explicitly.
        if not math.isfinite(factor) or factor < 1.0 or factor > max_factor * (1 + 1e-12):
            raise ValueError(
                f"bursty on_factor must lie in [1, (on_s + off_s) / on_s = {max_factor:g}] "
                f"so the off-phase rate is not negative, got {on_factor}"
            )
        self.on_factor = min(factor, max_factor)
        self.period_s = period_s
        self.on_rate_hz = self.rate * self.on_factor
        self.off_rate_hz = (
            max(self.rate * period_s - self.on_rate_hz * self.on_s, 0.0) / self.off_s
            if self.off_s > 0
            else 0.0
        )

    def rate_hz(self, t: float) -> float:
        return self.on_rate_hz if math.fmod(t, self.period_s) < self.on_s else self.off_rate_hz

    def _cumulative(self, t: float) -> float:
        whole_periods, into_period = divmod(t, self.period_s)
        in_on = min(into_period, self.on_s)
        in_off = max(into_period - self.on_s, 0.0)
        return (
            whole_periods * self.rate * self.period_s
            + in_on * self.on_rate_hz
            + in_off * self.off_rate_hz
        )

    def expected_arrivals(self, t0: float, t1: float) -> float:
        _check_interval(t0, t1)
        return self._cumulative(t1) - self._cumulative(t0)

    def __repr__(self) -> str:
        return (
            f"Bursty(rate={self.rate}, on_s={self.on_s}, off_s={self.off_s}, "
            f"on_factor={self.on_factor})"
        )


class Ramp(_DeterministicProfile):
    """A rate moving linearly from `start_rate` to `end_rate` over `over_s` seconds, then holding.

    With `over_s` = 0 the rate is `end_rate` from the start.
    """

    def __init__(self, start_rate: float, end_rate: float, over_s: float) -> None:
        super().__init__()
        self.start_rate = _check_rate("ramp start rate", start_rate)
        self.end_rate = _check_rate("ramp end rate", end_rate)
        self.over_s = _check_rate("ramp duration over_s", over_s)

    def rate_hz(self, t: float) -> float:
        if self.over_s == 0 or t >= self.over_s:
            return self.end_rate
        return self.start_rate + (self.end_rate - self.start_rate) * max(t, 0.0) / self.over_s

    def _cumulative(self, t: float) -> float:
        ramp_t = min(t, self.over_s)
        during_ramp = self.start_rate * ramp_t
        if self.over_s > 0:
            during_ramp += (self.end_rate - self.start_rate) * ramp_t * ramp_t / (2.0 * self.over_s)
        return during_ramp + self.end_rate * max(t - self.over_s, 0.0)

    def expected_arrivals(self, t0: float, t1: float) -> float:
        _check_interval(t0, t1)
        return self._cumulative(t1) - self._cumulative(t0)

    def __repr__(self) -> str:
        return f"Ramp(start_rate={self.start_rate}, end_rate={self.end_rate}, over_s={self.over_s})"


# Spec keys each profile name accepts; multiplier keys scale the base rate.
_SPEC_KEYS: dict[str, tuple[str, ...]] = {
    "constant": (),
    "poisson": (),
    "bursty": ("on", "off", "factor"),
    "ramp": ("from", "to", "over"),
}


def profile_names() -> tuple[str, ...]:
    """Profile names `parse_profile` accepts."""
    return tuple(_SPEC_KEYS)


def _parse_params(spec: str, name: str, text: str) -> dict[str, float]:
    valid = _SPEC_KEYS[name]
    params: dict[str, float] = {}
    for part in text.split(","):
        item = part.strip()
        if not item:
            raise ValueError(f"rate profile spec {spec!r}: empty parameter (stray comma?)")
        key, sep, raw_value = (piece.strip() for piece in item.partition("="))
        if not sep or not key:
            raise ValueError(f"rate profile spec {spec!r}: parameter {item!r} is not key=value")
        key = key.lower()
        if key not in valid:
            allowed = ", ".join(valid) if valid else "none"
            raise ValueError(
                f"rate profile spec {spec!r}: unknown parameter {key!r} for {name} "
                f"(valid: {allowed})"
            )
        if key in params:
            raise ValueError(f"rate profile spec {spec!r}: parameter {key!r} given twice")
        try:
            value = float(raw_value)
        except ValueError:
            raise ValueError(
                f"rate profile spec {spec!r}: value {raw_value!r} of {key!r} is not a number"
            ) from None
        if not math.isfinite(value):
            raise ValueError(
                f"rate profile spec {spec!r}: value of {key!r} must be finite, got {raw_value!r}"
            )
        params[key] = value
    return params


def parse_profile(spec: str, base_rate_hz: float) -> RateProfile:
    """Build a profile from a spec such as "bursty:on=2,off=1" or "ramp:from=0.5,to=2,over=60".

    Syntax is `name[:key=value,...]`. Keys: bursty takes `on` and `off` (seconds,
    default 1 each) and `factor` (on-phase rate as a multiple of the base rate,
    default: all arrivals in the on phase); ramp takes `from` and `to` (multiples
    of the base rate, default 0 and 1) and `over` (seconds, default 60).
    Constant and poisson take none. Any bad part raises ValueError naming it.
    """
    base_rate = _check_rate("base rate", base_rate_hz)
    name_text, has_params, params_text = spec.strip().partition(":")
    name = name_text.strip().lower()
    if name not in _SPEC_KEYS:
        raise ValueError(
            f"rate profile spec {spec!r}: unknown profile {name_text.strip()!r}; "
            f"valid: {', '.join(profile_names())}"
        )
    params = _parse_params(spec, name, params_text) if has_params else {}
    try:
        if name == "constant":
            return Constant(base_rate)
        if name == "poisson":
            return Poisson(base_rate)
        if name == "bursty":
            return Bursty(
                base_rate,
                on_s=params.get("on", 1.0),
                off_s=params.get("off", 1.0),
                on_factor=params.get("factor"),
            )
        return Ramp(
            base_rate * params.get("from", 0.0),
            base_rate * params.get("to", 1.0),
            over_s=params.get("over", 60.0),
        )
    except ValueError as error:
        raise ValueError(f"rate profile spec {spec!r}: {error}") from None
