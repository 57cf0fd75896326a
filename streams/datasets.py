"""In-memory labelled data sources (digits, synthetic sensor windows) simulators stream from."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "Dataset",
    "load_digits_dataset",
    "synthetic_sensor_dataset",
    "load_source",
    "source_names",
    "split_heldout",
    "stratified_mask",
]

# Size of the synthetic set when `load_source("synthetic")` is not given `n`.
SYNTHETIC_DEFAULT_SIZE = 6000

# Per-sample nuisance of the synthetic generator: it keeps the task from being
# solvable by matching one template per class, without hiding the class signal.
_MAX_TIME_SHIFT = 0.25  # fraction of a window
_AMPLITUDE_JITTER = 0.25
_MAX_CYCLES_PER_WINDOW = 4


@dataclass(frozen=True, eq=False)
class Dataset:
    """A labelled sample set held in memory.

    Invariant: `features` is float32 with shape [N, *feature_shape], `labels` is
    int64 with shape [N], and every label lies in [0, num_classes).
    """

    features: np.ndarray
    labels: np.ndarray
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        if self.features.dtype != np.float32:
            raise ValueError(
                f"dataset {self.name!r}: features must be float32, got {self.features.dtype}"
            )
        if self.labels.dtype != np.int64 or self.labels.ndim != 1:
            raise ValueError(
                f"dataset {self.name!r}: labels must be a 1-D int64 array, "
                f"got {self.labels.dtype} with shape {self.labels.shape}"
            )
        if self.features.ndim < 2 or self.features.shape[0] != self.labels.shape[0]:
            raise ValueError(
                f"dataset {self.name!r}: features {self.features.shape} and labels "
                f"{self.labels.shape} disagree on the number of samples"
            )
        if self.num_classes < 1:
            raise ValueError(
                f"dataset {self.name!r}: num_classes must be >= 1, got {self.num_classes}"
            )
        if self.labels.size and (self.labels.min() < 0 or self.labels.max() >= self.num_classes):
            raise ValueError(
                f"dataset {self.name!r}: labels must lie in [0, {self.num_classes}), "
                f"got range [{self.labels.min()}, {self.labels.max()}]"
            )

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """Shape of one sample's features, without the leading sample axis."""
        return tuple(int(dim) for dim in self.features.shape[1:])

    def subset(self, indices: np.ndarray | list[int]) -> Dataset:
        """The samples at `indices`, in that order, with the same classes and name."""
        index_array = np.asarray(indices, dtype=np.int64)
        if index_array.ndim != 1:
            raise ValueError(
                f"dataset {self.name!r}: subset indices must be 1-D, got shape {index_array.shape}"
            )
        return Dataset(
            features=self.features[index_array],
            labels=self.labels[index_array],
            num_classes=self.num_classes,
            name=self.name,
        )


def load_digits_dataset() -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 samples, 10 classes), features scaled to [0, 1].

    Reads the copy shipped inside scikit-learn; never touches the network. The file is read
    directly (65 integer columns a row: 64 pixels, then the label) when it is where
    scikit-learn keeps it: importing scikit-learn costs a process about 2 s of CPU and
    tens of MB it never uses otherwise. Elsewhere, ``sklearn.datasets.load_digits``.
    """
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    bundled = [path for root in roots if (path := Path(root) / "datasets" / "data" / "digits.csv.gz").is_file()]
    if bundled:
        table = np.loadtxt(bundled[0], delimiter=",", dtype=np.float32)
        pixels, target = table[:, :-1], table[:, -1]
    else:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        pixels, target = bunch.data, bunch.target
    # Pixel intensities in the bundled set are integers in [0, 16].
    features = (np.asarray(pixels, dtype=np.float32) / np.float32(16.0)).reshape(-1, 64)
    labels = np.asarray(target, dtype=np.int64)
    return Dataset(features=features, labels=labels, num_classes=10, name="digits")


def synthetic_sensor_dataset(
    n: int,
    num_classes: int = 6,
    channels: int = 3,
    window: int = 32,
    seed: int = 0,
    noise: float = 0.3,
    drift: float = 0.0,
) -> Dataset:
    """Accelerometer-like windows, shape [n, channels, window], fully determined by `seed`.

    Each class owns, per channel, a sinusoid (whole cycles per window, amplitude,
    phase) on top of a constant offset (think gravity on a tilted device). Each
    sample adds a random time shift, a random amplitude scale and Gaussian noise
    of standard deviation `noise`. Classes are balanced and shuffled along the
    sample axis, which is read as time: with `drift` > 0, sample i's amplitudes
    grow by a factor 1 + drift * i / (n - 1) and its offsets move by up to
    `drift` along a fixed direction, emulating slow concept drift.
    """
    if n < 1:
        raise ValueError(f"synthetic dataset: n must be >= 1, got {n}")
    if num_classes < 2:
        raise ValueError(f"synthetic dataset: num_classes must be >= 2, got {num_classes}")
    if channels < 1 or window < 4:
        raise ValueError(
            f"synthetic dataset: need channels >= 1 and window >= 4, got {channels}, {window}"
        )
    if noise < 0 or not np.isfinite(noise):
        raise ValueError(f"synthetic dataset: noise must be finite and >= 0, got {noise}")
    if drift < 0 or not np.isfinite(drift):
        raise ValueError(f"synthetic dataset: drift must be finite and >= 0, got {drift}")

    rng = np.random.default_rng(seed)
    # Step 1. Class patterns: a few cycles per window, so classes share some
    # frequencies and must be told apart by the combination across channels.
    max_cycles = max(1, min(_MAX_CYCLES_PER_WINDOW, window // 4))
    cycles = _distinct_cycle_patterns(rng, num_classes, channels, max_cycles)
    amplitude = rng.uniform(0.5, 1.5, size=(num_classes, channels))
    phase = rng.uniform(0.0, 2.0 * np.pi, size=(num_classes, channels))
    offset = rng.normal(0.0, 0.15, size=(num_classes, channels))
    drift_direction = rng.normal(0.0, 1.0, size=channels)
    drift_direction /= max(float(np.linalg.norm(drift_direction)), 1e-12)

    # Step 2. Balanced, shuffled labels; the sample axis is time.
    labels = rng.permutation(np.arange(n, dtype=np.int64) % num_classes)

    # Step 3. Per-sample nuisance and drift progress.
    time_shift = rng.uniform(-_MAX_TIME_SHIFT, _MAX_TIME_SHIFT, size=(n, 1, 1))
    amplitude_scale = rng.lognormal(0.0, _AMPLITUDE_JITTER, size=(n, 1, 1))
    progress = (np.arange(n) / max(n - 1, 1)).reshape(n, 1, 1)

    # Step 4. Render the windows.
    t = np.arange(window) / window
    angle = 2.0 * np.pi * cycles[labels][:, :, None] * (t + time_shift) + phase[labels][:, :, None]
    signal_amplitude = amplitude[labels][:, :, None] * amplitude_scale * (1.0 + drift * progress)
    signal_offset = offset[labels][:, :, None] + drift * progress * drift_direction[None, :, None]
    features = signal_offset + signal_amplitude * np.sin(angle)
    features = features + rng.normal(0.0, noise, size=features.shape)
    return Dataset(
        features=features.astype(np.float32),
        labels=labels,
        num_classes=num_classes,
        name="synthetic",
    )


def _distinct_cycle_patterns(
    rng: np.random.Generator, num_classes: int, channels: int, max_cycles: int
) -> np.ndarray:
    """Cycles per window per (class, channel); rows differ between classes where possible."""
    combinations = max_cycles**channels
    if combinations < num_classes:
        return rng.integers(1, max_cycles + 1, size=(num_classes, channels))
    # Read each chosen code as `channels` base-`max_cycles` digits.
    codes = rng.choice(combinations, size=num_classes, replace=False)
    digits = (codes[:, None] // max_cycles ** np.arange(channels)[None, :]) % max_cycles
    return digits + 1


def _load_digits_source(seed: int, **params: Any) -> Dataset:
    # The bundled digits are fixed; the seed has nothing to choose.
    del seed
    if params:
        raise ValueError(f"source 'digits' takes no parameters, got {sorted(params)}")
    return load_digits_dataset()


def _load_synthetic_source(seed: int, **params: Any) -> Dataset:
    allowed = {"n", "num_classes", "channels", "window", "noise", "drift"}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(
            f"source 'synthetic' got unknown parameters {unknown}; valid: {sorted(allowed)}"
        )
    params.setdefault("n", SYNTHETIC_DEFAULT_SIZE)
    return synthetic_sensor_dataset(seed=seed, **params)


_SOURCES: dict[str, Callable[..., Dataset]] = {
    "digits": _load_digits_source,
    "synthetic": _load_synthetic_source,
}


def source_names() -> tuple[str, ...]:
    """Names `load_source` accepts."""
    return tuple(sorted(_SOURCES))


def load_source(name: str, seed: int = 0, **params: Any) -> Dataset:
    """Load the data source registered as `name` ("digits" or "synthetic") with its parameters."""
    loader = _SOURCES.get(name)
    if loader is None:
        raise ValueError(f"unknown data source {name!r}; valid: {', '.join(source_names())}")
    return loader(seed, **params)


def stratified_mask(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """A boolean mask over ``labels`` choosing a stratified ``fraction`` of every class, fixed
    by ``seed``: round(fraction * count), but at least one and at most count - 1, of each
    class with at least two samples (a class with one sample is never chosen)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"held-out fraction must lie in (0, 1), got {fraction}")
    rng = np.random.default_rng(seed)
    chosen: list[np.ndarray] = []
    for label in np.unique(labels):
        class_indices = np.flatnonzero(labels == label)
        count = class_indices.size
        if count < 2:
            continue
        take = min(max(int(round(fraction * count)), 1), count - 1)
        chosen.append(rng.permutation(class_indices)[:take])
    mask = np.zeros(len(labels), dtype=bool)
    if chosen:
        mask[np.concatenate(chosen)] = True
    return mask


def split_heldout(ds: Dataset, fraction: float = 0.2, seed: int = 0) -> tuple[Dataset, Dataset]:
    """Split into (streamed, held-out) parts, stratified by class and fixed by `seed`.

    Each class with at least two samples puts round(fraction * count), but at
    least one and at most count - 1, of its samples in the held-out part. Both
    parts keep the original sample order, so a drifting source stays in time
    order. The held-out part is for evaluation and is never streamed.
    """
    heldout_mask = stratified_mask(ds.labels, fraction, seed)
    return ds.subset(np.flatnonzero(~heldout_mask)), ds.subset(np.flatnonzero(heldout_mask))
