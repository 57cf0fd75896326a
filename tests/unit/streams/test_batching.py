"""AdaptiveBatcher: window mode (ScaDLES) and fixed mode (baseline), on a fake clock."""

from __future__ import annotations

import pytest

from streams.batching import AdaptiveBatcher, Batch, BatchQueue, split_batch
from streams.buffering import StreamBuffer
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
