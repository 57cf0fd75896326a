"""`edgestream import`: turn a user's labelled table into a recording of device streams.

The table (CSV, .npy/.npz, or Parquet when pyarrow is installed) first loses a
stratified, seeded held-out share (``streams.datasets.split_heldout``); only the rest
is split over devices (iid / dirichlet / classes, ``streams.partition``) and each
device's share is streamed by a ``DeviceSimulator`` at its own rate; the simulator's
micro-batches are encoded as sensor messages (``streams.codec``) into
``sensors.<device>`` topics of a recording, with Kafka timestamps at each message's
send time. ``edgestream replay`` then streams it.

Besides the recording it owns the files a job needs to train on it without the
original table (``data.source = "recording"``, ``job.sources.recording``):

- ``heldout.npz``: the held-out rows (``features`` float32, ``labels`` int64), never streamed;
- ``train.npz``: the streamed rows (``features``, ``labels``) and each device's share of
  them (``share_indices`` concatenated in device order, cut at ``share_bounds``);
- ``import.json``: what was imported and how (version 2: ``data`` holds the feature
  shape, classes, label names, the per-feature min/max/mean/std of the streamed part,
  the device ids and rates and the recording's duration).

Invariant: the held-out rows and the streamed rows are disjoint and together are the
whole table; ``import.json`` is written last, so a directory with a version-2
``import.json`` is complete.
"""

from __future__ import annotations

import csv
import json
import math
import re
import shlex
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from edgestream.streams import codec, topics
from edgestream.streams.datasets import Dataset, split_heldout
from edgestream.streams.errors import StreamsError
from edgestream.streams.partition import DeviceSampler, label_histogram, partition
from edgestream.streams.profiles import parse_profile
from edgestream.streams.recording import RecordedMessage, RecordingWriter
from edgestream.streams.simulator import DeviceSimulator

IMPORT_INFO = "import.json"
#: Version of ``import.json``: 1 had no held-out split and no stored data; 2 adds ``data``.
IMPORT_VERSION = 2
TRAIN_FILE = "train.npz"
HELDOUT_FILE = "heldout.npz"


class TableImportError(StreamsError):
    """The input table cannot be imported; the message names the file and what is wrong."""


@dataclass
class ImportSpec:
    """What to build from the table: devices, their rates, the split and the length."""

    devices: int = 10
    rates_hz: list[float] = field(default_factory=lambda: [92.0, 38.0, 62.0, 42.0, 48.0, 88.0, 90.0,
                                                           22.0, 44.0, 28.0])
    partition: str = "iid"  # iid | dirichlet | classes
    dirichlet_alpha: float = 0.3
    classes_per_device: int = 2
    duration_s: float | None = None
    records_per_device: int | None = None
    message_interval_s: float = 0.1
    profile: str = "constant"
    device_prefix: str = "dev"
    seed: int = 0
    start_time_s: float | None = None  # epoch seconds of the first message; default now
    #: Stratified share of every class kept out of the streams for evaluation (in (0, 1)).
    heldout_fraction: float = 0.2

    def device_ids(self) -> list[str]:
        return [f"{self.device_prefix}{i:02d}" for i in range(self.devices)]

    def validate(self) -> None:
        """Refuse impossible specs with one line naming the option (before any file is written)."""
        if (self.duration_s is None) == (self.records_per_device is None):
            raise TableImportError("give exactly one of --duration or --records-per-device")
        if self.devices < 1:
            raise TableImportError(f"--devices must be >= 1 (got {self.devices})")
        if not self.rates_hz or not all(0 < r < math.inf for r in self.rates_hz):
            raise TableImportError(f"--rates must be positive finite records/s (got {self.rates_hz})")
        if self.duration_s is not None and not 0 < self.duration_s < math.inf:
            raise TableImportError(f"--duration must be a positive number of seconds (got {self.duration_s})")
        if self.records_per_device is not None and self.records_per_device < 1:
            raise TableImportError(f"--records-per-device must be >= 1 (got {self.records_per_device})")
        if not 0 < self.message_interval_s < math.inf:
            raise TableImportError(
                f"--message-interval must be a positive number of seconds (got {self.message_interval_s})"
            )
        if not 0 < self.heldout_fraction < 1:
            raise TableImportError(f"--heldout-fraction must lie in (0, 1) (got {self.heldout_fraction})")
        try:
            parse_profile(self.profile, 1.0)
        except ValueError as exc:
            raise TableImportError(f"--profile: {exc}") from None
        for device in self.device_ids():
            try:
                topics.sensor_topic(device)
            except StreamsError as exc:
                raise TableImportError(f"--device-prefix {self.device_prefix!r}: {exc}") from None


#: ``ImportSpec`` field -> the `edgestream import` option that sets it (``start_time_s`` has none).
IMPORT_OPTIONS = {
    "devices": "--devices", "rates_hz": "--rates", "partition": "--partition", "dirichlet_alpha": "--alpha",
    "classes_per_device": "--classes-per-device", "duration_s": "--duration",
    "records_per_device": "--records-per-device", "message_interval_s": "--message-interval",
    "profile": "--profile", "device_prefix": "--device-prefix", "seed": "--seed",
    "heldout_fraction": "--heldout-fraction",
}


def _option_text(value: object) -> str:
    if isinstance(value, list):
        return ",".join(_option_text(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def import_command(file: str, label_column: str, out: str, spec: dict | None = None) -> str:
    """The `edgestream import` command that makes the recording ``spec`` (``asdict(ImportSpec)``,
    as ``import.json`` keeps it) again from ``file``: the options that differ from the defaults,
    and always the length (``--duration`` or ``--records-per-device``, one is required). Without
    a spec, a command with ``--duration SECONDS`` to fill in."""
    words = ["edgestream import", "--file", shlex.quote(file), "--label-column", shlex.quote(label_column),
             "--out", shlex.quote(out)]
    defaults = asdict(ImportSpec())
    spec = spec if isinstance(spec, dict) else {}
    for key, option in IMPORT_OPTIONS.items():
        value = spec.get(key)
        if value is not None and (value != defaults[key] or key in ("duration_s", "records_per_device")):
            words += [option, shlex.quote(_option_text(value))]
    if spec.get("duration_s") is None and spec.get("records_per_device") is None:
        words += ["--duration", "SECONDS"]
    return " ".join(words)


@dataclass
class Table:
    features: np.ndarray  # float32 [N, F]
    labels: np.ndarray  # int64 [N]
    label_names: list[str]
    feature_names: list[str]


def load_table(path: str | Path, label_column: str) -> Table:
    """Read features and labels from CSV (header row), .npy, .npz or Parquet.

    ``label_column``: a column name (CSV, Parquet), an array name (.npz: the features are
    the other array, or the one named ``features``/``x``/``X``), or a column index
    (.npy 2-D arrays, negative allowed). Labels may be integers or strings; they are
    mapped to 0..C-1 in sorted order (``label_names`` keeps the mapping).
    """
    path = Path(path)
    if not path.is_file():
        raise TableImportError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv", ".txt"):
        return _load_csv(path, label_column, "\t" if suffix == ".tsv" else ",")
    if suffix == ".npy":
        return _load_npy(path, label_column)
    if suffix == ".npz":
        return _load_npz(path, label_column)
    if suffix in (".parquet", ".pq"):
        return _load_parquet(path, label_column)
    raise TableImportError(f"{path}: unsupported file type {suffix!r}; use .csv, .tsv, .npy, .npz or .parquet")


def _labels_to_ints(path: Path, raw: list[str] | np.ndarray,
                    rows: list[int] | None = None) -> tuple[np.ndarray, list[str]]:
    """Labels as 0..C-1 in sorted order, and the names. An empty, NaN or infinite label
    is refused naming its data row (``rows[i]``: the table's row number of label ``i``)."""
    values = ["" if v is None else str(v).strip() for v in raw]  # None: Parquet's missing value
    for i, value in enumerate(values):
        problem = _missing_label(value)
        if problem is not None:
            row = rows[i] if rows is not None else i + 1
            raise TableImportError(f"{path}: {problem} in data row {row}; every row needs a class: "
                                   "fill it in or delete the row")
    try:
        as_float = [float(v) for v in values]
        numeric = all(f == int(f) for f in as_float)
    except ValueError:
        numeric = False
    if numeric:
        keys = sorted({int(float(v)) for v in values})
        names = [str(k) for k in keys]
        index = {k: i for i, k in enumerate(keys)}
        return np.array([index[int(float(v))] for v in values], dtype=np.int64), names
    names = sorted(set(values))
    index = {k: i for i, k in enumerate(names)}
    return np.array([index[v] for v in values], dtype=np.int64), names


def _missing_label(value: str) -> str | None:
    """Why ``value`` is not a class (empty, NaN, infinite), or None if it is one."""
    if value == "":
        return "empty label"
    try:
        number = float(value)
    except ValueError:
        return None
    return None if math.isfinite(number) else f"label {value!r} (not a class)"


#: The largest magnitude a float32 feature can hold; a larger value would be stored as inf.
_F32_MAX = float(np.finfo(np.float32).max)
#: How many column names an error lists before "... and N more".
_LISTED_COLUMNS = 20


def _column_list(names: list[str]) -> str:
    """``names`` comma-separated, the first ``_LISTED_COLUMNS`` and then how many more."""
    shown = ", ".join(names[:_LISTED_COLUMNS])
    more = len(names) - _LISTED_COLUMNS
    return f"{shown}, ... and {more} more" if more > 0 else shown


def _features(path: Path, rows: np.ndarray, names: list[str], row_numbers: list[int] | None = None) -> np.ndarray:
    """``rows`` as float32 [N, F], refusing non-finite values and values float32 cannot hold
    (naming the data row, ``row_numbers[r]`` if given, and the column)."""
    try:
        features = np.asarray(rows, dtype=np.float64)
    except (ValueError, OverflowError) as exc:
        raise TableImportError(f"{path}: feature columns must be numeric: {exc}") from None
    if features.ndim != 2 or features.shape[1] == 0:
        raise TableImportError(f"{path}: need at least one feature column besides the label")

    def where(r: int, c: int) -> str:
        row = row_numbers[r] if row_numbers is not None else r + 1
        return f"data row {row}, column {names[c]!r}"

    bad = ~np.isfinite(features)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise TableImportError(f"{path}: non-finite value in {where(r, c)}")
    over = np.abs(features) > _F32_MAX
    if over.any():
        r, c = np.argwhere(over)[0]
        count = int(over.sum())
        others = f" ({count - 1} more value(s) too)" if count > 1 else ""
        raise TableImportError(
            f"{path}: value {features[r, c]:g} in {where(r, c)} overflows float32 "
            f"(magnitude above {_F32_MAX:.4g}){others}; rescale the column (e.g. other units)"
        )
    return features.astype(np.float32)


#: Bytes read to tell a binary file from text before parsing it.
_SNIFF_BYTES = 8192


def _load_csv(path: Path, label_column: str, delimiter: str) -> Table:
    with open(path, "rb") as fh:
        head = fh.read(_SNIFF_BYTES)
    if b"\0" in head:
        raise TableImportError(f"{path}: binary file (NUL bytes), not a CSV text table; "
                               "export the table as UTF-8 CSV, or import it as .npy / .npz / .parquet")
    try:
        # utf-8-sig drops a byte-order mark, which would otherwise stick to the first name.
        with open(path, newline="", encoding="utf-8-sig") as fh:
            return _parse_csv(path, csv.reader(fh, delimiter=delimiter), label_column)
    except UnicodeDecodeError:
        raise TableImportError(f"{path}: not UTF-8 text ({_first_bad_byte(path)}); "
                               "export the table as UTF-8 CSV") from None
    except csv.Error as exc:
        raise TableImportError(f"{path}: not a readable CSV: {exc}") from None


def _first_bad_byte(path: Path) -> str:
    """Where the first byte that is not UTF-8 is: the reader's error counts from its buffer."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        return f"byte 0x{data[exc.start]:02x} at offset {exc.start}, line {line}"
    return "it changed while being read"


def _parse_csv(path: Path, reader: Iterator[list[str]], label_column: str) -> Table:
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise TableImportError(f"{path}: empty file") from None
    seen: dict[str, int] = {}
    for position, name in enumerate(header, start=1):
        if name in seen:
            raise TableImportError(f"{path}: duplicate column name {name!r} (columns {seen[name]} and "
                                   f"{position}); give every column a unique name")
        seen[name] = position
    if label_column not in header:
        raise TableImportError(f"{path}: no label column {label_column!r}; "
                               f"{len(header)} columns: {_column_list(header)}")
    li = header.index(label_column)
    labels_raw, rows, row_numbers = [], [], []
    for n, row in enumerate(reader, start=1):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise TableImportError(f"{path}: data row {n} has {len(row)} fields, the header {len(header)}")
        labels_raw.append(row[li])
        rows.append([c.strip() for i, c in enumerate(row) if i != li])
        row_numbers.append(n)
    if not rows:
        raise TableImportError(f"{path}: no data rows")
    feature_names = [h for i, h in enumerate(header) if i != li]
    numeric = []
    for n, r in zip(row_numbers, rows, strict=True):
        try:
            numeric.append([float(c) for c in r])
        except ValueError:
            for name, c in zip(feature_names, r, strict=True):
                try:
                    float(c)
                except ValueError:
                    raise TableImportError(
                        f"{path}: data row {n}, column {name!r}: {c!r} is not a number"
                    ) from None
            raise
    labels, names = _labels_to_ints(path, labels_raw, row_numbers)
    return Table(_features(path, np.array(numeric), feature_names, row_numbers), labels, names, feature_names)


def _load_npy(path: Path, label_column: str) -> Table:
    arr = np.load(path, allow_pickle=False)
    if arr.ndim != 2:
        raise TableImportError(f"{path}: a .npy table must be 2-D [rows, columns], got shape {arr.shape}")
    try:
        li = int(label_column)
    except ValueError:
        raise TableImportError(f"{path}: for .npy, --label-column is a column index, got {label_column!r}") from None
    if not -arr.shape[1] <= li < arr.shape[1]:
        raise TableImportError(f"{path}: label column {li} out of range for {arr.shape[1]} columns")
    li %= arr.shape[1]
    names = [f"c{i}" for i in range(arr.shape[1]) if i != li]
    labels, label_names = _labels_to_ints(path, arr[:, li])
    return Table(_features(path, np.delete(arr, li, axis=1), names), labels, label_names, names)


def _load_npz(path: Path, label_column: str) -> Table:
    with np.load(path, allow_pickle=False) as z:
        keys = list(z.keys())
        if label_column not in keys:
            raise TableImportError(f"{path}: no array {label_column!r}; arrays: {_column_list(keys)}")
        others = [k for k in keys if k != label_column]
        feat_key = next((k for k in ("features", "x", "X") if k in others), others[0] if len(others) == 1 else None)
        if feat_key is None:
            raise TableImportError(f"{path}: cannot tell the feature array among {others}; name it 'features'")
        features, raw_labels = z[feat_key], z[label_column]
    if raw_labels.ndim != 1 or features.shape[0] != raw_labels.shape[0]:
        raise TableImportError(f"{path}: {feat_key} {features.shape} and {label_column} {raw_labels.shape} "
                           "must have the same number of rows (labels 1-D)")
    flat = features.reshape(features.shape[0], -1)
    names = [f"{feat_key}[{i}]" for i in range(flat.shape[1])]
    labels, label_names = _labels_to_ints(path, raw_labels)
    out = _features(path, flat, names).reshape(features.shape)
    return Table(out, labels, label_names, names)


def _load_parquet(path: Path, label_column: str) -> Table:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TableImportError(
            f"{path}: Parquet needs pyarrow, which is not installed; install it "
            "(pip install pyarrow) or convert the file to CSV / .npz"
        ) from None
    table = pq.read_table(path)
    if label_column not in table.column_names:
        raise TableImportError(f"{path}: no label column {label_column!r}; {len(table.column_names)} columns: "
                               f"{_column_list(table.column_names)}")
    names = [c for c in table.column_names if c != label_column]
    columns = [np.asarray(table.column(c).to_numpy(zero_copy_only=False)) for c in names]
    labels, label_names = _labels_to_ints(path, table.column(label_column).to_pylist())
    return Table(_features(path, np.stack(columns, axis=1), names), labels, label_names, names)


@dataclass
class ImportReport:
    directory: str
    devices: dict[str, dict]
    messages: int
    records: int
    duration_s: float
    source: dict
    #: What a job needs to train on the recording (``import.json``'s ``data``; see the module doc).
    data: dict = field(default_factory=dict)
    format: str = "edgestream-import"
    version: int = IMPORT_VERSION

    def to_dict(self) -> dict:
        return asdict(self)


def feature_stats(features: np.ndarray) -> dict[str, list[float]]:
    """Per-feature (flattened) min, max, mean and std of ``features`` [N, ...], as JSON lists.

    Computed in float64 so a column of large values does not lose its mean; the lists
    hold Python floats, which round-trip float32 values exactly through JSON.
    """
    flat = np.asarray(features, dtype=np.float64).reshape(features.shape[0], -1)
    return {
        "min": flat.min(axis=0).tolist(),
        "max": flat.max(axis=0).tolist(),
        "mean": flat.mean(axis=0).tolist(),
        "std": flat.std(axis=0).tolist(),
    }


def _check_stats(path: str | Path, stats: dict[str, list[float]], names: list[str]) -> None:
    """Refuse a table whose per-feature statistics are not finite, or whose span does not
    fit float32: a job's input standardisation ``(x - mean) / std`` runs in float32 (a
    span within float32 keeps ``x - mean`` finite) and its value range is built from them."""

    def column(i: int) -> str:
        return repr(names[i]) if len(names) == len(stats["min"]) else f"feature {i}"

    for stat, values in stats.items():
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise TableImportError(f"{path}: the {stat} of column {column(bad[0])} is {values[bad[0]]} "
                                   f"({len(bad)} column(s) affected); rescale the column so its "
                                   "values and their spread fit float32")
    spans = [hi - lo for lo, hi in zip(stats["min"], stats["max"], strict=True)]
    wide = [i for i, span in enumerate(spans) if span > _F32_MAX]
    if wide:
        i = wide[0]
        raise TableImportError(
            f"{path}: column {column(i)} spans {spans[i]:.4g} (min {stats['min'][i]:.4g}, max "
            f"{stats['max'][i]:.4g}), beyond float32's {_F32_MAX:.4g}: centring its values for "
            f"training would overflow ({len(wide)} column(s) affected); rescale the column (e.g. other units)"
        )


def _save_npz(path: Path, **arrays: np.ndarray) -> None:
    # Plain arrays only (no object dtype), so readers can load with allow_pickle=False.
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
    tmp.replace(path)


def import_table(
    path: str | Path, label_column: str, out: str | Path, spec: ImportSpec
) -> ImportReport:
    """Write a recording of ``spec.devices`` streams over the table at ``path``.

    A stratified ``spec.heldout_fraction`` of every class is held out first; only the
    remaining rows are partitioned over the devices and streamed. Both parts and the
    job-facing description are stored next to the recording (see the module doc).
    """
    spec.validate()
    table = load_table(path, label_column)
    num_classes = len(table.label_names)
    if num_classes < 2:
        raise TableImportError(f"{path}: the label column {label_column!r} has a single class "
                               f"({table.label_names[0]!r}); a classifier needs at least two")
    dataset = Dataset(table.features, table.labels, num_classes, Path(path).stem)
    train, heldout = split_heldout(dataset, fraction=spec.heldout_fraction, seed=spec.seed)
    if len(heldout) == 0:
        raise TableImportError(f"{path}: too few rows for a held-out split (every class has a single row)")
    # Before anything is written. The whole table's span bounds |x - mean| for every row,
    # held-out ones too (they are standardised with the streamed rows' mean when evaluated).
    _check_stats(path, feature_stats(table.features), table.feature_names)
    stats = feature_stats(train.features)
    _check_stats(path, stats, table.feature_names)
    params: dict = {}
    if spec.partition == "dirichlet":
        params = {"alpha": spec.dirichlet_alpha, "min_size": 1}
    elif spec.partition == "classes":
        params = {"k": spec.classes_per_device}
    try:
        shares = partition(train.labels, spec.devices, spec.partition, spec.seed, **params)
    except ValueError as exc:
        raise TableImportError(f"{path}: cannot split the {len(train)} streamed rows "
                               f"over {spec.devices} devices: {exc}") from None
    devices = spec.device_ids()
    rates = {d: float(spec.rates_hz[i % len(spec.rates_hz)]) for i, d in enumerate(devices)}
    sims = [
        DeviceSimulator(d, DeviceSampler(train, share, seed=spec.seed * 1000 + i),
                        parse_profile(spec.profile, rates[d]),
                        np.random.default_rng(spec.seed * 1000 + 500 + i))
        for i, (d, share) in enumerate(zip(devices, shares, strict=True))
    ]
    origin = spec.start_time_s if spec.start_time_s is not None else time.time()
    interval = spec.message_interval_s
    if spec.duration_s is not None:
        ticks = max(1, int(round(spec.duration_s / interval)))
    else:
        # Bounded even if a profile (e.g. a ramp from 0) delivers less than its mean rate.
        ticks = 10 * int(math.ceil(spec.records_per_device / min(rates.values()) / interval)) + 10
    target = spec.records_per_device
    offsets = {d: 0 for d in devices}
    produced = {d: 0 for d in devices}
    total_messages = 0
    with RecordingWriter(out, topics=[topics.sensor_topic(d) for d in devices]) as writer:
        tick = 0
        while True:
            if tick >= ticks:
                break
            if target is not None and all(produced[d] >= target for d in devices):
                break
            t0, t1 = tick * interval, (tick + 1) * interval
            ts_ms = int(round((origin + t1) * 1000))  # sent at the end of its interval
            for sim in sims:
                if target is not None and produced[sim.device] >= target:
                    continue
                for batch in sim.step(t0, t1, origin):
                    if target is not None:
                        keep = min(batch.count, target - produced[sim.device])
                        if keep <= 0:
                            break
                        if keep < batch.count:
                            batch = type(batch)(batch.device, batch.seq[:keep], batch.event_time[:keep],
                                                batch.features[:keep], None if batch.labels is None
                                                else batch.labels[:keep])
                    topic = topics.sensor_topic(sim.device)
                    writer.write(RecordedMessage(topic, 0, offsets[sim.device], ts_ms,
                                                 sim.device.encode(), codec.encode(batch)))
                    offsets[sim.device] += 1
                    produced[sim.device] += batch.count
                    total_messages += 1
            tick += 1
    out_dir = Path(out)
    bounds = np.cumsum([0] + [len(s) for s in shares]).astype(np.int64)
    _save_npz(out_dir / TRAIN_FILE, features=train.features, labels=train.labels,
              share_indices=np.concatenate(shares).astype(np.int64), share_bounds=bounds)
    _save_npz(out_dir / HELDOUT_FILE, features=heldout.features, labels=heldout.labels)
    hist = label_histogram(train.labels, shares, num_classes)
    data = {
        "feature_shape": list(train.feature_shape),
        "num_classes": num_classes,
        "label_names": table.label_names,
        "feature_names": table.feature_names,
        "heldout_fraction": spec.heldout_fraction,
        "partition": spec.partition,
        "seed": spec.seed,
        "train": {"file": TRAIN_FILE, "rows": len(train)},
        "heldout": {"file": HELDOUT_FILE, "rows": len(heldout),
                    "label_histogram": np.bincount(heldout.labels, minlength=num_classes).tolist()},
        "stats": stats,
        "device_ids": devices,
        "rates_hz": [rates[d] for d in devices],
        "profile": spec.profile,
        "message_interval_s": interval,
        "duration_s": round(tick * interval, 9),
    }
    report = ImportReport(
        directory=str(out),
        devices={d: {"rate_hz": rates[d], "records": produced[d], "messages": offsets[d],
                     "share_rows": int(len(shares[i])),
                     "label_histogram": [int(x) for x in hist[i]]}
                 for i, d in enumerate(devices)},
        messages=total_messages,
        records=sum(produced.values()),
        duration_s=tick * interval,
        source={"file": str(path), "rows": len(dataset), "label_column": label_column,
                "label_names": table.label_names, "feature_shape": list(dataset.feature_shape),
                "partition": spec.partition, "spec": asdict(spec),
                "streamed_rows": len(train), "heldout_rows": len(heldout)},
        data=data,
    )
    # Written last: a directory whose import.json has ``data`` holds every file it names.
    tmp = out_dir / (IMPORT_INFO + ".tmp")
    tmp.write_text(json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n")
    tmp.replace(out_dir / IMPORT_INFO)
    return report


def job_file_text(report: ImportReport, *, workers: int | None = None) -> str:
    """A job file (TOML) that trains on the recording of ``report``: ``edgestream run --job FILE``.

    ``[data]`` points at the recording (absolute path), ``[run] duration_s`` covers the
    recorded span at speed 1 (streaming stops earlier when the recording ends),
    training is on, ``workers.count`` is two (one per device if fewer) and
    ``batcher.max_batch`` takes a whole window of the fastest device.
    """
    directory = Path(report.directory).resolve()
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", directory.name).strip("-")[:64] or "imported"
    count = workers if workers is not None else min(2, len(report.devices))
    duration = math.ceil(report.duration_s) + 5  # the replayer's start-up and last interval
    # One batch takes a whole window (1 s) of the fastest device, so no device's backlog
    # grows while it streams.
    max_batch = max(64, math.ceil(max(d["rate_hz"] for d in report.devices.values())))
    lines = [
        f"# Train on {report.source.get('file', 'an imported table')} as recorded by `edgestream import`.",
        "# Run it with: edgestream run --job THIS_FILE",
        "[job]",
        f"name = {json.dumps(name)}",
        "",
        "[data]",
        'source = "recording"',
        f"recording = {json.dumps(str(directory))}",
        'replay_speed = "1"  # or "k" (k times faster) or "max"',
        "",
        "[workers]",
        f"count = {count}",
        "",
        "[batcher]",
        f"max_batch = {max_batch}  # records per device per 1 s window: the fastest device's rate",
        "",
        "[run]",
        f"duration_s = {duration}",
        "",
        "[train]",
        "enabled = true",
        'model = "mlp"',
        "",
    ]
    return "\n".join(lines)
