"""Sensor records: one reading (``SensorRecord``) and the columnar micro-batch a message carries."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

#: Where each record came from in Kafka (``RecordBatch.origin``): the partition and offset
#: of the message that carried it and that message's Kafka timestamp in seconds (NaN: none).
ORIGIN_DTYPE = np.dtype([("partition", "<i4"), ("offset", "<i8"), ("timestamp", "<f8")])


@dataclass(frozen=True)
class SensorRecord:
    """One sensor reading from one device.

    ``features`` has a fixed shape per stream; ``label`` is optional (unlabelled streams).
    """

    device: str
    seq: int
    event_time: float
    features: np.ndarray
    label: int | None = None


@dataclass(frozen=True)
class RecordBatch:
    """Records of one device in columnar form: what one Kafka message carries.

    Invariant: ``seq``, ``event_time``, ``features`` (and ``labels`` if present) all have
    the same leading length ``count``; ``features`` is float32.
    """

    device: str
    seq: np.ndarray  # uint64 [n]
    event_time: np.ndarray  # float64 [n], seconds since the epoch
    features: np.ndarray  # float32 [n, *feature_shape]
    labels: np.ndarray | None = None  # int32 [n]
    #: ``ORIGIN_DTYPE`` [n]: each record's source message, stamped by the ingest when a job
    #: publishes predictions (``serve.predictions``); None: not recorded. Never encoded.
    origin: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.seq)
        if len(self.event_time) != n or len(self.features) != n:
            raise ValueError("seq, event_time and features must have the same length")
        if self.labels is not None and len(self.labels) != n:
            raise ValueError("labels must have the same length as features")
        if self.origin is not None and (len(self.origin) != n or self.origin.dtype != ORIGIN_DTYPE):
            raise ValueError("origin must be an ORIGIN_DTYPE array as long as the records")

    @property
    def count(self) -> int:
        return len(self.seq)

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return tuple(self.features.shape[1:])

    @classmethod
    def from_records(cls, records: list[SensorRecord]) -> RecordBatch:
        if not records:
            raise ValueError("a RecordBatch needs at least one record")
        device = records[0].device
        if any(r.device != device for r in records):
            raise ValueError("all records of a batch must come from one device")
        has_labels = records[0].label is not None
        if any((r.label is not None) != has_labels for r in records):
            raise ValueError("either every record of a batch has a label or none has")
        return cls(
            device=device,
            seq=np.array([r.seq for r in records], dtype=np.uint64),
            event_time=np.array([r.event_time for r in records], dtype=np.float64),
            features=np.stack([np.asarray(r.features, dtype=np.float32) for r in records]),
            labels=np.array([r.label for r in records], dtype=np.int32) if has_labels else None,
        )

    def records(self) -> list[SensorRecord]:
        return [
            SensorRecord(
                device=self.device,
                seq=int(self.seq[i]),
                event_time=float(self.event_time[i]),
                features=self.features[i],
                label=None if self.labels is None else int(self.labels[i]),
            )
            for i in range(self.count)
        ]


def with_origin(batch: RecordBatch, partition: int, offsets: np.ndarray | int,
                timestamps: np.ndarray | float | None) -> RecordBatch:
    """``batch`` with its records' ``origin`` set: all from ``partition``, at ``offsets`` (one
    per record, or one for all) with Kafka timestamps ``timestamps`` (seconds; None: none)."""
    origin = np.empty(batch.count, dtype=ORIGIN_DTYPE)
    origin["partition"] = partition
    origin["offset"] = offsets
    origin["timestamp"] = np.nan if timestamps is None else timestamps
    return replace(batch, origin=origin)


def pick_origin(batch: RecordBatch, index: slice | np.ndarray) -> np.ndarray | None:
    """``batch.origin[index]`` (None when the batch has none)."""
    return None if batch.origin is None else batch.origin[index]


def join_origins(parts: list[RecordBatch]) -> np.ndarray | None:
    """The origins of ``parts`` concatenated, or None unless every part has them."""
    if any(p.origin is None for p in parts):
        return None
    return np.concatenate([p.origin for p in parts])  # type: ignore[misc]
