"""EdgeGossip against plain gossip training (issue #16; SEEDS.md section 3), on the simulated clock.

Ten workers, one per device, at the ScaDLES stream rates ``92 38 62 42 48 88 90 22 44 28``
records/s times ``--scale`` (2, as benchmarks/strategies.py) with compute slowdowns
``1 1 1 2 2 2 4 4 8 8`` (the ``both`` regime of the strategy matrix), digits IID and
Dirichlet(0.3), the simulator's default cost model. Rows:

  bsp                 the reference: fixed batch 64 per device, waits for it, LR 0.3 on the aggregate
  gossip              decentralised SGD on a ring, Metropolis weights, fixed batch 64, LR 0.3 per
                      local step, asynchronous (max_lag unset: a worker mixes whatever it holds)
  edgegossip          balanced batches b_i = B_total r_i / sum r (B_total = 64 x N), data- and
                      accuracy-weighted mixing, plateau LR decay; window batcher (a step takes
                      up to b_i of the records waiting), asynchronous
  gossip[lag=L]       the same with ``max_lag = L``: a worker does not start iteration k+1 while
  edgegossip[lag=L]   a neighbour's model it holds is more than L iterations behind (L = 0:
                      neighbour-synchronous D-PSGD)

Accuracy of a serverless job: every worker evaluates its own model on the held-out set
every ``eval_every_s`` (``RunConfig.evaluate_workers``, as the live workers do, and as
EdgeGossip's accuracy-aware mixing needs), and the job's accuracy is the **mean of the
ten nodes' held-out accuracies** (what the fleet serves on average; BSP's replicas are
identical, so for it this is its model's accuracy). TTA: that mean at or above the target
for 3 consecutive evaluations. Final accuracy: the mean at ``--acc-budget`` (every run
lasts at least that long).

Per run: TTA, final accuracy, per node the idle fraction (split into blocked: a batch
ready but not allowed to train, i.e. waiting for peers; and starved: no data), the
iteration time mean and CV (after ``--warmup`` s), the CV across nodes of their mean
iteration times, the exact consensus distance over time (RMS distance of the workers'
models to their average), and bytes produced / consumed per node per iteration. A
second sweep measures traffic alone at N = 4, 8, 16 on ring, torus and complete graphs
(equal streams and speeds, IID, one seed: bytes do not depend on it) beside BSP:
point-to-point ``inbox`` messages cost a node O(in-degree x model) per iteration, BSP's
broadcast log O(N x model).

Figures are ratios against gossip (the baseline) on the same seed, medians over
``--repeats`` seeds with the min-max. Writes benchmarks/results/gossip.{json,md},
gossip_accuracy.png (accuracy vs time), gossip_consensus.png (consensus distance vs
time), gossip_traffic.png. Never asserts.

    python -m edgestream bench gossip [--repeats 3 | --seeds 0,1,2] [--jobs 1] [--budget 120] [--acc-budget 60]
        [--scale 2] [--partitions iid,dirichlet] [--lags 1] [--rows ...] [--topology ring] [--edge-window 0.3]
        [--quick] [--no-traffic] [--no-main] [--out PATH] [--log RUNS.jsonl [--resume]]
        [--cost-model default|edge-compute|edge-network|FILE.toml[:KEY=VALUE,...]]
        [--tune-lr [--lr-grid 0.5,1,2] [--tune-seed 1000]]

``--cost-model`` (docs/simclock.md, "Cost models"): its compute, latency and bandwidth replace
the default cost model's; the slowdowns stay unless it sets its own.

``--tune-lr`` (benchmarks/tuning.py, as ``bench strategies``): every row of the main comparison
(bsp and gossip included) per partition runs at each multiplier of ``--lr-grid`` on the tuning
seed (``--tune-seed``, default 1000 + the first seed, never a reporting seed), the chooser picks
one (smallest TTA; if all missed, accuracy at ``--acc-budget``, then loss; ties towards x1, then
the smaller), and the reporting seeds run at it: the ratios are against tuned gossip and tuned
BSP. The tuning runs go to the log too (``--resume`` reuses them). JSON: ``tuning`` (grid, seeds,
rule, ``choices`` by ``PARTITION/ROW``, the tuning runs) and each cell's ``tuning`` record; the
markdown has a table of the chosen multipliers. The traffic sweep is not tuned.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np

from edgestream.benchmarks import parallel, tuning
from edgestream.benchmarks import strategies as matrix  # strategies.py: BSP's row, censored medians
from edgestream.trainers import costmodels, simclock
from edgestream.trainers.evaluation import time_to_target

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BATCH = 64
WORKERS = 10
TRAFFIC_SIZES = (4, 8, 16)
TRAFFIC_TOPOLOGIES = ("ring", "torus", "complete")


@dataclass
class Settings:
    scale: float = 2.0
    budget_s: float = 120.0
    acc_budget_s: float = 60.0
    target: float = 0.9
    eval_every_s: float = 0.5
    message_interval_s: float = 0.05
    lr: float = 0.3
    momentum: float = 0.9
    topology: str = "ring"
    edge_window_s: float = 0.3
    warmup_s: float = 5.0
    repeats: int = 3
    first_seed: int = 0
    traffic_rate_hz: float = 100.0
    traffic_budget_s: float = 10.0


def row_names(lags: list[int]) -> list[str]:
    rows = ["bsp", "gossip", "edgegossip"]
    for lag in lags:
        rows += [f"gossip[lag={lag}]", f"edgegossip[lag={lag}]"]
    return rows


def _lag(row: str) -> int | None:
    return int(row.split("[lag=")[1].rstrip("]")) if "[lag=" in row else None


def mode_for(row: str, streams: simclock.StreamSet, s: Settings, topology: str | None = None) -> simclock.Mode:
    """One row's mode: benchmarks/strategies.py's bsp, gossip and edgegossip rows (``topology``
    replaces the graph, for the traffic sweep), with ``max_lag`` for the ``[lag=L]`` rows."""
    ms = replace(matrix.Settings(), lr=s.lr, momentum=s.momentum, gossip_topology=topology or s.topology,
                 edge_window_s=s.edge_window_s)
    modes = matrix.row_modes(streams, ms)
    base = row.split("[")[0]
    if base not in ("bsp", "gossip", "edgegossip"):
        raise ValueError(f"unknown row {row!r}")
    mode = modes[base]
    lag = _lag(row)
    if lag is not None:
        mode = replace(mode, name=row, strategy_params={**mode.strategy_params, "max_lag": lag})
    return mode


@lru_cache(maxsize=8)
def _streams(partition: str, seed: int, scale: float, interval: float, split: str = "seed") -> simclock.StreamSet:
    rates = simclock.scadles_rates(scale)
    return tuning.fleet_streams(split, rates, partition=partition, seed=seed, message_interval_s=interval)


# -- one run -----------------------------------------------------------------------------------


@dataclass
class Task:
    kind: str  # "main" or "traffic"
    partition: str
    seed: int
    row: str
    topology: str
    workers: int
    lr_mult: float = 1.0  # scales every learning rate of the row (--tune-lr; benchmarks/tuning.py)
    split: str = "seed"  # the test split and what the run is measured on (tuning.SPLITS)


def _cell(d: dict[str, Any]) -> tuple[Any, ...]:
    """A task's or run's cell: everything but the seed and the LR multiplier."""
    return (d["kind"], d["partition"], d["row"], d["topology"], d["workers"])


def _iteration_stats(starts: list[float], after: float) -> tuple[float, float, int]:
    """(mean, CV, count) of the intervals between step starts at or after ``after``."""
    kept = [t for t in starts if t >= after]
    mean, cv = simclock.interval_stats(kept)
    return mean, cv, max(0, len(kept) - 1)


def _node(p: simclock.ProcessReport, total_s: float, warmup_s: float) -> dict[str, Any]:
    mean, cv, count = _iteration_stats(p.step_starts, warmup_s)
    steps = max(1, p.local_steps)
    return {
        "name": p.name, "local_steps": p.local_steps,
        "idle": p.idle_fraction, "blocked": p.blocked_s / total_s if total_s else 0.0,
        "starved": p.starved_s / total_s if total_s else 0.0,
        "iteration_mean_s": mean, "iteration_cv": cv, "iterations_measured": count,
        "produced_per_iteration": sum(p.produced_bytes.values()) / steps,
        "consumed_per_iteration": sum(p.consumed_bytes.values()) / steps,
        "produced_bytes": p.produced_bytes, "consumed_bytes": p.consumed_bytes,
        "observations": {k: v for k, v in p.observations.items() if k in ("idle_fraction", "iteration_time_s",
                                                                         "iteration_time_cv", "neighbour_lag")},
    }


def run_task(task: Task, s: Settings, base: simclock.CostModel | None = None) -> dict[str, Any]:
    """One run; ``base``: the cost model (default ``CostModel()``), whose slowdowns, if it sets
    any, replace the main comparison's."""
    started = time.monotonic()
    base = simclock.CostModel() if base is None else base
    if task.kind == "traffic":
        streams = simclock.StreamSet.from_fleet("digits", (s.traffic_rate_hz,) * task.workers, partition="iid",
                                                seed=task.seed, message_interval_s=s.message_interval_s)
        config = simclock.RunConfig(model="mlp", lr=s.lr * task.lr_mult, momentum=s.momentum, seed=task.seed,
                                    eval_every_s=1.0, target_accuracy=None, time_budget_s=s.traffic_budget_s,
                                    evaluate_workers=True)
        costs = base
    else:
        streams = _streams(task.partition, task.seed, s.scale, s.message_interval_s, task.split)
        config = simclock.RunConfig(model="mlp", lr=s.lr * task.lr_mult, momentum=s.momentum, seed=task.seed,
                                    eval_every_s=s.eval_every_s, target_accuracy=s.target,
                                    time_budget_s=s.budget_s, min_time_s=s.acc_budget_s, evaluate_workers=True)
        costs = costmodels.with_worker_lists(base, matrix.SLOWDOWN)
    mode = tuning.scaled_mode(mode_for(task.row, streams, s, task.topology), task.lr_mult)
    report = simclock.run(mode, streams, costs, config)
    workers = [p for p in report.processes if p.name != simclock.SERVER_NAME]
    nodes = [_node(p, report.sim_time_s, s.warmup_s if task.kind == "main" else 1.0) for p in workers]
    means = [n["iteration_mean_s"] for n in nodes if n["iteration_mean_s"] > 0]
    acc = [(t, a) for t, a, _ in report.timeline]
    node_acc = {w: matrix.accuracy_at([(t, a, 0) for t, a in tl], s.acc_budget_s)
                for w, tl in report.worker_timelines.items()}
    return {
        **asdict(task), "settings": asdict(s), "cost_model": asdict(base),
        "lr": config.lr if mode.lr is None else mode.lr,
        "tta_s": report.tta_s, "acc_at_budget": matrix.accuracy_at(report.timeline, s.acc_budget_s),
        "loss_at_budget": matrix.loss_at(report.loss_timeline, s.acc_budget_s),
        "final_accuracy": report.final_accuracy, "sim_time_s": report.sim_time_s, "stopped": report.stopped,
        "node_acc_at_budget": node_acc,
        "w0_tta_s": time_to_target(report.worker_timelines.get("w0", []), s.target) if report.worker_timelines
        else None,
        "local_steps": report.local_steps, "bytes_sent": report.bytes_sent,
        "mean_staleness": report.mean_staleness, "max_staleness": report.max_staleness,
        "rejected_messages": report.rejected_messages, "rejected_steps": report.rejected_steps,
        "nodes": nodes,
        "idle_mean": statistics.fmean(n["idle"] for n in nodes),
        "idle_max": max(n["idle"] for n in nodes),
        "blocked_mean": statistics.fmean(n["blocked"] for n in nodes),
        "starved_mean": statistics.fmean(n["starved"] for n in nodes),
        "iteration_cv_mean": statistics.fmean(n["iteration_cv"] for n in nodes),
        "iteration_cv_max": max(n["iteration_cv"] for n in nodes),
        "cross_node_cv": statistics.pstdev(means) / statistics.fmean(means) if len(means) > 1 else 0.0,
        "consumed_per_iteration_mean": statistics.fmean(n["consumed_per_iteration"] for n in nodes),
        "consumed_per_iteration_max": max(n["consumed_per_iteration"] for n in nodes),
        "produced_per_iteration_mean": statistics.fmean(n["produced_per_iteration"] for n in nodes),
        "produced_per_iteration_max": max(n["produced_per_iteration"] for n in nodes),
        "accuracy_timeline": [(round(t, 3), round(a, 4)) for t, a in acc],
        "consensus_timeline": [(round(t, 3), float(f"{d:.5g}")) for t, d in report.consensus_timeline],
        "wall_s": time.monotonic() - started,
    }


def run_all(tasks: list[Task], s: Settings, jobs: int, log: Path | None = None,
            done: list[dict[str, Any]] | None = None, base: simclock.CostModel | None = None) -> list[dict[str, Any]]:
    """Every task's result; each one is also appended to ``log`` (JSON lines) as it ends, and
    tasks whose result is in ``done`` (an earlier log of the same settings) are not run again."""
    return run_logged(partial(run_task, base=base), tasks, s, jobs, log, done or [], _key, _line)


def same_cost_model(run: dict[str, Any], model: simclock.CostModel) -> bool:
    """A logged run was made with ``model`` (runs logged before the cost model was recorded
    were made with the default)."""
    recorded = run.get("cost_model", asdict(simclock.CostModel()))
    return json.loads(json.dumps(recorded)) == json.loads(json.dumps(asdict(model)))


def run_logged(run: Callable[[Any, Any], dict[str, Any]], tasks: list[Any], s: Any, jobs: int,
               log: Path | None, done: list[dict[str, Any]], key: Callable[[dict[str, Any]], tuple[Any, ...]],
               line: Callable[[int, int, dict[str, Any], float], str]) -> list[dict[str, Any]]:
    """``run(task, s)`` for every task not in ``done`` (by ``key``), in this process at
    ``jobs`` 1, else in a pool of spawned processes (one torch thread each); every result is
    appended to ``log`` as it ends and announced with ``line(i, count, result, begun)``.
    Returns the results (``done``'s included) in the order of ``tasks``."""
    have = {key(r): r for r in done}
    out: list[dict[str, Any]] = [have[key(asdict(t))] for t in tasks if key(asdict(t)) in have]
    todo = [t for t in tasks if key(asdict(t)) not in have]
    if out:
        print(f"reusing {len(out)} runs from the log, {len(todo)} to go", flush=True)
    begun = time.monotonic()

    def keep(i: int, result: dict[str, Any]) -> None:
        out.append(result)
        if log is not None:
            with log.open("a") as f:
                f.write(json.dumps(result, default=str) + "\n")
        print(line(i, len(todo), result, begun), flush=True)

    parallel.map_in_order(partial(run, s=s), todo, jobs, keep)
    order = {key(asdict(t)): i for i, t in enumerate(tasks)}
    return sorted(out, key=lambda r: order[key(r)])


def _key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["kind"], r["partition"], r["seed"], r["row"], r["topology"], r["workers"], r.get("lr_mult", 1.0),
            r.get("split", "seed"))


def _line(i: int, n: int, r: dict[str, Any], begun: float) -> str:
    elapsed = time.monotonic() - begun
    eta = elapsed / i * (n - i)
    if r["kind"] == "traffic":
        what = (f"traffic N={r['workers']} {r['topology']} {r['row']}: consumed "
                f"{r['consumed_per_iteration_mean'] / 1e3:.1f} kB/node/iteration (max "
                f"{r['consumed_per_iteration_max'] / 1e3:.1f}), produced {r['produced_per_iteration_mean'] / 1e3:.1f}")
    else:
        lr = f" lr x{r['lr_mult']:g} ({r['lr']:.3g})" if r.get("lr_mult", 1.0) != 1.0 else ""
        what = (f"{r['partition']} seed {r['seed']} {r['row']}{lr}: TTA {_s(r['tta_s'])}, acc@budget "
                f"{_f3(r['acc_at_budget'])}, idle {r['idle_mean']:.0%} (blocked {r['blocked_mean']:.0%}), "
                f"iteration CV {r['iteration_cv_mean']:.2f}, across nodes {r['cross_node_cv']:.2f}")
    return f"[{i}/{n}] {what} ({r['wall_s']:.1f} s; {elapsed / 60:.1f} min so far, ~{eta / 60:.1f} min left)"


def _s(v: float | None) -> str:
    return "missed" if v is None else f"{v:.1f} s"


def _f3(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


# -- summary -------------------------------------------------------------------------------------


def _spread(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    text = fmt.format(med)
    if len(values) > 1 and not math.isclose(min(values), max(values)):
        text += f" ({fmt.format(min(values))}-{fmt.format(max(values))})"
    return text


def summarise(raw: list[dict[str, Any]], s: Settings, rows: list[str], partitions: list[str],
              tuned: dict[tuple[Any, ...], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per partition and row: medians over the seeds (``tuned``: each cell's tuning record,
    by :func:`_cell`)."""
    main = [r for r in raw if r["kind"] == "main"]
    by = {(r["partition"], r["seed"], r["row"]): r for r in main}
    seeds = sorted({r["seed"] for r in main})
    cells: dict[str, Any] = {}
    for partition in partitions:
        for row in rows:
            runs = [by[(partition, seed, row)] for seed in seeds if (partition, seed, row) in by]
            if not runs:
                continue
            base_row = _baseline(row)
            vs_gossip, speedup, acc_gap = [], [], []
            for r in runs:
                base = by.get((partition, r["seed"], base_row))
                if base is None:
                    continue
                ratio = matrix.censored_ratio(r["tta_s"], base["tta_s"], s.budget_s)
                vs_gossip.append(ratio)
                if ratio is not None:
                    inv = {"=": "=", ">": "<", "<": ">"}[ratio["bound"]]
                    speedup.append({"value": 1 / ratio["value"], "bound": inv})
                if r["acc_at_budget"] is not None and base["acc_at_budget"] is not None:
                    acc_gap.append(100 * (r["acc_at_budget"] - base["acc_at_budget"]))
            bsp = [by.get((partition, r["seed"], "bsp")) for r in runs]
            vs_bsp = [matrix.censored_ratio(r["tta_s"], b["tta_s"], s.budget_s) for r, b in zip(runs, bsp, strict=True)
                      if b is not None]
            cells[f"{partition}/{row}"] = {
                "partition": partition, "row": row, "seeds": len(runs), "baseline": base_row,
                "tta_s": [r["tta_s"] for r in runs],
                "tta_median": matrix.censored_median([r["tta_s"] for r in runs], s.budget_s),
                "speedup_vs_baseline": speedup, "speedup_median": matrix.median_bound(speedup),
                "vs_bsp": vs_bsp, "vs_bsp_median": matrix.median_bound(vs_bsp),
                "acc": [r["acc_at_budget"] for r in runs],
                "acc_gap_points": acc_gap,
                "idle_mean": [r["idle_mean"] for r in runs], "idle_max": [r["idle_max"] for r in runs],
                "blocked_mean": [r["blocked_mean"] for r in runs], "starved_mean": [r["starved_mean"] for r in runs],
                "iteration_cv_mean": [r["iteration_cv_mean"] for r in runs],
                "iteration_cv_max": [r["iteration_cv_max"] for r in runs],
                "cross_node_cv": [r["cross_node_cv"] for r in runs],
                "consumed_per_iteration": [r["consumed_per_iteration_mean"] for r in runs],
                "produced_per_iteration": [r["produced_per_iteration_mean"] for r in runs],
                "consensus_at_budget": [_at(r["consensus_timeline"], s.acc_budget_s) for r in runs],
                "local_steps": [r["local_steps"] for r in runs],
                "lr_mult": runs[0].get("lr_mult", 1.0), "lr": runs[0].get("lr"),
                "tuning": (tuned or {}).get(_cell(runs[0])),
            }
    return cells


def _baseline(row: str) -> str:
    """Each row's baseline: plain gossip in the same mode (async or the same lag)."""
    lag = _lag(row)
    return "gossip" if lag is None else f"gossip[lag={lag}]"


def _at(timeline: list[list[float]] | list[tuple[float, float]], t: float) -> float | None:
    best = None
    for at, v in timeline:
        if at <= t + 1e-9:
            best = v
    return best


def main_markdown(cells: dict[str, Any], s: Settings, rows: list[str], partitions: list[str], seeds: list[int],
                  seconds: float, costs: costmodels.NamedCostModel | None = None) -> str:
    named = costs or costmodels.PRESETS["default"]
    d = named.model
    rates = " ".join(f"{r:g}" for r in simclock.scadles_rates(s.scale))
    lines = [
        f"Simulated clock (trainers/simclock.py; {named.name} cost model: step ({d.compute_base_s * 1e3:g} ms + "
        f"{d.compute_per_record_s * 1e3:g} ms/record) x slowdown, {d.latency_s * 1e3:g} ms latency, "
        f"{d.bandwidth_bytes_per_s * 8 / 1e6:g} Mbit/s links), digits MLP (held-out 20 %), {WORKERS} workers one per "
        f"device, rates {rates} records/s (ScaDLES x {s.scale:g}), slowdowns "
        f"{' '.join(f'{x:g}' for x in matrix.SLOWDOWN)}; LR {s.lr:g}, momentum {s.momentum:g}; gossip rows on a "
        f"{s.topology}; edgegossip: window batcher ({s.edge_window_s:g} s windows), B_total = {BATCH} x {WORKERS}, "
        f"b_i in [4, 256] (rows as in benchmarks/strategies.py). Accuracy = the mean of the {WORKERS} nodes' held-out accuracies (each node "
        f"evaluates its own model every {s.eval_every_s:g} s); target {s.target:.0%} held for 3 evaluations; budget "
        f"{s.budget_s:g} s; final accuracy read at {s.acc_budget_s:g} s. Seeds {', '.join(map(str, seeds))}; medians "
        f"(min-max). Idle and iteration times are per node, averaged over the nodes; iteration times after "
        f"{s.warmup_s:g} s. About {seconds / 60:.0f} min for the sweep (run wall times summed / processes).",
    ]
    for partition in partitions:
        lines += ["", f"### {partition}", "",
                  "| row | TTA s | speed-up vs gossip (same mode) | TTA / BSP | acc @ budget | acc - gossip (points) "
                  "| idle (mean / max node) | blocked / starved | iteration CV (mean / max node) | CV across nodes "
                  "| kB consumed / node / iteration | consensus distance @ budget |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in rows:
            c = cells.get(f"{partition}/{row}")
            if c is None:
                continue
            base = row == c["baseline"]
            lines.append(
                f"| {row} | {matrix._cell(c['tta_median'], 1)} "
                f"| {'(baseline)' if base else _speed(c['speedup_median'])} "
                f"| {matrix._cell(c['vs_bsp_median']) if row != 'bsp' else '1'} "
                f"| {_spread([a for a in c['acc'] if a is not None], '{:.3f}')} "
                f"| {'-' if base else _spread(c['acc_gap_points'], '{:+.1f}')} "
                f"| {_spread(c['idle_mean'], '{:.0%}')} / {_spread(c['idle_max'], '{:.0%}')} "
                f"| {_spread(c['blocked_mean'], '{:.0%}')} / {_spread(c['starved_mean'], '{:.0%}')} "
                f"| {_spread(c['iteration_cv_mean'])} / {_spread(c['iteration_cv_max'])} "
                f"| {_spread(c['cross_node_cv'])} "
                f"| {_spread([v / 1e3 for v in c['consumed_per_iteration']], '{:.1f}')} "
                f"| {_spread([v for v in c['consensus_at_budget'] if v is not None], '{:.3g}')} |")
    lines += ["", "Speed-up = gossip's TTA / the row's on the same seed (the baseline is plain gossip in the same "
              "mode: asynchronous, or the same max_lag); `>x` / `<x`: censored at the budget (one of the two missed). "
              "Idle = blocked (a batch ready, not allowed to train: waiting for peers) + starved (no data ready)."]
    return "\n".join(lines)


def _speed(m: dict[str, Any] | None) -> str:
    if m is None:
        return "both missed"
    return matrix._cell(m) + "x"


def node_markdown(raw: list[dict[str, Any]], rows: list[str], partition: str, seed: int) -> str:
    lines = [f"### Per node ({partition}, seed {seed}): idle fraction (blocked + starved) and iteration time "
             "(mean s, CV)", "",
             "| row | " + " | ".join(f"w{i} (x{matrix.SLOWDOWN[i]:g})" for i in range(WORKERS)) + " |",
             "|---|" + "---:|" * WORKERS]
    for row in rows:
        r = next((x for x in raw if x["kind"] == "main" and x["partition"] == partition and x["seed"] == seed
                  and x["row"] == row), None)
        if r is None:
            continue
        lines.append(f"| {row} | " + " | ".join(
            f"{n['idle']:.0%} ({n['blocked']:.0%}+{n['starved']:.0%}), {n['iteration_mean_s']:.2f} s, "
            f"{n['iteration_cv']:.2f}" for n in r["nodes"]) + " |")
    return "\n".join(lines)


def traffic_markdown(raw: list[dict[str, Any]], s: Settings) -> str:
    runs = [r for r in raw if r["kind"] == "traffic"]
    if not runs:
        return ""
    sizes = sorted({r["workers"] for r in runs})
    lines = [f"### Traffic per node per iteration (simulated clock, N devices at {s.traffic_rate_hz:g} records/s each, "
             f"compute all 1, IID, {s.traffic_budget_s:g} s, seed {runs[0]['seed']}): kB consumed (produced), mean over "
             "nodes (max node)", "",
             "| row | topology | " + " | ".join(f"N = {n}" for n in sizes) + " |",
             "|---|---|" + "---:|" * len(sizes)]
    keys = list(dict.fromkeys((r["row"], r["topology"]) for r in runs))
    for row, topo in keys:
        parts = []
        for n in sizes:
            r = next((x for x in runs if x["row"] == row and x["topology"] == topo and x["workers"] == n), None)
            parts.append("-" if r is None else
                         f"{r['consumed_per_iteration_mean'] / 1e3:.1f} ({r['produced_per_iteration_mean'] / 1e3:.1f}) "
                         f"max {r['consumed_per_iteration_max'] / 1e3:.1f}")
        lines.append(f"| {row} | {topo if row != 'bsp' else '(broadcast log)'} | " + " | ".join(parts) + " |")
    lines += ["", "A gossip node fetches only its own inbox topic: its neighbours' models/deltas (one dense MLP "
              "delta is about 19.7 kB), O(in-degree x model) per iteration whatever N; a BSP worker fetches every "
              "gradient of the job's one log: O(N x model)."]
    return "\n".join(lines)


def goals(cells: dict[str, Any], partitions: list[str], lags: list[int]) -> list[str]:
    out = []
    for partition in partitions:
        for mode, suffix in [("asynchronous", "")] + [(f"max_lag={lag}", f"[lag={lag}]") for lag in lags]:
            edge = cells.get(f"{partition}/edgegossip{suffix}")
            if edge is None:
                continue
            sp = edge["speedup_median"]
            verdict = []
            if sp is None:
                verdict.append("speed-up: both missed the target")
            else:
                met = sp["value"] >= 2.7 and sp["bound"] in ("=", ">")
                verdict.append(f"TTA {matrix._cell(sp)}x sooner than gossip ({'met' if met else 'not met'}: >= 2.7x)")
            gaps = edge["acc_gap_points"]
            if gaps:
                gap = statistics.median(gaps)
                verdict.append(f"final accuracy {gap:+.2f} points vs gossip ({'met' if gap >= -0.8 else 'not met'}: "
                               ">= -0.8)")
            idle = statistics.median(edge["idle_mean"])
            blocked = statistics.median(edge["blocked_mean"])
            verdict.append(f"idle {idle:.0%} of which blocked on peers {blocked:.0%} "
                           f"({'met' if idle < 0.10 else 'not met'}: < 10 %)")
            cv = statistics.median(edge["iteration_cv_mean"])
            cross = statistics.median(edge["cross_node_cv"])
            verdict.append(f"iteration-time CV per node {cv:.2f}, across nodes {cross:.2f} "
                           f"({'met' if max(cv, cross) < 0.2 else 'not met'}: < 0.2)")
            out.append(f"{partition}, {mode}: " + "; ".join(verdict))
    return out


# -- plots ---------------------------------------------------------------------------------------


def plots(raw: list[dict[str, Any]], rows: list[str], partitions: list[str], s: Settings, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = [r for r in raw if r["kind"] == "main"]
    paths = []
    for key, name, ylabel, log in (("accuracy_timeline", "accuracy", "held-out accuracy (mean of the nodes)", False),
                                   ("consensus_timeline", "consensus", "consensus distance (RMS to the average model)",
                                    True)):
        fig, axes = plt.subplots(1, len(partitions), figsize=(6 * len(partitions), 4.2), squeeze=False)
        for ax, partition in zip(axes[0], partitions, strict=True):
            for row in rows:
                if key == "consensus_timeline" and row == "bsp":
                    continue  # identical replicas: 0
                runs = [r for r in main if r["partition"] == partition and r["row"] == row]
                if not runs:
                    continue
                n = min(len(r[key]) for r in runs)
                t = np.array([p[0] for p in runs[0][key][:n]])
                v = np.array([[p[1] for p in r[key][:n]] for r in runs])
                colour = f"C{rows.index(row) % 10}"  # the same colour per row in every plot
                ax.plot(t, np.median(v, axis=0), label=row, lw=1.3, color=colour,
                        ls="--" if "[lag=" in row else "-")
                ax.fill_between(t, v.min(axis=0), v.max(axis=0), color=colour, alpha=0.12)
            if key == "accuracy_timeline":
                ax.axhline(s.target, color="grey", ls=":", lw=1)
                ax.set_ylim(0.0, 1.0)
            if log:
                ax.set_yscale("log")
            ax.set_xlim(0, s.acc_budget_s)
            ax.set_xlabel("simulated time (s)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{partition}: median of {len(runs)} seeds, min-max band", fontsize=9)
            ax.legend(fontsize=7)
        fig.suptitle(f"Simulated clock, {WORKERS} workers, ScaDLES rates x{s.scale:g}, slowdowns 1 1 1 2 2 2 4 4 8 8",
                     fontsize=10)
        path = out.parent / f"{out.name}_{name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    traffic = [r for r in raw if r["kind"] == "traffic"]
    if traffic:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for row, topo in dict.fromkeys((r["row"], r["topology"]) for r in traffic):
            pts = sorted((r["workers"], r["consumed_per_iteration_mean"] / 1e3) for r in traffic
                         if r["row"] == row and r["topology"] == topo)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=row if row == "bsp" else f"{row} {topo}")
        ax.set_xlabel("nodes N")
        ax.set_ylabel("kB consumed per node per iteration")
        ax.set_xticks(sorted({r["workers"] for r in traffic}))
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.set_title("Simulated clock: download per node per iteration", fontsize=9)
        path = out.parent / f"{out.name}_traffic.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


# -- main ------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=Settings.repeats, help="seeds (medians and min-max)")
    parser.add_argument("--seeds", help="comma list of seeds (replaces --repeats; default 0 .. repeats - 1)")
    parser.add_argument("--jobs", type=int, default=1, help="simulations in parallel")
    parser.add_argument("--budget", type=float, default=Settings.budget_s, help="simulated seconds per run at most")
    parser.add_argument("--acc-budget", type=float, default=Settings.acc_budget_s,
                        help="final accuracy read at this simulated time (runs last at least this long)")
    parser.add_argument("--scale", type=float, default=Settings.scale, help="multiplies the ScaDLES rates")
    parser.add_argument("--partitions", default="iid,dirichlet", help="comma list of iid, dirichlet")
    parser.add_argument("--lags", default="1", help="comma list of max_lag values for the bounded-lag rows ('' none)")
    parser.add_argument("--rows", help="comma list of rows (default: bsp, gossip, edgegossip and the lag rows)")
    parser.add_argument("--topology", default=Settings.topology, help="graph of the main comparison")
    parser.add_argument("--edge-window", type=float, default=Settings.edge_window_s,
                        help="edgegossip's batching window (s)")
    parser.add_argument("--traffic-sizes", default=",".join(map(str, TRAFFIC_SIZES)), help="N of the traffic sweep")
    parser.add_argument("--no-traffic", action="store_true", help="skip the traffic sweep")
    parser.add_argument("--no-main", action="store_true", help="only the traffic sweep")
    parser.add_argument("--quick", action="store_true",
                        help="one seed, IID only, 40 s budget, accuracy at 30 s, traffic at N = 4, 8 (a smoke run)")
    parser.add_argument("--cost-model", default="default", metavar="SPEC",
                        help="the cost model (trainers/costmodels.py): a preset (" + ", ".join(costmodels.PRESETS)
                             + "), a .toml file, either with :KEY=VALUE,... overrides; its compute, latency and "
                               "bandwidth replace the default's, the slowdowns stay unless it sets its own")
    parser.add_argument("--out", default=str(RESULTS / "gossip"), help="output path without suffix")
    parser.add_argument("--log", help="append every finished run to this JSON-lines file "
                                      "(default: $TMPDIR/edgestream-bench-NAME.runs.jsonl)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the runs already in the log (same settings) instead of running them again")
    tuning.add_arguments(parser)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    s = Settings(budget_s=args.budget, acc_budget_s=min(args.acc_budget, args.budget), repeats=args.repeats,
                 scale=args.scale, topology=args.topology, edge_window_s=args.edge_window)
    partitions = [p for p in args.partitions.split(",") if p]
    sizes = [int(x) for x in args.traffic_sizes.split(",") if x]
    if args.quick:
        s = replace(s, repeats=1, budget_s=40.0, acc_budget_s=30.0)
        partitions = ["iid"]
        sizes = [4, 8]
    lags = [int(x) for x in args.lags.split(",") if x]
    rows = [r for r in args.rows.split(",") if r] if args.rows else row_names(lags)
    for needed in ("gossip", *[f"gossip[lag={lag}]" for lag in lags if f"edgegossip[lag={lag}]" in rows]):
        if needed not in rows:
            rows.insert(1, needed)  # every figure is a ratio against gossip in the same mode
    seeds = [s.first_seed + i for i in range(s.repeats)]
    if args.seeds:
        seeds = [int(x) for x in args.seeds.split(",") if x]
        s = replace(s, repeats=len(seeds), first_seed=seeds[0])
    tune = tuning.from_args(parser, args, seeds)
    if tune is not None and args.no_main:
        parser.error("--tune-lr tunes the main comparison's rows: not with --no-main (the traffic sweep is not tuned)")
    named = matrix.resolve_cost_model(parser, args.cost_model, (WORKERS, *([] if args.no_traffic else sizes)))
    tasks: list[Task] = []
    if not args.no_main:
        # Interleaved: every row of a (partition, seed) back to back.
        tasks += [Task("main", p, seed, row, s.topology, WORKERS) for seed in seeds for p in partitions
                   for row in rows]
    if not args.no_traffic:
        for n in sizes:
            tasks.append(Task("traffic", "iid", s.first_seed, "bsp", "ring", n))
            for topo in TRAFFIC_TOPOLOGIES:
                for row in ("gossip", "edgegossip"):
                    tasks.append(Task("traffic", "iid", s.first_seed, row, topo, n))
    log = Path(args.log) if args.log else Path(tempfile.gettempdir()) / f"edgestream-bench-{Path(args.out).name}.runs.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    done = []
    if args.resume and log.exists():
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        done = [r for r in lines if r.get("settings") == asdict(s) and same_cost_model(r, named.model)]
    elif log.exists():
        log.unlink()
    tuned, tune_raw = None, []
    if tune is not None:
        # Every main row (gossip and BSP included) on the tuning seeds at each multiplier, then the
        # reporting seeds at the chosen one; logged (and resumed) like the rest.
        tune_raw, tuned = tuning.tune_cells([t for t in tasks if t.kind == "main"], tune, _cell,
                                            lambda grid: run_all(grid, s, args.jobs, log, done, named.model),
                                            lambda key: f"{key[1]} {key[2]}")
        tasks = tuning.at_chosen(tasks, tuned, _cell)
    print(f"{len(tasks)} simulated runs on {args.jobs} process(es) ...", flush=True)
    raw = run_all(tasks, s, args.jobs, log, done, named.model)
    seconds = sum(r["wall_s"] for r in raw) / max(1, args.jobs)  # also right for resumed runs
    cells = summarise(raw, s, rows, partitions, tuned)
    verdicts = goals(cells, partitions, lags)
    md = ""
    if not args.no_main:
        md += main_markdown(cells, s, rows, partitions, seeds, seconds, named)
        if tune is not None:
            md += "\n\n" + "\n".join(tuning.markdown_table(
                {(row, p): cells[f"{p}/{row}"]["tuning"] for p in partitions for row in rows
                 if cells.get(f"{p}/{row}", {}).get("tuning")}, rows, partitions, tune))
        for partition in partitions:
            md += "\n\n" + node_markdown(raw, rows, partition, seeds[0])
    if not args.no_traffic:
        md += "\n\n" + traffic_markdown(raw, s)
    print(md)
    print("\n".join(f"- {v}" for v in verdicts))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pngs = plots(raw, rows, partitions, s, out) if not args.no_main else []
    import torch

    out.with_suffix(".json").write_text(json.dumps({
        "benchmark": "gossip", "clock": "simulated",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "processor": platform.processor()},
        "versions": {"torch": torch.__version__, "numpy": np.__version__},
        "settings": asdict(s), "seeds": seeds, "partitions": partitions, "rows": rows, "lags": lags,
        "slowdowns": list(matrix.SLOWDOWN), "rates": list(simclock.scadles_rates(s.scale)),
        "cost_model": asdict(named.model), "cost_model_name": named.name, "cost_model_source": named.source,
        "accuracy": "mean of the nodes' held-out accuracies (each node evaluates its own model)",
        "sweep_seconds": seconds, "jobs": args.jobs, "goals": verdicts,
        "runs": raw, "cells": cells,
        "tuning": None if tune is None else {
            **tune.to_json(), "choices": {f"{k[1]}/{k[2]}": rec for k, rec in (tuned or {}).items()},
            "runs": tune_raw},
    }, indent=1, default=str))
    md_path = out.with_suffix(".md")
    marker = "<!-- generated below -->"
    head = ""
    if md_path.exists() and marker in md_path.read_text():
        head = md_path.read_text().split(marker)[0]
    md_path.write_text(head + marker + "\n\n## EdgeGossip vs gossip (simulated clock)\n\n" + md
                       + "\n\n### Goals (issue #16, from the medians above)\n\n" + "\n".join(f"- {v}" for v in verdicts)
                       + "\n")
    print(f"wrote {out.with_suffix('.json')}, {md_path}" + "".join(f", {p}" for p in pngs))


if __name__ == "__main__":
    main()
