"""`edgestream import`: turn a user's labelled table into a recording of device streams.

The table (CSV, .npy/.npz, or Parquet when pyarrow is installed) is split over devices
(iid / dirichlet / classes, ``streams.partition``) and each device's share is streamed
by a ``DeviceSimulator`` at its own rate; the simulator's micro-batches are encoded as
sensor messages (``streams.codec``) into ``sensors.<device>`` topics of a recording, with
Kafka timestamps at each message's send time. ``edgestream replay`` then streams it.
"""

from __future__ import annotations

import csv
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from streams import codec, topics
from streams.datasets import Dataset
from streams.errors import StreamsError
from streams.partition import DeviceSampler, label_histogram, partition
from streams.profiles import parse_profile
from streams.recording import RecordedMessage, RecordingWriter
from streams.simulator import DeviceSimulator

IMPORT_INFO = "import.json"


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

    def device_ids(self) -> list[str]:
        return [f"{self.device_prefix}{i:02d}" for i in range(self.devices)]


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


def _labels_to_ints(path: Path, raw: list[str] | np.ndarray) -> tuple[np.ndarray, list[str]]:
    values = [str(v).strip() for v in raw]
    if any(v == "" for v in values):
        row = next(i for i, v in enumerate(values) if v == "")
        raise TableImportError(f"{path}: empty label in data row {row + 1}")
    try:
        as_float = [float(v) for v in values]
        numeric = all(math.isfinite(f) and f == int(f) for f in as_float)
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


def _features(path: Path, rows: np.ndarray, names: list[str]) -> np.ndarray:
    try:
        features = np.asarray(rows, dtype=np.float64)
    except ValueError as exc:
        raise TableImportError(f"{path}: feature columns must be numeric: {exc}") from None
    if features.ndim != 2 or features.shape[1] == 0:
        raise TableImportError(f"{path}: need at least one feature column besides the label")
    bad = ~np.isfinite(features)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise TableImportError(f"{path}: non-finite value in data row {r + 1}, column {names[c]!r}")
    return features.astype(np.float32)


def _load_csv(path: Path, label_column: str, delimiter: str) -> Table:
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh, delimiter=delimiter)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise TableImportError(f"{path}: empty file") from None
        if label_column not in header:
            raise TableImportError(f"{path}: no label column {label_column!r}; columns: {', '.join(header)}")
        li = header.index(label_column)
        labels_raw, rows = [], []
        for n, row in enumerate(reader, start=1):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise TableImportError(f"{path}: data row {n} has {len(row)} fields, the header {len(header)}")
            labels_raw.append(row[li])
            rows.append([c.strip() for i, c in enumerate(row) if i != li])
    if not rows:
        raise TableImportError(f"{path}: no data rows")
    feature_names = [h for i, h in enumerate(header) if i != li]
    try:
        numeric = [[float(c) for c in r] for r in rows]
    except ValueError:
        for n, r in enumerate(rows, start=1):
            for name, c in zip(feature_names, r, strict=True):
                try:
                    float(c)
                except ValueError:
                    raise TableImportError(
                        f"{path}: data row {n}, column {name!r}: {c!r} is not a number"
                    ) from None
        raise
    labels, names = _labels_to_ints(path, labels_raw)
    return Table(_features(path, np.array(numeric), feature_names), labels, names, feature_names)


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
            raise TableImportError(f"{path}: no array {label_column!r}; arrays: {', '.join(keys)}")
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
        raise TableImportError(f"{path}: no label column {label_column!r}; columns: {', '.join(table.column_names)}")
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

    def to_dict(self) -> dict:
        return asdict(self)


def import_table(
    path: str | Path, label_column: str, out: str | Path, spec: ImportSpec
) -> ImportReport:
    """Write a recording of ``spec.devices`` streams over the table at ``path``."""
    if (spec.duration_s is None) == (spec.records_per_device is None):
        raise TableImportError("give exactly one of --duration or --records-per-device")
    if spec.devices < 1 or not spec.rates_hz or any(r <= 0 for r in spec.rates_hz):
        raise TableImportError("need at least one device and positive rates")
    table = load_table(path, label_column)
    num_classes = len(table.label_names)
    dataset = Dataset(table.features, table.labels, num_classes, Path(path).stem)
    params: dict = {}
    if spec.partition == "dirichlet":
        params = {"alpha": spec.dirichlet_alpha, "min_size": 1}
    elif spec.partition == "classes":
        params = {"k": spec.classes_per_device}
    try:
        shares = partition(dataset.labels, spec.devices, spec.partition, spec.seed, **params)
    except ValueError as exc:
        raise TableImportError(f"{path}: cannot split {len(dataset)} rows over {spec.devices} devices: {exc}") from None
    devices = spec.device_ids()
    rates = {d: float(spec.rates_hz[i % len(spec.rates_hz)]) for i, d in enumerate(devices)}
    sims = [
        DeviceSimulator(d, DeviceSampler(dataset, share, seed=spec.seed * 1000 + i),
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
    hist = label_histogram(dataset.labels, shares, num_classes)
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
                "partition": spec.partition, "spec": asdict(spec)},
    )
    (Path(out) / IMPORT_INFO).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report
