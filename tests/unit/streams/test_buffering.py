"""StreamBuffer policies: persistence, truncation (counted), backpressure, token release."""

from __future__ import annotations

import numpy as np
import pytest

from edgestream.streams.buffering import StreamBuffer, concat
from edgestream.streams.records import RecordBatch


def chunk(start: int, n: int, device="d") -> RecordBatch:
    return RecordBatch(
        device=device,
        seq=np.arange(start, start + n, dtype=np.uint64),
        event_time=np.zeros(n),
        features=np.arange(start, start + n, dtype=np.float32).reshape(n, 1),
        labels=np.zeros(n, dtype=np.int32),
    )


def seqs(parts) -> list[int]:
    return [int(s) for p in parts for s in p.seq]


def test_take_is_fifo_across_chunks_and_names_the_chunk_of_every_part():
    buf = StreamBuffer("d", capacity=100)
    buf.push(chunk(0, 3), "m0")
    buf.push(chunk(3, 3), "m1")
    taken = buf.take(4)
    assert seqs(taken.parts) == [0, 1, 2, 3]
    assert taken.sources == [("m0", 3), ("m1", 1)]  # m1 still has records inside
    taken = buf.take(10)
    assert seqs(taken.parts) == [4, 5] and taken.sources == [("m1", 2)]
    assert buf.depth == 0


def test_truncate_drops_oldest_and_counts():
    buf = StreamBuffer("d", capacity=5, policy="truncate")
    buf.push(chunk(0, 3), "m0")
    result = buf.push(chunk(3, 4), "m1")
    assert result.dropped == 2 and result.sources == [("m0", 2)]
    assert buf.depth == 5 and buf.dropped_total == 2
    assert seqs(buf.take(5).parts) == [2, 3, 4, 5, 6]


def test_truncate_reports_the_chunks_it_dropped_from():
    buf = StreamBuffer("d", capacity=2, policy="truncate")
    buf.push(chunk(0, 2), "m0")
    result = buf.push(chunk(2, 2), "m1")
    assert result.dropped == 2 and result.sources == [("m0", 2)]
    assert not buf.pause_needed()  # truncate never pauses


@pytest.mark.parametrize("policy, pause_at", [("backpressure", 10), ("persist", 40)])
def test_pausing_policies_never_drop_and_pause_then_resume(policy, pause_at):
    buf = StreamBuffer("d", capacity=10, policy=policy, hard_limit_factor=4)
    pushed = 0
    while not buf.pause_needed():
        assert buf.push(chunk(pushed, 5), pushed).dropped == 0
        pushed += 5
    assert buf.depth == pause_at and buf.paused
    assert not buf.pause_needed()  # asks once
    buf.push(chunk(pushed, 5), "in-flight")  # fetched before the pause took effect: kept
    assert buf.depth == pause_at + 5 and buf.dropped_total == 0
    buf.take(buf.depth - 6)
    assert not buf.resume_needed()
    buf.take(1)
    assert buf.resume_needed() and not buf.paused


@pytest.mark.parametrize("policy, pause_at", [("backpressure", 10), ("persist", 40)])
def test_would_pause_foresees_the_push_that_reaches_the_threshold(policy, pause_at):
    buf = StreamBuffer("d", capacity=10, policy=policy, hard_limit_factor=4)
    buf.push(chunk(0, 3), "m0")
    assert not buf.would_pause(pause_at - 4) and buf.would_pause(pause_at - 3)
    buf.push(chunk(3, pause_at - 3), "m1")
    assert buf.pause_needed()  # what would_pause foresaw


def test_truncate_never_would_pause():
    assert not StreamBuffer("d", capacity=2, policy="truncate").would_pause(1000)


def test_invariant_depth_equals_pushed_minus_taken_minus_dropped():
    rng = np.random.default_rng(1)
    buf = StreamBuffer("d", capacity=17, policy="truncate")
    n = 0
    for _ in range(200):
        k = int(rng.integers(1, 9))
        buf.push(chunk(n, k), n)
        n += k
        if rng.random() < 0.5:
            buf.take(int(rng.integers(1, 12)))
        assert buf.depth == buf.pushed_total - buf.taken_total - buf.dropped_total
        assert buf.depth <= 17


def test_concat_joins_parts_in_order():
    buf = StreamBuffer("d", capacity=100)
    buf.push(chunk(0, 2))
    buf.push(chunk(2, 2))
    joined = concat(buf.take(3).parts)
    assert joined.features[:, 0].tolist() == [0.0, 1.0, 2.0]


def test_rejects_unknown_policy():
    with pytest.raises(ValueError, match="unknown buffer policy"):
        StreamBuffer("d", 10, "lossy")
