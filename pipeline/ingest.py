"""Ingest logic of one worker: decode -> buffer -> batch, as a synchronous core.

``IngestCore`` is what the ingest source calls for every message and on every timer
tick; it returns ``IngestActions`` (batches to hand to the sink, messages to
dead-letter, tokens to acknowledge, partitions to pause or resume) and the driver
performs them. It reads no clock and does no I/O, so it is unit-tested directly.

Every message read gets its token registered here with the number of records it
carries (0 for a message rejected whole). Each record is later *settled* exactly once:
consumed by the sink (trained, in a training job), dropped by a counted buffer or
window policy, or dead-lettered (out of its declared range at ingest, or in a training
step that was rejected). A token is acknowledged once all its records are settled
(and its dead letter, if any, is durable), never before.

Accounting invariant, per device, at any moment (``DeviceLedger``)::

    records_in == consumed + dropped + dead_records + buffered + in_sink

where ``buffered`` is the buffer depth and ``in_sink`` the records of batches handed
to the sink and not settled yet; every message read is decoded or dead-lettered whole.
``resolved`` ledgers count only fully settled tokens: with the tracker's watermarks
they are what a checkpoint stores, so a restarted worker continues the ledger exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgestream.job.config import JobConfig
from edgestream.monitoring.metrics import Metrics
from edgestream.streams import codec
from edgestream.streams.batching import AdaptiveBatcher, Batch
from edgestream.streams.buffering import Sources, StreamBuffer
from edgestream.streams.dedup import SeqWindow
from edgestream.streams.errors import RecordDecodeError, TopicNameError
from edgestream.streams.eventtime import BAD_TIMESTAMP, EventTimeCheck
from edgestream.streams.formats import FormatDecoder
from edgestream.streams.labels import Joined, LabelDecoder, LabelJoin, Waiting
from edgestream.streams.rates import RateEstimator
from edgestream.streams.records import RecordBatch, pick_origin, with_origin


@dataclass
class DeadLetter:
    """A rejected message (or the rejected records of one), with where it came from and why.

    ``value`` is what goes to the dead-letter topic: the message itself, or the rejected
    records re-encoded (``records`` > 0). ``token`` is acknowledged once the letter is
    durable and the message's other records are settled.
    """

    device: str
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    reason: str
    detail: str
    token: Any = None
    records: int = 0  # > 0: these records of a decoded message, not the whole message


@dataclass
class IngestActions:
    batches: list[Batch] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    ack: list[Any] = field(default_factory=list)
    pause: list[str] = field(default_factory=list)
    resume: list[str] = field(default_factory=list)
    #: Readings that began waiting for their label: the model's prediction for each is wanted
    #: now (``Waiting.prediction``), to score against the label when it comes.
    predict: list[Waiting] = field(default_factory=list)

    def __bool__(self) -> bool:
        """True if there is anything to do (most messages only fill a buffer)."""
        return bool(self.batches or self.dead_letters or self.ack or self.pause or self.resume or self.predict)

    def extend(self, other: IngestActions) -> None:
        self.batches += other.batches
        self.dead_letters += other.dead_letters
        self.ack += other.ack
        self.pause += other.pause
        self.resume += other.resume
        self.predict += other.predict


#: Checkpoint keys (no device id can be either) of the summed counts of the devices a shared
#: topic's worker forgot, and of how many it forgot.
EVICTED = "*evicted"
EVICTED_DEVICES = "*evicted_devices"
#: The device label of a message of a shared topic that names no device.
UNKNOWN_DEVICE = "(none)"

#: Seconds between updates of the arrival-rate gauges on ticks (a worker may hold thousands
#: of devices, and ticks come every few tens of milliseconds).
GAUGE_INTERVAL_S = 0.5

#: Outcomes a record can be settled with.
CONSUMED, DROPPED, DEAD = "consumed", "dropped", "dead"
#: The drop reason of a record whose sequence number its device sent before.
DUPLICATE = "duplicate"
#: Drop reasons of a reading whose label did not come within ``labels.max_delay_s``, and of
#: one pushed out of a full label wait (``labels.max_pending``).
UNLABELED, LABEL_WAIT_FULL = "unlabeled", "label_wait_full"
#: The device label of a label message's dead letter (it may name many devices).
LABELS_DEVICE = "(labels)"


@dataclass
class DeviceLedger:
    """Per-device counts behind the accounting invariant (records unless named messages)."""

    messages_in: int = 0
    records_in: int = 0
    consumed: int = 0
    dropped: int = 0
    dead_records: int = 0
    dead_letter_messages: int = 0
    dead_letters_by_reason: dict[str, int] = field(default_factory=dict)  # messages rejected whole
    dead_records_by_reason: dict[str, int] = field(default_factory=dict)
    dropped_by_reason: dict[str, int] = field(default_factory=dict)  # overflow, window_truncate, duplicate

    def to_dict(self) -> dict[str, Any]:
        return {
            "messages_in": self.messages_in, "records_in": self.records_in, "consumed": self.consumed,
            "dropped": self.dropped, "dead_records": self.dead_records,
            "dead_letter_messages": self.dead_letter_messages,
            "dead_letters_by_reason": dict(self.dead_letters_by_reason),
            "dead_records_by_reason": dict(self.dead_records_by_reason),
            "dropped_by_reason": dict(self.dropped_by_reason),
        }

    #: The plain counts (the rest are counts by reason).
    COUNTS = ("messages_in", "records_in", "consumed", "dropped", "dead_records", "dead_letter_messages")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceLedger:
        ints = {k: int(data.get(k, 0)) for k in cls.COUNTS}
        return cls(**ints,
                   dead_letters_by_reason={str(k): int(v) for k, v in data.get("dead_letters_by_reason", {}).items()},
                   dead_records_by_reason={str(k): int(v) for k, v in data.get("dead_records_by_reason", {}).items()},
                   dropped_by_reason={str(k): int(v) for k, v in data.get("dropped_by_reason", {}).items()})

    def copy(self) -> DeviceLedger:
        return DeviceLedger.from_dict(self.to_dict())

    def absorb(self, other: DeviceLedger) -> None:
        """Add ``other``'s counts to these (a forgotten device's into a worker's sums)."""
        for key in self.COUNTS:
            setattr(self, key, getattr(self, key) + getattr(other, key))
        for mine, theirs in ((self.dead_letters_by_reason, other.dead_letters_by_reason),
                             (self.dead_records_by_reason, other.dead_records_by_reason),
                             (self.dropped_by_reason, other.dropped_by_reason)):
            for reason, n in theirs.items():
                mine[reason] = mine.get(reason, 0) + n

    def add_dead_records(self, reason: str, n: int) -> None:
        self.dead_records += n
        self.dead_records_by_reason[reason] = self.dead_records_by_reason.get(reason, 0) + n

    def add_dropped(self, reason: str, n: int) -> None:
        self.dropped += n
        self.dropped_by_reason[reason] = self.dropped_by_reason.get(reason, 0) + n


class _OpenToken:
    """One registered token whose records are not all settled yet."""

    __slots__ = ("device", "messages", "records", "remaining", "consumed", "dropped", "dead", "dead_reasons",
                 "whole_reason", "dropped_reasons", "seqs", "label_tokens")

    def __init__(self, device: str, messages: int, records: int) -> None:
        self.device = device
        self.messages = messages
        self.records = records
        self.remaining = records
        self.consumed = 0
        self.dropped = 0
        self.dead = 0
        self.dead_reasons: dict[str, int] | None = None
        self.whole_reason: str | None = None  # the message was dead-lettered whole, for this reason
        self.dropped_reasons: dict[str, int] | None = None
        self.seqs: np.ndarray | None = None  # sequence numbers it brought into the duplicate window
        self.label_tokens: list[Any] | None = None  # label messages whose labels joined its records


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
                 "read_at", "in_sink", "seen", "clock", "partition", "last_at", "open", "awaiting")

    def __init__(self, name: str, buffer: StreamBuffer, batcher: AdaptiveBatcher, rate: RateEstimator,
                 ledger: DeviceLedger, series: _DeviceSeries, decoder: FormatDecoder) -> None:
        self.name = name
        self.buffer = buffer
        self.batcher = batcher
        self.rate = rate
        self.ledger = ledger
        self.series = series
        self.decoder = decoder
        self.newest_event_time: float | None = None  # event time of the newest record read
        self.read_at = 0.0  # wall clock when it was read
        self.in_sink = 0  # records of batches handed to the sink, not settled yet
        self.seen: SeqWindow | None = None  # sequence numbers read (data.duplicate_window)
        self.clock: EventTimeCheck | None = None  # event times vs the broker's (data.max_timestamp_skew_s)
        self.partition: int | None = None  # a shared topic: the partition its messages came from
        self.last_at = 0.0  # ingest clock of its last message (a shared topic's idle eviction)
        self.open = 0  # its registered tokens not settled yet
        self.awaiting = 0  # readings waiting for their label (labels.topic)

    def event_time_lag_s(self) -> float:
        if self.newest_event_time is None:
            return 0.0
        return max(0.0, self.read_at - self.newest_event_time)

    @property
    def pending(self) -> int:
        """Records read and not settled: waiting for a label, in the buffer or in batches the sink holds."""
        return self.buffer.depth + self.in_sink + self.awaiting


class IngestCore:
    """Buffers and batchers for the devices one worker consumes, and the record ledger.

    Invariant: for every device, ``records_in == consumed + dropped + dead_records +
    buffer depth + in_sink`` (see the module docstring), and a token appears in
    ``IngestActions.ack`` exactly once, when its last record was settled.
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
        value_range: tuple[np.ndarray, np.ndarray] | None = None,
        restored: dict[str, dict[str, Any]] | None = None,
        require_labels: bool = False,
    ) -> None:
        """``value_range``: declared (lo, hi) of every feature (records outside are
        dead-lettered as ``out_of_range``); ``restored``: the resolved ledgers of a
        checkpoint (``resolved_ledgers()``), which both ledgers continue from, and the
        duplicate windows too (each device's ``"seen"``: only numbers of settled messages,
        so a message re-read because it was not settled is handled again, not dropped);
        ``require_labels``: dead-letter messages without labels (a training job).
        ``cfg.data.duplicate_window`` and ``cfg.data.max_timestamp_skew_s`` set the
        duplicate and event-time checks (``_admit``)."""
        self.cfg = cfg
        self.devices: list[str] = []  # those it holds state for, in the order met
        self.metrics = metrics or Metrics()
        self.expected_shape = expected_shape
        self.value_range = value_range
        self.require_labels = require_labels
        self.input_format, self.input_params = cfg.input.resolved()  # input.format: how devices write
        self.layout = cfg.input.layout()  # input.topic: where each device writes
        self.limits = codec.DecodeLimits(
            max_message_bytes=cfg.limits.max_record_message_bytes,
            max_records=cfg.limits.max_records_per_message,
            num_classes=num_classes,
        )
        self.buffers: dict[str, StreamBuffer] = {}
        self.batchers: dict[str, AdaptiveBatcher] = {}
        self.rates: dict[str, RateEstimator] = {}
        self.ledgers: dict[str, DeviceLedger] = {}
        self.resolved: dict[str, DeviceLedger] = {}
        self._open: dict[Any, _OpenToken] = {}
        self._series: dict[str, _DeviceSeries] = {}  # labelled children, bound once (hot path)
        self._by_topic: dict[str, _Device] = {}  # the device's topic -> its state (hot path)
        self._by_name: dict[str, _Device] = {}
        #: Per device, the sequence numbers of fully settled messages: the checkpoint's window.
        self.resolved_seen: dict[str, SeqWindow] = {}
        self._start = start
        restored = dict(restored or {})
        #: Counts of the devices a shared topic's worker forgot (``evict``), summed: with the
        #: ledgers of the devices it holds, every record it read.
        self.evicted = DeviceLedger.from_dict(restored.pop(EVICTED, {}))
        self.devices_evicted = int(restored.pop(EVICTED_DEVICES, 0))
        #: Restored ledgers of devices not met since the restart (a shared topic's).
        self._restored = restored
        #: A shared topic (``input.topic`` without ``{device}``): its name; its messages' device
        #: is their key (or, without a key, the device the message names).
        self._shared = self.layout.pattern if self.layout.keyed else None
        self._keyless: FormatDecoder | None = None
        self._evicted_at = start
        self._gauges_at = -GAUGE_INTERVAL_S  # the first tick sets them
        #: Delayed labels (``labels.topic``): readings without a label wait in ``label_join``.
        self.labels_topic: str | None = cfg.labels.topic or None
        self.label_join: LabelJoin | None = None
        self.label_decoder: LabelDecoder | None = None
        #: Label messages not settled yet: their labels still to join, or joined to readings
        #: whose message is not settled (a label is committed only with its reading).
        self._label_open: dict[Any, int] = {}
        #: What became of the labels read: ``joined``, ``late``, ``foreign``, and label
        #: messages ``dead_lettered``; ``scored``/``correct``: the arrival-time predictions.
        self.label_counts = {"read": 0, "joined": 0, "late": 0, "foreign": 0, "dead_lettered": 0,
                             "scored": 0, "correct": 0}
        #: Set by a driver that can ask the model (``IngestActions.predict``).
        self.predict_on_arrival = False
        #: Stamp each record's source message on it (``RecordBatch.origin``): the job publishes
        #: a prediction per trained record, which names it (``serve.predictions``).
        self.stamp_origin = bool(cfg.serve.predictions)
        if self.labels_topic is not None:
            self.label_decoder = LabelDecoder(cfg.labels.fields(), num_classes,
                                              max_bytes=cfg.limits.max_record_message_bytes,
                                              max_labels=cfg.limits.max_records_per_message)
            self.label_join = join = LabelJoin(cfg.labels.max_delay_s, cfg.labels.max_pending)
            self.metrics.label_waiting.set_function(lambda: join.waiting)
            self.metrics.label_early.set_function(lambda: join.early)
        for device in devices:
            self._add_device(device)
        self.metrics.devices_held.set_function(lambda: len(self._by_name))

    def _add_device(self, device: str) -> _Device:
        """The state of a device met for the first time (or again after ``evict``)."""
        cfg = self.cfg
        self.devices.append(device)
        restored = self._restored.pop(device, {})
        buf = StreamBuffer(device, cfg.buffer.capacity, cfg.buffer.policy, cfg.buffer.hard_limit_factor)
        self.buffers[device] = buf
        self.batchers[device] = batcher = AdaptiveBatcher(
            buf,
            cfg.batcher.mode,
            window_s=cfg.batcher.window_s,
            max_batch=cfg.batcher.max_batch,
            batch_size=cfg.batcher.batch_size,
            window_overflow=cfg.batcher.window_overflow,
            start=self._start,
            max_batch_widen=cfg.batcher.max_batch_widen,
        )
        self.rates[device] = RateEstimator(tau_s=max(2.0, 2 * cfg.batcher.window_s), start=self._start)
        self.resolved[device] = DeviceLedger.from_dict(restored)
        self.ledgers[device] = ledger = self.resolved[device].copy()
        self._series[device] = series = _DeviceSeries(self.metrics, device)
        state = _Device(device, buf, batcher, self.rates[device], ledger, series, self._decoder(device))
        if not self.layout.keyed:
            self._by_topic[self.layout.topic(device)] = state
        self._by_name[device] = state
        window = cfg.data.duplicate_window
        if window:
            stored = restored.get("seen")
            self.resolved_seen[device] = SeqWindow.from_dict(stored, window) if stored else SeqWindow(window)
            state.seen = self.resolved_seen[device].copy()
        skew_s = cfg.data.timestamp_skew_s()
        if skew_s is not None:
            state.clock = EventTimeCheck(skew_s)
        self.metrics.init_device(device, reasons=not self.layout.keyed)
        self.metrics.buffer_capacity.labels(device).set(cfg.buffer.capacity)
        # Read when scraped, so the hot path sets no gauge per message.
        series.buffer_depth.set_function(lambda buf=buf: buf.depth)
        series.event_time_lag.set_function(state.event_time_lag_s)
        self.metrics.device_backlog.labels(device).set_function(
            lambda state=state, batcher=batcher: batcher.backlog(state.pending))
        self.metrics.batch_cap.labels(device).set_function(lambda batcher=batcher: batcher.batch_cap)
        for kind, read in (
            ("read", lambda ledger=ledger: ledger.records_in),
            ("trained", lambda ledger=ledger: ledger.consumed),
            ("dropped", lambda ledger=ledger: ledger.dropped),
            ("dead_lettered", lambda ledger=ledger: ledger.dead_records),
            ("pending", lambda state=state: state.pending),
        ):
            self.metrics.ledger_records.labels(device, kind).set_function(read)
        self.metrics.ledger_dead_letter_messages.labels(device).set_function(
            lambda ledger=ledger: ledger.dead_letter_messages)
        self.metrics.arrival_rate.labels(device).set(0)
        self.metrics.partition_paused.labels(device).set(0)
        return state

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
        timestamp_s: float | None = None,
    ) -> IngestActions:
        """Handle one Kafka message from a device topic; ``timestamp_s``: its Kafka
        timestamp (seconds), which its records' event times are checked against (none:
        no event-time check)."""
        # The hot path: one lookup for the device's state, counters only (gauges are read
        # when scraped, the arrival rate is published on ticks).
        actions = IngestActions()
        state = self._by_topic.get(topic)
        if state is None:
            if topic == self.labels_topic:
                return self._on_labels(topic, partition, offset, key, value, token, now)
            if topic != self._shared:
                actions.dead_letters.append(self._foreign(topic, partition, offset, key, value, token))
                return actions
            state = self._keyed_state(topic, partition, offset, key, value, token, timestamp_s, now, actions)
            if state is None:
                return actions
        device = state.name
        ledger = state.ledger
        series = state.series
        ledger.messages_in += 1
        series.messages_in.inc()
        data = value or b""
        series.bytes_in.inc(len(data))
        try:
            batch = state.decoder.decode(data, timestamp_s=timestamp_s, offset=offset)
        except codec.OutOfRange as exc:
            self._split_out_of_range(state, topic, partition, offset, key, exc, token, timestamp_s, now, wall_now,
                                     actions)
            return actions
        except RecordDecodeError as exc:
            actions.dead_letters.append(
                self._dead_letter(device, topic, partition, offset, key, data, exc.reason, exc.detail, token)
            )
            return actions
        if self.require_labels and batch.labels is None and self.label_join is None:
            actions.dead_letters.append(self._dead_letter(
                device, topic, partition, offset, key, data, "no_labels",
                "this job trains, and the message carries no labels", token))
            return actions
        if self.expected_shape is None:
            self.expected_shape = batch.feature_shape  # the first good message fixes it
            for other in self._by_topic.values():
                other.decoder = self._decoder(other.name)
        self._register(token, device, 1, batch.count)
        if self.stamp_origin:
            batch = with_origin(batch, partition, offset, timestamp_s)
        self._admit(state, topic, partition, offset, key, batch, token, timestamp_s, now, wall_now, actions)
        return actions

    def on_run(self, topic: str, values: list[bytes], token: Any, now: float, wall_now: float,
               timestamps_s: Sequence[float] | np.ndarray | None = None, *, partition: int = 0,
               offsets: Sequence[int] | None = None) -> IngestActions | None:
        """Consecutive messages of one device topic as one buffer chunk, or None.

        Same outcome as ``on_message`` for each of them (counts, buffer contents,
        batches, drops), except that the chunk's one ``token`` is acknowledged when all
        their records are settled, and the depth's high-water mark may be higher by up
        to the run (it enters the buffer at once). None, with nothing done, unless every
        message shares the stream's last good header and passes every check, and the run
        cannot make the buffer ask for a pause, no event time is off the Kafka timestamps
        (``timestamps_s``, one per message) and no sequence number is a duplicate: the
        caller then hands them to ``on_message`` one by one (which dead-letters or drops
        exactly the bad ones and pauses at the exact message). ``partition`` and ``offsets``
        (one per message) say where they are, for ``RecordBatch.origin``.
        """
        state = self._by_topic.get(topic)  # None for a shared topic: its runs mix devices
        if state is None or not values:
            return None
        layout = state.decoder.last_layout
        if layout is None or state.buffer.would_pause(layout.count * len(values)):
            return None
        batch = state.decoder.decode_run(values)
        if batch is None:
            return None
        if self.require_labels and batch.labels is None and self.label_join is None:
            return None  # on_message dead-letters each (no_labels)
        clock, seen = state.clock, state.seen
        times = None if timestamps_s is None else np.asarray(timestamps_s, dtype=np.float64)
        if clock is not None and times is not None and not clock.run_passes(
            batch.event_time, float(times.min()), float(times.max())
        ):
            reference = np.repeat(times, layout.count)
            if clock.verdict(batch.event_time, reference).count:
                return None
        if seen is not None and not seen.all_new(batch.seq):
            return None
        if self.stamp_origin:
            per = batch.count // len(values)  # every message of a run has the same readings
            stamped = offsets is not None and per * len(values) == batch.count
            batch = with_origin(batch, partition, np.repeat(np.asarray(offsets), per) if stamped else -1,
                                None if times is None else np.repeat(times, per))
        state.ledger.messages_in += len(values)
        state.series.messages_in.inc(len(values))
        state.series.bytes_in.inc(sum(map(len, values)))  # a JSON run's messages differ in size
        actions = IngestActions()
        self._register(token, state.name, len(values), batch.count)
        if clock is not None and times is not None:
            clock.accept(batch.event_time)
        if seen is not None:
            seen.add_new(batch.seq)  # all new (checked above)
            self._open[token].seqs = batch.seq
        self._accept(state, batch, token, now, wall_now, actions)
        return actions

    def _split_out_of_range(self, state: _Device, topic: str, partition: int, offset: int, key: bytes | None,
                            exc: codec.OutOfRange, token: Any, timestamp_s: float | None, now: float,
                            wall_now: float, actions: IngestActions) -> None:
        """A decoded message with records outside the declared range: those records go to
        the dead-letter topic (re-encoded, with the reason), the others on as usual."""
        batch, bad = exc.batch, exc.bad
        if self.stamp_origin:
            batch = with_origin(batch, partition, offset, timestamp_s)
        n_bad = int(bad.sum())
        self._register(token, state.name, 1, batch.count)
        rejected = _select(batch, bad)
        actions.dead_letters.append(DeadLetter(
            state.name, topic, partition, offset, key, codec.encode(rejected), exc.reason, exc.detail, token,
            records=n_bad,
        ))
        self.metrics.dead_letter_records.labels(state.name, exc.reason).inc(n_bad)
        if n_bad < batch.count:
            if self.expected_shape is None:
                self.expected_shape = batch.feature_shape
            self._admit(state, topic, partition, offset, key, _select(batch, ~bad), token, timestamp_s, now,
                        wall_now, actions)

    def _admit(self, state: _Device, topic: str, partition: int, offset: int, key: bytes | None,
               batch: RecordBatch, token: Any, timestamp_s: float | None, now: float, wall_now: float,
               actions: IngestActions) -> None:
        """Decoded records of a registered message: those whose event time is off the
        message's Kafka timestamp go to the dead-letter topic (``bad_timestamp``), those
        whose sequence number the device sent before are dropped (``duplicate``), the rest
        on to the buffer (``_accept``)."""
        clock = state.clock
        if clock is not None and timestamp_s is not None and not clock.accept_if_clean(batch.event_time, timestamp_s):
            verdict = clock.verdict(batch.event_time, timestamp_s)
            if verdict.count:
                actions.dead_letters.append(DeadLetter(
                    state.name, topic, partition, offset, key, codec.encode(_select(batch, verdict.bad)),
                    BAD_TIMESTAMP, verdict.detail, token, records=verdict.count,
                ))
                self.metrics.dead_letter_records.labels(state.name, BAD_TIMESTAMP).inc(verdict.count)
                if verdict.count == batch.count:
                    return
                batch = _select(batch, ~verdict.bad)
            clock.accept(batch.event_time)
        if state.seen is not None and state.seen.add_if_new(batch.seq):
            self._open[token].seqs = batch.seq
        elif state.seen is not None:
            duplicate = state.seen.check_and_add(batch.seq)
            n_duplicate = int(duplicate.sum())
            if n_duplicate:
                self.metrics.duplicate_records.labels(state.name).inc(n_duplicate)
                if n_duplicate < batch.count:
                    batch = _select(batch, ~duplicate)
                    self._open[token].seqs = batch.seq
                actions.ack += self._settle([(token, n_duplicate)], DROPPED, DUPLICATE)
                if n_duplicate == int(duplicate.size):
                    return
            else:
                self._open[token].seqs = batch.seq
        self._accept(state, batch, token, now, wall_now, actions)

    def _register(self, token: Any, device: str, messages: int, records: int) -> None:
        self._open[token] = _OpenToken(device, messages, records)
        state = self._by_name[device]
        state.open += 1
        state.ledger.records_in += records
        state.series.records_in.inc(records)

    def _accept(self, state: _Device, batch: RecordBatch, token: Any, now: float, wall_now: float,
                actions: IngestActions) -> None:
        """Decoded records of ``state``'s device: buffer, batch, maybe pause (or, without
        labels in a job whose labels come later, wait for them)."""
        state.rate.observe(batch.count, now)
        state.newest_event_time = float(batch.event_time[-1])
        state.read_at = wall_now
        if batch.labels is None and self.label_join is not None:
            self._hold(state, batch, token, now, actions)
            return
        self._buffer(state, batch, token, now, actions)

    def _buffer(self, state: _Device, batch: RecordBatch, token: Any, now: float, actions: IngestActions) -> None:
        buf = state.buffer
        pushed = buf.push(batch, token)
        if pushed.dropped:
            self.metrics.buffer_dropped.labels(state.name, "overflow").inc(pushed.dropped)
            actions.ack += self._settle(pushed.sources, DROPPED, "overflow")
        for b in state.batcher.on_arrival(now):
            self._emitted(b, actions)
        if buf.pause_needed():
            actions.pause.append(state.name)
            self.metrics.partition_paused.labels(state.name).set(1)
            self.metrics.partition_pauses.labels(state.name).inc()

    # --- delayed labels -------------------------------------------------------------------
    def _hold(self, state: _Device, batch: RecordBatch, token: Any, now: float, actions: IngestActions) -> None:
        """Readings without labels: each joins a label that came first, or waits for its own."""
        assert self.label_join is not None and self.label_decoder is not None
        keys = self.label_decoder.keys_of(batch.seq, batch.event_time)
        held = self.label_join.hold(state.name, keys, batch, token, now)
        state.awaiting += batch.count - len(held.joined) - len(held.duplicates)
        if held.duplicates:
            self.metrics.duplicate_records.labels(state.name).inc(len(held.duplicates))
            actions.ack += self._settle([(token, len(held.duplicates))], DROPPED, DUPLICATE)
        if self.predict_on_arrival:
            actions.predict += held.waiting
        self._leave_unlabeled(held.evicted, LABEL_WAIT_FULL, actions)
        self._joined(held.joined, now, actions, waited=False)

    def _on_labels(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                   token: Any, now: float) -> IngestActions:
        """A label message: each label joins its waiting reading, waits for it, or (a device
        another worker reads) is passed over; a message that cannot be read is dead-lettered."""
        assert self.label_join is not None and self.label_decoder is not None
        actions = IngestActions()
        try:
            labels = self.label_decoder.decode(value or b"", key)
        except RecordDecodeError as exc:
            self.label_counts["dead_lettered"] += 1
            actions.dead_letters.append(self._dead_letter(LABELS_DEVICE, topic, partition, offset, key, value,
                                                          exc.reason, exc.detail, token))
            return actions
        self.label_counts["read"] += len(labels)
        self._label_open[token] = len(labels)
        joined = []
        for label in labels:
            if not self.layout.keyed and label.device not in self._by_name:
                self._label_outcome("foreign")
                actions.ack += self._release_label(token)
                continue
            match, late = self.label_join.give(label, token, now)
            if match is not None:
                joined.append(match)
            for old in late:
                self._label_outcome("late")
                actions.ack += self._release_label(old)
        self._joined(joined, now, actions, waited=True)
        return actions

    def _joined(self, joined: list[Joined], now: float, actions: IngestActions, *, waited: bool) -> None:
        """Readings that met their label (``waited``: in the label wait; else as they came):
        on to the buffer, labelled, under their own token, which then also carries the
        label's (committed when the reading is settled)."""
        if not joined:
            return
        groups: dict[Any, list[Joined]] = {}
        for j in joined:
            groups.setdefault(j.reading.token, []).append(j)
        counts = self.label_counts
        scored = correct = 0
        for group in groups.values():
            first = group[0].reading
            state = self._by_name[first.device]
            entry = self._open[first.token]
            if entry.label_tokens is None:
                entry.label_tokens = []
            index = np.fromiter((j.reading.index for j in group), dtype=np.int64, count=len(group))
            labels = np.fromiter((j.label for j in group), dtype=np.int32, count=len(group))
            for j in group:
                entry.label_tokens.append(j.label_token)
                if j.reading.prediction >= 0:
                    scored += 1
                    correct += j.reading.prediction == j.label
            source = first.batch
            batch = RecordBatch(device=first.device, seq=source.seq[index], event_time=source.event_time[index],
                                features=source.features[index], labels=labels, origin=pick_origin(source, index))
            if waited:
                state.awaiting -= len(group)
            self._label_outcome("joined", len(group))
            self._buffer(state, batch, first.token, now, actions)
        if scored:
            counts["scored"] += scored
            counts["correct"] += correct
            self.metrics.label_prequential_records.inc(scored)
            self.metrics.label_prequential_correct.inc(correct)

    def _leave_unlabeled(self, readings: list[Waiting], reason: str, actions: IngestActions) -> None:
        """Readings that leave the label wait without a label: dropped, counted per reason."""
        groups: dict[Any, list[Waiting]] = {}
        for w in readings:
            groups.setdefault(w.token, []).append(w)
        for group in groups.values():
            device, token = group[0].device, group[0].token
            self._by_name[device].awaiting -= len(group)
            self.metrics.buffer_dropped.labels(device, reason).inc(len(group))
            actions.ack += self._settle([(token, len(group))], DROPPED, reason)

    def _label_outcome(self, outcome: str, n: int = 1) -> None:
        self.label_counts[outcome] += n
        self.metrics.labels_read.labels(outcome).inc(n)

    def _release_label(self, token: Any) -> list[Any]:
        """One label of a label message is settled; the token if that was its last."""
        left = self._label_open[token] - 1
        if left:
            self._label_open[token] = left
            return []
        del self._label_open[token]
        return [token]

    # --- a shared topic's devices ----------------------------------------------------------
    def _keyed_state(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                     token: Any, timestamp_s: float | None, now: float, actions: IngestActions) -> _Device | None:
        """The state of the device a message of the shared topic is from: its key, or
        without a key the device the message names (a format that carries one). None, with
        the message dead-lettered (``bad_device``), when neither names a device."""
        if key is None:
            decoder = self._keyless_decoder()
            if decoder is None:
                actions.dead_letters.append(self._dead_letter(
                    UNKNOWN_DEVICE, topic, partition, offset, key, value, "bad_device",
                    f"a message of the shared topic {topic} needs its device id as its key "
                    "(or, in a format that carries one, in the message: input.device)", token))
                return None
            try:
                device = decoder.decode(value or b"", timestamp_s=timestamp_s, offset=offset).device
            except codec.OutOfRange as exc:
                device = exc.batch.device
            except RecordDecodeError as exc:
                actions.dead_letters.append(self._dead_letter(
                    UNKNOWN_DEVICE, topic, partition, offset, key, value, exc.reason, exc.detail, token))
                return None
        else:
            try:
                device = key.decode("utf-8")
            except UnicodeDecodeError:
                device = ""
            if not codec.DEVICE_RE.fullmatch(device):
                actions.dead_letters.append(self._dead_letter(
                    UNKNOWN_DEVICE, topic, partition, offset, key, value, "bad_device",
                    f"the key {key[:80]!r} is not a device id (1-64 of letters, digits, '_', '.', '-')", token))
                return None
        state = self._by_name.get(device)
        if state is None:
            over = len(self._by_name) - self.cfg.input.max_devices + 1
            if over > 0:
                self.evict(now, need=over)  # back under the cap, as far as idle devices allow
            state = self._add_device(device)
        state.partition = partition
        state.last_at = now
        return state

    def lookups(self, values: Sequence[bytes | None]) -> list[Callable[[], None]]:
        """The blocking lookups decoding these messages needs first (``InputFormat.lookups``:
        a schema registry's schemas not cached yet); the async edge runs them off the event
        loop (``IngestDriver.look_up``) before it hands the messages in."""
        return self.input_format.lookups(self.input_params, values)

    def _keyless_decoder(self) -> FormatDecoder | None:
        """A decoder that takes the device from the message (None: the format cannot)."""
        if self._keyless is None:
            try:
                self._keyless = self.input_format.decoder(self.input_params, self.limits,
                                                          expected_shape=self.expected_shape,
                                                          value_range=self.value_range)
            except ValueError:
                return None
        return self._keyless

    def evict(self, now: float, need: int = 0) -> list[str]:
        """Forget the devices of a shared topic idle for ``input.device_idle_s`` with nothing
        pending or open, and, for ``need`` > 0, that many more of the longest idle such
        devices; their counts join ``evicted``. Returns the devices forgotten. A device with
        records in flight is never forgotten (its state is what settles them)."""
        if self._shared is None:
            return []
        idle = [s for s in self._by_name.values() if s.open == 0 and s.pending == 0]
        idle.sort(key=lambda s: s.last_at)
        limit = self.cfg.input.device_idle_s
        gone = [s for s in idle if now - s.last_at >= limit]
        if need > 0:
            rest = [s for s in idle if now - s.last_at < limit]
            gone += rest[:need]
        for state in gone:
            self._forget(state.name)
        return [s.name for s in gone]

    def _forget(self, device: str) -> None:
        self.evicted.absorb(self.resolved.pop(device))
        self.devices_evicted += 1
        for table in (self.buffers, self.batchers, self.rates, self.ledgers, self._series, self._by_name,
                      self.resolved_seen):
            table.pop(device, None)
        self.devices.remove(device)
        self.metrics.forget_device(device)
        self.metrics.devices_evicted.inc()

    def _decoder(self, device: str) -> FormatDecoder:
        return self.input_format.decoder(self.input_params, self.limits, expected_device=device,
                                         expected_shape=self.expected_shape, value_range=self.value_range)

    def _foreign(
        self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None, token: Any
    ) -> DeadLetter:
        """A message from a topic that is no device topic of this worker."""
        try:
            device = self.layout.device_of(topic)
        except TopicNameError as exc:
            return self._dead_letter("unknown", topic, partition, offset, key, value, "bad_device", str(exc), token)
        return self._dead_letter(device, topic, partition, offset, key, value, "bad_device",
                                 f"device {device!r} is not assigned to this worker", token)

    def on_tick(self, now: float) -> IngestActions:
        """Timer: close elapsed windows, refresh gauges, resume drained partitions; a shared
        topic's idle devices are forgotten (``evict``) at most once a second."""
        actions = IngestActions()
        if self._shared is not None and now - self._evicted_at >= 1.0:
            self._evicted_at = now
            self.evict(now)
        if self.label_join is not None:
            expired = self.label_join.expire(now)
            if expired:
                self._leave_unlabeled(expired.readings, UNLABELED, actions)
                for token in expired.late_tokens:
                    self._label_outcome("late")
                    actions.ack += self._release_label(token)
        gauges = now - self._gauges_at >= GAUGE_INTERVAL_S
        if gauges:
            self._gauges_at = now
        for device, batcher in self.batchers.items():
            for b in batcher.poll(now):
                self._emitted(b, actions)
            for drop in batcher.take_drops():
                self.metrics.buffer_dropped.labels(device, "window_truncate").inc(drop.dropped)
                actions.ack += self._settle(drop.sources, DROPPED, "window_truncate")
            if gauges:
                self._update_gauges(device, now)
        return actions

    def after_sink(self, device: str) -> IngestActions:
        """After the sink took a batch of ``device``: maybe resume its partition."""
        actions = IngestActions()
        buffer = self.buffers.get(device)  # a shared topic's device may be forgotten meanwhile
        if buffer is not None and buffer.resume_needed():
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

    # --- outcomes -------------------------------------------------------------------
    def settle_batch(self, batch: Batch, outcome: str = CONSUMED, reason: str | None = None) -> list[Any]:
        """The sink is done with ``batch``: its records were consumed (trained) or, with
        ``outcome="dead"``, dead-lettered for ``reason`` (a rejected training step; the
        caller wrote the dead letter first). Returns the tokens now fully settled, to
        acknowledge."""
        state = self._by_name[batch.device]
        state.in_sink -= batch.size
        if outcome == DEAD:
            self.metrics.dead_letter_records.labels(batch.device, reason or "rejected").inc(batch.size)
        else:
            self.metrics.trained_device_records.labels(batch.device).inc(batch.size)
        return self._settle(batch.sources, outcome, reason)

    def letter_sent(self, letter: DeadLetter) -> list[Any]:
        """``letter`` is durable: settle what it carried; returns the tokens now fully settled."""
        if letter.token is None:
            return []
        if letter.records:
            return self._settle([(letter.token, letter.records)], DEAD, letter.reason)
        entry = self._open.get(letter.token)
        if entry is None:  # a foreign topic's message: nothing of ours to settle
            return [letter.token]
        return self._settle([(letter.token, 0)], DEAD, letter.reason)

    def _settle(self, sources: Sources, outcome: str, reason: str | None = None) -> list[Any]:
        done = []
        for token, n in sources:
            entry = self._open[token]
            ledger = self._by_name[entry.device].ledger
            if outcome == CONSUMED:
                entry.consumed += n
                ledger.consumed += n
            elif outcome == DROPPED:
                entry.dropped += n
                key = reason or "dropped"
                if entry.dropped_reasons is None:
                    entry.dropped_reasons = {}
                entry.dropped_reasons[key] = entry.dropped_reasons.get(key, 0) + n
                ledger.add_dropped(key, n)
            elif n:  # 0: a message dead-lettered whole (counted as a message when rejected)
                entry.dead += n
                key = reason or "rejected"
                if entry.dead_reasons is None:
                    entry.dead_reasons = {}
                entry.dead_reasons[key] = entry.dead_reasons.get(key, 0) + n
                ledger.add_dead_records(key, n)
            entry.remaining -= n
            if entry.remaining == 0:
                del self._open[token]
                self._by_name[entry.device].open -= 1
                self._fold(entry)
                done.append(token)
                for label_token in entry.label_tokens or ():
                    done += self._release_label(label_token)
        return done

    def _fold(self, entry: _OpenToken) -> None:
        """A fully settled token enters the resolved ledger of its device."""
        resolved = self.resolved[entry.device]
        resolved.messages_in += entry.messages
        resolved.records_in += entry.records
        resolved.consumed += entry.consumed
        for key, n in (entry.dropped_reasons or {}).items():
            resolved.add_dropped(key, n)
        for key, n in (entry.dead_reasons or {}).items():
            resolved.add_dead_records(key, n)
        if entry.seqs is not None:
            self.resolved_seen[entry.device].add(entry.seqs)
        if entry.whole_reason is not None:
            resolved.dead_letter_messages += 1
            resolved.dead_letters_by_reason[entry.whole_reason] = (
                resolved.dead_letters_by_reason.get(entry.whole_reason, 0) + 1)

    # --- bookkeeping --------------------------------------------------------------
    def _emitted(self, batch: Batch, actions: IngestActions) -> None:
        series = self._series[batch.device]
        series.batches.inc()
        series.batched_records.inc(batch.size)
        series.batch_size.observe(batch.size)
        self._by_name[batch.device].in_sink += batch.size
        actions.batches.append(batch)

    def _dead_letter(
        self, device: str, topic: str, partition: int, offset: int, key: bytes | None,
        value: bytes | None, reason: str, detail: str, token: Any,
    ) -> DeadLetter:
        """A message rejected whole (it has no records to settle)."""
        if device in self.ledgers:
            ledger = self.ledgers[device]
            ledger.dead_letter_messages += 1
            ledger.dead_letters_by_reason[reason] = ledger.dead_letters_by_reason.get(reason, 0) + 1
            if token is not None:
                self._open[token] = entry = _OpenToken(device, 1, 0)
                entry.whole_reason = reason
                self._by_name[device].open += 1
        self.metrics.dead_letters.labels(device, reason).inc()
        return DeadLetter(device, topic, partition, offset, key, value or b"", reason, detail, token)

    def _update_gauges(self, device: str, now: float) -> None:
        self._series[device].arrival_rate.set(self.rates[device].rate_hz(now))

    def state_of(self, device: str) -> _Device | None:
        """The ingest state of ``device`` (None: not held: never met, or forgotten)."""
        return self._by_name.get(device)

    def pending(self, device: str) -> int:
        """Records of ``device`` read and not settled (buffered, or held by the sink)."""
        return self._by_name[device].pending

    def resolved_ledgers(self) -> dict[str, dict[str, Any]]:
        """Per device, the counts of fully settled tokens (what a checkpoint stores), with
        the duplicate window of their sequence numbers (``"seen"``)."""
        out = {device: ledger.to_dict() for device, ledger in self.resolved.items()}
        for device, window in self.resolved_seen.items():
            out[device]["seen"] = window.to_dict()
        for device, entry in self._restored.items():  # restored, not met again yet
            out.setdefault(device, entry)
        if self.devices_evicted:
            out[EVICTED] = self.evicted.to_dict()
            out[EVICTED_DEVICES] = self.devices_evicted  # type: ignore[assignment]
        return out

    def accounting(self) -> dict[str, dict[str, Any]]:
        """Per-device counts: read, trained (consumed), dropped, dead-lettered, pending; and
        how much may be pending without the device falling behind (``window_records``, at
        most ``capacity_hz`` records/s taken) and what is beyond it (``backlog``)."""
        out = {}
        for device in self.devices:
            buf = self.buffers[device]
            ledger = self.ledgers[device]
            state = self._by_name[device]
            batcher = self.batchers[device]
            out[device] = {
                **ledger.to_dict(),
                "batched": self.batchers[device].batched_records_total,
                "buffered": buf.depth,
                "in_sink": state.in_sink,
                "awaiting_label": state.awaiting,
                "pending": state.pending,
                "max_depth": buf.max_depth,
                "pauses": buf.pauses_total,
                "window_records": batcher.window_records,
                "capacity_hz": batcher.capacity_hz if batcher.mode == "window" else None,
                "backlog": batcher.backlog(state.pending),
                "batch_cap": batcher.batch_cap,
            }
        return out


def _select(batch: RecordBatch, mask: np.ndarray) -> RecordBatch:
    """The records of ``batch`` where ``mask`` is true (copies)."""
    return RecordBatch(
        device=batch.device, seq=batch.seq[mask], event_time=batch.event_time[mask],
        features=batch.features[mask], labels=None if batch.labels is None else batch.labels[mask],
        origin=pick_origin(batch, mask),
    )
