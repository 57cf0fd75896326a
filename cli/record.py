"""Subcommands `record`, `replay` and `import` of the `edgestream` CLI (issue 7)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from edgestream.cli.options import (
    add_service_args,
    job_config,
    need_bootstrap,
    port,
    positive_float,
    positive_int,
    use_log_format,
)


def _bootstrap(args: argparse.Namespace) -> tuple[str, int]:
    cfg = job_config(args)
    return need_bootstrap(args, cfg), cfg.kafka.max_message_bytes


def _fail(console: Console, command: str, message: object, hint: str | None = None) -> int:
    """Print an error, and the hint if any, on one unwrapped line (paths and offsets stay
    greppable); return 2."""
    line = Text(f"edgestream {command}: ", style="red") + Text(" ".join(str(message).split()))
    if hint:
        line += Text(f"; hint: {hint}")
    console.print(line, soft_wrap=True)
    return 2


@contextlib.contextmanager
def _ctrl_c_sets(stop: threading.Event) -> Iterator[None]:
    """While active, Ctrl-C asks the loop to stop cleanly (writer closed, producer flushed)
    instead of raising KeyboardInterrupt in the middle of a write."""
    previous = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    except ValueError:  # not the main thread: keep the default behaviour
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


# --- record -----------------------------------------------------------------------------
def cmd_record(args: argparse.Namespace) -> int:
    from edgestream.pipeline.kafka_io import topic_names
    from edgestream.pipeline.record import RecordError, record, resolve_topics

    console = Console(stderr=True)
    bootstrap, max_bytes = _bootstrap(args)
    # Refusals before the progress bar starts, so each is the only line on stderr.
    if args.out.exists():
        return _fail(console, "record", f"--out {args.out} already exists; choose a new directory")
    try:
        resolve_topics(topic_names(bootstrap), args.topics)
    except RecordError as exc:
        return _fail(console, "record", exc)
    with Progress(TextColumn("recording"), BarColumn(bar_width=None if args.max_records else 20),
                  TextColumn("{task.fields[messages]:,} msgs  {task.fields[rate]:,.0f} msgs/s  "
                             "{task.fields[mb]}  ({task.fields[mbps]:.2f} MB/s)"),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("record", total=args.max_records or args.duration, messages=0,
                                 rate=0.0, mb=_mb(0), mbps=0.0)

        def on_progress(p) -> None:
            el = max(p.elapsed_s, 1e-9)
            done = p.messages if args.max_records else (p.elapsed_s if args.duration else None)
            progress.update(task, completed=done, messages=p.messages, rate=p.messages / el,
                            mb=_mb(p.bytes), mbps=p.bytes / 1e6 / el)

        stop = threading.Event()
        try:
            with _ctrl_c_sets(stop):
                report = record(bootstrap, args.topics, args.out, duration_s=args.duration,
                                max_records=args.max_records, until_end=args.until_end,
                                from_now=args.from_now, max_message_bytes=max_bytes,
                                progress=on_progress, stop=stop)
        except RecordError as exc:
            return _fail(console, "record", exc)
        except FileExistsError as exc:
            return _fail(console, "record", exc)
    table = Table(title=f"recorded {report.directory} (stopped by {report.stopped_by})")
    table.add_column("topic")
    table.add_column("messages", justify="right")
    for t, n in sorted(report.per_topic.items()):
        table.add_row(t, f"{n:,}")
    Console().print(table)
    line = f"{report.messages:,} messages, {_mb(report.bytes)} in {report.duration_s:.1f}s"
    if report.skipped_tombstones:
        line += f"; [yellow]skipped {report.skipped_tombstones} tombstone(s)[/yellow] (not representable)"
    Console().print(line)
    return 0


TRUNCATED_HINT = "use --allow-truncated to replay the intact prefix"


# --- replay -----------------------------------------------------------------------------
def cmd_replay(args: argparse.Namespace) -> int:
    from edgestream.pipeline.replay import ReplayError, replay
    from edgestream.streams.recording import (
        ManifestError,
        RecordingCorrupt,
        RecordingError,
        RecordingReader,
        parse_speed,
    )

    console = Console(stderr=True)
    try:
        speed = parse_speed(args.speed)
        total = RecordingReader(args.directory, allow_truncated=args.allow_truncated).summary()["messages"]
    except (RecordingCorrupt, ManifestError) as exc:
        hint = TRUNCATED_HINT if isinstance(exc, RecordingCorrupt) or "manifest missing" in str(exc) else None
        return _fail(console, "replay", exc, hint)
    except (RecordingError, ReplayError) as exc:
        return _fail(console, "replay", exc)

    cfg = job_config(args)
    use_log_format(args, cfg)
    bootstrap, max_bytes = _bootstrap(args)
    looping = args.loop
    with Progress(TextColumn("replaying" + (" (loop)" if looping else "")),
                  BarColumn(), TextColumn("{task.fields[messages]:,} msgs  {task.fields[rate]:,.0f} msgs/s  "
                                          "{task.fields[mb]}  ({task.fields[mbps]:.2f} MB/s)  pass {task.fields[passes]}"),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("replay", total=None if looping else total, messages=0, rate=0.0,
                                 mb=_mb(0), mbps=0.0, passes=1)

        def on_progress(p) -> None:
            el = max(p.elapsed_s, 1e-9)
            progress.update(task, completed=p.messages if not looping else None, messages=p.messages,
                            rate=p.messages / el, mb=_mb(p.bytes), mbps=p.bytes / 1e6 / el,
                            passes=p.passes + (0 if not looping else 1))

        stop = threading.Event()
        from edgestream.monitoring.metrics import serve_process
        from edgestream.pipeline.service import ProcessService

        metrics, metrics_url = serve_process(args.metrics_port, cfg.workers.metrics_host,
                                             liveness_timeout_s=cfg.service.liveness_timeout_s)
        console.print(f"replayer /metrics: {metrics_url}")
        # Ready once it runs (the recording was read, the cluster answered); SIGTERM/SIGINT
        # stop it between messages (flushed), a second signal at once.
        service = ProcessService("replay", cfg.job.name, metrics.health, cfg.service.shutdown_grace_s)
        service.signals.on_stop = lambda _signum: stop.set()
        try:
            with contextlib.closing(service):
                report = replay(args.directory, bootstrap, speed=speed, loop=looping, metrics=metrics,
                                max_passes=args.max_passes, rename=args.rename or [],
                                rewrite_timestamps=args.rewrite_timestamps,
                                rewrite_devices=args.rewrite_device_ids,
                                allow_truncated=args.allow_truncated, max_message_bytes=max_bytes,
                                progress=on_progress, stop=stop)
        except RecordingCorrupt as exc:  # found while streaming (e.g. the file changed)
            return _fail(console, "replay", exc, TRUNCATED_HINT)
        except (RecordingError, ReplayError) as exc:
            return _fail(console, "replay", exc)
    out = Console()
    if stop.is_set():
        out.print("stopped by a signal; everything sent so far was flushed")
    for t in report.truncated:
        out.print(f"[yellow]replayed the intact prefix only:[/yellow] {t['path']} damaged at byte "
                  f"{t['position']}: {t['reason']}")
    table = Table(title=f"replay of {args.directory} at {'max' if math.isinf(speed) else f'{speed:g}x'}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("messages", f"{report.messages:,} ({report.passes} pass(es))")
    table.add_row("throughput", f"{report.messages_per_s:,.0f} msgs/s, {report.mb_per_s:,.2f} MB/s")
    if report.timing:
        t = report.timing
        table.add_row("requested / achieved span", f"{t['requested_s']:.3f} s / {t['achieved_s']:.3f} s")
        if t["inter_arrival_error_p50_ms"] is not None:
            table.add_row("inter-arrival error p50 / p99 / max",
                          f"{t['inter_arrival_error_p50_ms']:.2f} / {t['inter_arrival_error_p99_ms']:.2f} / "
                          f"{t['inter_arrival_error_max_ms']:.2f} ms")
            table.add_row("lateness p50 / p99", f"{t['lateness_p50_ms']:.2f} / {t['lateness_p99_ms']:.2f} ms")
    for src, dst in sorted(report.destination.items()):
        if src != dst:
            table.add_row(f"{src} ->", dst)
    out.print(table)
    if args.report:
        Path(args.report).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return 0


# --- import -----------------------------------------------------------------------------
def cmd_import(args: argparse.Namespace) -> int:
    from edgestream.job.importer import ImportSpec, TableImportError, import_table, job_file_text

    console = Console()
    err = Console(stderr=True)
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        return _fail(err, "import", f"--rates {args.rates!r} must be numbers, e.g. 92,38,62")
    if args.job_out is not None and args.job_out.exists():
        return _fail(err, "import", f"--job-out {args.job_out} already exists; choose a new file")
    spec = ImportSpec(devices=args.devices, rates_hz=rates, partition=args.partition,
                      dirichlet_alpha=args.alpha, classes_per_device=args.classes_per_device,
                      duration_s=args.duration, records_per_device=args.records_per_device,
                      message_interval_s=args.message_interval, profile=args.profile,
                      device_prefix=args.device_prefix, seed=args.seed,
                      heldout_fraction=args.heldout_fraction)
    try:
        spec.validate()  # before the spinner: a bad option is one line, nothing written
        with console.status(f"importing {args.file}"):
            report = import_table(args.file, args.label_column, args.out, spec)
    except TableImportError as exc:
        return _fail(err, "import", exc)
    except FileExistsError as exc:
        return _fail(err, "import", exc)
    table = Table(title=f"{report.directory}: {report.records:,} records in {report.messages:,} messages, "
                        f"{report.duration_s:.1f}s of streams")
    for col in ("device", "rate/s", "records", "share rows", "labels per class"):
        table.add_column(col, justify="right")
    for d, info in report.devices.items():
        table.add_row(d, f"{info['rate_hz']:g}", f"{info['records']:,}", f"{info['share_rows']:,}",
                      " ".join(map(str, info["label_histogram"])))
    console.print(table)
    data = report.data
    console.print(f"held out for evaluation (never streamed): {data['heldout']['rows']:,} of "
                  f"{report.source['rows']:,} rows ({spec.heldout_fraction:g} of every class); "
                  f"{data['num_classes']} classes, features {tuple(data['feature_shape'])}")
    job = job_file_text(report)
    if args.job_out is not None:
        args.job_out.parent.mkdir(parents=True, exist_ok=True)
        args.job_out.write_text(job)
        console.print(Text(f"job file written: {args.job_out}"))
        console.print(Text(f"train on it with: edgestream run --job {args.job_out}"))
    else:
        console.print("job file (save it, e.g. as job.toml, then run: edgestream run --job job.toml):")
        console.print(Text(job), soft_wrap=True)
    console.print(Text(f"or replay the streams alone with: edgestream replay {report.directory}"))
    return 0


def register(sub: argparse._SubParsersAction, add_job_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `record`, `replay` and `import` subcommands."""

    p = sub.add_parser("record", help="record Kafka topics to a recording directory")
    add_job_args(p)
    p.add_argument("--topics", action="append", required=True, metavar="PATTERN",
                   help="topic names or fnmatch patterns, e.g. 'sensors.*' (repeatable; "
                        "sensors.dlq only when named exactly)")
    p.add_argument("--out", type=Path, required=True, help="new directory for the recording")
    p.add_argument("--duration", type=positive_float, help="stop after this many seconds")
    p.add_argument("--max-records", type=positive_int, help="stop after this many messages")
    p.add_argument("--until-end", action="store_true",
                   help="stop when every partition reaches the end offset it had at start")
    p.add_argument("--from-now", action="store_true", help="start at the current end instead of the beginning")
    p.set_defaults(func=cmd_record)

    p = sub.add_parser("replay", help="produce a recording back to Kafka with its timing")
    add_job_args(p)
    p.add_argument("directory", type=Path, help="recording directory")
    p.add_argument("--speed", default="1", help="1 (recorded timing), k (k times faster) or max")
    p.add_argument("--loop", action="store_true", help="repeat the recording until stopped (Ctrl-C)")
    p.add_argument("--max-passes", type=positive_int, help="with --loop: stop after this many passes")
    p.add_argument("--rename", action="append", metavar="OLD:NEW",
                   help="send topic OLD to NEW (repeatable); prefix form 'sensors.*:sensors.r1-*'")
    p.add_argument("--rewrite-device-ids", action="store_true",
                   help="when a rename maps sensors.<a> to sensors.<b>, rewrite device a to b inside "
                        "sensor messages and keys (workers check that they match the topic)")
    p.add_argument("--rewrite-timestamps", action="store_true",
                   help="set Kafka timestamps to the send time (event times inside the records are kept)")
    p.add_argument("--allow-truncated", action="store_true",
                   help="replay the intact prefix of a truncated or corrupt recording")
    p.add_argument("--report", type=Path, help="write the replay summary as JSON here")
    p.add_argument("--metrics-port", type=port, default=0,
                   help="serve /metrics (records produced per device), /healthz and /readyz on "
                        "workers.metrics_host:PORT (0: a free port)")
    add_service_args(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("import", help="turn a labelled CSV / NumPy / Parquet table into a recording, "
                                      "a held-out split and a job file that trains on it")
    p.add_argument("--file", type=Path, required=True, help=".csv, .tsv, .npy, .npz or .parquet (needs pyarrow)")
    p.add_argument("--label-column", required=True,
                   help="label column name (CSV, Parquet), array name (.npz) or column index (.npy)")
    p.add_argument("--out", type=Path, required=True, help="new directory for the recording")
    p.add_argument("--devices", type=int, default=10)
    p.add_argument("--rates", default="92,38,62,42,48,88,90,22,44,28",
                   help="records/s per device, cycled (default: the ScaDLES rates)")
    p.add_argument("--partition", choices=("iid", "dirichlet", "classes"), default="iid")
    p.add_argument("--alpha", type=float, default=0.3, help="Dirichlet concentration")
    p.add_argument("--classes-per-device", type=int, default=2)
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--duration", type=float, help="seconds of streams")
    length.add_argument("--records-per-device", type=int)
    p.add_argument("--message-interval", type=float, default=0.1, help="seconds per micro-batch message")
    p.add_argument("--profile", default="constant", help="rate profile, e.g. poisson or bursty:on=2,off=1")
    p.add_argument("--device-prefix", default="dev", help="device ids are <prefix>00, <prefix>01, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout-fraction", type=float, default=0.2,
                   help="stratified share of every class kept out of the streams for evaluation "
                        "(default: %(default)s)")
    p.add_argument("--job-out", type=Path, metavar="FILE",
                   help="write a job file that trains on the recording here (default: print it)")
    p.set_defaults(func=cmd_import)
