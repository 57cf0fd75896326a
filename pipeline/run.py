"""`edgestream run`: broker (if needed), worker processes, simulators, live view, summary.

Every process it starts is in its own process group and is stopped on exit, on
error and on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from monitoring.scrape import Scrape, scrape
from pipeline.app import app_id
from pipeline.config import JobConfig
from pipeline.kafka_io import ensure_topics, sensor_topics_for, start_groups_at_end
from pipeline.simulate import SimulationReport, simulate
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
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "worker", "--job", str(cfg_path), "--worker", worker,
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


def drained(cfg: JobConfig, rows: dict, report: SimulationReport) -> bool:
    """Every produced record consumed and out of the buffers (or, in fixed mode, left as a
    remainder smaller than one batch), and every garbage message dead-lettered."""
    for device, r in rows.items():
        produced = report.records.get(device, 0)
        garbage = sum(report.garbage.get(device, {}).values())
        if r["records_in"] < produced or r["dlq"] < garbage:
            return False
        remainder_ok = cfg.batcher.mode == "fixed" and r["depth"] < cfg.batcher.batch_size
        if r["depth"] and not remainder_ok:
            return False
    return True


def run_job(
    cfg: JobConfig,
    bootstrap: str,
    *,
    garbage_per_device: int = 0,
    console: Console | None = None,
    live: bool = True,
) -> RunResult:
    """Run workers + simulators against ``bootstrap`` for ``cfg.run.duration_s``."""
    console = console or Console()
    state = cfg.state_path()
    if (state / "workers").exists():
        shutil.rmtree(state / "workers")
    state.mkdir(parents=True, exist_ok=True)
    cfg_path = state / "job.json"
    cfg_path.write_text(json.dumps(cfg.to_dict(), indent=2))
    devices = cfg.devices.device_ids()
    ensure_topics(bootstrap, sensor_topics_for(devices))
    # A run consumes what is produced during it, even on a long-lived cluster.
    start_groups_at_end(
        bootstrap,
        {app_id(cfg, w): [topics.sensor_topic(d) for d in cfg.devices_of(w)] for w in cfg.worker_names()},
    )
    workers: list[WorkerProc] = []
    stop = threading.Event()
    t_start = time.monotonic()
    try:
        for i, name in enumerate(cfg.worker_names()):
            port = cfg.workers.metrics_port_base + i if cfg.workers.metrics_port_base else 0
            log_path = state / "logs" / f"{name}.log"
            proc = start_worker_process(cfg_path, name, bootstrap, port, log_path)
            workers.append(WorkerProc(name, proc, cfg.devices_of(name), log_path=log_path))
        for w in workers:
            w.metrics_url = wait_for(
                lambda w=w: _endpoint(state, w), 60, f"worker {w.name} to start",
                on_fail=lambda w=w: _log_hint(w),
            )
            wait_for(
                lambda w=w: (s := scrape(w.metrics_url)) is not None
                and s.get("edgestream_worker_ready", worker=w.name) == 1,
                90, f"worker {w.name} to join its device topics", on_fail=lambda w=w: _log_hint(w),
            )
        console.print("[bold]metrics endpoints:[/bold] " + ", ".join(f"{w.name} {w.metrics_url}" for w in workers))
        report_box: dict[str, SimulationReport] = {}
        errors: list[BaseException] = []

        def produce() -> None:
            try:
                report_box["final"] = simulate(
                    cfg, bootstrap, cfg.run.duration_s, garbage_per_device=garbage_per_device,
                    stop=stop, progress=lambda r: report_box.__setitem__("live", r),
                    report_path=state / "simulation.json",
                )
            except BaseException as exc:  # surfaced in the main thread
                errors.append(exc)

        sim = threading.Thread(target=produce, name="simulators", daemon=True)
        sim.start()
        title = f"edgestream run '{cfg.job.name}' - {len(devices)} devices, {len(workers)} worker(s)"
        with Live(console=console, refresh_per_second=2, transient=False, auto_refresh=False) as view:
            while sim.is_alive():
                _check_alive(workers)
                rows = device_view(cfg, scrape_all(workers), report_box.get("live"))
                elapsed = time.monotonic() - t_start
                if live:
                    view.update(render(cfg, rows, f"{title} - streaming {elapsed:.0f}/{cfg.run.duration_s:.0f}s"),
                                refresh=True)
                sim.join(timeout=0.5)
            if errors:
                raise errors[0]
            report = report_box["final"]

            def check() -> bool:
                _check_alive(workers)
                rows = device_view(cfg, scrape_all(workers), report)
                if live:
                    view.update(render(cfg, rows, f"{title} - draining"), refresh=True)
                return drained(cfg, rows, report)

            wait_for(check, cfg.run.drain_timeout_s, "every record to be batched, dropped or dead-lettered",
                     on_fail=lambda: "; per device: " + json.dumps(
                         device_view(cfg, scrape_all(workers), report)))
    finally:
        stop.set()
        codes = {w.name: stop_process(w.proc) for w in workers}
    accounting: dict[str, dict[str, int]] = {}
    for w in workers:
        path = state / "workers" / w.name / "accounting.json"
        if not path.exists():
            raise RunError(f"worker {w.name} exited ({codes.get(w.name)}) without writing {path}{_log_hint(w)}")
        accounting.update(json.loads(path.read_text())["devices"])
    produced = dict(report.records)
    garbage = {d: sum(v.values()) for d, v in report.garbage.items()}
    balanced = all(
        produced[d] == a["batched"] + a["dropped"] + a["buffered"] and a["dead_letter_messages"] == garbage[d]
        for d, a in accounting.items()
    )
    result = RunResult(produced, garbage, accounting, balanced, time.monotonic() - t_start,
                       {w.name: w.metrics_url or "" for w in workers})
    (state / "summary.json").write_text(json.dumps(result.to_dict(), indent=2))
    console.print(summary_table(result))
    return result


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
    table.caption = ("* buffered: fixed-mode remainder smaller than one batch, not acked, so it is "
                     "redelivered when the worker restarts")
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
