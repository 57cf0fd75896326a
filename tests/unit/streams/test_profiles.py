"""Tests for streams.profiles: arrival counts of each rate profile and the profile spec parser."""

from __future__ import annotations

import numpy as np
import pytest

from edgestream.streams.profiles import (
    SCADLES_RATES,
    Bursty,
    Constant,
    Poisson,
    Ramp,
    RateProfile,
    parse_profile,
)


def count_arrivals(
    profile: RateProfile, duration_s: float, step_s: float, seed: int = 0
) -> list[int]:
    """Per-interval counts over [0, duration_s) in consecutive steps, as a simulator would ask."""
    rng = np.random.default_rng(seed)
    steps = int(round(duration_s / step_s))
    return [profile.arrivals(i * step_s, (i + 1) * step_s, rng) for i in range(steps)]


@pytest.mark.parametrize("rate", SCADLES_RATES + (0.0, 0.3, 7.5))
@pytest.mark.parametrize("step_s", [0.001, 0.01, 0.37])
def test_constant_counts_are_exact_over_many_small_intervals(rate: float, step_s: float) -> None:
    profile = Constant(rate)
    steps = int(round(100 / step_s))

    counts = count_arrivals(profile, steps * step_s, step_s)

    assert sum(counts) == round(rate * steps * step_s)
    assert min(counts) >= 0
    # Fluid counts never bunch up: each interval gets floor or ceil of its share.
    assert max(counts) <= int(np.ceil(rate * step_s))


def test_constant_ignores_the_generator_and_repeats_after_reset() -> None:
    profile = Constant(3.3)
    first = count_arrivals(profile, 10, 0.1, seed=1)

    profile.reset()
    again = count_arrivals(profile, 10, 0.1, seed=2)

    assert first == again


def test_poisson_mean_is_close_to_rate_and_counts_vary() -> None:
    rate, duration_s, step_s = 50.0, 200.0, 0.1
    expected_total = rate * duration_s

    counts = count_arrivals(Poisson(rate), duration_s, step_s, seed=123)

    # Poisson total has standard deviation sqrt(mean); allow five of them.
    assert abs(sum(counts) - expected_total) < 5 * np.sqrt(expected_total)
    assert np.var(counts) == pytest.approx(rate * step_s, rel=0.2)


def test_poisson_is_deterministic_given_the_generator_seed() -> None:
    first = count_arrivals(Poisson(20), 5, 0.05, seed=4)
    again = count_arrivals(Poisson(20), 5, 0.05, seed=4)
    other = count_arrivals(Poisson(20), 5, 0.05, seed=5)

    assert first == again
    assert first != other


@pytest.mark.parametrize(
    ("on_s", "off_s", "on_factor"),
    [(1.0, 1.0, None), (2.0, 1.0, None), (0.5, 3.0, 2.0), (1.0, 1.0, 1.0), (1.5, 0.5, 1.2)],
)
def test_bursty_mean_rate_equals_rate(on_s: float, off_s: float, on_factor: float | None) -> None:
    rate = 40.0
    profile = Bursty(rate, on_s=on_s, off_s=off_s, on_factor=on_factor)
    period_s = on_s + off_s
    duration_s = 20 * period_s

    counts = count_arrivals(profile, duration_s, 0.01)

    assert sum(counts) == round(rate * duration_s)
    assert profile.expected_arrivals(0.0, period_s) == pytest.approx(rate * period_s)


def test_bursty_arrives_only_in_on_phase_by_default() -> None:
    profile = Bursty(10.0, on_s=2.0, off_s=1.0)

    counts = count_arrivals(profile, 6.0, 0.5)

    assert profile.rate_hz(0.5) == pytest.approx(15.0)
    assert profile.rate_hz(2.5) == 0.0
    assert counts == [8, 7, 8, 7, 0, 0, 8, 7, 8, 7, 0, 0]


@pytest.mark.parametrize(
    ("on_factor", "message"), [(0.5, "on_factor must lie in"), (3.5, "on_factor must lie in")]
)
def test_bursty_rejects_factors_that_cannot_keep_the_mean(on_factor: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Bursty(10.0, on_s=1.0, off_s=2.0, on_factor=on_factor)


@pytest.mark.parametrize(("start", "end"), [(5.0, 20.0), (20.0, 5.0), (0.0, 10.0), (8.0, 8.0)])
def test_ramp_hits_its_endpoints_and_then_holds(start: float, end: float) -> None:
    over_s = 30.0
    profile = Ramp(start, end, over_s)

    assert profile.rate_hz(0.0) == start
    assert profile.rate_hz(over_s / 2) == pytest.approx((start + end) / 2)
    assert profile.rate_hz(over_s) == end
    assert profile.rate_hz(10 * over_s) == end
    assert profile.expected_arrivals(0.0, over_s) == pytest.approx((start + end) / 2 * over_s)
    assert profile.expected_arrivals(over_s, over_s + 10) == pytest.approx(end * 10)


def test_ramp_counts_follow_the_integral() -> None:
    profile = Ramp(0.0, 10.0, over_s=10.0)

    counts = count_arrivals(profile, 20.0, 0.05)

    assert sum(counts[:200]) == 50
    assert sum(counts) == 150
    assert sum(counts[:20]) < sum(counts[180:200])


def test_ramp_with_zero_duration_starts_at_end_rate() -> None:
    profile = Ramp(1.0, 4.0, over_s=0.0)

    assert profile.rate_hz(0.0) == 4.0
    assert sum(count_arrivals(profile, 10.0, 0.1)) == 40


@pytest.mark.parametrize(
    "build",
    [
        lambda: Constant(-1.0),
        lambda: Poisson(float("nan")),
        lambda: Ramp(1.0, 2.0, -5.0),
        lambda: Bursty(1.0, 0.0, 1.0),
    ],
)
def test_profiles_reject_bad_parameters(build: object) -> None:
    with pytest.raises(ValueError):
        build()  # type: ignore[operator]


@pytest.mark.parametrize(("t0", "t1"), [(2.0, 1.0), (-1.0, 1.0), (0.0, float("inf"))])
def test_profiles_reject_bad_intervals(t0: float, t1: float) -> None:
    with pytest.raises(ValueError, match="interval"):
        Constant(1.0).arrivals(t0, t1, np.random.default_rng(0))


@pytest.mark.parametrize(
    ("spec", "expected_type", "rate_at", "expected_rate"),
    [
        ("constant", Constant, 3.0, 10.0),
        (" Poisson ", Poisson, 3.0, 10.0),
        ("bursty", Bursty, 0.5, 20.0),
        ("bursty:on=2,off=1", Bursty, 2.5, 0.0),
        ("bursty:on=1, off=1, factor=1.5", Bursty, 1.5, 5.0),
        ("ramp:from=0.5,to=2,over=60", Ramp, 0.0, 5.0),
        ("ramp:from=0.5,to=2,over=60", Ramp, 60.0, 20.0),
        ("ramp", Ramp, 30.0, 5.0),
    ],
)
def test_parse_profile_builds_the_named_profile(
    spec: str, expected_type: type, rate_at: float, expected_rate: float
) -> None:
    profile = parse_profile(spec, base_rate_hz=10.0)

    assert isinstance(profile, expected_type)
    assert profile.rate_hz(rate_at) == pytest.approx(expected_rate)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("sawtooth", "unknown profile 'sawtooth'; valid: constant, poisson, bursty, ramp"),
        ("bursty:on", "parameter 'on' is not key=value"),
        ("bursty:on=2,,off=1", "empty parameter"),
        ("bursty:width=2", "unknown parameter 'width' for bursty"),
        ("constant:rate=3", "unknown parameter 'rate' for constant"),
        ("ramp:from=abc", "value 'abc' of 'from' is not a number"),
        ("ramp:to=inf", "value of 'to' must be finite"),
        ("ramp:to=1,to=2", "parameter 'to' given twice"),
        ("ramp:over=-3", "ramp duration over_s must be finite and >= 0"),
        ("bursty:on=1,off=1,factor=3", "on_factor must lie in"),
    ],
)
def test_parse_profile_names_the_bad_part(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_profile(spec, base_rate_hz=10.0)


def test_parse_profile_rejects_a_negative_base_rate() -> None:
    with pytest.raises(ValueError, match="base rate"):
        parse_profile("constant", base_rate_hz=-1.0)


def test_scadles_rates_are_the_ten_paper_rates() -> None:
    assert SCADLES_RATES == (92, 38, 62, 42, 48, 88, 90, 22, 44, 28)
