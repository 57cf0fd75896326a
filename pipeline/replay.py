"""`edgestream replay`: produce a recording back to Kafka, paced by its recorded timestamps.

Pure parts (``ReplaySchedule``, ``Pacer``, ``TimingStats``, ``TopicRenamer``,
``rewrite_device``) are synchronous and tested with a fake clock; ``replay()`` is the
I/O edge: it reads the recording, sleeps until each message is due (pacing, not
synchronisation) and hands it to an aiokafka producer (its record batches are built and
CRC-checked in C; kafka-python's pure-Python CRC32C caps it at a few MB/s here).
``pipeline.replay_workers.replay_through_workers()`` runs worker processes on the
replayed streams.
"""

from __future__ import annotations

import asyncio
import math
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgestream.pipeline import security
from edgestream.streams import codec, topics
from edgestream.streams.errors import StreamsError
from edgestream.streams.recording import (
    RecordedMessage,
    RecordingReader,
    ReplayError,
    check_topic,
)


class TopicRenamer:
    """Maps recorded topic names to destination names.

    Rules are ``old:new`` (exact) or ``prefix*:newprefix*`` (prefix form: the rest of the
    name is kept, e.g. ``sensors.*:sensors.r1-*`` maps ``sensors.dev01`` to
    ``sensors.r1-dev01``). Exact rules win over prefix rules; the longest prefix wins.
    Unmatched topics keep their names.
    """

    def __init__(self, specs: Iterable[str] = ()) -> None:
        self.exact: dict[str, str] = {}
        self.prefixes: list[tuple[str, str]] = []
        for spec in specs:
            old, sep, new = spec.partition(":")
            if not sep or not old or not new:
                raise ReplayError(f"--rename {spec!r}: expected OLD:NEW or PREFIX*:NEWPREFIX*")
            if old.endswith("*") != new.endswith("*"):
                raise ReplayError(
                    f"--rename {spec!r}: prefix form needs '*' at the end of both sides"
                )
            if old.endswith("*"):
                self.prefixes.append((old[:-1], new[:-1]))
            else:
                self.exact[old] = _checked(new, spec)
        self.prefixes.sort(key=lambda rule: len(rule[0]), reverse=True)

    def __call__(self, topic: str) -> str:
        if topic in self.exact:
            return self.exact[topic]
        for old, new in self.prefixes:
            if topic.startswith(old):
                return _checked(new + topic[len(old) :], f"{old}*:{new}*")
        return topic


def _checked(topic: str, spec: str) -> str:
    try:
        return check_topic(topic)
    except ValueError as exc:
        raise ReplayError(f"--rename {spec!r}: {exc}") from None


# Layout of a sensor message header (streams.codec, version 1): magic, version, flags,
# dtype, ndim, count, device_len, reserved; the device id follows at byte 16.
_SENSOR_HEADER = struct.Struct("<4sBBBBIHH")


def rewrite_device(value: bytes, old: str, new: str) -> bytes:
    """``value`` with its sensor-message device id ``old`` replaced by ``new``.

    Only a sensor message (``streams.codec``, version 1 or 2) whose device field is
    exactly ``old`` is changed; anything else (garbage, other formats) is returned
    unchanged, so a malformed message stays malformed for the same reason.

    A version-2 message gets its CRC32C trailer recomputed, with the input's CRC error
    carried over: an intact message comes out intact, a corrupted one (e.g. bit flips)
    still fails its CRC (``bad_checksum``) instead of being vouched for. A version-1
    message stays version 1 (only the id changes): upgrading it would put a CRC on bytes
    nobody checked, and workers still read version 1.
    """
    if len(value) < _SENSOR_HEADER.size:
        return value
    magic, version, flags, dtype, ndim, count, device_len, reserved = _SENSOR_HEADER.unpack_from(value)
    if magic != codec.MAGIC or version not in codec.READ_VERSIONS:
        return value
    start = _SENSOR_HEADER.size
    if value[start : start + device_len] != old.encode():
        return value
    new_raw = new.encode()
    if not codec.DEVICE_RE.match(new):
        raise ReplayError(f"device id {new!r} is not valid in a sensor message")
    head = _SENSOR_HEADER.pack(magic, version, flags, dtype, ndim, count, len(new_raw), reserved)
    out = head + new_raw + value[start + device_len :]
    trailer = codec.TRAILER_SIZE
    if version == 1 or len(value) - (start + device_len) < trailer:
        return out  # v1: no trailer; too short to hold one: stays truncated either way
    # XOR of stored and actual CRC: 0 for an intact message; kept, so damage stays damage.
    error = int.from_bytes(value[-trailer:], "little") ^ codec.checksum(memoryview(value)[:-trailer])
    crc = codec.checksum(memoryview(out)[:-trailer]) ^ error
    return out[:-trailer] + crc.to_bytes(trailer, "little")


def topic_kind(topic: str) -> str:
    """The ``streams.topics.topic_configs`` kind a destination topic is created with."""
    if topic == topics.SENSOR_DLQ or topic.endswith(".dlq"):
        return "dlq"
    if topic.startswith("gradients."):
        return "gradients"
    if topic.startswith("models."):
        return "models"
    return "sensors"


# --------------------------------------------------------------- scheduling


class ReplaySchedule:
    """When each recorded message is due, in seconds after the replay started.

    A message recorded ``d`` ms after the first one is due at ``d / speed / 1000`` s; pass
    ``k`` of a looped replay is shifted by ``k * period_ms / speed``. Invariant: due times
    never decrease: a message whose timestamp is earlier than its predecessor's (or
    unknown, ``-1``) is due together with the predecessor; it is not re-ordered.
    At ``speed=inf`` every message is due at once.
    """

    def __init__(self, speed: float, period_ms: float = 0.0) -> None:
        if not speed > 0:
            raise ReplayError(f"speed must be > 0, got {speed}")
        self.speed = speed
        self.period_ms = period_ms
        self.first_ts_ms: int | None = None
        self.last_due_s = 0.0

    def due(self, timestamp_ms: int, pass_index: int = 0) -> float:
        if math.isinf(self.speed):
            return 0.0
        if timestamp_ms >= 0 and self.first_ts_ms is None:
            self.first_ts_ms = timestamp_ms
        if timestamp_ms < 0 or self.first_ts_ms is None:
            return self.last_due_s
        raw = (timestamp_ms - self.first_ts_ms + pass_index * self.period_ms) / self.speed / 1000.0
        self.last_due_s = max(self.last_due_s, raw)
        return self.last_due_s


def loop_period_ms(first_ts_ms: int | None, last_ts_ms: int | None, messages: int) -> float:
    """Recorded span plus one mean inter-arrival gap: where pass ``k + 1`` starts."""
    if first_ts_ms is None or last_ts_ms is None or messages < 1:
        return 1000.0
    span = max(0, last_ts_ms - first_ts_ms)
    gap = span / (messages - 1) if messages > 1 and span > 0 else 1000.0
    return span + gap


@dataclass
class TimingStats:
    """Requested vs achieved send times of a paced replay.

    ``add(due_s, actual_s)`` per message, both relative to the replay start. The
    inter-arrival error of message ``i`` is
    ``|(actual_i - actual_{i-1}) - (due_i - due_{i-1})|``; lateness is ``actual - due``.
    """

    errors_s: list[float] = field(default_factory=list)
    lateness_s: list[float] = field(default_factory=list)
    first: tuple[float, float] | None = None
    last: tuple[float, float] | None = None

    def add(self, due_s: float, actual_s: float) -> None:
        if self.last is not None:
            requested = due_s - self.last[0]
            achieved = actual_s - self.last[1]
            self.errors_s.append(abs(achieved - requested))
        else:
            self.first = (due_s, actual_s)
        self.lateness_s.append(actual_s - due_s)
        self.last = (due_s, actual_s)

    def summary(self) -> dict[str, float | int | None]:
        """Counts, requested vs achieved span (s), error and lateness percentiles (ms)."""

        def ms(values: list[float], q: float) -> float | None:
            return float(np.percentile(values, q)) * 1000.0 if values else None

        first, last = self.first or (0.0, 0.0), self.last or (0.0, 0.0)
        return {
            "messages": len(self.lateness_s),
            "requested_s": last[0] - first[0],
            "achieved_s": last[1] - first[1],
            "inter_arrival_error_p50_ms": ms(self.errors_s, 50),
            "inter_arrival_error_p99_ms": ms(self.errors_s, 99),
            "inter_arrival_error_max_ms": max(self.errors_s) * 1000.0 if self.errors_s else None,
            "lateness_p50_ms": ms(self.lateness_s, 50),
            "lateness_p99_ms": ms(self.lateness_s, 99),
        }


class Pacer:
    """Turns due times into waits against a clock and records when messages went out."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.start_s: float | None = None
        self.stats = TimingStats()

    def begin(self) -> None:
        self.start_s = self.clock()

    def delay(self, due_s: float) -> float:
        """Seconds to wait before the message due at ``due_s`` may be sent (>= 0)."""
        assert self.start_s is not None, "begin() first"
        return max(0.0, self.start_s + due_s - self.clock())

    def sent(self, due_s: float) -> None:
        assert self.start_s is not None, "begin() first"
        self.stats.add(due_s, self.clock() - self.start_s)


# --------------------------------------------------------------------- replay


@dataclass
class ReplayProgress:
    messages: int = 0
    bytes: int = 0
    passes: int = 0
    elapsed_s: float = 0.0


@dataclass
class ReplayReport:
    """What a replay sent and how faithfully it kept the recorded timing."""

    speed: float
    messages: int
    bytes: int
    passes: int
    per_topic: dict[str, int]
    destination: dict[str, str]
    duration_s: float
    timing: dict[str, Any] | None
    truncated: list[dict[str, Any]]

    @property
    def messages_per_s(self) -> float:
        return self.messages / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.duration_s if self.duration_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["speed"] = "max" if math.isinf(self.speed) else self.speed
        out["messages_per_s"] = self.messages_per_s
        out["mb_per_s"] = self.mb_per_s
        return out


def _ordered_messages(reader: RecordingReader, names: list[str]) -> Iterator[RecordedMessage]:
    """Messages of ``names`` merged by timestamp, keeping each partition's order.

    If every file is in timestamp order this is ``reader.merged``. Otherwise the files
    are read once per partition and the per-partition streams merged (a consumer
    interleaves partitions, so a file is rarely sorted even when each partition is).
    """
    if reader.ordered:
        yield from reader.merged(names)
        return
    import heapq

    def only(topic: str, partition: int) -> Iterator[RecordedMessage]:
        return (m for m in reader.messages(topic) if m.partition == partition)

    summary = reader.summary()["topics"]
    streams = [only(topic, int(p)) for topic in names for p in summary[topic]["partitions"]]
    yield from heapq.merge(*streams, key=lambda m: m.sort_key)


def replay(
    directory: str | Path,
    bootstrap: str,
    *,
    speed: float = 1.0,
    loop: bool = False,
    max_passes: int | None = None,
    rename: Iterable[str] = (),
    rewrite_timestamps: bool = False,
    rewrite_devices: bool = False,
    topics_filter: Iterable[str] | None = None,
    allow_truncated: bool = False,
    create_topics: bool = True,
    producer_options: dict[str, Any] | None = None,
    max_message_bytes: int = topics.MAX_MESSAGE_BYTES,
    stop: threading.Event | None = None,
    progress: Callable[[ReplayProgress], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    metrics: Any = None,
    layout: topics.TopicLayout = topics.DEFAULT_LAYOUT,
) -> ReplayReport:
    """Produce the recording in ``directory`` to ``bootstrap``; return what was achieved.

    Messages go out merged across topics in timestamp order (each partition's order
    kept), to the same partition number, with their key, value, headers and (unless
    ``rewrite_timestamps``) their recorded timestamp, waiting between them so that
    recorded inter-arrival times are divided by ``speed`` (``inf``: no waiting).
    ``loop`` repeats the recording (forever, or ``max_passes`` times) until ``stop``.
    ``rewrite_devices``: where a rename maps ``sensors.<a>`` to ``sensors.<b>`` (a device
    topic of ``layout``: the destination job's ``input.topic``), sensor messages and keys
    naming device ``a`` are rewritten to ``b`` (see ``rewrite_device``). Recorded topics
    are read as ``sensors.<device>``.
    Raises ``RecordingCorrupt`` (unless ``allow_truncated``), ``ReplayError``.
    """
    reader = RecordingReader(directory, allow_truncated=allow_truncated)
    names = list(reader.topics if topics_filter is None else topics_filter)
    for name in names:
        if name not in reader.topics:
            raise ReplayError(f"topic {name!r} is not in {directory} (has: {', '.join(reader.topics)})")
    renamer = TopicRenamer(rename)
    destination = {t: renamer(t) for t in names}
    if len(set(destination.values())) != len(destination):
        raise ReplayError(f"--rename maps two recorded topics onto one: {destination}")
    summary = reader.summary()
    partitions_needed = {
        destination[t]: 1 + max((int(p) for p in summary["topics"][t]["partitions"]), default=0)
        for t in names
    }
    if create_topics:
        from edgestream.pipeline.kafka_io import ensure_topics

        for dest, n in partitions_needed.items():
            ensure_topics(bootstrap, {dest: topic_kind(dest)}, partitions=n)
    device_map: dict[str, tuple[str, str]] = {}
    if rewrite_devices:
        for src, dest in destination.items():
            try:
                old, new = topics.device_of(src), layout.device_of(dest)
            except StreamsError:
                continue
            if old != new:
                device_map[src] = (old, new)
    first_ts = summary["min_timestamp_ms"]
    period = loop_period_ms(first_ts, summary["max_timestamp_ms"], summary["messages"])
    passes_limit = max_passes if loop else 1  # None: loop until stopped
    report = asyncio.run(_replay_async(
        reader, names, destination, partitions_needed, device_map, bootstrap, speed, period,
        passes_limit, rewrite_timestamps, producer_options or {}, max_message_bytes,
        stop or threading.Event(), progress, clock, metrics, layout,
    ))
    report.truncated = [
        {"path": str(p), "position": pos, "reason": r} for p, pos, r in reader.truncated
    ]
    return report


async def _replay_async(
    reader: RecordingReader,
    names: list[str],
    destination: dict[str, str],
    partitions_needed: dict[str, int],
    device_map: dict[str, tuple[str, str]],
    bootstrap: str,
    speed: float,
    period_ms: float,
    passes_limit: int | None,
    rewrite_timestamps: bool,
    producer_options: dict[str, Any],
    max_message_bytes: int,
    stop: threading.Event,
    progress: Callable[[ReplayProgress], None] | None,
    clock: Callable[[], float],
    metrics: Any = None,
    layout: topics.TopicLayout = topics.DEFAULT_LAYOUT,
) -> ReplayReport:
    from aiokafka import AIOKafkaProducer

    produced = {}  # destination topic -> records_produced child (device topics only)
    if metrics is not None:
        for dest in set(destination.values()):
            if layout.matches(dest):
                produced[dest] = metrics.records_produced.labels(layout.device_of(dest))

    paced = not math.isinf(speed)
    options: dict[str, Any] = dict(
        bootstrap_servers=bootstrap,
        client_id="edgestream-replay",
        max_request_size=max_message_bytes,
        acks="all",
        enable_idempotence=True,  # keeps per-partition order across retries
        # Paced: hand each message to the broker at once. Max speed: fill large batches.
        linger_ms=0 if paced else 5,
        max_batch_size=(1 << 14) if paced else (1 << 20),
        **security.current().aiokafka(),
    )
    options.update(producer_options)
    producer = AIOKafkaProducer(**options)
    await producer.start()
    schedule = ReplaySchedule(speed, period_ms)
    pacer = Pacer(clock)
    prog = ReplayProgress()
    per_topic = {t: 0 for t in names}
    pending: list[asyncio.Future] = []
    try:
        for dest, needed in partitions_needed.items():
            have = await producer.partitions_for(dest)
            if have is None or len(have) < needed:
                raise ReplayError(
                    f"destination topic {dest!r} has {len(have or ())} partition(s) but the recording "
                    f"uses {needed}; create it with at least {needed} or --rename to a fresh topic"
                )
        pacer.begin()
        started = clock()
        pass_index = 0
        last_progress = started
        while passes_limit is None or pass_index < passes_limit:
            if stop.is_set():
                break
            for msg in _ordered_messages(reader, names):
                if stop.is_set():
                    break
                due = schedule.due(msg.timestamp_ms, pass_index)
                if paced:
                    wait = pacer.delay(due)
                    if wait > 0:
                        await asyncio.sleep(wait)  # pacing to the recorded timing
                key, value = msg.key, msg.value
                if msg.topic in device_map:
                    old, new = device_map[msg.topic]
                    value = rewrite_device(value, old, new)
                    if key == old.encode():
                        key = new.encode()
                fut = await producer.send(
                    destination[msg.topic], value=value, key=key, partition=msg.partition,
                    timestamp_ms=None if rewrite_timestamps else (msg.timestamp_ms if msg.timestamp_ms >= 0 else None),
                    headers=list(msg.headers) or None,
                )
                if paced:
                    pacer.sent(due)
                pending.append(fut)
                per_topic[msg.topic] += 1
                counter = produced.get(destination[msg.topic])
                if counter is not None:
                    counter.inc(sensor_record_count(value))
                prog.messages += 1
                prog.bytes += len(value) + len(key or b"")
                if len(pending) >= 4096:
                    pending = _check_sent(pending)
                now = clock()
                if progress is not None and now - last_progress >= 0.2:
                    prog.elapsed_s = now - started
                    progress(prog)
                    last_progress = now
            pass_index += 1
            prog.passes = pass_index
        await producer.flush()
        _check_sent(pending)
        pending = []
        duration = clock() - started
    finally:
        await producer.stop()
    prog.elapsed_s = duration
    if progress is not None:
        progress(prog)
    return ReplayReport(
        speed=speed, messages=prog.messages, bytes=prog.bytes, passes=prog.passes,
        per_topic=per_topic, destination=destination, duration_s=duration,
        timing=pacer.stats.summary() if paced else None, truncated=[],
    )


def _check_sent(pending: list[asyncio.Future]) -> list[asyncio.Future]:
    """Drop delivered futures; raise the first delivery error."""
    still = []
    for fut in pending:
        if not fut.done():
            still.append(fut)
        elif fut.exception() is not None:
            raise ReplayError(f"producing a replayed message failed: {fut.exception()!r}")
    return still


# ---------------------------------------------------- replay through workers


def sensor_record_count(value: bytes) -> int:
    """Records in a sensor message, read from its header (0 for anything else)."""
    if len(value) >= 12 and value[:4] == codec.MAGIC:
        return int.from_bytes(value[8:12], "little")
    return 0


def expected_from_recording(
    directory: str | Path, devices: dict[str, str], num_classes: int | None,
    feature_shape: tuple[int, ...] | None, limits: codec.DecodeLimits,
) -> tuple[dict[str, int], dict[str, int]]:
    """Per destination device: records a worker will accept, and messages it will dead-letter.

    ``devices`` maps recorded topic -> destination device id. Classification uses the same
    decode call as the workers' ``IngestCore`` (after the device rewrite).
    """
    reader = RecordingReader(directory)
    records = {d: 0 for d in devices.values()}
    garbage = {d: 0 for d in devices.values()}
    lim = codec.DecodeLimits(limits.max_message_bytes, limits.max_records,
                             limits.max_features_per_record, limits.max_ndim, num_classes)
    for topic, device in devices.items():
        old = topics.device_of(topic)
        for msg in reader.messages(topic):
            value = rewrite_device(msg.value, old, device)
            try:
                batch = codec.decode(value, lim, expected_device=device, expected_shape=feature_shape)
            except StreamsError:
                garbage[device] += 1
                continue
            records[device] += batch.count
    return records, garbage
