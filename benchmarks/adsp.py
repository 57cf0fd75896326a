"""ADSP under compute heterogeneity (issue #15; SEEDS.md section 2), on the simulated clock.

Ten workers (one per device) train the digits MLP; every device streams fast enough that
every worker is compute-bound (the ADSP paper's setting: speed is compute speed, data is
never the bottleneck). Compute heterogeneity ``H = sum(speed) / (N * min(speed))`` with
``speed = 1 / slowdown`` is set by slowing half the workers down by ``k = 2 H - 1``
(five at 1, five at k: ``H = (1 + k) / 2``):

  H = 1.0   slowdowns 1 x 10
  H = 1.45  five at 1, five at 1.9
  H = 2.2   five at 1, five at 3.4
  H = 3.2   five at 1, five at 5.4

Rows: adsp, bsp, ssp(s=3), ssp(s=40), localsgd, asp, configured exactly as in
``benchmarks/strategies.py`` (same LR rule, batch 64 per step). Figures, per H: time to a
target held-out loss and to a target held-out accuracy (each held for 3 evaluations), as
a ratio to BSP's on the same seed; accuracy at a fixed time budget; for adsp the
coefficient of variation of the per-worker commit counts (commits per check period).
Medians over ``--repeats`` seeds with the min-max. Plots: held-out loss vs simulated time
per strategy at the largest H, and speed-up over BSP vs H. Writes
benchmarks/results/adsp.{json,md} and adsp_loss.png, adsp_speedup.png. Never asserts.

    python -m edgestream bench adsp [--repeats 3] [--jobs 2] [--budget 60] [--acc-budget 30]
        [--levels 1.0,1.45,2.2,3.2] [--rows adsp,bsp,...] [--adsp period_s=10,commit_rate=10]
        [--cost-model default|edge-compute|edge-network|FILE.toml[:KEY=VALUE,...]]
        [--tune-lr [--lr-grid 0.5,1,2] [--tune-seed 1000]]

``--cost-model`` (docs/simclock.md, "Cost models"): its compute, latency and bandwidth replace
the default cost model's; each level's slowdowns stay unless it sets its own.

``--tune-lr`` (benchmarks/tuning.py, as ``bench strategies``): every (H, row) cell, bsp and the
``adsp[C=k]`` ablation included, runs at each multiplier of ``--lr-grid`` on the tuning seed
(``--tune-seed``, default 1000 + the first seed, never a reporting seed); the chooser picks one
by time to the target **accuracy** (if all missed: accuracy at ``--acc-budget``, then loss;
ties towards x1, then the smaller), and the reporting seeds run at it, so both the loss and the
accuracy ratios are against tuned BSP. A multiplier scales each row's own LR rule (ADSP's and
local SGD's local LR, ASP's and SSP's per-update LR). JSON: ``tuning`` (grid, seeds, rule,
``choices`` by ``H/ROW``, the tuning runs) and each cell's ``tuning`` record; the markdown has a
table of the chosen multipliers.
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
import time
from dataclasses import asdict, dataclass, replace
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np

from edgestream.benchmarks import parallel, tuning
from edgestream.benchmarks import strategies as matrix  # strategies.py: the rows' configurations
from edgestream.trainers import costmodels, simclock
from edgestream.trainers.evaluation import time_to_target

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LEVELS = (1.0, 1.45, 2.2, 3.2)
ROWS = ("adsp", "bsp", "ssp(s=3)", "ssp(s=40)", "localsgd", "asp")
WORKERS = 10


def slowdowns(h: float, n: int = WORKERS) -> tuple[float, ...]:
    """Half the workers at 1, half at ``k = 2 H - 1`` (so ``H = (1 + k) / 2`` for even ``n``)."""
    k = 2.0 * h - 1.0
    return (1.0,) * (n - n // 2) + (round(k, 6),) * (n // 2)


def heterogeneity(slow: tuple[float, ...]) -> float:
    speeds = [1.0 / x for x in slow]
    return sum(speeds) / (len(speeds) * min(speeds))


@dataclass
class Settings:
    rate_hz: float = 600.0  # per device: > 64 records / 138 ms (the fastest step), so no worker starves
    buffer_capacity: int = 2048  # truncate: a device keeps at most this many waiting records (drops counted)
    budget_s: float = 60.0
    acc_budget_s: float = 30.0
    target_accuracy: float = 0.9
    target_loss: float = 0.3
    eval_every_s: float = 0.25
    message_interval_s: float = 0.05
    lr: float = 0.3
    momentum: float = 0.9
    partition: str = "iid"
    repeats: int = 3
    first_seed: int = 0
    adsp_period_s: float = 10.0
    adsp_commit_rate: int = 10
    adsp_min_interval_s: float = 0.2


def matrix_settings(s: Settings) -> matrix.Settings:
    return replace(matrix.Settings(), lr=s.lr, momentum=s.momentum, budget_s=s.budget_s, acc_budget_s=s.acc_budget_s,
                   eval_every_s=s.eval_every_s, message_interval_s=s.message_interval_s,
                   adsp_period_s=s.adsp_period_s, adsp_commit_rate=s.adsp_commit_rate,
                   adsp_min_interval_s=s.adsp_min_interval_s)


@lru_cache(maxsize=4)
def _streams(seed: int, s_key: tuple, split: str = "seed") -> simclock.StreamSet:
    rate, partition, interval = s_key
    return tuning.fleet_streams(split, (rate,) * WORKERS, partition=partition, seed=seed, message_interval_s=interval)


def mode_for(row: str, streams: simclock.StreamSet, s: Settings) -> simclock.Mode:
    """A row of benchmarks/strategies.py; ``adsp[C=k]`` is adsp starting from ``C = k``."""
    if row.startswith("adsp[C="):
        c = int(row[len("adsp[C="):-1])
        mode = matrix.row_modes(streams, replace(matrix_settings(s), adsp_commit_rate=c))["adsp"]
        mode = replace(mode, name=row)
    else:
        mode = matrix.row_modes(streams, matrix_settings(s))[row]
    return replace(mode, buffer_policy="truncate", buffer_capacity=s.buffer_capacity)


@dataclass
class Task:
    h: float
    seed: int
    row: str
    lr_mult: float = 1.0  # scales every learning rate of the row (--tune-lr; benchmarks/tuning.py)
    split: str = "seed"  # the test split and what the run is measured on (tuning.SPLITS)


def _cell(d: dict[str, Any]) -> tuple[Any, ...]:
    """A task's or run's tuning cell: H and row."""
    return (d["h"], d["row"])


def run_task(task: Task, s: Settings, base: simclock.CostModel | None = None) -> dict[str, Any]:
    """One run; ``base``: the cost model (default ``CostModel()``), whose slowdowns, if it sets
    any, replace the level's."""
    started = time.monotonic()
    streams = _streams(task.seed, (s.rate_hz, s.partition, s.message_interval_s), task.split)
    config = simclock.RunConfig(model="mlp", lr=s.lr * task.lr_mult, momentum=s.momentum, seed=task.seed,
                                eval_every_s=s.eval_every_s, target_accuracy=s.target_accuracy,
                                stop_at_target=False, time_budget_s=s.budget_s)
    costs = costmodels.with_worker_lists(simclock.CostModel() if base is None else base, slowdowns(task.h))
    mode = tuning.scaled_mode(mode_for(task.row, streams, s), task.lr_mult)
    report = simclock.run(mode, streams, costs, config)
    acc = [(t, a) for t, a, _ in report.timeline]
    loss = report.loss_timeline
    counters = (report.server or {}).get("counters", {})
    commits = [counters.get(f"commits:w{i}", 0) for i in range(WORKERS)] if task.row.startswith("adsp") else None
    return {
        **asdict(task), "slowdowns": list(slowdowns(task.h)), "lr": config.lr if mode.lr is None else mode.lr,
        "tta_s": report.tta_s,
        "ttl_s": time_to_target([(t, -v) for t, v in loss], -s.target_loss),
        "acc_at_budget": _at(acc, s.acc_budget_s), "loss_at_budget": _at(loss, s.acc_budget_s),
        "final_accuracy": report.final_accuracy, "steps": report.steps, "local_steps": report.local_steps,
        "trained_per_worker": [d.trained for d in report.devices],
        "dropped": sum(d.dropped for d in report.devices),
        "mean_staleness": report.mean_staleness, "max_staleness": report.max_staleness,
        "bytes_sent": report.bytes_sent, "server": counters or None,
        "commits_per_worker": commits, "commit_cv": _cv(commits) if commits else None,
        "accuracy_timeline": [(round(t, 3), round(a, 4)) for t, a in acc],
        "loss_timeline": [(round(t, 3), round(v, 5)) for t, v in loss],
        "wall_s": time.monotonic() - started,
    }


def _at(timeline: list[tuple[float, float]], t: float) -> float | None:
    best = None
    for at, v in timeline:
        if at <= t + 1e-9:
            best = v
    return best


def _cv(values: list[int]) -> float:
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean else math.inf


def run_all(tasks: list[Task], s: Settings, jobs: int, base: simclock.CostModel | None = None,
            label: str = "") -> list[dict[str, Any]]:
    """Every task's run, in the order of ``tasks`` (benchmarks/parallel.py), a line per run as it ends."""
    return parallel.map_in_order(partial(run_task, s=s, base=base), tasks, jobs,
                                 lambda i, r: print(label + _line(i, len(tasks), r), flush=True))


def _line(i: int, n: int, r: dict[str, Any]) -> str:
    extra = f", commits CV {r['commit_cv']:.1%} {r['commits_per_worker']}" if r["commit_cv"] is not None else ""
    lr = f" lr x{r['lr_mult']:g} ({r['lr']:.3g})" if r.get("lr_mult", 1.0) != 1.0 else ""
    return (f"[{i}/{n}] H {r['h']:g} seed {r['seed']} {r['row']}{lr}: time to loss {_s(r['ttl_s'])}, to accuracy "
            f"{_s(r['tta_s'])}, acc@{'budget'} {_f3(r['acc_at_budget'])}, version {r['steps']}{extra} "
            f"({r['wall_s']:.1f} s)")


def _s(v: float | None) -> str:
    return "missed" if v is None else f"{v:.2f} s"


def _f3(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


# -- summary ---------------------------------------------------------------------------------


def summarise(raw: list[dict[str, Any]], s: Settings, levels: list[float], rows: list[str],
              tuned: dict[tuple[Any, ...], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per H and row: medians over the seeds and ratios to BSP on the same seed (``tuned``:
    each cell's tuning record, by :func:`_cell`)."""
    by = {(r["h"], r["seed"], r["row"]): r for r in raw}
    seeds = sorted({r["seed"] for r in raw})
    cells: dict[str, Any] = {}
    for h in levels:
        for row in rows:
            runs = [by[(h, seed, row)] for seed in seeds if (h, seed, row) in by]
            if not runs:
                continue
            cell: dict[str, Any] = {"h": h, "row": row, "seeds": len(runs)}
            for key in ("ttl_s", "tta_s"):
                values = [r[key] for r in runs]
                ratios = []
                for r in runs:
                    bsp = by.get((h, r["seed"], "bsp"))
                    ratios.append(matrix.censored_ratio(r[key], bsp[key] if bsp else None, s.budget_s))
                cell[key] = values
                cell[f"{key}_median"] = matrix.censored_median(values, s.budget_s)
                cell[f"{key}_vs_bsp"] = ratios
                cell[f"{key}_vs_bsp_median"] = matrix.median_bound(ratios)
            accs = [r["acc_at_budget"] for r in runs if r["acc_at_budget"] is not None]
            cell["acc_at_budget"] = accs
            cell["acc_median"] = statistics.median(accs) if accs else None
            cvs = [r["commit_cv"] for r in runs if r["commit_cv"] is not None]
            cell["commit_cv"] = cvs
            cell["commit_cv_median"] = statistics.median(cvs) if cvs else None
            cell["mean_staleness"] = statistics.median(r["mean_staleness"] for r in runs)
            cell["steps"] = statistics.median(r["steps"] for r in runs)
            cell["local_steps"] = statistics.median(r["local_steps"] for r in runs)
            cell["lr_mult"], cell["lr"] = runs[0].get("lr_mult", 1.0), runs[0].get("lr")
            cell["tuning"] = (tuned or {}).get((h, row))
            cells[f"{h}/{row}"] = cell
    return cells


def _ratio(m: dict[str, Any] | None, speedup: bool = False) -> str:
    """A ratio cell (median (min-max)); ``speedup``: print ``1 / ratio`` (BSP's time / the row's)."""
    if m is None:
        return "both missed"
    if speedup:
        inv = {"=": "=", ">": "<", "<": ">"}[m["bound"]]
        m = {"value": 1 / m["value"], "bound": inv, "min": 1 / m["max"], "max": 1 / m["min"]}
    return matrix._cell(m)


def goals(cells: dict[str, Any], s: Settings, levels: list[float], rows: list[str]) -> list[str]:
    """The issue's goals, each with its verdict from the medians."""
    out = []
    baselines = [r for r in rows if r not in ("adsp", "bsp")]
    het = [h for h in levels if h > 1]
    for key, what in (("ttl_s", f"loss {s.target_loss:g}"), ("tta_s", f"accuracy {s.target_accuracy:.0%}")):
        ahead, lead = [], []
        for h in het:
            adsp = cells.get(f"{h}/adsp", {}).get(f"{key}_median")
            others = [cells.get(f"{h}/{r}", {}).get(f"{key}_median") for r in [*baselines, "bsp"]]
            if adsp is None or adsp["bound"] != "=":
                ahead.append(f"H {h:g}: adsp missed")
                continue
            best = min((o["value"] for o in others if o is not None), default=math.inf)
            beaten = [r for r, o in zip([*baselines, "bsp"], others, strict=True)
                      if o is not None and o["value"] <= adsp["value"]]
            ahead.append(f"H {h:g}: {'ahead of all' if not beaten else 'not ahead of ' + ', '.join(beaten)}"
                         f" (adsp {adsp['value']:.2f} s, best other {best:.2f} s)")
            lead.append(best / adsp["value"] if math.isfinite(best) else math.inf)
        growing = all(b >= a for a, b in zip(lead, lead[1:], strict=False))
        out.append(f"time to {what}: " + "; ".join(ahead)
                   + f". Lead over the best other row by H: {', '.join(f'{x:.2f}x' for x in lead)} "
                   + ("(growing with H: met)" if growing and lead else "(not monotone in H: not met)"))
        top = cells.get(f"{max(levels)}/adsp", {}).get(f"{key}_vs_bsp_median")
        if top is not None:
            speed = 1 / top["value"]
            out.append(f"time to {what} at H {max(levels):g}: adsp {speed:.2f}x faster than BSP "
                       f"({'met' if speed >= 2 else 'not met'}: goal >= 2x)")
    top = max(levels)
    cv = cells.get(f"{top}/adsp", {}).get("commit_cv_median")
    if cv is not None:
        out.append(f"commit equalisation at H {top:g}: CV of per-worker commits {cv:.1%} "
                   f"({'met' if cv <= 0.10 else 'not met'}: goal <= 10 %)")
    for h in levels:
        adsp = cells.get(f"{h}/adsp", {}).get("acc_median")
        others = {r: cells.get(f"{h}/{r}", {}).get("acc_median") for r in rows if r != "adsp"}
        others = {r: v for r, v in others.items() if v is not None}
        if adsp is None or not others:
            continue
        best_row = max(others, key=others.get)
        gap = (adsp - others[best_row]) * 100
        out.append(f"accuracy at {s.acc_budget_s:g} s, H {h:g}: adsp {adsp:.3f} vs best baseline {best_row} "
                   f"{others[best_row]:.3f} ({gap:+.1f} points; {'met' if gap >= -1 else 'not met'}: within 1 point)")
    return out


def markdown(cells: dict[str, Any], s: Settings, levels: list[float], rows: list[str], seeds: list[int],
             seconds: float, costs: costmodels.NamedCostModel | None = None) -> str:
    header = "| row | " + " | ".join(f"H = {h:g}" for h in levels) + " |"
    rule = "|---|" + "---:|" * len(levels)
    named = costs or costmodels.PRESETS["default"]
    c = named.model
    lines = [
        f"Simulated clock (trainers/simclock.py, {named.name} cost model: step ({c.compute_base_s * 1e3:g} ms + "
        f"{c.compute_per_record_s * 1e3:g} ms/record) x slowdown, {c.latency_s * 1e3:g} ms latency, "
        f"{c.bandwidth_bytes_per_s * 8 / 1e6:g} Mbit/s links), digits MLP ({s.partition}, held-out 20 %), {WORKERS} workers one per device, "
        f"every device at {s.rate_hz:g} records/s (all workers compute-bound; a device keeps at most "
        f"{s.buffer_capacity} waiting records, the rest is dropped and counted), batch 64 per step, LR {s.lr:g} "
        f"momentum {s.momentum:g} (rows as in benchmarks/strategies.py). Targets: held-out loss <= {s.target_loss:g} "
        f"and held-out accuracy >= {s.target_accuracy:.0%}, each held for 3 evaluations (every {s.eval_every_s:g} s); "
        f"budget {s.budget_s:g} s; accuracy read at {s.acc_budget_s:g} s. Seeds {', '.join(map(str, seeds))} "
        f"(streams, shares, initial weights); medians with min-max over seeds. ADSP: period {s.adsp_period_s:g} s, "
        f"C = {s.adsp_commit_rate} at the start (a commit every {s.adsp_period_s / s.adsp_commit_rate:g} s), "
        f"min interval {s.adsp_min_interval_s:g} s, online search on. {seconds / 60:.1f} min for the sweep.",
        "",
        "| H | slowdowns (speed = 1 / slowdown) |",
        "|---:|---|",
    ]
    for h in levels:
        lines.append(f"| {heterogeneity(slowdowns(h)):.2f} | {' '.join(f'{x:g}' for x in slowdowns(h))} |")
    for key, what in (("ttl_s", f"loss <= {s.target_loss:g}"), ("tta_s", f"accuracy >= {s.target_accuracy:.0%}")):
        lines += ["", f"### Speed-up over BSP to {what} (BSP's time / the row's, same seed; > 1 is faster)", "",
                  header, rule]
        for row in rows:
            lines.append(f"| {row} | " + " | ".join(
                _ratio(cells.get(f"{h}/{row}", {}).get(f"{key}_vs_bsp_median"), speedup=True) for h in levels) + " |")
        lines += ["", f"### Time to {what}, simulated seconds (median, min-max)", "", header, rule]
        for row in rows:
            lines.append(f"| {row} | " + " | ".join(
                matrix._cell(cells.get(f"{h}/{row}", {}).get(f"{key}_median"), 2) for h in levels) + " |")
    lines += ["", f"### Held-out accuracy at {s.acc_budget_s:g} s (median, min-max)", "", header, rule]
    for row in rows:
        parts = []
        for h in levels:
            accs = cells.get(f"{h}/{row}", {}).get("acc_at_budget") or []
            parts.append(f"{statistics.median(accs):.3f} ({min(accs):.3f}-{max(accs):.3f})" if accs else "-")
        lines.append(f"| {row} | " + " | ".join(parts) + " |")
    lines += ["", "### ADSP commits: coefficient of variation of per-worker commit counts over the budget "
              "(= CV of commits per check period; median, min-max)", "", header, rule]
    parts = []
    for h in levels:
        cvs = cells.get(f"{h}/adsp", {}).get("commit_cv") or []
        parts.append(f"{statistics.median(cvs):.1%} ({min(cvs):.1%}-{max(cvs):.1%})" if cvs else "-")
    lines.append("| adsp | " + " | ".join(parts) + " |")
    lines += ["", "### Model updates by the end (median): version of the evaluated model / local steps, all workers",
              "", header, rule]
    for row in rows:
        lines.append(f"| {row} | " + " | ".join(
            (lambda c: f"{c['steps']:.0f} / {c['local_steps']:.0f}" if c else "-")(cells.get(f"{h}/{row}"))
            for h in levels) + " |")
    lines += ["", "`>x` / `<x`: censored at the budget (the row, or BSP, missed the target on the median seed)."]
    return "\n".join(lines)


def ablation_markdown(raw: list[dict[str, Any]], s: Settings, h: float, rows: list[str]) -> str:
    lines = [f"### ADSP's starting C at H = {h:g}: commit equalisation and speed (median, min-max over seeds)", "",
             "| row | C at the start | commit interval s | commits per worker (seed 0) | CV of commits "
             "| time to loss s | time to accuracy s | acc at budget |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    for row in rows:
        runs = [r for r in raw if r["h"] == h and r["row"] == row]
        if not runs:
            continue
        c = s.adsp_commit_rate if row == "adsp" else int(row[len("adsp[C="):-1])
        cvs = [r["commit_cv"] for r in runs]
        first = min(runs, key=lambda r: r["seed"])

        def med(key: str, runs: list[dict[str, Any]] = runs) -> str:
            return matrix._cell(matrix.censored_median([r[key] for r in runs], s.budget_s), 2)

        accs = [r["acc_at_budget"] for r in runs if r["acc_at_budget"] is not None]
        lines.append(
            f"| {row} | {c} | {max(s.adsp_min_interval_s, s.adsp_period_s / c):g} "
            f"| {' '.join(map(str, first['commits_per_worker']))} "
            f"| {statistics.median(cvs):.1%} ({min(cvs):.1%}-{max(cvs):.1%}) | {med('ttl_s')} | {med('tta_s')} "
            f"| {statistics.median(accs):.3f} |")
    return "\n".join(lines)


# -- plots -----------------------------------------------------------------------------------


def plots(raw: list[dict[str, Any]], cells: dict[str, Any], s: Settings, levels: list[float], rows: list[str],
          out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(levels)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for row in rows:
        runs = [r for r in raw if r["h"] == top and r["row"] == row]
        if not runs:
            continue
        n = min(len(r["loss_timeline"]) for r in runs)
        t = np.array([p[0] for p in runs[0]["loss_timeline"][:n]])
        v = np.array([[p[1] for p in r["loss_timeline"][:n]] for r in runs])
        line, = ax.plot(t, np.median(v, axis=0), label=row, lw=1.4)
        ax.fill_between(t, v.min(axis=0), v.max(axis=0), color=line.get_color(), alpha=0.15)
    ax.axhline(s.target_loss, color="grey", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("held-out loss (cross-entropy)")
    ax.set_title(f"Simulated clock: held-out loss vs time at H = {top:g} (median of {len(runs)} seeds, min-max band)",
                 fontsize=9)
    ax.legend(fontsize=8)
    loss_png = out.parent / f"{out.name}_loss.png"
    fig.savefig(loss_png, dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, (key, what) in zip(axes, (("ttl_s", f"loss <= {s.target_loss:g}"),
                                      ("tta_s", f"accuracy >= {s.target_accuracy:.0%}")), strict=True):
        for row in rows:
            xs, ys, lo, hi = [], [], [], []
            for h in levels:
                m = cells.get(f"{h}/{row}", {}).get(f"{key}_vs_bsp_median")
                if m is None:
                    continue
                xs.append(h)
                ys.append(1 / m["value"])
                lo.append(1 / m["value"] - 1 / m["max"])
                hi.append(1 / m["min"] - 1 / m["value"])
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=row, lw=1.3)
        ax.axhline(1.0, color="grey", ls=":", lw=1)
        ax.set_xlabel("heterogeneity H = sum(speed) / (N min(speed))")
        ax.set_title(f"speed-up over BSP to {what}", fontsize=9)
        ax.set_yscale("log", base=2)
    axes[0].set_ylabel("BSP's time / row's time (same seed; median, min-max)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Simulated clock: speed-up over BSP vs compute heterogeneity", fontsize=10)
    speed_png = out.parent / f"{out.name}_speedup.png"
    fig.savefig(speed_png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [loss_png, speed_png]


# -- main ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=Settings.repeats)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--budget", type=float, default=Settings.budget_s, help="simulated seconds per run")
    parser.add_argument("--acc-budget", type=float, default=Settings.acc_budget_s,
                        help="the accuracy figure is read at this simulated time")
    parser.add_argument("--levels", default=",".join(f"{h:g}" for h in LEVELS), help="comma list of H values")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of rows ({', '.join(ROWS)})")
    parser.add_argument("--adsp", default="", help="ADSP settings, e.g. period_s=10,commit_rate=10,min_interval_s=0.2")
    parser.add_argument("--commit-ablation", default="5,20",
                        help="at the largest H also run adsp starting from these C (commit-count equalisation vs C)")
    parser.add_argument("--cost-model", default="default", metavar="SPEC",
                        help="the cost model (trainers/costmodels.py): a preset (" + ", ".join(costmodels.PRESETS)
                             + "), a .toml file, either with :KEY=VALUE,... overrides; its compute, latency and "
                               "bandwidth replace the default's, each level's slowdowns stay unless it sets its own")
    parser.add_argument("--out", default=str(RESULTS / "adsp"), help="output path without suffix")
    tuning.add_arguments(parser)
    args = parser.parse_args()
    named = matrix.resolve_cost_model(parser, args.cost_model, (WORKERS,))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    overrides = {}
    for item in filter(None, args.adsp.split(",")):
        key, _, value = item.partition("=")
        field_name = f"adsp_{key}"
        if not hasattr(Settings, field_name):
            parser.error(f"--adsp: unknown setting {key!r}")
        overrides[field_name] = type(getattr(Settings, field_name))(value)
    s = Settings(budget_s=args.budget, acc_budget_s=min(args.acc_budget, args.budget), repeats=args.repeats,
                 **overrides)
    levels = [float(x) for x in args.levels.split(",") if x]
    rows = [r for r in args.rows.split(",") if r]
    if "bsp" not in rows:
        rows.insert(0, "bsp")  # every figure is a ratio to BSP in the same run
    unknown = set(rows) - set(matrix.ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {', '.join(matrix.ROWS)}")
    seeds = [s.first_seed + i for i in range(s.repeats)]
    tune = tuning.from_args(parser, args, seeds)
    # Interleaved: every row of a (seed, H) back to back, the slowest levels first.
    tasks = [Task(h, seed, row) for seed in seeds for h in sorted(levels, reverse=True) for row in rows]
    ablation = [f"adsp[C={int(c)}]" for c in args.commit_ablation.split(",") if c and int(c) != s.adsp_commit_rate]
    tasks += [Task(max(levels), seed, row) for seed in seeds for row in ablation]
    tuned, tune_raw, tune_seconds = None, [], 0.0
    if tune is not None:
        # Every (H, row) cell, bsp and the commit ablation included, on the tuning seeds at each
        # multiplier (chosen by time to the target accuracy), then the reporting seeds at its choice.
        started = time.monotonic()
        tune_raw, tuned = tuning.tune_cells(tasks, tune, _cell, lambda grid: run_all(grid, s, args.jobs, named.model,
                                                                                     label="tuning "),
                                            lambda key: f"H {key[0]:g} {key[1]}", f"simulated runs on {args.jobs} processes")
        tune_seconds = time.monotonic() - started
        tasks = tuning.at_chosen(tasks, tuned, _cell)
    print(f"{len(tasks)} simulated runs on {args.jobs} processes ...", flush=True)
    started = time.monotonic()
    raw = run_all(tasks, s, args.jobs, named.model)
    seconds = time.monotonic() - started
    cells = summarise(raw, s, levels, rows, tuned)
    verdicts = goals(cells, s, levels, rows)
    md = markdown(cells, s, levels, rows, seeds, seconds, named)
    if tuned is not None:
        md += "\n\n" + "\n".join(tuning.markdown_table(
            {(row, f"H {h:g}"): rec for (h, row), rec in tuned.items()}, list(dict.fromkeys(r for _, r in tuned)),
            [f"H {h:g}" for h in levels], tune))
    if ablation:
        md += "\n\n" + ablation_markdown(raw, s, max(levels), ["adsp", *ablation])
    print(md)
    print("\n".join(f"- {v}" for v in verdicts))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pngs = plots(raw, cells, s, levels, rows, out)
    import torch

    out.with_suffix(".json").write_text(json.dumps({
        "benchmark": "adsp", "clock": "simulated",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "processor": platform.processor()},
        "versions": {"torch": torch.__version__, "numpy": np.__version__},
        "settings": asdict(s), "seeds": seeds, "levels": levels, "rows": rows,
        "slowdowns": {f"{h:g}": list(slowdowns(h)) for h in levels},
        "cost_model": asdict(named.model), "cost_model_name": named.name, "cost_model_source": named.source,
        "sweep_seconds": seconds, "jobs": args.jobs, "goals": verdicts,
        "runs": raw, "cells": cells,
        "tuning": None if tune is None else {
            **tune.to_json(), "seconds": tune_seconds,
            "choices": {f"{h}/{row}": rec for (h, row), rec in (tuned or {}).items()}, "runs": tune_raw},
    }, indent=1, default=str))
    # The markdown: the generated tables; the hand-written summary at its top is kept.
    md_path = out.with_suffix(".md")
    marker = "<!-- generated below -->"
    head = ""
    if md_path.exists() and marker in md_path.read_text():
        head = md_path.read_text().split(marker)[0]
    md_path.write_text(head + marker + "\n\n## ADSP vs baselines across compute heterogeneity (simulated clock)\n\n"
                       + md + "\n\n### Goals (from the medians above)\n\n" + "\n".join(f"- {v}" for v in verdicts)
                       + "\n")
    print(f"wrote {out.with_suffix('.json')}, {md_path}, " + ", ".join(str(p) for p in pngs))


if __name__ == "__main__":
    main()
