"""The worker app's ingest plumbing without a broker: the direct source's hot path, acks,
commits and backpressure against a fake consumer, and where sensor offsets live."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import pytest
from aiokafka import TopicPartition

from edgestream.job.config import ConfigError, load_config
from edgestream.monitoring.metrics import Metrics
from edgestream.pipeline.app import (
    CountingSink,
    DirectSensorSource,
    IngestDriver,
    SensorToken,
    app_id,
    offsets_by_group,
    sensor_group,
)
from edgestream.pipeline.ingest import IngestActions, IngestCore
from edgestream.streams import codec
from edgestream.streams.garbage import make_garbage
from edgestream.streams.offsets import OffsetTracker
from edgestream.streams.records import RecordBatch

DEVICE = "dev00"
TOPIC = f"sensors.{DEVICE}"
TP = TopicPartition(TOPIC, 0)


def message(start: int, n: int = 4) -> bytes:
    return codec.encode(RecordBatch(
        device=DEVICE, seq=np.arange(start, start + n, dtype=np.uint64), event_time=np.full(n, 100.0),
        features=np.ones((n, 4), dtype=np.float32), labels=np.zeros(n, dtype=np.int32),
    ))


@dataclass
class Record:
    """What ``getmany`` returns per message (the fields the source reads)."""

    offset: int
    value: bytes
    key: bytes | None = None
    timestamp: int = -1  # Kafka's "no timestamp": no event-time check (the messages' times are 100 s)


class FakeConsumer:
    """The aiokafka consumer calls the direct source makes, recorded."""

    def __init__(self) -> None:
        self.paused: set[TopicPartition] = set()
        self.resumed: list[TopicPartition] = []
        self.seeks: list[tuple[TopicPartition, int]] = []
        self.commits: list[dict[TopicPartition, int]] = []
        self.highwaters: dict[TopicPartition, int] = {}

    def pause(self, *tps: TopicPartition) -> None:
        self.paused.update(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.paused.difference_update(tps)
        self.resumed += tps

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits.append(dict(offsets))

    def highwater(self, tp: TopicPartition) -> int | None:
        return self.highwaters.get(tp)

    def last_stable_offset(self, tp: TopicPartition) -> int:
        return -1


class Harness:
    """A direct source wired to a real ``IngestCore``, a counting sink and a recorded DLQ."""

    def __init__(self, *overrides: str) -> None:
        cfg = load_config(overrides=["devices.count=1", f"devices.ids={DEVICE}", *overrides], env={})
        self.core = IngestCore(cfg, [DEVICE], Metrics(), start=0.0, expected_shape=(4,), num_classes=10)
        self.tracker = OffsetTracker()
        self.sink = CountingSink()
        self.letters: list[tuple[int, int]] = []  # (offset, open messages when it was sent)
        self.driver = IngestDriver(self.core, self.sink, self.tracker, self.send_dead_letter)
        self.source = DirectSensorSource(
            bootstrap="unused:9092", group_id="g-sensors", devices=[DEVICE], driver=self.driver,
            tracker=self.tracker, max_message_bytes=1 << 20, clock=lambda: 0.5,
        )
        self.consumer = FakeConsumer()
        self.source.consumer = self.consumer  # type: ignore[assignment]
        self.driver.source = self.source
        self.part = self.source.parts[TP]

    async def send_dead_letter(self, letter) -> None:
        self.letters.append((letter.offset, self.tracker.open_count(self.part.key)))

    async def fetched(self, records: list[Record]) -> None:
        await self.source._handle(self.part, records, now=0.5, wall_now=101.0)

    async def tick(self, now: float) -> None:
        await self.driver.perform(self.core.on_tick(now))


def run(coro):
    return asyncio.run(coro)


def test_every_message_reaches_the_core_and_is_acked_once_batched():
    async def scenario():
        h = Harness("batcher.mode=window", "batcher.window_s=1", "batcher.max_batch=100")
        await h.fetched([Record(i, message(4 * i)) for i in range(5)])
        assert h.part.handled == 4 and h.tracker.open_count(h.part.key) == 5  # buffered, not acked
        await h.tick(1.0)
        return h

    h = run(scenario())

    assert h.sink.records == {DEVICE: 20}
    assert h.tracker.open_count(h.part.key) == 0 and h.tracker.watermark(h.part.key) == 5
    assert h.consumer.seeks == [] and h.consumer.paused == set()


def test_pause_stops_at_the_message_and_the_rest_is_read_again_after_resume():
    async def scenario():
        h = Harness("batcher.mode=window", "batcher.window_s=1", "batcher.max_batch=100",
                    "buffer.policy=backpressure", "buffer.capacity=8")
        await h.fetched([Record(i, message(4 * i)) for i in range(6)])
        paused = (set(h.consumer.paused), list(h.consumer.seeks), h.part.handled)
        await h.tick(1.0)  # the window drains the buffer: the partition resumes
        return h, paused

    h, (paused, seeks, handled) = run(scenario())

    assert paused == {TP}
    assert handled == 1 and seeks == [(TP, 2)]  # offsets 2..5 were not handed to the core
    assert h.core.accounting()[DEVICE]["records_in"] == 8
    assert h.consumer.paused == set() and h.consumer.resumed == [TP]
    assert h.sink.records == {DEVICE: 8}


def test_dead_letter_is_written_before_its_offset_is_acked():
    async def scenario():
        h = Harness()
        await h.fetched([Record(0, make_garbage("nan", DEVICE, (4,)))])
        return h

    h = run(scenario())

    assert h.letters == [(0, 1)]  # still open while being written
    assert h.tracker.open_count(h.part.key) == 0 and h.tracker.watermark(h.part.key) == 1


def test_commits_the_watermark_only_when_it_moves_and_never_past_an_open_message():
    async def scenario():
        h = Harness("batcher.mode=window", "batcher.window_s=1", "batcher.max_batch=100")
        await h.fetched([Record(0, message(0)), Record(1, message(4))])
        await h.tick(1.0)
        await h.source.commit()
        await h.source.commit()  # nothing moved: no second commit
        # offset 2 stays buffered (open), offset 3 is dead-lettered (resolved)
        await h.fetched([Record(2, message(8)), Record(3, b"junk")])
        await h.source.commit()
        return h

    h = run(scenario())

    assert h.consumer.commits == [{TP: 2}]
    assert h.tracker.watermark(h.part.key) == 2


def test_consumer_lag_counts_from_the_last_message_handled():
    async def scenario():
        h = Harness()
        before = h.source.consumer_lag()  # no fetch response yet: end offset unknown
        h.consumer.highwaters[TP] = 10
        h.part.start = 3
        at_start = h.source.consumer_lag()
        await h.fetched([Record(3, message(0)), Record(4, message(4))])
        return before, at_start, h.source.consumer_lag()

    before, at_start, after = run(scenario())

    assert before == {} and at_start == {DEVICE: 7} and after == {DEVICE: 5}


def test_tokens_are_small_and_name_their_messages():
    token = SensorToken(TOPIC, 0, 41, 44)
    assert (token.topic, token.partition, token.offset, token.last) == (TOPIC, 0, 41, 44)


def test_runs_of_good_messages_enter_as_one_chunk_and_a_bad_one_is_dead_lettered_alone():
    async def scenario():
        h = Harness("batcher.mode=window", "batcher.window_s=1", "batcher.max_batch=10000")
        records = [Record(i, message(4 * i)) for i in range(150)]
        records[100] = Record(100, make_garbage("nan", DEVICE, (4,)))
        await h.fetched(records)
        chunks = len(h.core.buffers[DEVICE]._chunks)
        await h.tick(1.0)
        return h, chunks

    h, chunks = run(scenario())

    # run 0-63: the first message validates the header, then one by one (the core had no
    # layout when the run began); run 64-127 holds the garbage: one by one; 128-149: one chunk.
    assert chunks == 64 + 63 + 1
    assert h.letters == [(100, 101)]  # written while 0..100 are open (0..99 buffered)
    assert h.sink.records == {DEVICE: 4 * 149}
    assert h.tracker.open_count(h.part.key) == 0 and h.tracker.watermark(h.part.key) == 150


def test_actions_are_falsy_when_there_is_nothing_to_do():
    assert not IngestActions()
    assert IngestActions(ack=["t"]) and IngestActions(pause=[DEVICE])


@pytest.mark.parametrize("source", ["direct", "faust"])
def test_sensor_offsets_belong_to_the_group_of_the_configured_source(source):
    cfg = load_config(overrides=[f"kafka.ingest_source={source}", "job.name=j"], env={})
    offsets = {"sensors.dev00:0": 12, "gradients.j:0": 7, "models.j:0": 3}

    groups = offsets_by_group(cfg, "w0", offsets)

    assert app_id(cfg, "w0") == "edgestream-j-w0"
    if source == "direct":
        assert sensor_group(cfg, "w0") == "edgestream-j-w0-sensors"
        assert groups == {"edgestream-j-w0-sensors": {"sensors.dev00:0": 12},
                          "edgestream-j-w0": {"gradients.j:0": 7, "models.j:0": 3}}
    else:
        assert sensor_group(cfg, "w0") == "edgestream-j-w0"
        assert groups == {"edgestream-j-w0": offsets}


def test_ingest_source_defaults_to_direct_and_rejects_unknown_values():
    assert load_config(env={}).kafka.ingest_source == "direct"
    with pytest.raises(ConfigError, match="kafka.ingest_source='kafka' is not one of direct, faust"):
        load_config(overrides=["kafka.ingest_source=kafka"], env={})


class DeferringSink:
    """A sink that, like the trainer, settles batches later (``defer_acks``)."""

    defer_acks = True

    def __init__(self) -> None:
        self.batches: list = []
        self.settle = None  # set by the driver
        self.ingest_snapshot = None

    async def submit(self, batch) -> None:
        self.batches.append(batch)


def test_a_deferring_sink_settles_and_only_then_the_offsets_resolve():
    async def scenario():
        h = Harness("batcher.mode=window", "batcher.window_s=1", "batcher.max_batch=100")
        sink = DeferringSink()
        h.driver = driver = IngestDriver(h.core, sink, h.tracker, h.send_dead_letter)
        h.source.driver = driver
        driver.source = h.source
        await h.fetched([Record(i, message(4 * i)) for i in range(3)])
        await h.tick(1.0)
        before = (h.tracker.watermark(h.part.key), driver.snapshot()["ledger"][DEVICE]["records_in"])
        (batch,) = sink.batches
        await sink.settle(batch, "dead", "gradient_norm")
        return h, driver, before

    h, driver, before = run(scenario())

    assert before == (0, 0)  # handed to the sink: nothing resolved, nothing in the resolved ledger
    snapshot = driver.snapshot()
    assert snapshot["sensors"] == {h.part.key: 3} and snapshot["sensors_done"] == {}
    assert snapshot["ledger"][DEVICE]["dead_records"] == 12
    assert snapshot["ledger"][DEVICE]["dead_records_by_reason"] == {"gradient_norm": 12}


def test_a_restored_worker_skips_messages_settled_before_its_checkpoint():
    async def scenario():
        h = Harness("batcher.mode=window", "batcher.window_s=1", "batcher.max_batch=100")
        # The checkpoint: resume at 2; offsets 3 and 5..6 were already settled (dead letters).
        h.tracker = OffsetTracker(start={h.part.key: 2}, done={h.part.key: [[3, 3], [5, 6]]})
        h.source.tracker = h.driver.tracker = h.tracker
        await h.fetched([Record(i, message(4 * i)) for i in range(2, 9)])
        read = h.core.accounting()[DEVICE]["messages_in"]
        await h.tick(1.0)
        return h, read

    h, read = run(scenario())

    assert read == 4  # offsets 2, 4, 7, 8: the settled ones are not handled again
    assert h.sink.records == {DEVICE: 16}
    assert h.tracker.watermark(h.part.key) == 9 and h.tracker.done_ranges() == {}


def test_a_shared_topic_reads_its_partitions_and_a_partition_resumes_once_no_device_holds_it():
    shared = "plant.readings"

    def keyed(device: str, start: int, n: int = 4) -> bytes:
        return codec.encode(RecordBatch(
            device=device, seq=np.arange(start, start + n, dtype=np.uint64), event_time=np.full(n, 100.0),
            features=np.ones((n, 4), dtype=np.float32), labels=np.zeros(n, dtype=np.int32),
        ))

    async def scenario():
        cfg = load_config(overrides=[f"input.topic={shared}", "input.partitions=4", "workers.count=2",
                                     "batcher.mode=window", "batcher.window_s=1", "batcher.max_batch=100",
                                     "buffer.policy=backpressure", "buffer.capacity=8"], env={})
        core = IngestCore(cfg, [], Metrics(), start=0.0, expected_shape=(4,), num_classes=10)
        tracker = OffsetTracker()
        sink = CountingSink()

        async def no_letters(letter) -> None:
            raise AssertionError(letter)

        driver = IngestDriver(core, sink, tracker, no_letters)
        source = DirectSensorSource(bootstrap="unused:9092", group_id="g", devices=[], driver=driver,
                                    tracker=tracker, max_message_bytes=1 << 20, clock=lambda: 0.5,
                                    shared_partitions=cfg.partitions_of("w1"))
        source.consumer = consumer = FakeConsumer()  # type: ignore[assignment]
        driver.source = source
        part = source.parts[TopicPartition(shared, 1)]
        # a and b share partition 1: a fills its buffer (8 records) and pauses it for both
        await source._handle(part, [Record(0, keyed("a", 0), b"a"), Record(1, keyed("a", 4), b"a"),
                                    Record(2, keyed("b", 0), b"b")], now=0.5, wall_now=101.0)
        paused = set(consumer.paused)
        await driver.perform(core.on_tick(1.0))
        return source, consumer, sink, paused, part

    source, consumer, sink, paused, part = run(scenario())

    assert sorted(source.parts) == [TopicPartition(shared, 1), TopicPartition(shared, 3)]  # p mod 2 == 1
    assert paused == {part.tp} and part.paused_by == set() and consumer.seeks == [(part.tp, 2)]
    assert consumer.paused == set() and consumer.resumed == [part.tp]
    assert sink.records == {"a": 8}


def test_ingest_waits_for_a_lookup_that_is_unavailable_before_the_core_sees_the_fetch(monkeypatch):
    from edgestream.pipeline import app as app_module
    from edgestream.streams.errors import LookupUnavailable

    monkeypatch.setattr(app_module, "LOOKUP_RETRY_S", 0.001)
    h = Harness()
    answers = iter([LookupUnavailable("the schema registry at http://r did not answer"), None, None])
    calls: list[tuple[int, float]] = []  # (records the core had seen, waiting gauge) per attempt

    def sample(name: str) -> float | None:
        return h.core.metrics.registry.get_sample_value(name)

    def lookup() -> None:
        calls.append((h.core.ledgers[DEVICE].records_in, sample("edgestream_ingest_lookup_paused")))
        answer = next(answers)
        if answer is not None:
            raise answer

    monkeypatch.setattr(h.core, "lookups", lambda values: [lookup] if len(values) == 3 else [])
    run(h.fetched([Record(i, message(4 * i)) for i in range(3)]))

    assert calls == [(0, 0.0), (0, 1.0)]  # tried again while waiting; the core saw nothing before
    assert h.core.ledgers[DEVICE].records_in == 12 and h.letters == []
    assert sample("edgestream_ingest_lookup_paused") == 0.0
    assert sample("edgestream_ingest_lookup_waits_total") == 1.0
