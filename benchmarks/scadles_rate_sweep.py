"""Where ScaDLES's advantage over BSP comes from: a rate-spread sweep on the simulated clock.

BSP waits for a fixed batch from every device, so its step rate is set by the slowest
stream; ScaDLES trains on what every device delivered each window. At equal sample
efficiency the speed-up is therefore bounded by ``sum(r) / (N * min(r))`` (the rate
bound). This sweep keeps the ten ScaDLES rates and slows the slowest device (22
records/s in the paper's list) step by step, then runs the time-to-accuracy comparison
of ``benchmarks/time_to_accuracy.py`` on the simulated clock (same model, costs,
window, batch and target; no Kafka) for the oracle, BSP and ScaDLES. It shows how the
measured speed-up follows the bound, and at what spread the paper's 3.3x appears.
Seeds 0 .. ``--repeats``-1 (streams, shares, initial weights); medians over them, each ratio
to BSP taken on the same seed. ``--tune-lr`` (benchmarks/tuning.py, as ``bench strategies``):
every (slowest rate, partition, row) cell, BSP and the oracle included, chooses its learning
rate on the tuning seed first. Writes benchmarks/results/scadles_rate_sweep.{json,md}. Never asserts.

    python -m edgestream bench scadles_rate_sweep [--slowest 22,15,10,7,5] [--partitions iid,dirichlet]
        [--budget 300] [--repeats 3] [--tune-lr [--lr-grid 0.5,1,2] [--tune-seed 1000]]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from edgestream.benchmarks import censored, tuning
from edgestream.benchmarks.time_to_accuracy import Settings, simulated_seeds
from edgestream.streams.profiles import SCADLES_RATES

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SLOWEST = SCADLES_RATES.index(min(SCADLES_RATES))  # dev07, 22 records/s


def rates_with_slowest(slowest: float) -> list[float]:
    rates = [float(r) for r in SCADLES_RATES]
    rates[SLOWEST] = slowest
    return rates


def rate_bound(rates: list[float]) -> float:
    return sum(rates) / (len(rates) * min(rates))


def sweep(slowest: list[float], partition: str, s: Settings, seeds: list[int] | None = None,
          tune: tuning.TuneSpec | None = None, progress=print) -> list[dict]:
    """One row per slowest rate: the oracle, BSP and ScaDLES on every seed (medians; ``tune``:
    each row at the learning rate it chose on the tuning seed of that rate and partition)."""
    rows = []
    for value in slowest:
        rates = rates_with_slowest(value)
        started = time.monotonic()
        sim = simulated_seeds(s, [partition], ["bsp", "scadles"], seeds or [s.seed], tune,
                              progress=lambda _line: None, rates=rates)
        cells = {c["mode"]: c for c in sim["summary"].values()}
        row = {
            "partition": partition, "slowest_rate": value, "rates": rates, "rate_bound": rate_bound(rates),
            "seeds": sim["seeds"], "tta": {m: c["tta"] for m, c in cells.items()},
            "final_accuracy": {m: c["final_accuracy"] for m, c in cells.items()},
            "lr": {m: c["lr"] for m, c in cells.items()},
            "oracle_vs_bsp": cells["oracle"]["speedup_vs_bsp"], "scadles_vs_bsp": cells["scadles"]["speedup_vs_bsp"],
            "tuning": sim["tuning"], "runs": sim["runs"], "seconds": time.monotonic() - started,
        }
        rows.append(row)
        progress(f"{partition}, slowest {value:g}/s: bound {row['rate_bound']:.2f}, TTA oracle "
                 f"{_s(row['tta'].get('oracle'))}, bsp {_s(row['tta'].get('bsp'))}, scadles "
                 f"{_s(row['tta'].get('scadles'))}; ScaDLES vs BSP {_x(row['scadles_vs_bsp'])} "
                 f"({row['seconds']:.0f} s)")
    return rows


def _s(value: dict | None) -> str:
    """A censored median TTA: ``>300.0 s`` when most seeds missed."""
    return censored.text(value, 1, " s", spread=False)


def _x(value: dict | None) -> str:
    return censored.text(value, 2, "x")


def markdown(rows: list[dict], s: Settings, tune: tuning.TuneSpec | None = None) -> str:
    seeds = ", ".join(map(str, rows[0]["seeds"])) if rows else ""
    lines = [
        f"Simulated clock, rates x{s.scale:g} (slowest device varied, others as in ScaDLES), "
        f"window {s.window_s:g} s, BSP batch 64/device, target {s.target:.0%}, budget {s.budget_s:.0f} s; seeds "
        f"{seeds}, medians (ratios per seed, with the min-max; `>`: a missed target counted as the budget).",
        "",
        "| partition | slowest rate/s | rate bound | TTA oracle s | TTA BSP s | TTA ScaDLES s | oracle vs BSP "
        "| ScaDLES vs BSP | acc at end BSP | acc at end ScaDLES | LR oracle / BSP / ScaDLES |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t, a, lr = r["tta"], r["final_accuracy"], r["lr"]
        lines.append(
            f"| {r['partition']} | {r['slowest_rate']:g} | {r['rate_bound']:.2f} | {_s(t.get('oracle'))} | "
            f"{_s(t.get('bsp'))} | {_s(t.get('scadles'))} | {_x(r['oracle_vs_bsp'])} | {_x(r['scadles_vs_bsp'])} "
            f"| {a.get('bsp', 0):.3f} | {a.get('scadles', 0):.3f} | "
            f"{' / '.join(f'{lr[m]:.3g}' for m in ('oracle', 'bsp', 'scadles') if m in lr)} |"
        )
    if tune is not None:
        lines += ["", tuning.describe(tune) + " Chosen per (slowest rate, partition, row): the LR column."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slowest", default="22,15,10,7,5",
                        help="comma list of rates (records/s, before --scale) for the slowest device")
    parser.add_argument("--partitions", default="iid,dirichlet", help="comma list of iid, dirichlet")
    parser.add_argument("--budget", type=float, default=300.0,
                        help="simulated seconds per run (BSP slows down with the slowest device)")
    parser.add_argument("--repeats", type=int, default=3, help="seeds 0 .. REPEATS-1 (medians)")
    parser.add_argument("--out", default=str(RESULTS / "scadles_rate_sweep"), help="output path without suffix")
    tuning.add_arguments(parser)
    args = parser.parse_args()
    try:
        slowest = [float(x) for x in args.slowest.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--slowest must be a comma list of numbers, got {args.slowest!r}")
    if not slowest or any(v <= 0 for v in slowest):
        parser.error("--slowest needs at least one positive rate")
    partitions = [p for p in args.partitions.split(",") if p]
    unknown = sorted(set(partitions) - {"iid", "dirichlet"})
    if not partitions or unknown:
        parser.error(f"--partitions takes iid and/or dirichlet, got {args.partitions!r}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    s = Settings(budget_s=args.budget)
    seeds = [s.seed + i for i in range(args.repeats)]
    tune = tuning.from_args(parser, args, seeds)
    rows = []
    for partition in partitions:
        rows += sweep(slowest, partition, s, seeds, tune, progress=lambda line: print(line, flush=True))
    md = f"Command: `python -m edgestream bench scadles_rate_sweep {' '.join(sys.argv[1:])}`.\n\n" + markdown(rows, s, tune)
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(md + "\n")
    out.with_suffix(".json").write_text(json.dumps({
        "benchmark": "scadles_rate_sweep", "clock": "simulated", "partitions": partitions, "seeds": seeds,
        "tuning": None if tune is None else tune.to_json(),
        "settings": s.__dict__, "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "rows": rows,
    }, indent=1, default=list))
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
