"""RateEstimator on a fake clock."""

from __future__ import annotations

import pytest

from edgestream.streams.rates import RateEstimator


@pytest.mark.parametrize("rate", [5.0, 92.0, 1000.0])
def test_converges_to_a_constant_rate(rate):
    est = RateEstimator(tau_s=2.0)
    t = 0.0
    for _ in range(400):
        t += 0.05
        est.observe(rate * 0.05, t)
    assert est.rate_hz(t) == pytest.approx(rate, rel=0.03)


def test_early_estimate_is_not_biased_low():
    est = RateEstimator(tau_s=10.0)
    for i in range(1, 11):
        est.observe(10, i * 0.1)  # 100/s for one second
    assert est.rate_hz(1.0) == pytest.approx(100, rel=0.1)


def test_tracks_a_rate_change_and_decays_when_silent():
    est = RateEstimator(tau_s=1.0)
    t = 0.0
    for _ in range(100):
        t += 0.1
        est.observe(10, t)  # 100/s
    for _ in range(100):
        t += 0.1
        est.observe(2, t)  # 20/s
    # Arrivals counted at the end of 0.1 s steps bias a 1 s EWMA up by about dt / 2tau.
    assert est.rate_hz(t) == pytest.approx(20, rel=0.08)
    assert est.rate_hz(t + 10) < 0.1
    assert est.total == 1200


def test_zero_before_any_time_passes():
    assert RateEstimator().rate_hz(0.0) == 0.0
