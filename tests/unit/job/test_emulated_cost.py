"""The emulated device compute cost of live workers (workers.step_base_s,
workers.step_per_record_s): the wait rule and the config validation."""

from __future__ import annotations

import pytest

from edgestream.job.config import ConfigError, emulated_wait_s, load_config


def test_defaults_keep_the_slowdown_rule():
    # base 0, per record 0: wait (slowdown - 1) x the measured compute, as before.
    assert emulated_wait_s(0.002, 64, 0.0, 0.0, 1.0) == 0.0
    assert emulated_wait_s(0.002, 64, 0.0, 0.0, 5.4) == pytest.approx(4.4 * 0.002)


def test_emulated_cost_pads_the_step_to_the_device_cost():
    # The default simulated cost model: (10 ms + 2 ms/record) x slowdown; measured 1 ms counts.
    assert emulated_wait_s(0.001, 64, 0.01, 0.002, 1.0) == pytest.approx(0.138 - 0.001)
    assert emulated_wait_s(0.001, 64, 0.01, 0.002, 5.4) == pytest.approx(0.138 * 5.4 - 0.001)
    assert emulated_wait_s(0.0, 0, 0.5, 0.0, 2.0) == pytest.approx(1.0)


def test_slower_measured_compute_keeps_the_slowdown_rule():
    # Measured 0.2 s > emulated 0.138 s: the step lasts slowdown x measured.
    assert emulated_wait_s(0.2, 64, 0.01, 0.002, 1.0) == 0.0
    assert emulated_wait_s(0.2, 64, 0.01, 0.002, 2.0) == pytest.approx(0.2)
    # Between the two: the emulated cost wins (0.138 x 2 = 0.276 > 2 x 0.1).
    assert emulated_wait_s(0.1, 64, 0.01, 0.002, 2.0) == pytest.approx(0.276 - 0.1)


def test_worker_wait_uses_its_slowdown():
    cfg = load_config(overrides=["workers.count=2", "workers.slowdown=1,3", "workers.step_base_s=0.01",
                                 "workers.step_per_record_s=0.002"], env={})
    assert cfg.workers.wait_after_step_s(0, 0.001, 64) == pytest.approx(0.137)
    assert cfg.workers.wait_after_step_s(1, 0.001, 64) == pytest.approx(0.414 - 0.001)
    assert load_config(env={}).workers.wait_after_step_s(0, 0.001, 64) == 0.0


@pytest.mark.parametrize("override", ["workers.step_base_s=-0.01", "workers.step_base_s=nan",
                                      "workers.step_per_record_s=inf", "workers.step_per_record_s=-1"])
def test_invalid_step_cost_is_refused(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"{key} must be a finite number >= 0"):
        load_config(overrides=[override], env={})
