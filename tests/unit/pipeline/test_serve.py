"""``edgestream serve``'s pure parts: the predicting sink's micro-batches, swaps and ack order
(a fake producer and a fake clock), its arguments and its ingest settings."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from edgestream.job.config import load_config
from edgestream.pipeline.serve import (
    PredictingSink,
    ServeRefused,
    check_serve_args,
    serve_ingest_config,
)
from edgestream.streams.batching import Batch
from edgestream.streams.predictions import decode
from edgestream.streams.records import RecordBatch, with_origin
from edgestream.trainers.serving import ModelId


class FakeModel:
    """A model that predicts class ``version % 10`` for every record."""

    def __init__(self, version: int) -> None:
        self.ident = ModelId(version, f"{version:064x}", "test")


class FakeProducer:
    """Keeps what it is sent; each send's acknowledgement resolves only when the test says."""

    def __init__(self) -> None:
        self.sent: list[list[tuple[bytes, bytes]]] = []
        self.acks: list[asyncio.Future] = []

    async def send(self, topic: str, messages: list[tuple[bytes, bytes]]) -> list[asyncio.Future]:
        ack = asyncio.get_running_loop().create_future()
        self.sent.append(messages)
        self.acks.append(ack)
        return [ack]

    def ack_all(self) -> None:
        for ack in self.acks:
            if not ack.done():
                ack.set_result(None)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


PASSES: list[int] = []


async def fake_predict(model: FakeModel, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    PASSES.append(len(features))
    classes = np.full((len(features), 2), model.ident.version % 10, dtype=np.int64)
    classes[:, 1] = (classes[:, 0] + 1) % 10
    return classes, np.tile(np.array([[0.75, 0.25]]), (len(features), 1))


def batch_of(device: str, first_offset: int, n: int) -> Batch:
    records = RecordBatch(device=device, seq=np.arange(first_offset, first_offset + n, dtype=np.uint64),
                          event_time=np.full(n, 999.0), features=np.zeros((n, 4), dtype=np.float32),
                          labels=None)
    records = with_origin(records, 0, np.arange(first_offset, first_offset + n), np.full(n, 999.5))
    return Batch(device, records, created_at=0.0, sources=[(f"{device}@{first_offset}", n)])


def sink_of(producer: FakeProducer, settled: list[Batch], max_batch: int = 8) -> PredictingSink:
    sink = PredictingSink(predict=fake_predict, send=producer.send, topic="predictions.j", job="j", worker="s0",
                          top_k=2, max_batch=max_batch, topic_of=lambda d: f"sensors.{d}", clock=Clock())

    async def settle(batch: Batch) -> None:
        settled.append(batch)

    sink.settle = settle
    return sink


def run(coro):
    return asyncio.run(coro)


def test_a_batch_is_settled_only_after_its_predictions_are_acknowledged():
    async def scenario():
        producer, settled = FakeProducer(), []
        sink = sink_of(producer, settled)
        sink.offer(FakeModel(3))
        await sink.submit(batch_of("a", 0, 5))
        step = asyncio.ensure_future(sink.step())
        while not producer.sent:
            await asyncio.sleep(0)
        for _ in range(5):
            await asyncio.sleep(0)
        assert settled == [] and not step.done()  # sent, not acknowledged: nothing settled
        producer.ack_all()
        assert await step == 5
        return producer, settled, sink

    producer, settled, sink = run(scenario())
    assert [b.records.seq.tolist() for b in settled] == [[0, 1, 2, 3, 4]]
    predictions = [decode(value) for _, value in producer.sent[0]]
    assert [(p.device, p.topic, p.partition, p.offset, p.record_id) for p in predictions] == \
        [("a", "sensors.a", 0, i, i) for i in range(5)]
    assert {(p.worker, p.at, p.model_version, p.predicted) for p in predictions} == {("s0", "serve", 3, 3)}
    assert sink.published == {"a": 5}


def test_micro_batches_take_whole_batches_up_to_max_batch_in_order():
    async def scenario():
        producer, settled = FakeProducer(), []
        sink = sink_of(producer, settled, max_batch=8)
        sink.offer(FakeModel(1))
        for i, n in enumerate((3, 4, 5, 20)):
            await sink.submit(batch_of(f"d{i}", 0, n))
        sizes = []
        while sink.queued_records:
            step = asyncio.ensure_future(sink.step())
            while len(producer.sent) == len(sizes):
                await asyncio.sleep(0)
            producer.ack_all()
            sizes.append(await step)
        return sizes, settled

    PASSES.clear()
    sizes, settled = run(scenario())
    assert sizes == [7, 5, 20]  # 3+4 fit in 8, 5 alone, a batch above max_batch is taken alone ...
    assert PASSES == [7, 5, 20]  # ... and each micro-batch predicted in one call (the model chunks it)
    assert [b.device for b in settled] == ["d0", "d1", "d2", "d3"]


def test_a_model_offered_mid_batch_predicts_from_the_next_micro_batch_only():
    async def scenario():
        producer, settled = FakeProducer(), []
        sink = sink_of(producer, settled, max_batch=4)
        sink.offer(FakeModel(5))
        await sink.submit(batch_of("a", 0, 4))
        await sink.submit(batch_of("a", 4, 4))
        first = asyncio.ensure_future(sink.step())
        while not producer.sent:
            await asyncio.sleep(0)
        sink.offer(FakeModel(6))  # arrives while the first micro-batch waits for its acks
        producer.ack_all()
        await first
        second = asyncio.ensure_future(sink.step())
        while len(producer.sent) < 2:
            await asyncio.sleep(0)
        producer.ack_all()
        await second
        return producer, sink

    producer, sink = run(scenario())
    versions = [{decode(v).model_version for _, v in sent} for sent in producer.sent]
    assert versions == [{5}, {6}]  # each micro-batch by exactly one model
    assert sink.swaps == 1 and [(a, b) for a, b, _ in sink.swap_log] == [(None, 5), (5, 6)]


def test_drain_returns_once_everything_submitted_is_settled():
    async def scenario():
        producer, settled = FakeProducer(), []
        sink = sink_of(producer, settled, max_batch=4)
        sink.offer(FakeModel(1))
        runner = asyncio.ensure_future(sink.run())
        for i in range(3):
            await sink.submit(batch_of("a", 4 * i, 4))
        drained = asyncio.ensure_future(sink.drain())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not drained.done() and len(producer.sent) == 1  # the first micro-batch waits for its acks
        await ack_until_drained(producer, drained)
        runner.cancel()
        return settled

    settled = run(scenario())
    assert [b.records.seq[0] for b in settled] == [0, 4, 8]


def test_a_failed_write_settles_nothing_and_raises():
    async def scenario():
        producer, settled = FakeProducer(), []
        sink = sink_of(producer, settled)
        sink.offer(FakeModel(1))
        await sink.submit(batch_of("a", 0, 3))
        step = asyncio.ensure_future(sink.step())
        while not producer.sent:
            await asyncio.sleep(0)
        producer.acks[0].set_exception(RuntimeError("broker said no"))
        with pytest.raises(RuntimeError, match="broker said no"):
            await step
        return settled, sink

    settled, sink = run(scenario())
    assert settled == [] and sink.published == {}


async def until(condition, turns: int = 1000) -> None:
    """Let the event loop run until ``condition()`` holds (a bounded number of turns)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def filled_sink(version: int, batches: int) -> tuple[FakeProducer, list, PredictingSink]:
    """A sink of 4-record micro-batches holding model ``version`` and ``batches`` 4-record batches
    of device ``a`` (seq 0, 4, 8 ...), its pipeline (``run``) not started yet."""
    producer, settled = FakeProducer(), []
    sink = sink_of(producer, settled, max_batch=4)
    sink.offer(FakeModel(version))
    for i in range(batches):
        await sink.submit(batch_of("a", 4 * i, 4))
    return producer, settled, sink


async def ack_until_drained(producer: FakeProducer, drained: asyncio.Future) -> None:
    """Acknowledge every write the sink makes until its ``drain`` returned."""
    while not drained.done():
        producer.ack_all()
        await asyncio.sleep(0)


def test_run_predicts_the_next_micro_batch_while_the_previous_waits_for_its_acks():
    async def scenario():
        producer, settled, sink = await filled_sink(1, 3)
        runner = asyncio.ensure_future(sink.run())
        await until(lambda: len(producer.sent) == 1 and len(PASSES) == 2)
        for _ in range(20):
            await asyncio.sleep(0)
        # The second micro-batch is predicted, not sent before the first is acknowledged; the
        # third is not taken (one micro-batch in flight at most).
        assert len(producer.sent) == 1 and PASSES == [4, 4] and settled == [] and sink.queued_records == 12
        producer.ack_all()
        await until(lambda: len(producer.sent) == 2 and len(PASSES) == 3)
        assert [b.records.seq[0] for b in settled] == [0] and len(producer.sent) == 2
        await ack_until_drained(producer, asyncio.ensure_future(sink.drain()))
        runner.cancel()
        return producer, settled, sink

    PASSES.clear()
    producer, settled, sink = run(scenario())
    assert [b.records.seq[0] for b in settled] == [0, 4, 8] and sink.micro_batches == 3
    ids = [decode(v).record_id for sent in producer.sent for _, v in sent]
    assert ids == list(range(12))  # each record once, in order


def test_a_swap_while_the_pipeline_is_full_predicts_each_record_once_each_micro_batch_by_one_model():
    async def scenario():
        producer, settled, sink = await filled_sink(5, 4)
        runner = asyncio.ensure_future(sink.run())
        await until(lambda: len(producer.sent) == 1 and len(PASSES) == 2)
        sink.offer(FakeModel(6))  # the first micro-batch waits for its acks, the second is predicted (5)
        await ack_until_drained(producer, asyncio.ensure_future(sink.drain()))
        runner.cancel()
        return producer, settled, sink

    PASSES.clear()
    producer, settled, sink = run(scenario())
    versions = [{decode(v).model_version for _, v in sent} for sent in producer.sent]
    assert versions == [{5}, {5}, {6}, {6}]
    ids = [decode(v).record_id for sent in producer.sent for _, v in sent]
    assert ids == list(range(16)) and len(settled) == 4
    assert [(a, b) for a, b, _ in sink.swap_log] == [(None, 5), (5, 6)]


def test_a_failed_write_in_the_pipeline_settles_nothing_after_it_and_raises():
    async def scenario():
        producer, settled, sink = await filled_sink(1, 2)
        runner = asyncio.ensure_future(sink.run())
        await until(lambda: len(producer.sent) == 1 and len(PASSES) == 2)
        producer.acks[0].set_exception(RuntimeError("broker said no"))
        with pytest.raises(RuntimeError, match="broker said no"):
            await runner
        return producer, settled, sink

    PASSES.clear()
    producer, settled, sink = run(scenario())
    assert settled == [] and sink.published == {} and len(producer.sent) == 1  # the predicted one never sent


def test_the_latency_histogram_counts_each_acknowledged_record_once():
    from edgestream.monitoring.metrics import Metrics

    async def scenario():
        producer, settled = FakeProducer(), []
        sink = sink_of(producer, settled, max_batch=8)
        sink.metrics = Metrics()
        sink.offer(FakeModel(1))
        await sink.submit(batch_of("a", 0, 5))
        await sink.submit(batch_of("b", 0, 3))
        step = asyncio.ensure_future(sink.step())
        await until(lambda: bool(producer.sent))
        producer.ack_all()
        await step
        return sink.metrics

    metrics = run(scenario())
    assert metrics.serve_latency._sum.get() > 0
    assert sum(b.get() for b in metrics.serve_latency._buckets) == 8
    assert metrics.serve_predictions.labels("a")._value.get() == 5


def cfg_of(*overrides: str):
    return load_config(overrides=["job.name=shop", "train.enabled=true", "workers.count=2", *overrides], env={})


@pytest.mark.parametrize(("overrides", "args", "message"), [
    ((), ("w0", "checkpoints", None, None), "is a process of the training job"),
    ((), ("s 0", "checkpoints", None, None), "--name 's 0'"),
    ((), ("s0", "models", None, None), "train.strategy='bsp' has no server: use --model-from checkpoints"),
    ((), ("s0", "export", None, None), "--model-from export needs --export-dir"),
    ((), ("s0", "checkpoints", "w7", None), "--worker 'w7': the job's processes with checkpoints are w0, w1"),
    ((), ("s0", "models", "w0", None), "has no server"),
    (("train.strategy=asp",), ("s0", "models", "w0", None), "--worker names the process whose checkpoints"),
    ((), ("s0", "checkpoints", None, Path("x")), "--export-dir is read with --model-from export only"),
])
def test_bad_arguments_are_refused_with_what_to_do(overrides, args, message):
    with pytest.raises(ServeRefused, match=message.replace("(", r"\(").replace("[", r"\[")):
        check_serve_args(cfg_of(*overrides), *args)


def test_the_default_checkpoints_are_the_servers_or_the_first_workers():
    assert check_serve_args(cfg_of(), "s0", "checkpoints", None, None) == ("checkpoints", "w0")
    assert check_serve_args(cfg_of("train.strategy=asp"), "s0", "checkpoints", None, None) == ("checkpoints",
                                                                                              "server")
    assert check_serve_args(cfg_of("train.strategy=asp"), "s0", "models", None, None) == ("models", None)


def test_serve_ingest_drops_nothing_and_batches_by_the_serve_settings():
    cfg = cfg_of("buffer.policy=truncate", "batcher.window_overflow=truncate", "batcher.mode=fixed",
                 "serve.max_batch=32", "serve.max_wait_s=0.02", "labels.topic=labels.shop")
    served = serve_ingest_config(cfg)
    assert served.buffer.policy == "backpressure"
    assert (served.batcher.mode, served.batcher.window_s, served.batcher.max_batch,
            served.batcher.window_overflow) == ("window", 0.02, 32, "persist")
    assert served.labels.topic == "" and served.serve.predictions
    assert cfg.buffer.policy == "truncate" and cfg.batcher.mode == "fixed"  # the job's own is untouched
