"""Adaptive batching of one device's buffered records (pure, synchronous, clock passed in).

Two modes:
  * ``window`` (ScaDLES): every ``window_s`` seconds emit whatever arrived, capped at
    ``max_batch``. The excess is kept for the next window (``persist``) or dropped and
    counted (``truncate``). With ``max_batch_widen`` above ``max_batch`` the cap widens
    (doubling) while a device's arrivals outpace it, up to that bound, and narrows back
    once they fit again: a moderately fast device is kept up with; beyond the bound its
    backlog grows and is reported (``backlog``).
  * ``fixed`` (the conventional baseline): emit exactly ``batch_size`` records as soon
    as that many are buffered; a slow stream simply waits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from edgestream.streams.buffering import Sources, StreamBuffer, concat, slice_records
from edgestream.streams.records import RecordBatch, pick_origin


@dataclass
class Batch:
    """A training batch of one device, and the message chunks its records came from."""

    device: str
    records: RecordBatch
    created_at: float
    #: ``(token, records)`` in order: which ingest chunk each part of ``records`` came from.
    sources: Sources = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.records.count

    def select(self, positions: Sequence[int]) -> Batch:
        """The records at ``positions`` (ascending, within this batch) as a batch of their
        own, with the sources they came from (so part of a batch can be settled one way and
        the rest another: a refused step's culprits dead-lettered, the others trained)."""
        index = np.asarray(positions, dtype=np.int64)
        if len(index) == self.size:
            return self
        records = RecordBatch(
            device=self.records.device, seq=self.records.seq[index], event_time=self.records.event_time[index],
            features=self.records.features[index],
            labels=None if self.records.labels is None else self.records.labels[index],
            origin=pick_origin(self.records, index),
        )
        sources: Sources = []
        start = 0
        for token, count in self.sources:
            taken = int(np.count_nonzero((index >= start) & (index < start + count)))
            if taken:
                sources.append((token, taken))
            start += count
        return Batch(self.device, records, self.created_at, sources)


@dataclass
class WindowDrop:
    """Records dropped by window truncation at one window boundary."""

    device: str
    dropped: int
    sources: Sources


#: Consecutive windows that must leave records behind before the cap widens (one burst
#: does not widen it).
WIDEN_AFTER_WINDOWS = 2


class AdaptiveBatcher:
    """Turns a ``StreamBuffer`` into batches; owns no I/O and reads no clock.

    Invariant: every record leaving the buffer through this class is either in an
    emitted ``Batch`` or counted in ``window_dropped_total``; in ``window`` mode no batch
    is larger than ``batch_cap``, and ``max_batch <= batch_cap <= window_records``.
    """

    def __init__(
        self,
        buffer: StreamBuffer,
        mode: str = "window",
        *,
        window_s: float = 1.0,
        max_batch: int = 64,
        batch_size: int = 64,
        window_overflow: str = "persist",
        start: float = 0.0,
        max_batch_widen: int = 0,
    ) -> None:
        """``max_batch_widen``: the most records a widened window batch may take (a memory
        bound); 0 (or ``max_batch``) keeps every window at ``max_batch``."""
        if mode not in ("window", "fixed"):
            raise ValueError(f"unknown batcher mode {mode!r}; use 'window' or 'fixed'")
        if window_overflow not in ("persist", "truncate"):
            raise ValueError(f"unknown window_overflow {window_overflow!r}")
        if window_s <= 0 or max_batch < 1 or batch_size < 1:
            raise ValueError("window_s, max_batch and batch_size must be positive")
        if max_batch_widen and max_batch_widen < max_batch:
            raise ValueError(f"max_batch_widen ({max_batch_widen}) must be 0 (off) or at least max_batch "
                             f"({max_batch})")
        self.buffer = buffer
        self.mode = mode
        self.window_s = window_s
        self.max_batch = max_batch
        self.batch_size = batch_size
        self.window_overflow = window_overflow
        self.max_batch_widen = max(max_batch, max_batch_widen)
        #: The cap of the next window batch: ``max_batch``, widened under sustained overload.
        self.batch_cap = max_batch
        self._overloaded_windows = 0  # consecutive windows that left records behind
        self.next_window_at = start + window_s
        self.batches_total = 0
        self.batched_records_total = 0
        self.window_dropped_total = 0
        self.drops: list[WindowDrop] = []

    def on_arrival(self, now: float) -> list[Batch]:
        """Call after records were pushed; in ``fixed`` mode emits every full batch."""
        if self.mode != "fixed":
            return []
        out = []
        while self.buffer.depth >= self.batch_size:
            out.append(self._emit(self.batch_size, now))
        return out

    def poll(self, now: float) -> list[Batch]:
        """Call periodically; in ``window`` mode emits one batch per elapsed window.

        Windows with nothing buffered emit nothing. If several windows elapsed since the
        last poll (a stalled loop), each gets its own batch, so the cap is per window.
        Truncation drops are collected in ``drops`` for the caller to account and ack.
        Each window then adjusts the cap (``_adjust_cap``).
        """
        if self.mode != "window":
            return []
        out = []
        while now >= self.next_window_at:
            self.next_window_at += self.window_s
            emitted = 0
            if self.buffer.depth > 0:
                out.append(self._emit(self.batch_cap, now))
                emitted = out[-1].size
            self._adjust_cap(emitted, left_behind=self.buffer.depth)
            if self.window_overflow == "truncate" and self.buffer.depth > 0:
                dropped = self.buffer.drop_oldest(self.buffer.depth)
                self.window_dropped_total += dropped.dropped
                self.drops.append(WindowDrop(self.buffer.device, dropped.dropped, dropped.sources))
        return out

    def _adjust_cap(self, emitted: int, left_behind: int) -> None:
        """Widen the cap (doubling, up to ``max_batch_widen``) after ``WIDEN_AFTER_WINDOWS``
        consecutive windows that left records behind; narrow it (halving, down to
        ``max_batch``) after a window whose batch would have fit in half of it."""
        if left_behind > 0:
            self._overloaded_windows += 1
            if self._overloaded_windows >= WIDEN_AFTER_WINDOWS and self.batch_cap < self.max_batch_widen:
                self.batch_cap = min(self.max_batch_widen, 2 * self.batch_cap)
                self._overloaded_windows = 0
            return
        self._overloaded_windows = 0
        if self.batch_cap > self.max_batch and emitted <= self.batch_cap // 2:
            self.batch_cap = max(self.max_batch, self.batch_cap // 2)

    @property
    def window_records(self) -> int:
        """The most records one window batch can take (``fixed``: one batch): what may be
        pending without the device falling behind."""
        return self.max_batch_widen if self.mode == "window" else self.batch_size

    @property
    def capacity_hz(self) -> float:
        """The most records per second the batcher takes from the device, widened fully
        (``fixed`` mode waits for the stream: unbounded)."""
        return self.window_records / self.window_s if self.mode == "window" else float("inf")

    def backlog(self, pending: int) -> int:
        """Records of ``pending`` (read, not yet trained) beyond one window: what the device
        has run ahead of the batcher (0 for a device that is kept up with)."""
        return max(0, pending - self.window_records)

    def flush(self, now: float) -> Batch | None:
        """Emit everything still buffered as one (possibly short) batch."""
        if self.buffer.depth == 0:
            return None
        return self._emit(self.buffer.depth, now)

    def take_drops(self) -> list[WindowDrop]:
        drops, self.drops = self.drops, []
        return drops

    def seconds_to_next_window(self, now: float) -> float:
        return max(0.0, self.next_window_at - now)

    def _emit(self, n: int, now: float) -> Batch:
        taken = self.buffer.take(n)
        batch = Batch(self.buffer.device, concat(taken.parts), now, taken.sources)
        self.batches_total += 1
        self.batched_records_total += batch.size
        return batch


def split_batch(batch: Batch, k: int) -> tuple[Batch, Batch]:
    """The first ``k`` records of ``batch`` and the rest, each with the sources its records
    came from (a chunk cut in two appears in both, with its share of the records)."""
    if not 0 < k < batch.size:
        raise ValueError(f"split at {k} of a batch of {batch.size} records")
    head_sources: Sources = []
    tail_sources: Sources = []
    left = k
    for token, n in batch.sources:
        if left >= n:
            head_sources.append((token, n))
            left -= n
        elif left > 0:
            head_sources.append((token, left))
            tail_sources.append((token, n - left))
            left = 0
        else:
            tail_sources.append((token, n))
    head = Batch(batch.device, slice_records(batch.records, 0, k), batch.created_at, head_sources)
    tail = Batch(batch.device, slice_records(batch.records, k, batch.size), batch.created_at, tail_sources)
    return head, tail


class BatchQueue:
    """Batches the batchers emitted, waiting for the trainer, and the one rule for what a
    local step takes from them (live runs and the simulated clock alike):

    * ``fixed`` mode (the BSP baseline): exactly the oldest batch;
    * ``window`` mode (ScaDLES): the oldest records up to ``limit`` (the strategy's wanted
      batch size, or ``train.max_step_batch``), whole batches first; the batch that does
      not fit is split and its rest stays at the head.

    Invariant: ``records`` is the sum of the waiting batches' sizes; records leave in
    arrival order.
    """

    def __init__(self, mode: str = "window") -> None:
        if mode not in ("window", "fixed"):
            raise ValueError(f"unknown batcher mode {mode!r}; use 'window' or 'fixed'")
        self.mode = mode
        self._batches: deque[Batch] = deque()
        self.records = 0

    def __len__(self) -> int:
        return len(self._batches)

    def put(self, batch: Batch) -> None:
        self._batches.append(batch)
        self.records += batch.size

    def take(self, limit: int) -> list[Batch]:
        """What the next step trains on (possibly several devices' batches), oldest first."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        taken: list[Batch] = []
        if self.mode == "fixed":
            if self._batches:
                taken.append(self._batches.popleft())
        else:
            room = limit
            while self._batches and room > 0:
                head = self._batches[0]
                if head.size <= room:
                    taken.append(self._batches.popleft())
                    room -= head.size
                else:
                    part, self._batches[0] = split_batch(head, room)
                    taken.append(part)
                    room = 0
        self.records -= sum(b.size for b in taken)
        return taken

    def drop_oldest(self) -> Batch:
        """Remove the oldest batch (a capacity policy of the caller's)."""
        batch = self._batches.popleft()
        self.records -= batch.size
        return batch
