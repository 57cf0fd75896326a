"""Sensor records: one reading (``SensorRecord``) and the columnar micro-batch a message carries."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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

    def __post_init__(self) -> None:
        n = len(self.seq)
        if len(self.event_time) != n or len(self.features) != n:
            raise ValueError("seq, event_time and features must have the same length")
        if self.labels is not None and len(self.labels) != n:
            raise ValueError("labels must have the same length as features")

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
