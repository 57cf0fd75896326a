"""One worker (or server) process: serves /metrics and runs its Faust app until stopped."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import faust

from monitoring.metrics import Metrics, serve
from pipeline import memory
from pipeline.app import (
    CountingSink,
    app_id,
    create_app,
    new_faust_app,
    offsets_by_group,
    sensor_group,
)
from pipeline.config import JobConfig
from pipeline.kafka_io import adopt_group_offsets, set_group_offsets
from pipeline.simulate import job_fleet_data
from streams import topics

log = logging.getLogger(__name__)

SERVER_NAME = "server"


def worker_state_dir(cfg: JobConfig, worker: str) -> Path:
    return cfg.state_path() / "workers" / worker


def write_json_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
    tmp.replace(path)


def _start(cfg: JobConfig, name: str, metrics_port: int, devices: list[str]) -> tuple[Path, Metrics]:
    state = worker_state_dir(cfg, name)
    state.mkdir(parents=True, exist_ok=True)
    metrics = Metrics()
    port = serve(metrics, metrics_port, cfg.workers.metrics_host)
    metrics.worker_up.labels(name).set(1)
    metrics.worker_ready.labels(name).set(0)
    write_json_atomic(
        state / "endpoint.json",
        {"worker": name, "pid": os.getpid(), "metrics": f"http://{cfg.workers.metrics_host}:{port}/metrics",
         "devices": devices},
    )
    return state, metrics


def _execute(app: faust.App, loglevel: str) -> None:
    memory.freeze_startup_objects()
    runner = faust.Worker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False)
    try:
        runner.execute_from_commandline()
    except SystemExit:
        pass


def run_worker(
    cfg: JobConfig, worker: str, bootstrap: str, metrics_port: int = 0, loglevel: str = "warning"
) -> None:
    """Run the worker until SIGINT/SIGTERM; writes its endpoint, accounting and training summary."""
    memory.tune_allocator()
    devices = cfg.devices_of(worker)
    state, metrics = _start(cfg, worker, metrics_port, devices)
    data = job_fleet_data(cfg)
    runtime = None
    if cfg.train.enabled:
        from pipeline.training import TrainingRuntime

        runtime = TrainingRuntime(cfg, worker, data, metrics, state)
        # Resume exactly at the checkpoint: commit its offsets, before any consumer starts,
        # for the groups that read each topic (device topics: the ingest source's group).
        for group, offsets in offsets_by_group(cfg, worker, runtime.resume_offsets).items():
            set_group_offsets(bootstrap, group, offsets)
        sink = runtime
        metrics.strategy_info.labels(worker, cfg.train.strategy).set(1)
    else:
        sink = CountingSink(metrics)
    if sensor_group(cfg, worker) != app_id(cfg, worker):
        # Device-topic partitions the direct source's group has no offset for start where
        # the Faust group is (a switch of kafka.ingest_source, or a caller that positioned it).
        adopted = adopt_group_offsets(bootstrap, app_id(cfg, worker), sensor_group(cfg, worker),
                                      [topics.sensor_topic(d) for d in devices])
        if adopted:
            log.info("%s: sensor offsets taken from the Faust group: %s", worker, adopted)
    app, core = create_app(
        cfg, worker, bootstrap, sink, metrics,
        datadir=state / "faust", devices=devices,
        expected_shape=data.feature_shape, num_classes=data.num_classes,
        on_ready=lambda: metrics.worker_ready.labels(worker).set(1),
        tracker=runtime.sensor_offsets if runtime else None,
        extend=runtime.attach if runtime else None,
    )
    summary: dict = {}
    if runtime is not None:
        @app.on_before_shutdown.connect
        async def final(app_: faust.App, **kwargs) -> None:
            summary.update(await runtime.shutdown())

    try:
        _execute(app, loglevel)
    finally:
        metrics.worker_up.labels(worker).set(0)
        write_json_atomic(state / "accounting.json", {"worker": worker, "devices": core.accounting()})
        if summary:
            write_json_atomic(state / "training.json", summary)


def run_server(cfg: JobConfig, bootstrap: str, metrics_port: int = 0, loglevel: str = "warning") -> None:
    """The parameter server of strategies with a server role (ASP, SSP, ADSP)."""
    memory.tune_allocator()
    from pipeline.training import TrainingRuntime

    state, metrics = _start(cfg, SERVER_NAME, metrics_port, [])
    data = job_fleet_data(cfg)
    runtime = TrainingRuntime(cfg, SERVER_NAME, data, metrics, state, role="server")
    set_group_offsets(bootstrap, app_id(cfg, SERVER_NAME), runtime.resume_offsets)
    app = new_faust_app(cfg, SERVER_NAME, bootstrap, state / "faust")

    @app.on_partitions_assigned.connect
    async def assigned(app_: faust.App, assigned, **kwargs) -> None:
        metrics.worker_ready.labels(SERVER_NAME).set(1)

    runtime.attach(app)

    async def noop_ack(tokens) -> None:
        return None

    runtime.ack_tokens = noop_ack
    summary: dict = {}

    @app.on_before_shutdown.connect
    async def final(app_: faust.App, **kwargs) -> None:
        summary.update(await runtime.shutdown())

    _ = assigned  # registered by its decorator
    try:
        _execute(app, loglevel)
    finally:
        metrics.worker_up.labels(SERVER_NAME).set(0)
        if summary:
            write_json_atomic(state / "training.json", summary)
