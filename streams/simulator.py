"""Simulated devices: turn a dataset share and a rate profile into timed record batches.

Pure and deterministic: the caller passes stream-relative times and the wall-clock
origin; ``pipeline.simulate`` does the sleeping and the producing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from edgestream.streams.datasets import Dataset, load_source, split_heldout, stratified_mask
from edgestream.streams.partition import DeviceSampler, partition
from edgestream.streams.profiles import RateProfile, parse_profile
from edgestream.streams.records import RecordBatch


class DeviceSimulator:
    """One device's stream: how many records arrive in each interval, and which.

    Invariant: ``seq`` numbers are consecutive from 0 and ``produced`` counts them.
    """

    def __init__(
        self,
        device: str,
        sampler: DeviceSampler,
        profile: RateProfile,
        rng: np.random.Generator,
        max_records_per_message: int = 4096,
        with_labels: bool = True,
    ) -> None:
        self.device = device
        self.sampler = sampler
        self.profile = profile
        self.rng = rng
        self.max_records_per_message = max_records_per_message
        self.with_labels = with_labels
        self.produced = 0

    def step(self, t0: float, t1: float, wall_origin: float) -> list[RecordBatch]:
        """The messages of interval [t0, t1): event times spread evenly inside it."""
        n = self.profile.arrivals(t0, t1, self.rng)
        if n <= 0:
            return []
        features, labels, _ = self.sampler.take(n)
        seq = np.arange(self.produced, self.produced + n, dtype=np.uint64)
        event_time = wall_origin + t0 + (np.arange(n, dtype=np.float64) + 0.5) * ((t1 - t0) / n)
        self.produced += n
        out = []
        for start in range(0, n, self.max_records_per_message):
            stop = min(n, start + self.max_records_per_message)
            out.append(
                RecordBatch(
                    device=self.device,
                    seq=seq[start:stop],
                    event_time=event_time[start:stop],
                    features=np.ascontiguousarray(features[start:stop], dtype=np.float32),
                    labels=labels[start:stop].astype(np.int32) if self.with_labels else None,
                )
            )
        return out


@dataclass(frozen=True)
class FleetData:
    """The data of a job: streamed part, held-out part, validation part, and each device's share.

    Three disjoint parts: ``train`` is what the devices stream (``shares`` index it),
    ``heldout`` is the test split the reported accuracy is measured on, and
    ``validation`` (None: none) is carved from the training data and never streamed:
    the only split a strategy's decisions may be scored on (``Driver.validate``), so no
    decision that shapes training sees the test split.

    ``value_range``: the declared range of every feature value, ``(lo, hi)`` as float32
    arrays of shape ``()`` or ``(F,)`` (``F`` = features per record, flattened), against
    which the ingest layer dead-letters absurd records (``out_of_range``); ``None`` = no
    check. ``input_stats``: per-feature ``(mean, std)`` (float32, shape ``(F,)``) of the
    streamed part, for a fixed input standardisation of the model; ``None`` where the
    source is already on a sane scale (digits, synthetic).
    """

    train: Dataset
    heldout: Dataset
    shares: dict[str, np.ndarray]
    value_range: tuple[np.ndarray, np.ndarray] | None = None
    input_stats: tuple[np.ndarray, np.ndarray] | None = None
    validation: Dataset | None = None

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return self.train.feature_shape

    def validation_as_test(self) -> FleetData:
        """The same job measured on its validation split: ``heldout`` replaced by
        ``validation``, so the held-out test split is not in the result at all. For a run
        that tunes (a benchmark's ``--tune-lr``): what it reports is a validation score,
        and nothing in it can read the test split. ``ValueError`` without a validation split."""
        if self.validation is None:
            raise ValueError("this job keeps no validation split (data.validation_fraction = 0): a tuning run "
                             "needs one to be scored on instead of the held-out test split")
        return dataclasses.replace(self, heldout=self.validation)

    @property
    def num_classes(self) -> int:
        return self.train.num_classes


def fleet_data(
    source: str,
    devices: list[str],
    *,
    scheme: str = "iid",
    seed: int = 0,
    heldout_fraction: float = 0.2,
    validation_fraction: float = 0.1,
    dirichlet_alpha: float = 0.3,
    classes_per_device: int = 2,
    source_params: dict | None = None,
    heldout_seed: int | None = None,
) -> FleetData:
    """Load a source, hold out a stratified part, carve a validation part from the rest
    (``validation_fraction`` of it; 0: none) and partition what remains over devices.

    ``heldout_seed`` draws the held-out test split (None: ``seed``). Fixed while ``seed``
    varies, every seed is measured on the same test rows, and no seed trains or is
    validated on a row another seed is tested on; the validation split and the shares
    still follow ``seed``. (A source whose rows depend on the seed, such as ``synthetic``,
    has other rows under every seed whatever the split.)"""
    dataset = load_source(source, seed=seed, **(source_params or {}))
    split_seed = seed if heldout_seed is None else heldout_seed
    train, heldout = split_heldout(dataset, fraction=heldout_fraction, seed=split_seed)
    train, validation, _ = carve_validation(train, None, validation_fraction, seed)
    params: dict = {}
    if scheme == "dirichlet":
        params["alpha"] = dirichlet_alpha
    elif scheme == "classes":
        params["k"] = classes_per_device
    parts = partition(train.labels, len(devices), scheme, seed, **params)
    return FleetData(train, heldout, dict(zip(devices, parts, strict=True)), validation=validation)


#: ``data.validation_fraction``'s default: the share of the streamed part kept back to score
#: a strategy's decisions on (never streamed, never the held-out test split).
DEFAULT_VALIDATION_FRACTION = 0.1
#: Added to the job's seed for the validation split's draw (the held-out split uses the seed).
VALIDATION_SEED_OFFSET = 104_729


def carve_validation(
    train: Dataset, shares: dict[str, np.ndarray] | None, fraction: float, seed: int
) -> tuple[Dataset, Dataset | None, dict[str, np.ndarray] | None]:
    """A stratified ``fraction`` of ``train`` taken out as the validation split.

    Returns ``(rest, validation, shares)``: the rows that stay (in their order), the
    validation rows (None when ``fraction`` is 0) and ``shares`` (indices into ``train``;
    None: none given) as indices into ``rest``, with the validation rows left out, so no
    device streams them. Deterministic from ``seed``.
    """
    if fraction == 0:
        return train, None, shares
    mask = stratified_mask(train.labels, fraction, seed + VALIDATION_SEED_OFFSET)
    kept = np.flatnonzero(~mask)
    rest, validation = train.subset(kept), train.subset(np.flatnonzero(mask))
    if shares is None:
        return rest, validation, None
    position = np.full(len(train), -1, dtype=np.int64)
    position[kept] = np.arange(len(kept), dtype=np.int64)
    remapped = {}
    for device, indices in shares.items():
        moved = position[np.asarray(indices, dtype=np.int64)]
        remapped[device] = moved[moved >= 0]
    return rest, validation, remapped


def build_simulators(
    data: FleetData,
    rates_hz: dict[str, float],
    profile_spec: str = "constant",
    seed: int = 0,
    max_records_per_message: int = 4096,
) -> list[DeviceSimulator]:
    """One simulator per device, each with its own deterministic random stream."""
    sims = []
    for index, (device, share) in enumerate(data.shares.items()):
        sims.append(
            DeviceSimulator(
                device,
                DeviceSampler(data.train, share, seed=seed * 1000 + index),
                parse_profile(profile_spec, rates_hz[device]),
                np.random.default_rng(seed * 1000 + 500 + index),
                max_records_per_message=max_records_per_message,
            )
        )
    return sims
