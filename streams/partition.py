"""Splitting samples over devices (IID and non-IID) and replaying one device's share endlessly."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from edgestream.streams.datasets import Dataset

__all__ = [
    "DeviceSampler",
    "label_histogram",
    "partition",
    "partition_dirichlet",
    "partition_iid",
    "partition_k_classes",
    "scheme_names",
]

# Draws of the Dirichlet proportions before falling back to moving samples
# into devices that came out smaller than `min_size`.
_DIRICHLET_MAX_DRAWS = 100


def _as_labels(labels: np.ndarray) -> np.ndarray:
    label_array = np.asarray(labels)
    if label_array.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {label_array.shape}")
    if label_array.size and not np.issubdtype(label_array.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {label_array.dtype}")
    if label_array.size and label_array.min() < 0:
        raise ValueError(f"labels must be >= 0, got {label_array.min()}")
    return label_array.astype(np.int64, copy=False)


def _check_devices(num_samples: int, num_devices: int, min_size: int = 1) -> None:
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if num_samples < num_devices * min_size:
        raise ValueError(
            f"cannot give each of {num_devices} devices at least {min_size} samples "
            f"from {num_samples} samples"
        )


def _finish(parts: list[np.ndarray]) -> list[np.ndarray]:
    # Sorted indices keep each device's share in source (time) order.
    return [np.sort(np.asarray(part, dtype=np.int64)) for part in parts]


def partition_iid(labels: np.ndarray, num_devices: int, seed: int) -> list[np.ndarray]:
    """Shuffle all samples and deal them into `num_devices` shares differing in size by <= 1."""
    label_array = _as_labels(labels)
    _check_devices(label_array.size, num_devices)
    rng = np.random.default_rng(seed)
    return _finish(np.array_split(rng.permutation(label_array.size), num_devices))


def partition_dirichlet(
    labels: np.ndarray,
    num_devices: int,
    alpha: float,
    seed: int,
    min_size: int = 10,
) -> list[np.ndarray]:
    """Label-skewed shares: each class is split over devices in proportions ~ Dirichlet(alpha).

    Small `alpha` concentrates each class on few devices (strong skew); large
    `alpha` approaches an IID split. Proportions are redrawn until every device
    holds at least `min_size` samples; if that keeps failing, the largest
    devices hand random samples to the short ones, so no device is ever empty.
    """
    label_array = _as_labels(labels)
    if not alpha > 0 or not np.isfinite(alpha):
        raise ValueError(f"dirichlet alpha must be finite and > 0, got {alpha}")
    if min_size < 1:
        raise ValueError(f"min_size must be >= 1, got {min_size}")
    _check_devices(label_array.size, num_devices, min_size)
    rng = np.random.default_rng(seed)
    classes = np.unique(label_array)

    assignment = np.empty(label_array.size, dtype=np.int64)
    for _ in range(_DIRICHLET_MAX_DRAWS):
        for label in classes:
            class_indices = rng.permutation(np.flatnonzero(label_array == label))
            proportions = rng.dirichlet(np.full(num_devices, float(alpha)))
            cut_points = (np.cumsum(proportions)[:-1] * class_indices.size).astype(np.int64)
            for device, share in enumerate(np.split(class_indices, cut_points)):
                assignment[share] = device
        if np.bincount(assignment, minlength=num_devices).min() >= min_size:
            break
    else:
        _top_up_short_devices(assignment, num_devices, min_size, rng)

    return _finish([np.flatnonzero(assignment == device) for device in range(num_devices)])


def _top_up_short_devices(
    assignment: np.ndarray, num_devices: int, min_size: int, rng: np.random.Generator
) -> None:
    """Move random samples from the largest devices to those below `min_size`, in place."""
    sizes = np.bincount(assignment, minlength=num_devices)
    for device in np.flatnonzero(sizes < min_size):
        while sizes[device] < min_size:
            donor = int(np.argmax(sizes))
            moved = rng.choice(np.flatnonzero(assignment == donor))
            assignment[moved] = device
            sizes[donor] -= 1
            sizes[device] += 1


def partition_k_classes(
    labels: np.ndarray, num_devices: int, k: int, seed: int
) -> list[np.ndarray]:
    """Shares in which each device holds samples of exactly `k` classes.

    Classes are dealt from successive shuffled class orders, so every class
    goes to at least one device and class loads differ by at most one device;
    each class's samples are then split evenly over its devices.
    """
    label_array = _as_labels(labels)
    _check_devices(label_array.size, num_devices)
    classes = np.unique(label_array)
    if not 1 <= k <= classes.size:
        raise ValueError(f"k must lie in [1, {classes.size}] (the classes present), got {k}")
    if num_devices * k < classes.size:
        raise ValueError(
            f"{num_devices} devices with {k} classes each cannot cover all {classes.size} classes"
        )
    rng = np.random.default_rng(seed)
    device_classes = _deal_classes(classes, num_devices, k, rng)

    parts: list[list[np.ndarray]] = [[] for _ in range(num_devices)]
    for label in classes:
        holders = np.flatnonzero((device_classes == label).any(axis=1))
        class_indices = rng.permutation(np.flatnonzero(label_array == label))
        if class_indices.size < holders.size:
            raise ValueError(
                f"class {label} has {class_indices.size} samples but is assigned to "
                f"{holders.size} devices; use fewer devices or a smaller k"
            )
        for device, share in zip(holders, np.array_split(class_indices, holders.size), strict=True):
            parts[device].append(share)
    return _finish([np.concatenate(device_parts) for device_parts in parts])


def _deal_classes(
    classes: np.ndarray, num_devices: int, k: int, rng: np.random.Generator
) -> np.ndarray:
    """Class ids per device, shape [num_devices, k]: distinct within a row, each class used evenly.

    Slots are filled from a sequence of fresh class permutations, k per device,
    so class counts differ by at most one and device class sets vary. Where a
    device's k slots straddle two permutations, the next permutation starts with
    classes the device does not hold yet (possible because k <= classes).
    """
    slots: list[int] = []
    while len(slots) < num_devices * k:
        order = [int(label) for label in rng.permutation(classes)]
        filled = len(slots) % k
        if filled:
            held = set(slots[-filled:])
            head = [label for label in order if label not in held][: k - filled]
            order = head + [label for label in order if label not in head]
        slots.extend(order)
    return np.asarray(slots[: num_devices * k], dtype=np.int64).reshape(num_devices, k)


_SCHEMES: dict[str, Callable[..., list[np.ndarray]]] = {
    "iid": partition_iid,
    "dirichlet": partition_dirichlet,
    "classes": partition_k_classes,
}


def scheme_names() -> tuple[str, ...]:
    """Names `partition` accepts."""
    return tuple(sorted(_SCHEMES))


def partition(
    labels: np.ndarray, num_devices: int, scheme: str, seed: int, **params: Any
) -> list[np.ndarray]:
    """Split sample indices over devices by `scheme` ("iid", "dirichlet" or "classes").

    Extra parameters go to the scheme: `alpha` and optional `min_size` for
    "dirichlet", `k` for "classes". The result has one sorted index array per
    device; together they are disjoint and cover every sample.
    """
    function = _SCHEMES.get(scheme)
    if function is None:
        raise ValueError(f"unknown partition scheme {scheme!r}; valid: {', '.join(scheme_names())}")
    signature = inspect.signature(function)
    accepted = [
        name for name in signature.parameters if name not in ("labels", "num_devices", "seed")
    ]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"partition scheme {scheme!r} got unknown parameters {unknown}; valid: {accepted}"
        )
    missing = [
        name
        for name in accepted
        if signature.parameters[name].default is inspect.Parameter.empty and name not in params
    ]
    if missing:
        raise ValueError(f"partition scheme {scheme!r} needs parameters {missing}")
    return function(labels, num_devices, seed=seed, **params)


def label_histogram(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Sample count per (device, class), shape [devices, num_classes], int64."""
    label_array = _as_labels(labels)
    histogram = np.zeros((len(parts), num_classes), dtype=np.int64)
    for device, part in enumerate(parts):
        histogram[device] = np.bincount(
            label_array[np.asarray(part, dtype=np.int64)], minlength=num_classes
        )[:num_classes]
    return histogram


class DeviceSampler:
    """An endless stream over one device's share of a dataset.

    Invariant: samples are served in passes; each pass visits every index of the
    share exactly once, in an order reshuffled per pass and fixed by the seed.
    """

    def __init__(self, dataset: Dataset, indices: np.ndarray, seed: int) -> None:
        index_array = np.asarray(indices, dtype=np.int64)
        if index_array.ndim != 1 or index_array.size == 0:
            raise ValueError(
                f"device sampler needs a non-empty 1-D index array, got shape {index_array.shape}"
            )
        if index_array.min() < 0 or index_array.max() >= len(dataset):
            raise ValueError(
                f"device sampler indices must lie in [0, {len(dataset)}), "
                f"got range [{index_array.min()}, {index_array.max()}]"
            )
        self._dataset = dataset
        self._indices = index_array
        self._rng = np.random.default_rng(seed)
        self._order = self._rng.permutation(self._indices)
        self._position = 0
        self._passes_completed = 0

    @property
    def size(self) -> int:
        """Number of distinct samples in this device's share."""
        return int(self._indices.size)

    @property
    def passes_completed(self) -> int:
        """Full passes over the share served so far."""
        return self._passes_completed

    @property
    def samples_served(self) -> int:
        """Total samples returned by `take` so far."""
        return self._passes_completed * self.size + self._position

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next `n` samples as (features, labels, source_indices into the dataset)."""
        if n < 0:
            raise ValueError(f"cannot take a negative number of samples, got {n}")
        chunks: list[np.ndarray] = []
        remaining = n
        while remaining > 0:
            if self._position == self._order.size:
                self._order = self._rng.permutation(self._indices)
                self._position = 0
                self._passes_completed += 1
            step = min(remaining, self._order.size - self._position)
            chunks.append(self._order[self._position : self._position + step])
            self._position += step
            remaining -= step
        source_indices = np.concatenate(chunks) if chunks else np.empty(0, dtype=np.int64)
        return (
            self._dataset.features[source_indices],
            self._dataset.labels[source_indices],
            source_indices,
        )
