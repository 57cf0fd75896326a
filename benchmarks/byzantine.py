"""Robust aggregation against Byzantine workers (issue #21), on the simulated clock.

Eight workers, one per device, train the digits MLP (IID, held-out 20 %); every device
streams 400 records/s (the workers are compute-bound: a batch of 64 takes 138 ms on the
default cost model), compute slowdowns ``1 1 1 1 2 2 2 2``. One or two workers are
Byzantine (``trainers/byzantine.py``): they train honestly, then corrupt every gradient
they send, after their own step guard and before the codec, so all values are finite and
pass the receivers' validation and norm check:

  sign_flip   -g
  scale100    100 g
  noise       Gaussian noise with the L2 norm of g

The attackers are the fastest workers (``w0``; ``w0, w1``): under ASP they send the most.
Each attack and count runs with four aggregations, and a clean run (no attacker) of each
sits beside them on the same seed:

  mean          the strategy's default (BSP: sample-weighted mean; ASP: each gradient
                applied on arrival)
  trimmed_mean  coordinate-wise, trim 2 (tolerates 2 Byzantine of 8); ASP: a window of
                one slot per worker, all 8 (``aggregate_window`` default)
  median        coordinate-wise; ASP: the same window
  krum          multi-Krum with krum_f 2 (the same ``--trim``): the mean of the 6 updates
                closest to their neighbours, whole updates left out; ASP: the same window
  mean+clip     the default mean with ``max_update_norm`` (clip), about the 95th
                percentile of honest gradient norms of this model (measured: median 0.35,
                p90 0.79, p99 1.23 over 300 steps)

for BSP (fixed batch 64 per device, LR 0.3 momentum 0.9 on the aggregate, linear scaling
with B_ref = 64 x 8), ADSP (local SGD at LR 0.3 momentum 0.9, batch 64, commits of the
summed local progress, C = 10 per 10 s period at the start with the online search on, as
in benchmarks/strategies.py; the server applies ``W += delta / N``, with a robust rule one
aggregate per window of 8 committers' summed deltas) and ASP (the server applies each gradient with LR 0.3 / 8, a window
with LR 0.3 / 8 x slots; no staleness bound; server momentum 0: with 0.9 every clean ASP
run fell back to 10-30 % after a few seconds, and with 0.5 the windowed ones swung between
70 % and 90 % from one evaluation to the next). The figure is the held-out accuracy at two
fixed simulated times, half the budget and the budget (30 s and 60 s by default; each the
mean of the evaluations in the last ``read_window_s`` before it, which smooths the
evaluation-to-evaluation swing of asynchronous runs), median over seeds with the min-max,
and its gap in points to the clean run of the same strategy with the plain mean (the run
users have today), and to the clean run with the same aggregation. Writes
benchmarks/results/byzantine.{json,md}. Never asserts.

    python -m edgestream bench byzantine [--seeds 0,1,2] [--budget 60] [--strategies bsp,asp,adsp]
        [--attacks sign_flip,scale100,noise] [--byzantine 1,2] [--clip 1.0] [--trim 2] [--out PATH]
        [--cost-model default|edge-compute|edge-network|FILE.toml[:KEY=VALUE,...]]
        [--tune-lr [--lr-grid 0.5,1,2] [--tune-seed 1000]] [--jobs 2]

``--jobs N`` runs N simulated runs at once (benchmarks/parallel.py; the figures do not depend on it).
``--cost-model`` (docs/simclock.md, "Cost models"): its compute, latency and bandwidth replace
the default cost model's; the slowdowns stay unless it sets its own.

``--tune-lr`` (benchmarks/tuning.py, as ``bench strategies``): every (strategy, aggregation)
pair's **clean** run runs at each multiplier of ``--lr-grid`` on the tuning seed (``--tune-seed``,
default 1000 + the first seed, never a reporting seed); the chooser picks one (smallest time to
90 %; if all missed, the accuracy read at the budget, then the held-out loss; ties towards x1,
then the smaller), and every run of the pair, clean and attacked, runs at it: the LR is tuned
as an operator would, without knowing the attack, and each gap is to a tuned clean run. JSON:
``tuning`` (grid, seeds, rule, ``choices`` by ``STRATEGY/AGGREGATION``, the tuning runs); every
run and cell records ``lr_mult`` and ``lr``; the markdown has a table of the chosen multipliers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np

from edgestream.benchmarks import parallel, tuning
from edgestream.trainers import costmodels, simclock
from edgestream.trainers.byzantine import ATTACKS, register_byzantine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
AGGREGATIONS = ("mean", "trimmed_mean", "median", "krum", "mean+clip")
STRATEGIES = ("bsp", "asp", "adsp")
BATCH = 64
CLEAN = "clean"


@dataclass
class Settings:
    workers: int = 8
    rate_hz: float = 400.0
    slowdowns: tuple[float, ...] = (1, 1, 1, 1, 2, 2, 2, 2)
    buffer_capacity: int = 2048
    budget_s: float = 60.0
    eval_every_s: float = 0.5
    message_interval_s: float = 0.1
    lr: float = 0.3
    momentum: float = 0.9
    asp_momentum: float = 0.0
    adsp_period_s: float = 10.0
    adsp_commit_rate: int = 10
    adsp_min_interval_s: float = 0.2
    read_window_s: float = 3.0
    clip: float = 1.0
    trim: int = 2
    seeds: tuple[int, ...] = (0, 1, 2)
    strategies: tuple[str, ...] = STRATEGIES
    attacks: tuple[str, ...] = ATTACKS
    byzantine: tuple[int, ...] = (1, 2)
    aggregations: tuple[str, ...] = AGGREGATIONS
    max_grad_norm: float = 1.0e4
    read_at_s: tuple[float, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.read_at_s:
            self.read_at_s = (self.budget_s / 2, self.budget_s)


@dataclass(frozen=True)
class Task:
    strategy: str
    aggregation: str
    attack: str  # CLEAN for no attacker
    byzantine: int
    seed: int
    lr_mult: float = 1.0  # scales every learning rate of the run (--tune-lr; benchmarks/tuning.py)
    split: str = "seed"  # the test split and what the run is measured on (tuning.SPLITS)

    @property
    def key(self) -> tuple[str, str, str, int, int]:
        return (self.strategy, self.aggregation, self.attack, self.byzantine, self.seed)


def _cell(d: dict[str, Any]) -> tuple[str, str]:
    """A task's or run's tuning cell: strategy and aggregation (every attack of the pair takes
    the choice made on its clean runs)."""
    return (d["strategy"], d["aggregation"])


def aggregation_params(aggregation: str, s: Settings) -> dict[str, Any]:
    """The strategy parameters of one aggregation (what a job puts in ``train.strategy_params``)."""
    if aggregation == "mean":
        return {}
    if aggregation == "trimmed_mean":
        return {"aggregation": "trimmed_mean", "trim": s.trim}
    if aggregation == "median":
        return {"aggregation": "median"}
    if aggregation == "krum":
        return {"aggregation": "krum", "krum_f": s.trim}
    if aggregation == "mean+clip":
        return {"max_update_norm": s.clip, "norm_policy": "clip"}
    raise ValueError(f"unknown aggregation {aggregation!r}")


def attackers(count: int) -> list[str]:
    """The Byzantine workers: the fastest ones first (``w0``, ``w1``, ...)."""
    return [f"w{i}" for i in range(count)]


@lru_cache(maxsize=4)
def _streams(seed: int, workers: int, rate_hz: float, interval: float, split: str = "seed") -> simclock.StreamSet:
    return tuning.fleet_streams(split, (rate_hz,) * workers, partition="iid", seed=seed, message_interval_s=interval)


def mode_for(task: Task, s: Settings) -> simclock.Mode:
    name = register_byzantine(task.strategy)
    params: dict[str, Any] = dict(aggregation_params(task.aggregation, s))
    if task.attack != CLEAN:
        params.update({"byzantine": attackers(task.byzantine), "attack": task.attack, "attack_seed": task.seed})
    lr = None
    if task.strategy == "bsp":
        params["reference_batch"] = BATCH * s.workers
    elif task.strategy == "adsp":
        params.update({"period_s": s.adsp_period_s, "commit_rate": s.adsp_commit_rate,
                       "min_interval_s": s.adsp_min_interval_s, "search": True})
    else:
        lr = s.lr / s.workers  # per gradient on arrival; a window of k slots steps with k times that
    return simclock.Mode(f"{task.strategy}/{task.aggregation}/{task.attack}", name, params, batcher="fixed",
                         batch_size=BATCH, buffer_policy="truncate", buffer_capacity=s.buffer_capacity, lr=lr)


def run_task(task: Task, s: Settings, base: simclock.CostModel | None = None) -> dict[str, Any]:
    """One run; ``base``: the cost model (default ``CostModel()``), whose slowdowns, if it sets
    any, replace the settings' ``slowdowns``."""
    started = time.monotonic()
    streams = _streams(task.seed, s.workers, s.rate_hz, s.message_interval_s, task.split)
    momentum = s.asp_momentum if task.strategy == "asp" else s.momentum
    config = simclock.RunConfig(model="mlp", lr=s.lr * task.lr_mult, momentum=momentum, seed=task.seed,
                                eval_every_s=s.eval_every_s, target_accuracy=0.9, stop_at_target=False,
                                time_budget_s=s.budget_s, max_grad_norm=s.max_grad_norm)
    costs = costmodels.with_worker_lists(simclock.CostModel() if base is None else base, s.slowdowns)
    mode = tuning.scaled_mode(mode_for(task, s), task.lr_mult)
    report = simclock.run(mode, streams, costs, config)
    timeline = [(t, a) for t, a, _ in report.timeline]
    server = report.server or {}
    counters = server.get("counters", {})
    return {
        **asdict(task),
        "byzantine_workers": attackers(task.byzantine) if task.attack != CLEAN else [],
        "lr": config.lr if mode.lr is None else mode.lr,
        "accuracy_at": {f"{t:g}": _mean_over(timeline, t, s.read_window_s) for t in s.read_at_s},
        # for --tune-lr's chooser: time to 90 % (held for 3 evaluations), accuracy as read at the
        # budget, held-out loss at the budget
        "tta_s": report.tta_s, "acc_at_budget": _mean_over(timeline, s.budget_s, s.read_window_s),
        "loss_at_budget": _at(report.loss_timeline, s.budget_s),
        "last_evaluation_at": {f"{t:g}": _at(timeline, t) for t in s.read_at_s},
        "final_accuracy": report.final_accuracy,
        "steps": report.steps, "local_steps": report.local_steps,
        "rejected_messages": report.rejected_messages, "rejected_steps": report.rejected_steps,
        "mean_staleness": report.mean_staleness,
        "server_counters": {k: v for k, v in counters.items()
                            if k.startswith(("updates_", "trim_", "windows", "applied", "windowed"))} or None,
        "accuracy_timeline": [(round(t, 3), round(a, 4)) for t, a in timeline],
        "wall_s": time.monotonic() - started,
    }


def _at(timeline: list[tuple[float, float]], t: float) -> float | None:
    best = None
    for at, value in timeline:
        if at <= t + 1e-9:
            best = value
    return best


def _mean_over(timeline: list[tuple[float, float]], t: float, window: float) -> float | None:
    """Mean of the evaluations in ``(t - window, t]`` (the last one at or before ``t`` if none)."""
    values = [value for at, value in timeline if t - window < at <= t + 1e-9]
    return statistics.fmean(values) if values else _at(timeline, t)


def tasks_for(s: Settings) -> list[Task]:
    """Per seed and strategy: the clean runs of every aggregation, then each attack and count
    with every aggregation back to back (the figures compare runs of the same seed)."""
    tasks = []
    for seed in s.seeds:
        for strategy in s.strategies:
            tasks += [Task(strategy, agg, CLEAN, 0, seed) for agg in s.aggregations]
            for attack in s.attacks:
                for count in s.byzantine:
                    tasks += [Task(strategy, agg, attack, count, seed) for agg in s.aggregations]
    return tasks


# -- summary ---------------------------------------------------------------------------------


def summarise(raw: list[dict[str, Any]], s: Settings) -> dict[str, Any]:
    """Per (strategy, aggregation, attack, count): accuracies at each read time over seeds, their
    median and min-max, and the gaps in points (per seed, then the median) to the clean mean run
    and to the clean run of the same aggregation."""
    by = {(r["strategy"], r["aggregation"], r["attack"], r["byzantine"], r["seed"]): r for r in raw}
    cells: dict[str, Any] = {}
    conditions = [(CLEAN, 0)] + [(a, c) for a in s.attacks for c in s.byzantine]
    for strategy in s.strategies:
        for aggregation in s.aggregations:
            for attack, count in conditions:
                runs = [by[k] for seed in s.seeds if (k := (strategy, aggregation, attack, count, seed)) in by]
                if not runs:
                    continue
                cell: dict[str, Any] = {"strategy": strategy, "aggregation": aggregation, "attack": attack,
                                        "byzantine": count, "seeds": [r["seed"] for r in runs]}
                for t in s.read_at_s:
                    key = f"{t:g}"
                    accs = [r["accuracy_at"][key] for r in runs]
                    gap_mean, gap_same = [], []
                    for r in runs:
                        clean_mean = by.get((strategy, "mean", CLEAN, 0, r["seed"]))
                        clean_same = by.get((strategy, aggregation, CLEAN, 0, r["seed"]))
                        if clean_mean is not None:
                            gap_mean.append(100 * (r["accuracy_at"][key] - clean_mean["accuracy_at"][key]))
                        if clean_same is not None:
                            gap_same.append(100 * (r["accuracy_at"][key] - clean_same["accuracy_at"][key]))
                    cell[key] = {
                        "accuracy": accs, "median": statistics.median(accs), "min": min(accs), "max": max(accs),
                        "gap_vs_clean_mean_points": gap_mean,
                        "gap_vs_clean_mean_median": statistics.median(gap_mean) if gap_mean else None,
                        "gap_vs_clean_same_points": gap_same,
                        "gap_vs_clean_same_median": statistics.median(gap_same) if gap_same else None,
                    }
                counters = [r["server_counters"] for r in runs if r["server_counters"]]
                if counters:
                    cell["server_counters_seed0"] = counters[0]
                cell["lr_mult"], cell["lr"] = runs[0].get("lr_mult", 1.0), runs[0].get("lr")
                cells[f"{strategy}/{aggregation}/{attack}/{count}"] = cell
    return cells


def _cond(attack: str, count: int) -> str:
    return "clean" if attack == CLEAN else f"{attack} x{count}"


def _row_cells(cells: dict[str, Any], s: Settings, strategy: str, aggregation: str, t_key: str,
               render: Any) -> str:
    conditions = [(CLEAN, 0)] + [(a, c) for a in s.attacks for c in s.byzantine]
    row = []
    for attack, count in conditions:
        cell = cells.get(f"{strategy}/{aggregation}/{attack}/{count}", {}).get(t_key)
        row.append("-" if cell is None else render(cell))
    return f"| {strategy} | {aggregation} | " + " | ".join(row) + " |"


def _gap(key: str) -> Any:
    def render(cell: dict[str, Any]) -> str:
        gap = cell[key]
        return "-" if gap is None else (f"**{gap:+.1f}**" if gap < -2 else f"{gap:+.1f}")

    return render


def _jobs_text(jobs: int) -> str:
    return "one process" if jobs <= 1 else f"{jobs} processes"


def markdown(cells: dict[str, Any], s: Settings, seconds: float, costs: costmodels.NamedCostModel | None = None,
             jobs: int = 1) -> str:
    conditions = [(CLEAN, 0)] + [(a, c) for a in s.attacks for c in s.byzantine]
    header = "| strategy | aggregation | " + " | ".join(_cond(a, c) for a, c in conditions) + " |"
    rule = "|---|---|" + "---:|" * len(conditions)
    named = costs or costmodels.PRESETS["default"]
    c = named.model
    lines = [
        f"Simulated clock (trainers/simclock.py, {named.name} cost model: step ({c.compute_base_s * 1e3:g} ms + "
        f"{c.compute_per_record_s * 1e3:g} ms/record) x slowdown, {c.latency_s * 1e3:g} ms latency, "
        f"{c.bandwidth_bytes_per_s * 8 / 1e6:g} Mbit/s), digits MLP (IID, held-out 20 %), {s.workers} workers one per device at "
        f"{s.rate_hz:g} records/s each, slowdowns {' '.join(f'{x:g}' for x in s.slowdowns)}, batch {BATCH}. "
        f"BSP: LR {s.lr:g} momentum {s.momentum:g} on the aggregate, B_ref = {BATCH * s.workers}; ADSP: local SGD at LR {s.lr:g} momentum {s.momentum:g}, "
        f"period {s.adsp_period_s:g} s, C = {s.adsp_commit_rate} at the start, search on; ASP: LR "
        f"{s.lr:g} / {s.workers} per gradient (x slots per window), momentum {s.asp_momentum:g}, no staleness "
        f"bound. Byzantine workers: the fastest (w0; w0 and w1), attacks sign_flip (-g), scale100 (100 g), "
        f"noise (Gaussian with the norm of g). Aggregations: mean (each strategy's default), trimmed_mean "
        f"(trim {s.trim}), median, krum (krum_f {s.trim}), mean+clip (max_update_norm={s.clip:g}, norm_policy=clip); the ASP and ADSP servers' "
        f"trimmed_mean, median and krum collect a window of one slot per worker ({s.workers}). Accuracy at t: mean of the held-out "
        f"evaluations (every {s.eval_every_s:g} s) in the last {s.read_window_s:g} s before t. Seeds "
        f"{', '.join(map(str, s.seeds))} (streams, shares, initial weights, noise); medians with min-max over "
        f"seeds. {seconds / 60:.1f} min for the whole sweep ({_jobs_text(jobs)}, one torch thread each).",
    ]
    for t in reversed(s.read_at_s):
        t_key = f"{t:g}"
        lines += ["", f"### Held-out accuracy at {t_key} s (median, min-max)", "", header, rule]
        lines += [_row_cells(cells, s, st, agg, t_key,
                             lambda c: f"{c['median']:.3f} ({c['min']:.3f}-{c['max']:.3f})")
                  for st in s.strategies for agg in s.aggregations]
        for key, what in (("gap_vs_clean_mean_median", "the clean run with the plain mean (same strategy, same seed)"),
                          ("gap_vs_clean_same_median", "the clean run with the same aggregation (same seed)")):
            lines += ["", f"### Gap at {t_key} s, points, to {what}; median over seeds; "
                          f"**bold**: more than 2 points below", "", header, rule]
            lines += [_row_cells(cells, s, st, agg, t_key, _gap(key)) for st in s.strategies for agg in s.aggregations]
    lines += ["", "### Verdicts", ""] + [f"- {v}" for v in verdicts(cells, s)]
    return "\n".join(lines)


def verdicts(cells: dict[str, Any], s: Settings) -> list[str]:
    """The issue's goals, from the medians at each read time: the plain mean degrades under
    attack; each robust option stays within 2 points of the clean plain-mean run."""
    out = []
    attacked = [(a, c) for a in s.attacks for c in s.byzantine]
    for t in reversed(s.read_at_s):
        t_key = f"{t:g}"
        for strategy in s.strategies:
            plain = [(a, c, cells.get(f"{strategy}/mean/{a}/{c}", {}).get(t_key)) for a, c in attacked]
            gaps = [(a, c, cell["gap_vs_clean_mean_median"]) for a, c, cell in plain
                    if cell is not None and cell["gap_vs_clean_mean_median"] is not None]
            degraded = [f"{_cond(a, c)} ({g:+.1f})" for a, c, g in gaps if g < -2]
            held = [_cond(a, c) for a, c, g in gaps if g >= -2]
            out.append(f"at {t_key} s, {strategy}, plain mean: "
                       + (f"more than 2 points below the clean run under {', '.join(degraded)}" if degraded
                          else "never more than 2 points below the clean run")
                       + (f"; within 2 points under {', '.join(held)}" if held else ""))
            for aggregation in s.aggregations:
                if aggregation == "mean":
                    continue
                misses = []
                for a, c in attacked:
                    cell = cells.get(f"{strategy}/{aggregation}/{a}/{c}", {}).get(t_key)
                    if cell is not None and cell["gap_vs_clean_mean_median"] is not None \
                            and cell["gap_vs_clean_mean_median"] < -2:
                        misses.append(f"{_cond(a, c)} ({cell['gap_vs_clean_mean_median']:+.1f})")
                out.append(f"at {t_key} s, {strategy}, {aggregation}: within 2 points of the clean mean run under "
                           f"every attack: " + ("met" if not misses else "not met under " + ", ".join(misses)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma list of seeds")
    parser.add_argument("--budget", type=float, default=Settings.budget_s, help="simulated seconds per run")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--byzantine", default="1,2", help="comma list of attacker counts")
    parser.add_argument("--aggregations", default=",".join(AGGREGATIONS))
    parser.add_argument("--clip", type=float, default=Settings.clip, help="max_update_norm of mean+clip")
    parser.add_argument("--trim", type=int, default=Settings.trim, help="trim of trimmed_mean and krum_f of krum")
    parser.add_argument("--cost-model", default="default", metavar="SPEC",
                        help="the cost model (trainers/costmodels.py): a preset (" + ", ".join(costmodels.PRESETS)
                             + "), a .toml file, either with :KEY=VALUE,... overrides; its compute, latency and "
                               "bandwidth replace the default's, the slowdowns stay unless it sets its own")
    parser.add_argument("--out", default=str(RESULTS / "byzantine"), help="output path without suffix")
    parser.add_argument("--jobs", type=int, default=1,
                        help="simulated runs at once, one process and one torch thread each (the figures do "
                             "not depend on it; 2 on two cores)")
    tuning.add_arguments(parser)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def listed(text: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
        items = tuple(x for x in text.split(",") if x)
        unknown = sorted(set(items) - set(known))
        if not items or unknown:
            parser.error(f"--{what}: choose from {', '.join(known)}, got {text!r}")
        return items

    try:
        seeds = tuple(int(x) for x in args.seeds.split(",") if x)
        counts = tuple(int(x) for x in args.byzantine.split(",") if x)
    except ValueError:
        parser.error("--seeds and --byzantine take comma lists of integers")
    s = Settings(budget_s=args.budget, clip=args.clip, trim=args.trim, seeds=seeds,
                 strategies=listed(args.strategies, STRATEGIES, "strategies"),
                 attacks=listed(args.attacks, ATTACKS, "attacks"), byzantine=counts,
                 aggregations=listed(args.aggregations, AGGREGATIONS, "aggregations"))
    if "mean" not in s.aggregations:
        s.aggregations = ("mean", *s.aggregations)  # every gap is to the clean mean run
    if not seeds or any(c < 1 or c >= s.workers for c in counts):
        parser.error(f"need at least one seed and attacker counts in 1..{s.workers - 1}")
    from edgestream.benchmarks.strategies import resolve_cost_model
    tune = tuning.from_args(parser, args, seeds)
    named = resolve_cost_model(parser, args.cost_model, (s.workers,))
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    tasks = tasks_for(s)

    def run(tasks: list[Task], label: str = "") -> list[dict[str, Any]]:
        def show(i: int, r: dict[str, Any]) -> None:
            lr = f" lr x{r['lr_mult']:g} ({r['lr']:.3g})" if label or r["lr_mult"] != 1.0 else ""
            print(f"{label}[{i}/{len(tasks)}] seed {r['seed']} {r['strategy']} {r['aggregation']} "
                  f"{_cond(r['attack'], r['byzantine'])}{lr}: accuracy {r['accuracy_at']} ({r['wall_s']:.1f} s)",
                  flush=True)

        return parallel.map_in_order(partial(run_task, s=s, base=named.model), tasks, args.jobs, show)

    tuned, tune_raw = None, []
    if tune is not None:
        # Every (strategy, aggregation) pair's clean run on the tuning seeds at each multiplier;
        # its attacked runs take the same choice (the LR is tuned without knowing the attack).
        tune_raw, tuned = tuning.tune_cells([t for t in tasks if t.attack == CLEAN], tune, _cell,
                                            lambda grid: run(grid, "tuning "), lambda key: f"{key[0]} {key[1]}",
                                            "clean runs")
        tasks = tuning.at_chosen(tasks, tuned, _cell)
    print(f"{len(tasks)} simulated runs, {args.jobs} at a time ...", flush=True)
    started = time.monotonic()
    raw = run(tasks)
    seconds = time.monotonic() - started
    cells = summarise(raw, s)
    md = markdown(cells, s, seconds, named, args.jobs)
    if tuned is not None:
        md += "\n\n" + "\n".join(tuning.markdown_table(
            {(strategy, aggregation): rec for (strategy, aggregation), rec in tuned.items()},
            list(s.strategies), list(s.aggregations), tune,
            "Learning rate chosen on the tuning seed's clean runs (row: strategy; column: aggregation)"))
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    out.with_suffix(".md").write_text("## Robust aggregation against Byzantine workers (simulated clock)\n\n" + md + "\n")
    out.with_suffix(".json").write_text(json.dumps({
        "benchmark": "byzantine", "clock": "simulated",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "processor": platform.processor()},
        "versions": {"torch": torch.__version__, "numpy": np.__version__},
        "settings": asdict(s), "cost_model": asdict(costmodels.with_worker_lists(named.model, s.slowdowns)),
        "cost_model_name": named.name, "cost_model_source": named.source,
        "strategy_params": {agg: aggregation_params(agg, s) for agg in s.aggregations},
        "sweep_seconds": seconds, "jobs": args.jobs, "verdicts": verdicts(cells, s), "cells": cells, "runs": raw,
        "tuning": None if tune is None else {
            **tune.to_json(), "tuned_on": "clean runs; every attack of the pair runs at the pair's choice",
            "choices": {f"{strategy}/{aggregation}": rec for (strategy, aggregation), rec in (tuned or {}).items()},
            "runs": tune_raw},
    }, indent=1, default=list))
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
