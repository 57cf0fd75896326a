"""The comparison claims of the strategy matrix, judged under every cost model of a run.

A claim says one row reaches the target sooner than a baseline row in some columns
(regime, partition) of the matrix. Under one cost model it *holds* in a column when the
median over seeds of the row's time to target over the baseline's (same seed) is below 1:
a plain ratio, or a bound ``<`` (the baseline missed the target). A median marked ``>``
(the row missed) or no ratio at all (both missed) does not hold. The report states each
claim as "holds under k of n" cost models, with the ratio under each.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edgestream.benchmarks.censored import censored_ratio, median_bound


@dataclass(frozen=True)
class Claim:
    """``row`` reaches the target sooner than ``baseline`` in each of ``columns``."""

    name: str
    row: str
    baseline: str
    columns: tuple[tuple[str, str], ...]
    why: str  # where the claim comes from (the technique's paper, our docs)


ALL_PARTITIONS = ("iid", "dirichlet")

#: The headline claims docs/training.md makes from the matrix, one per technique.
CLAIMS: tuple[Claim, ...] = (
    Claim("ScaDLES before BSP where device rates differ", "scadles", "bsp",
          tuple(("rates", p) for p in ALL_PARTITIONS),
          "ScaDLES: rate-aware windows beat waiting for the slowest stream"),
    Claim("ADSP before BSP where compute differs", "adsp", "bsp",
          tuple(("compute", p) for p in ALL_PARTITIONS),
          "ADSP: commit-rate control lets fast workers keep computing"),
    Claim("EdgeGossip before gossip", "edgegossip", "gossip",
          tuple((r, p) for r in ("rates", "compute", "both", "network") for p in ALL_PARTITIONS),
          "EdgeGossip: balanced iterations and accuracy-aware mixing"),
    Claim("DLion before BSP where links differ", "dlion", "bsp",
          tuple(("network", p) for p in ALL_PARTITIONS),
          "DLion: weighted batching and per-link prioritised exchange"),
    Claim("ASP before BSP", "asp", "bsp",
          tuple((r, p) for r in ("rates", "compute", "both", "network") for p in ALL_PARTITIONS),
          "asynchronous updates never wait for the slowest worker"),
)


def ratio_median(raw: Iterable[Mapping[str, Any]], cost: str, regime: str, partition: str, row: str,
                 baseline: str, budget_s: float) -> dict[str, Any] | None:
    """The median over seeds of ``row``'s TTA over ``baseline``'s on the same seed (censored)."""
    by = {(r["cost"], r["regime"], r["partition"], r["seed"], r["row"]): r for r in raw}
    seeds = sorted({key[3] for key in by if key[:3] == (cost, regime, partition) and key[4] == row})
    ratios = []
    for seed in seeds:
        mine, theirs = by[(cost, regime, partition, seed, row)], by.get((cost, regime, partition, seed, baseline))
        if theirs is not None:
            ratios.append(censored_ratio(mine["tta_s"], theirs["tta_s"], budget_s))
    return median_bound(ratios) if ratios else None


def holds(median: dict[str, Any] | None) -> bool:
    """A median ratio says "sooner": below 1, and not a lower bound (the row missed)."""
    return median is not None and median["bound"] != ">" and median["value"] < 1


def judge(raw: Sequence[Mapping[str, Any]], costs: Sequence[str], budget_s: float,
          claims: Sequence[Claim] = CLAIMS) -> list[dict[str, Any]]:
    """Every claim in every one of its columns the run has, under each of ``costs``: the
    median ratio there and whether it holds; ``holds`` and ``of`` count the cost models."""
    present = {(r["regime"], r["partition"], r["row"]) for r in raw}
    out = []
    for claim in claims:
        for regime, partition in claim.columns:
            if (regime, partition, claim.row) not in present or (regime, partition, claim.baseline) not in present:
                continue
            per_cost = {}
            for cost in costs:
                median = ratio_median(raw, cost, regime, partition, claim.row, claim.baseline, budget_s)
                per_cost[cost] = {"ratio": median, "holds": holds(median)}
            out.append({"claim": claim.name, "row": claim.row, "baseline": claim.baseline, "regime": regime,
                        "partition": partition, "why": claim.why, "per_cost": per_cost,
                        "holds": sum(v["holds"] for v in per_cost.values()), "of": len(costs)})
    return out


def _shown(median: dict[str, Any] | None) -> str:
    if median is None:
        return "both missed"
    mark = {"=": "", ">": ">", "<": "<"}[median["bound"]]
    return f"{mark}{median['value']:.2f}"


def markdown(judged: Sequence[Mapping[str, Any]], costs: Sequence[str]) -> str:
    """The claims table: one line per claim and column, the ratio under each cost model
    (bold where it holds) and "k of n"."""
    if not judged:
        return ""
    lines = ["### Claims across cost models", "",
             "TTA of the row / TTA of the baseline (median over seeds, same seed); a claim holds under "
             "a cost model where that is below 1 (bold); `>`: the row missed the target, `<`: the baseline did.",
             "", "| claim | column | " + " | ".join(costs) + " | holds under |",
             "|---|---|" + "---:|" * len(costs) + "---:|"]
    for entry in judged:
        cells = []
        for cost in costs:
            value = entry["per_cost"][cost]
            text = _shown(value["ratio"])
            cells.append(f"**{text}**" if value["holds"] else text)
        lines.append(f"| {entry['claim']} | {entry['regime']} {entry['partition']} | " + " | ".join(cells)
                     + f" | {entry['holds']} of {entry['of']} |")
    return "\n".join(lines) + "\n"
