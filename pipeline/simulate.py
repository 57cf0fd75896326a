"""Streams a job's devices into their topics: simulated in real time, or a recording replayed.

Owns the job's data (``job_fleet_data``: dataset, held-out split, device shares, declared
value range and input statistics, deterministic from the config) and the producing side
of a run (``stream_devices``). Invariant: the ``SimulationReport`` returned counts exactly
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

from job.config import ConfigError, JobConfig, parse_value_range
from monitoring.metrics import Metrics
from pipeline.kafka_io import TopicSetupError, ensure_topics, producer, sensor_topics_for
from pipeline.outage import BrokerWatch
from streams import codec, topics
from streams.garbage import KINDS, make_garbage
from streams.simulator import FleetData, build_simulators, fleet_data

log = logging.getLogger(__name__)

#: Seconds the simulator's producer keeps a record it could not deliver (a broker that is
#: down or restarting), retrying, before the record counts as refused.
SEND_RETRY_S = 300.0


def declared_value_range(
    cfg: JobConfig, auto: tuple[np.ndarray, np.ndarray], *, from_data: bool
) -> tuple[np.ndarray, np.ndarray] | None:
    """``data.value_range`` resolved: ``none`` -> None, ``LO,HI`` -> scalars, ``auto`` -> ``auto``.

    ``auto`` is the source's own declaration; ``from_data`` says it is the min/max seen
    in the data, which is then widened by ``data.value_margin`` (later records may lie
    a little outside what the data happened to contain).
    """
    spec = parse_value_range(cfg.data.value_range)
    if spec == "none":
        return None
    if isinstance(spec, tuple):
        return np.float32(spec[0]).reshape(()), np.float32(spec[1]).reshape(())
    lo, hi = auto
    if from_data:
        # Float64 out of widen; float32 rounding never moves a bound inside the data's [min, max].
        lo, hi = codec.widen(lo, hi, cfg.data.value_margin)
        # Data near float32's limit widens past it: every float32 lies inside, so clip
        # (a plain cast would make the bound infinite, with an overflow warning).
        f32_max = float(np.finfo(np.float32).max)
        lo, hi = np.clip(lo, -f32_max, f32_max), np.clip(hi, -f32_max, f32_max)
    return np.asarray(lo, dtype=np.float32), np.asarray(hi, dtype=np.float32)


def job_fleet_data(cfg: JobConfig) -> FleetData:
    """The job's dataset, held-out split, device shares, value range and input statistics.

    Deterministic from the config. For ``data.source = "recording"`` everything comes
    from the recording's stored files (``job.sources.recording``): the streamed rows, the
    held-out rows, the device shares, and the streamed rows' per-feature statistics.
    """
    if cfg.data.source == "recording":
        return _recording_fleet_data(cfg)
    source_params = {}
    if cfg.data.source == "synthetic":
        source_params["n"] = cfg.data.synthetic_samples
    data = fleet_data(
        cfg.data.source,
        cfg.devices.device_ids(),
        scheme=cfg.data.partition,
        seed=cfg.job.seed,
        heldout_fraction=cfg.data.heldout_fraction,
        dirichlet_alpha=cfg.data.dirichlet_alpha,
        classes_per_device=cfg.data.classes_per_device,
        source_params=source_params,
    )
    if cfg.data.source == "digits":
        # Pixels are scaled to [0, 1] by the loader: that is the declaration, not an estimate.
        auto = (np.float32(0.0).reshape(()), np.float32(1.0).reshape(()))
        value_range = declared_value_range(cfg, auto, from_data=False)
    else:
        every = np.concatenate([data.train.features, data.heldout.features]).reshape(
            len(data.train) + len(data.heldout), -1)
        value_range = declared_value_range(cfg, (every.min(axis=0), every.max(axis=0)), from_data=True)
    return dataclasses.replace(data, value_range=value_range)


def _recording_fleet_data(cfg: JobConfig) -> FleetData:
    from job.sources.recording import read_recording_info

    info = read_recording_info(cfg.data.recording)
    train, heldout, shares = info.load_data()
    devices = cfg.devices.device_ids()
    if list(shares) != devices:
        # load_config takes the devices from the recording; a config built another way may not.
        raise ConfigError(f"devices {devices} are not the devices {list(shares)} of the recording "
                          f"{cfg.data.recording}; load the job with job.config.load_config")
    value_range = declared_value_range(cfg, (info.stats.min, info.stats.max), from_data=True)
    return FleetData(train, heldout, shares, value_range=value_range,
                     input_stats=(info.stats.mean, info.stats.std))


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
    # Its device topics only: the dead-letter topic is the workers' (a devices principal of a
    # secure cluster may not even see it: docs/security.md).
    try:
        ensure_topics(bootstrap, {topic: kind for topic, kind in sensor_topics_for(devices).items() if kind != "dlq"})
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
                    value = codec.encode(batch)
                    report.records[sim.device] += batch.count
                    report.messages[sim.device] += 1
                    report.bytes += len(value)
                    with lock:
                        pending[sim.device] += batch.count
                    try:
                        sent = prod.send(topics.sensor_topic(sim.device), value=value, key=sim.device.encode())
                    except KafkaTimeoutError as exc:  # no room to keep it for SEND_RETRY_S: refused, counted
                        refused(sim.device, batch.count, exc)
                        continue
                    sent.add_errback(refused, sim.device, batch.count)
                    sent.add_callback(taken, sim.device, batch.count)
                for k in range(garbage_at.get(tick, 0)):
                    kind = KINDS[(sum(report.garbage[sim.device].values()) + k) % len(KINDS)]
                    value = make_garbage(kind, sim.device, data.feature_shape, seed=tick)
                    prod.send(topics.sensor_topic(sim.device), value=value, key=sim.device.encode())
                    report.garbage[sim.device][kind] = report.garbage[sim.device].get(kind, 0) + 1
            if progress is not None:
                report.duration_s = time.monotonic() - start_mono
                progress(report)
            # Pace to real time: sleep until this tick's end (not a synchronisation sleep).
            delay = start_mono + t1 - time.monotonic()
            if delay > 0:
                stop.wait(delay)
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
    if garbage_per_device and cfg.data.source == "recording":
        raise ConfigError(
            "garbage injection (--garbage) is not supported with data.source = 'recording': the "
            "recording is replayed as imported; use a digits or synthetic job to test the dead-letter path"
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
    if cfg.data.source != "recording":
        return simulate(cfg, bootstrap, duration_s, garbage_per_device=garbage_per_device, stop=stop,
                        metrics=metrics, progress=progress, report_path=report_path, stop_flush_s=stop_flush_s)
    return _replay_recording(cfg, bootstrap, duration_s, stop=stop or threading.Event(), metrics=metrics,
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
    from pipeline.replay import _ordered_messages, sensor_record_count
    from streams.recording import RecordingReader

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
    bootstrap: str,
    duration_s: float,
    *,
    stop: threading.Event,
    metrics: Metrics | None,
    progress: Callable[[SimulationReport], None] | None,
    report_path: Path | None,
) -> SimulationReport:
    from job.sources.recording import read_recording_info
    from pipeline.replay import ReplayError, replay
    from streams.recording import parse_speed

    info = read_recording_info(cfg.data.recording)
    try:
        speed = parse_speed(cfg.data.replay_speed)
    except ReplayError as exc:
        raise ConfigError(f"data.replay_speed: {exc}") from None
    devices = cfg.devices.device_ids()
    order = _send_order(info.directory, devices)
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
        result = replay(info.directory, bootstrap, speed=speed, topics_filter=[topics.sensor_topic(d) for d in devices],
                        rewrite_timestamps=True, max_message_bytes=cfg.kafka.max_message_bytes,
                        stop=ended, progress=on_progress, metrics=metrics)
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
