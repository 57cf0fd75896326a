"""Link shaping in the edge testbed (issue #17): BSP and ScaDLES with one worker host on a
1 Mbit/s link (and 1 Mbit/s + 80 ms) against every host on a fast link, beside the
simulated clock's prediction for the same links.

Real processes, real Kafka, real links (root): three workers, each on its own testbed host
(network namespace, veth, ``tbf`` both ways), the devices on theirs, one Kafka node on its
own (``pipeline.testbed_run``). Every host's link is ``--fast`` (1 Gbit/s); a condition
changes w1's link for its runs only (``Testbed.fault("w1", "degrade", spec)``, healed
after). Conditions:

  fast        every link at 1 Gbit/s (the baseline)
  slow        w1 at 1 Mbit/s
  slow+80ms   w1 at 1 Mbit/s plus 80 ms round trip (the testbed's delay proxy; skipped
              with the reason if the testbed cannot delay)

Same work in every run: three devices at ``--rate`` records/s each (digits, IID, one per
worker, same seed), an MLP, BSP with fixed batches of ``--batch`` (each step waits for every
worker's gradient) or ScaDLES with ``--window`` s windows (a step takes what arrived, up to
``--max-batch`` records). Per run, after ``--warmup`` s of streaming until the end of
streaming (``--duration`` s): steps/s (each worker's ``edgestream_steps_total`` slope,
mean over the workers; BSP workers step together), the mean step interval (1 / steps/s),
the mean local compute per step (``edgestream_step_seconds``), and w1's application
bytes/s (gradient bytes sent + received, sensor bytes read) on its link.

Prediction: ``trainers.simclock`` runs the same job (``pipeline.simjob``: same data, seed,
rates; the mode ``simclock.default_modes`` builds with the same batch, window and
reference batch) with ``CostModel(link_bandwidths_bytes_per_s=(w0, w1, w2 links),
latency_s=...)`` (the condition's round trip, else the default 2 ms), compute from the
default cost model and from one calibrated to this machine (``benchmarks/strategies.py``
``calibrate``); steps/s over the same window. What the simulator leaves out: the sensor
records also travel over the worker's link (devices host -> broker -> worker), Kafka's
request/fetch round trips, and the per-message encode/decode cost.

Figures: each condition's steps/s as a ratio to the fast baseline of the same strategy in
the same repeat (runs interleaved: fast, slow, slow+80ms per strategy per repeat), medians
over ``--repeats`` with min-max; measured vs predicted side by side. Writes
benchmarks/results/testbed.{json,md}. Never asserts.

    scripts/with-venv.sh python -m edgestream bench testbed [--repeats 3] [--duration 45] [--warmup 10]
        [--strategies bsp,scadles] [--conditions fast,slow,slow+80ms] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import signal
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from edgestream.job.config import JobConfig, load_config
from edgestream.trainers import simclock

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
WORKERS = ("w0", "w1", "w2")
SLOW_HOST = "w1"
CONDITIONS = {"fast": None, "slow": "1mbit", "slow+80ms": "1mbit 80ms"}


@dataclass
class Settings:
    rate_hz: float = 100.0
    batch: int = 32
    window_s: float = 0.5
    max_batch: int = 256
    duration_s: float = 40.0
    warmup_s: float = 10.0
    repeats: int = 3
    fast_link: str = "1gbit"
    lr: float = 0.1
    seed: int = 0
    #: The testbed's address block (its own, so it runs beside other testbeds on the machine).
    subnet: str = "10.78.200.0/24"
    strategies: list[str] = field(default_factory=lambda: ["bsp", "scadles"])
    conditions: list[str] = field(default_factory=lambda: list(CONDITIONS))


# -- the job ---------------------------------------------------------------------------------
def job(strategy: str, s: Settings, state: Path, tag: str) -> JobConfig:
    """One run's job: three devices, one per worker, the strategy's batching."""
    n = len(WORKERS)
    overrides = [
        f"job.name=tb{tag}", f"job.seed={s.seed}", f"run.state_dir={state / tag}",
        f"devices.count={n}", f"devices.ids={','.join(f'tb{tag}d{i}' for i in range(n))}",
        f"devices.rates_hz={s.rate_hz}", "devices.profile=poisson", "devices.message_interval_s=0.1",
        f"workers.count={n}", "data.source=digits", "data.partition=iid",
        "buffer.policy=persist", "buffer.capacity=1000000",
        "train.enabled=true", "train.model=mlp", f"train.lr={s.lr}", "train.momentum=0.9",
        "train.eval_every_s=2", "train.checkpoint_every_steps=1000000", f"train.max_step_batch={s.max_batch}",
        f"run.duration_s={s.duration_s}", "run.drain_timeout_s=30",
        "testbed.enabled=true", "testbed.brokers=1", f"testbed.default_link={s.fast_link}",
        f"testbed.subnet={s.subnet}",
    ]
    reference = s.batch * n  # simclock.default_modes' B_ref
    if strategy == "bsp":
        overrides += ["train.strategy=bsp", "batcher.mode=fixed", f"batcher.batch_size={s.batch}",
                      f"train.strategy_params=reference_batch={reference}"]
    elif strategy == "scadles":
        overrides += ["train.strategy=scadles", "batcher.mode=window", f"batcher.window_s={s.window_s}",
                      f"batcher.max_batch={s.max_batch}",
                      f"train.strategy_params=reference_batch={reference},adaptive_compression=false"]
    else:
        raise ValueError(f"strategy {strategy!r}: this benchmark runs bsp and scadles")
    return load_config(overrides=overrides, env={})


def sim_mode(strategy: str, streams: simclock.StreamSet, s: Settings) -> simclock.Mode:
    modes = {m.name: m for m in simclock.default_modes(streams, batch_size=s.batch, window_s=s.window_s,
                                                          max_batch=s.max_batch)}
    return modes[strategy]


# -- measuring a live run --------------------------------------------------------------------
def link_counters(testbed, host: str = SLOW_HOST) -> dict[str, dict[str, int]]:
    """The tbf counters of ``host``'s link as tc reports them: ``up`` (its end of the veth,
    in its namespace) and ``down`` (the bridge end): bytes and packets sent, drops. Wire
    bytes: everything the host sends and receives, scrapes and heartbeats included."""
    from edgestream.deploy.testbed.plan import HOST_IF
    from edgestream.deploy.testbed.testbed import read_qdisc

    h = testbed.hosts[host]
    out = {}
    for way, tc, dev in (("up", ["tc", "-n", h.netns], HOST_IF), ("down", ["tc"], testbed.plan.host(host).bridge_if)):
        q = read_qdisc(tc, dev)
        out[way] = {k: int(q.get(k, 0)) for k in ("bytes", "packets", "drops")}
    return out


class Sampler:
    """Every second while the devices stream: each worker's steps, compute seconds and bytes,
    and w1's link counters."""

    def __init__(self, testbed=None) -> None:
        self.testbed = testbed
        self.samples: list[dict[str, Any]] = []
        #: Size of one gzipped /metrics page of w1 (scrapes cross its link too: the run's live
        #: loop fetches every worker's page about twice a second, this sampler once).
        self.page_bytes: int | None = None

    def __call__(self, ctx) -> None:
        import urllib.request

        from edgestream.monitoring.scrape import scrape

        t0 = time.monotonic()
        while not ctx.stop.wait(1.0):  # poll interval of a sampler, not synchronisation
            w1 = ctx.worker(SLOW_HOST)
            if self.page_bytes is None and w1.metrics_url:
                try:
                    request = urllib.request.Request(w1.metrics_url, headers={"Accept-Encoding": "gzip"})
                    with urllib.request.urlopen(request, timeout=2) as resp:
                        self.page_bytes = len(resp.read())
                except OSError:
                    pass
            row: dict[str, Any] = {"t": time.monotonic() - t0}
            if self.testbed is not None:
                try:
                    row["link"] = link_counters(self.testbed)
                except Exception:  # a counter read is evidence, not a reason to stop measuring
                    pass
            for name in WORKERS:
                w = ctx.worker(name)
                sc = scrape(w.metrics_url) if w.metrics_url else None
                if sc is None:
                    continue
                row[name] = {
                    "steps": sc.get("edgestream_steps_total", worker=name),
                    "step_s_sum": sc.get("edgestream_step_seconds_sum", worker=name),
                    "step_s_count": sc.get("edgestream_step_seconds_count", worker=name),
                    "grad_out": sc.get("edgestream_gradient_bytes_sent_total", worker=name),
                    "grad_in": sc.get("edgestream_gradient_bytes_received_total", worker=name),
                    "sensor_in": sc.get("edgestream_bytes_in_total"),  # its one device's
                }
            self.samples.append(row)


def measure(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """Rates over [first sample after ``warmup_s``, last sample] (each worker's own samples)."""
    out: dict[str, Any] = {"workers": {}}
    for name in WORKERS:
        rows = [(r["t"], r[name]) for r in samples if name in r and r["t"] >= warmup_s]
        if len(rows) < 2:
            out["workers"][name] = None
            continue
        (t0, a), (t1, b) = rows[0], rows[-1]
        dt = t1 - t0
        steps = b["steps"] - a["steps"]
        computed = b["step_s_count"] - a["step_s_count"]
        out["workers"][name] = {
            "window_s": round(dt, 2), "steps": steps, "steps_per_s": steps / dt,
            "compute_s": (b["step_s_sum"] - a["step_s_sum"]) / computed if computed else None,
            "grad_bytes_per_s": (b["grad_out"] - a["grad_out"] + b["grad_in"] - a["grad_in"]) / dt,
            "sensor_bytes_per_s": (b["sensor_in"] - a["sensor_in"]) / dt,
        }
    rates = [w["steps_per_s"] for w in out["workers"].values() if w]
    out["steps_per_s"] = statistics.mean(rates) if rates else None
    out["step_interval_s"] = 1 / out["steps_per_s"] if out["steps_per_s"] else None
    computes = [w["compute_s"] for w in out["workers"].values() if w and w["compute_s"]]
    out["compute_s"] = statistics.mean(computes) if computes else None
    slow = out["workers"].get(SLOW_HOST)
    out["w1_link_bytes_per_s"] = slow["grad_bytes_per_s"] + slow["sensor_bytes_per_s"] if slow else None
    links = [(r["t"], r["link"]) for r in samples if "link" in r and r["t"] >= warmup_s]
    if len(links) >= 2:
        (t0, a), (t1, b) = links[0], links[-1]
        out["w1_wire"] = {way: {"bytes_per_s": (b[way]["bytes"] - a[way]["bytes"]) / (t1 - t0),
                                "drops_per_s": (b[way]["drops"] - a[way]["drops"]) / (t1 - t0)}
                          for way in ("up", "down")}
    return out


def predict(cfg: JobConfig, strategy: str, s: Settings, link: str | None, costs: dict[str, simclock.CostModel],
            goodputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The simulated clock's steps/s for the same job and links (over the same window): for
    each cost model with the links' nominal rates, and (``goodputs``: probe_links' figures)
    with each link at what one TCP stream measured on it (the slower direction), compute
    from the calibrated model if there is one."""
    from edgestream.deploy.testbed import parse_link
    from edgestream.pipeline.simjob import run_config_from_job, streams_from_job

    fast = parse_link(s.fast_link)
    spec = parse_link(link) if link else fast
    nominal = tuple((spec if w == SLOW_HOST else fast).rate_bps / 8 for w in WORKERS)
    streams = streams_from_job(cfg)
    config = run_config_from_job(cfg, time_budget_s=s.duration_s, stop_at_target=False, target_accuracy=None)
    mode = sim_mode(strategy, streams, s)
    variants = {name: (base, nominal) for name, base in costs.items()}
    if goodputs:
        def measured(rate: str) -> float:
            g = goodputs[rate]
            return min(g["down_bytes_per_s"], g["up_bytes_per_s"])

        slow_rate = link.split()[0] if link else s.fast_link
        effective = tuple(measured(slow_rate if w == SLOW_HOST else s.fast_link) for w in WORKERS)
        variants["goodput"] = (costs.get("calibrated", costs["default"]), effective)
    out = {}
    for name, (base, bandwidths) in variants.items():
        cost = replace(base, link_bandwidths_bytes_per_s=bandwidths,
                       latency_s=spec.delay_ms / 1000 if spec.delay_ms else base.latency_s)
        report = simclock.run(mode, streams, cost, config)
        rates = []
        for p in report.processes:
            if p.name not in WORKERS:
                continue
            starts = [t for t in p.step_starts if s.warmup_s <= t <= s.duration_s]
            rates.append(len(starts) / (s.duration_s - s.warmup_s))
        steps_per_s = statistics.mean(rates) if rates else None
        w1 = next((p for p in report.processes if p.name == SLOW_HOST), None)
        out[name] = {"steps_per_s": steps_per_s, "step_interval_s": 1 / steps_per_s if steps_per_s else None,
                     "cost_model": asdict(cost),
                     "w1_bytes_per_s": ((sum(w1.produced_bytes.values()) + sum(w1.consumed_bytes.values()))
                                        / report.sim_time_s) if w1 and report.sim_time_s else None}
    return out


# -- the runs --------------------------------------------------------------------------------
def set_link(testbed, link: str | None) -> None:
    """w1's link for the next run: ``link`` (degraded), or back to the configured fast one."""
    from edgestream.deploy.testbed import parse_link

    if link is None:
        testbed.fault(SLOW_HOST, "heal", None)
    else:
        testbed.fault(SLOW_HOST, "degrade", parse_link(link))


def run_one(testbed, bootstrap: str, strategy: str, condition: str, repeat: int, s: Settings, state: Path,
            costs: dict[str, simclock.CostModel], goodputs: dict[str, Any] | None) -> dict[str, Any]:
    from rich.console import Console

    from edgestream.pipeline.run import run_job

    link = CONDITIONS[condition]
    tag = uuid.uuid4().hex[:6]
    cfg = job(strategy, s, state, tag)
    entry: dict[str, Any] = {"strategy": strategy, "condition": condition, "repeat": repeat, "w1_link": link or
                             s.fast_link, "loadavg_before": os.getloadavg()}
    started = time.monotonic()
    try:
        set_link(testbed, link)
        sampler = Sampler(testbed)
        try:
            run_job(cfg, bootstrap, console=Console(file=io.StringIO()), live=False, on_streaming=sampler,
                    drain=False, testbed=testbed)
        finally:
            if link is not None:
                set_link(testbed, None)
        entry["measured"] = measure(sampler.samples, s.warmup_s)
        entry["measured"]["metrics_page_bytes"] = sampler.page_bytes
    except Exception as exc:  # one failed run must not lose the others' figures
        entry["error"] = f"{type(exc).__name__}: {exc}"
    entry["wall_s"] = round(time.monotonic() - started, 1)
    entry["loadavg_after"] = os.getloadavg()
    entry["predicted"] = predict(cfg, strategy, s, link, costs, goodputs)
    return entry


def cost_models(calibrate: bool) -> tuple[dict[str, simclock.CostModel], dict[str, Any] | None]:
    costs = {"default": simclock.CostModel()}
    calibration = None
    if calibrate:
        from edgestream.benchmarks import strategies as matrix

        calibration = matrix.calibrate()
        costs["calibrated"] = replace(simclock.CostModel(), compute_base_s=calibration["compute_base_s"],
                                      compute_per_record_s=calibration["compute_per_record_s"])
    return costs, calibration


def goodput(testbed, sender: str, receiver: str, nbytes: int = 384 * 1024, port: int = 9700) -> float:
    """Bytes/s one TCP connection carries from host ``sender`` to host ``receiver`` (first byte
    to last, at the receiver): what a shaped link really gives a stream."""
    import socket
    import threading

    address = testbed.hosts[receiver].address  # before any delay: no proxy in front of the brokers yet
    ready, done = threading.Event(), {}

    def receive() -> None:
        testbed.enter(receiver)
        with socket.create_server((address, port)) as server:
            ready.set()
            conn, _ = server.accept()
            with conn:
                got, first = 0, None
                while got < nbytes:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    first = first or time.monotonic()
                    got += len(chunk)
                done["rate"] = got / (time.monotonic() - first) if first else 0.0

    def send() -> None:
        testbed.enter(sender)
        ready.wait(10)
        try:
            with socket.create_connection((address, port), timeout=60) as conn:
                conn.sendall(b"\0" * nbytes)
        except OSError as exc:
            done["error"] = f"{sender} -> {receiver}: {exc}"

    threads = [threading.Thread(target=receive, daemon=True), threading.Thread(target=send, daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if "rate" not in done:
        raise RuntimeError(f"TCP probe {sender} -> {receiver} failed: {done.get('error', 'no data in 120 s')}")
    return done["rate"]


def probe_links(testbed, s: Settings) -> dict[str, Any]:
    """Goodput of one TCP stream over w1's link at the fast rate and at 1 Mbit/s, both ways
    (w1 <-> b0, before any delay: rates only). None if a probe failed (said on stdout)."""
    out: dict[str, Any] = {}
    for rate in dict.fromkeys([s.fast_link, *(CONDITIONS[c].split()[0] for c in s.conditions if CONDITIONS[c])]):
        set_link(testbed, None if rate == s.fast_link else rate)
        try:
            nbytes = 384 * 1024 if rate != s.fast_link else 64 * 1024 * 1024
            out[rate] = {"down_bytes_per_s": goodput(testbed, "b0", SLOW_HOST, nbytes),
                         "up_bytes_per_s": goodput(testbed, SLOW_HOST, "b0", nbytes, port=9701)}
        except RuntimeError as exc:
            print(f"no goodput prediction: {exc}", flush=True)
            return None
        finally:
            set_link(testbed, None)
    return out


def delay_works(testbed) -> str | None:
    """None if the testbed can put 80 ms on w1's link, else why not (tried once, healed)."""
    try:
        set_link(testbed, CONDITIONS["slow+80ms"])
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        try:
            set_link(testbed, None)
        except Exception:
            pass
    return None


# -- summary ---------------------------------------------------------------------------------
def _spread(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


PREDICTIONS = ("default", "calibrated", "goodput")


def _base(entries: list[dict[str, Any]], e: dict[str, Any]) -> dict[str, Any] | None:
    """The fast run of the same strategy and repeat (the baseline of ``e``)."""
    return next((b for b in entries if b["strategy"] == e["strategy"] and b["condition"] == "fast"
                 and b["repeat"] == e["repeat"] and (b.get("measured") or {}).get("steps_per_s")), None)


def summarise(entries: list[dict[str, Any]], s: Settings) -> dict[str, Any]:
    """Per strategy/condition: every repeat's figures (medians and spreads are taken when printed)."""
    cells: dict[str, Any] = {}
    for strategy in s.strategies:
        for condition in s.conditions:
            runs = [e for e in entries if e["strategy"] == strategy and e["condition"] == condition
                    and (e.get("measured") or {}).get("steps_per_s")]
            cell: dict[str, Any] = {"runs": len(runs)}
            for key in ("steps_per_s", "step_interval_s", "compute_s", "w1_link_bytes_per_s"):
                cell[key] = [e["measured"][key] for e in runs if e["measured"].get(key) is not None]
            for way in ("down", "up"):
                for what in ("bytes_per_s", "drops_per_s"):
                    cell[f"w1_wire_{way}_{what}"] = [e["measured"]["w1_wire"][way][what] for e in runs
                                                     if "w1_wire" in e["measured"]]
            cell["vs_fast"] = [e["measured"]["steps_per_s"] / b["measured"]["steps_per_s"]
                               for e in runs if (b := _base(entries, e)) is not None]
            for cost in PREDICTIONS:
                with_pred = [e for e in runs if (e.get("predicted", {}).get(cost) or {}).get("steps_per_s")]
                cell[f"predicted_{cost}"] = [e["predicted"][cost]["steps_per_s"] for e in with_pred]
                cell[f"predicted_{cost}_vs_fast"] = [
                    e["predicted"][cost]["steps_per_s"] / b["predicted"][cost]["steps_per_s"]
                    for e in with_pred if (b := _base(entries, e)) is not None
                    and (b.get("predicted", {}).get(cost) or {}).get("steps_per_s")]
                cell[f"measured_over_{cost}"] = [e["measured"]["steps_per_s"] / e["predicted"][cost]["steps_per_s"]
                                                 for e in with_pred]
            cells[f"{strategy}/{condition}"] = cell
    return cells


def markdown(cells: dict[str, Any], s: Settings, entries: list[dict[str, Any]], skipped: dict[str, str],
             calibration: dict[str, Any] | None, goodputs: dict[str, Any] | None, command: str,
             seconds: float) -> str:
    costs = [c for c in PREDICTIONS if any(cell[f"predicted_{c}"] for cell in cells.values())]
    lines = [
        f"Three workers (one device each at {s.rate_hz:g} records/s, digits IID, MLP), one Kafka node, each on "
        f"its own testbed host; every link {s.fast_link} except w1's in the slow conditions. Streaming "
        f"{s.duration_s:g} s per run, rates measured from {s.warmup_s:g} s to the end; medians of "
        f"{s.repeats} repeat(s) (min-max), runs interleaved per repeat. BSP: fixed batches of {s.batch}; "
        f"ScaDLES: {s.window_s:g} s windows, at most {s.max_batch} records a step. "
        f"Wall time of the whole benchmark: {seconds / 60:.1f} min. Command: `{command}`.",
        "",
        "Measured (real processes, real Kafka, testbed links):",
        "",
        "| strategy | condition | steps/s | vs fast (same repeat) | mean step interval s | compute/step ms "
        "| w1 app traffic kB/s | w1 wire down / up kB/s | w1 tbf drops/s down / up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows: list[tuple[str, str, dict[str, Any]]] = []
    for key, cell in cells.items():
        strategy, condition = key.split("/")
        if condition in skipped:
            lines.append(f"| {strategy} | {condition} | skipped: {skipped[condition]} | | | | | | |")
            continue
        if not cell["runs"]:
            errors = sorted({e.get("error", "?") for e in entries if e["strategy"] == strategy
                             and e["condition"] == condition})
            lines.append(f"| {strategy} | {condition} | no run finished: {'; '.join(errors)} | | | | | | |")
            continue
        rows.append((strategy, condition, cell))
        lines.append("| " + " | ".join([
            strategy, condition, _spread(cell["steps_per_s"]),
            _spread(cell["vs_fast"]) if condition != "fast" else "1",
            _spread(cell["step_interval_s"], "{:.3f}"),
            _spread([v * 1000 for v in cell["compute_s"]], "{:.1f}"),
            _spread([v / 1000 for v in cell["w1_link_bytes_per_s"]], "{:.1f}"),
            f"{_spread([v / 1000 for v in cell['w1_wire_down_bytes_per_s']], '{:.1f}')} / "
            f"{_spread([v / 1000 for v in cell['w1_wire_up_bytes_per_s']], '{:.1f}')}",
            f"{_spread(cell['w1_wire_down_drops_per_s'], '{:.1f}')} / "
            f"{_spread(cell['w1_wire_up_drops_per_s'], '{:.1f}')}"]) + " |")
    names = {"default": "default cost model", "calibrated": "compute calibrated to this machine",
             "goodput": "calibrated compute, links at their measured TCP goodput"}
    lines += ["", "Predicted by the simulated clock for the same job and links, and measured / predicted:", "",
              "| strategy | condition | measured steps/s | measured vs fast | "
              + " | ".join(f"sim steps/s ({c}) | sim vs fast ({c}) | measured / sim ({c})" for c in costs) + " |",
              "|---|---|---|---|" + "---|---|---|" * len(costs)]
    for strategy, condition, cell in rows:
        row = [strategy, condition, _spread(cell["steps_per_s"]), _spread(cell["vs_fast"]) if condition != "fast"
               else "1"]
        for c in costs:
            row += [_spread(cell[f"predicted_{c}"]),
                    _spread(cell[f"predicted_{c}_vs_fast"]) if condition != "fast" else "1",
                    _spread(cell[f"measured_over_{c}"])]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Prediction columns: " + "; ".join(f"**{c}**: {names[c]}" for c in costs) + "."]
    if calibration:
        lines.append(f"Calibrated compute: {calibration['compute_base_s'] * 1000:.2f} ms + "
                     f"{calibration['compute_per_record_s'] * 1e6:.1f} us/record (one torch thread); default: 10 ms + "
                     "2 ms/record. Simulated latency: the condition's round trip (80 ms) on every message, else 2 ms.")
    if goodputs:
        lines.append("One TCP stream over w1's link (b0 <-> w1, 384 kB at 1 Mbit/s, 64 MB at the fast rate): "
                     + "; ".join(f"{rate}: down {g['down_bytes_per_s'] / 1000:.1f} kB/s, up "
                                 f"{g['up_bytes_per_s'] / 1000:.1f} kB/s" for rate, g in goodputs.items()) + ".")
    failed = [e for e in entries if "error" in e]
    if failed:
        lines += ["", "Failed runs: " + "; ".join(f"{e['strategy']}/{e['condition']} #{e['repeat']}: {e['error']}"
                                                  for e in failed)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=Settings.repeats)
    parser.add_argument("--duration", type=float, default=Settings.duration_s, help="seconds of streaming per run")
    parser.add_argument("--warmup", type=float, default=Settings.warmup_s, help="seconds left out of the rates")
    parser.add_argument("--rate", type=float, default=Settings.rate_hz, help="records/s of each device")
    parser.add_argument("--strategies", default="bsp,scadles")
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--no-calibration", action="store_true", help="only the default cost model's prediction")
    parser.add_argument("--no-probe", action="store_true", help="skip the TCP goodput probe of w1's link")
    parser.add_argument("--quick", action="store_true", help="one repeat of 25 s runs, bsp only, fast and slow")
    parser.add_argument("--out", default=str(RESULTS / "testbed"), help="output path without suffix")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    s = Settings(repeats=args.repeats, duration_s=args.duration, warmup_s=args.warmup, rate_hz=args.rate,
                 strategies=[x for x in args.strategies.split(",") if x],
                 conditions=[x for x in args.conditions.split(",") if x])
    if args.quick:
        s = replace(s, repeats=1, duration_s=25.0, warmup_s=8.0, strategies=["bsp"], conditions=["fast", "slow"])
    unknown = set(s.conditions) - set(CONDITIONS)
    if unknown or "fast" not in s.conditions:
        raise SystemExit(f"--conditions: choose from {', '.join(CONDITIONS)}, fast included (the baseline)")
    command = "scripts/with-venv.sh python -m edgestream bench testbed " + " ".join(sys.argv[1:])
    from rich.console import Console

    from edgestream.pipeline.testbed_run import open_testbed

    costs, calibration = cost_models(not args.no_calibration)
    began = time.monotonic()
    entries: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    base = job(s.strategies[0], s, Path(os.environ.get("TMPDIR", "/tmp")) / "edgestream-bench-testbed", "base")
    state = base.state_path().parent
    with open_testbed(base, console=Console(stderr=True)) as session:
        # The probe first: once w1 had a delay, its Kafka traffic goes through the proxy.
        goodputs = None if args.no_probe else probe_links(session.testbed, s)
        print(f"TCP goodput over w1's link: {goodputs}", flush=True)
        if "slow+80ms" in s.conditions and (why := delay_works(session.testbed)) is not None:
            skipped["slow+80ms"] = why
            print(f"slow+80ms skipped: {why}", flush=True)
        for repeat in range(s.repeats):
            for strategy in s.strategies:
                for condition in s.conditions:
                    if condition in skipped:
                        continue
                    print(f"repeat {repeat} {strategy} {condition} ...", flush=True)
                    e = run_one(session.testbed, session.bootstrap, strategy, condition, repeat, s, state, costs,
                                goodputs)
                    m = e.get("measured") or {}
                    print(f"  {e.get('error') or ''} steps/s {m.get('steps_per_s')} "
                          f"(sim default {e['predicted']['default']['steps_per_s']}) in {e['wall_s']} s", flush=True)
                    entries.append(e)
    seconds = time.monotonic() - began
    cells = summarise(entries, s)
    md = markdown(cells, s, entries, skipped, calibration, goodputs, command, seconds)
    print(md)
    import numpy as np
    import torch

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({
        "benchmark": "testbed", "clock": "wall (real processes, real Kafka, testbed links) and simulated",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "processor": platform.processor()},
        "versions": {"torch": torch.__version__, "numpy": np.__version__},
        "command": command, "settings": asdict(s), "conditions": {c: CONDITIONS[c] for c in s.conditions},
        "skipped": skipped, "calibration": calibration, "goodput": goodputs, "seconds": seconds, "runs": entries,
        "cells": cells,
    }, indent=1, default=str))
    md_path = out.with_suffix(".md")
    marker = "<!-- generated below -->"
    head = md_path.read_text().split(marker)[0] if md_path.exists() and marker in md_path.read_text() else ""
    md_path.write_text(head + marker + "\n\n## Link shaping in the testbed: measured vs simulated\n\n" + md + "\n")
    print(f"wrote {out.with_suffix('.json')}, {md_path}")


if __name__ == "__main__":
    main()
