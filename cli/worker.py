"""`edgestream worker` and `edgestream server`: one training process of a job, until stopped."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from edgestream.cli.errors import CommandError
from edgestream.cli.options import (
    add_service_args,
    job_config,
    need_bootstrap,
    port,
    use_log_format,
)
from edgestream.job.config import JobConfig
from edgestream.pipeline.exits import EXIT_CONFIG, EXIT_FILE, worker_state_dir
from edgestream.streams.topics import SERVER_NAME

LOGLEVELS = ("debug", "info", "warning", "error", "critical")


def cmd_worker(args: argparse.Namespace) -> int:
    cfg, bootstrap = _process_config(args, args.worker)
    from edgestream.pipeline.worker import (  # torch, faust
        check_training_config,
        run_worker,
        worker_cpus,
    )

    worker_cpus(cfg, args.worker)
    check_training_config(cfg)  # before any side effect (topics, state, /metrics)
    run_worker(cfg, args.worker, bootstrap, args.metrics_port, loglevel=args.loglevel, join=args.join)
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    cfg, bootstrap = _process_config(args, SERVER_NAME)
    from edgestream.pipeline.worker import check_training_config, run_server  # torch, faust

    check_training_config(cfg)
    from edgestream.trainers.strategies import names, roles

    if not cfg.train.enabled or "server" not in roles(cfg.train.strategy):
        with_server = ", ".join(n for n in names() if "server" in roles(n))
        raise CommandError(f"train.strategy={cfg.train.strategy!r} (train.enabled={cfg.train.enabled}) has "
                           f"no server role; `edgestream server` runs strategies that have one ({with_server}), "
                           "e.g. --set train.enabled=true --set train.strategy=asp", EXIT_CONFIG)
    run_server(cfg, bootstrap, args.metrics_port, loglevel=args.loglevel)
    return 0


def _process_config(args: argparse.Namespace, name: str) -> tuple[JobConfig, str]:
    """Config and cluster of a worker/server process, checked without side effects (the
    cluster answers; worker, device and job names make valid topic names). Sets up its
    log and where ``main`` reports how it ended (``exit.json``, read by `run`). Imports
    nothing heavy until the cluster answered: an unreachable one is reported in seconds,
    not after torch and faust are imported."""
    level = getattr(logging, args.loglevel.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = job_config(args)
    use_log_format(args, cfg)
    if name != SERVER_NAME:
        cfg.devices_of(name)  # a worker of this job
    args.exit_file = worker_state_dir(cfg, name) / EXIT_FILE
    args.exit_file.unlink(missing_ok=True)  # a previous run's verdict is not this one's
    bootstrap = need_bootstrap(args, cfg)
    from edgestream.pipeline.worker import process_topics, quiet_tracebacks  # torch, faust

    quiet_tracebacks(logging.getLogger(), level)
    process_topics(cfg, name)
    return cfg, bootstrap


def register(sub: argparse._SubParsersAction, add_job_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `worker` and `server` subcommands."""
    p = sub.add_parser("worker", help="run one worker (a Faust worker) until stopped")
    add_job_args(p)
    p.add_argument("--worker", required=True, help="worker name, w0 .. w{workers.count-1}")
    p.add_argument("--join", action="store_true",
                   help="enter a running job: read the update topics from their end and wait for the model "
                        "(a worker without a checkpoint also joins when the job's gradients log already holds "
                        "records of other workers; one with a checkpoint resumes from it)")
    p.add_argument("--metrics-port", type=port, default=0, help="/metrics port (0: a free one)")
    p.add_argument("--loglevel", default="warning", type=str.lower, choices=LOGLEVELS,
                   help="log level; debug also logs the traceback of a crash (default: %(default)s)")
    add_service_args(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("server", help="run the parameter server of a job whose strategy has one "
                                         "(e.g. asp; a strategy without one is refused, naming those that have one)")
    add_job_args(p)
    p.add_argument("--metrics-port", type=port, default=0, help="/metrics port (0: a free one)")
    p.add_argument("--loglevel", default="warning", type=str.lower, choices=LOGLEVELS,
                   help="log level; debug also logs the traceback of a crash (default: %(default)s)")
    add_service_args(p)
    p.set_defaults(func=cmd_server)
