"""The simulator's stop: a bounded flush and a producer close that never outlives it."""

from __future__ import annotations

from kafka.errors import KafkaTimeoutError

from edgestream.pipeline.simulate import _close, _flush


class FakeSender:
    def __init__(self, producer: FakeProducer) -> None:
        self.producer = producer
        self.forced = False

    def force_close(self):  # fails the pending batches: a flush after it returns
        self.forced = True
        self.producer.acknowledges = True


class FakeProducer:
    def __init__(self, acknowledges: bool) -> None:
        self.acknowledges = acknowledges
        self.flushes: list[float | None] = []
        self.closes: list[float | None] = []
        self._sender = FakeSender(self)

    def flush(self, timeout=None):
        self.flushes.append(timeout)
        if not self.acknowledges:
            raise KafkaTimeoutError("Timeout waiting for future")

    def close(self, timeout=None):
        self.closes.append(timeout)
        self.flush(timeout)  # kafka-python's close flushes first, raising on a timeout


def test_a_flush_that_runs_out_says_so_and_the_close_does_not_wait():
    prod = FakeProducer(acknowledges=False)
    assert _flush(prod, 3.0) is False and prod.flushes == [3.0]
    _close(prod, flushed=False)
    assert prod._sender.forced and prod.closes == [2.0]


def test_an_acknowledged_flush_closes_without_a_bound():
    prod = FakeProducer(acknowledges=True)
    assert _flush(prod, None) is True
    _close(prod, flushed=True)
    assert not prod._sender.forced and prod.closes == [None]
