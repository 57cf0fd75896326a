"""ObservedRange: per-feature bounds learned from a stream without a declared range, and
the driver refusing records outside them before any step sees them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgestream.trainers.driver import DriverConfig, TrainingDriver
from edgestream.trainers.local import LocalTrainer
from edgestream.trainers.models import build_model
from edgestream.trainers.observed import REASON, ObservedRange
from edgestream.trainers.strategies import StrategyContext
from tests.unit.trainers.test_culprit_search import ApplyAtOnce, devices


def normal(n: int, features: int = 4, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).uniform(0, 1, size=(n, features)) * scale).astype(np.float32)


def warmed(margin: float = 1.0, warmup: int = 100) -> ObservedRange:
    observed = ObservedRange(margin, warmup)
    observed.observe(normal(warmup))
    return observed


def test_nothing_is_refused_during_the_warm_up():
    observed = ObservedRange(1.0, warmup=100)
    observed.observe(normal(99))

    assert not observed.active
    assert not observed.outside(normal(5) * 1e5).any()


@pytest.mark.parametrize("scale", [300, 1000, 100_000, -300])
def test_records_far_outside_the_observed_scale_are_refused(scale):
    observed = warmed()
    batch = normal(6, seed=1)
    batch[[1, 4]] *= scale

    assert observed.outside(batch).tolist() == [False, True, False, False, True, False]


def test_the_margin_admits_values_near_the_observed_range():
    observed = warmed(margin=1.0)  # observed about [0, 1]: the band is about [-1, 2]

    assert not observed.outside(np.full((1, 4), 1.9, dtype=np.float32)).any()
    assert observed.outside(np.full((1, 4), 2.1, dtype=np.float32)).all()
    assert observed.outside(np.array([[0.5, np.nan, 0.5, 0.5]], dtype=np.float32)).all()


def test_a_feature_seen_constant_gets_the_band_of_a_typical_feature():
    observed = ObservedRange(1.0, warmup=10)
    data = normal(10)
    data[:, 2] = 0.0  # a pixel that was always dark so far
    observed.observe(data)

    assert not observed.outside(np.array([[0.5, 0.5, 0.7, 0.5]], dtype=np.float32)).any()


def test_a_slowly_drifting_stream_is_followed_not_rejected_wholesale():
    observed = warmed(margin=1.0)
    refused = 0
    for step in range(1, 60):  # the level rises by 5 % of the span per batch: x4 in the end
        batch = normal(20, seed=step) + 0.05 * step
        outside = observed.outside(batch)
        refused += int(outside.sum())
        observed.observe(batch[~outside])

    assert refused == 0
    assert observed.outside(np.full((1, 4), 100.0, dtype=np.float32)).all()  # a jump still is refused


def test_state_round_trips_through_json():
    observed = warmed()
    restored = ObservedRange(1.0, warmup=100)

    restored.load_state_dict(json.loads(json.dumps(observed.state_dict(), allow_nan=False)))

    probe = np.vstack([normal(3, seed=5), normal(3, seed=6) * 500])
    assert restored.active and restored.observed == observed.observed
    assert restored.outside(probe).tolist() == observed.outside(probe).tolist() == [False] * 3 + [True] * 3


@pytest.mark.parametrize("state", [
    {"observed": 5, "lo": [0.0, 1.0], "hi": [1.0, 0.0]},
    {"observed": 5, "lo": [0.0], "hi": None},
    {"observed": -1, "lo": None, "hi": None},
    {"lo": None, "hi": None},
])
def test_a_malformed_state_is_refused(state):
    with pytest.raises(ValueError):
        ObservedRange().load_state_dict(state)


def make_driver(warmup: int = 48) -> TrainingDriver:
    trainer = LocalTrainer(build_model("mlp", (4,), 3, seed=0, hidden=(8,)), lr=0.1)
    strategy = ApplyAtOnce(StrategyContext(worker_id="w0", trainer=trainer))
    config = DriverConfig(job="test", observed_margin=1.0, observed_warmup=warmup)
    return TrainingDriver("w0", trainer, strategy, config)


def test_the_driver_dead_letters_records_outside_the_learned_range_and_trains_the_rest():
    driver = make_driver()
    rng = np.random.default_rng(0)
    for seed in range(3):  # 48 records: the warm-up
        driver.step(normal(16, seed=seed), rng.integers(0, 3, 16), devices(8, 8))
    x, y = normal(16, seed=9), rng.integers(0, 3, 16)
    x[[3, 11]] *= 300

    stepped = driver.step(x, y, devices(8, 8))

    assert stepped.rejection is None and stepped.refused is None  # no step was refused
    (dead,) = stepped.dead
    assert dead.indices.tolist() == [3, 11] and dead.rejection.reason == REASON
    assert "data.value_margin" in dead.rejection.detail
    assert stepped.trained.tolist() == [i for i in range(16) if i not in (3, 11)]
    assert len(stepped.correct_mask) == 14 and driver.prequential.records == 48 + 14
    assert driver.observed.observed == 48 + 14  # the refused records did not widen the bounds
    assert driver.stats()["guard"]["outside_observed_range"] == 2


def test_without_observed_bounds_the_same_records_are_trained():
    trainer = LocalTrainer(build_model("mlp", (4,), 3, seed=0, hidden=(8,)), lr=0.1)
    driver = TrainingDriver("w0", trainer, ApplyAtOnce(StrategyContext(worker_id="w0", trainer=trainer)),
                            DriverConfig(job="test"))
    x = normal(16, seed=9)
    x[[3, 11]] *= 300

    stepped = driver.step(x, np.zeros(16, dtype=np.int64), devices(8, 8))

    assert driver.observed is None and stepped.dead == () and stepped.trained_records == 16
