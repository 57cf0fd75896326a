"""DLion against BSP and gossip on the real broker in the edge testbed (issue #18), and
DLion's per-link shares following a link degraded mid-run.

Real processes, real Kafka, real links (root): ``--workers`` workers (8), each on its own
testbed host (network namespace, veth, ``tbf`` both ways), links ``100 100 20 20 5 5 1 1``
Mbit/s (``testbed.links.wI``; the devices host and the Kafka node unshaped), one device per
worker at the ScaDLES rates times ``--scale`` (``92 38 62 42 48 88 90 22`` x 2 records/s),
compute slowdowns ``1 1 2 2 1 1 2 2`` applied by waiting on an emulated step cost of
(10 ms + 2 ms/record) x slowdown (``workers.step_base_s`` / ``step_per_record_s``: the
simulated clock's default cost model; waiting, so the two cores are not what is measured),
digits MLP, IID and label-skewed (Dirichlet 0.3). Same devices, rates, seed, initial
weights and budget for every strategy; the runs of a repeat are back to back (bsp, gossip,
dlion per partition). Rows (``benchmarks/strategies.py``'s rows, same parameters):

  bsp     fixed batch 64 per device, every step waits for every worker's gradient, LR 0.3
  gossip  plain decentralised SGD on a ring (``topology=ring``), fixed batch 64, LR 0.3 per
          local step, asynchronous (never waits)
  dlion   all to all gradients, weighted dynamic batching, prioritised partial messages,
          knowledge transfer (``strategies.dlion_params``: b_i = 64 before capacities are
          known, B_total = 64 N, b_i in [4, 256]; min_ratio 0.001, budget_safety 0.9; the
          rest the strategy's defaults), window batcher (0.3 s windows, at most 256 records)

Accuracy: every worker evaluates its own model on the held-out 20 % every
``--eval-every`` s (evaluations.jsonl); the run's accuracy is the mean over the workers
(``strategies.mean_timeline``: at each of w0's evaluations, the mean of every worker's
latest). Time is wall time from the first record produced (simulation.json's
``started_at``). TTA: the mean at or above ``--target`` for ``--hold`` consecutive
evaluations (``trainers.evaluation.time_to_target``); accuracy at ``--acc-budget`` s.
Figures per partition: TTA, TTA of dlion over BSP's and over gossip's (same repeat,
censored at the budget when one missed), accuracy at the budget and dlion's gap to BSP and
gossip in points; per worker of each dlion run (training.json ``strategy_stats``): steps,
batch size, blocked seconds, links' ratios and bandwidth estimates, bytes, transfers.

Degraded link: one more dlion run (IID, ``--degrade-duration`` s): at ``--degrade-at`` s
host ``--degrade-host`` (w2, 20 Mbit/s) goes to 1 Mbit/s (``Testbed.fault(.., "degrade",
..)`` from the ``on_streaming`` hook, as tests/chaos/test_dlion_testbed.py); every
``--sample-every`` s (0.5) each worker's /metrics is scraped for
``edgestream_link_ratio{worker,peer}``, its bandwidth estimate and its steps. Per link to
and from that host: the ratio before and after and after how many of the host's
iterations (and seconds) it got within 10 % of the way to its new level
(``benchmarks/dlion.py``'s ``follow``).

Writes benchmarks/results/dlion_testbed.{json,md}, dlion_testbed_accuracy.png (mean
accuracy vs wall time, IID and Dirichlet panels) and dlion_testbed_degraded.png (the
ratios over time, degradation marked). Never asserts.

    scripts/with-venv.sh python -m edgestream bench dlion_testbed [--repeats 1] [--duration 120]
        [--acc-budget 110] [--target 0.85] [--partitions iid,dirichlet] [--strategies bsp,gossip,dlion]
        [--no-degraded] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from edgestream.benchmarks import dlion as dlion_bench  # dlion.py: how a ratio follows a change
from edgestream.benchmarks import (
    strategies as matrix,  # strategies.py: row parameters, mean timeline, censoring
)
from edgestream.benchmarks import testbed as testbed_bench  # testbed.py: tbf counters, spreads
from edgestream.job.config import JobConfig, load_config
from edgestream.trainers.evaluation import time_to_target

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LINKS = ("100mbit", "100mbit", "20mbit", "20mbit", "5mbit", "5mbit", "1mbit", "1mbit")
SLOWDOWNS = (1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0)
STRATEGIES = ("bsp", "gossip", "dlion")
#: Accuracy at the budget is also given as the mean over this many seconds before it (one
#: evaluation of a replica that oscillates is noisy).
ACC_WINDOW_S = 10.0


@dataclass
class Settings:
    workers: int = 8
    links: tuple[str, ...] = LINKS
    slowdowns: tuple[float, ...] = SLOWDOWNS
    scale: float = 2.0
    step_cost: tuple[float, float] = (0.010, 0.002)
    batch: int = matrix.BATCH
    window_s: float = 0.3
    max_batch: int = 256
    lr: float = 0.3
    momentum: float = 0.9
    topology: str = "ring"
    #: More dlion parameters, ``key=value,...`` (values as JSON), e.g. ``max_lag=null``.
    dlion_extra: str = ""
    eval_every_s: float = 1.0
    duration_s: float = 120.0
    acc_budget_s: float = 110.0
    target: float = 0.85
    hold: int = 2
    repeats: int = 1
    seed: int = 0
    partitions: list[str] = field(default_factory=lambda: ["iid", "dirichlet"])
    strategies: list[str] = field(default_factory=lambda: list(STRATEGIES))
    sample_every_s: float = 2.0
    degraded: bool = True
    degrade_host: str = "w2"
    degrade_link: str = "1mbit"
    degrade_at_s: float = 40.0
    degrade_duration_s: float = 90.0
    degrade_sample_every_s: float = 0.5
    #: The testbed's address block (its own, so it runs beside other testbeds on the machine).
    subnet: str = "10.78.212.0/24"

    def names(self) -> list[str]:
        return [f"w{i}" for i in range(self.workers)]

    def rates(self) -> list[float]:
        from edgestream.trainers import simclock

        base = simclock.scadles_rates(self.scale)
        return [base[i % len(base)] for i in range(self.workers)]


def quick(s: Settings) -> Settings:
    """4 workers (links 100 20 5 1 Mbit/s, slowdowns 1 2 1 2), 45 s runs, IID only, a 40 s degraded run."""
    return replace(s, workers=4, links=("100mbit", "20mbit", "5mbit", "1mbit"), slowdowns=(1.0, 2.0, 1.0, 2.0),
                   duration_s=45.0, acc_budget_s=40.0, partitions=["iid"], degrade_at_s=15.0,
                   degrade_duration_s=40.0, degrade_host="w1")


# -- the job ---------------------------------------------------------------------------------
def job(strategy: str, partition: str, s: Settings, state: Path, tag: str, duration_s: float) -> JobConfig:
    n = s.workers
    overrides = [
        f"job.name=dt{tag}", f"job.seed={s.seed}", f"run.state_dir={state / tag}",
        f"devices.count={n}", f"devices.ids={','.join(f'dt{tag}d{i}' for i in range(n))}",
        f"devices.rates_hz={','.join(f'{r:g}' for r in s.rates())}", "devices.profile=poisson",
        "devices.message_interval_s=0.05",
        f"workers.count={n}", f"workers.slowdown={','.join(f'{x:g}' for x in s.slowdowns)}",
        f"workers.step_base_s={s.step_cost[0]}", f"workers.step_per_record_s={s.step_cost[1]}",
        "data.source=digits", f"data.partition={partition}", "data.dirichlet_alpha=0.3",
        "buffer.policy=persist", "buffer.capacity=1000000",
        "train.enabled=true", "train.model=mlp", f"train.lr={s.lr}", f"train.momentum={s.momentum}",
        f"train.eval_every_s={s.eval_every_s}", "train.checkpoint_every_steps=1000000",
        f"run.duration_s={duration_s}", "run.drain_timeout_s=30",
        "testbed.enabled=true", "testbed.brokers=1", f"testbed.subnet={s.subnet}",
        *(f"testbed.links.w{i}={link}" for i, link in enumerate(s.links)),
    ]
    if strategy in ("bsp", "gossip"):
        overrides += [f"train.strategy={strategy}", "batcher.mode=fixed", f"batcher.batch_size={s.batch}",
                      f"train.max_step_batch={s.batch}"]
        if strategy == "gossip":
            overrides.append(f"train.strategy_params=topology={s.topology}")
    elif strategy == "dlion":
        params = {**matrix.dlion_params(matrix.Settings()), **dlion_bench.extra_params(s.dlion_extra)}
        overrides += ["train.strategy=dlion", "batcher.mode=window", f"batcher.window_s={s.window_s}",
                      f"batcher.max_batch={s.max_batch}", f"train.max_step_batch={s.max_batch}",
                      "train.strategy_params=" + ",".join(f"{k}={json.dumps(v)}" for k, v in params.items())]
    else:
        raise ValueError(f"strategy {strategy!r}: this benchmark runs {', '.join(STRATEGIES)}")
    return load_config(overrides=overrides, env={})


# -- sampling a live run ---------------------------------------------------------------------
class Sampler:
    """Every ``every`` s while the devices stream: each worker's steps and, per peer, its link
    ratio and bandwidth estimate (DLion's gauges; absent for the others). With ``degrade``
    (host, link spec, seconds): degrades that host's link once that many seconds passed."""

    def __init__(self, names: list[str], every: float, degrade: tuple[str, str, float] | None = None,
                 testbed=None) -> None:
        self.names = names
        self.every = every
        self.degrade = degrade
        self.testbed = testbed
        self.samples: list[dict[str, Any]] = []
        self.degraded: dict[str, Any] | None = None
        self.page_bytes: dict[str, int] = {}

    def sample(self, ctx) -> dict[str, Any]:
        from edgestream.monitoring.scrape import scrape

        row: dict[str, Any] = {"wall": time.time()}
        for name in self.names:
            w = ctx.worker(name)
            sc = scrape(w.metrics_url, timeout_s=1.0) if w.metrics_url else None
            if sc is None:
                continue
            peers = [p for p in self.names if p != name]
            ratio = {p: sc.get("edgestream_link_ratio", None, worker=name, peer=p) for p in peers}
            bw = {p: sc.get("edgestream_link_bandwidth_bytes_per_second", None, worker=name, peer=p) for p in peers}
            row[name] = {"steps": int(sc.get("edgestream_steps_total", 0, worker=name)),
                         "live": int(sc.get("edgestream_live_workers", 0, worker=name)),
                         "ratio": {p: v for p, v in ratio.items() if v is not None},
                         "bandwidth": {p: v for p, v in bw.items() if v is not None}}
        if self.testbed is not None and self.degrade is not None:
            try:
                row["link"] = testbed_bench.link_counters(self.testbed, self.degrade[0])
            except Exception:  # a counter read is evidence, not a reason to stop measuring
                pass
        self.samples.append(row)
        return row

    def _page_sizes(self, ctx) -> None:
        import urllib.request

        for name in self.names:
            w = ctx.worker(name)
            try:
                request = urllib.request.Request(w.metrics_url, headers={"Accept-Encoding": "gzip"})
                with urllib.request.urlopen(request, timeout=2) as resp:
                    self.page_bytes[name] = len(resp.read())
            except (OSError, ValueError, TypeError):
                pass

    def __call__(self, ctx) -> None:
        from edgestream.deploy.testbed import parse_link

        t0 = time.monotonic()
        while not ctx.stop.wait(self.every):  # poll interval of a sampler, not synchronisation
            row = self.sample(ctx)
            if not self.page_bytes and time.monotonic() - t0 > 5:
                self._page_sizes(ctx)
            if self.degrade is not None and self.degraded is None and time.monotonic() - t0 >= self.degrade[2]:
                host, spec, _ = self.degrade
                ctx.testbed.fault(host, "degrade", parse_link(spec))
                self.degraded = {"wall": time.time(), "host": host, "link": spec,
                                 "host_steps": (row.get(host) or {}).get("steps")}


# -- one run ---------------------------------------------------------------------------------
def worker_summary(training: dict[str, Any]) -> dict[str, Any]:
    """What a worker's training.json says about its run (DLion's per-link figures included)."""
    stats = training.get("strategy_stats") or {}
    out = {**matrix.node_traffic(training), "accuracy": training.get("accuracy")}
    for key in ("iteration", "batch_size", "capacity_samples_per_s", "compute_samples_per_s", "stream_samples_per_s",
                "capacities", "rebalances", "members", "iteration_time_s", "compute_time_s", "blocked_seconds", "score",
                "links", "transfers_in", "transfers_out", "counters", "staleness"):
        if key in stats:
            out[key] = stats[key]
    return out


def run_one(session, strategy: str, partition: str, repeat: int, s: Settings, state: Path,
            degrade: bool = False) -> dict[str, Any]:
    from rich.console import Console

    from edgestream.pipeline.run import run_job

    tag = uuid.uuid4().hex[:6]
    duration = s.degrade_duration_s if degrade else s.duration_s
    cfg = job(strategy, partition, s, state, tag, duration)
    entry: dict[str, Any] = {"strategy": strategy, "partition": partition, "repeat": repeat, "seed": s.seed,
                             "kind": "degraded" if degrade else "main", "duration_s": duration,
                             "loadavg_before": os.getloadavg(), "dlion_code": dlion_code(),
                             "strategy_params": list(cfg.train.strategy_params)}
    sampler = Sampler(s.names(), s.degrade_sample_every_s if degrade else s.sample_every_s,
                      (s.degrade_host, s.degrade_link, s.degrade_at_s) if degrade else None, session.testbed)
    started = time.monotonic()
    try:
        try:
            result = run_job(cfg, session.bootstrap, console=Console(file=io.StringIO()), live=False,
                             on_streaming=sampler, drain=False, testbed=session.testbed)
        finally:
            if degrade:
                session.testbed.fault(s.degrade_host, "heal", None)
        origin = json.loads((cfg.state_path() / "simulation.json").read_text())["started_at"]
        budget = min(s.acc_budget_s, duration)

        def timeline_of(name: str) -> list[tuple[float, float]]:
            path = cfg.state_path() / "workers" / name / "evaluations.jsonl"
            evals = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
            return [(round(e["t"] - origin, 3), round(e["accuracy"], 4)) for e in evals if e["t"] - origin <= duration]

        per_worker = {name: timeline_of(name) for name in s.names()}
        mean = matrix.mean_timeline(list(per_worker.values()))
        within = [(t, a) for t, a in mean if t <= budget]
        entry.update({
            "tta_s": time_to_target(within, s.target, hold=s.hold),
            "acc_at_budget": within[-1][1] if within else None, "acc_at_budget_t": within[-1][0] if within else None,
            "final_accuracy": mean[-1][1] if mean else None,
            "timeline": [(round(t, 3), round(a, 4)) for t, a in mean], "worker_timelines": per_worker,
            "workers": {name: worker_summary(result.training.get(name, {})) for name in s.names()},
            "balanced": result.balanced, "deaths": result.deaths,
            "samples": [{**r, "t": round(r["wall"] - origin, 3)} for r in sampler.samples],
            "metrics_page_bytes": sampler.page_bytes,
        })
        if sampler.degraded is not None:
            entry["degraded"] = {**sampler.degraded, "t": round(sampler.degraded["wall"] - origin, 3)}
    except Exception as exc:  # one failed run must not lose the others' figures
        entry["error"] = f"{type(exc).__name__}: {exc}"
    entry["wall_s"] = round(time.monotonic() - started, 1)
    entry["loadavg_after"] = os.getloadavg()
    return entry


# -- summary ---------------------------------------------------------------------------------
def _runs(entries: list[dict[str, Any]], strategy: str, partition: str) -> list[dict[str, Any]]:
    return [e for e in entries if e["kind"] == "main" and e["strategy"] == strategy and e["partition"] == partition
            and "error" not in e]


def _same(entries: list[dict[str, Any]], e: dict[str, Any], strategy: str) -> dict[str, Any] | None:
    return next((b for b in _runs(entries, strategy, e["partition"]) if b["repeat"] == e["repeat"]), None)


def summarise(entries: list[dict[str, Any]], s: Settings) -> dict[str, Any]:
    cells: dict[str, Any] = {}
    budget = min(s.acc_budget_s, s.duration_s)

    def window(e: dict[str, Any]) -> float | None:
        xs = [a for t, a in e["timeline"] if budget - ACC_WINDOW_S <= t <= budget]
        return statistics.mean(xs) if xs else None
    for partition in s.partitions:
        for strategy in s.strategies:
            runs = _runs(entries, strategy, partition)
            cell: dict[str, Any] = {"runs": len(runs), "tta": matrix.censored_median([e["tta_s"] for e in runs], budget)
                                    if runs else None,
                                    "acc": [e["acc_at_budget"] for e in runs if e["acc_at_budget"] is not None],
                                    "steps": [statistics.mean(w["steps"] or 0 for w in e["workers"].values())
                                              for e in runs],
                                    "mb_sent": [sum(sum(w["bytes_out"].values()) for w in e["workers"].values()) / 1e6
                                                for e in runs]}
            cell["acc_window"] = [w for e in runs if (w := window(e)) is not None]
            for base in ("bsp", "gossip"):
                pairs = [(e, b) for e in runs if (b := _same(entries, e, base)) is not None]
                cell[f"accw_minus_{base}"] = [100 * (window(e) - window(b)) for e, b in pairs
                                              if window(e) is not None and window(b) is not None]
                cell[f"tta_over_{base}"] = matrix.median_bound(
                    [matrix.censored_ratio(e["tta_s"], b["tta_s"], budget) for e, b in pairs])
                cell[f"acc_minus_{base}"] = [100 * (e["acc_at_budget"] - b["acc_at_budget"]) for e, b in pairs
                                             if e["acc_at_budget"] is not None and b["acc_at_budget"] is not None]
            cells[f"{partition}/{strategy}"] = cell
    return cells


def _points(values: list[float]) -> str:
    return testbed_bench._spread(values, "{:+.1f}") if values else "-"


def main_markdown(cells: dict[str, Any], s: Settings) -> list[str]:
    budget = min(s.acc_budget_s, s.duration_s)
    lines = []
    for partition in s.partitions:
        lines += [f"### {partition}", "",
                  "| strategy | TTA s | TTA / BSP | TTA / gossip | acc @ budget | vs BSP (points) | vs gossip (points) "
                  f"| acc, mean of the last {ACC_WINDOW_S:g} s | vs BSP / vs gossip (points, that mean) "
                  "| steps per worker | MB sent (all workers) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for strategy in s.strategies:
            c = cells[f"{partition}/{strategy}"]
            if not c["runs"]:
                lines.append(f"| {strategy} | no run finished | | | | | | | | | |")
                continue
            lines.append("| " + " | ".join([
                strategy, matrix._cell(c["tta"], 1),
                "1" if strategy == "bsp" else matrix._cell(c["tta_over_bsp"]) if "bsp" in s.strategies else "-",
                "1" if strategy == "gossip" else matrix._cell(c["tta_over_gossip"]) if "gossip" in s.strategies
                else "-",
                testbed_bench._spread(c["acc"], "{:.3f}"),
                "-" if strategy == "bsp" else _points(c["acc_minus_bsp"]),
                "-" if strategy == "gossip" else _points(c["acc_minus_gossip"]),
                testbed_bench._spread(c["acc_window"], "{:.3f}"),
                f"{'-' if strategy == 'bsp' else _points(c['accw_minus_bsp'])} / "
                f"{'-' if strategy == 'gossip' else _points(c['accw_minus_gossip'])}",
                testbed_bench._spread(c["steps"], "{:.0f}"), testbed_bench._spread(c["mb_sent"], "{:.1f}")]) + " |")
        lines.append("")
    lines.append(f"TTA: mean accuracy >= {s.target} for {s.hold} consecutive evaluations, censored at the budget "
                 f"({budget:g} s; `>x`: missed, `<x`: the baseline missed, `missed`: both); ratios < 1: dlion faster.")
    return lines


def claims(cells: dict[str, Any], s: Settings) -> list[str]:
    """The issue's claims against what was measured."""
    out = []
    for partition in s.partitions:
        d = cells.get(f"{partition}/dlion")
        if not d or not d["runs"]:
            continue
        for base in ("bsp", "gossip"):
            if base not in s.strategies:
                continue
            r = d[f"tta_over_{base}"]
            if r is None:
                out.append(f"- {partition}: TTA >= 2x sooner than {base}: not decided (neither reached the target)")
            else:
                met = r["value"] <= 0.5 and r["bound"] in ("=", "<")
                out.append(f"- {partition}: TTA >= 2x sooner than {base} (dlion/{base} <= 0.5): "
                           f"{'met' if met else 'NOT met'} ({matrix._cell(r)})")
            if partition == "dirichlet":
                gap = d[f"acc_minus_{base}"]
                if gap:
                    met = statistics.median(gap) >= 5
                    window = d[f"accw_minus_{base}"]
                    out.append(f"- {partition}: >= 5 points above {base} at the budget: "
                               f"{'met' if met else 'NOT met'} ({_points(gap)} points; mean of the last "
                               f"{ACC_WINDOW_S:g} s: {_points(window)})")
    return out


def dlion_workers_markdown(entries: list[dict[str, Any]], s: Settings) -> list[str]:
    """Per worker of the first repeat's dlion runs: what its training.json says."""
    lines = []
    for partition in s.partitions:
        e = next(iter(_runs(entries, "dlion", partition)), None)
        if e is None:
            continue
        lines += [f"dlion, {partition} (repeat {e['repeat']}): per worker at the end of the run "
                  "(ratio / bandwidth: its outgoing links, min-median-max over peers)", "",
                  "| worker | link | slowdown | members seen | steps | batch | capacity rec/s | blocked s | iteration s | ratio out "
                  "| bandwidth out kB/s | MB out | acc | transfers in / out |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---|"]
        for i, name in enumerate(s.names()):
            w = e["workers"].get(name, {})
            links = w.get("links") or {}
            ratios = sorted(v["ratio"] for v in links.values() if v.get("ratio") is not None)
            bws = sorted(v["bandwidth_bytes_per_s"] / 1000 for v in links.values()
                         if v.get("bandwidth_bytes_per_s") is not None)

            def mmm(xs: list[float], fmt: str) -> str:
                return "-" if not xs else "-".join(fmt.format(x) for x in (xs[0], statistics.median(xs), xs[-1]))

            def num(v: Any, fmt: str) -> str:
                return "-" if v is None else fmt.format(v)

            lines.append("| " + " | ".join([
                name, s.links[i], f"{s.slowdowns[i]:g}", num(len(w["members"]) if w.get("members") else None, "{}"),
                num(w.get("steps"), "{}"), num(w.get("batch_size"), "{}"),
                num(w.get("capacity_samples_per_s"), "{:.0f}"), num(w.get("blocked_seconds"), "{:.1f}"),
                num(w.get("iteration_time_s"), "{:.3f}"), mmm(ratios, "{:.3f}"), mmm(bws, "{:.0f}"),
                f"{sum((w.get('bytes_out') or {}).values()) / 1e6:.1f}", num(w.get("accuracy"), "{:.3f}"),
                f"{sum((w.get('transfers_in') or {}).values())} / {sum((w.get('transfers_out') or {}).values())}"])
                + " |")
        lines.append("")
    return lines


def others_markdown(entries: list[dict[str, Any]], s: Settings) -> list[str]:
    """Per worker steps of bsp and gossip (first repeat): where each one's time went."""
    lines = ["Steps per worker (first repeat; links as above):", "",
             "| partition | strategy | " + " | ".join(s.names()) + " |", "|---|---|" + "---:|" * s.workers]
    for partition in s.partitions:
        for strategy in s.strategies:
            e = next(iter(_runs(entries, strategy, partition)), None)
            if e is None:
                continue
            lines.append(f"| {partition} | {strategy} | " + " | ".join(
                str(e["workers"].get(n, {}).get("steps")) for n in s.names()) + " |")
    return lines + [""]


def link_series(run: dict[str, Any], host: str) -> dict[str, list[tuple[float, int, float]]]:
    """The ratio over time of every link to and from ``host``, with ``host``'s iteration."""
    out: dict[str, list[tuple[float, int, float]]] = {}
    for row in run.get("samples", []):
        if row.get(host) is None:
            continue
        it = row[host]["steps"]
        for worker in run["workers"]:
            if row.get(worker) is None:
                continue
            for peer, ratio in row[worker]["ratio"].items():
                if worker == host or peer == host:
                    out.setdefault(f"{worker}->{peer}", []).append((row["t"], it, ratio))
    return out


def degraded_figures(run: dict[str, Any], s: Settings) -> dict[str, Any]:
    at = run["degraded"]["t"]
    series = link_series(run, s.degrade_host)
    control = {}
    others = [n for n in s.names() if n != s.degrade_host][:2]
    for row in run.get("samples", []):
        a, b = others
        if row.get(a) and b in row[a]["ratio"] and row.get(s.degrade_host):
            control.setdefault(f"{a}->{b}", []).append((row["t"], row[s.degrade_host]["steps"], row[a]["ratio"][b]))
    return {"at_s": at, "links": {k: dlion_bench.follow(v, at) for k, v in series.items()},
            "control": {k: dlion_bench.follow(v, at) for k, v in control.items()}}


def degraded_markdown(run: dict[str, Any], figures: dict[str, Any], s: Settings) -> list[str]:
    host = s.degrade_host
    i = s.names().index(host)
    lines = [f"### Degraded link: {host}'s link {s.links[i]} -> {s.degrade_link} at {figures['at_s']:.1f} s "
             f"(dlion, iid, {run['duration_s']:g} s run)", "",
             f"Ratio = share of the gradient entries the last message on the link carried "
             f"(`edgestream_link_ratio`, scraped every {s.degrade_sample_every_s:g} s from every worker). Before: "
             "median over the 5 s before; after: median over the last quarter of the run; followed: the first sample "
             f"within 10 % of the step (+0.01) of the new level, in {host}'s iterations and seconds after the "
             "degradation.", "",
             "| link | ratio before | ratio after | followed after (iterations of " + host + ") | seconds |",
             "|---|---:|---:|---:|---:|"]
    for kind, table in (("", figures["links"]), (" (control)", figures["control"])):
        for link, f in sorted(table.items()):
            if f is None:
                lines.append(f"| {link}{kind} | too few samples | | | |")
                continue
            lines.append(f"| {link}{kind} | {f['before']:.3f} | {f['after']:.3f} | "
                         f"{'-' if f['iterations'] is None else f['iterations']}"
                         f"{'' if f['changed'] else ' (did not move)'} | "
                         f"{'-' if f['seconds'] is None else format(f['seconds'], '.1f')} |")
    moved = [f["iterations"] for f in figures["links"].values() if f and f["changed"] and f["iterations"] is not None]
    if moved:
        lines += ["", f"The ratios of {len(moved)} of {len(figures['links'])} links of {host} moved; the slowest "
                  f"followed after {max(moved)} of {host}'s iterations (median {statistics.median(moved):g})."]
    return lines + [""]


# -- plots -----------------------------------------------------------------------------------
def plots(entries: list[dict[str, Any]], s: Settings, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    colors = {"bsp": "tab:blue", "gossip": "tab:orange", "dlion": "tab:green"}
    fig, axes = plt.subplots(1, len(s.partitions), figsize=(6 * len(s.partitions), 4.2), squeeze=False)
    for ax, partition in zip(axes[0], s.partitions, strict=True):
        for strategy in s.strategies:
            for k, e in enumerate(_runs(entries, strategy, partition)):
                if e["timeline"]:
                    t, a = zip(*e["timeline"], strict=True)
                    ax.plot(t, a, color=colors.get(strategy), alpha=1.0 if k == 0 else 0.4,
                            label=strategy if k == 0 else None)
        ax.axhline(s.target, color="grey", linestyle=":", linewidth=1)
        ax.axvline(min(s.acc_budget_s, s.duration_s), color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"{partition}: mean held-out accuracy of {s.workers} workers")
        ax.set_xlabel("wall time since the first record (s)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1)
        ax.legend(loc="lower right")
    fig.tight_layout()
    path = out.parent / f"{out.name}_accuracy.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    deg = next((e for e in entries if e["kind"] == "degraded" and "degraded" in e), None)
    if deg is not None:
        series = link_series(deg, s.degrade_host)
        fig, axes = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
        for ax, outgoing in zip(axes, (True, False), strict=True):
            for link, xs in sorted(series.items()):
                if link.startswith(s.degrade_host + "->") != outgoing or not xs:
                    continue
                t, _, r = zip(*xs, strict=True)
                ax.plot(t, r, label=link, linewidth=1)
            ax.axvline(deg["degraded"]["t"], color="red", linestyle="--",
                       label=f"{s.degrade_host} -> {s.degrade_link}")
            ax.set_yscale("log")
            ax.set_ylabel("link ratio (share of entries)")
            ax.set_title(f"links {'from' if outgoing else 'to'} {s.degrade_host}")
            ax.legend(fontsize=7, ncol=3, loc="lower left")
        axes[-1].set_xlabel("wall time since the first record (s)")
        fig.tight_layout()
        path = out.parent / f"{out.name}_degraded.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# -- main ------------------------------------------------------------------------------------
def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def dlion_code() -> str:
    """trainers/strategies/dlion.py as the run's processes load it: the last commit that
    touched it, and the file's sha256 (differs from the commit's when the tree has edits)."""
    import hashlib

    path = ROOT / "trainers" / "strategies" / "dlion.py"
    sha = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    clean = _git("hash-object", str(path)) == _git("rev-parse", "HEAD:trainers/strategies/dlion.py")
    return f"{_git('log', '-1', '--format=%h', '--', 'trainers/strategies/dlion.py')} sha256:{sha}" + (
        "" if clean else " (uncommitted edits)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=Settings.repeats)
    parser.add_argument("--seed", type=int, default=Settings.seed, help="seed of the first repeat (+1 per repeat)")
    parser.add_argument("--duration", type=float, default=Settings.duration_s, help="seconds of streaming per run")
    parser.add_argument("--acc-budget", type=float, default=Settings.acc_budget_s,
                        help="wall-time budget: accuracy read there, TTA censored there")
    parser.add_argument("--target", type=float, default=Settings.target)
    parser.add_argument("--hold", type=int, default=Settings.hold, help="consecutive evaluations at the target")
    parser.add_argument("--scale", type=float, default=Settings.scale, help="ScaDLES rates times this")
    parser.add_argument("--partitions", default=",".join(Settings().partitions))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--topology", default=Settings.topology, help="gossip's graph (ring, complete, ...)")
    parser.add_argument("--lr", type=float, default=Settings.lr)
    parser.add_argument("--momentum", type=float, default=Settings.momentum)
    parser.add_argument("--dlion-params", default="", help="more dlion parameters: key=value,... (JSON values)")
    parser.add_argument("--no-degraded", action="store_true", help="skip the degraded-link run")
    parser.add_argument("--degrade-at", type=float, default=Settings.degrade_at_s)
    parser.add_argument("--degrade-duration", type=float, default=Settings.degrade_duration_s)
    parser.add_argument("--quick", action="store_true", help="smoke run: " + quick.__doc__)
    parser.add_argument("--out", default=str(RESULTS / "dlion_testbed"), help="output path without suffix")
    parser.add_argument("--from-json", metavar="PATH",
                        help="run nothing: summarise the runs of an earlier JSON again (tables, plots)")
    args = parser.parse_args()
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        known = {k: v for k, v in data["settings"].items() if k in Settings.__dataclass_fields__}
        s = Settings(**{k: tuple(v) if k in ("links", "slowdowns", "step_cost") else v for k, v in known.items()})
        report(data["runs"], s, data["command"], data["seconds"], Path(args.out), data.get("dlion_commit", ""), False,
               f"scripts/with-venv.sh python -m edgestream bench dlion_testbed --from-json {args.from_json}")
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    s = Settings(repeats=args.repeats, seed=args.seed, duration_s=args.duration, acc_budget_s=args.acc_budget,
                 target=args.target, hold=args.hold, scale=args.scale,
                 partitions=[x for x in args.partitions.split(",") if x],
                 strategies=[x for x in args.strategies.split(",") if x], topology=args.topology,
                 lr=args.lr, momentum=args.momentum, dlion_extra=args.dlion_params,
                 degraded=not args.no_degraded, degrade_at_s=args.degrade_at, degrade_duration_s=args.degrade_duration)
    if args.quick:
        s = quick(s)
    if set(s.strategies) - set(STRATEGIES):
        raise SystemExit(f"--strategies: choose from {', '.join(STRATEGIES)}")
    command = "scripts/with-venv.sh python -m edgestream bench dlion_testbed " + " ".join(sys.argv[1:])
    from rich.console import Console

    from edgestream.pipeline.testbed_run import open_testbed

    began = time.monotonic()
    entries: list[dict[str, Any]] = []
    state = Path(os.environ.get("TMPDIR", "/tmp")) / "edgestream-bench-dlion-testbed"
    base = job("dlion", "iid", s, state, "base", s.duration_s)
    first_seed = s.seed
    with open_testbed(base, console=Console(stderr=True)) as session:
        for repeat in range(s.repeats):
            rs = replace(s, seed=first_seed + repeat)
            for partition in s.partitions:
                for strategy in s.strategies:
                    print(f"repeat {repeat} {partition} {strategy} ...", flush=True)
                    e = run_one(session, strategy, partition, repeat, rs, state)
                    print(f"  {e.get('error') or ''} TTA {e.get('tta_s')} acc@budget {e.get('acc_at_budget')} "
                          f"in {e['wall_s']} s (load {e['loadavg_after'][0]:.1f})", flush=True)
                    entries.append(e)
        if s.degraded and "dlion" in s.strategies:
            print(f"degraded: dlion iid, {s.degrade_host} -> {s.degrade_link} at {s.degrade_at_s:g} s ...", flush=True)
            e = run_one(session, "dlion", "iid", 0, s, state, degrade=True)
            print(f"  {e.get('error') or ''} in {e['wall_s']} s", flush=True)
            entries.append(e)
    seconds = time.monotonic() - began
    commit = _git("log", "-1", "--format=%h %s", "--", "trainers/strategies/dlion.py")
    dirty = bool(_git("status", "--porcelain", "--", "trainers", "pipeline"))
    report(entries, s, command, seconds, Path(args.out), commit, dirty)


def report(entries: list[dict[str, Any]], s: Settings, command: str, seconds: float, out: Path, commit: str,
           dirty: bool, summarised: str | None = None) -> None:
    """Tables, claims, plots, JSON and markdown of the runs in ``entries``."""
    cells = summarise(entries, s)
    deg = next((e for e in entries if e["kind"] == "degraded" and "degraded" in e), None)
    figures = degraded_figures(deg, s) if deg is not None else None
    import numpy as np
    import torch

    loads = [e["loadavg_after"][0] for e in entries]
    codes = sorted({e.get("dlion_code", "not recorded") for e in entries if e["strategy"] == "dlion"})
    params = next((e["strategy_params"] for e in entries if e["strategy"] == "dlion" and "strategy_params" in e), None)
    params_text = ", ".join(params) if params is not None else json.dumps(
        {**matrix.dlion_params(matrix.Settings()), **dlion_bench.extra_params(s.dlion_extra)})
    lines = [
        *([f"Summarised again from the runs' JSON by `{summarised}`.", ""] if summarised else []),
        f"Command: `{command}`; trainers/strategies/dlion.py as the dlion runs loaded it: {'; '.join(codes)} "
        f"(at the end: {commit}{', trainers/ or pipeline/ with uncommitted changes' if dirty else ''}).", "",
        f"Real processes, real Kafka (one node), real links: {s.workers} workers, each on its own testbed host, "
        f"links {' '.join(s.links)} (tbf both ways; devices host and broker unshaped), one device per worker at "
        f"{' '.join(f'{r:g}' for r in s.rates())} records/s (ScaDLES x {s.scale:g}), compute slowdowns "
        f"{' '.join(f'{x:g}' for x in s.slowdowns)} on an emulated step cost of ({s.step_cost[0] * 1000:g} ms + "
        f"{s.step_cost[1] * 1000:g} ms/record) x slowdown (applied by waiting), digits MLP, LR {s.lr}, momentum "
        f"{s.momentum}. Rows: bsp (fixed batch {s.batch} per device), gossip ({s.topology}, fixed batch {s.batch}), "
        f"dlion ({params_text}, window {s.window_s:g} s, at most "
        f"{s.max_batch} records). Accuracy: mean of the workers' own held-out accuracies (every {s.eval_every_s:g} "
        f"s), wall time from the first record. {s.duration_s:g} s of streaming per run, accuracy read at "
        f"{min(s.acc_budget_s, s.duration_s):g} s; {s.repeats} repeat(s) (seed {s.seed}"
        f"{'+' if s.repeats > 1 else ''}): medians (min-max) when more than one.", "",
        f"Machine: {os.cpu_count()} cores **shared with another helper's simulated-clock benchmarks** during the "
        f"run (1-min load average after each run {min(loads):.1f}-{max(loads):.1f}); the emulated compute is "
        f"waiting, but Kafka, decoding, evaluation and the sender tasks of {s.workers} workers use the real cores, "
        f"so wall times here are inflated by contention. Python {platform.python_version()}, torch "
        f"{torch.__version__}, numpy {np.__version__}, {platform.platform()}. Whole benchmark: "
        f"{seconds / 60:.1f} min.", "",
        *main_markdown(cells, s), "", "Claims of issue #18 against these numbers:", "", *claims(cells, s), "",
        *dlion_workers_markdown(entries, s), *others_markdown(entries, s),
    ]
    if deg is not None and figures is not None:
        lines += degraded_markdown(deg, figures, s)
    failed = [e for e in entries if "error" in e]
    if failed:
        lines += ["Failed runs: " + "; ".join(f"{e['kind']} {e['partition']}/{e['strategy']} #{e['repeat']}: "
                                               f"{e['error']}" for e in failed), ""]
    md = "\n".join(lines)
    print(md)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = plots(entries, s, out)
    out.with_suffix(".json").write_text(json.dumps({
        "benchmark": "dlion_testbed", "clock": "wall (real processes, real Kafka, testbed links)",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "processor": platform.processor(), "shared": "with another helper's simulated-clock benchmarks"},
        "versions": {"torch": torch.__version__, "numpy": np.__version__}, "dlion_commit": commit,
        "command": command, "settings": asdict(s), "seconds": seconds, "cells": cells,
        "degraded": figures, "runs": entries,
    }, indent=1, default=str))
    md_path = out.with_suffix(".md")
    marker = "<!-- generated below -->"
    head = md_path.read_text().split(marker)[0] if md_path.exists() and marker in md_path.read_text() else ""
    md_path.write_text(head + marker + "\n\n## DLion vs BSP and gossip on the real broker in the testbed\n\n" + md
                       + "\n\nPlots: " + ", ".join(p.name for p in written) + "\n")
    print(f"wrote {out.with_suffix('.json')}, {md_path}, " + ", ".join(str(p) for p in written))


if __name__ == "__main__":
    main()
