"""Tests for streams.datasets: digits, the synthetic generator, the registry, held-out splits."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.neighbors import NearestCentroid

from edgestream.streams.datasets import (
    Dataset,
    load_digits_dataset,
    load_source,
    split_heldout,
    synthetic_sensor_dataset,
)


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_digits_dataset()


def make_dataset(n: int = 12, num_classes: int = 3) -> Dataset:
    features = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    labels = np.arange(n, dtype=np.int64) % num_classes
    return Dataset(features=features, labels=labels, num_classes=num_classes, name="toy")


def test_digits_read_from_the_bundled_file_equal_scikit_learns_loader(digits: Dataset) -> None:
    # The file is read directly (no scikit-learn import in a worker); the values must be
    # exactly what load_digits gives, scaled to [0, 1].
    from sklearn.datasets import load_digits

    bunch = load_digits()
    assert np.array_equal(digits.features, (bunch.data.astype(np.float32) / np.float32(16.0)).reshape(-1, 64))
    assert np.array_equal(digits.labels, bunch.target)


def test_digits_have_expected_shape_dtype_and_range(digits: Dataset) -> None:
    assert digits.features.shape == (1797, 64)
    assert digits.feature_shape == (64,)
    assert digits.features.dtype == np.float32
    assert digits.labels.dtype == np.int64
    assert digits.num_classes == 10
    assert digits.name == "digits"
    assert float(digits.features.min()) == 0.0
    assert float(digits.features.max()) == 1.0
    assert set(np.unique(digits.labels)) == set(range(10))


def test_subset_keeps_order_classes_and_name() -> None:
    ds = make_dataset()

    part = ds.subset([5, 0, 7])

    np.testing.assert_array_equal(part.labels, ds.labels[[5, 0, 7]])
    np.testing.assert_array_equal(part.features, ds.features[[5, 0, 7]])
    assert (part.num_classes, part.name, len(part)) == (3, "toy", 3)


@pytest.mark.parametrize(
    ("features", "labels", "num_classes"),
    [
        (np.zeros((3, 2), dtype=np.float64), np.zeros(3, dtype=np.int64), 2),  # wrong feature dtype
        (np.zeros((3, 2), dtype=np.float32), np.zeros(3, dtype=np.int32), 2),  # wrong label dtype
        (np.zeros((3, 2), dtype=np.float32), np.zeros(4, dtype=np.int64), 2),  # length mismatch
        # label out of range
        (np.zeros((3, 2), dtype=np.float32), np.array([0, 1, 2], dtype=np.int64), 2),
    ],
)
def test_dataset_rejects_inconsistent_arrays(
    features: np.ndarray, labels: np.ndarray, num_classes: int
) -> None:
    with pytest.raises(ValueError, match="dataset 'bad'"):
        Dataset(features=features, labels=labels, num_classes=num_classes, name="bad")


@pytest.mark.parametrize(
    ("channels", "window", "num_classes"), [(3, 32, 6), (1, 16, 4), (6, 64, 10)]
)
def test_synthetic_shapes_dtypes_and_balanced_classes(
    channels: int, window: int, num_classes: int
) -> None:
    ds = synthetic_sensor_dataset(
        120, num_classes=num_classes, channels=channels, window=window, seed=3
    )

    assert ds.features.shape == (120, channels, window)
    assert ds.feature_shape == (channels, window)
    assert ds.features.dtype == np.float32
    assert ds.labels.dtype == np.int64
    assert np.all(np.isfinite(ds.features))
    counts = np.bincount(ds.labels, minlength=num_classes)
    assert counts.max() - counts.min() <= 1


def test_synthetic_is_deterministic_in_seed() -> None:
    first = synthetic_sensor_dataset(200, seed=7, drift=0.5)
    again = synthetic_sensor_dataset(200, seed=7, drift=0.5)
    other = synthetic_sensor_dataset(200, seed=8, drift=0.5)

    np.testing.assert_array_equal(first.features, again.features)
    np.testing.assert_array_equal(first.labels, again.labels)
    assert not np.array_equal(first.features, other.features)


def test_synthetic_is_learnable_but_not_trivial() -> None:
    ds = synthetic_sensor_dataset(1200, seed=0)
    train, test = split_heldout(ds, fraction=0.25, seed=0)
    train_x, test_x = train.features.reshape(len(train), -1), test.features.reshape(len(test), -1)
    chance = 1.0 / ds.num_classes

    linear_accuracy = (
        LogisticRegression(max_iter=500).fit(train_x, train.labels).score(test_x, test.labels)
    )
    centroid_accuracy = NearestCentroid().fit(train_x, train.labels).score(test_x, test.labels)

    assert linear_accuracy > 0.8
    assert centroid_accuracy > 2.5 * chance
    # One template per class does not solve it: the per-sample shifts matter.
    assert centroid_accuracy < 0.9


def test_synthetic_drift_moves_late_samples_away_from_early_ones() -> None:
    def early_late_gap(drift: float) -> float:
        ds = synthetic_sensor_dataset(3000, seed=1, drift=drift, noise=0.1)
        early, late = ds.features[:500], ds.features[-500:]
        return float(
            np.abs(late.mean(axis=(0, 2)) - early.mean(axis=(0, 2))).sum()
            + abs(late.std() - early.std())
        )

    assert early_late_gap(1.0) > 5 * early_late_gap(0.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 0},
        {"n": 10, "num_classes": 1},
        {"n": 10, "noise": -1.0},
        {"n": 10, "drift": float("nan")},
    ],
)
def test_synthetic_rejects_bad_parameters(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="synthetic dataset"):
        synthetic_sensor_dataset(**kwargs)  # type: ignore[arg-type]


def test_load_source_dispatches_by_name() -> None:
    synthetic = load_source("synthetic", seed=2, n=50, channels=2)
    digits = load_source("digits")

    assert synthetic.name == "synthetic" and synthetic.features.shape == (50, 2, 32)
    np.testing.assert_array_equal(
        synthetic.features, synthetic_sensor_dataset(50, channels=2, seed=2).features
    )
    assert digits.name == "digits" and len(digits) == 1797


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("mnist", {}, "unknown data source 'mnist'; valid: digits, synthetic"),
        ("digits", {"n": 5}, "source 'digits' takes no parameters"),
        ("synthetic", {"rows": 5}, r"unknown parameters \['rows'\]"),
    ],
)
def test_load_source_rejects_unknown_names_and_parameters(
    name: str, params: dict[str, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_source(name, **params)


@pytest.mark.parametrize("fraction", [0.1, 0.2, 0.5])
def test_split_heldout_is_stratified_disjoint_and_covering(
    digits: Dataset, fraction: float
) -> None:
    indexed = Dataset(
        features=np.arange(len(digits), dtype=np.float32)[:, None],
        labels=digits.labels,
        num_classes=digits.num_classes,
        name="indexed",
    )

    streamed, heldout = split_heldout(indexed, fraction=fraction, seed=4)

    streamed_ids = streamed.features[:, 0].astype(np.int64)
    heldout_ids = heldout.features[:, 0].astype(np.int64)
    assert np.intersect1d(streamed_ids, heldout_ids).size == 0
    np.testing.assert_array_equal(
        np.sort(np.concatenate([streamed_ids, heldout_ids])), np.arange(len(digits))
    )
    assert np.all(np.diff(streamed_ids) > 0) and np.all(np.diff(heldout_ids) > 0)
    class_counts = np.bincount(digits.labels, minlength=10)
    heldout_counts = np.bincount(heldout.labels, minlength=10)
    np.testing.assert_allclose(heldout_counts, class_counts * fraction, atol=1.0)


def test_split_heldout_is_deterministic_in_seed(digits: Dataset) -> None:
    _, first = split_heldout(digits, seed=1)
    _, again = split_heldout(digits, seed=1)
    _, other = split_heldout(digits, seed=2)

    np.testing.assert_array_equal(first.features, again.features)
    assert not np.array_equal(first.features, other.features)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_split_heldout_rejects_fractions_outside_open_unit_interval(fraction: float) -> None:
    with pytest.raises(ValueError, match="fraction"):
        split_heldout(make_dataset(), fraction=fraction)
