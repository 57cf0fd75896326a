"""Which offsets of each partition are fully handled: the resume point of a checkpoint.

Pure bookkeeping. A message is *seen* when the agent reads it and *resolved* once
nothing more will happen to it (its records trained, dropped by a counted policy, or
the message dead-lettered). The watermark of a partition is the first offset that is
seen but not resolved (or one past the highest resolved): restarting there loses
nothing and repeats at most the messages resolved above a still-open one.
"""

from __future__ import annotations

import bisect
import heapq


class OffsetTracker:
    """Low watermark of resolved offsets, per ``"topic:partition"`` key.

    Invariant: every offset below ``watermark(key)`` that was seen is resolved.

    ``done`` (from a checkpoint's ``done_ranges()``) names offsets above the restored
    watermark that were already resolved before the checkpoint: the reader skips them
    (``is_done``) instead of handling them a second time.
    """

    def __init__(self, start: dict[str, int] | None = None,
                 done: dict[str, list[list[int]]] | None = None) -> None:
        self._open: dict[str, list[int]] = {}
        self._open_set: dict[str, set[int]] = {}
        self._next: dict[str, int] = dict(start or {})
        self._top: dict[str, int] = {}  # highest offset pushed on each heap
        # key -> sorted, disjoint [first, last] ranges to skip, and their firsts for bisect
        self._done: dict[str, list[tuple[int, int]]] = {
            key: sorted((int(a), int(b)) for a, b in ranges) for key, ranges in (done or {}).items() if ranges
        }
        self._done_firsts = {key: [a for a, _ in ranges] for key, ranges in self._done.items()}

    @staticmethod
    def key(topic: str, partition: int) -> str:
        return f"{topic}:{partition}"

    def seen(self, key: str, offset: int) -> None:
        self.seen_range(key, offset, offset)

    def seen_range(self, key: str, first: int, last: int) -> None:
        """Offsets ``first..last`` (inclusive) were read."""
        opened = self._open_set.setdefault(key, set())
        heap = self._open.setdefault(key, [])
        top = self._top.get(key, -1)
        if first > top:
            # Above everything on the heap: appending in order keeps it a heap.
            opened.update(range(first, last + 1))
            heap.extend(range(first, last + 1))
            self._top[key] = last
            return
        for offset in range(first, last + 1):
            if offset not in opened:
                opened.add(offset)
                heapq.heappush(heap, offset)
        self._top[key] = max(top, last)

    def resolved(self, key: str, offset: int) -> None:
        self.resolved_range(key, offset, offset)

    def resolved_range(self, key: str, first: int, last: int) -> None:
        """Offsets ``first..last`` (inclusive) are fully handled."""
        opened = self._open_set.get(key)
        if opened is not None:
            opened.difference_update(range(first, last + 1))
        self._next[key] = max(self._next.get(key, 0), last + 1)

    def watermark(self, key: str) -> int | None:
        heap = self._open.get(key, [])
        opened = self._open_set.get(key, set())
        while heap and heap[0] not in opened:
            heapq.heappop(heap)
        if heap:
            return heap[0]
        return self._next.get(key)

    def done_ranges(self) -> dict[str, list[list[int]]]:
        """Per key, the offsets at or above the watermark that are already resolved, as
        ``[first, last]`` ranges (what a checkpoint stores beside the watermarks)."""
        out: dict[str, list[list[int]]] = {}
        for key in set(self._open) | set(self._next) | set(self._done):
            mark = self.watermark(key)
            end = self._next.get(key)
            ranges: list[list[int]] = []
            if mark is not None and end is not None and end > mark:
                cursor = mark
                for offset in sorted(o for o in self._open_set.get(key, ()) if mark <= o < end):
                    if offset > cursor:
                        ranges.append([cursor, offset - 1])
                    cursor = offset + 1
                if cursor < end:
                    ranges.append([cursor, end - 1])
            # Restored ranges not read again yet still hold.
            floor = max(end or 0, mark or 0)
            ranges += [[max(a, floor), b] for a, b in self._done.get(key, ()) if b >= floor]
            if ranges:
                out[key] = ranges
        return out

    def is_done(self, key: str, offset: int) -> bool:
        """True if ``offset`` was resolved before the restored checkpoint (skip it)."""
        firsts = self._done_firsts.get(key)
        if not firsts:
            return False
        i = bisect.bisect_right(firsts, offset) - 1
        return i >= 0 and self._done[key][i][1] >= offset

    def has_done(self, key: str, first: int, last: int) -> bool:
        """True if any offset of ``first..last`` is one to skip (cheap when there are none)."""
        firsts = self._done_firsts.get(key)
        if not firsts:
            return False
        i = bisect.bisect_right(firsts, last) - 1
        return i >= 0 and self._done[key][i][1] >= first

    def open_count(self, key: str) -> int:
        """Messages of ``key`` seen but not yet resolved."""
        return len(self._open_set.get(key, ()))

    def watermarks(self) -> dict[str, int]:
        out = {}
        for key in set(self._open) | set(self._next):
            mark = self.watermark(key)
            if mark is not None:
                out[key] = mark
        return out
