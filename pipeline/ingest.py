"""Ingest logic of one worker: decode -> buffer -> batch, as a synchronous core.

``IngestCore`` is what the Faust agent calls for every message and on every timer
tick; it returns ``IngestActions`` (batches to hand to the sink, messages to
dead-letter, tokens to acknowledge, partitions to pause or resume) and the agent
performs them. It reads no clock and does no I/O, so it is unit-tested directly.

Accounting invariant, per device, at any moment:
    records decoded = records batched + records dropped (by policy) + buffer depth
and every message read is either decoded or dead-lettered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from monitoring.metrics import Metrics
from pipeline.batching import AdaptiveBatcher, Batch
from pipeline.buffering import StreamBuffer
from pipeline.config import JobConfig
from pipeline.rates import RateEstimator
from streams import codec
from streams.errors import RecordDecodeError, TopicNameError
from streams.records import RecordBatch
from streams.topics import device_of, sensor_topic


@dataclass
class DeadLetter:
    """A rejected message, with where it came from and why; ``token`` acks it once sent."""

    device: str
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    reason: str
    detail: str
    token: Any = None


@dataclass
class IngestActions:
    batches: list[Batch] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    ack: list[Any] = field(default_factory=list)
    pause: list[str] = field(default_factory=list)
    resume: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        """True if there is anything to do (most messages only fill a buffer)."""
        return bool(self.batches or self.dead_letters or self.ack or self.pause or self.resume)

    def extend(self, other: IngestActions) -> None:
        self.batches += other.batches
        self.dead_letters += other.dead_letters
        self.ack += other.ack
        self.pause += other.pause
        self.resume += other.resume


@dataclass
class DeviceLedger:
    """Per-device counts behind the accounting invariant."""

    messages_in: int = 0
    records_in: int = 0
    dead_letter_messages: int = 0
    dead_letters_by_reason: dict[str, int] = field(default_factory=dict)


class _DeviceSeries:
    """The labelled metric children of one device, looked up once."""

    def __init__(self, metrics: Metrics, device: str) -> None:
        self.messages_in = metrics.messages_in.labels(device)
        self.bytes_in = metrics.bytes_in.labels(device)
        self.records_in = metrics.records_in.labels(device)
        self.event_time_lag = metrics.event_time_lag.labels(device)
        self.buffer_depth = metrics.buffer_depth.labels(device)
        self.arrival_rate = metrics.arrival_rate.labels(device)
        self.batches = metrics.batches.labels(device)
        self.batched_records = metrics.batched_records.labels(device)
        self.batch_size = metrics.batch_size.labels(device)


class _Device:
    """Everything ``on_message`` touches for one device, behind one lookup (the hot path)."""

    __slots__ = ("name", "buffer", "batcher", "rate", "ledger", "series", "decoder", "newest_event_time",
                 "read_at")

    def __init__(self, name: str, buffer: StreamBuffer, batcher: AdaptiveBatcher, rate: RateEstimator,
                 ledger: DeviceLedger, series: _DeviceSeries, decoder: codec.Decoder) -> None:
        self.name = name
        self.buffer = buffer
        self.batcher = batcher
        self.rate = rate
        self.ledger = ledger
        self.series = series
        self.decoder = decoder
        self.newest_event_time: float | None = None  # event time of the newest record read
        self.read_at = 0.0  # wall clock when it was read

    def event_time_lag_s(self) -> float:
        if self.newest_event_time is None:
            return 0.0
        return max(0.0, self.read_at - self.newest_event_time)


class IngestCore:
    """Buffers and batchers for the devices one worker consumes.

    Invariant: for every device, ``records_in == batched + dropped + depth``.
    """

    def __init__(
        self,
        cfg: JobConfig,
        devices: list[str],
        metrics: Metrics | None = None,
        *,
        start: float = 0.0,
        expected_shape: tuple[int, ...] | None = None,
        num_classes: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.devices = list(devices)
        self.metrics = metrics or Metrics()
        self.expected_shape = expected_shape
        self.limits = codec.DecodeLimits(
            max_message_bytes=cfg.limits.max_record_message_bytes,
            max_records=cfg.limits.max_records_per_message,
            num_classes=num_classes,
        )
        self.buffers: dict[str, StreamBuffer] = {}
        self.batchers: dict[str, AdaptiveBatcher] = {}
        self.rates: dict[str, RateEstimator] = {}
        self.ledgers: dict[str, DeviceLedger] = {}
        self._series: dict[str, _DeviceSeries] = {}  # labelled children, bound once (hot path)
        self._by_topic: dict[str, _Device] = {}  # sensors.<device> -> its state (hot path)
        for device in self.devices:
            buf = StreamBuffer(
                device, cfg.buffer.capacity, cfg.buffer.policy, cfg.buffer.hard_limit_factor
            )
            self.buffers[device] = buf
            self.batchers[device] = AdaptiveBatcher(
                buf,
                cfg.batcher.mode,
                window_s=cfg.batcher.window_s,
                max_batch=cfg.batcher.max_batch,
                batch_size=cfg.batcher.batch_size,
                window_overflow=cfg.batcher.window_overflow,
                start=start,
            )
            self.rates[device] = RateEstimator(tau_s=max(2.0, 2 * cfg.batcher.window_s), start=start)
            self.ledgers[device] = DeviceLedger()
            self._series[device] = series = _DeviceSeries(self.metrics, device)
            self._by_topic[sensor_topic(device)] = state = _Device(
                device, buf, self.batchers[device], self.rates[device], self.ledgers[device], series,
                self._decoder(device),
            )
            self.metrics.init_device(device)
            self.metrics.buffer_capacity.labels(device).set(cfg.buffer.capacity)
            # Read when scraped, so the hot path sets no gauge per message.
            series.buffer_depth.set_function(lambda buf=buf: buf.depth)
            series.event_time_lag.set_function(state.event_time_lag_s)
            self.metrics.arrival_rate.labels(device).set(0)
            # Create the labelled series up front so dashboards show zeros, not gaps.
            self.metrics.records_in.labels(device)
            self.metrics.batched_records.labels(device)
            self.metrics.partition_paused.labels(device).set(0)

    # --- inputs -----------------------------------------------------------------
    def on_message(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        token: Any,
        now: float,
        wall_now: float,
    ) -> IngestActions:
        """Handle one Kafka message from a device topic."""
        # The hot path: one lookup for the device's state, counters only (gauges are read
        # when scraped, the arrival rate is published on ticks).
        actions = IngestActions()
        state = self._by_topic.get(topic)
        if state is None:
            actions.dead_letters.append(self._foreign(topic, partition, offset, key, value, token))
            return actions
        device = state.name
        ledger = state.ledger
        series = state.series
        ledger.messages_in += 1
        series.messages_in.inc()
        data = value or b""
        series.bytes_in.inc(len(data))
        try:
            batch = state.decoder.decode(data)
        except RecordDecodeError as exc:
            actions.dead_letters.append(
                self._dead_letter(device, topic, partition, offset, key, data, exc.reason, exc.detail, token)
            )
            return actions
        if self.expected_shape is None:
            self.expected_shape = batch.feature_shape  # the first good message fixes it
            for other in self._by_topic.values():
                other.decoder = self._decoder(other.name)
        self._accept(state, batch, token, now, wall_now, actions)
        return actions

    def on_run(self, topic: str, values: list[bytes], token: Any, now: float, wall_now: float) -> IngestActions | None:
        """Consecutive messages of one device topic as one buffer chunk, or None.

        Same outcome as ``on_message`` for each of them (counts, buffer contents,
        batches, drops), except that the chunk's one ``token`` is released when all
        their records have left the buffer, and the depth's high-water mark may be
        higher by up to the run (it enters the buffer at once). None, with nothing done,
        unless every message shares the stream's last good header and passes every
        check, and the run cannot make the buffer ask for a pause: the caller then hands
        them to ``on_message`` one by one (which dead-letters exactly the bad ones and
        pauses at the exact message).
        """
        state = self._by_topic.get(topic)
        if state is None or not values:
            return None
        layout = state.decoder.last_layout
        if layout is None or state.buffer.would_pause(layout.count * len(values)):
            return None
        batch = state.decoder.decode_run(values)
        if batch is None:
            return None
        state.ledger.messages_in += len(values)
        state.series.messages_in.inc(len(values))
        state.series.bytes_in.inc(layout.size * len(values))
        actions = IngestActions()
        self._accept(state, batch, token, now, wall_now, actions)
        return actions

    def _accept(self, state: _Device, batch: RecordBatch, token: Any, now: float, wall_now: float,
                actions: IngestActions) -> None:
        """Decoded records of ``state``'s device: count, buffer, batch, maybe pause."""
        count = batch.count
        state.ledger.records_in += count
        state.series.records_in.inc(count)
        state.rate.observe(count, now)
        state.newest_event_time = float(batch.event_time[-1])
        state.read_at = wall_now
        buf = state.buffer
        pushed = buf.push(batch, token)
        if pushed.dropped:
            self.metrics.buffer_dropped.labels(state.name, "overflow").inc(pushed.dropped)
            actions.ack += pushed.released
        for b in state.batcher.on_arrival(now):
            self._emitted(b, actions)
        if buf.pause_needed():
            actions.pause.append(state.name)
            self.metrics.partition_paused.labels(state.name).set(1)
            self.metrics.partition_pauses.labels(state.name).inc()

    def _decoder(self, device: str) -> codec.Decoder:
        return codec.Decoder(self.limits, expected_device=device, expected_shape=self.expected_shape)

    def _foreign(
        self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None, token: Any
    ) -> DeadLetter:
        """A message from a topic that is no device topic of this worker."""
        try:
            device = device_of(topic)
        except TopicNameError as exc:
            return self._dead_letter("unknown", topic, partition, offset, key, value, "bad_device", str(exc), token)
        return self._dead_letter(device, topic, partition, offset, key, value, "bad_device",
                                 f"device {device!r} is not assigned to this worker", token)

    def on_tick(self, now: float) -> IngestActions:
        """Timer: close elapsed windows, refresh gauges, resume drained partitions."""
        actions = IngestActions()
        for device, batcher in self.batchers.items():
            for b in batcher.poll(now):
                self._emitted(b, actions)
            for drop in batcher.take_drops():
                self.metrics.buffer_dropped.labels(device, "window_truncate").inc(drop.dropped)
                actions.ack += drop.released
            self._update_gauges(device, now)
        return actions

    def after_sink(self, device: str) -> IngestActions:
        """After the sink took a batch of ``device``: maybe resume its partition."""
        actions = IngestActions()
        if self.buffers[device].resume_needed():
            actions.resume.append(device)
            self.metrics.partition_paused.labels(device).set(0)
        return actions

    def flush(self, now: float) -> IngestActions:
        """Emit every buffered record as a final batch per device (end of a bounded run)."""
        actions = IngestActions()
        for batcher in self.batchers.values():
            b = batcher.flush(now)
            if b is not None:
                self._emitted(b, actions)
        return actions

    # --- bookkeeping --------------------------------------------------------------
    def _emitted(self, batch: Batch, actions: IngestActions) -> None:
        series = self._series[batch.device]
        series.batches.inc()
        series.batched_records.inc(batch.size)
        series.batch_size.observe(batch.size)
        actions.batches.append(batch)

    def _dead_letter(
        self, device: str, topic: str, partition: int, offset: int, key: bytes | None,
        value: bytes | None, reason: str, detail: str, token: Any,
    ) -> DeadLetter:
        if device in self.ledgers:
            ledger = self.ledgers[device]
            ledger.dead_letter_messages += 1
            ledger.dead_letters_by_reason[reason] = ledger.dead_letters_by_reason.get(reason, 0) + 1
        self.metrics.dead_letters.labels(device, reason).inc()
        return DeadLetter(device, topic, partition, offset, key, value or b"", reason, detail, token)

    def _update_gauges(self, device: str, now: float) -> None:
        self._series[device].arrival_rate.set(self.rates[device].rate_hz(now))

    def accounting(self) -> dict[str, dict[str, int]]:
        """Per-device counts: decoded, batched, dropped, buffered, dead-lettered."""
        out = {}
        for device in self.devices:
            buf = self.buffers[device]
            ledger = self.ledgers[device]
            out[device] = {
                "messages_in": ledger.messages_in,
                "records_in": ledger.records_in,
                "batched": self.batchers[device].batched_records_total,
                "dropped": buf.dropped_total,
                "buffered": buf.depth,
                "max_depth": buf.max_depth,
                "pauses": buf.pauses_total,
                "dead_letter_messages": ledger.dead_letter_messages,
            }
        return out
