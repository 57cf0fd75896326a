"""Which offsets of each partition are fully handled: the resume point of a checkpoint.

Pure bookkeeping. A message is *seen* when the agent reads it and *resolved* once
nothing more will happen to it (its records trained, dropped by a counted policy, or
the message dead-lettered). The watermark of a partition is the first offset that is
seen but not resolved (or one past the highest resolved): restarting there loses
nothing and repeats at most the messages resolved above a still-open one.
"""

from __future__ import annotations

import bisect


class OffsetTracker:
    """Low watermark of resolved offsets, per ``"topic:partition"`` key.

    Invariant: every offset below ``watermark(key)`` that was seen is resolved.

    ``done`` (from a checkpoint's ``done_ranges()``) names offsets above the restored
    watermark that were already resolved before the checkpoint: the reader skips them
    (``is_done``) instead of handling them a second time.
    """

    def __init__(self, start: dict[str, int] | None = None,
                 done: dict[str, list[list[int]]] | None = None) -> None:
        self._open: dict[str, _Intervals] = {}  # key -> offsets seen and not resolved
        self._next: dict[str, int] = dict(start or {})
        # key -> sorted, disjoint [first, last] ranges to skip, and their firsts for bisect
        self._done: dict[str, list[tuple[int, int]]] = {
            key: sorted((int(a), int(b)) for a, b in ranges) for key, ranges in (done or {}).items() if ranges
        }
        self._done_firsts = {key: [a for a, _ in ranges] for key, ranges in self._done.items()}

    @staticmethod
    def key(topic: str, partition: int) -> str:
        return f"{topic}:{partition}"

    @staticmethod
    def split_key(key: str) -> tuple[str, int]:
        """The inverse of :meth:`key`: ``(topic, partition)`` (a topic name has no ``:``)."""
        topic, sep, partition = key.rpartition(":")
        if not sep or not topic or not partition.isdigit():
            raise ValueError(f"not a topic:partition key: {key!r}")
        return topic, int(partition)

    def seen(self, key: str, offset: int) -> None:
        self.seen_range(key, offset, offset)

    def seen_range(self, key: str, first: int, last: int) -> None:
        """Offsets ``first..last`` (inclusive) were read."""
        opened = self._open.get(key)
        if opened is None:
            opened = self._open[key] = _Intervals()
        opened.add(first, last)

    def resolved(self, key: str, offset: int) -> None:
        self.resolved_range(key, offset, offset)

    def resolved_range(self, key: str, first: int, last: int) -> None:
        """Offsets ``first..last`` (inclusive) are fully handled."""
        opened = self._open.get(key)
        if opened is not None:
            opened.remove(first, last)
        self._next[key] = max(self._next.get(key, 0), last + 1)

    def watermark(self, key: str) -> int | None:
        opened = self._open.get(key)
        lowest = opened.lowest() if opened is not None else None
        return lowest if lowest is not None else self._next.get(key)

    def done_ranges(self) -> dict[str, list[list[int]]]:
        """Per key, the offsets at or above the watermark that are already resolved, as
        ``[first, last]`` ranges (what a checkpoint stores beside the watermarks)."""
        out: dict[str, list[list[int]]] = {}
        for key in set(self._open) | set(self._next) | set(self._done):
            mark = self.watermark(key)
            end = self._next.get(key)
            ranges: list[list[int]] = []
            if mark is not None and end is not None and end > mark:
                opened = self._open.get(key)
                ranges = opened.gaps(mark, end) if opened is not None else [[mark, end - 1]]
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
        opened = self._open.get(key)
        return opened.count if opened is not None else 0

    def watermarks(self) -> dict[str, int]:
        out = {}
        for key in set(self._open) | set(self._next):
            mark = self.watermark(key)
            if mark is not None:
                out[key] = mark
        return out


class _Intervals:
    """A set of integers as sorted, disjoint, non-adjacent ``[start, end]`` ranges.

    Invariant: ``starts`` and ``ends`` have equal length, ``starts[k] <= ends[k]`` and
    ``ends[k] + 1 < starts[k + 1]``; ``count`` is the number of integers in the set.
    A stream's offsets are read and settled in runs, so the set holds a few ranges
    where it would hold thousands of offsets.
    """

    __slots__ = ("starts", "ends", "count")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.count = 0

    def add(self, first: int, last: int) -> None:
        """Put ``first..last`` (inclusive) in the set."""
        starts, ends = self.starts, self.ends
        if not ends or first > ends[-1] + 1:  # above everything: the common case
            starts.append(first)
            ends.append(last)
            self.count += last - first + 1
            return
        i = bisect.bisect_left(ends, first - 1)  # the first range ending at or after first - 1
        j = bisect.bisect_right(starts, last + 1)  # ranges from i up to j touch first..last
        if i == j:
            starts.insert(i, first)
            ends.insert(i, last)
            self.count += last - first + 1
            return
        low, high = min(first, starts[i]), max(last, ends[j - 1])
        self.count += (high - low + 1) - sum(ends[k] - starts[k] + 1 for k in range(i, j))
        starts[i:j] = [low]
        ends[i:j] = [high]

    def remove(self, first: int, last: int) -> None:
        """Take ``first..last`` (inclusive) out of the set."""
        starts, ends = self.starts, self.ends
        i = bisect.bisect_left(ends, first)  # the first range ending at or after first
        j = bisect.bisect_right(starts, last)  # ranges from i up to j overlap first..last
        if i >= j:
            return
        kept_starts, kept_ends = [], []
        for k in range(i, j):
            start, end = starts[k], ends[k]
            self.count -= min(end, last) - max(start, first) + 1
            if start < first:
                kept_starts.append(start)
                kept_ends.append(first - 1)
            if end > last:
                kept_starts.append(last + 1)
                kept_ends.append(end)
        starts[i:j] = kept_starts
        ends[i:j] = kept_ends

    def lowest(self) -> int | None:
        return self.starts[0] if self.starts else None

    def gaps(self, low: int, high: int) -> list[list[int]]:
        """The ranges of ``low..high - 1`` not in the set, as ``[first, last]`` lists."""
        out: list[list[int]] = []
        cursor = low
        for start, end in zip(self.starts, self.ends, strict=True):
            if end < cursor:
                continue
            if start >= high:
                break
            if start > cursor:
                out.append([cursor, start - 1])
            cursor = end + 1
        if cursor < high:
            out.append([cursor, high - 1])
        return out
