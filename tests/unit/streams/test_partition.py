"""Tests for streams.partition: scheme invariants, label skew, dispatch, the device sampler."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edgestream.streams.datasets import Dataset
from edgestream.streams.partition import (
    DeviceSampler,
    label_histogram,
    partition,
    partition_dirichlet,
    partition_iid,
    partition_k_classes,
)

NUM_CLASSES = 10


def make_labels(per_class: int = 60, num_classes: int = NUM_CLASSES, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.permutation(np.repeat(np.arange(num_classes, dtype=np.int64), per_class))


def make_dataset(n: int = 30, num_classes: int = 3) -> Dataset:
    # Feature value = sample index, so served samples can be traced back.
    return Dataset(
        features=np.arange(n, dtype=np.float32)[:, None],
        labels=np.arange(n, dtype=np.int64) % num_classes,
        num_classes=num_classes,
        name="indexed",
    )


SCHEMES: list[tuple[str, dict[str, Any]]] = [
    ("iid", {}),
    ("dirichlet", {"alpha": 0.3}),
    ("dirichlet", {"alpha": 0.05, "min_size": 20}),
    ("dirichlet", {"alpha": 100.0}),
    ("classes", {"k": 2}),
    ("classes", {"k": 5}),
    ("classes", {"k": 10}),
]


@pytest.mark.parametrize(("scheme", "params"), SCHEMES)
@pytest.mark.parametrize("num_devices", [5, 10, 16])
def test_every_scheme_gives_disjoint_covering_nonempty_parts(
    scheme: str, params: dict[str, Any], num_devices: int
) -> None:
    labels = make_labels()

    parts = partition(labels, num_devices, scheme, seed=3, **params)

    assert len(parts) == num_devices
    assert all(part.dtype == np.int64 and part.size > 0 for part in parts)
    everything = np.concatenate(parts)
    np.testing.assert_array_equal(np.sort(everything), np.arange(labels.size))
    assert all(np.all(np.diff(part) > 0) for part in parts)


@pytest.mark.parametrize(("scheme", "params"), SCHEMES)
def test_every_scheme_is_deterministic_in_seed(scheme: str, params: dict[str, Any]) -> None:
    labels = make_labels()

    first = partition(labels, 10, scheme, seed=11, **params)
    again = partition(labels, 10, scheme, seed=11, **params)
    other = partition(labels, 10, scheme, seed=12, **params)

    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_iid_sizes_differ_by_at_most_one_and_labels_are_mixed() -> None:
    labels = make_labels()

    parts = partition_iid(labels, 7, seed=0)

    sizes = [part.size for part in parts]
    assert max(sizes) - min(sizes) <= 1
    assert (label_histogram(labels, parts, NUM_CLASSES) > 0).all()


@pytest.mark.parametrize(
    ("num_devices", "k"), [(10, 1), (10, 2), (7, 3), (4, 3), (20, 2), (3, 10), (13, 7), (10, 9)]
)
def test_k_classes_gives_each_device_exactly_k_classes_and_uses_all(
    num_devices: int, k: int
) -> None:
    labels = make_labels()

    parts = partition_k_classes(labels, num_devices, k, seed=5)

    histogram = label_histogram(labels, parts, NUM_CLASSES)
    assert ((histogram > 0).sum(axis=1) == k).all()
    holders_per_class = (histogram > 0).sum(axis=0)
    assert (holders_per_class > 0).all()
    assert holders_per_class.max() - holders_per_class.min() <= 1


def test_k_classes_varies_class_sets_between_devices() -> None:
    labels = make_labels()

    parts = partition_k_classes(labels, 10, 2, seed=0)

    class_sets = {tuple(np.flatnonzero(row)) for row in label_histogram(labels, parts, NUM_CLASSES)}
    assert len(class_sets) > 5


@pytest.mark.parametrize(
    ("num_devices", "k", "message"),
    [(10, 0, "k must lie in"), (10, 11, "k must lie in"), (3, 2, "cannot cover all 10 classes")],
)
def test_k_classes_rejects_impossible_requests(num_devices: int, k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        partition_k_classes(make_labels(), num_devices, k, seed=0)


def test_k_classes_rejects_classes_too_small_for_their_devices() -> None:
    labels = make_labels(per_class=2)

    with pytest.raises(ValueError, match="class .* has 2 samples but is assigned to 3 devices"):
        partition_k_classes(labels, 15, 2, seed=0)


def mean_label_skew(alpha: float, seeds: range = range(5)) -> float:
    """Mean total-variation distance between each device's label mix and the global one."""
    labels = make_labels(per_class=200)
    distances = []
    for seed in seeds:
        histogram = label_histogram(
            labels, partition_dirichlet(labels, 10, alpha, seed=seed), NUM_CLASSES
        )
        device_mix = histogram / histogram.sum(axis=1, keepdims=True)
        distances.append(0.5 * np.abs(device_mix - 1.0 / NUM_CLASSES).sum(axis=1).mean())
    return float(np.mean(distances))


def test_dirichlet_skew_increases_as_alpha_falls() -> None:
    skews = [mean_label_skew(alpha) for alpha in (100.0, 1.0, 0.3, 0.05)]

    assert skews == sorted(skews)
    assert skews[0] < 0.1
    assert skews[-1] > 0.6


def test_dirichlet_respects_min_size_even_when_draws_keep_failing() -> None:
    # 50 devices with 6 samples each minimum from 300: Dirichlet(0.01) draws
    # essentially never satisfy this, so the top-up path has to.
    labels = make_labels(per_class=30)

    parts = partition_dirichlet(labels, 50, alpha=0.01, seed=0, min_size=6)

    assert [part.size for part in parts] == [6] * 50
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(labels.size))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": 0.0}, "alpha must be finite and > 0"),
        ({"alpha": float("inf")}, "alpha must be finite and > 0"),
        ({"alpha": 1.0, "min_size": 0}, "min_size must be >= 1"),
        ({"alpha": 1.0, "min_size": 61}, "cannot give each of 10 devices at least 61 samples"),
    ],
)
def test_dirichlet_rejects_bad_parameters(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        partition_dirichlet(make_labels(), 10, seed=0, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("scheme", "params", "message"),
    [
        ("shards", {}, "unknown partition scheme 'shards'; valid: classes, dirichlet, iid"),
        ("dirichlet", {}, r"needs parameters \['alpha'\]"),
        ("classes", {"k": 2, "alpha": 1.0}, r"unknown parameters \['alpha'\]"),
        ("iid", {"k": 2}, r"unknown parameters \['k'\]"),
    ],
)
def test_partition_dispatch_rejects_bad_scheme_or_parameters(
    scheme: str, params: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        partition(make_labels(), 10, scheme, seed=0, **params)


def test_partition_rejects_more_devices_than_samples() -> None:
    with pytest.raises(ValueError, match="cannot give each of 5 devices"):
        partition_iid(np.zeros(4, dtype=np.int64), 5, seed=0)


def test_label_histogram_counts_each_device_and_class() -> None:
    labels = np.array([0, 1, 1, 2, 2, 2], dtype=np.int64)
    parts = [np.array([0, 1]), np.array([2, 3, 4, 5])]

    histogram = label_histogram(labels, parts, num_classes=4)

    np.testing.assert_array_equal(histogram, [[1, 1, 0, 0], [0, 1, 3, 0]])


def test_sampler_visits_every_index_once_per_pass_and_reshuffles() -> None:
    dataset = make_dataset()
    indices = np.arange(3, 23)
    sampler = DeviceSampler(dataset, indices, seed=0)

    _, _, first_pass = sampler.take(20)
    _, _, second_pass = sampler.take(20)

    np.testing.assert_array_equal(np.sort(first_pass), indices)
    np.testing.assert_array_equal(np.sort(second_pass), indices)
    assert not np.array_equal(first_pass, second_pass)
    assert sampler.samples_served == 40


def test_sampler_returns_matching_features_and_labels_across_pass_boundaries() -> None:
    dataset = make_dataset()
    sampler = DeviceSampler(dataset, np.array([1, 4, 9, 16, 25]), seed=2)

    features, labels, source = sampler.take(13)

    assert features.shape == (13, 1) and labels.shape == (13,) and source.shape == (13,)
    np.testing.assert_array_equal(features[:, 0].astype(np.int64), source)
    np.testing.assert_array_equal(labels, dataset.labels[source])
    assert sampler.passes_completed == 2
    assert sorted(np.bincount(source, minlength=26)[[1, 4, 9, 16, 25]].tolist()) == [2, 2, 3, 3, 3]


@pytest.mark.parametrize("chunk_sizes", [[37], [1] * 37, [5, 0, 12, 20]])
def test_sampler_stream_does_not_depend_on_how_it_is_chunked(chunk_sizes: list[int]) -> None:
    dataset = make_dataset()
    reference = DeviceSampler(dataset, np.arange(0, 30, 2), seed=9).take(37)[2]
    sampler = DeviceSampler(dataset, np.arange(0, 30, 2), seed=9)

    served = np.concatenate([sampler.take(size)[2] for size in chunk_sizes])

    np.testing.assert_array_equal(served, reference)


def test_sampler_take_zero_returns_empty_arrays_of_the_right_shape() -> None:
    sampler = DeviceSampler(make_dataset(), np.arange(5), seed=0)

    features, labels, source = sampler.take(0)

    assert features.shape == (0, 1) and labels.shape == (0,) and source.shape == (0,)
    assert sampler.samples_served == 0


@pytest.mark.parametrize(
    ("indices", "message"),
    [(np.array([], dtype=np.int64), "non-empty"), (np.array([0, 30]), r"must lie in \[0, 30\)")],
)
def test_sampler_rejects_empty_or_out_of_range_indices(indices: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DeviceSampler(make_dataset(), indices, seed=0)
