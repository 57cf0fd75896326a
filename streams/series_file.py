"""Labelled multichannel time series: the UEA/UCR archive's ``.ts`` text files, and the
compact ``.npz`` edgestream keeps of a dataset (``data.source = "series"``).

``parse_ts`` reads one ``.ts`` file (the archive's own text format: ``#`` comment lines,
``@key value`` header lines, then after ``@data`` one series per line, its dimensions
separated by ``:``, each a comma-separated list of numbers, and the class label last).
Only what a sensor dataset of fixed length needs is accepted: equal lengths, no missing
values (``?``), no timestamps, a class label per series; anything else is a
``SeriesFormatError`` naming the line. ``SeriesFile`` is the converted dataset: the
archive's train and test series kept apart (the test series are what a job holds out),
the class and channel names, the sample rate and where the data came from.
``windows`` cuts series into the fixed-length windows a job trains on.

Plain numpy and text: no network, no pickles (``np.load(..., allow_pickle=False)``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: Version of the ``.npz`` layout ``SeriesFile.save`` writes.
SERIES_FILE_VERSION = 1
_ARRAYS = ("train_series", "train_labels", "test_series", "test_labels", "class_names", "channel_names")


class SeriesFormatError(ValueError):
    """A ``.ts`` file or a converted ``.npz`` that cannot be used; the message says where and why."""


@dataclass(frozen=True)
class TsData:
    """One parsed ``.ts`` file: ``series`` float32 ``[N, dimensions, length]``, ``labels`` the
    class label of each series as written, ``class_names`` in the header's order."""

    problem: str
    series: np.ndarray
    labels: tuple[str, ...]
    class_names: tuple[str, ...]
    comments: tuple[str, ...] = ()


def _header_bool(value: str, key: str, where: str) -> bool:
    word = value.strip().lower()
    if word not in ("true", "false"):
        raise SeriesFormatError(f"{where}: @{key} must be true or false (got {value.strip()!r})")
    return word == "true"


def parse_ts(text: str, source: str = "<ts>") -> TsData:
    """Parse the text of one ``.ts`` file; ``SeriesFormatError`` naming the line otherwise."""
    header: dict[str, str] = {}
    comments: list[str] = []
    rows: list[np.ndarray] = []
    labels: list[str] = []
    in_data = False
    shape: tuple[int, int] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        where = f"{source}:{number}"
        if not line:
            continue
        if not in_data:
            if line.startswith("#"):
                comments.append(line[1:].strip())
                continue
            if not line.startswith("@"):
                raise SeriesFormatError(f"{where}: expected a #comment or an @header line before @data")
            key, _, value = line[1:].partition(" ")
            key = key.lower()
            if key == "data":
                in_data = True
                continue
            header[key] = value.strip()
            continue
        parts = line.split(":")
        if len(parts) < 2:
            raise SeriesFormatError(f"{where}: a series needs its dimensions and a class label, separated by ':'")
        label = parts[-1].strip()
        try:
            dims = [np.array([float(v) for v in part.split(",")], dtype=np.float64) for part in parts[:-1]]
        except ValueError:
            bad = next(v for part in parts[:-1] for v in part.split(",") if not _is_number(v))
            what = "a missing value ('?')" if bad.strip() == "?" else f"{bad.strip()!r}, not a number"
            raise SeriesFormatError(f"{where}: {what}; only complete series of numbers are supported") from None
        lengths = {d.size for d in dims}
        if len(lengths) != 1:
            raise SeriesFormatError(f"{where}: dimensions of unequal length {sorted(lengths)}; only equal-length "
                                    "series are supported")
        this = (len(dims), lengths.pop())
        if shape is not None and this != shape:
            raise SeriesFormatError(f"{where}: {this[0]} dimensions of length {this[1]}, but the series before "
                                    f"have {shape[0]} of length {shape[1]}")
        shape = this
        values = np.stack(dims)
        if not np.all(np.isfinite(values)) or np.any(np.abs(values) > np.finfo(np.float32).max):
            raise SeriesFormatError(f"{where}: a value is not finite or does not fit float32")
        rows.append(values.astype(np.float32))
        labels.append(label)
    where = f"{source}"
    if not in_data:
        raise SeriesFormatError(f"{where}: no @data line")
    if "timestamps" in header and _header_bool(header["timestamps"], "timeStamps", where):
        raise SeriesFormatError(f"{where}: @timeStamps true is not supported (series of plain values only)")
    class_label = header.get("classlabel", "").split()
    if not class_label or not _header_bool(class_label[0], "classLabel", where) or len(class_label) < 2:
        raise SeriesFormatError(f"{where}: needs '@classLabel true NAME NAME ...' (a classification dataset)")
    class_names = tuple(class_label[1:])
    if not rows:
        raise SeriesFormatError(f"{where}: no series after @data")
    unknown = sorted(set(labels) - set(class_names))
    if unknown:
        raise SeriesFormatError(f"{where}: class label(s) {unknown} not in @classLabel {list(class_names)}")
    series = np.stack(rows)
    for key, actual in (("dimensions", series.shape[1]), ("serieslength", series.shape[2])):
        if key in header and header[key].isdigit() and int(header[key]) != actual:
            raise SeriesFormatError(f"{where}: @{key} says {header[key]} but the series have {actual}")
    return TsData(problem=header.get("problemname", ""), series=series, labels=tuple(labels),
                  class_names=class_names, comments=tuple(comments))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, eq=False)
class SeriesFile:
    """A converted dataset: train and test series ``[N, channels, length]`` (float32) with
    class indices (int64, into ``class_names``), channel names, the sample rate and ``meta``
    (dataset name, source, citation, license, checksums: JSON-serialisable)."""

    train_series: np.ndarray
    train_labels: np.ndarray
    test_series: np.ndarray
    test_labels: np.ndarray
    class_names: tuple[str, ...]
    channel_names: tuple[str, ...]
    sample_rate_hz: float
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for part in ("train", "test"):
            series, labels = getattr(self, f"{part}_series"), getattr(self, f"{part}_labels")
            if series.dtype != np.float32 or series.ndim != 3 or len(series) == 0:
                raise SeriesFormatError(f"{part}_series must be a non-empty float32 [N, channels, length] array "
                                        f"(got {series.dtype} {series.shape})")
            if labels.dtype != np.int64 or labels.shape != (len(series),):
                raise SeriesFormatError(f"{part}_labels must be int64 with one label per series")
            if labels.min() < 0 or labels.max() >= len(self.class_names):
                raise SeriesFormatError(f"{part}_labels must lie in [0, {len(self.class_names)})")
            if not np.all(np.isfinite(series)):
                raise SeriesFormatError(f"{part}_series holds a value that is not finite")
        if self.train_series.shape[1:] != self.test_series.shape[1:]:
            raise SeriesFormatError(f"train series {self.train_series.shape[1:]} and test series "
                                    f"{self.test_series.shape[1:]} differ in channels or length")
        if len(self.channel_names) != self.train_series.shape[1]:
            raise SeriesFormatError(f"{len(self.channel_names)} channel names for {self.train_series.shape[1]} channels")
        if not (math.isfinite(self.sample_rate_hz) and self.sample_rate_hz > 0):
            raise SeriesFormatError(f"sample_rate_hz must be positive (got {self.sample_rate_hz})")

    @property
    def channels(self) -> int:
        return int(self.train_series.shape[1])

    @property
    def length(self) -> int:
        return int(self.train_series.shape[2])

    def save(self, path: str | Path) -> Path:
        """Write the ``.npz`` (atomically: a temporary file renamed into place)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(
            tmp, version=np.int64(SERIES_FILE_VERSION), train_series=self.train_series,
            train_labels=self.train_labels, test_series=self.test_series, test_labels=self.test_labels,
            class_names=np.array(self.class_names, dtype=str), channel_names=np.array(self.channel_names, dtype=str),
            sample_rate_hz=np.float64(self.sample_rate_hz), meta=np.array(json.dumps(self.meta, sort_keys=True)),
        )
        tmp.replace(path)
        return path


def load_series_file(path: str | Path) -> SeriesFile:
    """Read a ``SeriesFile.save`` file; ``FileNotFoundError`` if there is none,
    ``SeriesFormatError`` if it is not one (or of another version)."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in (*_ARRAYS, "version", "sample_rate_hz", "meta") if k not in z.files]
            if missing:
                raise SeriesFormatError(f"{path}: not a converted series file (no {', '.join(missing)})")
            if int(z["version"]) != SERIES_FILE_VERSION:
                raise SeriesFormatError(f"{path}: version {int(z['version'])}, this edgestream reads "
                                        f"{SERIES_FILE_VERSION}; convert the dataset again")
            arrays = {k: z[k] for k in _ARRAYS}
            rate = float(z["sample_rate_hz"])
            meta = json.loads(str(z["meta"]))
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        if isinstance(exc, SeriesFormatError):
            raise
        raise SeriesFormatError(f"{path}: cannot be read as a converted series file ({exc})") from None
    return SeriesFile(arrays["train_series"], arrays["train_labels"], arrays["test_series"], arrays["test_labels"],
                      tuple(str(c) for c in arrays["class_names"]), tuple(str(c) for c in arrays["channel_names"]),
                      rate, meta)


def convert_ts(train: TsData, test: TsData, *, channel_names: tuple[str, ...], sample_rate_hz: float,
               meta: dict[str, Any] | None = None) -> SeriesFile:
    """The archive's train and test files as one ``SeriesFile`` (classes in the train file's
    header order; the two files must declare the same classes and series shape)."""
    if train.class_names != test.class_names:
        raise SeriesFormatError(f"the train and test files declare different classes: {list(train.class_names)} "
                                f"and {list(test.class_names)}")
    index = {name: i for i, name in enumerate(train.class_names)}
    return SeriesFile(
        train.series, np.array([index[c] for c in train.labels], dtype=np.int64),
        test.series, np.array([index[c] for c in test.labels], dtype=np.int64),
        train.class_names, tuple(channel_names), float(sample_rate_hz),
        {"problem": train.problem, "description": " ".join(train.comments), **(meta or {})},
    )


def windows(series: np.ndarray, window: int, hop: int) -> np.ndarray:
    """Every ``window``-long slice of each series, ``hop`` steps apart, in time order:
    ``[N * k, channels, window]`` with ``k = (length - window) // hop + 1`` per series,
    series after series (rows ``i * k`` to ``(i + 1) * k - 1`` are series ``i``)."""
    if window < 1 or hop < 1:
        raise ValueError(f"window and hop must be >= 1 (got {window}, {hop})")
    length = series.shape[2]
    if window > length:
        raise ValueError(f"a window of {window} steps is longer than the series ({length} steps)")
    starts = range(0, length - window + 1, hop)
    cut = np.stack([series[:, :, s:s + window] for s in starts], axis=1)  # [N, k, channels, window]
    return np.ascontiguousarray(cut.reshape(-1, series.shape[1], window), dtype=np.float32)


def windows_per_series(length: int, window: int, hop: int) -> int:
    """How many windows ``windows`` cuts from one series of ``length`` steps."""
    return (length - window) // hop + 1
