"""Runs device simulators in real time and produces their messages to the device topics."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from monitoring.metrics import Metrics
from pipeline.config import JobConfig
from pipeline.kafka_io import ensure_topics, producer, sensor_topics_for
from streams import codec, topics
from streams.garbage import KINDS, make_garbage
from streams.simulator import FleetData, build_simulators, fleet_data


def job_fleet_data(cfg: JobConfig) -> FleetData:
    """The job's dataset, held-out split and device shares, deterministic from the config."""
    source_params = {}
    if cfg.data.source == "synthetic":
        source_params["n"] = cfg.data.synthetic_samples
    return fleet_data(
        cfg.data.source,
        cfg.devices.device_ids(),
        scheme=cfg.data.partition,
        seed=cfg.job.seed,
        heldout_fraction=cfg.data.heldout_fraction,
        dirichlet_alpha=cfg.data.dirichlet_alpha,
        classes_per_device=cfg.data.classes_per_device,
        source_params=source_params,
    )


@dataclass
class SimulationReport:
    """What the simulators produced, per device (good records and garbage messages)."""

    records: dict[str, int] = field(default_factory=dict)
    messages: dict[str, int] = field(default_factory=dict)
    garbage: dict[str, dict[str, int]] = field(default_factory=dict)
    bytes: int = 0
    duration_s: float = 0.0
    #: Wall-clock time (epoch seconds) the first tick was produced: the origin of TTA figures.
    started_at: float = 0.0

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
) -> SimulationReport:
    """Produce every device's stream for ``duration_s`` seconds of real time.

    Each device sends one micro-batch message per ``devices.message_interval_s``.
    With ``garbage_per_device`` > 0, that many malformed messages (cycling through
    every kind in ``streams.garbage.KINDS``) are interleaved into each device topic.
    """
    stop = stop or threading.Event()
    devices = cfg.devices.device_ids()
    ensure_topics(bootstrap, sensor_topics_for(devices))
    data = job_fleet_data(cfg)
    rates = {d: cfg.devices.rate_of(i) for i, d in enumerate(devices)}
    sims = build_simulators(data, rates, cfg.devices.profile, seed=cfg.job.seed)
    report = SimulationReport(
        records={d: 0 for d in devices}, messages={d: 0 for d in devices},
        garbage={d: {} for d in devices},
    )
    prod = producer(bootstrap, cfg.kafka.max_message_bytes)
    interval = cfg.devices.message_interval_s
    ticks = max(1, int(round(duration_s / interval)))
    garbage_at = _garbage_schedule(ticks, garbage_per_device)
    start_mono = time.monotonic()
    wall_origin = time.time()
    report.started_at = wall_origin
    try:
        for tick in range(ticks):
            if stop.is_set():
                break
            t0, t1 = tick * interval, (tick + 1) * interval
            for sim in sims:
                for batch in sim.step(t0, t1, wall_origin):
                    value = codec.encode(batch)
                    prod.send(topics.sensor_topic(sim.device), value=value, key=sim.device.encode())
                    report.records[sim.device] += batch.count
                    report.messages[sim.device] += 1
                    report.bytes += len(value)
                    if metrics is not None:
                        metrics.records_produced.labels(sim.device).inc(batch.count)
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
        prod.flush()
    finally:
        prod.close()
    report.duration_s = time.monotonic() - start_mono
    if report_path is not None:
        report_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = report_path.with_suffix(".tmp")
        tmp.write_text(report.to_json())
        tmp.replace(report_path)
    return report


def _garbage_schedule(ticks: int, per_device: int) -> dict[int, int]:
    """Spread ``per_device`` garbage messages evenly over the run's ticks."""
    schedule: dict[int, int] = {}
    for i in range(per_device):
        tick = min(ticks - 1, int((i + 0.5) * ticks / per_device))
        schedule[tick] = schedule.get(tick, 0) + 1
    return schedule
