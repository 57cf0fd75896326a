"""The Faust app of one worker: a thin ingest agent and a timer around ``IngestCore``.

The agent reads raw messages from the worker's device topics with manual acks, hands
each to ``IngestCore`` and performs the returned actions: batches go to the sink,
rejected messages to ``sensors.dlq`` (reason and source in headers), released
messages are acked (so Faust commits only offsets whose records were consumed),
partitions are paused and resumed for backpressure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import faust
from faust.types import TP

from monitoring.metrics import Metrics, consumer_lag
from pipeline.batching import Batch
from pipeline.config import JobConfig
from pipeline.ingest import DeadLetter, IngestActions, IngestCore
from pipeline.offsets import OffsetTracker
from streams import topics

log = logging.getLogger(__name__)


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
    """Consumer group of a worker: one group per worker, so device assignment is explicit."""
    return f"edgestream-{cfg.job.name}-{worker}"


def new_faust_app(cfg: JobConfig, name: str, bootstrap: str, datadir: Path) -> faust.App:
    """The Faust app of one edgestream process (worker or server), with the settings all share."""
    max_bytes = cfg.kafka.max_message_bytes
    return faust.App(
        app_id(cfg, name),
        broker=f"kafka://{bootstrap}",
        store="memory://",
        datadir=str(datadir),
        web_enabled=False,
        topic_disable_leader=True,
        consumer_auto_offset_reset="earliest",
        producer_max_request_size=max_bytes,
        consumer_max_fetch_size=max_bytes,
        stream_wait_empty=False,
        broker_commit_interval=1.0,
        autodiscover=False,
        # A crashed process's group membership must lapse quickly so its restart can rejoin.
        broker_session_timeout=10.0,
        broker_heartbeat_interval=2.0,
    )


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
    clock: Callable[[], float] = time.monotonic,
    on_ready: Callable[[], None] | None = None,
    tracker: OffsetTracker | None = None,
    extend: Callable[[faust.App], None] | None = None,
) -> tuple[faust.App, IngestCore]:
    """Build the worker's Faust app; returns it with the ``IngestCore`` it drives.

    ``tracker`` learns which sensor offsets are fully handled (a checkpoint's resume
    point; restoring it is the caller's job, see ``kafka_io.set_group_offsets``);
    ``extend(app)`` registers more
    agents and tasks (training). A sink with ``defer_acks = True`` gets an async
    ``ack_tokens(tokens)`` attribute and must call it once a batch is fully handled.
    """
    tracker = tracker if tracker is not None else OffsetTracker()
    devices = devices if devices is not None else cfg.devices_of(worker)
    max_bytes = cfg.kafka.max_message_bytes
    app = new_faust_app(cfg, worker, bootstrap, datadir)
    core = IngestCore(
        cfg, devices, metrics, start=clock(), expected_shape=expected_shape, num_classes=num_classes
    )
    source = app.topic(
        *[topics.sensor_topic(d) for d in devices], key_serializer="raw", value_serializer="raw"
    )
    dlq = app.topic(topics.SENSOR_DLQ, key_serializer="raw", value_serializer="raw")
    partitions: dict[str, TP] = {}
    last_offset: dict[TP, int] = {}  # highest offset the agent has handled, per partition
    state: dict[str, Any] = {"stream": None}

    async def ack(token: Any) -> None:
        await state["stream"].ack(token)
        tracker.resolved(OffsetTracker.key(token.message.topic, token.message.partition), token.message.offset)

    async def ack_tokens(tokens: list[Any]) -> None:
        for token in tokens:
            await ack(token)

    defer_acks = bool(getattr(sink, "defer_acks", False))
    if defer_acks:
        sink.ack_tokens = ack_tokens  # type: ignore[attr-defined]

    async def perform(actions: IngestActions) -> None:
        for letter in actions.dead_letters:
            await send_dead_letter(letter)
        for batch in actions.batches:
            await sink.submit(batch)
            if not defer_acks:
                await ack_tokens(batch.released)
            actions.resume += core.after_sink(batch.device).resume
        await ack_tokens(actions.ack)
        if actions.pause:
            app.consumer.pause_partitions([partitions[d] for d in actions.pause if d in partitions])
        for device in actions.resume:
            tp = partitions.get(device)
            if tp is None:
                continue
            app.consumer.resume_partitions([tp])
            # Faust silently skips already-fetched records of a partition paused mid-batch
            # (they are never yielded, yet the fetch position moved past them). Seek back to
            # the first offset not seen; duplicates still queued are filtered in the agent.
            if tp in last_offset:
                await app.consumer.seek(tp, last_offset[tp] + 1)

    async def send_dead_letter(letter: DeadLetter) -> None:
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
        # An oversized value cannot be forwarded whole; the headers still say everything.
        value = letter.value if len(letter.value) <= max_bytes // 2 else letter.value[:1024]
        fut = await dlq.send(key=letter.key, value=value, headers=headers)
        await fut  # the ack below must not run before the dead letter is durable
        await ack(letter.token)

    @app.agent(source, concurrency=1)
    async def ingest(stream: faust.Stream) -> None:
        manual = stream.noack()
        state["stream"] = manual
        # Events are taken in small groups (up to 256, or what arrived within 10 ms) so the
        # per-message await of acting on the result is paid once per group. Acks stay
        # manual: take_events on a no-ack stream acknowledges nothing by itself.
        async for events in manual.take_events(256, within=0.01):
            actions = IngestActions()
            now, wall_now = clock(), time.time()
            for event in events:
                msg = event.message
                if msg.offset <= last_offset.get(msg.tp, -1):
                    # Re-delivered after a resume seek: the first copy is already handled.
                    # Not acked here: the first copy's ack marks this offset once consumed.
                    metrics.duplicates_skipped.labels(topics.device_of(msg.topic)).inc()
                    continue
                last_offset[msg.tp] = msg.offset
                tracker.seen(OffsetTracker.key(msg.topic, msg.partition), msg.offset)
                partitions.setdefault(topics.device_of(msg.topic), msg.tp)
                actions.extend(core.on_message(
                    msg.topic, msg.partition, msg.offset, msg.key, event.value, event,
                    now=now, wall_now=wall_now,
                ))
            await perform(actions)

    tick_s = min(0.1, cfg.batcher.window_s / 4)

    lag_state = {"at": 0.0}

    @app.timer(interval=tick_s)
    async def tick() -> None:
        if state["stream"] is None:
            return
        await perform(core.on_tick(clock()))
        now = clock()
        if now - lag_state["at"] >= 1.0 and partitions:
            lag_state["at"] = now
            await update_consumer_lag()

    async def update_consumer_lag() -> None:
        """Records not yet handled per device: end offset - (last offset handled + 1)."""
        tps = list(partitions.values())
        ends = {}
        for tp in tps:
            try:
                # the high watermark of the partition's latest fetch response
                end = app.consumer.highwater(tp)
            except Exception as exc:  # not fetched yet / transient: skip this round
                log.debug("consumer lag of %s unknown: %s", tp, exc)
                continue
            if end is not None and end >= 0:
                ends[tp] = end
        positions = {(tp.topic, tp.partition): last_offset.get(tp, -1) + 1 for tp in tps}
        metrics.record_consumer_lag(
            consumer_lag({(tp.topic, tp.partition): end for tp, end in ends.items()}, positions)
        )

    @app.on_partitions_assigned.connect
    async def assigned(app_: faust.App, assigned: set[TP], **kwargs: Any) -> None:
        for tp in assigned:
            if tp.topic.startswith(topics.SENSOR_PREFIX) and tp.topic != topics.SENSOR_DLQ:
                partitions[topics.device_of(tp.topic)] = tp
        if on_ready is not None and assigned:
            on_ready()

    if extend is not None:
        extend(app)
    _ = (ingest, tick, assigned)  # registered with the app by their decorators
    return app, core
