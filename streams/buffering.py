"""Per-device stream buffer with explicit, counted overflow policies (pure, synchronous).

The buffer holds decoded record chunks (one per Kafka message, or one per run of
messages) in arrival order. Every chunk carries an opaque *token* (the ingest source's
acknowledgement handle). Whatever leaves the buffer, taken for a batch or dropped under
a counted policy, is reported as ``sources``: ``(token, records)`` pairs in order, so
the owner (the ingest path's ``IngestCore``, or the simulated clock) knows which message each record came from
and acknowledges a message only once all its records are settled.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgestream.streams.records import RecordBatch, join_origins, pick_origin

POLICIES = ("persist", "truncate", "backpressure")


@dataclass
class _Chunk:
    batch: RecordBatch
    token: Any
    start: int = 0  # records before ``start`` already left the buffer

    @property
    def remaining(self) -> int:
        return self.batch.count - self.start


#: ``(token, records)``: how many records that left the buffer came from the chunk of ``token``.
Sources = list[tuple[Any, int]]


@dataclass
class PushResult:
    """What a push did: records dropped (oldest first) and where they came from."""

    dropped: int = 0
    sources: Sources = field(default_factory=list)


@dataclass
class Taken:
    """Records taken from the head of the buffer, and the chunk each part came from."""

    parts: list[RecordBatch]
    sources: Sources

    @property
    def count(self) -> int:
        return sum(p.count for p in self.parts)


class StreamBuffer:
    """Bounded FIFO of one device's records.

    Policies:
      * ``persist``: never drops; keeps the excess for later. Asks to pause the
        partition only at the hard limit (``hard_limit_factor * capacity``), a memory
        guard, and to resume when depth falls to half the capacity.
      * ``truncate``: never exceeds ``capacity``; drops the *oldest* records to make
        room (counted in ``dropped_total``).
      * ``backpressure``: never drops; asks to pause the partition at ``capacity`` and
        to resume at half of it. Records already fetched when the pause takes effect
        are still accepted, so depth may exceed ``capacity`` by what was in flight.

    Invariant: ``depth`` equals records pushed - records taken - records dropped.
    """

    def __init__(
        self, device: str, capacity: int, policy: str = "persist", hard_limit_factor: int = 16
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown buffer policy {policy!r}; use one of {POLICIES}")
        if capacity < 1:
            raise ValueError("buffer capacity must be >= 1")
        self.device = device
        self.capacity = capacity
        self.policy = policy
        self.pause_at = capacity * hard_limit_factor if policy == "persist" else capacity
        self.resume_at = max(capacity // 2, 0)
        self._chunks: deque[_Chunk] = deque()
        self.depth = 0
        self.max_depth = 0
        self.pushed_total = 0
        self.taken_total = 0
        self.dropped_total = 0
        self.paused = False
        self.pauses_total = 0

    def push(self, batch: RecordBatch, token: Any = None) -> PushResult:
        """Append one chunk; under ``truncate`` drop the oldest records beyond capacity."""
        result = PushResult()
        self._chunks.append(_Chunk(batch, token))
        self.depth += batch.count
        self.pushed_total += batch.count
        if self.policy == "truncate" and self.depth > self.capacity:
            result = self.drop_oldest(self.depth - self.capacity)
        self.max_depth = max(self.max_depth, self.depth)
        return result

    def drop_oldest(self, n: int) -> PushResult:
        """Drop up to ``n`` records from the head (counted)."""
        result = PushResult()
        taken = self._take(n)
        result.dropped = taken.count
        result.sources = taken.sources
        self.dropped_total += taken.count
        self.taken_total -= taken.count  # _take counted them as taken
        return result

    def take(self, n: int) -> Taken:
        """Remove and return up to ``n`` records from the head, oldest first."""
        return self._take(n)

    def _take(self, n: int) -> Taken:
        parts: list[RecordBatch] = []
        sources: Sources = []
        want = n
        while want > 0 and self._chunks:
            chunk = self._chunks[0]
            k = min(want, chunk.remaining)
            parts.append(slice_records(chunk.batch, chunk.start, chunk.start + k))
            sources.append((chunk.token, k))
            chunk.start += k
            want -= k
            if chunk.remaining == 0:
                self._chunks.popleft()
        got = n - want
        self.depth -= got
        self.taken_total += got
        return Taken(parts, sources)

    def would_pause(self, n: int) -> bool:
        """True if ``n`` more records would bring the depth to the pause threshold (under a
        policy that pauses; whether or not the partition is already paused)."""
        return self.policy != "truncate" and self.depth + n >= self.pause_at

    def pause_needed(self) -> bool:
        """True when the consumer of this device should pause (and was not already)."""
        if not self.paused and self.policy != "truncate" and self.depth >= self.pause_at:
            self.paused = True
            self.pauses_total += 1
            return True
        return False

    def resume_needed(self) -> bool:
        """True when a paused consumer may resume."""
        if self.paused and self.depth <= self.resume_at:
            self.paused = False
            return True
        return False


def slice_records(batch: RecordBatch, start: int, stop: int) -> RecordBatch:
    """Records ``start:stop`` of ``batch`` (the batch itself when that is all of it)."""
    if start == 0 and stop == batch.count:
        return batch
    return RecordBatch(
        device=batch.device,
        seq=batch.seq[start:stop],
        event_time=batch.event_time[start:stop],
        features=batch.features[start:stop],
        labels=None if batch.labels is None else batch.labels[start:stop],
        origin=pick_origin(batch, slice(start, stop)),
    )


def concat(parts: list[RecordBatch]) -> RecordBatch:
    """One ``RecordBatch`` from consecutive parts of the same device (copies)."""
    if len(parts) == 1:
        return parts[0]
    labels = None
    if parts[0].labels is not None:
        labels = np.concatenate([p.labels for p in parts])  # type: ignore[misc]
    return RecordBatch(
        device=parts[0].device,
        seq=np.concatenate([p.seq for p in parts]),
        event_time=np.concatenate([p.event_time for p in parts]),
        features=np.concatenate([p.features for p in parts]),
        labels=labels,
        origin=join_origins(parts),
    )
