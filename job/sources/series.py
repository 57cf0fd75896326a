"""``data.source = "series"``: labelled multichannel time series from a converted file.

The file (``data.series_file``, ``streams/series_file.py``; scripts/fetch_basicmotions.py
writes one from a real smartwatch dataset) keeps the archive's train and test series
apart. A record is a window of every channel, ``data.series_window`` steps long; the
windows of one series start ``data.series_hop`` steps apart.

Invariant: the three parts are disjoint **by series**, not only by row. The held-out split
is every window of the file's test series; the validation split is every window of a
stratified ``data.validation_fraction`` of the train series; the streamed rows are the
windows of the other train series, each series dealt whole to one device (a watch plays
its recordings). Overlapping windows of one series therefore never straddle two parts,
and nothing of a test series is streamed, trained on, or scored for a training decision.
The input statistics and the ``auto`` value range come from the streamed rows alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from edgestream.job.errors import ConfigError
from edgestream.job.sources.base import DataNames, DataSource, declared_value_range, register
from edgestream.streams.datasets import Dataset, stratified_mask
from edgestream.streams.series_file import (
    SeriesFile,
    SeriesFormatError,
    load_series_file,
    windows,
    windows_per_series,
)
from edgestream.streams.simulator import VALIDATION_SEED_OFFSET, FleetData

if TYPE_CHECKING:
    from edgestream.job.config import JobConfig

#: What to run when the file is missing (the example job's file).
FETCH_HINT = "scripts/with-venv.sh python scripts/fetch_basicmotions.py"
#: Seed offset of dealing the streamed series to the devices (apart from the validation draw's).
DEAL_SEED_OFFSET = 7_919


@register("series")
class SeriesSource(DataSource):
    """Windows of a converted series file; ``auto`` value range: the streamed rows' min/max
    per feature, widened by ``data.value_margin``; a fixed per-channel standardisation."""

    parameters: ClassVar[tuple[str, ...]] = ("series_file", "series_window", "series_hop")

    def validate(self, cfg: JobConfig) -> None:
        # The file itself is read when the data is loaded (a fresh clone's example jobs load
        # before anything is downloaded); here only what needs no file.
        if not cfg.data.series_file:
            raise ConfigError(f"data.source='series' needs data.series_file = a converted file (`{FETCH_HINT}` "
                              "writes ~/.cache/edgestream/data/basicmotions.npz)")
        if cfg.data.series_window < 1 or cfg.data.series_hop < 1:
            raise ConfigError(f"data.series_window and data.series_hop must be >= 1 (got {cfg.data.series_window}, "
                              f"{cfg.data.series_hop})")

    @staticmethod
    def _load(cfg: JobConfig) -> tuple[Path, SeriesFile]:
        path = Path(cfg.data.series_file).expanduser()
        where = f"data.series_file={cfg.data.series_file!r}"
        try:
            return path, load_series_file(path)
        except FileNotFoundError:
            raise ConfigError(f"{where}: no such file; write it with `{FETCH_HINT} --out {path}`") from None
        except SeriesFormatError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def data_names(self, cfg: JobConfig) -> DataNames:
        """The file's class names; a feature is a channel at a step of the window, channel-major
        as the model reads it: ``<channel>[<step>]``."""
        _path, data = self._load(cfg)
        steps = range(cfg.data.series_window)
        return DataNames(class_names=tuple(data.class_names),
                         feature_names=tuple(f"{channel}[{t}]" for channel in data.channel_names for t in steps))

    def fleet_data(self, cfg: JobConfig) -> FleetData:
        path, data = self._load(cfg)
        window, hop = cfg.data.series_window, cfg.data.series_hop
        if window > data.length:
            raise ConfigError(f"data.series_window={window} is longer than the file's series ({data.length} steps)")
        per = windows_per_series(data.length, window, hop)
        num_classes = len(data.class_names)
        name = data.meta.get("dataset") or path.stem

        held = stratified_mask(data.train_labels, cfg.data.validation_fraction, cfg.job.seed + VALIDATION_SEED_OFFSET) \
            if cfg.data.validation_fraction > 0 else np.zeros(len(data.train_labels), dtype=bool)
        streamed = np.flatnonzero(~held)
        devices = cfg.devices.device_ids()
        if len(devices) > len(streamed):
            raise ConfigError(f"{len(devices)} devices but only {len(streamed)} streamed series in {path.name}: "
                              "each device plays whole series; use fewer devices")
        # Deal the streamed series to the devices whole: a seeded shuffle, then round robin.
        order = np.random.default_rng(cfg.job.seed + DEAL_SEED_OFFSET).permutation(streamed)
        # (The file lists its series class by class; a watch plays its own in the shuffled order.)
        dealt = [order[i::len(devices)] for i in range(len(devices))]
        series_order = np.concatenate(dealt)  # the streamed rows: device after device, series in dealt order

        def part(indices: np.ndarray, series: np.ndarray, labels: np.ndarray, label: str) -> Dataset:
            return Dataset(windows(series[indices], window, hop), np.repeat(labels[indices], per), num_classes,
                           f"{name}-{label}")

        train = part(series_order, data.train_series, data.train_labels, "streamed")
        validation = (part(np.flatnonzero(held), data.train_series, data.train_labels, "validation")
                      if held.any() else None)
        heldout = part(np.arange(len(data.test_series)), data.test_series, data.test_labels, "heldout")
        shares: dict[str, np.ndarray] = {}
        start = 0
        for device, mine in zip(devices, dealt, strict=True):
            shares[device] = np.arange(start, start + len(mine) * per, dtype=np.int64)
            start += len(mine) * per

        flat = train.features.reshape(len(train), -1)
        value_range = declared_value_range(cfg, (flat.min(axis=0), flat.max(axis=0)), from_data=True)
        # Per channel over every streamed step, repeated over the window (features are channel-major).
        mean = train.features.mean(axis=(0, 2))
        std = np.maximum(train.features.std(axis=(0, 2)), 1e-6)
        stats = (np.repeat(mean, window).astype(np.float32), np.repeat(std, window).astype(np.float32))
        return FleetData(train, heldout, shares, value_range=value_range, input_stats=stats, validation=validation)
