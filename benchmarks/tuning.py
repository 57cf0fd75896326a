"""Learning-rate tuning of the comparison benchmarks' rows (issue #32): pure, unit-tested.

A comparison benchmark with ``--tune-lr`` runs every row (baselines included) on a **tuning
seed** at each multiplier of a grid (``--lr-grid``, default 0.5, 1, 2), picks one multiplier
per row with :func:`choose`, and runs the reporting seeds at it. A multiplier scales every
learning rate the row uses (its trainer LR and, where the row sets one, its mode's own LR,
e.g. ASP's per-update ``lr * 64 / (64 N)``): the row's own LR rule keeps its shape and only
its level moves. Every ratio of the benchmark is then against the tuned baseline.

The chooser, per row, on the tuning seed's runs:

1. a multiplier that reached the target (on the validation split, below) beats one that
   missed it; among those that reached it the smallest time to the target wins;
2. when every multiplier missed, the highest validation accuracy at the accuracy budget
   wins, then the lowest validation loss there;
3. ties go to the multiplier closest to the base LR (1; distance ``|log m|``), then to the
   smaller one.

With several tuning seeds a multiplier's figures are medians over them, a missed target
counted as infinitely late (so the median misses when half or more of the seeds missed).
Deterministic: the same runs give the same choice, whatever their order.

The tuning seeds are disjoint from the reporting seeds (:func:`tune_seeds` refuses an
overlap), and no tuning run sees a row any reporting run is tested on. With ``--tune-lr``
every run of the benchmark, tuning or reporting, draws its held-out test split with one
fixed seed (:data:`TEST_SPLIT_SEED`) rather than its own, so the test rows are the same
for every seed and no seed streams or validates on them (:data:`SPLITS`: ``"fixed"``).
A tuning run (``"tuning"``) is then measured on its own **validation split** in place of
the test split (``StreamSet.scored_on_validation``): the chooser reads time to the target
and accuracy at the accuracy budget on validation rows, and the test split is not in a
tuning run at all. Without ``--tune-lr`` each seed keeps its own split (``"seed"``), as
every committed untuned figure was measured.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

DEFAULT_GRID = (0.5, 1.0, 2.0)
#: How a run's data is split (a task's ``split``): ``"seed"``, the held-out test split drawn
#: with the run's seed (untuned benchmarks); ``"fixed"``, drawn with ``TEST_SPLIT_SEED``
#: whatever the seed (the reporting runs of a tuned benchmark); ``"tuning"``, as ``"fixed"``
#: and measured on the validation split, the test split out of reach (a tuning run).
SPLITS = ("seed", "fixed", "tuning")
#: The held-out test split's seed under ``"fixed"`` and ``"tuning"``: seed 0's split, so a
#: tuned benchmark's seed-0 runs are tested on the rows its untuned ones were.
TEST_SPLIT_SEED = 0
#: The default tuning seed is this far above the first reporting seed.
TUNE_SEED_OFFSET = 1000
RULE = ("smallest time to the target on the tuning seed's validation split; if every multiplier missed it, "
        "highest validation accuracy at the accuracy budget, then lowest validation loss there; ties towards the "
        "base LR (x1), then the smaller LR")


@dataclass(frozen=True)
class Point:
    """One grid point of a row: its multiplier and the tuning run's figures (medians over the
    tuning seeds; ``tta_s`` None: missed)."""

    lr_mult: float
    tta_s: float | None
    acc: float | None
    loss: float | None = None


@dataclass(frozen=True)
class Choice:
    lr_mult: float
    by: str  # "tta": the target was reached at the chosen multiplier; "accuracy": missed at every one
    at_edge: bool  # the chosen multiplier is the grid's smallest or largest (the grid may be too narrow)
    points: tuple[Point, ...]  # by multiplier


@dataclass(frozen=True)
class TuneSpec:
    """What ``--tune-lr`` asked for: the grid of multipliers and the tuning seeds."""

    grid: tuple[float, ...]
    seeds: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"grid": list(self.grid), "seeds": list(self.seeds), "rule": RULE}


def parse_grid(text: str) -> tuple[float, ...]:
    """``"0.5,1,2"`` -> ``(0.5, 1.0, 2.0)`` (sorted); every multiplier finite and > 0, none twice."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--lr-grid wants a comma list of multipliers of the row's LR, e.g. 0.5,1,2; "
                         f"got {text!r}") from None
    if not values:
        raise ValueError(f"--lr-grid wants at least one multiplier, got {text!r}") from None
    bad = [v for v in values if not (math.isfinite(v) and v > 0)]
    if bad:
        raise ValueError(f"--lr-grid multipliers must be finite and > 0, got {', '.join(f'{v:g}' for v in bad)}")
    if len(set(values)) != len(values):
        raise ValueError(f"--lr-grid names a multiplier twice: {text!r}")
    return tuple(sorted(values))


def parse_seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--tune-seed wants a seed or a comma list of seeds, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--tune-seed wants distinct seeds, got {text!r}") from None
    return seeds


def tune_seeds(report_seeds: Sequence[int], given: Sequence[int] | None = None) -> tuple[int, ...]:
    """The tuning seeds: ``given``, else ``TUNE_SEED_OFFSET + min(report_seeds)``. A tuning seed
    that is also a reporting seed is refused (``ValueError``): the reported figures must come
    from runs the chooser never saw."""
    seeds = tuple(given) if given else (TUNE_SEED_OFFSET + min(report_seeds),)
    shared = sorted(set(seeds) & set(report_seeds))
    if shared:
        raise ValueError(
            f"--tune-seed {', '.join(map(str, shared))} is also a reporting seed (reporting seeds: "
            f"{', '.join(map(str, sorted(report_seeds)))}): the learning rate must be chosen on seeds that are not "
            f"reported; give a tuning seed outside them (default {TUNE_SEED_OFFSET} + the first reporting seed)")
    return seeds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tune-lr``, ``--lr-grid``, ``--tune-seed`` (the same flags in every comparison benchmark)."""
    parser.add_argument("--tune-lr", action="store_true",
                        help="tune every row's learning rate (baselines included) on a tuning seed before the "
                             "reporting runs: each multiplier of --lr-grid, the smallest time to the target wins "
                             "(if all miss: accuracy at the accuracy budget), ties towards x1; ratios are then "
                             "against the tuned baseline")
    parser.add_argument("--lr-grid", metavar="M,M,...",
                        help="with --tune-lr: multipliers of each row's own learning rate(s) (default "
                             + ",".join(f"{m:g}" for m in DEFAULT_GRID) + ")")
    parser.add_argument("--tune-seed", metavar="SEED[,SEED]",
                        help=f"with --tune-lr: the tuning seed(s), disjoint from the reporting seeds (default "
                             f"{TUNE_SEED_OFFSET} + the first reporting seed)")


def from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, report_seeds: Sequence[int]
              ) -> TuneSpec | None:
    """The ``TuneSpec`` of ``--tune-lr`` (None without it); a bad grid or seed, or ``--lr-grid`` /
    ``--tune-seed`` without ``--tune-lr``, ends the program with a usage error."""
    if not args.tune_lr:
        if args.tune_seed is not None or args.lr_grid is not None:
            parser.error("--lr-grid and --tune-seed only mean something with --tune-lr")
        return None
    try:
        grid = parse_grid(args.lr_grid) if args.lr_grid is not None else DEFAULT_GRID
        seeds = tune_seeds(report_seeds, parse_seeds(args.tune_seed) if args.tune_seed is not None else None)
    except ValueError as exc:
        parser.error(str(exc))
    return TuneSpec(grid, seeds)


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def _median(values: Iterable[float]) -> float:
    return statistics.median(values)


def point(lr_mult: float, runs: Sequence[dict[str, Any]], tta: str = "tta_s", acc: str = "acc_at_budget",
          loss: str = "loss_at_budget") -> Point:
    """A grid point from the runs of one multiplier on the tuning seeds (their ``tta``, ``acc``
    and ``loss`` keys): medians over the seeds, a miss counted as infinitely late."""
    if not runs:
        raise ValueError(f"no tuning run at multiplier {lr_mult:g}")
    ttas = [r.get(tta) if _finite(r.get(tta)) else math.inf for r in runs]
    median_tta = _median(ttas)
    accs = [r.get(acc) for r in runs if _finite(r.get(acc))]
    losses = [r.get(loss) for r in runs if _finite(r.get(loss))]
    return Point(lr_mult, None if math.isinf(median_tta) else float(median_tta),
                 float(_median(accs)) if accs else None, float(_median(losses)) if losses else None)


def rank_key(p: Point) -> tuple[Any, ...]:
    """Smaller is better (the module's rule)."""
    closeness = (abs(math.log(p.lr_mult)), p.lr_mult)
    if p.tta_s is not None:
        return (0, p.tta_s, *closeness)
    acc = -p.acc if _finite(p.acc) else math.inf
    loss = p.loss if _finite(p.loss) else math.inf
    return (1, acc, loss, *closeness)


def choose(points: Iterable[Point]) -> Choice:
    """The chosen multiplier of one row (the module's rule)."""
    ordered = tuple(sorted(points, key=lambda p: p.lr_mult))
    if not ordered:
        raise ValueError("no grid point to choose from")
    mults = [p.lr_mult for p in ordered]
    if len(set(mults)) != len(mults):
        raise ValueError(f"a multiplier appears twice among the grid points: {mults}")
    best = min(ordered, key=rank_key)
    edge = len(ordered) > 1 and best.lr_mult in (mults[0], mults[-1])
    return Choice(best.lr_mult, "tta" if best.tta_s is not None else "accuracy", edge, ordered)


def choose_runs(runs: Sequence[dict[str, Any]], **keys: str) -> Choice:
    """:func:`choose` over one row's tuning runs, each with its ``lr_mult`` (seeds grouped)."""
    by: dict[float, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(float(r["lr_mult"]), []).append(r)
    return choose(point(m, rs, **keys) for m, rs in by.items())


def record(choice: Choice, spec: TuneSpec, base_lr: float | None = None) -> dict[str, Any]:
    """The JSON record of one row's tuning: grid, seeds, every point, the chosen multiplier and
    (given the row's base LR) the LR it gives."""
    return {
        "grid": list(spec.grid), "tune_seeds": list(spec.seeds),
        "points": [{**asdict(p), "lr": None if base_lr is None else base_lr * p.lr_mult} for p in choice.points],
        "chosen_mult": choice.lr_mult, "base_lr": base_lr,
        "lr": None if base_lr is None else base_lr * choice.lr_mult,
        "chosen_by": choice.by, "at_edge": choice.at_edge,
    }


def mult_text(rec: dict[str, Any] | None) -> str:
    """A chosen multiplier for a table: ``x2``, with ``*`` when it is at the grid's edge."""
    if not rec:
        return "-"
    text = f"x{rec['chosen_mult']:g}"
    if rec.get("lr") is not None:
        text += f" ({rec['lr']:.3g})"
    if rec["chosen_by"] == "accuracy":
        text += " acc"
    return text + ("*" if rec["at_edge"] else "")


LEGEND = ("`xM (LR)`: the chosen multiplier of the row's own learning rate(s) and the resulting trainer LR; "
          "`acc`: every multiplier missed the target on the tuning seed, chosen by accuracy at the accuracy budget; "
          "`*`: at the edge of the grid (a wider grid might choose further out).")


def scaled_lr(lr: float | None, mult: float) -> float | None:
    return None if lr is None else lr * mult


def scaled_mode(mode: Any, mult: float) -> Any:
    """A simulated-clock ``Mode`` with its own LR (if it sets one) times ``mult``; the run's
    ``RunConfig.lr`` is scaled by the caller. Multiplier 1: the mode itself."""
    if mult == 1.0 or getattr(mode, "lr", None) is None:
        return mode
    return replace(mode, lr=mode.lr * mult)


def split_params(split: str) -> dict[str, Any]:
    """``StreamSet.from_fleet`` keyword arguments of a run's ``split`` (:data:`SPLITS`)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    return {} if split == "seed" else {"heldout_seed": TEST_SPLIT_SEED}


def fleet_streams(split: str, rates: Sequence[float], *, partition: str, seed: int, **params: Any) -> Any:
    """A benchmark run's ``simclock.StreamSet`` over digits: ``rates`` per device, the test split
    as ``split`` says (:func:`split_params`), measured on validation for a tuning run."""
    from edgestream.trainers import simclock  # torch: only where a run is built

    streams = simclock.StreamSet.from_fleet("digits", tuple(rates), partition=partition, seed=seed,
                                            **split_params(split), **params)
    return streams.scored_on_validation() if split == "tuning" else streams


def run_split(spec: TuneSpec | None, tuning_run: bool = False) -> str:
    """The split of a run: ``"tuning"`` for a tuning run, ``"fixed"`` for any other run of a
    tuned benchmark, ``"seed"`` untuned."""
    if tuning_run:
        return "tuning"
    return "seed" if spec is None else "fixed"


# -- for a benchmark whose tasks are dataclasses with ``seed``, ``lr_mult`` and ``split`` fields --


def grid_tasks(tasks: Sequence[Any], spec: TuneSpec, cell: Callable[[dict[str, Any]], Hashable]) -> list[Any]:
    """The tuning runs of ``tasks``' cells: one task per cell (``cell(asdict(task))``, a key
    without the seed and multiplier), at every tuning seed and multiplier of the grid."""
    first: dict[Hashable, Any] = {}
    for t in tasks:
        first.setdefault(cell(asdict(t)), t)
    return [replace(t, seed=seed, lr_mult=m, split="tuning") for t in first.values() for seed in spec.seeds
            for m in spec.grid]


def choose_cells(runs: Sequence[dict[str, Any]], spec: TuneSpec, cell: Callable[[dict[str, Any]], Hashable],
                 **keys: str) -> dict[Hashable, dict[str, Any]]:
    """Per cell, the record (:func:`record`) of the choice over its tuning runs (each with
    ``lr_mult`` and the trainer ``lr`` it ran at)."""
    groups: dict[Hashable, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(cell(r), []).append(r)
    out = {}
    for key, group in groups.items():
        base_lr = group[0]["lr"] / group[0]["lr_mult"] if group[0].get("lr") is not None else None
        out[key] = record(choose_runs(group, **keys), spec, base_lr)
    return out


def tune_cells(tasks: Sequence[Any], spec: TuneSpec, cell: Callable[[dict[str, Any]], Hashable],
               run: Callable[[list[Any]], list[dict[str, Any]]], label: Callable[[Hashable], str],
               what: str = "runs", **keys: str) -> tuple[list[dict[str, Any]], dict[Hashable, dict[str, Any]]]:
    """Run the grid of ``tasks``' cells (:func:`grid_tasks`) with ``run``, printing progress,
    and choose per cell (:func:`choose_cells`): ``(the tuning runs, the choices)``."""
    grid = grid_tasks(tasks, spec, cell)
    print(f"tuning the learning rate: {len(grid)} {what} (grid {', '.join(f'x{m:g}' for m in spec.grid)}, "
          f"tuning seed {', '.join(map(str, spec.seeds))}) ...", flush=True)
    raw = run(grid)
    choices = choose_cells(raw, spec, cell, **keys)
    for key, rec in choices.items():
        print(f"chosen: {label(key)} {mult_text(rec)}", flush=True)
    return raw, choices


def at_chosen(tasks: Sequence[Any], choices: dict[Hashable, dict[str, Any]],
              cell: Callable[[dict[str, Any]], Hashable]) -> list[Any]:
    """``tasks`` at their cell's chosen multiplier (a task of a cell that was not tuned keeps its
    own), every one on the fixed test split (``"fixed"``)."""
    out = []
    for t in tasks:
        rec = choices.get(cell(asdict(t)))
        out.append(replace(t, split="fixed") if rec is None
                   else replace(t, lr_mult=rec["chosen_mult"], split="fixed"))
    return out


def markdown_table(choices: dict[tuple[str, str], dict[str, Any]], rows: Sequence[str], columns: Sequence[str],
                   spec: TuneSpec, title: str = "Learning rate chosen on the tuning seed") -> list[str]:
    """A table of the chosen multipliers: ``choices`` keyed ``(row, column)``, with the rule below it."""
    lines = [f"### {title}", "", "| row | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for row in rows:
        if any((row, c) in choices for c in columns):
            lines.append(f"| {row} | " + " | ".join(mult_text(choices.get((row, c))) for c in columns) + " |")
    return [*lines, "", describe(spec) + " " + LEGEND]


def describe(spec: TuneSpec) -> str:
    return (f"Learning rates tuned (--tune-lr): every row, the baselines included, ran at each multiplier "
            f"{', '.join(f'x{m:g}' for m in spec.grid)} of its own learning rate(s) on tuning "
            f"seed{'s' if len(spec.seeds) > 1 else ''} {', '.join(map(str, spec.seeds))}, never reported, scored on "
            f"its validation split; the rule: {RULE}. Every run was tested on the same held-out split (drawn with seed "
            f"{TEST_SPLIT_SEED}), which no tuning run streams, validates or is scored on. The reported seeds ran at "
            f"the chosen multiplier: every ratio is against the tuned baseline.")
