"""`edgestream run`: broker, simulated devices and workers of a job, with a live view."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from edgestream.cli.errors import CommandError
from edgestream.cli.options import (
    add_stream_args,
    cluster_bootstrap,
    job_config,
)
from edgestream.pipeline.exits import EXIT_CONFIG, EXIT_RUNTIME, EXIT_UNBALANCED


def _stop_signals_interrupt() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread (the cleanup path of
    Ctrl-C), whatever this process inherited: a shell without job control starts background
    commands with SIGINT ignored, and a parent may start it with SIGINT blocked; either way
    ``kill -INT`` would otherwise do nothing."""
    import signal

    def interrupt(_signum, _frame) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


#: Width of ``run``'s output when it goes to a file or a pipe: wide enough that no table is cut
#: (a cut cell ends in an ellipsis and its value is lost from the log); each row stays one line.
PIPED_WIDTH = 10_000


def run_console() -> Console:
    """The console ``run`` prints to: the terminal's width, or no limit that a table meets when piped."""
    return Console() if sys.stdout.isatty() else Console(width=PIPED_WIDTH)


def cmd_run(args: argparse.Namespace) -> int:
    from edgestream.deploy.kafka.broker import LocalBroker, kafka_version
    from edgestream.pipeline.kafka_io import check_reachable
    from edgestream.pipeline.launcher import warm_up
    from edgestream.pipeline.run import process_config, run_in_testbed, run_job
    from edgestream.pipeline.testbed_run import uses_testbed
    from edgestream.pipeline.worker import check_training_config, process_topics, worker_cpus

    _stop_signals_interrupt()  # `kill`/`timeout` stop the run like Ctrl-C: every process it started too
    cfg = job_config(args)
    if args.duration:
        cfg.run.duration_s = args.duration
    process_config(cfg)  # the workers' principal (run.workers_password_file): refused before anything else
    in_testbed = uses_testbed(cfg)  # the brokers are the testbed's own (pipeline/testbed_run.py)
    if in_testbed and (args.bootstrap or cfg.kafka.bootstrap):
        raise CommandError("a job with [testbed] enabled runs its own brokers in the testbed's broker hosts: "
                           "drop --bootstrap / kafka.bootstrap, or set testbed.enabled=false", EXIT_CONFIG)
    bootstrap = None if in_testbed else cluster_bootstrap(args, cfg)
    if bootstrap:  # first, before torch is imported: an unreachable cluster is reported in seconds
        args.resolved_bootstrap = bootstrap
        check_reachable(bootstrap)
    # Everything a process of the run would refuse, refused now: before a broker or topic exists.
    for name in cfg.worker_names():
        process_topics(cfg, name)
        worker_cpus(cfg, name)
    check_training_config(cfg)
    if not in_testbed:
        warm_up()  # the workers' imports, in the fork server, beside the broker's start
    console = run_console()
    broker = None
    work: Path | None = None  # the data of the broker this run starts (removed at its end)
    try:
        if in_testbed:
            result = run_in_testbed(cfg, console, garbage_per_device=args.garbage, keep=args.keep_testbed)
        elif not bootstrap:
            work = Path(tempfile.mkdtemp(prefix="broker-", dir=str(_ensure(cfg.state_path()))))
            with console.status(f"starting a local Kafka {kafka_version()} broker "
                                "(first run resolves the jars from Maven Central)"):
                broker = LocalBroker(work).start()
            bootstrap = broker.bootstrap
            args.resolved_bootstrap = bootstrap
            console.print(f"local Kafka {kafka_version()} broker at {bootstrap}")
        if not in_testbed:
            result = run_job(cfg, bootstrap, garbage_per_device=args.garbage, console=console)
    except KeyboardInterrupt:
        console.print("interrupted; stopped every process this run started")
        return 130
    finally:
        if broker is not None:
            broker.stop()
        if work is not None:
            if args.keep_broker:
                console.print(f"the run's broker data is kept in {work} (--keep-broker)")
            else:
                shutil.rmtree(work, ignore_errors=True)
    if result.outcome == "drain_timeout":
        console.print(f"[red]the drain timed out: {result.reason.split('; per device:')[0]}[/red]", soft_wrap=True)
        return EXIT_RUNTIME
    if not result.balanced:
        console.print("[red]accounting does not balance: see the table above[/red]")
        return EXIT_UNBALANCED
    if result.backlog:
        console.print("[yellow]rate above capacity: " + ", ".join(
            f"{d} has {n} records pending beyond one window" for d, n in result.backlog.items())
            + " (it arrives faster than its worker batches and trains: see the balanced column, and "
              "docs/ingest.md#backlog for batcher.max_batch_widen and train.max_step_batch)[/yellow]", soft_wrap=True)
    console.print(f"[green]every record accounted for[/green]; summary in {cfg.state_path() / 'summary.json'}")
    return 0


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def register(sub: argparse._SubParsersAction, add_job_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `run` subcommand."""
    p = sub.add_parser("run", help="broker + simulated devices + workers, with a live view")
    add_job_args(p)
    add_stream_args(p, "seconds of streaming (default: run.duration_s)", "inject N malformed messages per device")
    p.add_argument("--keep-testbed", action="store_true",
                   help="with [testbed]: leave the hosts and brokers up after the run (`edgestream testbed down`)")
    p.add_argument("--keep-broker", action="store_true",
                   help="a run that starts its own broker (no --bootstrap, no local broker running) removes its "
                        "data (STATE/broker-*) when it ends; keep it instead")
    p.set_defaults(func=cmd_run)
