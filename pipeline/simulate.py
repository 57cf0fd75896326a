"""Streams a job's devices into their topics: simulated in real time, or a recording replayed.

Owns the producing side of a run (``stream_devices``); the job's data comes from its
source (``job.sources.job_fleet_data``). Invariant: the ``SimulationReport`` returned counts exactly
the records and messages handed to the producer per device, which is what the run's
accounting balances against.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from kafka.errors import KafkaTimeoutError

from edgestream.job.config import ConfigError, JobConfig
from edgestream.job.sources import job_fleet_data, source_named
from edgestream.job.topics import label_topics, sensor_partitions, sensor_topics_for
from edgestream.monitoring.metrics import Metrics
from edgestream.pipeline.kafka_io import TopicSetupError, ensure_topics, producer
from edgestream.pipeline.outage import BrokerWatch
from edgestream.streams import topics
from edgestream.streams.garbage import KINDS, make_garbage
from edgestream.streams.labels import LabelPlan, encode_labels, join_keys
from edgestream.streams.simulator import build_simulators

log = logging.getLogger(__name__)

#: Seconds the simulator's producer keeps a record it could not deliver (a broker that is
#: down or restarting), retrying, before the record counts as refused.
SEND_RETRY_S = 300.0
#: Added to ``job.seed`` for the draw of simulated label delays (apart from the data's draws).
LABEL_SEED_OFFSET = 7919


@dataclass
class SimulationReport:
    """What the simulators produced, per device (good records and garbage messages)."""

    records: dict[str, int] = field(default_factory=dict)
    #: Records the cluster refused, per device and reason (not in ``records``).
    refused: dict[str, dict[str, int]] = field(default_factory=dict)
    messages: dict[str, int] = field(default_factory=dict)
    garbage: dict[str, dict[str, int]] = field(default_factory=dict)
    bytes: int = 0
    duration_s: float = 0.0
    #: Wall-clock time (epoch seconds) the first tick was produced: the origin of TTA figures.
    started_at: float = 0.0
    #: Records still unacknowledged when a stop's flush bound ran out, per device (in
    #: ``records``: they may or may not have been written).
    unconfirmed: dict[str, int] = field(default_factory=dict)
    #: Delayed labels (``labels.topic``): labels sent to the label topic, and those held back
    #: on purpose (``labels.simulate_missing``).
    labels_sent: int = 0
    labels_withheld: int = 0

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2, sort_keys=True)


def simulate(
    cfg: JobConfig,
    bootstrap: str,
    duration_s: float,
    *,
    garbage_per_device: int = 0,
    stop: threading.Event | None = None,
    metrics: Metrics | None = None,
    progress: Callable[[SimulationReport], None] | None = None,
    report_path: Path | None = None,
    stop_flush_s: float | None = None,
) -> SimulationReport:
    """Produce every device's stream for ``duration_s`` seconds of real time.

    Each device sends one micro-batch message per ``devices.message_interval_s``.
    With ``garbage_per_device`` > 0, that many malformed messages (cycling through
    every kind in ``streams.garbage.KINDS``) are interleaved into each device topic.
    ``stop_flush_s``: once ``stop`` is set, wait at most that long for Kafka to acknowledge
    what was sent (a service's stop must end within its grace); what it has not acknowledged
    by then is counted in ``report.unconfirmed`` and said in one line. None: wait for all.
    """
    stop = stop or threading.Event()
    devices = cfg.devices.device_ids()
    layout = cfg.input.layout()  # input.topic: each device's topic
    # Its device topics only: the dead-letter topic is the workers' (a devices principal of a
    # secure cluster may not even see it: docs/security.md).
    try:
        ensure_topics(bootstrap, {**{topic: kind for topic, kind in sensor_topics_for(devices, layout).items()
                                     if kind != "dlq"}, **label_topics(cfg)}, sized=sensor_partitions(cfg))
    except TopicSetupError as exc:
        if "Authorization" not in str(exc):
            raise
        # A device principal may see and write its own topic only: what it may not write is
        # refused per message below, counted (records_refused), and not counted as produced.
        log.warning("%s; sends to those topics will be refused and counted", exc)
    data = job_fleet_data(cfg)
    rates = {d: cfg.devices.rate_of(i) for i, d in enumerate(devices)}
    sims = build_simulators(data, rates, cfg.devices.profile, seed=cfg.job.seed)
    report = SimulationReport(
        records={d: 0 for d in devices}, messages={d: 0 for d in devices},
        garbage={d: {} for d in devices},
    )
    # A broker that restarts (same address) gets the records the devices produced meanwhile:
    # the producer keeps them, retries and reconnects within a second for SEND_RETRY_S;
    # what it still cannot deliver then is refused and counted (``refused``).
    prod = producer(bootstrap, cfg.kafka.max_message_bytes, delivery_timeout_ms=int(SEND_RETRY_S * 1000),
                    max_block_ms=int(SEND_RETRY_S * 1000), reconnect_backoff_max_ms=1000)
    watch = BrokerWatch(bootstrap, "simulator", log.warning).start()
    lock = threading.Lock()
    #: Records handed to the producer and neither acknowledged nor refused yet, per device.
    pending = {d: 0 for d in devices}
    abandoned = False  # set once a stop's flush bound ran out

    def refused(device: str, count: int, exc: BaseException) -> None:
        """A send the cluster did not take (the producer's I/O thread calls it): its records
        are not produced; counted per device and reason."""
        reason = type(exc).__name__
        with lock:
            if abandoned:  # failed by the stop's forced close: counted as unconfirmed already
                return
            pending[device] -= count
            report.records[device] -= count
            report.messages[device] -= 1
            per_reason = report.refused.setdefault(device, {})
            first = reason not in per_reason
            per_reason[reason] = per_reason.get(reason, 0) + count
        if metrics is not None:
            metrics.records_refused.labels(device, reason).inc(count)
        if first:  # once per device and reason: the metric and the report count the rest
            log.warning("the cluster refused the records of %s (%s: %s); counted, not produced",
                        device, reason, exc)

    def taken(device: str, count: int, _metadata: object) -> None:
        with lock:
            pending[device] -= count
        if metrics is not None:  # counted once the cluster took them
            metrics.records_produced.labels(device).inc(count)

    interval = cfg.devices.message_interval_s
    # duration_s = inf (`simulate --forever`): until ``stop``; garbage, if any, in the first minute.
    ticks = max(1, int(round((duration_s if math.isfinite(duration_s) else 60.0) / interval)))
    garbage_at = _garbage_schedule(ticks, garbage_per_device)
    if not math.isfinite(duration_s):
        ticks = None
    input_format, input_params = cfg.input.resolved()
    encode = input_format.encode  # the devices write the job's input format
    # Delayed labels: the readings go without theirs, and each label follows on the label
    # topic when ``plan`` says (or never).
    plan = labels_fields = None
    if cfg.labels.delayed:
        low, high = cfg.labels.simulate_delay_s
        plan = LabelPlan((low, high), cfg.labels.simulate_missing, seed=cfg.job.seed + LABEL_SEED_OFFSET)
        labels_fields = cfg.labels.fields()

    def send_labels(now_s: float) -> None:
        assert plan is not None and labels_fields is not None
        for device, pairs in plan.due(now_s).items():
            prod.send(cfg.labels.topic, value=encode_labels(labels_fields, device, pairs), key=device.encode())
            report.labels_sent += len(pairs)

    start_mono = time.monotonic()
    wall_origin = time.time()
    report.started_at = wall_origin
    flushed = True
    try:
        for tick in itertools.count():
            if stop.is_set() or (ticks is not None and tick >= ticks):
                break
            t0, t1 = tick * interval, (tick + 1) * interval
            for sim in sims:
                for batch in sim.step(t0, t1, wall_origin):
                    if plan is not None and labels_fields is not None and batch.labels is not None:
                        plan.plan(sim.device, join_keys(labels_fields.match, batch.seq, batch.event_time),
                                  batch.labels, t1)
                        batch = dataclasses.replace(batch, labels=None)
                    value = encode(input_params, batch)
                    report.records[sim.device] += batch.count
                    report.messages[sim.device] += 1
                    report.bytes += len(value)
                    with lock:
                        pending[sim.device] += batch.count
                    try:
                        sent = prod.send(layout.topic(sim.device), value=value, key=sim.device.encode())
                    except KafkaTimeoutError as exc:  # no room to keep it for SEND_RETRY_S: refused, counted
                        refused(sim.device, batch.count, exc)
                        continue
                    sent.add_errback(refused, sim.device, batch.count)
                    sent.add_callback(taken, sim.device, batch.count)
                for k in range(garbage_at.get(tick, 0)):
                    kind = KINDS[(sum(report.garbage[sim.device].values()) + k) % len(KINDS)]
                    value = make_garbage(kind, sim.device, data.feature_shape, seed=tick)
                    prod.send(layout.topic(sim.device), value=value, key=sim.device.encode())
                    report.garbage[sim.device][kind] = report.garbage[sim.device].get(kind, 0) + 1
            if plan is not None:
                send_labels(t1)
            if progress is not None:
                report.duration_s = time.monotonic() - start_mono
                progress(report)
            # Pace to real time: sleep until this tick's end (not a synchronisation sleep).
            delay = start_mono + t1 - time.monotonic()
            if delay > 0:
                stop.wait(delay)
        while plan is not None and plan.outstanding and not stop.is_set():
            # The last readings' labels, each when it is due (pacing, as above).
            due = plan.next_due()
            assert due is not None
            delay = start_mono + due - time.monotonic()
            if delay > 0:
                stop.wait(delay)
            send_labels(due)
        if plan is not None:
            report.labels_withheld = plan.withheld
        bounded = stop_flush_s is not None and stop.is_set()
        flushed = _flush(prod, stop_flush_s if bounded else None)
        if not flushed:
            with lock:
                abandoned = True
                report.unconfirmed = {d: n for d, n in pending.items() if n > 0}
            log.warning("stopping: Kafka had not acknowledged %d records (%s) %g s after the stop; "
                        "exiting without them confirmed (they may or may not have been written)",
                        sum(report.unconfirmed.values()), ", ".join(sorted(report.unconfirmed)), stop_flush_s)
    finally:
        watch.stop()
        _close(prod, flushed)
    report.duration_s = time.monotonic() - start_mono
    _write_report(report, report_path)
    return report


def _flush(prod, timeout_s: float | None) -> bool:
    """Wait for every send to be acknowledged or refused, at most ``timeout_s`` (None: no
    bound); False if the bound ran out first."""
    try:
        prod.flush(timeout=timeout_s)
    except KafkaTimeoutError:
        return False
    return True


def _close(prod, flushed: bool) -> None:
    """Close the producer; one whose bounded flush ran out (``flushed`` False) is closed
    forcefully: its unacknowledged sends fail at once instead of being retried."""
    if not flushed:
        # kafka-python has no public forced close (its close flushes first and raises on a
        # timeout, also from __del__): fail the pending batches, then close as usual. The
        # sender logs each cancelled request as an error: the one line above said it all.
        logging.getLogger("kafka.producer.sender").setLevel(logging.CRITICAL)
        prod._sender.force_close()
    try:
        prod.close(timeout=None if flushed else 2.0)
    except KafkaTimeoutError:
        log.warning("the producer did not close within 2 s of its forced close")


def _write_report(report: SimulationReport, report_path: Path | None) -> None:
    if report_path is not None:
        report_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = report_path.with_suffix(".tmp")
        tmp.write_text(report.to_json())
        tmp.replace(report_path)


def check_stream_options(cfg: JobConfig, garbage_per_device: int = 0) -> None:
    """Raise ``ConfigError`` if ``stream_devices`` would refuse these options (call it before
    starting processes, so the user gets the one-line error at once)."""
    refused = source_named(cfg.data.source).garbage_refused
    if garbage_per_device and refused:
        raise ConfigError(
            f"garbage injection (--garbage) is not supported with data.source = {cfg.data.source!r}: {refused}"
        )


def stream_devices(
    cfg: JobConfig,
    bootstrap: str,
    duration_s: float,
    *,
    garbage_per_device: int = 0,
    stop: threading.Event | None = None,
    metrics: Metrics | None = None,
    progress: Callable[[SimulationReport], None] | None = None,
    report_path: Path | None = None,
    stop_flush_s: float | None = None,
) -> SimulationReport:
    """Stream the job's devices for at most ``duration_s`` seconds; what ``edgestream run`` calls.

    ``digits`` / ``synthetic``: ``simulate``. ``recording``: the recording's device topics
    are replayed at ``data.replay_speed`` (``pipeline.replay.replay``, Kafka timestamps
    set at send time; the event times inside the records are the recorded ones) until
    the recording ends, ``duration_s`` passes or ``stop`` is set, whichever comes first.
    Garbage injection is refused for a recording (``ConfigError``): it is replayed as
    imported. ``progress`` gets the running report, as with ``simulate``; ``stop_flush_s``
    bounds the wait after a stop for simulated devices only (a replay waits for every send).
    """
    check_stream_options(cfg, garbage_per_device)
    directory = source_named(cfg.data.source).replay_directory(cfg)
    if directory is None:
        return simulate(cfg, bootstrap, duration_s, garbage_per_device=garbage_per_device, stop=stop,
                        metrics=metrics, progress=progress, report_path=report_path, stop_flush_s=stop_flush_s)
    return _replay_recording(cfg, directory, bootstrap, duration_s, stop=stop or threading.Event(), metrics=metrics,
                             progress=progress, report_path=report_path)


@dataclass
class _SendOrder:
    """The recording's device messages in the order the replayer sends them.

    ``device[i]`` / ``records[i]``: the device index and record count of the i-th message
    sent. The replayer stops only between messages, so what it sent is always a prefix
    of this order, and its message count alone gives the exact per-device figures.
    """

    devices: list[str]
    device: np.ndarray
    records: np.ndarray

    def counts(self, sent: int) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """(records, good messages, undecodable messages) per device after ``sent`` messages."""
        n = len(self.devices)
        dev, rec = self.device[:sent], self.records[:sent]
        records = np.bincount(dev, weights=rec, minlength=n)
        good = np.bincount(dev[rec > 0], minlength=n)
        bad = np.bincount(dev[rec == 0], minlength=n)
        return ({d: int(records[i]) for i, d in enumerate(self.devices)},
                {d: int(good[i]) for i, d in enumerate(self.devices)},
                {d: int(bad[i]) for i, d in enumerate(self.devices)})


def _send_order(directory: Path, devices: list[str]) -> _SendOrder:
    from edgestream.pipeline.replay import _ordered_messages, sensor_record_count
    from edgestream.streams.recording import RecordingReader

    reader = RecordingReader(directory)
    index = {topics.sensor_topic(d): i for i, d in enumerate(devices)}
    missing = sorted(set(index) - set(reader.topics))
    if missing:
        raise ConfigError(f"the recording {directory} has no topic {', '.join(missing)}")
    dev: list[int] = []
    rec: list[int] = []
    for msg in _ordered_messages(reader, list(index)):
        dev.append(index[msg.topic])
        # Imports write only valid messages; a zero count marks one a worker dead-letters.
        rec.append(sensor_record_count(msg.value))
    return _SendOrder(devices, np.asarray(dev, dtype=np.int64), np.asarray(rec, dtype=np.int64))


def _replay_recording(
    cfg: JobConfig,
    directory: Path,
    bootstrap: str,
    duration_s: float,
    *,
    stop: threading.Event,
    metrics: Metrics | None,
    progress: Callable[[SimulationReport], None] | None,
    report_path: Path | None,
) -> SimulationReport:
    from edgestream.pipeline.replay import ReplayError, replay
    from edgestream.streams.recording import parse_speed

    try:
        speed = parse_speed(cfg.data.replay_speed)
    except ReplayError as exc:
        raise ConfigError(f"data.replay_speed: {exc}") from None
    devices = cfg.devices.device_ids()
    order = _send_order(directory, devices)
    report = SimulationReport(records={d: 0 for d in devices}, messages={d: 0 for d in devices},
                              garbage={d: {} for d in devices})

    def fill(sent: int) -> None:
        records, good, bad = order.counts(sent)
        report.records, report.messages = records, good
        report.garbage = {d: ({"recorded": bad[d]} if bad[d] else {}) for d in devices}

    # The replayer knows one stop event; end it on the caller's stop or at the deadline.
    ended = threading.Event()
    start_mono = time.monotonic()
    deadline = start_mono + duration_s

    def watch() -> None:
        while not ended.is_set():
            if stop.wait(min(0.1, max(0.0, deadline - time.monotonic()))) or time.monotonic() >= deadline:
                ended.set()

    def on_progress(p) -> None:
        fill(p.messages)
        report.bytes = p.bytes
        report.duration_s = time.monotonic() - start_mono
        if progress is not None:
            progress(report)

    watcher = threading.Thread(target=watch, name="replay-deadline", daemon=True)
    report.started_at = time.time()
    watcher.start()
    try:
        # Recorded as sensors.<device>; replayed into each device's topic of input.topic.
        layout = cfg.input.layout()
        rename = [] if layout.is_default else [f"{topics.sensor_topic(d)}:{layout.topic(d)}" for d in devices]
        result = replay(directory, bootstrap, speed=speed, topics_filter=[topics.sensor_topic(d) for d in devices],
                        rename=rename, layout=layout, rewrite_timestamps=True,
                        max_message_bytes=cfg.kafka.max_message_bytes, stop=ended, progress=on_progress,
                        metrics=metrics)
    finally:
        ended.set()
        watcher.join()
    fill(result.messages)
    sent_per_topic = {topics.sensor_topic(d): report.messages[d] + sum(report.garbage[d].values()) for d in devices}
    if sent_per_topic != result.per_topic:
        raise ReplayError(f"replay sent {result.per_topic} messages per topic, expected the prefix {sent_per_topic}")
    report.bytes = result.bytes
    report.duration_s = time.monotonic() - start_mono
    _write_report(report, report_path)
    return report


def _garbage_schedule(ticks: int, per_device: int) -> dict[int, int]:
    """Spread ``per_device`` garbage messages evenly over the run's ticks."""
    schedule: dict[int, int] = {}
    for i in range(per_device):
        tick = min(ticks - 1, int((i + 0.5) * ticks / per_device))
        schedule[tick] = schedule.get(tick, 0) + 1
    return schedule
