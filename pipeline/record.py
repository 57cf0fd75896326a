"""`edgestream record`: consume Kafka topics into a recording directory (streams.recording).

Partitions are assigned explicitly (no consumer group, nothing committed), from the
beginning or from the current end (``from_now``). Recording stops at a duration, a
message count, when every partition has reached the end offset it had when recording
started (``until_end``), on ``stop``, or on Ctrl-C; the writer is always closed, so the
manifest is always written.
"""

from __future__ import annotations

import fnmatch
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgestream.streams import topics
from edgestream.streams.errors import StreamsError
from edgestream.streams.recording import RecordedMessage, RecordingWriter

log = logging.getLogger(__name__)


class RecordError(StreamsError):
    """Recording cannot start or proceed (no topic matches, bad option)."""


def resolve_topics(available: Iterable[str], patterns: Iterable[str]) -> list[str]:
    """Topics matching any of ``patterns`` (fnmatch, comma-separated lists allowed).

    Internal topics (``__*``) and ``sensors.dlq`` are only included when named exactly.
    """
    names = sorted(set(available))
    wanted: set[str] = set()
    pats = [p.strip() for spec in patterns for p in spec.split(",") if p.strip()]
    if not pats:
        raise RecordError("no topic pattern given (e.g. --topics 'sensors.*')")
    for pat in pats:
        if pat in names:
            wanted.add(pat)
            continue
        hits = [n for n in fnmatch.filter(names, pat)
                if n != topics.SENSOR_DLQ and not n.startswith("__")]
        wanted.update(hits)
    if not wanted:
        shown = ", ".join(names[:20]) + (f", ... ({len(names)} topics)" if len(names) > 20 else "")
        raise RecordError(f"no topic matches {', '.join(pats)} (the cluster has: {shown or 'no topics'})")
    return sorted(wanted)


@dataclass
class RecordProgress:
    messages: int = 0
    bytes: int = 0
    skipped_tombstones: int = 0
    elapsed_s: float = 0.0
    per_topic: dict[str, int] = field(default_factory=dict)


@dataclass
class RecordReport:
    directory: str
    topics: list[str]
    messages: int
    bytes: int
    skipped_tombstones: int
    duration_s: float
    per_topic: dict[str, int]
    stopped_by: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def record(
    bootstrap: str,
    patterns: Iterable[str],
    out: str | Path,
    *,
    duration_s: float | None = None,
    max_records: int | None = None,
    until_end: bool = False,
    from_now: bool = False,
    max_message_bytes: int = topics.MAX_MESSAGE_BYTES,
    stop: threading.Event | None = None,
    progress: Callable[[RecordProgress], None] | None = None,
    idle_timeout_s: float | None = None,
) -> RecordReport:
    """Record the topics matching ``patterns`` into the new directory ``out``.

    Tombstones (``None`` values) and ``None`` header values cannot be represented in
    format version 1: such messages are skipped, counted in ``skipped_tombstones`` and
    logged. ``max_records`` counts recorded messages.
    """
    from kafka.structs import TopicPartition

    from edgestream.pipeline.kafka_io import consumer

    stop = stop or threading.Event()
    # check_crcs=False: kafka-python's CRC32C is pure Python (a few MB/s) here; the broker
    # verified every batch on produce and each recorded frame gets its own CRC32.
    cons = consumer(bootstrap, max_message_bytes=max_message_bytes, check_crcs=False,
                    client_id="edgestream-record")
    stopped_by = "end"
    try:
        names = resolve_topics(cons.topics(), patterns)
        tps = [TopicPartition(t, p) for t in names for p in sorted(cons.partitions_for_topic(t) or ())]
        cons.assign(tps)
        if from_now:
            cons.seek_to_end(*tps)
        else:
            cons.seek_to_beginning(*tps)
        ends = cons.end_offsets(tps) if until_end else {}
        # Partitions already at their end need nothing more.
        remaining = {tp for tp in tps if until_end and cons.position(tp) < ends[tp]}
        prog = RecordProgress(per_topic={t: 0 for t in names})
        started = time.monotonic()
        last_data = started
        last_progress = 0.0
        with RecordingWriter(out, topics=names) as writer:
            try:
                while True:
                    now = time.monotonic()
                    if stop.is_set():
                        stopped_by = "stop"
                        break
                    if duration_s is not None and now - started >= duration_s:
                        stopped_by = "duration"
                        break
                    if max_records is not None and prog.messages >= max_records:
                        stopped_by = "max_records"
                        break
                    if until_end and not remaining:
                        stopped_by = "end"
                        break
                    if idle_timeout_s is not None and now - last_data >= idle_timeout_s:
                        stopped_by = "idle"
                        break
                    budget = None if max_records is None else max_records - prog.messages
                    batch = cons.poll(timeout_ms=200, max_records=budget or None)
                    for tp, msgs in batch.items():
                        for m in msgs:
                            if max_records is not None and prog.messages >= max_records:
                                break
                            if until_end and m.offset >= ends[tp]:
                                continue  # produced after recording started
                            _write(writer, m, prog)
                            last_data = time.monotonic()
                        if until_end and tp in remaining and cons.position(tp) >= ends[tp]:
                            remaining.discard(tp)
                    if until_end and remaining:
                        # Offsets can end in a gap (transaction markers, compaction).
                        for tp in list(remaining):
                            if cons.position(tp) >= ends[tp]:
                                remaining.discard(tp)
                    now = time.monotonic()
                    if progress is not None and now - last_progress >= 0.2:
                        prog.elapsed_s = now - started
                        progress(prog)
                        last_progress = now
            except KeyboardInterrupt:
                stopped_by = "interrupt"  # the normal way to end an open-ended recording
        prog.elapsed_s = time.monotonic() - started
        if progress is not None:
            progress(prog)
    finally:
        cons.close()
    if prog.skipped_tombstones:
        log.warning("skipped %d tombstone(s) / None header values: not representable in format v1",
                    prog.skipped_tombstones)
    return RecordReport(str(out), names, prog.messages, prog.bytes, prog.skipped_tombstones,
                        prog.elapsed_s, dict(prog.per_topic), stopped_by)


def _write(writer: RecordingWriter, m: Any, prog: RecordProgress) -> None:
    headers = tuple((k, v) for k, v in (m.headers or ()))
    if m.value is None or any(v is None for _, v in headers):
        prog.skipped_tombstones += 1
        return
    writer.write(RecordedMessage(m.topic, m.partition, m.offset, m.timestamp, m.key, m.value, headers))
    prog.messages += 1
    prog.bytes += len(m.value) + len(m.key or b"")
    prog.per_topic[m.topic] = prog.per_topic.get(m.topic, 0) + 1
