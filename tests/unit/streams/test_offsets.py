"""OffsetTracker: the watermark never passes a message that is seen but not resolved."""

from __future__ import annotations

import numpy as np
import pytest

from edgestream.streams.offsets import OffsetTracker

KEY = "sensors.dev00:0"


def test_watermark_waits_for_the_oldest_open_message():
    t = OffsetTracker()
    for offset in range(3):
        t.seen(KEY, offset)
    t.resolved(KEY, 1)
    t.resolved(KEY, 2)
    assert t.watermark(KEY) == 0 and t.open_count(KEY) == 1
    t.resolved(KEY, 0)
    assert t.watermark(KEY) == 3 and t.open_count(KEY) == 0


def test_ranges_behave_like_their_offsets_one_by_one():
    rng = np.random.default_rng(5)
    singles, ranges = OffsetTracker({KEY: 0}), OffsetTracker({KEY: 0})
    open_ranges: list[tuple[int, int]] = []
    offset = 0
    for _ in range(400):
        if open_ranges and rng.random() < 0.5:
            first, last = open_ranges.pop(int(rng.integers(len(open_ranges))))
            for o in range(first, last + 1):
                singles.resolved(KEY, o)
            ranges.resolved_range(KEY, first, last)
        else:
            n = int(rng.integers(1, 6))
            first, last = offset, offset + n - 1
            offset += n
            if rng.random() < 0.1 and first > 3:  # a redelivery overlapping what was seen
                first -= 3
            for o in range(first, last + 1):
                singles.seen(KEY, o)
            ranges.seen_range(KEY, first, last)
            open_ranges.append((first, last))
        assert ranges.watermark(KEY) == singles.watermark(KEY)
        assert ranges.open_count(KEY) == singles.open_count(KEY)
    for first, last in open_ranges:
        ranges.resolved_range(KEY, first, last)
    assert ranges.watermark(KEY) == offset and ranges.open_count(KEY) == 0


def test_done_ranges_are_the_resolved_offsets_above_the_watermark():
    tracker = OffsetTracker()
    tracker.seen_range("t:0", 0, 9)
    for offset in (0, 1, 3, 4, 7):
        tracker.resolved("t:0", offset)
    assert tracker.watermark("t:0") == 2
    assert tracker.done_ranges() == {"t:0": [[3, 4], [7, 7]]}
    tracker.resolved_range("t:0", 2, 2)
    assert tracker.watermark("t:0") == 5 and tracker.done_ranges() == {"t:0": [[7, 7]]}


def test_restored_done_ranges_are_skipped_and_kept_until_read_again():
    tracker = OffsetTracker(start={"t:0": 10}, done={"t:0": [[12, 13], [20, 20]]})
    assert tracker.watermark("t:0") == 10
    assert [o for o in range(10, 22) if tracker.is_done("t:0", o)] == [12, 13, 20]
    assert tracker.has_done("t:0", 14, 25) and not tracker.has_done("t:0", 14, 19)
    assert not tracker.has_done("t:1", 0, 100)
    # Nothing read yet: a checkpoint taken now must still carry them.
    assert tracker.done_ranges() == {"t:0": [[12, 13], [20, 20]]}
    tracker.seen_range("t:0", 10, 13)
    tracker.resolved_range("t:0", 12, 13)
    assert tracker.done_ranges() == {"t:0": [[12, 13], [20, 20]]}


def test_watermark_open_count_and_done_ranges_match_a_set_of_offsets_under_random_traffic():
    """Ranges seen and resolved in any order, overlapping, re-seen after resolution and
    split in the middle: the tracker answers as a plain set of open offsets would."""
    rng = np.random.default_rng(17)
    tracker, opened, top = OffsetTracker({KEY: 0}), set(), -1
    resolved_above = 0  # one past the highest offset resolved (the watermark with nothing open)
    for _ in range(3000):
        first = int(rng.integers(max(0, top - 40), top + 8))
        last = first + int(rng.integers(0, 12))
        if rng.random() < 0.55:
            tracker.seen_range(KEY, first, last)
            opened.update(range(first, last + 1))
            top = max(top, last)
        else:
            tracker.resolved_range(KEY, first, last)
            opened.difference_update(range(first, last + 1))
            resolved_above = max(resolved_above, last + 1)
        mark = min(opened) if opened else resolved_above
        assert tracker.watermark(KEY) == mark
        assert tracker.open_count(KEY) == len(opened)
        gaps = [o for o in range(mark, resolved_above) if o not in opened]
        expected = []
        for o in gaps:
            if expected and expected[-1][1] == o - 1:
                expected[-1][1] = o
            else:
                expected.append([o, o])
        assert tracker.done_ranges().get(KEY, []) == expected


def test_split_key_inverts_key_and_refuses_what_is_not_one() -> None:
    for topic, partition in (("job.updates", 0), ("sensors.dev-1.x", 12)):
        assert OffsetTracker.split_key(OffsetTracker.key(topic, partition)) == (topic, partition)
    for bad in ("job.updates", "job.updates:", ":3", "job.updates:x"):
        with pytest.raises(ValueError, match="topic:partition"):
            OffsetTracker.split_key(bad)
