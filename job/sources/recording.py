"""A job's data kept on disk: an `edgestream import` recording as ``data.source = "recording"``.

Owns reading what `edgestream import` stored next to a recording (``import.json``,
``train.npz``, ``heldout.npz``; written by ``job.importer``) and fitting a job
configuration to it: ``apply_recording_source`` takes the job's devices from the
recording, so the workers read exactly the recorded device topics.

Invariant: a job whose source is a recording has the recording's device ids, in the
recorded order, at the recorded rates times ``data.replay_speed`` (the recorded rates
for ``max``), and evaluates on the recording's held-out rows, which were never
streamed. Anything missing or contradictory is a ``ConfigError`` of one line that
names what is wrong and how to fix it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from edgestream.job.errors import ConfigError
from edgestream.job.importer import (
    HELDOUT_FILE,
    IMPORT_INFO,
    IMPORT_VERSION,
    TRAIN_FILE,
    import_command,
)
from edgestream.job.sources.base import DataNames, DataSource, declared_value_range, register
from edgestream.streams.datasets import Dataset, stratified_mask
from edgestream.streams.recording import MANIFEST_NAME, ReplayError, parse_speed
from edgestream.streams.simulator import VALIDATION_SEED_OFFSET, FleetData

if TYPE_CHECKING:
    from edgestream.job.config import JobConfig


class RecordingSourceError(ConfigError):
    """``data.recording`` cannot be used as a job's data; the message says how to fix it."""


@dataclass(frozen=True)
class FeatureStats:
    """Per-feature statistics of the streamed rows, flattened: float32 arrays of shape (F,)."""

    min: np.ndarray
    max: np.ndarray
    mean: np.ndarray
    std: np.ndarray


@dataclass(frozen=True)
class RecordingInfo:
    """What ``import.json`` (version 2) says about an imported recording.

    Reading it checks that every file a job needs is present; the arrays themselves are
    loaded by ``load_data`` (workers, simulators), not when a config is loaded.
    """

    directory: Path
    device_ids: tuple[str, ...]
    rates_hz: tuple[float, ...]
    feature_shape: tuple[int, ...]
    num_classes: int
    label_names: tuple[str, ...]
    heldout_fraction: float
    partition: str
    profile: str
    message_interval_s: float
    duration_s: float
    stats: FeatureStats
    rerun_hint: str
    #: The table's feature columns, one per flattened feature (None: not recorded, or not one each).
    feature_names: tuple[str, ...] | None = None

    def load_data(self) -> tuple[Dataset, Dataset, dict[str, np.ndarray]]:
        """(streamed rows, held-out rows, each device's indices into the streamed rows)."""
        train = _load_npz(self, TRAIN_FILE, ("features", "labels", "share_indices", "share_bounds"))
        heldout = _load_npz(self, HELDOUT_FILE, ("features", "labels"))
        name = self.directory.name
        train_ds = self._dataset(TRAIN_FILE, train, name)
        heldout_ds = self._dataset(HELDOUT_FILE, heldout, name + "-heldout")
        bounds, indices = train["share_bounds"], train["share_indices"]
        if bounds.shape != (len(self.device_ids) + 1,) or bounds[0] != 0 or bounds[-1] != indices.size \
                or np.any(np.diff(bounds) < 0) or indices.size and (indices.min() < 0 or indices.max() >= len(train_ds)):
            raise self._error(f"{TRAIN_FILE} has device shares that do not fit its rows or the "
                              f"{len(self.device_ids)} devices of {IMPORT_INFO}")
        shares = {d: indices[bounds[i]:bounds[i + 1]].astype(np.int64)
                  for i, d in enumerate(self.device_ids)}
        return train_ds, heldout_ds, shares

    def _dataset(self, file: str, arrays: dict[str, np.ndarray], name: str) -> Dataset:
        features, labels = arrays["features"], arrays["labels"]
        if tuple(features.shape[1:]) != self.feature_shape:
            raise self._error(f"{file} holds features of shape {tuple(features.shape[1:])} but "
                              f"{IMPORT_INFO} declares {self.feature_shape}")
        try:
            return Dataset(features, labels, self.num_classes, name)
        except ValueError as exc:
            raise self._error(f"{file}: {exc}") from None

    def _error(self, what: str) -> RecordingSourceError:
        return RecordingSourceError(f"data.recording={str(self.directory)!r}: {what}; {self.rerun_hint}")


def _load_npz(info: RecordingInfo, file: str, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    path = info.directory / file
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in keys if k not in z.files]
            if missing:
                raise info._error(f"{file} lacks the array(s) {', '.join(missing)}")
            return {k: z[k] for k in keys}
    except FileNotFoundError:
        raise info._error(f"{file} is missing") from None
    except (OSError, ValueError) as exc:  # not an npz, truncated, or object arrays
        raise info._error(f"{file} cannot be read ({exc})") from None


def _rerun_hint(info: dict[str, Any]) -> str:
    source = info.get("source") if isinstance(info.get("source"), dict) else {}
    command = import_command(str(source.get("file") or "DATA.csv"), str(source.get("label_column") or "LABEL"),
                             "NEW_DIR", source.get("spec"))
    return f"re-run `{command}` and point data.recording at NEW_DIR"


def read_recording_info(directory: str | Path) -> RecordingInfo:
    """Read and check ``import.json`` of the recording at ``directory`` (cheap: no arrays loaded)."""
    root = Path(directory)
    label = f"data.recording={str(root)!r}"
    generic = _rerun_hint({})
    if not root.is_dir():
        raise RecordingSourceError(f"{label}: no such directory; make one with "
                                   f"`{import_command('DATA.csv', 'LABEL', str(root))}`")
    info_path = root / IMPORT_INFO
    if not info_path.is_file():
        if (root / MANIFEST_NAME).is_file():
            raise RecordingSourceError(
                f"{label}: no {IMPORT_INFO}: a recording of Kafka topics (`edgestream record`) has no "
                f"held-out split nor data description to train on; import your table with "
                f"`{import_command('DATA.csv', 'LABEL', 'NEW_DIR')}`")
        raise RecordingSourceError(f"{label}: not a recording (no {IMPORT_INFO}, no {MANIFEST_NAME}); {generic}")
    try:
        raw = json.loads(info_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordingSourceError(f"{label}: {IMPORT_INFO} cannot be read ({exc}); {generic}") from None
    if not isinstance(raw, dict):
        raise RecordingSourceError(f"{label}: {IMPORT_INFO} is not a JSON object; {generic}")
    hint = _rerun_hint(raw)
    data = raw.get("data")
    version = raw.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool):
        raise RecordingSourceError(f"{label}: {IMPORT_INFO} has version {version!r}, not an integer; {hint}")
    if not isinstance(data, dict) or version < IMPORT_VERSION:
        raise RecordingSourceError(
            f"{label}: made by an older `edgestream import` (no held-out split: {HELDOUT_FILE}, "
            f"{TRAIN_FILE} and the feature statistics are missing); {hint}")
    for file in (MANIFEST_NAME, TRAIN_FILE, HELDOUT_FILE):
        if not (root / file).is_file():
            raise RecordingSourceError(f"{label}: {file} is missing; {hint}")
    try:
        shape = tuple(int(d) for d in data["feature_shape"])
        width = math.prod(shape)
        stats = FeatureStats(*(np.asarray(data["stats"][k], dtype=np.float32).reshape(width)
                               for k in ("min", "max", "mean", "std")))
        devices = tuple(str(d) for d in data["device_ids"])
        rates = tuple(float(r) for r in data["rates_hz"])
        info = RecordingInfo(
            directory=root.resolve(),
            device_ids=devices,
            rates_hz=rates,
            feature_shape=shape,
            num_classes=int(data["num_classes"]),
            label_names=tuple(str(n) for n in data["label_names"]),
            heldout_fraction=float(data["heldout_fraction"]),
            partition=str(data["partition"]),
            profile=str(data["profile"]),
            message_interval_s=float(data["message_interval_s"]),
            duration_s=float(data["duration_s"]),
            stats=stats,
            rerun_hint=hint,
            feature_names=_names(data.get("feature_names"), width),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordingSourceError(f"{label}: {IMPORT_INFO} is incomplete or malformed ({exc!r}); {hint}") from None
    if not devices or len(rates) != len(devices) or not all(0 < r < math.inf for r in rates):
        raise RecordingSourceError(f"{label}: {IMPORT_INFO} lists no devices or bad rates; {hint}")
    return info


def _names(value: Any, count: int) -> tuple[str, ...] | None:
    """``value`` as ``count`` names, or None when it is not a list of that many."""
    if not isinstance(value, list) or len(value) != count:
        return None
    return tuple(str(v) for v in value)


def _speed_factor(text: str) -> float:
    try:
        speed = parse_speed(text)
    except ReplayError as exc:
        raise ConfigError(f"data.replay_speed: {exc}") from None
    return 1.0 if math.isinf(speed) else speed


def apply_recording_source(cfg: JobConfig) -> None:
    """With ``data.source = "recording"``, take the job's devices from the recording.

    Sets ``devices.ids``, ``devices.count`` and ``devices.rates_hz`` (the recorded rates
    times ``data.replay_speed``; the recorded rates for ``max``), and
    ``devices.profile``, ``devices.message_interval_s``, ``data.heldout_fraction`` and
    ``data.partition`` to what the import used, so the effective config says what is
    streamed. A key the user set to something else is refused with one line; a key
    still at its default is taken over (a value equal to the default cannot be told
    apart from an unset one). Idempotent: a config this function filled in passes again
    (worker processes reload the effective config). Other sources are left alone; an
    empty ``data.recording`` is left to ``RecordingSource.validate``.
    """
    if not cfg.data.recording:
        return
    info = read_recording_info(cfg.data.recording)
    scale = _speed_factor(cfg.data.replay_speed)
    where = f"the recording {cfg.data.recording}"
    defaults = type(cfg)()
    devices, data = defaults.devices, defaults.data
    if cfg.devices.time_scale != devices.time_scale:
        raise ConfigError(f"devices.time_scale={cfg.devices.time_scale:g} does not apply to a recording "
                          "source (its rates are recorded); set data.replay_speed instead")
    taken: list[tuple[Any, str, Any, Any]] = [
        (cfg.devices, "ids", devices.ids, list(info.device_ids)),
        (cfg.devices, "count", devices.count, len(info.device_ids)),
        (cfg.devices, "rates_hz", devices.rates_hz, [r * scale for r in info.rates_hz]),
        (cfg.devices, "profile", devices.profile, info.profile),
        (cfg.devices, "message_interval_s", devices.message_interval_s, info.message_interval_s),
        (cfg.data, "heldout_fraction", data.heldout_fraction, info.heldout_fraction),
        (cfg.data, "partition", data.partition, info.partition),
    ]
    for section, key, default, recorded in taken:
        current = getattr(section, key)
        if current != default and current != recorded:
            name = f"{'devices' if section is cfg.devices else 'data'}.{key}"
            raise ConfigError(
                f"{name}={_show(current)} contradicts {where}, which has {_show(recorded)}; leave "
                f"{name} unset (job file, --set, environment): a recording source takes it from the recording"
            )
    for section, key, _default, recorded in taken:
        setattr(section, key, recorded)


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


@register("recording")
class RecordingSource(DataSource):
    """An `edgestream import` recording: its devices, rows, held-out split and statistics.

    ``auto`` value range: the streamed rows' per-feature min/max from ``import.json``,
    widened; ``auto`` timestamp skew: none (its replay keeps the recorded event times,
    Kafka stamps the send time). ``edgestream run`` replays its device topics.
    """

    parameters: ClassVar[tuple[str, ...]] = ("recording", "replay_speed")
    auto_timestamp_skew_s: ClassVar[float | None] = None
    garbage_refused: ClassVar[str] = (
        "the recording is replayed as imported; use a digits or synthetic job to test the dead-letter path")

    def configure(self, cfg: JobConfig) -> None:
        apply_recording_source(cfg)

    def validate(self, cfg: JobConfig) -> None:
        if not cfg.data.recording:
            raise ConfigError(
                "data.source='recording' needs data.recording = the directory `edgestream import` wrote"
            )

    def fleet_data(self, cfg: JobConfig) -> FleetData:
        """Everything from the recording's stored files: the streamed rows, the held-out
        rows, the device shares, and the streamed rows' per-feature statistics."""
        info = read_recording_info(cfg.data.recording)
        train, heldout, shares = info.load_data()
        devices = cfg.devices.device_ids()
        if list(shares) != devices:
            # load_config takes the devices from the recording; a config built another way may not.
            raise ConfigError(f"devices {devices} are not the devices {list(shares)} of the recording "
                              f"{cfg.data.recording}; load the job with job.config.load_config")
        value_range = declared_value_range(cfg, (info.stats.min, info.stats.max), from_data=True)
        return FleetData(train, heldout, shares, value_range=value_range,
                         input_stats=(info.stats.mean, info.stats.std),
                         validation=self.validation(cfg, train))

    @staticmethod
    def validation(cfg: JobConfig, train: Dataset) -> Dataset | None:
        """A stratified ``data.validation_fraction`` of the streamed rows. A recording's
        device topics are replayed as recorded, so these rows are streamed too (unlike a
        generated source's, which are carved out): the split overlaps the training data but
        is never the held-out test split."""
        if cfg.data.validation_fraction == 0:
            return None
        mask = stratified_mask(train.labels, cfg.data.validation_fraction, cfg.job.seed + VALIDATION_SEED_OFFSET)
        return train.subset(np.flatnonzero(mask))

    def replay_directory(self, cfg: JobConfig) -> Path | None:
        return read_recording_info(cfg.data.recording).directory

    def data_names(self, cfg: JobConfig) -> DataNames:
        """The imported table's label values (label i is the i-th in sorted order, as the import
        numbered them) and its feature columns."""
        info = read_recording_info(cfg.data.recording)
        return DataNames(class_names=_names(list(info.label_names), info.num_classes),
                         feature_names=info.feature_names)
