"""The `edgestream` command line: broker, simulate, worker, run, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from pipeline.config import ConfigError, JobConfig, load_config

DEFAULT_BROKER_STATE = Path(".edgestream/broker")

#: Modules that add subcommands: each has ``register(subparsers, add_job_args)``, which
#: adds its parsers with ``set_defaults(func=...)``; ``func(args) -> int``.
EXTENSIONS: tuple[str, ...] = ("monitoring.cli", "pipeline.record_cli")


def job_config(args: argparse.Namespace) -> JobConfig:
    return load_config(getattr(args, "job", None), getattr(args, "set", None) or [])


def _add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", type=Path, help="job file (TOML); defaults built in")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable), e.g. --set buffer.policy=truncate")
    p.add_argument("--bootstrap", metavar="HOST:PORT",
                   help="use this Kafka cluster instead of the local broker")


def _local_broker_bootstrap(state_dir: Path) -> str | None:
    from deploy.kafka.broker import BrokerInfo, pid_alive

    info_file = state_dir / "broker.json"
    if info_file.exists():
        info = BrokerInfo.load(info_file)
        if pid_alive(info.pid):
            return info.bootstrap
    return None


def _bootstrap(args: argparse.Namespace, cfg: JobConfig | None) -> str | None:
    return (
        getattr(args, "bootstrap", None)
        or (cfg.kafka.bootstrap if cfg else None)
        or _local_broker_bootstrap(DEFAULT_BROKER_STATE)
    )


def need_bootstrap(args: argparse.Namespace, cfg: JobConfig | None) -> str:
    bootstrap = _bootstrap(args, cfg)
    if not bootstrap:
        raise SystemExit(
            "edgestream: no Kafka broker. Start the local one with `edgestream broker start`, "
            "or pass --bootstrap HOST:PORT (or set kafka.bootstrap in the job file)."
        )
    return bootstrap


# --- broker ---------------------------------------------------------------------------
def cmd_broker(args: argparse.Namespace) -> int:
    from deploy.kafka.broker import (
        BrokerInfo,
        LocalBroker,
        kafka_version,
        metadata_ok,
        pid_alive,
        stop_pid,
    )

    console = Console()
    state: Path = args.state_dir
    info_file = state / "broker.json"
    if args.action == "start":
        if args.bootstrap:
            ok = metadata_ok(args.bootstrap)
            console.print(f"using existing cluster {args.bootstrap}: {'reachable' if ok else 'NOT reachable'}")
            return 0 if ok else 1
        running = _local_broker_bootstrap(state)
        if running:
            console.print(f"local broker already running at {running}")
            return 0
        with console.status(f"starting Kafka {kafka_version()} (first run resolves the jars from Maven Central)"):
            broker = LocalBroker(state / "kafka", port=args.port or None, heap=args.heap).start()
        broker.info().save(info_file)
        broker.proc = None  # keep running after this command exits
        console.print(f"Kafka {kafka_version()} broker ready at [bold]{broker.bootstrap}[/bold] "
                      f"(log: {broker.log_file}); stop with `edgestream broker stop`")
        print(broker.bootstrap)
        return 0
    if args.action == "status":
        if args.bootstrap:
            ok = metadata_ok(args.bootstrap)
            console.print(f"{args.bootstrap}: {'up' if ok else 'down'}")
            return 0 if ok else 1
        if not info_file.exists():
            console.print("no local broker started from this directory")
            return 1
        info = BrokerInfo.load(info_file)
        alive = pid_alive(info.pid) and metadata_ok(info.bootstrap)
        console.print(f"local Kafka {info.version} at {info.bootstrap} (pid {info.pid}): {'up' if alive else 'down'}")
        return 0 if alive else 1
    if args.action == "stop":
        if not info_file.exists():
            console.print("no local broker started from this directory")
            return 0
        info = BrokerInfo.load(info_file)
        if pid_alive(info.pid):
            stop_pid(info.pid)
        info_file.unlink()
        console.print(f"local broker at {info.bootstrap} stopped")
        return 0
    raise AssertionError(args.action)


# --- simulate ---------------------------------------------------------------------------
def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from monitoring.metrics import serve_process
    from pipeline.simulate import simulate

    cfg = job_config(args)
    bootstrap = need_bootstrap(args, cfg)
    duration = args.duration or cfg.run.duration_s
    metrics, metrics_url = serve_process(args.metrics_port, cfg.workers.metrics_host)
    Console().print(f"simulator /metrics: {metrics_url}")
    with Progress(TextColumn("simulating {task.fields[devices]} devices"), BarColumn(),
                  TextColumn("{task.fields[records]} records"), TimeElapsedColumn()) as progress:
        task = progress.add_task("sim", total=duration, devices=cfg.devices.count, records=0)

        def on_progress(report):
            progress.update(task, completed=report.duration_s, records=sum(report.records.values()))

        report = simulate(cfg, bootstrap, duration, garbage_per_device=args.garbage,
                          progress=on_progress, report_path=args.report, metrics=metrics)
    Console().print(f"produced {sum(report.records.values())} records in "
                    f"{sum(report.messages.values())} messages ({report.bytes} bytes) in {report.duration_s:.1f}s")
    return 0


# --- worker -----------------------------------------------------------------------------
def cmd_worker(args: argparse.Namespace) -> int:
    from pipeline.worker import run_worker

    cfg = job_config(args)
    bootstrap = need_bootstrap(args, cfg)
    logging.basicConfig(level=getattr(logging, args.loglevel.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_worker(cfg, args.worker, bootstrap, args.metrics_port, loglevel=args.loglevel)
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    from pipeline.worker import run_server

    cfg = job_config(args)
    bootstrap = need_bootstrap(args, cfg)
    logging.basicConfig(level=getattr(logging, args.loglevel.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_server(cfg, bootstrap, args.metrics_port, loglevel=args.loglevel)
    return 0


# --- run --------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from deploy.kafka.broker import LocalBroker, kafka_version
    from pipeline.run import RunError, run_job

    cfg = job_config(args)
    if args.duration:
        cfg.run.duration_s = args.duration
    console = Console() if sys.stdout.isatty() else Console(width=140)
    bootstrap = _bootstrap(args, cfg)
    broker = None
    try:
        if not bootstrap:
            work = Path(tempfile.mkdtemp(prefix="broker-", dir=str(_ensure(cfg.state_path()))))
            with console.status(f"starting a local Kafka {kafka_version()} broker "
                                "(first run resolves the jars from Maven Central)"):
                broker = LocalBroker(work).start()
            bootstrap = broker.bootstrap
            console.print(f"local Kafka {kafka_version()} broker at {bootstrap}")
        result = run_job(cfg, bootstrap, garbage_per_device=args.garbage, console=console)
    except RunError as exc:
        console.print(f"[red]run failed:[/red] {exc}")
        return 1
    except KeyboardInterrupt:
        console.print("interrupted; stopped every process this run started")
        return 130
    finally:
        if broker is not None:
            broker.stop()
    if not result.balanced:
        console.print("[red]accounting does not balance: see the table above[/red]")
        return 2
    console.print(f"[green]every record accounted for[/green]; summary in {cfg.state_path() / 'summary.json'}")
    return 0


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


# --- bench ------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    import runpy

    root = Path(__file__).resolve().parent.parent / "benchmarks"
    script = root / f"{args.name}.py"
    if not script.exists():
        names = sorted(p.stem for p in root.glob("*.py") if not p.stem.startswith("_"))
        raise SystemExit(f"edgestream: no benchmark {args.name!r}; available: {', '.join(names)}")
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgestream",
        description="Online deep learning on edge sensor streams over Kafka.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("broker", help="start, stop or check the local Kafka broker")
    p.add_argument("action", choices=("start", "stop", "status"))
    p.add_argument("--state-dir", type=Path, default=DEFAULT_BROKER_STATE,
                   help="where the broker's data, log and pid file live (default: %(default)s)")
    p.add_argument("--port", type=int, default=0, help="client port (default: a free one)")
    p.add_argument("--heap", default="512m", help="JVM heap (default: %(default)s)")
    p.add_argument("--bootstrap", metavar="HOST:PORT", help="check an existing cluster instead")
    p.set_defaults(func=cmd_broker)

    p = sub.add_parser("simulate", help="stream simulated devices into their topics")
    _add_job_args(p)
    p.add_argument("--duration", type=float, help="seconds (default: run.duration_s)")
    p.add_argument("--garbage", type=int, default=0, metavar="N",
                   help="also send N malformed messages per device (tests the dead-letter path)")
    p.add_argument("--report", type=Path, help="write what was produced as JSON here")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve /metrics (records produced per device) on this port (0: a free one)")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("worker", help="run one worker (a Faust worker) until stopped")
    _add_job_args(p)
    p.add_argument("--worker", required=True, help="worker name, w0 .. w{workers.count-1}")
    p.add_argument("--metrics-port", type=int, default=0, help="/metrics port (0: a free one)")
    p.add_argument("--loglevel", default="warning")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("server", help="run the parameter server of a strategy that has one (asp)")
    _add_job_args(p)
    p.add_argument("--metrics-port", type=int, default=0, help="/metrics port (0: a free one)")
    p.add_argument("--loglevel", default="warning")
    p.set_defaults(func=cmd_server)

    p = sub.add_parser("run", help="broker + simulated devices + workers, with a live view")
    _add_job_args(p)
    p.add_argument("--duration", type=float, help="seconds of streaming (default: run.duration_s)")
    p.add_argument("--garbage", type=int, default=0, metavar="N",
                   help="inject N malformed messages per device")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("bench", help="run a benchmark from benchmarks/ (table + JSON)")
    p.add_argument("name", help="benchmark name, e.g. ingest")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    p.set_defaults(func=cmd_bench)

    import importlib

    for module in EXTENSIONS:
        importlib.import_module(module).register(sub, _add_job_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"edgestream: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
