"""DLion against BSP and gossip, with its ablations (issue #18; SEEDS.md section 4), on the simulated clock.

N workers (``--nodes``: 8 and 16 by default, about 14 min at ``--jobs 1``; add 32 with
``--nodes 8,16,32 --resume``, about 35 min more: asynchronous DLion's all-to-all traffic
makes a 32-node run cost minutes of wall time), one per device, on heterogeneous hosts:
links ``100 100 20 20 5 5 1 1`` Mbit/s and compute slowdowns ``1 1 2 2 4 4 8 8``, both
repeated to N (host i has the i-th entry of each), streams at the ScaDLES rates ``92 38
62 42 48 88 90 22 44 28`` records/s times ``--scale`` (2) repeated to N; digits IID and
label-skewed (``dirichlet``: Dirichlet 0.3; ``classes``: 2 classes per node); the
simulator's default cost model (step ``(10 ms + 2 ms/record) x slowdown``, 2 ms latency),
downloads charged on each host's link. Rows (benchmarks/strategies.py's, same names):

  bsp          fixed batch 64 per device, waits for it, LR 0.3 on the aggregate
  gossip       plain decentralised SGD on a ring, fixed batch 64, LR 0.3 per local step, asynchronous
  edgegossip   balanced batches, data- and accuracy-weighted mixing, plateau LR decay (window batcher)
  dlion        all to all gradients, weighted dynamic batching, prioritised partial messages,
               knowledge transfer (``strategies.dlion_params``: see "Parameters" below)
  dlion-wb     dlion without weighted batching     (``weighted_batching=false``)
  dlion-prio   dlion without the prioritised exchange (``prioritised=false``: dense to every peer)
  dlion-kt     dlion without knowledge transfer    (``knowledge_transfer=false``)
  dlion-base   all three off: dense all-to-all SGD with the lag bound (the ablations' floor)

The ablation rows run at ``--ablation-nodes`` (default 8). Accuracy of the serverless
rows is the mean of the nodes' held-out accuracies (every node evaluates its own model,
``RunConfig.evaluate_workers``, which DLion's knowledge transfer needs: its score is the
node's last held-out accuracy); BSP's replicas are identical. TTA: that accuracy at or
above the target (90 %) for 3 consecutive evaluations (every 0.5 s). Figures, each on the
same seed (same streams, shares and initial weights) and as medians over ``--repeats``
seeds with the min-max: TTA as a ratio to BSP's and to gossip's, held-out accuracy at
``--acc-budget`` (every run lasts at least that long) and its gap to BSP and to gossip
in points; the ablation table: each ablation's TTA over dlion's and dlion's accuracy
minus the ablation's (what the part switched off contributes).

Degraded link: at ``--degrade-at`` simulated seconds host ``--degrade-host`` (w2, 20
Mbit/s) drops to ``--degrade-mbit`` (1 Mbit/s) for the rest of the run
(``CostModel.link_changes``); rows bsp, gossip and dlion at the first of ``--nodes`` on
the first partition. DLion's per-link ratio (share of the gradient entries a message to
that peer carries, its ``stats()["links"][peer]["ratio"]``) is sampled at each
evaluation, for w2's links both ways; the table says how many of the sender's
iterations the ratio took to get 90 % of the way to its new level.

Parameters: the dlion rows take the strategy's defaults (``min_ratio`` 0.001,
``budget_safety`` 0.9; ``--min-ratio``, ``--budget-safety``) except ``max_lag``: None
(asynchronous, as the gossip rows; ``--max-lag 2`` for the strategy's default, with which
every node waits for the slowest link most of the time), with ``batch_size`` 64
(B_total = 64 N, as BSP's 64 per device) and ``b_i`` in [4, 256]; ``--dlion-params``
sets any other.

Writes benchmarks/results/dlion.{json,md}, dlion_accuracy.png (accuracy vs simulated
time per row), dlion_scaling.png (TTA ratios and accuracy gaps vs N) and
dlion_degraded.png (the ratios over time). Never asserts.

    python -m edgestream bench dlion [--repeats 3 | --seeds 0,1,2] [--jobs 1] [--nodes 8,16] [--ablation-nodes 8]
        [--partitions iid,dirichlet] [--rows ...] [--budget 60] [--acc-budget 30] [--scale 2]
        [--degrade-at 20] [--degrade-host 2] [--degrade-mbit 1] [--no-degraded]
        [--min-ratio 0.001] [--budget-safety 0.9] [--max-lag none] [--dlion-params max_lag=null,...] [--quick] [--out PATH] [--log RUNS.jsonl [--resume]]
        [--cost-model default|edge-compute|edge-network|FILE.toml[:KEY=VALUE,...]]
        [--tune-lr [--lr-grid 0.5,1,2] [--tune-seed 1000]]

``--cost-model`` (docs/simclock.md, "Cost models"): its compute, latency and server bandwidth
replace the default cost model's; the hosts' slowdowns and links stay unless it sets its own.

``--tune-lr`` (benchmarks/tuning.py, as ``bench strategies``): every main cell (partition, N,
row; the ablations, bsp and gossip included) runs at each multiplier of ``--lr-grid`` on the
tuning seed (``--tune-seed``, default 1000 + the first seed, never a reporting seed), the chooser
picks one (smallest TTA; if all missed, accuracy at ``--acc-budget``, then loss; ties towards
x1, then the smaller), and the reporting seeds run at it, the degraded-link runs at their main
cell's: every ratio is against tuned BSP, gossip and dlion. The tuning runs go to the log
(``--resume`` reuses them). JSON: ``tuning`` (grid, seeds, rule, ``choices`` by
``PARTITION/N/ROW``, the tuning runs) and each cell's ``tuning`` record; the markdown has a
table of the chosen multipliers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np

from edgestream.benchmarks import (
    gossip as gossip_bench,  # gossip.py: per-node idle figures, spreads
)
from edgestream.benchmarks import strategies as matrix  # strategies.py: the rows, censored medians
from edgestream.benchmarks import tuning
from edgestream.trainers import costmodels, simclock

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SLOWDOWNS = (1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0)
LINKS_MBIT = (100.0, 100.0, 20.0, 20.0, 5.0, 5.0, 1.0, 1.0)
NODES = (8, 16)
MAIN_ROWS = ("bsp", "gossip", "edgegossip", "dlion")
ABLATIONS = {"dlion-wb": "weighted batching", "dlion-prio": "prioritised exchange",
             "dlion-kt": "knowledge transfer", "dlion-base": "all three"}
DEGRADED_ROWS = ("bsp", "gossip", "dlion")
#: The dlion strategy with its link ratios sampled at every evaluation (the degraded-link runs).
TRACED = "dlion[traced]"
TRACES: dict[str, list[dict[str, Any]]] = {}


@dataclass
class Settings:
    scale: float = 2.0
    budget_s: float = 60.0
    acc_budget_s: float = 30.0
    target: float = 0.9
    eval_every_s: float = 0.5
    message_interval_s: float = 0.05
    lr: float = 0.3
    momentum: float = 0.9
    topology: str = "ring"
    edge_window_s: float = 0.3
    dlion_min_ratio: float = matrix.MIN_RATIO
    dlion_budget_safety: float = matrix.BUDGET_SAFETY
    dlion_max_lag: int | None = matrix.Settings.dlion_max_lag
    dlion_extra: str = ""
    """More dlion parameters for every dlion row, ``key=value,...`` (values as JSON), e.g. ``max_lag=null``."""
    degrade_at_s: float = 20.0
    degrade_host: int = 2
    degrade_mbit: float = 1.0
    repeats: int = 3
    first_seed: int = 0


def fleet(n: int, scale: float) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Rates (records/s), slowdowns and links (Mbit/s) of ``n`` hosts: the patterns repeated."""
    rates = simclock.scadles_rates(scale)
    return (tuple(rates[i % len(rates)] for i in range(n)), tuple(SLOWDOWNS[i % len(SLOWDOWNS)] for i in range(n)),
            tuple(LINKS_MBIT[i % len(LINKS_MBIT)] for i in range(n)))


def costs_for(n: int, s: Settings, degraded: bool, base: simclock.CostModel | None = None) -> simclock.CostModel:
    """``n`` hosts' cost model: ``base`` (default ``CostModel()``) with the hosts' slowdowns and
    links where it sets none of its own, and the degraded scenario's link drop."""
    _, slowdowns, links = fleet(n, s.scale)
    changes = ((s.degrade_at_s, s.degrade_host, s.degrade_mbit * 1e6 / 8),) if degraded else ()
    return costmodels.with_worker_lists(simclock.CostModel() if base is None else base, slowdowns,
                                        tuple(m * 1e6 / 8 for m in links), changes)


@lru_cache(maxsize=4)
def _streams(partition: str, n: int, seed: int, scale: float, interval: float, split: str = "seed"
             ) -> simclock.StreamSet:
    rates, _, _ = fleet(n, scale)
    return tuning.fleet_streams(split, rates, partition=partition, seed=seed, message_interval_s=interval)


def mode_for(row: str, streams: simclock.StreamSet, s: Settings, traced: bool = False) -> simclock.Mode:
    """benchmarks/strategies.py's row (the LR rules follow N), with this benchmark's dlion parameters."""
    ms = replace(matrix.Settings(), lr=s.lr, momentum=s.momentum, gossip_topology=s.topology,
                 edge_window_s=s.edge_window_s, dlion_min_ratio=s.dlion_min_ratio,
                 dlion_budget_safety=s.dlion_budget_safety)
    ms = replace(ms, dlion_max_lag=s.dlion_max_lag)
    mode = matrix.row_modes(streams, ms)[row]
    if mode.strategy == "dlion" and s.dlion_extra:
        mode = replace(mode, strategy_params={**mode.strategy_params, **extra_params(s.dlion_extra)})
    if traced and mode.strategy == "dlion":
        _register_traced()
        mode = replace(mode, strategy=TRACED)
    return mode


def extra_params(text: str) -> dict[str, Any]:
    """``key=value,...`` with JSON values (``max_lag=null,transfer_every=10``)."""
    out = {}
    for item in (x for x in text.split(",") if x):
        key, _, value = item.partition("=")
        out[key.strip()] = json.loads(value)
    return out


def _register_traced() -> None:
    from edgestream.trainers import strategies
    from edgestream.trainers.strategies.dlion import DLionStrategy

    if TRACED in strategies.names():
        return

    @strategies.register(TRACED)
    class TracedDLion(DLionStrategy):
        """DLion, its iteration and per-link ratios recorded at every evaluation."""

        def on_evaluation(self, accuracy: float, loss: float):  # type: ignore[override]
            links = self.stats()["links"]
            TRACES.setdefault(self.worker_id, []).append(
                {"iteration": self.iteration, "ratio": {p: v["ratio"] for p, v in links.items()},
                 "bandwidth": {p: v["bandwidth_bytes_per_s"] for p, v in links.items()}})
            return super().on_evaluation(accuracy, loss)


# -- one run -----------------------------------------------------------------------------------


@dataclass
class Task:
    kind: str  # "main" or "degraded"
    partition: str
    nodes: int
    seed: int
    row: str
    lr_mult: float = 1.0  # scales every learning rate of the row (--tune-lr; benchmarks/tuning.py)
    split: str = "seed"  # the test split and what the run is measured on (tuning.SPLITS)


def _cell(d: dict[str, Any]) -> tuple[Any, ...]:
    """A task's or run's tuning cell: partition, N and row (a degraded-link run takes its main
    cell's choice)."""
    return (d["partition"], d["nodes"], d["row"])


def run_task(task: Task, s: Settings, base: simclock.CostModel | None = None) -> dict[str, Any]:
    started = time.monotonic()
    base = simclock.CostModel() if base is None else base
    streams = _streams(task.partition, task.nodes, task.seed, s.scale, s.message_interval_s, task.split)
    degraded = task.kind == "degraded"
    mode = tuning.scaled_mode(mode_for(task.row, streams, s, traced=degraded), task.lr_mult)
    config = simclock.RunConfig(model="mlp", lr=s.lr * task.lr_mult, momentum=s.momentum, seed=task.seed,
                                eval_every_s=s.eval_every_s, target_accuracy=s.target, time_budget_s=s.budget_s,
                                min_time_s=s.budget_s if degraded else s.acc_budget_s,
                                evaluate_workers=task.row in matrix.MEAN_OF_NODES_ROWS)
    TRACES.clear()
    report = simclock.run(mode, streams, costs_for(task.nodes, s, degraded, base), config)
    workers = [p for p in report.processes if p.name != simclock.SERVER_NAME]
    nodes = [gossip_bench._node(p, report.sim_time_s, 5.0) for p in workers]
    obs = {p.name: {k: p.observations.get(k) for k in ("batch_size", "capacity", "iteration_time_s", "link_ratio",
                                                       "knowledge_transfers")}
           for p in workers} if task.row.startswith("dlion") else None
    traces = None
    if TRACES:  # sample k of every worker is the k-th evaluation: the timeline's k-th time
        times = [t for t, _, _ in report.timeline]
        traces = {w: [{"t": times[i], **x} for i, x in enumerate(samples) if i < len(times)]
                  for w, samples in TRACES.items()}
        TRACES.clear()
    return {
        **asdict(task), "settings": asdict(s), "cost_model": asdict(base),
        "lr": config.lr if mode.lr is None else mode.lr,
        "tta_s": report.tta_s, "acc_at_budget": matrix.accuracy_at(report.timeline, s.acc_budget_s),
        "loss_at_budget": matrix.loss_at(report.loss_timeline, s.acc_budget_s),
        "final_accuracy": report.final_accuracy, "sim_time_s": report.sim_time_s, "stopped": report.stopped,
        "local_steps": report.local_steps, "bytes_sent": report.bytes_sent,
        "rejected_messages": report.rejected_messages, "rejected_steps": report.rejected_steps,
        "idle_mean": statistics.fmean(n["idle"] for n in nodes),
        "blocked_mean": statistics.fmean(n["blocked"] for n in nodes),
        "starved_mean": statistics.fmean(n["starved"] for n in nodes),
        "steps_per_node": [n["local_steps"] for n in nodes],
        "node_acc_at_budget": {w: matrix.accuracy_at([(t, a, 0) for t, a in tl], s.acc_budget_s)
                               for w, tl in report.worker_timelines.items()},
        "accuracy_timeline": [(round(t, 3), round(a, 4)) for t, a, _ in report.timeline],
        "dlion": obs, "traces": traces, "dlion_code": DLION_CODE,
        "wall_s": time.monotonic() - started,
    }


def _key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["kind"], r["partition"], r["nodes"], r["seed"], r["row"], r.get("lr_mult", 1.0),
            r.get("split", "seed"))


def run_all(tasks: list[Task], s: Settings, jobs: int, log: Path, done: list[dict[str, Any]],
            base: simclock.CostModel | None = None) -> list[dict[str, Any]]:
    """Every task's result, each appended to ``log`` (JSON lines) as it ends; tasks already in
    ``done`` (an earlier log of the same settings) are not run again."""

    def line(i: int, count: int, r: dict[str, Any], begun: float) -> str:
        elapsed = time.monotonic() - begun
        lr = f" lr x{r['lr_mult']:g} ({r['lr']:.3g})" if r.get("lr_mult", 1.0) != 1.0 else ""
        return (f"[{i}/{count}] {r['kind']} {r['partition']} N={r['nodes']} seed {r['seed']} {r['row']}{lr}: TTA "
                f"{gossip_bench._s(r['tta_s'])}, acc@{s.acc_budget_s:g}s {gossip_bench._f3(r['acc_at_budget'])}, "
                f"blocked {r['blocked_mean']:.0%} ({r['wall_s']:.1f} s; {elapsed / 60:.1f} min, "
                f"~{elapsed / i * (count - i) / 60:.1f} min left)")

    return gossip_bench.run_logged(partial(run_task, base=base), tasks, s, jobs, log, done, _key, line)


# -- summary -------------------------------------------------------------------------------------


def summarise(raw: list[dict[str, Any]], s: Settings,
              tuned: dict[tuple[Any, ...], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per (partition, N, row) of the main runs: TTA and accuracy, and per seed their ratio /
    gap to BSP, gossip and (ablations) dlion on the same seed (``tuned``: each cell's tuning
    record, by :func:`_cell`)."""
    main = [r for r in raw if r["kind"] == "main"]
    by = {(r["partition"], r["nodes"], r["seed"], r["row"]): r for r in main}
    cells: dict[str, Any] = {}
    for partition, n, row in dict.fromkeys((r["partition"], r["nodes"], r["row"]) for r in main):
        runs = [r for r in main if (r["partition"], r["nodes"], r["row"]) == (partition, n, row)]
        cell: dict[str, Any] = {"partition": partition, "nodes": n, "row": row, "seeds": [r["seed"] for r in runs],
                                "tta_s": [r["tta_s"] for r in runs],
                                "tta_median": matrix.censored_median([r["tta_s"] for r in runs], s.budget_s),
                                "acc": [r["acc_at_budget"] for r in runs],
                                "blocked": [r["blocked_mean"] for r in runs],
                                "bytes_sent": [r["bytes_sent"] for r in runs],
                                "lr_mult": runs[0].get("lr_mult", 1.0), "lr": runs[0].get("lr"),
                                "tuning": (tuned or {}).get((partition, n, row))}
        for base in ("bsp", "gossip", "dlion"):
            ratios, gaps = [], []
            for r in runs:
                b = by.get((partition, n, r["seed"], base))
                if b is None:
                    continue
                ratios.append(matrix.censored_ratio(r["tta_s"], b["tta_s"], s.budget_s))
                if r["acc_at_budget"] is not None and b["acc_at_budget"] is not None:
                    gaps.append(100 * (r["acc_at_budget"] - b["acc_at_budget"]))
            cell[f"vs_{base}"] = ratios
            cell[f"vs_{base}_median"] = matrix.median_bound(ratios)
            cell[f"gap_{base}_points"] = gaps
        cells[f"{partition}/{n}/{row}"] = cell
    return cells


def _gap(values: list[float]) -> str:
    return gossip_bench._spread(values, "{:+.1f}")


def main_markdown(cells: dict[str, Any], s: Settings, seeds: list[int], seconds: float,
                  costs: costmodels.NamedCostModel | None = None) -> str:
    named = costs or costmodels.PRESETS["default"]
    d = named.model
    lines = [
        f"Simulated clock (trainers/simclock.py; {named.name} cost model: step ({d.compute_base_s * 1e3:g} ms + "
        f"{d.compute_per_record_s * 1e3:g} ms/record) x slowdown, {d.latency_s * 1e3:g} ms latency, downloads "
        f"charged), digits MLP (held-out 20 %), N workers one per device; host i: link "
        f"{' '.join(f'{x:g}' for x in LINKS_MBIT)} Mbit/s, slowdown {' '.join(f'{x:g}' for x in SLOWDOWNS)} "
        f"(repeated to N), rates ScaDLES x {s.scale:g} repeated. LR {s.lr:g}, momentum {s.momentum:g}; rows as in "
        f"benchmarks/strategies.py; dlion: {json.dumps({**matrix.dlion_params(_ms(s)), **extra_params(s.dlion_extra)})}"
        f" (the rest the strategy's "
        f"defaults: transfer every 20 iterations, lambda 0.5, gap 0.02). Accuracy = mean of the nodes' "
        f"held-out accuracies (BSP: its model); target {s.target:.0%} held for 3 evaluations (every "
        f"{s.eval_every_s:g} s), budget {s.budget_s:g} s, accuracy read at {s.acc_budget_s:g} s. Seeds "
        f"{', '.join(map(str, seeds))}: medians (min-max). Ratios < 1 are faster; `>x` / `<x`: censored at the budget "
        f"(the row / the baseline missed); gaps in points (+ is better than the baseline). About {seconds / 60:.0f} "
        f"min of simulation (run wall times summed / processes).",
    ]
    partitions = list(dict.fromkeys(c["partition"] for c in cells.values()))
    for partition in partitions:
        lines += ["", f"### {partition}", "",
                  "| N | row | TTA s | TTA / BSP | TTA / gossip | acc @ budget | vs BSP (points) | vs gossip (points) "
                  "| blocked on peers | MB sent |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c in cells.values():
            if c["partition"] != partition or c["row"] in ABLATIONS:
                continue
            lines.append(
                f"| {c['nodes']} | {c['row']} | {matrix._cell(c['tta_median'], 1)} "
                f"| {'1' if c['row'] == 'bsp' else _ratio(c['vs_bsp_median'])} "
                f"| {'1' if c['row'] == 'gossip' else _ratio(c['vs_gossip_median'])} "
                f"| {gossip_bench._spread([a for a in c['acc'] if a is not None], '{:.3f}')} "
                f"| {'-' if c['row'] == 'bsp' else _gap(c['gap_bsp_points'])} "
                f"| {'-' if c['row'] == 'gossip' else _gap(c['gap_gossip_points'])} "
                f"| {gossip_bench._spread(c['blocked'], '{:.0%}')} "
                f"| {gossip_bench._spread([b / 1e6 for b in c['bytes_sent']], '{:.0f}')} |")
    return "\n".join(lines)


def _ratio(m: dict[str, Any] | None) -> str:
    return "both missed" if m is None else matrix._cell(m)


def ablation_markdown(cells: dict[str, Any], s: Settings) -> str:
    rows = [c for c in cells.values() if c["row"] in ABLATIONS]
    if not rows:
        return ""
    lines = [f"### Ablation: what each part of DLion contributes (accuracy at {s.acc_budget_s:g} s, TTA)", "",
             "| partition | N | row (part switched off) | TTA s | TTA / dlion's | dlion's acc - this row's (points) "
             "| TTA / BSP | TTA / gossip | acc @ budget |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for c in rows:
        lines.append(
            f"| {c['partition']} | {c['nodes']} | {c['row']} ({ABLATIONS[c['row']]}) "
            f"| {matrix._cell(c['tta_median'], 1)} | {_ratio(c['vs_dlion_median'])} "
            f"| {_gap([-g for g in c['gap_dlion_points']])} | {_ratio(c['vs_bsp_median'])} "
            f"| {_ratio(c['vs_gossip_median'])} "
            f"| {gossip_bench._spread([a for a in c['acc'] if a is not None], '{:.3f}')} |")
    lines += ["", "TTA / dlion's > 1: the row is slower without the part (the part helps); a positive "
              "accuracy difference: dlion is that much better with the part than without it."]
    return "\n".join(lines)


def _ms(s: Settings) -> matrix.Settings:
    return replace(matrix.Settings(), dlion_min_ratio=s.dlion_min_ratio, dlion_budget_safety=s.dlion_budget_safety,
                   dlion_max_lag=s.dlion_max_lag)


def goals(cells: dict[str, Any], s: Settings) -> list[str]:
    """The paper's claims against the medians: TTA >= 2x sooner than BSP and than gossip;
    >= 5 points higher at the fixed budget under label skew."""
    out = []
    for c in cells.values():
        if c["row"] != "dlion":
            continue
        parts = []
        for base in ("bsp", "gossip"):
            m = c[f"vs_{base}_median"]
            if m is None:
                parts.append(f"vs {base}: both missed")
                continue
            met = m["value"] <= 0.5 and m["bound"] in ("=", "<")
            parts.append(f"TTA / {base}'s {matrix._cell(m)} ({'met' if met else 'not met'}: <= 0.5, i.e. >= 2x sooner)")
        if c["partition"] != "iid":
            for base in ("bsp", "gossip"):
                gaps = c[f"gap_{base}_points"]
                if gaps:
                    g = statistics.median(gaps)
                    parts.append(f"{g:+.1f} points vs {base} at {s.acc_budget_s:g} s "
                                 f"({'met' if g >= 5 else 'not met'}: >= +5)")
        out.append(f"{c['partition']}, N = {c['nodes']}: " + "; ".join(parts))
    return out


# -- the degraded link ---------------------------------------------------------------------------


def follow(samples: list[tuple[float, int, float]], at: float) -> dict[str, Any] | None:
    """How a link's ratio follows a change at ``at``: ``samples`` are (t, sender iteration,
    ratio). Before: the median over the 5 s before; after: the median over the last quarter
    of the samples after; the ratio has followed at the first sample after the change within
    10 % of the step (and 0.01) of the new level."""
    before = [r for t, _, r in samples if at - 5 <= t < at and r is not None]
    after_all = [(t, it, r) for t, it, r in samples if t >= at and r is not None]
    if not before or len(after_all) < 4:
        return None
    b = statistics.median(before)
    a = statistics.median(r for _, _, r in after_all[-max(1, len(after_all) // 4):])
    start = next((it for t, it, _ in samples if t >= at), None)
    if abs(b - a) < 0.05:
        return {"before": b, "after": a, "seconds": None, "iterations": None, "changed": False}
    tol = 0.1 * abs(b - a) + 0.01
    hit = next(((t, it) for t, it, r in after_all if abs(r - a) <= tol), None)
    return {"before": b, "after": a, "seconds": None if hit is None else hit[0] - at,
            "iterations": None if hit is None or start is None else hit[1] - start, "changed": True}


def link_series(run: dict[str, Any], host: str) -> dict[str, list[tuple[float, int, float]]]:
    """The ratio over time of every link of ``host``: ``host->peer`` (the host's messages) and
    ``peer->host`` (the peers' messages to it), with the sender's iteration."""
    out: dict[str, list[tuple[float, int, float]]] = {}
    for worker, samples in (run.get("traces") or {}).items():
        for x in samples:
            for peer, ratio in x["ratio"].items():
                if worker == host or peer == host:
                    out.setdefault(f"{worker}->{peer}", []).append((x["t"], x["iteration"], ratio))
    return out


def degraded_markdown(raw: list[dict[str, Any]], s: Settings) -> str:
    runs = [r for r in raw if r["kind"] == "degraded"]
    if not runs:
        return ""
    main = {(r["partition"], r["nodes"], r["seed"], r["row"]): r for r in raw if r["kind"] == "main"}
    host = f"w{s.degrade_host}"
    n = runs[0]["nodes"]
    _, _, links = fleet(n, s.scale)
    lines = [f"### Degraded link: {host}'s link {links[s.degrade_host]:g} -> {s.degrade_mbit:g} Mbit/s at "
             f"{s.degrade_at_s:g} s (N = {n}, {runs[0]['partition']}, runs of {s.budget_s:g} s)", "",
             "| row | seed | TTA s (degraded) | TTA s (link kept) | at s | acc (degraded) | acc (link kept) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        kept = main.get((r["partition"], r["nodes"], r["seed"], r["row"]))
        at = min(r["sim_time_s"], kept["sim_time_s"]) if kept else r["sim_time_s"]

        def acc(run: dict[str, Any] | None, at: float = at) -> str:
            return "-" if run is None else gossip_bench._f3(matrix.accuracy_at(
                [(t, a, 0) for t, a in run["accuracy_timeline"]], at - s.eval_every_s / 2))

        lines.append(f"| {r['row']} | {r['seed']} | {gossip_bench._s(r['tta_s'])} "
                     f"| {gossip_bench._s(kept['tta_s']) if kept else '-'} | {at:.1f} | {acc(r)} | {acc(kept)} |")
    traced = [r for r in runs if r.get("traces")]
    if traced:
        lines += ["", f"DLion's ratio on {host}'s links (median over the 5 s before the drop -> over the last quarter "
                  "of the run; how long until 90 % of the way, in simulated s and the sender's iterations):", "",
                  "| seed | link | ratio before | ratio after | s to follow | iterations to follow |",
                  "|---:|---|---:|---:|---:|---:|"]
        note = len(lines)
        unchanged: list[str] = []
        for r in traced:
            for link, series in sorted(link_series(r, host).items()):
                f = follow(series, s.degrade_at_s)
                if f is None:
                    continue
                if not f["changed"]:
                    unchanged.append(link)
                    continue
                lines.append(f"| {r['seed']} | {link} | {f['before']:.3f} | {f['after']:.3f} "
                             f"| {gossip_bench._f3(f['seconds'])} "
                             f"| {'-' if f['iterations'] is None else f['iterations']} |")
        lines.append("")
        lines.append(f"Links whose ratio moved by less than 0.05 (left out): {len(unchanged)} of "
                     f"{len(unchanged) + len(lines) - note - 1} (all seeds). `-`: not within 10 % of the new level "
                     f"before the end.")
    return "\n".join(lines)


# -- plots ---------------------------------------------------------------------------------------


def plots(raw: list[dict[str, Any]], cells: dict[str, Any], s: Settings, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    main = [r for r in raw if r["kind"] == "main"]
    panels = list(dict.fromkeys((r["partition"], r["nodes"]) for r in main))
    rows = list(dict.fromkeys(r["row"] for r in main))
    if panels:
        cols = len({n for _, n in panels})
        parts = list(dict.fromkeys(p for p, _ in panels))
        sizes = sorted({n for _, n in panels})
        fig, axes = plt.subplots(len(parts), cols, figsize=(5 * cols, 3.8 * len(parts)), squeeze=False)
        for (partition, n) in panels:
            ax = axes[parts.index(partition)][sizes.index(n)]
            for row in rows:
                runs = [r for r in main if (r["partition"], r["nodes"], r["row"]) == (partition, n, row)]
                if not runs:
                    continue
                k = min(len(r["accuracy_timeline"]) for r in runs)
                t = np.array([p[0] for p in runs[0]["accuracy_timeline"][:k]])
                v = np.array([[p[1] for p in r["accuracy_timeline"][:k]] for r in runs])
                colour = f"C{rows.index(row) % 10}"
                ax.plot(t, np.median(v, axis=0), label=row, lw=1.2, color=colour,
                        ls="--" if row in ABLATIONS else "-")
                ax.fill_between(t, v.min(axis=0), v.max(axis=0), color=colour, alpha=0.1)
            ax.axhline(s.target, color="grey", ls=":", lw=1)
            ax.set_ylim(0, 1)
            ax.set_xlim(0, s.budget_s)
            ax.set_title(f"{partition}, N = {n}", fontsize=9)
            ax.set_xlabel("simulated time (s)")
            ax.set_ylabel("held-out accuracy (mean of nodes)")
            ax.legend(fontsize=7)
        fig.suptitle("DLion vs BSP and gossip: median over seeds, min-max band", fontsize=10)
        path = out.parent / f"{out.name}_accuracy.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
        # Scaling: TTA ratio and accuracy gap of dlion (and edgegossip) vs N.
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for partition in parts:
            for row, base, marker in (("dlion", "bsp", "o"), ("dlion", "gossip", "s")):
                pts = [(c["nodes"], c[f"vs_{base}_median"]) for c in cells.values()
                       if c["partition"] == partition and c["row"] == row and c[f"vs_{base}_median"]]
                if pts:
                    axes[0].errorbar([p[0] for p in pts], [p[1]["value"] for p in pts],
                                     yerr=[[p[1]["value"] - p[1]["min"] for p in pts],
                                           [p[1]["max"] - p[1]["value"] for p in pts]],
                                     marker=marker, capsize=3, label=f"{partition}: dlion / {base}")
                gaps = [(c["nodes"], c[f"gap_{base}_points"]) for c in cells.values()
                        if c["partition"] == partition and c["row"] == row and c[f"gap_{base}_points"]]
                if gaps:
                    med = [statistics.median(g) for _, g in gaps]
                    axes[1].errorbar([n for n, _ in gaps], med, yerr=[[m - min(g) for m, (_, g) in zip(med, gaps, strict=True)],
                                                                       [max(g) - m for m, (_, g) in zip(med, gaps, strict=True)]],
                                     marker=marker, capsize=3, label=f"{partition}: dlion - {base}")
        axes[0].axhline(1, color="grey", lw=0.8)
        axes[0].axhline(0.5, color="grey", ls=":", lw=0.8)
        axes[0].set_yscale("log")
        axes[0].set_ylabel("TTA ratio (< 1: dlion sooner; censored at the budget)")
        axes[1].axhline(0, color="grey", lw=0.8)
        axes[1].axhline(5, color="grey", ls=":", lw=0.8)
        axes[1].set_ylabel(f"accuracy gap at {s.acc_budget_s:g} s (points)")
        for ax in axes:
            ax.set_xlabel("nodes N")
            ax.set_xticks(sizes)
            ax.legend(fontsize=7)
        fig.suptitle("How DLion's lead scales (medians, min-max)", fontsize=10)
        path = out.parent / f"{out.name}_scaling.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    traced = [r for r in raw if r["kind"] == "degraded" and r.get("traces")]
    if traced:
        host = f"w{s.degrade_host}"
        series = link_series(traced[0], host)
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for link, pts in sorted(series.items()):
            ax = axes[0] if link.startswith(f"{host}->") else axes[1]
            ax.plot([p[0] for p in pts], [p[2] for p in pts], lw=1, label=link)
        for ax, title in zip(axes, (f"{host} -> peers", f"peers -> {host}"), strict=True):
            ax.axvline(s.degrade_at_s, color="grey", ls=":", lw=1)
            ax.set_yscale("log")
            ax.set_xlabel("simulated time (s)")
            ax.set_title(title, fontsize=9)
            ax.legend(fontsize=6, ncol=2)
        axes[0].set_ylabel("dlion link ratio (share of gradient entries sent)")
        fig.suptitle(f"Degraded link: {host} drops to {s.degrade_mbit:g} Mbit/s at {s.degrade_at_s:g} s "
                     f"(seed {traced[0]['seed']})", fontsize=10)
        path = out.parent / f"{out.name}_degraded.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def _code_version(path: str) -> str:
    """The last commit of ``path`` (and "+ uncommitted changes" if the tree differs from it)."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("log", "-1", "--format=%h %s", "--", path)[:100]
    return commit + (" + uncommitted changes" if git("status", "--short", "--", path) else "")


#: The strategy's code this process runs (taken at import, as the strategy module is).
DLION_CODE = _code_version("trainers/strategies/dlion.py")


# -- main ------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=Settings.repeats, help="seeds (medians and min-max)")
    parser.add_argument("--seeds", help="comma list of seeds (replaces --repeats)")
    parser.add_argument("--jobs", type=int, default=1, help="simulations in parallel")
    parser.add_argument("--nodes", default=",".join(map(str, NODES)), help="comma list of N")
    parser.add_argument("--ablation-nodes", default="8", help="comma list of N for the ablation rows ('' none)")
    parser.add_argument("--partitions", default="iid,dirichlet", help="comma list of iid, dirichlet, classes")
    parser.add_argument("--rows", default=",".join(MAIN_ROWS), help="comma list of the main rows")
    parser.add_argument("--budget", type=float, default=Settings.budget_s, help="simulated seconds per run at most")
    parser.add_argument("--acc-budget", type=float, default=Settings.acc_budget_s,
                        help="accuracy read at this simulated time (runs last at least this long)")
    parser.add_argument("--scale", type=float, default=Settings.scale, help="multiplies the ScaDLES rates")
    parser.add_argument("--min-ratio", type=float, default=Settings.dlion_min_ratio, help="dlion's min_ratio")
    parser.add_argument("--budget-safety", type=float, default=Settings.dlion_budget_safety,
                        help="dlion's budget_safety")
    parser.add_argument("--max-lag", type=lambda v: None if v.lower() in ("none", "null", "") else int(v),
                        default=Settings.dlion_max_lag, help="dlion's max_lag (none: asynchronous, the default here)")
    parser.add_argument("--dlion-params", default="", metavar="KEY=JSON,...",
                        help="more parameters of every dlion row, e.g. max_lag=null,transfer_every=10")
    parser.add_argument("--degrade-at", type=float, default=Settings.degrade_at_s, help="simulated s of the drop")
    parser.add_argument("--degrade-host", type=int, default=Settings.degrade_host, help="host index whose link drops")
    parser.add_argument("--degrade-mbit", type=float, default=Settings.degrade_mbit, help="its link after the drop")
    parser.add_argument("--no-degraded", action="store_true", help="skip the degraded-link scenario")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: N = 8, IID, one seed, 40 s budget, accuracy at 20 s")
    parser.add_argument("--cost-model", default="default", metavar="SPEC",
                        help="the cost model (trainers/costmodels.py): a preset (" + ", ".join(costmodels.PRESETS)
                             + "), a .toml file, either with :KEY=VALUE,... overrides; its compute, latency and "
                               "bandwidth replace the default's, the hosts' slowdowns and links stay unless it sets "
                               "its own")
    parser.add_argument("--out", default=str(RESULTS / "dlion"), help="output path without suffix")
    parser.add_argument("--log", help="JSON lines of finished runs (default: $TMPDIR/edgestream-bench-NAME.runs.jsonl)")
    parser.add_argument("--resume", action="store_true", help="reuse the runs of the log with the same settings")
    tuning.add_arguments(parser)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    s = Settings(budget_s=args.budget, acc_budget_s=min(args.acc_budget, args.budget), scale=args.scale,
                 dlion_min_ratio=args.min_ratio, dlion_budget_safety=args.budget_safety,
                 dlion_max_lag=args.max_lag, dlion_extra=args.dlion_params, degrade_at_s=args.degrade_at,
                 degrade_host=args.degrade_host, degrade_mbit=args.degrade_mbit, repeats=args.repeats)
    nodes = [int(x) for x in args.nodes.split(",") if x]
    ablation_nodes = [int(x) for x in args.ablation_nodes.split(",") if x]
    partitions = [p for p in args.partitions.split(",") if p]
    rows = [r for r in args.rows.split(",") if r]
    if args.quick:
        s = replace(s, repeats=1, budget_s=40.0, acc_budget_s=20.0)
        nodes, ablation_nodes, partitions = [8], [8], ["iid"]
    seeds = [s.first_seed + i for i in range(s.repeats)]
    if args.seeds:
        seeds = [int(x) for x in args.seeds.split(",") if x]
        s = replace(s, repeats=len(seeds), first_seed=seeds[0])
    tune = tuning.from_args(parser, args, seeds)
    for needed in ("bsp", "gossip", "dlion"):  # the baselines of every ratio
        if needed not in rows:
            rows.insert(0, needed)
    named = matrix.resolve_cost_model(parser, args.cost_model, tuple(nodes))
    # Interleaved: every row of a (partition, N, seed) back to back.
    tasks = [Task("main", p, n, seed, row) for n in nodes for seed in seeds for p in partitions
             for row in rows + (list(ABLATIONS) if n in ablation_nodes else [])]
    if not args.no_degraded:
        tasks += [Task("degraded", partitions[0], nodes[0], seed, row) for seed in seeds for row in DEGRADED_ROWS]
    log = Path(args.log) if args.log else Path(tempfile.gettempdir()) / f"edgestream-bench-{Path(args.out).name}.runs.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    done: list[dict[str, Any]] = []
    if args.resume and log.exists():
        done = [r for r in (json.loads(x) for x in log.read_text().splitlines() if x.strip())
                if r.get("settings") == asdict(s) and gossip_bench.same_cost_model(r, named.model)]
    elif log.exists():
        log.unlink()
    tuned, tune_raw = None, []
    if tune is not None:
        # Every main cell (bsp, gossip and dlion included) on the tuning seeds at each multiplier,
        # then the reporting seeds (and the degraded-link runs) at its chosen one; logged and resumed.
        tune_raw, tuned = tuning.tune_cells([t for t in tasks if t.kind == "main"], tune, _cell,
                                            lambda grid: run_all(grid, s, args.jobs, log, done, named.model),
                                            lambda key: f"{key[0]} N={key[1]} {key[2]}", f"runs on {args.jobs} process(es)")
        tasks = tuning.at_chosen(tasks, tuned, _cell)
    print(f"{len(tasks)} simulated runs on {args.jobs} process(es) ...", flush=True)
    raw = run_all(tasks, s, args.jobs, log, done, named.model)
    seconds = sum(r["wall_s"] for r in raw) / max(1, args.jobs)
    cells = summarise(raw, s, tuned)
    verdicts = goals(cells, s)
    command = "python -m edgestream bench dlion " + " ".join(sys.argv[1:])
    versions = sorted({r.get("dlion_code") or "not recorded" for r in raw})
    md = (f"## DLion vs BSP and gossip (simulated clock)\n\nCommand: `{command}`; trainers/strategies/dlion.py at "
          f"{'; '.join(versions)}\n\n" + main_markdown(cells, s, seeds, seconds, named)
          + "\n\n" + ablation_markdown(cells, s) + "\n\n" + degraded_markdown(raw, s)
          + ("" if tune is None else "\n\n" + "\n".join(tuning.markdown_table(
              {(row, f"{partition} N={n}"): rec for (partition, n, row), rec in tuned.items()},
              list(dict.fromkeys(row for _, _, row in tuned)),
              list(dict.fromkeys(f"{partition} N={n}" for partition, n, _ in tuned)), tune))
             + " The degraded-link runs use their main cell's choice.")
          + "\n\n### The paper's claims (SEEDS.md section 4) against the medians\n\n"
          + "\n".join(f"- {v}" for v in verdicts) + "\n")
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pngs = plots(raw, cells, s, out)
    import torch

    out.with_suffix(".json").write_text(json.dumps({
        "benchmark": "dlion", "clock": "simulated", "command": command,
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "processor": platform.processor()},
        "versions": {"torch": torch.__version__, "numpy": np.__version__},
        "settings": asdict(s), "seeds": seeds, "nodes": nodes, "ablation_nodes": ablation_nodes,
        "partitions": partitions, "rows": rows, "slowdowns": list(SLOWDOWNS), "links_mbit": list(LINKS_MBIT),
        "dlion_params": matrix.dlion_params(_ms(s)),
        "cost_model": asdict(named.model), "cost_model_name": named.name, "cost_model_source": named.source,
        "accuracy": "mean of the nodes' held-out accuracies (each node evaluates its own model); BSP: its model",
        "sweep_seconds": seconds, "jobs": args.jobs, "goals": verdicts, "runs": raw, "cells": cells,
        "tuning": None if tune is None else {
            **tune.to_json(), "choices": {f"{p}/{n}/{row}": rec for (p, n, row), rec in (tuned or {}).items()},
            "runs": tune_raw},
    }, indent=1, default=str))
    md_path = out.with_suffix(".md")
    marker = "<!-- generated below -->"
    head = md_path.read_text().split(marker)[0] if md_path.exists() and marker in md_path.read_text() else ""
    md_path.write_text(head + marker + "\n\n" + md)
    print(f"wrote {out.with_suffix('.json')}, {md_path}" + "".join(f", {p}" for p in pngs))


if __name__ == "__main__":
    main()
