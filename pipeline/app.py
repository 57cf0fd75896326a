"""The Faust app of one worker: ingest of the device topics around ``IngestCore``.

Every message of a device topic goes to ``IngestCore.on_message``; ``IngestDriver``
performs the returned actions: batches go to the sink, rejected messages to
``sensors.dlq`` (reason and source in headers), released messages are acknowledged
(so only offsets whose records were consumed are committed), partitions are paused
and resumed for backpressure. Two sources feed it (``kafka.ingest_source``):

* ``direct`` (default): ``DirectSensorSource``, an aiokafka consumer owned by the app
  as a service, explicitly assigned the worker's device partitions; it commits the
  ``OffsetTracker`` watermarks for its own group ``<app id>-sensors``. It skips
  Faust's per-event stream machinery, which caps ingest far below the target
  (docs/ingest.md has the numbers).
* ``faust``: ``FaustSensorSource``, a Faust agent with manual acks in the app's group.

Everything else (training agents on the update topics, timers) is the same Faust app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import faust
import numpy as np
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from faust.transport.drivers.aiokafka import Producer as AIOKafkaFaustProducer
from faust.types import TP
from mode import Service

from edgestream.job.config import JobConfig
from edgestream.monitoring.metrics import Metrics, consumer_lag
from edgestream.pipeline import security
from edgestream.pipeline.ingest import CONSUMED, DeadLetter, IngestActions, IngestCore
from edgestream.streams import topics
from edgestream.streams.batching import Batch
from edgestream.streams.errors import LookupUnavailable
from edgestream.streams.labels import Waiting
from edgestream.streams.offsets import OffsetTracker

log = logging.getLogger(__name__)
#: Seconds before ingest asks a service it waits for (a schema registry) again; doubled up to the max.
LOOKUP_RETRY_S = 0.5
LOOKUP_RETRY_MAX_S = 5.0

#: Seconds between offset commits, for both sources (Faust's ``broker_commit_interval``).
COMMIT_INTERVAL_S = 1.0
#: The direct source's ``getmany``: longest wait when nothing arrives, most messages per
#: call (more than one fetch response holds: a call takes all that was fetched).
DIRECT_POLL_TIMEOUT_MS = 200
DIRECT_MAX_RECORDS = 100_000
#: Messages the direct source hands to ``IngestCore.on_run`` at once (one decode), and
#: yields to the event loop after.
RUN = 64
#: Seconds between consumer-lag updates.
LAG_INTERVAL_S = 1.0


class BatchSink(Protocol):
    """Where batches go: the trainer in a training job, a counter in an ingest-only run."""

    async def submit(self, batch: Batch) -> None: ...


class CountingSink:
    """Counts records per device; the sink of ingest-only runs and of the ingest benchmark."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.records: dict[str, int] = {}
        self.batches = 0
        self.metrics = metrics

    async def submit(self, batch: Batch) -> None:
        self.records[batch.device] = self.records.get(batch.device, 0) + batch.size
        self.batches += 1
        if self.metrics is not None:
            self.metrics.sink_records.labels(batch.device).inc(batch.size)


def app_id(cfg: JobConfig, worker: str) -> str:
    """Consumer group of a worker's Faust app: one group per worker, so device assignment is explicit."""
    return f"edgestream-{cfg.job.name}-{worker}"


def sensor_group(cfg: JobConfig, worker: str) -> str:
    """The consumer group whose committed offsets say where ``worker`` resumes its device topics.

    The direct source commits for ``<app id>-sensors`` (it has no members: its
    partitions are assigned explicitly); the Faust source commits for the app's group.
    Checkpoint restore and "start at the end" must target this group.
    """
    if cfg.kafka.ingest_source == "direct":
        return f"{app_id(cfg, worker)}-sensors"
    return app_id(cfg, worker)


def offsets_by_group(cfg: JobConfig, worker: str, offsets: dict[str, int]) -> dict[str, dict[str, int]]:
    """Split ``"topic:partition" -> offset`` into the groups that consume each topic.

    Device topics go to ``sensor_group``; every other topic (update topics of a
    training job) to the Faust app's group. Groups without offsets are left out.
    """
    out: dict[str, dict[str, int]] = {}
    for key, offset in offsets.items():
        topic = key.rpartition(":")[0]
        group = sensor_group(cfg, worker) if is_sensor_topic(topic, cfg.input.layout()) else app_id(cfg, worker)
        out.setdefault(group, {})[key] = offset
    return out


def is_sensor_topic(topic: str, layout: topics.TopicLayout = topics.DEFAULT_LAYOUT) -> bool:
    """A device topic of ``layout`` (``sensors.<device>`` by default), not the dead-letter topic."""
    return layout.matches(topic)


class DurableProducer(AIOKafkaFaustProducer):
    """Faust's aiokafka producer with idempotence on, not only inside transactions.

    faust-streaming 0.15.3 has ``producer_acks`` (default -1 = all) but no setting for
    idempotence: it passes ``enable_idempotence`` to aiokafka only when the app is in a
    transaction (``processing_guarantee="exactly_once"``). Gradients, models, control
    messages and dead letters go through this producer; with idempotence a retry after
    a broker failure (leader moved, request timed out) cannot write an update twice
    or out of order.
    """

    def _settings_extra(self) -> Mapping[str, Any]:
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}

    async def send_keyed(self, topic: str, messages: Sequence[tuple[bytes, bytes]]) -> list[asyncio.Future]:
        """Hand ``messages`` (``(key, value)``, in order) to the producer as record batches, one
        or more per partition (a message's partition is Kafka's default for its key), instead
        of one send each; returns the batches' acknowledgements to await (many messages for
        the cost of a few sends: the predictions of a training step)."""
        return await send_keyed(self._ensure_producer(), topic, messages)


async def send_keyed(producer: Any, topic: str, messages: Sequence[tuple[bytes, bytes]]) -> list[asyncio.Future]:
    """``DurableProducer.send_keyed`` on an ``AIOKafkaProducer``: ``messages`` as record batches,
    one or more per partition (the key's default partition); the acknowledgements to await."""
    partitions = sorted(await producer.partitions_for(topic))
    by_partition: dict[int, list[tuple[bytes, bytes]]] = {}
    partition_of: dict[bytes, int] = {}
    for key, value in messages:
        partition = partition_of.get(key)
        if partition is None:
            partition = partition_of[key] = partitions[(topics.murmur2(key) & 0x7FFFFFFF) % len(partitions)]
        by_partition.setdefault(partition, []).append((key, value))
    acks = []
    for partition, items in by_partition.items():
        batch = producer.create_batch()
        for key, value in items:
            if batch.append(key=key, value=value, timestamp=None) is None:  # full: send it, start another
                acks.append(await producer.send_batch(batch, topic, partition=partition))
                batch = producer.create_batch()
                if batch.append(key=key, value=value, timestamp=None) is None:
                    raise ValueError(f"a message of {len(value)} bytes does not fit a record batch of {topic}")
        acks.append(await producer.send_batch(batch, topic, partition=partition))
    return acks


async def cancel_and_wait(tasks: Sequence[asyncio.Future]) -> None:
    """Cancel every task of ``tasks``, then wait until each has ended (its cancellation taken,
    not raised here): a source's loops, stopped before it commits and leaves."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


class EdgeApp(faust.App):
    """``faust.App`` whose producer is a ``DurableProducer`` (acks=all + idempotence)."""

    def _new_producer(self) -> Any:
        return DurableProducer(self.transport, loop=self.loop, beacon=self.beacon)


def new_faust_app(cfg: JobConfig, name: str, bootstrap: str, datadir: Path) -> faust.App:
    """The Faust app of one edgestream process (worker or server), with the settings all share.

    Its producer writes with acks=all (``producer_acks=-1``) and idempotence
    (``DurableProducer``)."""
    max_bytes = cfg.kafka.max_message_bytes
    return EdgeApp(
        app_id(cfg, name),
        broker=f"kafka://{bootstrap}",
        store="memory://",
        datadir=str(datadir),
        web_enabled=False,
        topic_disable_leader=True,
        consumer_auto_offset_reset="earliest",
        producer_max_request_size=max_bytes,
        producer_acks=-1,
        consumer_max_fetch_size=max_bytes,
        stream_wait_empty=False,
        broker_commit_interval=COMMIT_INTERVAL_S,
        autodiscover=False,
        # A crashed process's group membership must lapse quickly so its restart can rejoin.
        broker_session_timeout=10.0,
        broker_heartbeat_interval=2.0,
        broker_credentials=security.current().faust_credentials(),
    )


def dead_letter_message(letter: DeadLetter, worker: str, max_bytes: int) -> tuple[bytes, dict[str, bytes]]:
    """The value and headers ``letter`` goes to ``sensors.dlq`` with (reason and source in
    headers), logged once; ``worker``: the process that read it."""
    log.warning(
        "dead-lettered %s[%s]@%s: %s (%s)",
        letter.topic, letter.partition, letter.offset, letter.reason, letter.detail,
    )
    headers = {
        topics.DLQ_HEADER_REASON: letter.reason.encode(),
        topics.DLQ_HEADER_DETAIL: letter.detail.encode()[:1024],
        topics.DLQ_HEADER_TOPIC: letter.topic.encode(),
        topics.DLQ_HEADER_PARTITION: str(letter.partition).encode(),
        topics.DLQ_HEADER_OFFSET: str(letter.offset).encode(),
        topics.DLQ_HEADER_WORKER: worker.encode(),
    }
    if letter.records:
        headers[topics.DLQ_HEADER_RECORDS] = str(letter.records).encode()
    # An oversized value cannot be forwarded whole; the headers still say everything.
    value = letter.value if len(letter.value) <= max_bytes // 2 else letter.value[:1024]
    return value, headers


class SensorSource(Protocol):
    """What ``IngestDriver`` needs from whoever reads the device topics."""

    running: bool

    def token_range(self, token: Any) -> tuple[str, int, int]:
        """``(tracker key, first offset, last offset)`` of the messages of ``token``."""

    async def ack(self, tokens: list[Any]) -> None:
        """The messages of ``tokens`` are fully handled (the tracker already knows)."""

    def pause(self, devices: list[str]) -> None: ...

    async def resume(self, devices: list[str]) -> None: ...

    def consumer_lag(self) -> dict[str, int]:
        """Records not yet handled, per device (devices whose end offset is unknown are left out)."""


class IngestDriver:
    """Performs ``IngestActions`` against a source, the sink and the dead-letter topic.

    Invariant: a token is acked (and marked resolved in the tracker) only once every
    record it carried is settled: consumed by the sink (with ``defer_acks``, once the
    sink says so through ``settle``), dropped by a counted policy, or in a dead letter
    that is durable. The core's resolved ledger and the tracker change together, in one
    synchronous step, so a checkpoint always sees them agree.
    """

    def __init__(
        self,
        core: IngestCore,
        sink: BatchSink,
        tracker: OffsetTracker,
        send_dead_letter: Callable[[DeadLetter], Any],
    ) -> None:
        self.core = core
        self.sink = sink
        self.tracker = tracker
        self.send_dead_letter = send_dead_letter
        self.source: SensorSource | None = None
        self.defer_acks = bool(getattr(sink, "defer_acks", False))
        if self.defer_acks:
            sink.settle = self.settle  # type: ignore[attr-defined]
        # Timer and fetch loop both perform actions; one at a time keeps batches in order.
        self._lock = asyncio.Lock()
        #: The sink's model, asked what it predicts for readings that wait for their label
        #: (``IngestActions.predict``), given their features and ``(device, seq)`` keys; None:
        #: a sink without one (nothing is scored).
        self.predictor: Callable[[np.ndarray, list[tuple[str, int]]], Any] | None = getattr(sink, "predict", None)
        core.predict_on_arrival = self.predictor is not None and core.label_join is not None
        self._to_predict: list[Waiting] = []
        self._predicting: asyncio.Task | None = None

    async def look_up(self, values: Sequence[bytes | None]) -> None:
        """Run the blocking lookups decoding ``values`` needs (``IngestCore.lookups``: the
        schema registry's schemas of ids not seen yet) off the event loop. While the service
        does not answer, wait and try again (every ``LOOKUP_RETRY_S``, doubling up to
        ``LOOKUP_RETRY_MAX_S``): the source reads nothing meanwhile, so no reading is
        dead-lettered for an outage; one log line when the wait starts and one when it ends,
        ``edgestream_ingest_lookup_paused`` 1 in between."""
        metrics = self.core.metrics
        for lookup in self.core.lookups(values):
            began: float | None = None
            delay = LOOKUP_RETRY_S
            while True:
                try:
                    await asyncio.get_running_loop().run_in_executor(None, lookup)
                    break
                except LookupUnavailable as exc:
                    if began is None:
                        began = time.monotonic()
                        metrics.lookup_waiting.set(1)
                        log.warning("%s; ingest waits for it and tries again", exc)
                    await asyncio.sleep(delay)  # the retry interval of a service that is down
                    delay = min(2 * delay, LOOKUP_RETRY_MAX_S)
            if began is not None:
                metrics.lookup_waiting.set(0)
                metrics.lookup_waits.inc()
                log.warning("the lookup ingest waited for answered after %.1f s; ingest goes on",
                            time.monotonic() - began)

    async def settle(self, batch: Batch, outcome: str = CONSUMED, reason: str | None = None) -> None:
        """The sink is done with ``batch`` (trained, or dead-lettered for ``reason``)."""
        await self.ack_tokens(self.core.settle_batch(batch, outcome, reason))

    async def ack_tokens(self, tokens: list[Any]) -> None:
        assert self.source is not None
        if not tokens:
            return
        resolved, token_range = self.tracker.resolved_range, self.source.token_range
        for token in tokens:
            resolved(*token_range(token))
        await self.source.ack(tokens)

    def snapshot(self) -> dict[str, Any]:
        """Where the device topics resume and the ledger up to there, taken at one instant:
        the checkpoint's ``sensors`` offsets, the offsets above them already settled
        (``sensors_done``: skipped after a restore) and the resolved ``ledger``."""
        return {"sensors": self.tracker.watermarks(), "sensors_done": self.tracker.done_ranges(),
                "ledger": self.core.resolved_ledgers()}

    async def perform(self, actions: IngestActions) -> None:
        assert self.source is not None
        async with self._lock:
            for letter in actions.dead_letters:
                await self.send_dead_letter(letter)  # durable before the ack below
                await self.ack_tokens(self.core.letter_sent(letter))
            for batch in actions.batches:
                await self.sink.submit(batch)
                if not self.defer_acks:
                    await self.ack_tokens(self.core.settle_batch(batch))
                actions.resume += self.core.after_sink(batch.device).resume
            await self.ack_tokens(actions.ack)
            if actions.pause:
                self.source.pause(actions.pause)
            if actions.resume:
                await self.source.resume(actions.resume)
            if actions.predict:
                self._to_predict += actions.predict
                if self._predicting is None or self._predicting.done():
                    self._predicting = asyncio.ensure_future(self._predict())

    async def _predict(self) -> None:
        """The model's predictions for readings that began waiting for their label, asked
        for as they come (in batches while one is being answered): what each is scored on
        when its label arrives. A reading whose label came first is not scored."""
        assert self.predictor is not None
        while self._to_predict:
            waiting, self._to_predict = self._to_predict, []
            features = np.stack([w.batch.features[w.index] for w in waiting])
            keys = [(w.device, int(w.batch.seq[w.index])) for w in waiting]
            try:
                classes = await self.predictor(features, keys)
            except Exception:  # a model that cannot answer now (stopping): those readings go unscored
                log.warning("predicting for readings that wait for their label failed", exc_info=True)
                return
            for w, c in zip(waiting, classes.tolist(), strict=True):
                w.prediction = int(c)


def _kafka_time_s(timestamp_ms: int | None) -> float | None:
    """A Kafka record's timestamp in seconds, or None if it has none (-1)."""
    return timestamp_ms / 1000.0 if timestamp_ms is not None and timestamp_ms >= 0 else None


def _run_times_s(run: list[Any]) -> np.ndarray | None:
    """The Kafka timestamps of a run of records in seconds, or None if any has none."""
    try:
        times = np.fromiter(map(_timestamp_of, run), np.float64, len(run))
    except TypeError:  # a None
        return None
    if len(times) and times.min() < 0:
        return None
    return times / 1000.0


_timestamp_of = operator.attrgetter("timestamp")


class SensorToken(NamedTuple):
    """Acknowledgement token of the messages ``offset..last`` read by the direct source."""

    topic: str
    partition: int
    offset: int
    last: int


@dataclass
class _Partition:
    """The direct source's state of one assigned device partition."""

    tp: TopicPartition
    device: str | None  # None: a partition of a shared topic (many devices, keyed)
    key: str  # OffsetTracker key
    start: int = 0  # position when assigned (committed offset or the reset point)
    handled: int = -1  # highest offset handed to IngestCore
    committed: int | None = None
    paused: bool = False
    #: The devices whose buffers asked for this partition's pause (a shared topic's partition
    #: resumes once none of them still asks).
    paused_by: set[str] = field(default_factory=set)


class DirectSensorSource(Service):
    """Reads the worker's device partitions with an aiokafka consumer and feeds ``IngestCore``.

    Partitions are assigned explicitly (no group membership, no rebalances); the
    group ``group_id`` only stores committed offsets, which are the tracker's
    watermarks: never ahead of what is fully handled. Started and stopped with the
    Faust app (``attach``).
    """

    def __init__(
        self,
        *,
        bootstrap: str,
        group_id: str,
        devices: list[str],
        driver: IngestDriver,
        tracker: OffsetTracker,
        max_message_bytes: int,
        clock: Callable[[], float],
        on_positioned: Callable[[], None] | None = None,
        shared_partitions: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        """``shared_partitions``: with a shared device topic (``input.topic`` without
        ``{device}``), the partitions of it this worker reads (``JobConfig.partitions_of``)."""
        super().__init__(**kwargs)
        self.bootstrap = bootstrap
        self.group_id = group_id
        self.driver = driver
        self.tracker = tracker
        self.max_message_bytes = max_message_bytes
        self.clock = clock
        self.on_positioned = on_positioned
        self.parts: dict[TopicPartition, _Partition] = {}
        self.layout = driver.core.layout  # input.topic
        #: labels.topic: with a shared topic, the same partitions of it (a device's labels,
        #: keyed by it, land in the partition number its readings do); else all of them.
        self.labels_topic = driver.core.labels_topic
        if self.layout.keyed:
            topic = self.layout.pattern
            for p in shared_partitions or []:
                for t in (topic, self.labels_topic) if self.labels_topic else (topic,):
                    tp = TopicPartition(t, p)
                    self.parts[tp] = _Partition(tp, None, OffsetTracker.key(t, p))
        else:
            for device in devices:
                topic = self.layout.topic(device)
                tp = TopicPartition(topic, 0)
                self.parts[tp] = _Partition(tp, device, OffsetTracker.key(topic, 0))
        self.consumer: AIOKafkaConsumer | None = None
        self.running = False
        self._loops: list[asyncio.Task] = []

    def attach(self, app: faust.App) -> None:
        """Start with the app (once it is up, so its producer can take dead letters); stop first."""

        @app.task
        async def start_direct_source() -> None:
            try:
                await app.add_runtime_dependency(self)
            except Exception as exc:  # e.g. the broker refused: a worker that cannot read must stop
                log.exception("direct sensor source could not start")
                await app.crash(exc)

        @app.on_before_shutdown.connect
        async def stop_direct_source(app_: faust.App, **kwargs: Any) -> None:
            await self.stop()

        _ = (start_direct_source, stop_direct_source)

    async def on_start(self) -> None:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=self.group_id,
            client_id=f"{self.group_id}-direct",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_partition_fetch_bytes=self.max_message_bytes,
            fetch_max_bytes=max(self.max_message_bytes, 52_428_800),
            **security.current().aiokafka(),
        )
        await consumer.start()
        self.consumer = consumer
        # Every partition of each device topic (one, as ``ensure_topics`` creates them).
        await consumer.topics()  # fresh metadata
        for topic in sorted({tp.topic for tp in self.parts if not self.layout.keyed}):
            for p in sorted(consumer.partitions_for_topic(topic) or {0}):
                tp = TopicPartition(topic, p)
                if tp not in self.parts:
                    self.parts[tp] = _Partition(tp, self.layout.device_of(topic), OffsetTracker.key(topic, p))
        if self.labels_topic and not self.layout.keyed:
            for p in sorted(consumer.partitions_for_topic(self.labels_topic) or {0}):
                tp = TopicPartition(self.labels_topic, p)
                self.parts[tp] = _Partition(tp, None, OffsetTracker.key(self.labels_topic, p))
        consumer.assign(list(self.parts))
        for part in self.parts.values():
            part.start = await consumer.position(part.tp)
            part.committed = part.start
        self.running = True
        self._loops = [asyncio.ensure_future(self._fetch_loop()), asyncio.ensure_future(self._commit_loop())]
        if self.on_positioned is not None:
            self.on_positioned()

    async def on_stop(self) -> None:
        """Stop reading, commit what is fully handled, close the consumer."""
        self.running = False
        await cancel_and_wait(self._loops)
        self._loops = []
        if self.consumer is not None:
            await self.commit()
            await self.consumer.stop()
            self.consumer = None

    # --- the hot path ----------------------------------------------------------------
    async def _fetch_loop(self) -> None:
        assert self.consumer is not None
        getmany = self.consumer.getmany
        try:
            while True:
                fetched = await getmany(timeout_ms=DIRECT_POLL_TIMEOUT_MS, max_records=DIRECT_MAX_RECORDS)
                if not fetched:
                    continue
                # aiokafka fetches a partition again only once its buffered records are all
                # taken (just done): yield once so that request goes out now and the broker
                # works on the next fetch while these records are handled.
                await asyncio.sleep(0)
                now, wall_now = self.clock(), time.time()
                for tp, records in fetched.items():
                    await self._handle(self.parts[tp], records, now, wall_now)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # A worker must not look alive without reading: crash the app (and the process).
            log.exception("direct sensor source failed")
            await self.crash(exc)

    async def _handle(self, part: _Partition, records: list[Any], now: float, wall_now: float) -> None:
        """Hand ``records`` of one partition to the core, in order, acting on what it returns.

        Runs of ``RUN`` messages go to ``IngestCore.on_run`` as one chunk (one decode over
        the run); a run it declines (a bad message, a header change, a pause due) goes
        message by message through ``on_message``.
        """
        core = self.driver.core
        topic, partition, key = part.tp.topic, part.tp.partition, part.key
        await self.driver.look_up([r.value for r in records])
        for start in range(0, len(records), RUN):
            run = records[start : start + RUN]
            first, last = run[0].offset, run[-1].offset
            actions = None
            if not self.tracker.has_done(key, first, last):
                actions = core.on_run(
                    topic, [r.value for r in run], SensorToken(topic, partition, first, last), now, wall_now,
                    _run_times_s(run), partition=partition,
                    offsets=[r.offset for r in run] if core.stamp_origin else None,
                )
            if actions is not None:
                self.tracker.seen_range(key, first, last)
                part.handled = last
                if actions:
                    await self.driver.perform(actions)
            else:
                for index, record in enumerate(run):
                    offset = record.offset
                    self.tracker.seen(key, offset)
                    if self.tracker.is_done(key, offset):
                        # Settled before the checkpoint this worker restored: not again.
                        self.tracker.resolved(key, offset)
                        part.handled = offset
                        continue
                    actions = core.on_message(
                        topic, partition, offset, record.key, record.value,
                        SensorToken(topic, partition, offset, offset), now, wall_now,
                        _kafka_time_s(record.timestamp),
                    )
                    part.handled = offset
                    if actions:
                        await self.driver.perform(actions)
                    if part.paused:
                        if start + index + 1 < len(records):
                            # Stop at the pause: the rest of this fetch is read again after
                            # the resume (paused partitions keep their position).
                            assert self.consumer is not None
                            self.consumer.seek(part.tp, records[start + index + 1].offset)
                        return
            # Let the connection read the next fetch response (and timers run) between
            # runs: reading and handling then overlap.
            await asyncio.sleep(0)
            now, wall_now = self.clock(), time.time()

    # --- SensorSource ------------------------------------------------------------------
    def token_range(self, token: SensorToken) -> tuple[str, int, int]:
        return OffsetTracker.key(token.topic, token.partition), token.offset, token.last

    async def ack(self, tokens: list[SensorToken]) -> None:
        """Nothing beyond the tracker: commits are its watermarks (``commit``)."""

    def _parts_of(self, device: str) -> list[_Partition]:
        """The partitions ``device``'s messages come from: its topic's, or the shared topic's
        partition it was last read from."""
        if not self.layout.keyed:
            return [p for p in self.parts.values() if p.device == device]
        state = self.driver.core.state_of(device)
        if state is None or state.partition is None:
            return []
        part = self.parts.get(TopicPartition(self.layout.pattern, state.partition))
        return [] if part is None else [part]

    def pause(self, devices: list[str]) -> None:
        """Pause the partitions of ``devices`` (a shared topic's: every device on it waits)."""
        paused = []
        for device in devices:
            for part in self._parts_of(device):
                part.paused_by.add(device)
                if not part.paused:
                    part.paused = True
                    paused.append(part.tp)
        if self.consumer is not None and paused:
            self.consumer.pause(*paused)

    async def resume(self, devices: list[str]) -> None:
        """Resume the partitions of ``devices`` that no other device still holds paused."""
        resumed = []
        for device in devices:
            for part in self._parts_of(device):
                part.paused_by.discard(device)
                if part.paused and not part.paused_by:
                    part.paused = False
                    resumed.append(part.tp)
        if self.consumer is not None and resumed:
            self.consumer.resume(*resumed)

    def consumer_lag(self) -> dict[str, int]:
        if self.consumer is None:
            return {}
        ends: dict[tuple[str, int], int] = {}
        positions: dict[tuple[str, int], int | None] = {}
        for tp, part in self.parts.items():
            if tp.topic == self.labels_topic:
                continue  # not a device's: the labels' progress shows as readings leaving the label wait
            # the high watermark of the partition's latest fetch response
            end = self.consumer.highwater(tp)
            if end is None or end < 0:
                end = self.consumer.last_stable_offset(tp)  # -1 unless read_committed
            if end is None or end < 0:
                continue
            ends[(tp.topic, tp.partition)] = end
            positions[(tp.topic, tp.partition)] = part.handled + 1 if part.handled >= 0 else part.start
        return consumer_lag(ends, positions, self.layout)

    # --- commits -----------------------------------------------------------------------
    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(COMMIT_INTERVAL_S)
            await self.commit()

    async def commit(self) -> None:
        """Commit every partition's watermark that moved: the first offset not fully handled
        (a partition revoked while the commit was on its way, in a consumer group, is left
        alone: its new owner commits from there)."""
        if self.consumer is None:
            return
        offsets = {}
        for tp, part in list(self.parts.items()):
            mark = self.tracker.watermark(part.key)
            if mark is not None and mark != part.committed:
                offsets[tp] = mark
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except KafkaError as exc:  # transient (coordinator moving, a rebalance): the next round retries
            log.warning("committing sensor offsets for %s failed: %r", self.group_id, exc)
            return
        for tp, mark in offsets.items():
            part = self.parts.get(tp)
            if part is not None:
                part.committed = mark


class FaustSensorSource:
    """Reads the device topics with a Faust agent (manual acks) in the app's own group."""

    def __init__(self, driver: IngestDriver, tracker: OffsetTracker, metrics: Metrics,
                 clock: Callable[[], float]) -> None:
        self.driver = driver
        self.tracker = tracker
        self.metrics = metrics
        self.clock = clock
        self.app: faust.App | None = None
        self.stream: Any = None
        self.partitions: dict[str, TP] = {}
        self.last_offset: dict[TP, int] = {}  # highest offset the agent has handled, per partition

    @property
    def running(self) -> bool:
        return self.stream is not None

    def attach(self, app: faust.App, devices: list[str], on_assigned: Callable[[], None]) -> None:
        self.app = app
        layout = self.driver.core.layout  # input.topic
        source = app.topic(*[layout.topic(d) for d in devices], key_serializer="raw", value_serializer="raw")
        core, metrics, tracker = self.driver.core, self.metrics, self.tracker
        last_offset, partitions = self.last_offset, self.partitions

        @app.agent(source, concurrency=1)
        async def ingest(stream: faust.Stream) -> None:
            manual = stream.noack()
            self.stream = manual
            # Events are taken in small groups (up to 256, or what arrived within 10 ms) so the
            # per-message await of acting on the result is paid once per group. Acks stay
            # manual: take_events on a no-ack stream acknowledges nothing by itself.
            async for events in manual.take_events(256, within=0.01):
                await self.driver.look_up([event.value for event in events])
                actions = IngestActions()
                now, wall_now = self.clock(), time.time()
                for event in events:
                    msg = event.message
                    if msg.offset <= last_offset.get(msg.tp, -1):
                        # Re-delivered after a resume seek: the first copy is already handled.
                        # Not acked here: the first copy's ack marks this offset once consumed.
                        metrics.duplicates_skipped.labels(layout.device_of(msg.topic)).inc()
                        continue
                    last_offset[msg.tp] = msg.offset
                    key = OffsetTracker.key(msg.topic, msg.partition)
                    tracker.seen(key, msg.offset)
                    if tracker.is_done(key, msg.offset):
                        # Settled before the checkpoint this worker restored: not again.
                        tracker.resolved(key, msg.offset)
                        await manual.ack(event)
                        continue
                    partitions.setdefault(layout.device_of(msg.topic), msg.tp)
                    actions.extend(core.on_message(
                        msg.topic, msg.partition, msg.offset, msg.key, event.value, event,
                        now=now, wall_now=wall_now,
                        timestamp_s=msg.timestamp if msg.timestamp is not None and msg.timestamp >= 0 else None,
                    ))
                await self.driver.perform(actions)

        @app.on_partitions_assigned.connect
        async def assigned(app_: faust.App, assigned: set[TP], **kwargs: Any) -> None:
            for tp in assigned:
                if layout.matches(tp.topic):
                    partitions[layout.device_of(tp.topic)] = tp
            if assigned:
                on_assigned()

        _ = (ingest, assigned)  # registered with the app by their decorators

    def token_range(self, token: Any) -> tuple[str, int, int]:
        msg = token.message
        return OffsetTracker.key(msg.topic, msg.partition), msg.offset, msg.offset

    async def ack(self, tokens: list[Any]) -> None:
        for token in tokens:
            await self.stream.ack(token)

    def pause(self, devices: list[str]) -> None:
        assert self.app is not None
        self.app.consumer.pause_partitions([self.partitions[d] for d in devices if d in self.partitions])

    async def resume(self, devices: list[str]) -> None:
        assert self.app is not None
        for device in devices:
            tp = self.partitions.get(device)
            if tp is None:
                continue
            self.app.consumer.resume_partitions([tp])
            # Faust silently skips already-fetched records of a partition paused mid-batch
            # (they are never yielded, yet the fetch position moved past them). Seek back to
            # the first offset not seen; duplicates still queued are filtered in the agent.
            if tp in self.last_offset:
                await self.app.consumer.seek(tp, self.last_offset[tp] + 1)

    def consumer_lag(self) -> dict[str, int]:
        """Records not yet handled per device: end offset - (last offset handled + 1)."""
        assert self.app is not None
        ends = {}
        for tp in self.partitions.values():
            try:
                # the high watermark of the partition's latest fetch response
                end = self.app.consumer.highwater(tp)
            except Exception as exc:  # not fetched yet / transient: skip this round
                log.debug("consumer lag of %s unknown: %s", tp, exc)
                continue
            if end is not None and end >= 0:
                ends[(tp.topic, tp.partition)] = end
        positions = {(tp.topic, tp.partition): self.last_offset.get(tp, -1) + 1
                     for tp in self.partitions.values()}
        return consumer_lag(ends, positions, self.driver.core.layout)


class _Readiness:
    """Calls ``on_ready`` once every named part reported ready."""

    def __init__(self, on_ready: Callable[[], None] | None) -> None:
        self.on_ready = on_ready
        self.waiting: set[str] = set()

    def need(self, part: str) -> None:
        self.waiting.add(part)

    def done(self, part: str) -> None:
        self.waiting.discard(part)
        if not self.waiting and self.on_ready is not None:
            self.on_ready()


def create_app(
    cfg: JobConfig,
    worker: str,
    bootstrap: str,
    sink: BatchSink,
    metrics: Metrics,
    *,
    datadir: Path,
    devices: list[str] | None = None,
    expected_shape: tuple[int, ...] | None = None,
    num_classes: int | None = None,
    value_range: tuple[Any, Any] | None = None,
    restored_ledger: dict[str, dict[str, Any]] | None = None,
    require_labels: bool = False,
    clock: Callable[[], float] = time.monotonic,
    on_ready: Callable[[], None] | None = None,
    tracker: OffsetTracker | None = None,
    extend: Callable[[faust.App], None] | None = None,
) -> tuple[faust.App, IngestCore]:
    """Build the worker's Faust app; returns it with the ``IngestCore`` it drives.

    ``tracker`` learns which sensor offsets are fully handled (a checkpoint's resume
    point; restoring it is the caller's job: ``kafka_io.set_group_offsets`` for
    ``sensor_group``); ``extend(app)`` registers more agents and tasks (training).
    A sink with ``defer_acks = True`` gets an async ``settle(batch, outcome, reason)``
    attribute and must call it once it is done with a batch (``IngestDriver.settle``).
    ``value_range``, ``restored_ledger`` and ``require_labels`` go to ``IngestCore``. ``on_ready`` is called once the
    device partitions are assigned (and, if ``extend`` added agents, Faust's too).
    """
    tracker = tracker if tracker is not None else OffsetTracker()
    devices = devices if devices is not None else cfg.devices_of(worker)
    max_bytes = cfg.kafka.max_message_bytes
    app = new_faust_app(cfg, worker, bootstrap, datadir)
    core = IngestCore(
        cfg, devices, metrics, start=clock(), expected_shape=expected_shape, num_classes=num_classes,
        value_range=value_range, restored=restored_ledger, require_labels=require_labels,
    )
    dlq = app.topic(topics.SENSOR_DLQ, key_serializer="raw", value_serializer="raw")

    async def send_dead_letter(letter: DeadLetter) -> None:
        value, headers = dead_letter_message(letter, worker, max_bytes)
        fut = await dlq.send(key=letter.key, value=value, headers=headers)
        await fut  # the caller acks only once the dead letter is durable

    driver = IngestDriver(core, sink, tracker, send_dead_letter)
    if hasattr(sink, "ingest_snapshot"):
        sink.ingest_snapshot = driver.snapshot  # what a training checkpoint stores of ingest
        sink.devices_held = lambda: len(core.devices)  # how many batches may queue for the trainer
    readiness = _Readiness(on_ready)
    source: DirectSensorSource | FaustSensorSource
    if cfg.kafka.ingest_source == "direct":
        readiness.need("sensors")
        source = DirectSensorSource(
            bootstrap=bootstrap, group_id=sensor_group(cfg, worker), devices=devices, driver=driver,
            tracker=tracker, max_message_bytes=max_bytes, clock=clock,
            on_positioned=lambda: readiness.done("sensors"), shared_partitions=cfg.partitions_of(worker),
        )
        source.attach(app)
    else:
        readiness.need("faust")
        source = FaustSensorSource(driver, tracker, metrics, clock)
        source.attach(app, devices, on_assigned=lambda: readiness.done("faust"))
    driver.source = source

    tick_s = min(0.1, cfg.batcher.window_s / 4)
    lag_state = {"at": 0.0}

    @app.timer(interval=tick_s)
    async def tick() -> None:
        if not source.running:
            return
        await driver.perform(core.on_tick(clock()))
        now = clock()
        if now - lag_state["at"] >= LAG_INTERVAL_S:
            lag_state["at"] = now
            metrics.record_consumer_lag(source.consumer_lag())

    if extend is not None:
        extend(app)
    if cfg.kafka.ingest_source == "direct":
        if app.agents:
            # The update topics of a training job are read by Faust agents: wait for them too.
            readiness.need("faust")

            @app.on_partitions_assigned.connect
            async def assigned(app_: faust.App, assigned: set[TP], **kwargs: Any) -> None:
                if assigned:
                    readiness.done("faust")

            _ = assigned
        else:
            # Nothing for Faust's consumer to read (it refuses an empty subscription).
            app.producer_only = True
    _ = tick  # registered with the app by its decorator
    return app, core
