"""`edgestream serve`: inference only, beside a training job (pipeline/serve.py)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

from edgestream.cli.errors import CommandError
from edgestream.cli.options import (
    add_service_args,
    job_config,
    need_bootstrap,
    port,
    use_log_format,
)
from edgestream.job.config import JobConfig
from edgestream.pipeline.exits import EXIT_CONFIG

LOGLEVELS = ("debug", "info", "warning", "error", "critical")
MODEL_SOURCES = ("models", "checkpoints", "export")


def cmd_serve(args: argparse.Namespace) -> int:
    level = getattr(logging, args.loglevel.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = job_config(args)
    use_log_format(args, cfg)
    if args.state_dir:
        cfg.run.state_dir = args.state_dir
    if not cfg.train.enabled:
        raise CommandError("the job does not train (train.enabled = false): serve predicts with the job's model; "
                           "use the job file the training run used", EXIT_CONFIG)
    from edgestream.pipeline.serve import (  # torch, aiokafka
        ServeRefused,
        check_serve_args,
        default_model_source,
        default_name,
        run_serve,
    )
    from edgestream.pipeline.worker import quiet_tracebacks

    quiet_tracebacks(logging.getLogger(), level)
    name = args.name or default_name()
    export_dir = Path(args.export_dir) if args.export_dir else None
    try:
        model_from, process = check_serve_args(cfg, name, args.model_from or default_model_source(cfg), args.worker,
                                               export_dir)
    except ServeRefused as exc:
        raise CommandError(str(exc), EXIT_CONFIG) from None
    _check_model(cfg, model_from, export_dir)  # before the broker: a typo fails in seconds, not a timeout
    bootstrap = need_bootstrap(args, cfg)
    summary = run_serve(cfg, name, bootstrap, model_from=model_from, process=process, export_dir=export_dir,
                        metrics_port=args.metrics_port)
    total = sum(summary["published"].values())
    print(f"serve {name}: {total} predictions published on predictions.{cfg.job.name} in {summary['micro_batches']} "
          f"micro-batches, {summary['swaps']} model swap(s), last model version {summary['model_version']}",
          flush=True)
    return 0


def _check_model(cfg: JobConfig, model_from: str, export_dir: Path | None) -> None:
    """What serve would refuse about the job's model, refused before any broker connection (exit 2,
    one line): the job's model, strategy and codec as its training processes build them
    (``check_training_config``: ``train.model`` imports, builds and gives one finite score per
    class on the job's data); with ``--model-from export``, a directory that does not exist, or
    whose export is of another model than the job's. (A directory without a card yet, or an export
    refused for its digest, is waited for: it may be being written.)"""
    from edgestream.job.plan import training_plan
    from edgestream.pipeline.worker import check_training_config
    from edgestream.streams.topics import SERVER_NAME
    from edgestream.trainers.export import CARD_FILE
    from edgestream.trainers.serving import SHAPE, ModelLoader, ModelRefused
    from edgestream.trainers.strategies import roles

    check_training_config(cfg)  # ConfigError: one line naming the key, exit 2
    if model_from != "export" or export_dir is None:
        return
    if not export_dir.is_dir():
        raise CommandError(f"--export-dir {export_dir}: no such directory; write an export there first "
                           f"(edgestream export --job ... --out {export_dir}) or fix the path", EXIT_CONFIG)
    if not (export_dir / CARD_FILE).is_file():
        return
    from edgestream.job.sources import job_fleet_data

    holder = SERVER_NAME if "server" in roles(cfg.train.strategy) else cfg.worker_names()[0]  # as Server's
    loader = ModelLoader(training_plan(cfg), job_fleet_data(cfg), holder,
                         role="server" if holder == SERVER_NAME else "worker")
    try:
        loader.from_export(export_dir)
    except ModelRefused as exc:
        if exc.reason == SHAPE:
            raise CommandError(f"--export-dir {export_dir}: not the job's model ({exc.detail}); serve it with "
                               "the job file (and --set overrides) it was trained and exported with",
                               EXIT_CONFIG) from None


def register(sub: argparse._SubParsersAction, add_job_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `serve` subcommand."""
    p = sub.add_parser("serve", help="predict every record of the job's device streams with its newest model "
                                     "(inference only, its own consumer group; predictions on predictions.<job>)")
    add_job_args(p)
    p.add_argument("--name", default=None,
                   help="this instance's name: its predictions' worker field and its state dir (default: "
                        "serve-<host name>)")
    p.add_argument("--model-from", choices=MODEL_SOURCES, default=None,
                   help="where the model comes from: models (the server's snapshots on models.<job>; default for "
                        "strategies with a server), checkpoints (a process's newest good checkpoint; default for the "
                        "others), export (an edgestream export directory)")
    p.add_argument("--worker", default=None,
                   help="with --model-from checkpoints: the process whose checkpoints to read (default: the server, "
                        "else w0)")
    p.add_argument("--export-dir", default=None, help="with --model-from export: the export directory")
    p.add_argument("--state-dir", default=None,
                   help="the job's state directory (default: run.state_dir): the checkpoints read, and this "
                        "instance's endpoint and summary under workers/<name>/")
    p.add_argument("--metrics-port", type=port, default=0, help="/metrics port (0: a free one)")
    p.add_argument("--loglevel", default="warning", type=str.lower, choices=LOGLEVELS,
                   help="log level (default: %(default)s)")
    add_service_args(p)
    p.set_defaults(func=cmd_serve)
