"""AdaptiveBatcher: window mode (ScaDLES) and fixed mode (baseline), on a fake clock."""

from __future__ import annotations

import pytest

from edgestream.streams.batching import AdaptiveBatcher, Batch, BatchQueue, split_batch
from edgestream.streams.buffering import StreamBuffer
from tests.unit.streams.test_buffering import chunk


def make(mode="window", **kw):
    buf = StreamBuffer("d", capacity=10_000)
    return buf, AdaptiveBatcher(buf, mode, start=0.0, **kw)


def test_window_emits_what_arrived_once_per_window():
    buf, b = make(window_s=1.0, max_batch=64)
    buf.push(chunk(0, 10), "m0")
    assert b.poll(0.99) == []
    (batch,) = b.poll(1.0)
    assert batch.size == 10 and batch.sources == [("m0", 10)]
    assert b.poll(1.5) == [] and b.poll(2.0) == []  # empty window: nothing


def test_window_caps_at_max_batch_and_persists_excess():
    buf, b = make(window_s=1.0, max_batch=8)
    buf.push(chunk(0, 20))
    assert [x.size for x in b.poll(1.0)] == [8]
    assert buf.depth == 12
    assert [x.size for x in b.poll(2.0)] == [8]
    assert [x.size for x in b.poll(3.0)] == [4]
    assert b.window_dropped_total == 0


def test_window_truncation_drops_excess_and_counts():
    buf, b = make(window_s=1.0, max_batch=8, window_overflow="truncate")
    buf.push(chunk(0, 20), "m0")
    (batch,) = b.poll(1.0)
    assert batch.size == 8 and [int(s) for s in batch.records.seq] == list(range(8))
    assert buf.depth == 0 and b.window_dropped_total == 12
    (drop,) = b.take_drops()
    assert drop.dropped == 12 and drop.sources == [("m0", 12)]


def test_bursts_stay_capped_per_window_even_after_a_stalled_poll():
    buf, b = make(window_s=0.5, max_batch=4)
    buf.push(chunk(0, 30))  # a burst
    batches = b.poll(2.0)  # four windows elapsed while the loop was stalled
    assert [x.size for x in batches] == [4, 4, 4, 4]
    assert b.seconds_to_next_window(2.0) == pytest.approx(0.5)


def test_fixed_mode_waits_for_exactly_batch_size():
    buf, b = make("fixed", batch_size=5)
    buf.push(chunk(0, 4))
    assert b.on_arrival(0.1) == [] and b.poll(100.0) == []
    buf.push(chunk(4, 7))
    out = b.on_arrival(0.2)
    assert [x.size for x in out] == [5, 5] and buf.depth == 1


def test_flush_emits_the_remainder():
    buf, b = make("fixed", batch_size=5)
    buf.push(chunk(0, 3))
    assert b.flush(1.0).size == 3 and b.flush(1.0) is None


def test_every_record_is_batched_or_counted_as_dropped():
    buf, b = make(window_s=1.0, max_batch=7, window_overflow="truncate")
    total = 0
    for t in range(1, 50):
        buf.push(chunk(total, t % 13))
        total += t % 13
        b.poll(float(t))
    b.poll(100.0)
    assert b.batched_records_total + b.window_dropped_total == total


@pytest.mark.parametrize("kwargs", [{"mode": "adaptive"}, {"window_overflow": "spill"}, {"window_s": 0}])
def test_rejects_bad_settings(kwargs):
    buf = StreamBuffer("d", 10)
    mode = kwargs.pop("mode", "window")
    with pytest.raises(ValueError):
        AdaptiveBatcher(buf, mode, **kwargs)


def _batch(device: str, start: int, n: int, token: str, created: float = 0.0) -> Batch:
    return Batch(device, chunk(start, n), created, [(token, n)])


def test_split_batch_divides_records_and_sources():
    batch = Batch("d", chunk(0, 10), 1.0, [("m0", 3), ("m1", 5), ("m2", 2)])

    head, tail = split_batch(batch, 4)

    assert head.records.seq.tolist() == [0, 1, 2, 3] and head.sources == [("m0", 3), ("m1", 1)]
    assert tail.records.seq.tolist() == list(range(4, 10)) and tail.sources == [("m1", 4), ("m2", 2)]
    with pytest.raises(ValueError):
        split_batch(batch, 10)


def test_fixed_queue_takes_exactly_one_batch_whatever_the_limit():
    queue = BatchQueue("fixed")
    queue.put(_batch("a", 0, 64, "a0"))
    queue.put(_batch("b", 0, 64, "b0"))

    assert [b.device for b in queue.take(1000)] == ["a"] and queue.records == 64
    assert [b.device for b in queue.take(1)] == ["b"] and queue.records == 0
    assert queue.take(10) == []


def test_window_queue_fills_up_to_the_limit_and_splits_the_batch_that_does_not_fit():
    queue = BatchQueue("window")
    for i, device in enumerate("abc"):
        queue.put(_batch(device, 0, 100, f"{device}0", created=i))

    step = queue.take(256)

    assert [(b.device, b.size) for b in step] == [("a", 100), ("b", 100), ("c", 56)]
    assert step[2].sources == [("c0", 56)]
    assert queue.records == 44 and len(queue) == 1
    (rest,) = queue.take(256)
    assert rest.records.seq.tolist() == list(range(56, 100)) and rest.sources == [("c0", 44)]


def test_select_keeps_the_chosen_records_and_the_share_of_each_source():
    batch = Batch("d", chunk(0, 10), 0.0, [("a", 4), ("b", 6)])

    picked = batch.select([1, 3, 5])
    rest = batch.select([0, 2, 4, 6, 7, 8, 9])

    assert [int(s) for s in picked.records.seq] == [1, 3, 5]
    assert picked.sources == [("a", 2), ("b", 1)] and rest.sources == [("a", 2), ("b", 5)]
    assert picked.size + rest.size == batch.size and picked.device == "d"
    assert batch.select(range(10)) is batch


# --- widening the window cap (batcher.max_batch_widen) ------------------------------------


def _overload(buf, b, rate_per_window: int, windows: int, t0: float = 0.0, start_seq: int = 0):
    """``rate_per_window`` records arrive in each of ``windows`` windows of 1 s; returns the
    sizes emitted and the cap after each window."""
    sizes, caps = [], []
    for w in range(windows):
        buf.push(chunk(start_seq + w * rate_per_window, rate_per_window))
        sizes += [x.size for x in b.poll(t0 + w + 1.0)]
        caps.append(b.batch_cap)
    return sizes, caps


def test_cap_widens_under_sustained_overload_and_never_beyond_the_bound():
    buf, b = make(window_s=1.0, max_batch=8, max_batch_widen=40)

    sizes, caps = _overload(buf, b, rate_per_window=100, windows=12)

    assert caps[:2] == [8, 16]  # two windows left records behind: doubled
    assert max(caps) == 40 and caps[-1] == 40  # 8 -> 16 -> 32 -> 40, the bound
    assert max(sizes) == 40 and all(s <= c for s, c in zip(sizes, [8, *caps[:-1]], strict=True))
    assert b.window_records == 40 and b.capacity_hz == 40.0
    assert b.backlog(buf.depth) == buf.depth - 40 > 0  # 100/s against 40/s: the backlog grows


def test_moderate_overload_is_kept_up_with_once_widened():
    buf, b = make(window_s=1.0, max_batch=8, max_batch_widen=64)

    sizes, caps = _overload(buf, b, rate_per_window=20, windows=10)

    assert caps[-1] == 32 and sizes[-1] == 20  # the whole window's arrivals in one batch
    assert buf.depth == 0 and b.backlog(buf.depth) == 0
    assert sum(sizes) == 200


def test_cap_shrinks_back_once_arrivals_fit_again():
    buf, b = make(window_s=1.0, max_batch=8, max_batch_widen=64)
    _overload(buf, b, rate_per_window=100, windows=8)
    assert b.batch_cap == 64
    buf.drop_oldest(buf.depth)  # the backlog is gone (kept out of the assertion below)

    _, caps = _overload(buf, b, rate_per_window=3, windows=6, t0=8.0, start_seq=10_000)

    assert caps[:4] == [32, 16, 8, 8] and caps[-1] == 8  # halving, down to max_batch


def test_one_burst_does_not_widen_the_cap():
    buf, b = make(window_s=1.0, max_batch=8, max_batch_widen=64)
    buf.push(chunk(0, 12))

    assert [x.size for x in b.poll(1.0)] == [8] and b.batch_cap == 8
    assert [x.size for x in b.poll(2.0)] == [4] and b.batch_cap == 8


def test_without_a_widen_bound_the_cap_stays_at_max_batch():
    buf, b = make(window_s=1.0, max_batch=8)

    sizes, caps = _overload(buf, b, rate_per_window=20, windows=10)

    assert set(caps) == {8} and set(sizes) == {8}
    assert b.window_records == 8 and b.backlog(buf.depth) == buf.depth - 8 == 112


def test_widened_truncation_drops_only_beyond_the_widened_cap():
    buf, b = make(window_s=1.0, max_batch=8, max_batch_widen=16, window_overflow="truncate")

    sizes, _ = _overload(buf, b, rate_per_window=20, windows=4)

    assert sizes == [8, 8, 16, 16] and b.window_dropped_total == 12 + 12 + 4 + 4
    assert b.batched_records_total + b.window_dropped_total == 80


def test_fixed_mode_backlog_is_beyond_one_batch():
    buf, b = make("fixed", batch_size=5)
    assert b.window_records == 5 and b.backlog(4) == 0 and b.backlog(12) == 7


def test_a_widen_bound_below_max_batch_is_refused():
    with pytest.raises(ValueError, match="max_batch_widen"):
        AdaptiveBatcher(StreamBuffer("d", 10), "window", max_batch=64, max_batch_widen=32)
