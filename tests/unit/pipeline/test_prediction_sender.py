"""PredictionSender (pipeline/predictions.py) with a fake producer and a fake clock: each step's
predictions go out together, in order, counted once acknowledged; a step never waits for the
broker, only for room; a failed write stops the next put or flush."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from edgestream.pipeline.predictions import PredictionSender
from edgestream.streams.predictions import Scored, decode, top_k
from edgestream.streams.records import RecordBatch, with_origin


def scored(device: str, n: int, start: int = 0) -> Scored:
    batch = with_origin(RecordBatch(device=device, seq=np.arange(start, start + n, dtype=np.uint64),
                                    event_time=np.full(n, 10.0), features=np.zeros((n, 2), np.float32)),
                        0, np.arange(start, start + n), 11.0)
    classes, probs = top_k(np.tile(np.array([0.25, 0.75], np.float32), (n, 1)), 3)
    return Scored.of(batch, f"sensors.{device}", version=1, digest="0" * 64, classes=classes,
                     probabilities=probs, predicted_at=12.0)


class FakeProducer:
    """Takes each step's messages at once, as one batch; acknowledges a batch when the test says
    (``release``), or fails it."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes]] = []
        self.calls = 0
        self.acks: list[asyncio.Future] = []
        self.fail: Exception | None = None

    async def send(self, topic: str, messages: list[tuple[bytes, bytes]]) -> list[asyncio.Future]:
        self.calls += 1
        self.sent += [(topic, key, value) for key, value in messages]
        ack = asyncio.get_running_loop().create_future()
        if self.fail is not None:
            ack.set_exception(self.fail)
        self.acks.append(ack)
        return [ack]

    def release(self) -> None:
        for ack in self.acks:
            if not ack.done():
                ack.set_result(None)


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(producer: FakeProducer, clock: FakeClock, **kwargs) -> tuple[PredictionSender, list]:
    seen: list[tuple[str, int]] = []
    sender = PredictionSender(producer.send, topic="predictions.j", job="j", worker="w0", clock=clock,
                              on_published=lambda device, n: seen.append((device, n)), **kwargs)
    return sender, seen


async def until(predicate) -> None:
    """Let the sender's task run until ``predicate()`` holds (bounded: a hang fails the test)."""
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("the sender's task did not get there")


def test_a_step_is_published_together_in_order_and_counted_once_acknowledged():
    async def scenario():
        producer, clock = FakeProducer(), FakeClock(20.0)
        sender, seen = make(producer, clock, published={"a": 5})
        await sender.put([scored("a", 2), scored("b", 1)])  # returns before any acknowledgement
        await until(lambda: len(producer.sent) == 3)
        assert producer.calls == 1  # the step's messages, handed over together
        assert sender.published == {"a": 5} and seen == []  # sent, not acknowledged yet
        clock.now = 99.0  # after the messages went out: not their publish time
        producer.release()
        await sender.flush()
        assert sender.published == {"a": 7, "b": 1} and sender.total == 8 and seen == [("a", 2), ("b", 1)]
        decoded = [decode(value) for _, _, value in producer.sent]
        assert [(p.device, p.record_id) for p in decoded] == [("a", 0), ("a", 1), ("b", 0)]
        assert [key for _, key, _ in producer.sent] == [b"a", b"a", b"b"]
        assert {topic for topic, _, _ in producer.sent} == {"predictions.j"}
        assert {p.published_at for p in decoded} == {20.0}
        assert decoded[0].latency_event_s == 10.0 and decoded[0].latency_append_s == 9.0
        await sender.close()

    asyncio.run(scenario())


def test_steps_keep_their_order_and_a_full_queue_makes_the_next_step_wait():
    async def scenario():
        producer, clock = FakeProducer(), FakeClock(13.0)
        sender, _ = make(producer, clock, depth=2)
        for i in range(3):  # the first is taken by the task (waiting for its acks), two fill the queue
            await sender.put([scored("a", 1, start=i)])
        fourth = asyncio.ensure_future(sender.put([scored("a", 1, start=3)]))
        await until(lambda: len(producer.sent) == 1)
        assert not fourth.done()  # no room: the step waits (backpressure), nothing is dropped
        while len(producer.sent) < 4 or not all(a.done() for a in producer.acks):
            producer.release()
            await asyncio.sleep(0)
        await fourth
        await sender.flush()
        assert [decode(v).record_id for _, _, v in producer.sent] == [0, 1, 2, 3]
        assert sender.published == {"a": 4} and sender.batches == 4
        await sender.close()

    asyncio.run(scenario())


def test_an_empty_step_sends_nothing_and_flush_without_puts_returns():
    async def scenario():
        producer = FakeProducer()
        sender, seen = make(producer, FakeClock(13.0))
        await sender.put([scored("a", 0)])
        await sender.flush()
        assert producer.sent == [] and seen == [] and sender.total == 0

    asyncio.run(scenario())


def test_a_failed_write_is_raised_by_the_next_flush_and_put_and_not_counted():
    async def scenario():
        producer = FakeProducer()
        producer.fail = OSError("broker gone")
        sender, seen = make(producer, FakeClock(13.0))
        await sender.put([scored("a", 2)])
        with pytest.raises(RuntimeError, match="publishing predictions to predictions.j failed: broker gone"):
            await sender.flush()
        with pytest.raises(RuntimeError, match="broker gone"):
            await sender.put([scored("a", 1)])
        assert sender.published == {} and seen == []
        await sender.close()

    asyncio.run(scenario())
