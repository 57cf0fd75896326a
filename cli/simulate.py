"""`edgestream simulate`: stream the job's devices into their topics."""

from __future__ import annotations

import argparse
import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from edgestream.cli.errors import CommandError
from edgestream.cli.options import (
    add_service_args,
    add_stream_args,
    job_config,
    need_bootstrap,
    port,
    use_log_format,
)
from edgestream.pipeline.exits import EXIT_CONFIG


def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from edgestream.monitoring.metrics import serve_process
    from edgestream.pipeline.service import ProcessService
    from edgestream.pipeline.simulate import check_stream_options, stream_devices

    cfg = job_config(args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    use_log_format(args, cfg)
    check_stream_options(cfg, args.garbage)
    if args.forever and args.duration:
        raise CommandError("simulate: --forever and --duration exclude each other", EXIT_CONFIG)
    bootstrap = need_bootstrap(args, cfg)
    duration = math.inf if args.forever else (args.duration or cfg.run.duration_s)
    metrics, metrics_url = serve_process(args.metrics_port, cfg.workers.metrics_host,
                                         liveness_timeout_s=cfg.service.liveness_timeout_s)
    metrics.health.require("producing")
    stop = threading.Event()
    service = ProcessService("simulate", cfg.job.name, metrics.health, cfg.service.shutdown_grace_s)
    service.signals.on_stop = lambda _signum: stop.set()
    Console().print(f"simulator /metrics: {metrics_url}")
    try:
        with Progress(TextColumn("simulating {task.fields[devices]} devices"), BarColumn(),
                      TextColumn("{task.fields[records]} records"), TimeElapsedColumn()) as progress:
            task = progress.add_task("sim", total=None if args.forever else duration,
                                     devices=cfg.devices.count, records=0)

            producing = False

            def on_progress(report):
                nonlocal producing
                if not producing:  # the first messages went out: ready
                    producing = True
                    metrics.health.set("producing", True, "devices streaming")
                metrics.health.beat()
                progress.update(task, completed=report.duration_s, records=sum(report.records.values()))

            # A stop's flush: 3/4 of the grace or the grace minus 5 s, whichever is longer (docs/deploy.md).
            flush_s = max(cfg.service.shutdown_grace_s * 0.75, cfg.service.shutdown_grace_s - 5.0, 0.5)
            report = stream_devices(cfg, bootstrap, duration, garbage_per_device=args.garbage, stop=stop,
                                    progress=on_progress, report_path=args.report, metrics=metrics,
                                    stop_flush_s=flush_s)
    finally:
        service.close()
    stopped = ""
    if stop.is_set():
        stopped = " (stopped by a signal; " + ("not everything sent was acknowledged)" if report.unconfirmed
                                               else "everything sent was flushed)")
    Console().print(f"produced {sum(report.records.values())} records in "
                    f"{sum(report.messages.values())} messages ({report.bytes} bytes) in {report.duration_s:.1f}s"
                    + stopped)
    if report.unconfirmed:
        Console().print(f"[yellow]not acknowledged by the stop's end[/yellow]: {sum(report.unconfirmed.values())} "
                        "records (they may or may not have been written)")
    for device, reasons in sorted(report.refused.items()):
        Console().print(f"[yellow]refused by the cluster[/yellow]: {sum(reasons.values())} records of {device} "
                        f"({', '.join(sorted(reasons))}): not produced")
    return 0


def register(sub: argparse._SubParsersAction, add_job_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `simulate` subcommand."""
    p = sub.add_parser("simulate", help="stream the job's devices into their topics (simulated, or its recording)")
    add_job_args(p)
    add_stream_args(p, "seconds (default: run.duration_s)",
                    "also send N malformed messages per device (tests the dead-letter path)")
    p.add_argument("--report", type=Path, help="write what was produced as JSON here")
    p.add_argument("--forever", action="store_true",
                   help="stream until stopped (SIGTERM/SIGINT), as a service does; excludes --duration")
    p.add_argument("--metrics-port", type=port, default=0,
                   help="serve /metrics (records produced per device), /healthz and /readyz on this port "
                        "(0: a free one)")
    add_service_args(p)
    p.set_defaults(func=cmd_simulate)
