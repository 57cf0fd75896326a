"""One worker process: serves /metrics and runs the Faust ingest app until stopped."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import faust

from monitoring.metrics import Metrics, serve
from pipeline.app import CountingSink, create_app
from pipeline.config import JobConfig
from pipeline.simulate import job_fleet_data

log = logging.getLogger(__name__)


def worker_state_dir(cfg: JobConfig, worker: str) -> Path:
    return cfg.state_path() / "workers" / worker


def write_json_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
    tmp.replace(path)


def run_worker(
    cfg: JobConfig, worker: str, bootstrap: str, metrics_port: int = 0, loglevel: str = "warning"
) -> None:
    """Run the worker until SIGINT/SIGTERM; writes its endpoint and final accounting."""
    state = worker_state_dir(cfg, worker)
    state.mkdir(parents=True, exist_ok=True)
    metrics = Metrics()
    port = serve(metrics, metrics_port, cfg.workers.metrics_host)
    metrics.worker_up.labels(worker).set(1)
    metrics.worker_ready.labels(worker).set(0)
    devices = cfg.devices_of(worker)
    write_json_atomic(
        state / "endpoint.json",
        {"worker": worker, "pid": os.getpid(), "metrics": f"http://{cfg.workers.metrics_host}:{port}/metrics",
         "devices": devices},
    )
    data = job_fleet_data(cfg)
    sink = CountingSink(metrics)
    app, core = create_app(
        cfg, worker, bootstrap, sink, metrics,
        datadir=state / "faust", devices=devices,
        expected_shape=data.feature_shape, num_classes=data.num_classes,
        on_ready=lambda: metrics.worker_ready.labels(worker).set(1),
    )
    runner = faust.Worker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False)
    try:
        runner.execute_from_commandline()
    except SystemExit:
        pass
    finally:
        metrics.worker_up.labels(worker).set(0)
        write_json_atomic(state / "accounting.json", {"worker": worker, "devices": core.accounting()})
