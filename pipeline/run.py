"""`edgestream run`: broker (if needed), worker processes, simulators, live view, summary.

Every process it starts is in its own process group and is stopped on exit, on
error and on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from monitoring.metrics import serve_process
from monitoring.prometheus import file_sd_path, run_targets, write_file_sd
from monitoring.scrape import Scrape, scrape
from pipeline.app import app_id, sensor_group
from pipeline.config import JobConfig
from pipeline.kafka_io import ensure_topics, sensor_topics_for, start_groups_at_end
from pipeline.simulate import SimulationReport, simulate
from pipeline.worker import SERVER_NAME
from streams import topics


class RunError(RuntimeError):
    """The run could not proceed; the message says what to do."""


@dataclass
class WorkerProc:
    name: str
    proc: subprocess.Popen
    devices: list[str]
    metrics_url: str | None = None
    log_path: Path | None = None


@dataclass
class RunResult:
    produced: dict[str, int]
    garbage: dict[str, int]
    accounting: dict[str, dict[str, int]]
    balanced: bool
    duration_s: float
    workers: dict[str, str] = field(default_factory=dict)
    training: dict[str, dict] = field(default_factory=dict)
    restarted: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return self.__dict__


def start_worker_process(
    cfg_path: Path, worker: str, bootstrap: str, metrics_port: int, log_path: Path
) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    role_args = ["server"] if worker == SERVER_NAME else ["worker", "--worker", worker]
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", *role_args, "--job", str(cfg_path),
             "--bootstrap", bootstrap, "--metrics-port", str(metrics_port)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env,
        )


def stop_process(proc: subprocess.Popen, timeout_s: float = 20.0) -> int | None:
    """SIGTERM the process group, SIGKILL it after ``timeout_s``; return the exit code."""
    if proc.poll() is None:
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


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2, on_fail=None):
    """Poll ``predicate`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
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
    """Per-device figures merged from every worker's metrics."""
    rows = {}
    for i, device in enumerate(cfg.devices.device_ids()):
        row = {"target_hz": cfg.devices.rate_of(i), "produced": 0, "rate_hz": 0.0, "depth": 0,
               "batches": 0, "batched": 0, "dropped": 0, "dlq": 0, "records_in": 0}
        if report is not None:
            row["produced"] = report.records.get(device, 0)
            row["garbage"] = sum(report.garbage.get(device, {}).values())
        for s in scrapes.values():
            row["rate_hz"] += s.get("edgestream_arrival_rate_hz", device=device)
            row["depth"] += int(s.get("edgestream_buffer_depth_records", device=device))
            row["batches"] += int(s.get("edgestream_batches_total", device=device))
            row["batched"] += int(s.get("edgestream_batched_records_total", device=device))
            row["dropped"] += int(s.get("edgestream_buffer_dropped_records_total", device=device))
            row["dlq"] += int(s.get("edgestream_dead_letter_messages_total", device=device))
            row["records_in"] += int(s.get("edgestream_records_in_total", device=device))
            lag = s.get("edgestream_consumer_lag_records", -1, device=device)
            if lag >= 0:
                row["lag"] = row.get("lag", 0) + int(lag)
        rows[device] = row
    return rows


def render(cfg: JobConfig, rows: dict, title: str) -> Table:
    table = Table(title=title, expand=False)
    for col in ("device", "target/s", "produced", "arrival/s", "buffer", "batches", "batched",
                "dropped", "dead-lettered"):
        table.add_column(col, justify="right")
    for device, r in rows.items():
        table.add_row(device, f"{r['target_hz']:.0f}", str(r["produced"]), f"{r['rate_hz']:.1f}",
                      str(r["depth"]), str(r["batches"]), str(r["batched"]), str(r["dropped"]),
                      str(r["dlq"]))
    return table


def drained(cfg: JobConfig, rows: dict, report: SimulationReport, restarted: set[str] | None = None) -> bool:
    """Every produced record consumed and out of the buffers (or, in fixed mode, left as a
    remainder smaller than one batch), and every garbage message dead-lettered.

    A restarted worker's counters start again at its checkpoint, so for its devices
    "consumed" means no consumer lag left instead of counting every record."""
    restarted = restarted or set()
    for device, r in rows.items():
        produced = report.records.get(device, 0)
        garbage = sum(report.garbage.get(device, {}).values())
        if _owner(cfg, device) in restarted:
            if r.get("lag", -1) != 0:
                return False
        elif r["records_in"] < produced or r["dlq"] < garbage:
            return False
        remainder_ok = cfg.batcher.mode == "fixed" and r["depth"] < cfg.batcher.batch_size
        if r["depth"] and not remainder_ok:
            return False
    return True


def prepare_state(cfg: JobConfig) -> tuple[Path, Path]:
    """A clean state dir for a new run (worker state from earlier runs removed) and the
    effective config written there as JSON, which worker processes load."""
    state = cfg.state_path()
    if (state / "workers").exists():
        shutil.rmtree(state / "workers")
    state.mkdir(parents=True, exist_ok=True)
    cfg_path = state / "job.json"
    cfg_path.write_text(json.dumps(cfg.to_dict(), indent=2))
    return state, cfg_path


def run_job(
    cfg: JobConfig,
    bootstrap: str,
    *,
    garbage_per_device: int = 0,
    console: Console | None = None,
    live: bool = True,
    on_streaming: Callable[[RunContext], None] | None = None,
    drain: bool = True,
) -> RunResult:
    """Run workers (+ server) + simulators against ``bootstrap`` for ``cfg.run.duration_s``.

    ``drain=False`` stops the processes as soon as streaming ends instead of waiting for
    every record to be consumed (benchmarks that measure a fixed time budget); records
    not yet read stay in their topics and show as neither batched nor buffered.

    ``on_streaming(ctx)`` is called once from a helper thread while the simulators run
    (tests use it to kill and restart a worker mid-run).
    """
    console = console or Console()
    state, cfg_path = prepare_state(cfg)
    devices = cfg.devices.device_ids()
    training = cfg.train.enabled
    wanted = sensor_topics_for(devices)
    if training:
        from pipeline.training import training_topics

        wanted.update(training_topics(cfg.job.name))
    ensure_topics(bootstrap, wanted)
    names = list(cfg.worker_names())
    if training and "server" in strategy_roles(cfg.train.strategy):
        names.insert(0, SERVER_NAME)
    groups: dict[str, list[str]] = {}
    for name in names:
        if name != SERVER_NAME:
            sensors = [topics.sensor_topic(d) for d in cfg.devices_of(name)]
            groups.setdefault(sensor_group(cfg, name), []).extend(sensors)
        if training:
            updates = [t for t in training_topics(cfg.job.name) if not t.endswith(".dlq")]
            groups.setdefault(app_id(cfg, name), []).extend(updates)
    # A run consumes what is produced during it, even on a long-lived cluster.
    start_groups_at_end(bootstrap, groups)
    ctx = RunContext(cfg, bootstrap, state, cfg_path, [])
    stop = ctx.stop
    t_start = time.monotonic()
    report: SimulationReport | None = None
    try:
        for name in names:
            ctx.start(name)
        for w in ctx.workers:
            ctx.wait_ready(w)
        sim_metrics, sim_url = serve_process(0, cfg.workers.metrics_host)
        ctx.simulator_url = sim_url
        ctx.publish_targets()
        console.print("[bold]metrics endpoints:[/bold] " + ", ".join(
            [f"{w.name} {w.metrics_url}" for w in ctx.workers] + [f"simulator {sim_url}"]))
        console.print(f"[bold]Prometheus targets file:[/bold] {ctx.targets_file} "
                      "(see docs/monitoring.md; `edgestream prometheus` scrapes it)")
        report_box: dict[str, SimulationReport] = {}
        errors: list[BaseException] = []

        def produce() -> None:
            try:
                report_box["final"] = simulate(
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
        with Live(console=console, refresh_per_second=2, transient=False, auto_refresh=False) as view:
            while sim.is_alive():
                if not ctx.restarting:
                    _check_alive(ctx.workers)
                scrapes = scrape_all(ctx.workers)
                rows = device_view(cfg, scrapes, report_box.get("live"))
                elapsed = time.monotonic() - t_start
                if live:
                    view.update(render_all(cfg, rows, scrapes, f"{title} - streaming {elapsed:.0f}/{cfg.run.duration_s:.0f}s"),
                                refresh=True)
                if training and cfg.train.target_accuracy > 0 and _reached(cfg, scrapes):
                    stop.set()
                sim.join(timeout=0.5)
            stop.set()  # streaming is over: tells hooks that wait on ``ctx.stop``
            if hook is not None:
                hook.join(timeout=120)
            if errors:
                raise errors[0]
            report = report_box["final"]

            settle = {"key": None, "since": time.monotonic()}

            def check() -> bool:
                _check_alive(ctx.workers)
                scrapes = scrape_all(ctx.workers)
                rows = device_view(cfg, scrapes, report)
                if live:
                    view.update(render_all(cfg, rows, scrapes, f"{title} - draining"), refresh=True)
                if drained(cfg, rows, report, set(ctx.restarts)):
                    return True
                if not training:
                    return False
                # Training can hold records it cannot use yet (BSP waits for peers whose
                # streams ended). Settled = nothing left to read and no progress for 3 s;
                # what is held shows up as buffered (not acknowledged, re-read on restart).
                progress = {d: [r["records_in"], r["batched"], r["depth"], r.get("lag")] for d, r in rows.items()}
                key = json.dumps([progress, {w: s.get("edgestream_trained_records_total", worker=w)
                                             for w, s in scrapes.items()}], sort_keys=True)
                if key != settle["key"]:
                    settle.update(key=key, since=time.monotonic())
                    return False
                return all(r.get("lag", -1) == 0 for r in rows.values()) and \
                    time.monotonic() - settle["since"] >= 3.0

            if drain:
                wait_for(check, cfg.run.drain_timeout_s, "every record to be batched, dropped or dead-lettered",
                         on_fail=lambda: "; per device: " + json.dumps(
                             device_view(cfg, scrape_all(ctx.workers), report)))
            if training and drain:
                # Replicas that read the whole update log agree on the version.
                with contextlib.suppress(RunError):
                    wait_for(lambda: _versions_settled(cfg, scrape_all(ctx.workers)), 30,
                             "workers to apply every published update")
    finally:
        stop.set()
        codes = {w.name: stop_process(w.proc) for w in reversed(ctx.workers)}
    accounting: dict[str, dict[str, int]] = {}
    train_summary: dict[str, dict] = {}
    for w in ctx.workers:
        wdir = state / "workers" / w.name
        if w.name != SERVER_NAME:
            path = wdir / "accounting.json"
            if not path.exists():
                raise RunError(f"worker {w.name} exited ({codes.get(w.name)}) without writing {path}{_log_hint(w)}")
            accounting.update(json.loads(path.read_text())["devices"])
        if training:
            path = wdir / "training.json"
            if not path.exists():
                raise RunError(f"{w.name} exited ({codes.get(w.name)}) without writing {path}{_log_hint(w)}")
            train_summary[w.name] = json.loads(path.read_text())
    assert report is not None
    produced = dict(report.records)
    garbage = {d: sum(v.values()) for d, v in report.garbage.items()}
    restarted = set(ctx.restarts)
    balanced = all(
        (produced[d] == a["batched"] + a["dropped"] + a["buffered"] or _owner(cfg, d) in restarted)
        and a["dead_letter_messages"] == garbage[d]
        for d, a in accounting.items()
    )
    result = RunResult(produced, garbage, accounting, balanced, time.monotonic() - t_start,
                       {w.name: w.metrics_url or "" for w in ctx.workers}, train_summary,
                       sorted(restarted))
    (state / "summary.json").write_text(json.dumps(result.to_dict(), indent=2))
    console.print(summary_table(result))
    if training:
        console.print(training_table(result))
    return result


def _owner(cfg: JobConfig, device: str) -> str:
    return next(w for w in cfg.worker_names() if device in cfg.devices_of(w))


def _guard(fn, ctx, errors) -> None:
    try:
        fn(ctx)
    except BaseException as exc:
        errors.append(exc)


def strategy_roles(name: str) -> tuple[str, ...]:
    from trainers.strategies import roles

    return roles(name)


def _reached(cfg: JobConfig, scrapes: dict[str, Scrape]) -> bool:
    accs = [s.get("edgestream_accuracy_ratio", -1.0, worker=w, split="heldout")
            for w in cfg.worker_names() for s in [scrapes.get(w)] if s is not None]
    return len(accs) == cfg.workers.count and min(accs) >= cfg.train.target_accuracy


def _versions_settled(cfg: JobConfig, scrapes: dict[str, Scrape]) -> bool:
    versions = {s.get("edgestream_model_version", -1.0, worker=w) for w, s in scrapes.items() if w != SERVER_NAME}
    return len(versions) == 1


@dataclass
class RunContext:
    """The processes of a run, for the orchestrator and for hooks (fault tests)."""

    cfg: JobConfig
    bootstrap: str
    state: Path
    cfg_path: Path
    workers: list[WorkerProc]
    restarts: list[str] = field(default_factory=list)
    restarting: bool = False
    simulator_url: str | None = None
    #: Set to end streaming early (the run then drains as after ``run.duration_s``).
    stop: threading.Event = field(default_factory=threading.Event)

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

    def start(self, name: str) -> WorkerProc:
        base = self.cfg.workers.metrics_port_base
        port = base + len(self.workers) if base else 0
        log_path = self.state / "logs" / f"{name}.log"
        endpoint = self.state / "workers" / name / "endpoint.json"
        if endpoint.exists():
            endpoint.unlink()
        proc = start_worker_process(self.cfg_path, name, self.bootstrap, port, log_path)
        devices = self.cfg.devices_of(name) if name != SERVER_NAME else []
        w = WorkerProc(name, proc, devices, log_path=log_path)
        self.workers = [x for x in self.workers if x.name != name] + [w]
        return w

    def wait_ready(self, w: WorkerProc) -> None:
        w.metrics_url = wait_for(
            lambda: _endpoint(self.state, w), 90, f"{w.name} to start", on_fail=lambda: _log_hint(w),
        )
        wait_for(
            lambda: (s := scrape(w.metrics_url)) is not None
            and s.get("edgestream_worker_ready", worker=w.name) == 1,
            90, f"{w.name} to join its topics", on_fail=lambda: _log_hint(w),
        )

    def worker(self, name: str) -> WorkerProc:
        return next(w for w in self.workers if w.name == name)

    def kill(self, name: str) -> None:
        """SIGKILL a worker's process group (a crash), as ``kill -9`` would."""
        self.restarting = True
        w = self.worker(name)
        os.killpg(w.proc.pid, signal.SIGKILL)
        w.proc.wait(timeout=10)

    def restart(self, name: str) -> WorkerProc:
        w = self.start(name)
        self.wait_ready(w)
        self.restarts.append(name)
        self.restarting = False
        self.publish_targets()
        return w


def render_all(cfg: JobConfig, rows: dict, scrapes: dict[str, Scrape], title: str):
    table = render(cfg, rows, title)
    if not cfg.train.enabled:
        return table
    return Group(table, training_view(cfg, scrapes))


def training_view(cfg: JobConfig, scrapes: dict[str, Scrape]) -> Table:
    table = Table(title=f"training: {cfg.train.strategy}, model {cfg.train.model}, codec {cfg.train.codec}")
    for col in ("process", "steps", "trained", "version", "held-out acc", "loss", "staleness (mean)",
                "compressed", "rejected"):
        table.add_column(col, justify="right")
    for name, s in sorted(scrapes.items()):
        count = s.get("edgestream_staleness_versions_count", worker=name)
        total = s.get("edgestream_staleness_versions_sum", worker=name)
        table.add_row(
            name, str(int(s.get("edgestream_steps_total", worker=name))),
            str(int(s.get("edgestream_trained_records_total", worker=name))),
            str(int(s.get("edgestream_model_version", worker=name))),
            f"{s.get('edgestream_accuracy_ratio', worker=name, split='heldout'):.3f}",
            f"{s.get('edgestream_loss', worker=name, split='train'):.3f}",
            f"{total / count:.2f}" if count else "-",
            str(int(s.get("edgestream_compressed_steps_total", worker=name))),
            str(int(s.get("edgestream_updates_rejected_total", worker=name))),
        )
    return table


def training_table(result: RunResult) -> Table:
    table = Table(title="training summary")
    for col in ("process", "steps", "trained records", "injected", "version", "held-out acc",
                "staleness mean/max", "compressed steps", "rejected updates", "digest"):
        table.add_column(col, justify="right")
    for name, t in sorted(result.training.items()):
        st = t.get("staleness") or {}
        steps = t["steps"]
        compressed = t.get("compressed_steps", 0)
        table.add_row(name, str(steps), str(t["trained_records"]), str(t.get("injected_records", 0)),
                      str(t["version"]), f"{t['accuracy']:.3f}", f"{st.get('mean', 0):.2f}/{st.get('max', 0)}",
                      f"{compressed} ({compressed / steps:.0%})" if steps else "0",
                      str(t["updates_rejected"]), t["digest"][:12])
    return table


def summary_table(result: RunResult) -> Table:
    table = Table(title="final accounting (produced = batched + dropped + buffered; garbage = dead-lettered)")
    for col in ("device", "produced", "batched", "dropped", "buffered*", "max depth", "garbage sent",
                "dead-lettered", "balanced"):
        table.add_column(col, justify="right")
    for device, a in sorted(result.accounting.items()):
        ok = result.produced[device] == a["batched"] + a["dropped"] + a["buffered"] and \
            a["dead_letter_messages"] == result.garbage[device]
        table.add_row(device, str(result.produced[device]), str(a["batched"]), str(a["dropped"]),
                      str(a["buffered"]), str(a["max_depth"]), str(result.garbage[device]),
                      str(a["dead_letter_messages"]), "yes" if ok else "[red]NO[/red]")
    table.caption = ("* buffered: records not trained yet (a fixed-mode remainder, or records held while "
                     "BSP waits for peers whose streams ended); not acknowledged, so re-read on restart")
    return table


def _endpoint(state: Path, w: WorkerProc) -> str | None:
    _check_alive([w])
    path = state / "workers" / w.name / "endpoint.json"
    if path.exists():
        return json.loads(path.read_text())["metrics"]
    return None


def _check_alive(workers: list[WorkerProc]) -> None:
    for w in workers:
        if w.proc.poll() is not None:
            raise RunError(f"worker {w.name} exited with code {w.proc.returncode}{_log_hint(w)}")


def _log_hint(w: WorkerProc) -> str:
    if w.log_path and w.log_path.exists():
        tail = "\n".join(w.log_path.read_text(errors="replace").splitlines()[-25:])
        return f"\n--- last lines of {w.log_path} ---\n{tail}"
    return ""
