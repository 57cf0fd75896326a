"""`edgestream run`: broker (if needed), worker processes, simulators, live view, summary.

Every process it starts is in its own process group and is stopped on exit, on
error and on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from edgestream.job.config import ConfigError, JobConfig
from edgestream.job.sources import job_fleet_data
from edgestream.job.topics import job_topics, label_topics, sensor_partitions
from edgestream.monitoring.metrics import serve_process
from edgestream.monitoring.prometheus import file_sd_path, run_targets, write_file_sd
from edgestream.monitoring.scrape import Scrape, scrape
from edgestream.pipeline.app import app_id, sensor_group
from edgestream.pipeline.drain import WAIT, DrainProgress, waiting_for
from edgestream.pipeline.errors import RunError
from edgestream.pipeline.exits import (
    ENDPOINT_FILE,
    EXIT_FILE,
    EXIT_NO_CHECKPOINT,
    FREEZE_SIGNAL,
    FROZEN_FILE,
    worker_state_dir,
)
from edgestream.pipeline.kafka_io import ensure_topics, producer, start_groups_at_end
from edgestream.pipeline.launcher import LaunchedProcess, launcher, preloaded, warm_up
from edgestream.pipeline.outage import BrokerWatch
from edgestream.pipeline.simulate import SimulationReport, check_stream_options, stream_devices
from edgestream.pipeline.worker import (
    SERVER_NAME,
    check_training_config,
    update_topics,
    warn_byzantine,
)

log = logging.getLogger(__name__)

#: The run's result (``RunResult.to_dict``), written on every exit, in the run's state dir.
SUMMARY_FILE = "summary.json"
#: What ``RunResult.outcome`` may be (``failed: <reason>`` too).
RUN_OUTCOMES = ("balanced", "backlog", "unbalanced", "drain_timeout", "interrupted", "failed")


class ProcessFailed(RunError):
    """A process of the run died more often than ``run.max_restarts`` allows (a crash
    loop), or did not become ready in time; one line, with the process's own reason."""

    def __init__(self, message: str, name: str, deaths: list[dict]) -> None:
        super().__init__(message)
        self.name = name
        #: Every death of the run so far (``RunContext.deaths``).
        self.deaths = deaths


#: The live view and the drain wait this many times as long as their last scrape of the
#: workers took before the next (at least 0.5 s and 0.2 s): a worker holding thousands of
#: devices serves a page of megabytes, and the orchestrator shares the cores with it.
SCRAPE_PACE = 4.0
#: Seconds a (re)started process has to join its topics before the run gives up on it.
READY_TIMEOUT_S = 90.0


@dataclass
class WorkerProc:
    """One incarnation of a worker (or server) process of a run."""

    name: str
    proc: subprocess.Popen | LaunchedProcess
    devices: list[str]
    metrics_url: str | None = None
    log_path: Path | None = None
    #: ``time.monotonic()`` when this incarnation was started.
    started_at: float = field(default_factory=time.monotonic)
    #: Joined its topics (its ``edgestream_worker_ready`` gauge is 1).
    ready: bool = False


@dataclass
class RunResult:
    produced: dict[str, int]
    garbage: dict[str, int]
    accounting: dict[str, dict[str, int]]
    balanced: bool
    duration_s: float
    workers: dict[str, str] = field(default_factory=dict)
    training: dict[str, dict] = field(default_factory=dict)
    #: One process name per restart the supervisor made, in order.
    restarted: list[str] = field(default_factory=list)
    #: Every death of a process during the run (``RunContext.deaths``): process, exit
    #: code, reason, seconds into the run, and the backoff before its restart.
    deaths: list[dict] = field(default_factory=list)
    #: Workers stopped on purpose during the run (``RunContext.stop_worker``), in order.
    left: list[str] = field(default_factory=list)
    #: Workers started after the run began (``RunContext.start_worker``), in order.
    joined: list[str] = field(default_factory=list)
    #: A stage-split job (``train.stages``): the stages' final checkpoints put together and
    #: evaluated on the held-out set (``pipeline.training.assembled_evaluation``).
    assembled: dict | None = None
    #: How the run ended: ``balanced``, ``backlog`` (balanced, but a device has records
    #: pending beyond one window: ``backlog``), ``unbalanced``, ``drain_timeout``,
    #: ``interrupted`` or ``failed: <reason>`` (``RUN_OUTCOMES``).
    outcome: str = "balanced"
    #: Why it ended so, in one line ("" for a balanced run).
    reason: str = ""
    #: Processes that wrote no accounting or training summary (name -> what happened).
    missing: dict[str, str] = field(default_factory=dict)
    #: Devices that fell behind (``backlog_of``): device -> records pending beyond one
    #: window at the end. Derived from ``accounting``; the accounting may still balance.
    backlog: dict[str, int] = field(default_factory=dict)
    #: Devices the job file does not name that wrote to a shared topic (their ledgers): what
    #: they produced is not this run's to know, so they are not in ``accounting``'s balance.
    other_devices: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Delayed labels (``labels.topic``): the workers' label counts summed (read, joined,
    #: late, foreign, dead_lettered; scored and correct: arrival-time predictions), with the
    #: simulated devices' ``sent`` and ``withheld``. Empty for inline labels.
    labels: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.backlog = {d: n for d, a in sorted(self.accounting.items()) if (n := backlog_of(a))}

    def to_dict(self) -> dict:
        return self.__dict__


def start_worker_process(
    cfg_path: Path, worker: str, bootstrap: str, metrics_port: int, log_path: Path, join: bool = False,
    prefix: Sequence[str] = (), extra_args: Sequence[str] = (),
) -> subprocess.Popen | LaunchedProcess:
    """Start ``edgestream worker`` (or ``server``) in its own process group; ``join``: ``--join``.

    ``prefix`` runs the command under another one (the testbed's ``ip netns exec NS``, which
    execs it: the process group and exit code stay the worker's); ``extra_args`` go after
    its arguments (the testbed's ``--set workers.metrics_host=<host address>``).

    Without a prefix the process is forked from the preloaded launcher
    (``pipeline/launcher.py``: no import time; ``EDGESTREAM_LAUNCH=exec`` turns it off);
    the handle answers like a ``subprocess.Popen``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    role_args = ["server"] if worker == SERVER_NAME else ["worker", "--worker", worker, *(["--join"] if join else [])]
    argv = [*role_args, "--job", str(cfg_path), "--bootstrap", bootstrap, "--metrics-port", str(metrics_port),
            *extra_args]
    if not prefix and preloaded():
        return launcher().start(argv, log_path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [*prefix, sys.executable, "-m", "edgestream", *argv],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env,
        )


def stop_processes(procs: Sequence[subprocess.Popen | LaunchedProcess], timeout_s: float = 20.0) -> list[int | None]:
    """SIGTERM every process group at once, then wait for each (SIGKILL after ``timeout_s``);
    the exit codes in order. At the end of a run every training process freezes at its
    signal, so one that stops a moment after another never reacts to the other's leave."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    return [stop_process(proc, max(0.0, deadline - time.monotonic()), signalled=True) for proc in procs]


#: At the end of a run, the longest wait for every training process to say it froze.
FREEZE_TIMEOUT_S = 10.0


def freeze_processes(procs: Sequence[tuple[subprocess.Popen | LaunchedProcess, Path]],
                     timeout_s: float = FREEZE_TIMEOUT_S) -> list[bool]:
    """Send ``FREEZE_SIGNAL`` to every running process of ``procs`` (each with its state dir),
    then wait until each wrote ``FROZEN_FILE`` there or exited, at most ``timeout_s``; which
    froze. The end of a run does this before ``stop_processes``: a process frozen takes no
    more steps or membership changes, so none trains on alone when another leaves first
    (SIGTERM is handled when each event loop gets to it, not at one instant). A process
    still starting (no ``ENDPOINT_FILE`` of its pid yet: the signal's default action would
    end it) is not signalled: it trains nothing yet."""
    signalled = [proc.poll() is None and _serving(proc, state) for proc, state in procs]
    for (proc, _), send in zip(procs, signalled, strict=True):
        if send:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, FREEZE_SIGNAL)
    deadline = time.monotonic() + timeout_s

    def settled() -> list[bool]:
        return [not send or (state / FROZEN_FILE).exists() or proc.poll() is not None
                for (proc, state), send in zip(procs, signalled, strict=True)]

    while not all(settled()) and time.monotonic() < deadline:
        time.sleep(0.02)  # poll interval of the markers
    frozen = [(state / FROZEN_FILE).exists() for _, state in procs]
    late = [state.name for (proc, state), ok, send in zip(procs, frozen, signalled, strict=True)
            if send and not ok and proc.poll() is None]
    if late:
        log.warning("%s did not confirm freezing within %g s; stopping them anyway", ", ".join(late), timeout_s)
    return frozen


def _serving(proc: subprocess.Popen | LaunchedProcess, state: Path) -> bool:
    """Whether ``proc`` wrote its ``ENDPOINT_FILE`` in ``state`` (it handles the freeze signal by then)."""
    try:
        return json.loads((state / ENDPOINT_FILE).read_text()).get("pid") == proc.pid
    except (OSError, ValueError, AttributeError):
        return False


def stop_process(proc: subprocess.Popen | LaunchedProcess, timeout_s: float = 20.0, signalled: bool = False) -> int | None:
    """SIGTERM the process group (unless ``signalled``: it was sent already, and a second
    stop signal makes an edgestream process exit at once), SIGKILL it after ``timeout_s``;
    return the exit code."""
    if proc.poll() is None:
        if not signalled:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=5)
    return proc.returncode


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2, on_fail=None,
             since: Callable[[], float] | None = None):
    """Poll ``predicate`` until it returns a truthy value or the deadline passes.

    The deadline is ``timeout_s`` after the call, or after ``since()`` if that is later
    (the run's drain counts from the last time a restarted process became ready).
    """
    started = time.monotonic()
    while True:
        value = predicate()
        if value:
            return value
        deadline = max(started, since() if since is not None else started) + timeout_s
        if time.monotonic() >= deadline:
            detail = on_fail() if on_fail else ""
            raise RunError(f"timed out after {timeout_s:.0f}s waiting for {what}{detail}")
        time.sleep(interval_s)  # poll interval of a deadline wait


def scrape_all(workers: list[WorkerProc]) -> dict[str, Scrape]:
    out = {}
    for w in workers:
        if w.metrics_url:
            s = scrape(w.metrics_url)
            if s is not None:
                out[w.name] = s
    return out


def device_view(cfg: JobConfig, scrapes: dict[str, Scrape], report: SimulationReport | None) -> dict:
    """Per-device figures merged from every worker's metrics.

    The record columns come from each worker's ledger (``edgestream_ledger_records``),
    which a restarted worker continues from its checkpoint, so they stay comparable with
    what was produced across restarts."""
    rows = {}
    layout = cfg.input.layout()
    partitions = cfg.device_partitions()  # computed once, not per device per refresh
    for i, device in enumerate(cfg.devices.device_ids()):
        # A shared topic's lag is per partition: a device's is its partition's (0: nothing
        # of it left to read either).
        lag_label = f"{layout.pattern}:{partitions[device]}" if layout.keyed else device
        row = {"target_hz": cfg.devices.rate_of(i), "produced": 0, "rate_hz": 0.0, "depth": 0,
               "batches": 0, "read": 0, "trained": 0, "dropped": 0, "dead_records": 0, "pending": 0,
               "dlq": 0, "backlog": 0, "batch_cap": 0}
        if report is not None:
            row["produced"] = report.records.get(device, 0)
            row["garbage"] = sum(report.garbage.get(device, {}).values())
        for s in scrapes.values():
            row["rate_hz"] += s.get("edgestream_arrival_rate_hz", device=device)
            row["depth"] += int(s.get("edgestream_buffer_depth_records", device=device))
            row["batches"] += int(s.get("edgestream_batches_total", device=device))
            for key, state in (("read", "read"), ("trained", "trained"), ("dropped", "dropped"),
                               ("dead_records", "dead_lettered"), ("pending", "pending")):
                row[key] += int(s.get("edgestream_ledger_records", device=device, state=state))
            row["dlq"] += int(s.get("edgestream_ledger_dead_letter_messages", device=device))
            row["backlog"] += int(s.get("edgestream_device_backlog_records", device=device))
            row["batch_cap"] = max(row["batch_cap"], int(s.get("edgestream_batch_cap_records", device=device)))
            lag = s.get("edgestream_consumer_lag_records", -1, device=lag_label)
            if lag >= 0:
                row["lag"] = row.get("lag", 0) + int(lag)
        rows[device] = row
    return rows


def render(cfg: JobConfig, rows: dict, title: str) -> Table:
    """The live device table. ``backlog``: records pending beyond one window batch (the
    device arrives faster than its worker batches and trains), red while above 0; with
    ``batcher.max_batch_widen``, ``batch cap`` is each device's current window cap."""
    table = Table(title=title, expand=False)
    trained = "trained" if cfg.train.enabled else "batched"
    widening = cfg.batcher.mode == "window" and cfg.batcher.max_batch_widen > cfg.batcher.max_batch
    for col in ("device", "target/s", "produced", "arrival/s", "buffer", "batches", *(["batch cap"] * widening),
                trained, "dropped", "dead-lettered", "pending", "backlog", "bad msgs"):
        table.add_column(col, justify="right")
    for device, r in rows.items():
        backlog = r.get("backlog", 0)
        table.add_row(device, f"{r['target_hz']:.0f}", str(r["produced"]), f"{r['rate_hz']:.1f}",
                      str(r["depth"]), str(r["batches"]), *([str(r.get("batch_cap", 0))] * widening),
                      str(r["trained"]), str(r["dropped"]), str(r["dead_records"]), str(r["pending"]),
                      f"[red]{backlog}[/red]" if backlog else "-", str(r["dlq"]))
    return table


def drained(cfg: JobConfig, rows: dict, report: SimulationReport) -> bool:
    """Every produced record read and settled (trained, dropped or dead-lettered; in fixed
    mode a remainder smaller than one batch may stay buffered), and every garbage
    message dead-lettered."""
    for device, r in rows.items():
        produced = report.records.get(device, 0)
        garbage = sum(report.garbage.get(device, {}).values())
        if r["read"] < produced or r["dlq"] < garbage:
            return False
        remainder_ok = cfg.batcher.mode == "fixed" and r["pending"] < cfg.batcher.batch_size
        if r["pending"] and not remainder_ok:
            return False
    return True


def prepare_state(cfg: JobConfig) -> tuple[Path, Path]:
    """A clean state dir for a new run (worker state from earlier runs removed) and the
    effective config written there as JSON, which worker processes load: with
    ``run.workers_password_file``, logged in as the job's workers principal."""
    state = cfg.state_path()
    if (state / "workers").exists():
        shutil.rmtree(state / "workers")
    state.mkdir(parents=True, exist_ok=True)
    (state / SUMMARY_FILE).unlink(missing_ok=True)  # never a previous run's result in its place
    cfg_path = state / "job.json"
    cfg_path.write_text(json.dumps(process_config(cfg).to_dict(), indent=2))
    return state, cfg_path


def process_config(cfg: JobConfig) -> JobConfig:
    """The configuration the run's workers and server start with: ``cfg``, or with
    ``run.workers_password_file`` a copy that logs in as ``<job>-workers`` with that file.
    ``ConfigError`` if the file cannot be read (say how to make it)."""
    if not cfg.run.workers_password_file:
        return cfg
    from edgestream.pipeline.acl import workers_user

    password_file = Path(cfg.run.workers_password_file).expanduser().resolve()
    if not password_file.is_file() or not os.access(password_file, os.R_OK):
        raise ConfigError(f"run.workers_password_file {str(password_file)!r} is not a readable file: "
                          f"`edgestream acl apply --job JOB --password-dir DIR` writes DIR/{workers_user(cfg)}.password")
    kafka = dataclasses.replace(cfg.kafka, sasl_username=workers_user(cfg), sasl_password_file=str(password_file))
    return dataclasses.replace(cfg, kafka=kafka)


def run_job(
    cfg: JobConfig,
    bootstrap: str,
    *,
    garbage_per_device: int = 0,
    console: Console | None = None,
    live: bool = True,
    on_streaming: Callable[[RunContext], None] | None = None,
    drain: bool = True,
    testbed: Any = None,
) -> RunResult:
    """Run workers (+ server) + simulators against ``bootstrap`` for ``cfg.run.duration_s``.

    ``drain=False`` stops the processes as soon as streaming ends instead of waiting for
    every record to be consumed (benchmarks that measure a fixed time budget); records
    not yet read stay in their topics and show as neither batched nor buffered.

    ``on_streaming(ctx)`` is called once from a helper thread while the simulators run
    (tests use it to kill and restart a worker mid-run).

    ``testbed`` (a running ``deploy.testbed.Testbed``, ``pipeline.testbed_run``): every
    worker and the server start on their own host, the simulators on the devices host;
    ``bootstrap`` is then the testbed's brokers, reached from here over its bridge.
    """
    console = console or Console()
    check_stream_options(cfg, garbage_per_device)
    if cfg.devices.external and garbage_per_device:
        raise ConfigError("--garbage injects malformed messages from the simulators, and a job with "
                          "devices.external = true has none: its devices publish themselves")
    if testbed is None:
        warm_up()  # the fork server imports the workers' code while topics are made
    state, cfg_path = prepare_state(cfg)
    devices = cfg.devices.device_ids()
    training = cfg.train.enabled
    subscribes: tuple[str, ...] = ()
    if training:
        subscribes = check_training_config(cfg)
        warn_byzantine(cfg)
    # Every configured worker's inbox up front (point-to-point strategies): a message
    # to a worker that starts later (or joins) waits in its topic.
    ensure_topics(bootstrap, job_topics(cfg, subscribes), sized=sensor_partitions(cfg))
    if training:
        from edgestream.pipeline.training import initial_workers

        names = initial_workers(cfg)  # the others may join later (RunContext.start_worker)
    else:
        names = list(cfg.worker_names())
    if training and "server" in strategy_roles(cfg.train.strategy):
        names.insert(0, SERVER_NAME)
    groups: dict[str, list[str]] = {}
    for name in [SERVER_NAME] * (SERVER_NAME in names) + list(cfg.worker_names()):
        if name != SERVER_NAME:
            sensors = sorted({cfg.input.layout().topic(d) for d in cfg.devices_of(name)})
            # and the label topic: an earlier run's labels must not join this run's readings
            groups.setdefault(sensor_group(cfg, name), []).extend([*sensors, *label_topics(cfg)])
        if training:
            groups.setdefault(app_id(cfg, name), []).extend(
                update_topics(cfg, name, subscribes if name != SERVER_NAME else ()))
    # A run consumes what is produced during it, even on a long-lived cluster. External
    # devices (devices.external) are counted from exactly where their workers start.
    arrivals_from = None
    if cfg.devices.external:
        from edgestream.pipeline.external import device_topic_ends

        arrivals_from = device_topic_ends(bootstrap, cfg)
    start_groups_at_end(bootstrap, groups, at=arrivals_from)
    ctx = RunContext(cfg, bootstrap, state, cfg_path, [], testbed=testbed)
    stop = ctx.stop
    t_start = time.monotonic()
    report_box: dict[str, SimulationReport] = {}
    outcome, reason = "", ""
    failure: BaseException | None = None
    sim: threading.Thread | None = None
    injected_added = False
    watch = BrokerWatch(bootstrap, "run", lambda line: console.print(f"[yellow]{line}[/yellow]")).start()
    try:
        for name in names:
            ctx.start(name)
        ctx.wait_all_ready()  # supervised: a process that dies starting is restarted (or ends the run)
        sim_metrics, sim_url = serve_process(0, cfg.workers.metrics_host)
        ctx.simulator_url = sim_url
        ctx.publish_targets()
        console.print("[bold]metrics endpoints:[/bold] " + ", ".join(
            [f"{w.name} {w.metrics_url}" for w in ctx.workers] + [f"simulator {sim_url}"]))
        console.print(f"[bold]Prometheus targets file:[/bold] {ctx.targets_file} "
                      "(see docs/monitoring.md; `edgestream prometheus` scrapes it)")
        errors: list[BaseException] = []

        def produce() -> None:
            try:
                if testbed is not None:
                    from edgestream.pipeline.testbed_run import enter_devices

                    enter_devices(testbed)  # this thread and the producers' threads
                if arrivals_from is not None:  # no simulators: count what the devices write
                    from edgestream.pipeline.external import await_devices

                    report_box["final"] = await_devices(
                        cfg, bootstrap, cfg.run.duration_s, start_offsets=arrivals_from, stop=stop,
                        progress=lambda r: report_box.__setitem__("live", r), report_path=state / "simulation.json",
                        say=lambda line: console.print(f"[yellow]{line}[/yellow]", soft_wrap=True))
                    return
                report_box["final"] = stream_devices(
                    cfg, bootstrap, cfg.run.duration_s, garbage_per_device=garbage_per_device,
                    stop=stop, progress=lambda r: report_box.__setitem__("live", r), metrics=sim_metrics,
                    report_path=state / "simulation.json",
                )
            except BaseException as exc:  # surfaced in the main thread
                errors.append(exc)

        sim = threading.Thread(target=produce, name="simulators", daemon=True)
        sim.start()
        hook = None
        if on_streaming is not None:
            hook = threading.Thread(target=lambda: _guard(on_streaming, ctx, errors), name="run-hook", daemon=True)
            hook.start()
        title = f"edgestream run '{cfg.job.name}' - {len(devices)} devices, {len(cfg.worker_names())} worker(s)"
        if arrivals_from is not None:
            title = title.replace(" devices,", " external devices,")
            console.print(f"devices.external: no simulators; counting what the {len(devices)} devices write to "
                          f"{cfg.input.topic} for up to {cfg.run.duration_s:g} s", soft_wrap=True)
        with Live(console=console, refresh_per_second=2, transient=False, auto_refresh=False) as view:
            while sim.is_alive():
                ctx.supervise()
                scraped_at = time.monotonic()
                scrapes = scrape_all(ctx.workers)
                rows = device_view(cfg, scrapes, report_box.get("live"))
                took = time.monotonic() - scraped_at
                elapsed = time.monotonic() - t_start
                if live:
                    view.update(render_all(cfg, rows, scrapes, f"{title} - streaming {elapsed:.0f}/{cfg.run.duration_s:.0f}s",
                                           ctx.restarts_line()), refresh=True)
                if training and cfg.train.target_accuracy > 0 and _reached(cfg, scrapes, ctx.running_workers()):
                    stop.set()
                sim.join(timeout=max(0.5, SCRAPE_PACE * took))
            stop.set()  # streaming is over: tells hooks that wait on ``ctx.stop``
            if hook is not None:
                hook.join(timeout=120)
            if errors:
                raise errors[0]
            report = report_box["final"]
            _add_injected(ctx, report)
            injected_added = True
            if drain:
                reason = _drain(cfg, ctx, report, view if live else None, title, watch)
                outcome = "drain_timeout" if reason else ""
                if reason:
                    console.print(f"[red]{reason}[/red]")
            if training and drain and not reason:
                # Replicas that read the whole update log agree on the version; where the
                # strategy keeps replicas apart (local steps, per-worker pulls), every
                # process's version stops moving instead.
                quiet = VersionsQuiet()
                try:
                    wait_for(lambda: ctx.supervise() or quiet.settled(scrape_all(ctx.workers)), 30,
                             "workers to apply every published update")
                except ProcessFailed:
                    raise
                except RunError:
                    # Not settled in time: the summary's versions and digests show it.
                    log.warning("training did not settle within 30 s of the drain: updates in flight: %s",
                                ", ".join(updates_in_flight(scrape_all(ctx.workers))) or "none")
        if not console.is_terminal:
            console.line()  # rich ends a live view on a non-terminal without a newline
    except KeyboardInterrupt as exc:
        outcome, reason, failure = "interrupted", "interrupted (Ctrl-C or SIGTERM)", exc
    except BaseException as exc:
        outcome, reason, failure = f"failed: {_one_line(exc)}", _one_line(exc), exc
    finally:
        stop.set()
        if sim is not None:
            sim.join(timeout=60)  # an interrupted stream flushes and reports what it produced
        watch.stop()
        procs = list(reversed(ctx.workers))
        if training:
            freeze_processes([(w.proc, worker_state_dir(cfg, w.name)) for w in procs])
        codes = dict(zip([w.name for w in procs], stop_processes([w.proc for w in procs]), strict=True))
    report = report_box.get("final") or report_box.get("live")
    if report is not None and not injected_added:
        _add_injected(ctx, report)
    try:
        result = _collect(cfg, ctx, state, report, codes, time.monotonic() - t_start, query_kafka=failure is None)
    except Exception as exc:  # noqa: BLE001 - the summary of a run that failed must not hide why
        if failure is not None:
            raise failure from exc
        raise
    result.outcome, result.reason = (outcome, reason) if outcome else ended_as(result)
    (state / SUMMARY_FILE).write_text(json.dumps(result.to_dict(), indent=2))
    console.print(summary_table(result, training))
    if result.other_devices:
        console.print(others_line(result, training), soft_wrap=True)
    if training:
        console.print(training_table(result))
        if any(t.get("predictions") for t in result.training.values()):
            console.print(predictions_line(result), soft_wrap=True)
    if result.labels:
        console.print(labels_line(result.labels), soft_wrap=True)
    if result.assembled is not None:
        console.print(f"assembled model (stages {' -> '.join(result.assembled['versions'])}, from their final "
                      f"checkpoints at versions {', '.join(map(str, result.assembled['versions'].values()))}): "
                      f"held-out accuracy {result.assembled['accuracy']:.3f}, loss {result.assembled['loss']:.3f}")
    if result.deaths:
        console.print(deaths_table(result))
    for line in result.missing.values():
        console.print(f"[yellow]{line}[/yellow]", soft_wrap=True)
    console.print(f"outcome: {result.outcome}; summary in {state / SUMMARY_FILE}", soft_wrap=True)
    if failure is not None:
        raise failure
    return result


def ended_as(result: RunResult) -> tuple[str, str]:
    """The outcome of a run that drained, and why in one line: ``unbalanced`` (the accounting
    does not add up), ``backlog`` (it adds up, but a device has records pending beyond one
    window: it arrives faster than its worker batches and trains) or ``balanced``."""
    if not result.balanced:
        return "unbalanced", "accounting does not balance (see the table)"
    if result.backlog:
        return "backlog", "rate above capacity: " + ", ".join(
            f"{d} has {n} records pending beyond one window" for d, n in result.backlog.items())
    return "balanced", ""


def _one_line(exc: BaseException) -> str:
    """``exc`` as one line: its message, or its class name when it has none."""
    text = " ".join(str(exc).split())
    return text if isinstance(exc, RunError) and text else f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _add_injected(ctx: RunContext, report: SimulationReport) -> None:
    """What hooks injected beside the simulators joins the report's figures."""
    for device, n in ctx.injected_records.items():
        report.records[device] = report.records.get(device, 0) + n
    for device, n in ctx.injected_garbage.items():
        report.garbage.setdefault(device, {})["injected"] = n


def _drain(cfg: JobConfig, ctx: RunContext, report: SimulationReport, view: Live | None, title: str,
           watch: BrokerWatch) -> str:
    """Wait until every record is settled (``drained``; a training run also until nothing
    moves for 3 s with no lag left); "" then, else why it stopped waiting (one line).

    The drain waits while anything moves (``DrainProgress``: records read, trained or
    pending, steps, versions, lag; a process that became ready; Kafka unreachable), at
    most ``run.drain_timeout_s`` without progress and ``run.drain_max_s`` in all.
    """
    training = cfg.train.enabled
    progress = DrainProgress(cfg.run.drain_timeout_s, cfg.run.drain_max_s)
    blocked = BlockedWatch(scrape_all(ctx.workers))
    settle = {"key": None, "since": time.monotonic()}
    while True:
        ctx.supervise()
        progress.restarted(ctx.last_ready_at())
        if watch.down():
            progress.restarted(time.monotonic())  # the broker is away: waiting is not being stuck
        scraped_at = time.monotonic()
        scrapes = scrape_all(ctx.workers)
        all_rows = device_view(cfg, scrapes, report)
        # A device whose worker left (or never started) is not read any more: its
        # records stay in Kafka and the summary counts them as unread.
        reading = set(ctx.running_devices())
        rows = {d: r for d, r in all_rows.items() if d in reading}
        figures = [{d: [r["read"], r["trained"], r["pending"], r.get("lag")] for d, r in rows.items()},
                   {w: [s.get("edgestream_trained_records_total", worker=w), s.get("edgestream_steps_total", worker=w),
                        s.get("edgestream_model_version", worker=w)] for w, s in scrapes.items()}]
        progress.observe(figures)
        took = time.monotonic() - scraped_at
        what = waiting_for(rows, report.records) + ("; Kafka unreachable" if watch.down() else "")
        if view is not None:
            view.update(render_all(cfg, all_rows, scrapes, f"{title} - {progress.status(what)}",
                                   ctx.restarts_line()), refresh=True)
        if ctx.all_ready() and _settled(cfg, rows, report, figures, settle, training):
            return ""
        if progress.verdict() != WAIT:
            return (progress.timeout_reason(what) + blocked.hint(scrape_all(ctx.workers))
                    + "; per device: " + json.dumps(rows))
        time.sleep(max(0.2, SCRAPE_PACE * took))  # poll interval; DrainProgress enforces the deadlines


def _settled(cfg: JobConfig, rows: dict, report: SimulationReport, figures: list, settle: dict,
             training: bool) -> bool:
    """Every record read and settled (``drained``); or, for training (which can hold records
    it cannot use yet: BSP waits for peers whose streams ended), nothing left to read and
    no progress for 3 s (what is held shows up as pending: not acknowledged, re-read on
    restart)."""
    if drained(cfg, rows, report):
        return True
    if not training:
        return False
    key = json.dumps(figures, sort_keys=True)
    if key != settle["key"]:
        settle.update(key=key, since=time.monotonic())
        return False
    return all(r.get("lag", -1) == 0 for r in rows.values()) and time.monotonic() - settle["since"] >= 3.0


def _collect(cfg: JobConfig, ctx: RunContext, state: Path, report: SimulationReport | None,
             codes: dict[str, int | None], duration_s: float, *, query_kafka: bool) -> RunResult:
    """The run's result from what its processes wrote on exit. A process that wrote no
    accounting (or training summary) is named in ``missing``; its devices show as nothing
    read. ``query_kafka`` False (the run failed: the cluster may be what failed): the
    records of a stopped worker's devices still in Kafka are not counted."""
    training = cfg.train.enabled
    accounting: dict[str, dict[str, int]] = {}
    labels: dict[str, int] = {}
    train_summary: dict[str, dict] = {}
    missing: dict[str, str] = {}
    running = set(ctx.running_workers())
    for w in ctx.workers:
        wdir = state / "workers" / w.name
        files = ([] if w.name == SERVER_NAME else ["accounting.json"]) + (["training.json"] if training else [])
        for file in files:
            path = wdir / file
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                missing[w.name] = (f"{_role(w.name)} exited ({codes.get(w.name)}) without writing {path}: "
                                   f"its figures are not in the tables{_log_hint(w)}")
                continue
            if file == "accounting.json":
                accounting.update(data["devices"])
                for key, n in (data.get("labels") or {}).items():
                    labels[key] = labels.get(key, 0) + n
            else:
                train_summary[w.name] = data
    report = report or SimulationReport()
    produced = {d: report.records.get(d, 0) for d in cfg.devices.device_ids()}
    garbage = {d: sum(report.garbage.get(d, {}).values()) for d in cfg.devices.device_ids()}
    for worker in cfg.worker_names():
        for device in cfg.devices_of(worker):
            a = accounting.setdefault(device, dict(NOTHING_READ))  # a worker that never ran
            a["running"] = worker in running
            a["unread"] = 0 if a["running"] else produced.get(device, 0) - a["records_in"]
            if not a["running"] and query_kafka:
                a["in_kafka"] = records_in_kafka(ctx.bootstrap, device, sensor_group(cfg, worker), cfg)
    others = {d: accounting.pop(d) for d in sorted(set(accounting) - set(produced))}  # met on a shared topic
    balanced = not missing and all(balances(produced[d], garbage[d], a) for d, a in accounting.items())
    result = RunResult(produced, garbage, accounting, balanced, duration_s,
                       {w.name: w.metrics_url or "" for w in ctx.workers}, train_summary,
                       list(ctx.restarts), list(ctx.deaths), list(ctx.left), list(ctx.joined), missing=missing,
                       other_devices=others)
    if cfg.labels.delayed:
        result.labels = {**labels, "sent": report.labels_sent, "withheld": report.labels_withheld}
    if training and cfg.train.stages and not missing:
        from edgestream.pipeline.training import (
            assembled_evaluation,  # torch: only for training runs
        )

        result.assembled = assembled_evaluation(
            cfg, job_fleet_data(cfg), {name: state / "workers" / name for name in cfg.worker_names()})
    return result


def _guard(fn, ctx, errors) -> None:
    try:
        fn(ctx)
    except BaseException as exc:
        errors.append(exc)


def strategy_roles(name: str) -> tuple[str, ...]:
    from edgestream.trainers.strategies import roles

    return roles(name)


def _reached(cfg: JobConfig, scrapes: dict[str, Scrape], running: list[str]) -> bool:
    """Every running worker's held-out accuracy reached ``train.target_accuracy``."""
    workers = [w for w in running if w != SERVER_NAME]
    accs = [s.get("edgestream_accuracy_ratio", -1.0, worker=w, split="heldout")
            for w in workers for s in [scrapes.get(w)] if s is not None]
    return bool(workers) and len(accs) == len(workers) and min(accs) >= cfg.train.target_accuracy


#: The accounting row of a device nobody read during the run.
NOTHING_READ: dict = {
    "messages_in": 0, "records_in": 0, "consumed": 0, "dropped": 0, "dead_records": 0,
    "dead_letter_messages": 0, "dead_letters_by_reason": {}, "dead_records_by_reason": {},
    "batched": 0, "buffered": 0, "in_sink": 0, "pending": 0, "max_depth": 0, "pauses": 0,
}


def records_in_kafka(bootstrap: str, device: str, group: str, cfg: JobConfig) -> int:
    """Records still in ``device``'s topic at or above the committed offset of ``group`` (the
    worker's sensor group: everything it did not acknowledge), counted by decoding each
    message there (a malformed one counts 0). What the summary's "unread" is checked against."""
    from kafka.structs import TopicPartition

    from edgestream.pipeline.kafka_io import end_offsets, group_positions, read_range
    from edgestream.streams import codec

    input_format, params = cfg.input.resolved()  # the devices' own format (input.format)
    limits = codec.DecodeLimits(max_message_bytes=cfg.limits.max_record_message_bytes,
                                max_records=cfg.limits.max_records_per_message)
    decoder = input_format.decoder(params, limits, expected_device=device)
    layout = cfg.input.layout()
    topic = layout.topic(device)
    start = group_positions(bootstrap, group, [topic])
    total = 0
    for tp, end in end_offsets(bootstrap, [topic]).items():
        if layout.keyed and tp.partition != cfg.device_partitions()[device]:
            continue  # a shared topic: the device's messages are in its key's partition only
        first = start.get(f"{tp.topic}:{tp.partition}", 0)
        for record in read_range(bootstrap, TopicPartition(tp.topic, tp.partition), first, end, timeout_s=60.0,
                                 max_message_bytes=cfg.kafka.max_message_bytes, client_id="edgestream-unread"):
            if layout.keyed and record.key != device.encode():
                continue  # another device's
            try:
                total += len(decoder.decode(record.value, timestamp_s=record.timestamp / 1000,
                                            offset=record.offset).seq)
            except Exception:  # a malformed message carries no records
                pass
    return total


class BlockedWatch:
    """Which workers the sync rule kept from training during the drain (their
    ``edgestream_blocked_seconds_total`` grew: SSP workers waiting for a peer whose stream
    ended), for the message of a drain that timed out."""

    def __init__(self, scrapes: dict[str, Scrape]) -> None:
        self._start = self._blocked(scrapes)

    @staticmethod
    def _blocked(scrapes: dict[str, Scrape]) -> dict[str, float]:
        return {w: s.get("edgestream_blocked_seconds_total", worker=w) for w, s in scrapes.items()}

    def hint(self, scrapes: dict[str, Scrape]) -> str:
        now = self._blocked(scrapes)
        waiting = sorted(w for w, v in now.items() if v - self._start.get(w, v) > 1.0)
        if not waiting:
            return ""
        return (f"; {', '.join(waiting)} kept waiting for the slowest worker (the strategy's staleness "
                "bound); once that one has no records left they wait for good: give the devices equal "
                "streams, a larger bound, or a longer run.drain_timeout_s")


def uncommitted(scrapes: dict[str, Scrape]) -> list[str]:
    """Workers holding local steps that a commit due without further training will carry
    (ADSP's timed commit: ``edgestream_awaiting_commit_steps`` above 0). A local SGD
    worker's partial round at the end of a stream needs more steps to be committed and is not
    waited for: it never comes."""
    return [w for w, s in scrapes.items() if s.get("edgestream_awaiting_commit_steps", 0.0, worker=w) > 0]


def updates_in_flight(scrapes: dict[str, Scrape]) -> list[str]:
    """The update partitions some process wrote past what one of its readers has handled,
    as ``topic[partition] (reader at handled of written)``. A reader of a topic exports
    where it is in each partition it reads (``edgestream_update_log_handled_messages``,
    from the position it starts at) and must be at the highest end any process wrote there
    (``edgestream_update_log_written_messages``). A restarted process reports only its
    own writes since, but offsets are the log's, so the highest end still holds."""
    written: dict[tuple[str, str], float] = {}
    handled: dict[str, dict[tuple[str, str], float]] = {}
    for w, s in scrapes.items():
        for sample in s.samples:
            if sample.name not in ("edgestream_update_log_written_messages", "edgestream_update_log_handled_messages"):
                continue
            labels = dict(sample.labels)
            if labels.get("worker") != w:
                continue
            at = (labels.get("topic", ""), labels.get("partition", ""))
            if sample.name == "edgestream_update_log_written_messages":
                written[at] = max(written.get(at, 0.0), sample.value)
            else:
                handled.setdefault(w, {})[at] = sample.value
    behind = []
    for reader, positions in sorted(handled.items()):
        readers_topics = {topic for topic, _ in positions}
        for (topic, partition), end in sorted(written.items()):
            at = positions.get((topic, partition), 0.0)
            if topic in readers_topics and at < end:
                behind.append(f"{topic}[{partition}] ({reader} at {at:.0f} of {end:.0f})")
    return behind


class VersionsQuiet:
    """The end-of-run check that training settled: no update is in flight (every reader of
    an update topic handled what was written there), no worker holds local steps it has not
    committed (ADSP), and every worker is at one model version, or no process's version
    (the server's included) moved for ``quiet_s`` seconds (ADSP and local SGD workers end
    at versions of their own)."""

    def __init__(self, quiet_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.quiet_s = quiet_s
        self.clock = clock
        self._last: dict[str, float] | None = None
        self._since = clock()

    def settled(self, scrapes: dict[str, Scrape]) -> bool:
        if updates_in_flight(scrapes):
            return False  # a gradient or model written and not yet handled by a reader
        if uncommitted(scrapes):
            return False  # local steps not committed yet (ADSP): their commit is due within an interval
        versions = {w: s.get("edgestream_model_version", -1.0, worker=w) for w, s in scrapes.items()}
        if len({v for w, v in versions.items() if w != SERVER_NAME}) == 1:
            return True
        now = self.clock()
        if versions != self._last:
            self._last, self._since = versions, now
            return False
        return now - self._since >= self.quiet_s


@dataclass
class RunContext:
    """The processes of a run, for the orchestrator and for hooks (fault tests), and their
    supervision: ``supervise()`` notices a process that died, restarts it after a backoff
    (``run.restart_backoff_s``, doubled per restart of that process) at most
    ``run.max_restarts`` times, and then ends the run (``ProcessFailed``). A restarted
    worker resumes from its checkpoint (``pipeline.training``).

    Invariant: ``restarts`` holds one name per restart made, ``deaths`` one entry per
    death noticed; a name is in ``_due`` while its restart waits for its backoff.
    """

    cfg: JobConfig
    bootstrap: str
    state: Path
    cfg_path: Path
    workers: list[WorkerProc]
    restarts: list[str] = field(default_factory=list)
    #: One dict per death: process, code, reason, at_s (into the run), restart_in_s (None: none).
    deaths: list[dict] = field(default_factory=list)
    simulator_url: str | None = None
    #: The supervisor's clock (a fake one in unit tests) and the run's start on it.
    clock: Callable[[], float] = time.monotonic
    started_at: float = field(default_factory=time.monotonic)
    #: Process name -> ``clock()`` time its restart is due.
    _due: dict[str, float] = field(default_factory=dict)
    _last_ready_at: float = 0.0
    #: Set to end streaming early (the run then drains as after ``run.duration_s``).
    stop: threading.Event = field(default_factory=threading.Event)
    #: What hooks produced beside the simulators (``inject``): records and bad messages per device.
    injected_records: dict[str, int] = field(default_factory=dict)
    injected_garbage: dict[str, int] = field(default_factory=dict)
    #: Workers stopped on purpose (``stop_worker``): never restarted, their devices not read.
    left: list[str] = field(default_factory=list)
    #: Workers started after the run began (``start_worker``).
    joined: list[str] = field(default_factory=list)
    #: Process name -> started with ``--join`` (kept for its restarts).
    _join: dict[str, bool] = field(default_factory=dict)
    #: Processes whose restart waits, past its backoff, until ``release_restart`` (fault tests).
    _held: set[str] = field(default_factory=set)
    #: The running ``deploy.testbed.Testbed`` of a run in the testbed (None: loopback): where
    #: each process starts, and what hooks cut and heal (``ctx.testbed.fault("w2", "partition")``).
    testbed: Any = None
    #: Held by a supervision pass and by a membership change (``start_worker``, the start of
    #: ``stop_worker``): a hook's thread changes the processes while the orchestrating
    #: thread supervises them, and a pass must never see a worker stopped on purpose as
    #: running again before its new process is in ``workers`` (it would take the old
    #: process's exit for a death and start a second one).
    _membership: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def inject(self, device: str, values: list[bytes], *, records: int = 0) -> None:
        """Produce ``values`` into ``device``'s topic (fault tests) and count them in the run's
        accounting: ``records`` > 0 is how many records the messages carry in all (they join
        what was produced); 0 means bad messages (each must be dead-lettered whole)."""
        prod = producer(self.bootstrap, self.cfg.kafka.max_message_bytes)
        try:
            for value in values:
                prod.send(self.cfg.input.layout().topic(device), value=value, key=device.encode())
            prod.flush()
        finally:
            prod.close()
        if records:
            self.injected_records[device] = self.injected_records.get(device, 0) + records
        else:
            self.injected_garbage[device] = self.injected_garbage.get(device, 0) + len(values)

    def stop_streaming(self) -> None:
        """End the simulators now; the run drains, summarises and stops its processes."""
        self.stop.set()

    @property
    def targets_file(self) -> Path:
        return file_sd_path(self.cfg.job.name)

    def publish_targets(self) -> None:
        """Write the Prometheus file-SD targets of every process of the run."""
        write_file_sd(self.targets_file, run_targets({w.name: w.metrics_url or "" for w in self.workers},
                                                     simulator_url=self.simulator_url))

    def start(self, name: str, *, join: bool | None = None) -> WorkerProc:
        """Start (or restart) process ``name``; ``join`` (None: as it was started before)
        starts a worker with ``--join``."""
        join = self._join.get(name, False) if join is None else join
        self._join[name] = join
        base = self.cfg.workers.metrics_port_base
        port = base + len(self.workers) if base else 0
        log_path = self.state / "logs" / f"{name}.log"
        for stale in (ENDPOINT_FILE, EXIT_FILE):  # the previous incarnation's
            (self.state / "workers" / name / stale).unlink(missing_ok=True)
        extra: dict[str, Any] = {"join": True} if join else {}
        if self.testbed is not None:
            from edgestream.pipeline.testbed_run import process_placement

            extra["prefix"], extra["extra_args"] = process_placement(self.testbed, name)
        proc = start_worker_process(self.cfg_path, name, self.bootstrap, port, log_path, **extra)
        devices = self.cfg.devices_of(name) if name != SERVER_NAME else []
        w = WorkerProc(name, proc, devices, log_path=log_path, started_at=self.clock())
        self.workers = [x for x in self.workers if x.name != name] + [w]
        return w

    # --- membership (hooks): workers that join or leave the running job -----------------
    def start_worker(self, name: str, *, join: bool = True) -> WorkerProc:
        """Start a worker that is not running: one outside the initial set (it joins the
        running job: ``--join``), or one that left (with a checkpoint it resumes from it and
        the strategy readmits it). The supervisor watches it from then on."""
        if name == SERVER_NAME or name not in self.cfg.worker_names():
            raise RunError(f"{name!r} is not a worker of this job ({self.cfg.worker_names()})")
        with self._membership:
            if any(w.name == name and w.proc.poll() is None for w in self.workers):
                raise RunError(f"worker {name} is already running")
            self.left = [n for n in self.left if n != name]
            self.joined.append(name)
            return self.start(name, join=join)

    def stop_worker(self, name: str, timeout_s: float = 20.0) -> int | None:
        """SIGTERM worker ``name`` and wait for it to exit: it leaves the job (``op: leave``,
        final checkpoint) and the supervisor does not restart it. Its devices are not read
        any more; the summary counts their records as unread. Returns its exit code."""
        with self._membership:
            w = self.worker(name)
            self.left.append(name)  # before the signal: supervise() must not take it for a death
        return stop_process(w.proc, timeout_s)

    def running_workers(self) -> list[str]:
        """Processes of the run that are not stopped on purpose (a dead one waiting for its
        restart counts: it comes back)."""
        return [w.name for w in self.workers if w.name not in self.left]

    def running_devices(self) -> list[str]:
        """Devices whose worker runs: the ones the run must read to the end."""
        running = set(self.running_workers())
        return [d for w in self.cfg.worker_names() if w in running for d in self.cfg.devices_of(w)]

    # --- supervision (called from the orchestrating thread only) ----------------------
    def supervise(self) -> None:
        """One supervision pass: record deaths, start restarts that are due, track readiness.

        Raises ``ProcessFailed`` when a process dies once more than ``run.max_restarts``
        allows, or a (re)started process is not ready within ``READY_TIMEOUT_S``.

        Once ready, a process is judged by its exit alone: one whose ``/metrics`` does not
        answer (its testbed host partitioned) is left running, never counted dead.
        """
        with self._membership:
            self._supervise()

    def _supervise(self) -> None:
        now = self.clock()
        left = set(self.left)
        for w in list(self.workers):
            if w.name in self._due or w.name in left:
                continue
            code = w.proc.poll()
            if code is None:
                if not w.ready:
                    self._check_ready(w, now)
                continue
            self._died(w, code, now)
        for name, due in list(self._due.items()):
            if now >= due and name not in self._held:
                del self._due[name]
                self.start(name)
                self.restarts.append(name)

    def _died(self, w: WorkerProc, code: int, now: float) -> None:
        done = self.restarts.count(w.name)
        allowed = self.cfg.run.max_restarts
        death = {"process": w.name, "code": code, "reason": self._death_reason(w, code),
                 "at_s": round(now - self.started_at, 1), "restart_in_s": None}
        self.deaths.append(death)
        if code == EXIT_NO_CHECKPOINT:  # every checkpoint rejected: a restart meets the same files
            raise ProcessFailed(f"{_role(w.name)} {death['reason']}; not restarted (exit {code}: a restart "
                                f"cannot help), so the run stops{_log_hint(w)}", w.name, list(self.deaths))
        if done >= allowed:
            deaths = sum(1 for d in self.deaths if d["process"] == w.name)
            raise ProcessFailed(
                f"{_role(w.name)} {death['reason']}; it died {deaths} time(s) and run.max_restarts={allowed} "
                f"allows {allowed} restart(s), so the run stops{_log_hint(w)}",
                w.name, list(self.deaths),
            )
        # Exponential backoff: a process that fails at once does not spin.
        death["restart_in_s"] = self.cfg.run.restart_backoff_s * 2 ** done
        self._due[w.name] = now + death["restart_in_s"]
        w.ready = False

    def _death_reason(self, w: WorkerProc, code: int) -> str:
        """How a process ended, in words: its own crash reason (``exit.json``) if it wrote one."""
        verdict: dict = {}
        path = self.state / "workers" / w.name / EXIT_FILE
        try:
            verdict = json.loads(path.read_text())
        except (OSError, ValueError):
            pass
        if verdict.get("pid") not in (None, w.proc.pid):
            verdict = {}  # another incarnation's
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        if verdict.get("reason"):
            return f"crashed (exit {code}): {verdict['reason']}"
        if code == 0:
            return "exited (code 0) before the run was over"
        return f"exited with code {code}"

    def _check_ready(self, w: WorkerProc, now: float) -> None:
        if w.metrics_url is None:
            path = self.state / "workers" / w.name / ENDPOINT_FILE
            if path.exists():
                w.metrics_url = json.loads(path.read_text())["metrics"]
                self.publish_targets()
        if w.metrics_url is not None:
            s = scrape(w.metrics_url)
            if s is not None and s.get("edgestream_worker_ready", worker=w.name) == 1:
                w.ready = True
                self._last_ready_at = now
                return
        if now - w.started_at > READY_TIMEOUT_S:
            what = "join its topics" if w.metrics_url else "start"
            raise ProcessFailed(f"{_role(w.name)} did not {what} within {READY_TIMEOUT_S:.0f}s{_log_hint(w)}",
                                w.name, list(self.deaths))

    def all_ready(self) -> bool:
        """Every process is running and has joined its topics (no restart pending)."""
        left = set(self.left)
        return not self._due and all(w.ready for w in self.workers if w.name not in left)

    def last_ready_at(self) -> float:
        """``clock()`` time a process last became ready (0.0: none yet)."""
        return self._last_ready_at

    def wait_all_ready(self, interval_s: float = 0.2) -> None:
        """Supervise until every process is ready (``ProcessFailed`` if one cannot be)."""
        while True:
            self.supervise()
            if self.all_ready():
                return
            time.sleep(interval_s)  # poll interval; supervise() enforces the deadlines

    def restarts_line(self) -> str | None:
        """The live view's line about deaths and restarts, None while there were none."""
        if not self.deaths:
            return None
        parts = []
        for name in dict.fromkeys(d["process"] for d in self.deaths):
            last = next(d for d in reversed(self.deaths) if d["process"] == name)
            state = ("restart due" if name in self._due
                     else "running" if self.worker(name).ready else "starting")
            parts.append(f"{name}: {self.restarts.count(name)}/{self.cfg.run.max_restarts} restarts, "
                         f"{state}; last death at {last['at_s']:.0f}s: {last['reason']}")
        return "restarts - " + "; ".join(parts)

    def worker(self, name: str) -> WorkerProc:
        """The current incarnation of process ``name``."""
        return next(w for w in self.workers if w.name == name)

    def hold_restart(self, name: str) -> None:
        """Keep ``name``'s next restart waiting, past its backoff, until ``release_restart``
        (a fault test checks what the others do while it is down)."""
        self._held.add(name)

    def release_restart(self, name: str) -> None:
        """Let ``name``'s restart happen (at once if its backoff is over)."""
        self._held.discard(name)

    def kill(self, name: str) -> None:
        """SIGKILL a worker's process group (a crash), as ``kill -9`` would; the supervisor
        notices the death and restarts it."""
        w = self.worker(name)
        os.killpg(w.proc.pid, signal.SIGKILL)
        w.proc.wait(timeout=10)


def render_all(cfg: JobConfig, rows: dict, scrapes: dict[str, Scrape], title: str, notes: str | None = None):
    """The live view: device table, training table (training jobs), then ``notes`` (restarts)."""
    parts: list = [render(cfg, rows, title)]
    if cfg.train.enabled:
        parts.append(training_view(cfg, scrapes))
    if notes:
        parts.append(Text(notes, style="yellow"))
    return parts[0] if len(parts) == 1 else Group(*parts)


def deaths_table(result: RunResult) -> Table:
    """Every death of a process during the run, and what the supervisor did about it."""
    table = Table(title=f"process deaths ({len(result.restarted)} restart(s))")
    for col in ("process", "at", "exit code", "reason", "restarted after"):
        table.add_column(col, justify="left" if col == "reason" else "right")
    for d in result.deaths:
        backoff = d.get("restart_in_s")
        table.add_row(d["process"], f"{d['at_s']:.0f}s", str(d["code"]), d["reason"],
                      f"{backoff:g}s" if backoff is not None else "-")
    return table


def _shown(value: float) -> str:
    """A score, or "-" for one the process does not export (a stage of a split model)."""
    return "-" if math.isnan(value) else f"{value:.3f}"


def training_view(cfg: JobConfig, scrapes: dict[str, Scrape]) -> Table:
    table = Table(title=f"training: {cfg.train.strategy}, model {cfg.train.model}, codec {cfg.train.codec}")
    for col in ("process", "steps", "trained", "version", "held-out acc", "prequential acc (recent)",
                "loss", "staleness (mean)", "compressed", "rejected"):
        table.add_column(col, justify="right")
    for name, s in sorted(scrapes.items()):
        count = s.get("edgestream_staleness_versions_count", worker=name)
        total = s.get("edgestream_staleness_versions_sum", worker=name)
        table.add_row(
            name, str(int(s.get("edgestream_steps_total", worker=name))),
            str(int(s.get("edgestream_trained_records_total", worker=name))),
            str(int(s.get("edgestream_model_version", worker=name))),
            _shown(s.get('edgestream_accuracy_ratio', math.nan, worker=name, split='heldout')),
            f"{_shown(s.get('edgestream_accuracy_ratio', math.nan, worker=name, split='prequential'))} "
            f"({_shown(s.get('edgestream_accuracy_ratio', math.nan, worker=name, split='prequential_recent'))})",
            f"{s.get('edgestream_loss', worker=name, split='train'):.3f}",
            f"{total / count:.2f}" if count else "-",
            str(int(s.get("edgestream_compressed_steps_total", worker=name))),
            _rejected_live(s, name),
        )
    return table


def _rejected_live(s: Scrape, name: str) -> str:
    """Updates refused on receipt, and (``+N bound``) those the norm bound left out."""
    refused = int(s.get("edgestream_updates_rejected_total", worker=name))
    bound = int(s.get("edgestream_norm_rejected_updates_total", worker=name))
    return f"{refused}" + (f" (+{bound} bound)" if bound else "")


def training_table(result: RunResult) -> Table:
    table = Table(title="training summary")
    for col in ("process", "steps", "trained records", "injected", "version", "held-out acc",
                "prequential acc (recent)", "staleness mean/max", "compressed steps", "rejected steps",
                "rejected updates", "live set (last)", "digest"):
        table.add_column(col, justify="right")
    for name, t in sorted(result.training.items()):
        preq = t.get("prequential") or {}
        prequential = f"{preq['accuracy']:.3f} ({preq['window_accuracy']:.3f})" if preq.get("records") else "-"
        st = t.get("staleness") or {}
        steps = t["steps"]
        compressed = t.get("compressed_steps", 0)
        rejected = str(t.get("rejected_steps", 0))
        if t.get("rejected_by_reason"):
            rejected += " (" + ", ".join(f"{k} {v}" for k, v in sorted(t["rejected_by_reason"].items())) + ")"
        byzantine = t.get("byzantine")
        shown_name = f"{name} (byzantine: {byzantine['attack']}, {byzantine['corrupted']} sent)" if byzantine else name
        table.add_row(shown_name, str(steps), str(t["trained_records"]), str(t.get("injected_records", 0)),
                      str(t["version"]), f"{t['accuracy']:.3f}" if t.get("evaluates_model", True) else "-",
                      prequential,
                      f"{st.get('mean', 0):.2f}/{st.get('max', 0)}",
                      f"{compressed} ({compressed / steps:.0%})" if steps else "0",
                      rejected, _updates_rejected(t),
                      ",".join(t.get("live") or []) + (" (joined)" if t.get("joining") else "")
                      + (" (left)" if name in result.left else ""), t["digest"][:12])
    return table


def _updates_rejected(t: dict) -> str:
    """Updates refused on receipt (validation), and those the strategy's norm bound left out
    or clipped (``max_update_norm``)."""
    counters = (t.get("strategy_stats") or {}).get("counters") or {}
    shown = str(t["updates_rejected"])
    bound = [f"{what} {counters[key]}" for key, what in (("updates_rejected", "over the bound"),
                                                         ("updates_clipped", "clipped")) if counters.get(key)]
    return shown + (f" ({', '.join(bound)})" if bound else "")


def predictions_line(result: RunResult) -> str:
    """The summary's line on ``serve.predictions``: predictions published per trained record,
    and the devices where the two differ (none in a run that drained)."""
    published: dict[str, int] = {}
    topic = ""
    for t in result.training.values():
        for device, n in ((t.get("predictions") or {}).get("by_device") or {}).items():
            published[device] = published.get(device, 0) + int(n)
        topic = topic or (t.get("predictions") or {}).get("topic", "")
    trained = {device: int(a.get("consumed", 0)) for device, a in result.accounting.items()}
    off = sorted(d for d in set(published) | set(trained) if published.get(d, 0) != trained.get(d, 0))
    line = (f"predictions: {sum(published.values())} published on {topic} for {sum(trained.values())} trained "
            "records")
    if not off:
        return line + " (one per trained record on every device)"
    return line + "; differ on " + ", ".join(f"{d} ({published.get(d, 0)} for {trained.get(d, 0)})" for d in off[:5])


def labels_line(labels: dict[str, int]) -> str:
    """The summary's line on delayed labels: what became of the labels sent and read, and
    the arrival-time prequential accuracy (each reading's prediction when it came, scored
    when its label did)."""
    scored = labels.get("scored", 0)
    preq = f"{labels.get('correct', 0) / scored:.3f} over {scored} readings" if scored else "-"
    sent = f"{labels['sent']} sent, {labels['withheld']} never sent; " if "sent" in labels else ""
    return (f"labels (labels.topic): {sent}{labels.get('read', 0)} read: {labels.get('joined', 0)} joined, "
            f"{labels.get('late', 0)} late, {labels.get('foreign', 0)} for other workers' devices; "
            f"{labels.get('dead_lettered', 0)} label messages dead-lettered; "
            f"prequential accuracy at arrival {preq}")


def balances(produced: int, garbage: int, a: dict) -> bool:
    """A device's row adds up: every produced record is trained (consumed), dropped by a
    counted policy, dead-lettered, or pending (read, not settled: buffered or held by the
    trainer); every garbage message was dead-lettered whole; and what the worker read is
    exactly what was produced (no record lost or counted twice, also across restarts).

    A device whose worker is not running at the end (``a["running"]`` False: it left, or
    never started) may also have **unread** records, ``produced - read``: they must still be
    in Kafka, above the worker's committed offset, with its pending ones
    (``unread + pending <= a["in_kafka"]``, counted there), and it cannot have
    dead-lettered more bad messages than were sent. A device whose worker runs must still
    read everything."""
    pending = a["buffered"] + a["in_sink"] + a.get("awaiting_label", 0)
    settled = a["consumed"] + a["dropped"] + a["dead_records"]
    if a.get("running", True):
        return (produced == settled + pending and a["records_in"] == produced
                and a["dead_letter_messages"] == garbage)
    unread = a.get("unread", 0)
    return (unread >= 0 and produced == settled + pending + unread and a["records_in"] + unread == produced
            and unread + pending <= a.get("in_kafka", 0) and a["dead_letter_messages"] <= garbage)


def backlog_of(a: dict) -> int:
    """Records of a device pending at the end beyond one window batch (``window_records``,
    what the worker's batcher takes per window, widened fully): 0 for a device that was
    kept up with, else how far it ran ahead of what its worker batches and trains."""
    return max(0, a.get("buffered", 0) + a.get("in_sink", 0) - a.get("window_records", 0))


def balance_status(produced: int, garbage: int, a: dict) -> str:
    """The summary's ``balanced`` cell: ``yes`` only if the row adds up (``balances``) and
    nothing is pending beyond one window; a row that adds up with a backlog says
    ``pending N (rate above capacity: ...)`` and which capacity: the batcher's (more than a
    window left in the buffer: the most records/s it takes, widened) or its worker's
    training (the batches wait for the trainer); ``NO`` if it does not add up."""
    if not balances(produced, garbage, a):
        return "[red]NO[/red]"
    if not backlog_of(a):
        return "yes"
    capacity = a.get("capacity_hz")
    if capacity and a["buffered"] > a.get("window_records", 0):
        which = f"batcher {capacity:.0f}/s"
    else:
        which = "its worker's training"
    return f"[yellow]pending {a['buffered'] + a['in_sink']} (rate above capacity: {which})[/yellow]"


def summary_table(result: RunResult, training: bool = True) -> Table:
    trained = "trained" if training else "batched"
    table = Table(title=f"final accounting (produced = {trained} + dropped + dead-lettered + pending; "
                        "bad messages = dead-lettered whole)")
    for col in ("device", "produced", trained, "dropped", "dead-lettered", "pending*", "unread**", "max depth",
                "bad msgs sent", "bad msgs dead-lettered", "balanced"):
        table.add_column(col, justify="right")
    for device, a in sorted(result.accounting.items()):
        status = balance_status(result.produced[device], result.garbage[device], a)
        dead = str(a["dead_records"])
        if a.get("dead_records_by_reason"):
            dead += " (" + ", ".join(f"{k} {v}" for k, v in sorted(a["dead_records_by_reason"].items())) + ")"
        dropped = str(a["dropped"])
        if a.get("dropped_by_reason"):
            dropped += " (" + ", ".join(f"{k} {v}" for k, v in sorted(a["dropped_by_reason"].items())) + ")"
        unread = str(a.get("unread", 0))
        if not a.get("running", True):
            unread += f" ({a.get('in_kafka', 0)} in Kafka)"
        table.add_row(device, str(result.produced[device]), str(a["consumed"]), dropped, dead,
                      str(a["buffered"] + a["in_sink"] + a.get("awaiting_label", 0)), unread, str(a["max_depth"]), str(result.garbage[device]),
                      str(a["dead_letter_messages"]), status)
    table.caption = ("* pending: read but not trained yet (a fixed-mode remainder, or records held while "
                     "BSP waits for peers whose streams ended); not acknowledged, so re-read on restart. "
                     "More than one window batch pending: the device arrives faster than its worker "
                     "batches and trains (balanced says 'pending N (rate above capacity)'; docs/ingest.md). "
                     "** unread: never read because the device's worker left the job (or never started); "
                     "still in Kafka above its committed offset (in Kafka: the records there), nothing lost")
    return table


def others_line(result: RunResult, training: bool = True) -> str:
    """One line on the devices the job file does not name that wrote to a shared topic."""
    total = {k: sum(int(a.get(k, 0)) for a in result.other_devices.values())
             for k in ("records_in", "consumed", "dropped", "dead_records", "dead_letter_messages")}
    pending = sum(int(a.get("buffered", 0)) + int(a.get("in_sink", 0)) for a in result.other_devices.values())
    named = ", ".join(list(result.other_devices)[:5]) + (", ..." if len(result.other_devices) > 5 else "")
    return (f"{len(result.other_devices)} device(s) not in the job file wrote to the shared topic ({named}): "
            f"read {total['records_in']} records, {'trained' if training else 'batched'} {total['consumed']}, "
            f"dropped {total['dropped']}, dead-lettered {total['dead_records']}, pending {pending}; "
            f"{total['dead_letter_messages']} bad messages dead-lettered (their producers are not this run's: "
            "summary.json has each one's ledger under other_devices)")


def _role(name: str) -> str:
    """How a process is named in messages: ``worker w1``, ``server``."""
    return name if name == SERVER_NAME else f"worker {name}"


def _log_hint(w: WorkerProc) -> str:
    """Where the process's log is, as a suffix of a one-line message."""
    return f" (log: {w.log_path})" if w.log_path else ""


def run_in_testbed(cfg: JobConfig, console: Console, *, garbage_per_device: int = 0, keep: bool = False):
    """`edgestream run` for a job with ``[testbed]``: testbed and brokers up, the run with every
    process on its host, the testbed table after the summary, everything down at the end."""
    from edgestream.pipeline.testbed_run import (
        has_server,
        host_rows,
        hosts_table,
        links_summary,
        open_testbed,
    )

    with open_testbed(cfg, keep=keep, console=console) as session:
        console.print(hosts_table(host_rows(cfg, session.testbed.hosts, server=has_server(cfg)),
                                  title="testbed hosts"))
        result = run_job(cfg, session.bootstrap, garbage_per_device=garbage_per_device, console=console,
                         testbed=session.testbed)
        console.print(links_summary(cfg, session.testbed, result))
        return result
