"""The streaming phase of a run whose devices publish themselves (``devices.external``).

``edgestream run`` starts no simulators for such a job: the devices (watches behind an MQTT
gateway and ``edgestream bridge mqtt``, or anything writing to the device topics) are not
the run's. So that the accounting still has an independent "produced" side, this module
counts what the devices wrote: from the offsets the workers' groups start at
(``start_offsets``, committed by ``start_groups_at_end``) it reads every device topic,
decodes each message as the workers do (the job's ``input.format``, the data's feature
shape and classes) and counts its records per device; a message that does not decode
counts as one bad message, which the workers must dead-letter whole.

Invariant: the returned ``SimulationReport`` counts exactly the messages in the device
topics between ``start_offsets`` and the ends at which the topics were last seen quiet:
after ``duration_s`` (or ``stop``), the phase waits until no device topic grew for
``quiet_s`` (at most ``settle_max_s``) and reads up to those ends. Devices should stop
publishing by then: a record written later is read by a worker but not counted here, and
the summary says the row does not balance.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kafka.structs import TopicPartition

from edgestream.job.config import JobConfig
from edgestream.job.sources import job_fleet_data
from edgestream.pipeline.kafka_io import consumer, end_offsets
from edgestream.pipeline.simulate import SimulationReport, _write_report
from edgestream.streams import codec

log = logging.getLogger(__name__)

#: The bad-message kind of a device message that does not decode (``SimulationReport.garbage``).
UNDECODABLE = "undecodable"


def device_topic_ends(bootstrap: str, cfg: JobConfig) -> dict[TopicPartition, int]:
    """The current end of every partition of the job's device topics."""
    layout = cfg.input.layout()
    return end_offsets(bootstrap, sorted({layout.topic(d) for d in cfg.devices.device_ids()}))


class ArrivalCounter:
    """Counts the records of device messages as the workers will decode them."""

    def __init__(self, cfg: JobConfig) -> None:
        data = job_fleet_data(cfg)
        self.layout = cfg.input.layout()
        self.devices = cfg.devices.device_ids()
        input_format, params = cfg.input.resolved()
        limits = codec.DecodeLimits(max_message_bytes=cfg.limits.max_record_message_bytes,
                                    max_records=cfg.limits.max_records_per_message, num_classes=data.num_classes)
        self.decoders = {d: input_format.decoder(params, limits, expected_device=d, expected_shape=data.feature_shape)
                         for d in self.devices}
        self.report = SimulationReport(records={d: 0 for d in self.devices}, messages={d: 0 for d in self.devices},
                                       garbage={d: {} for d in self.devices})
        #: Messages of a shared topic from devices the job does not name (not this run's to count).
        self.others = 0

    def device_of(self, topic: str, key: bytes | None) -> str | None:
        if self.layout.keyed:
            try:
                device = (key or b"").decode("utf-8")
            except UnicodeDecodeError:
                return None
        else:
            device = self.layout.device_of(topic)
        return device if device in self.decoders else None

    def add(self, topic: str, key: bytes | None, value: bytes | None, timestamp_ms: int, offset: int) -> None:
        device = self.device_of(topic, key)
        if device is None:
            self.others += 1
            return
        try:
            count = self.decoders[device].decode(value or b"", timestamp_s=timestamp_ms / 1000, offset=offset).count
        except Exception:  # noqa: BLE001 - any message the decoder refuses is dead-lettered whole
            bad = self.report.garbage[device]
            bad[UNDECODABLE] = bad.get(UNDECODABLE, 0) + 1
            return
        self.report.records[device] += count
        self.report.messages[device] += 1
        self.report.bytes += len(value or b"")


def await_devices(
    cfg: JobConfig,
    bootstrap: str,
    duration_s: float,
    *,
    start_offsets: dict[TopicPartition, int],
    stop: threading.Event | None = None,
    progress: Callable[[SimulationReport], None] | None = None,
    report_path: Path | None = None,
    quiet_s: float = 2.0,
    settle_max_s: float | None = None,
    say: Callable[[str], None] = log.warning,
) -> SimulationReport:
    """Count what the job's devices write for ``duration_s`` (or until ``stop``), then until
    their topics are quiet; the report of what they produced (module docstring)."""
    stop = stop or threading.Event()
    counter = ArrivalCounter(cfg)
    report = counter.report
    parts = sorted(start_offsets, key=lambda tp: (tp.topic, tp.partition))
    cons = consumer(bootstrap, max_message_bytes=cfg.kafka.max_message_bytes, client_id="edgestream-arrivals")
    started = time.monotonic()
    report.started_at = time.time()
    positions = dict(start_offsets)

    def read(timeout_ms: int) -> None:
        for tp, records in cons.poll(timeout_ms=timeout_ms).items():
            for r in records:
                counter.add(tp.topic, r.key, r.value, r.timestamp, r.offset)
                positions[tp] = r.offset + 1

    try:
        cons.assign(parts)
        for tp in parts:
            cons.seek(tp, start_offsets[tp])
        last_progress = 0.0
        while not stop.is_set() and time.monotonic() - started < duration_s:
            read(200)
            if progress is not None and time.monotonic() - last_progress >= 0.5:
                report.duration_s = time.monotonic() - started
                progress(report)
                last_progress = time.monotonic()
        # Settle: read to the ends until they stay put for quiet_s.
        bound = time.monotonic() + (settle_max_s if settle_max_s is not None else cfg.run.drain_timeout_s)
        ends, since = None, time.monotonic()
        while True:
            now_ends = cons.end_offsets(parts)
            while any(positions[tp] < now_ends[tp] for tp in parts) and time.monotonic() < bound:
                read(200)
            if now_ends != ends:
                ends, since = now_ends, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
            if time.monotonic() >= bound:
                say(f"the device topics were still growing {bound - started:.0f} s into the run; counting what "
                    "they held then (records written later are read but not counted: stop the devices before "
                    "the run's end)")
                break
            time.sleep(0.2)  # poll interval of the quiet check
    finally:
        cons.close()
    if counter.others:
        log.info("%d messages of devices the job does not name were not counted", counter.others)
    report.duration_s = time.monotonic() - started
    if progress is not None:
        progress(report)
    _write_report(report, report_path)
    return report
