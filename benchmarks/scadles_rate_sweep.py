"""Where ScaDLES's advantage over BSP comes from: a rate-spread sweep on the simulated clock.

BSP waits for a fixed batch from every device, so its step rate is set by the slowest
stream; ScaDLES trains on what every device delivered each window. At equal sample
efficiency the speed-up is therefore bounded by ``sum(r) / (N * min(r))`` (the rate
bound). This sweep keeps the ten ScaDLES rates and slows the slowest device (22
records/s in the paper's list) step by step, then runs the time-to-accuracy comparison
of ``benchmarks/time_to_accuracy.py`` on the simulated clock (same model, costs,
window, batch and target; no Kafka) for the oracle, BSP and ScaDLES. It shows how the
measured speed-up follows the bound, and at what spread the paper's 3.3x appears.
Writes benchmarks/results/scadles_rate_sweep.{json,md}. Never asserts.

    python -m edgestream bench scadles_rate_sweep [--slowest 22,15,10,7,5] [--partitions iid,dirichlet]
        [--budget 300]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from edgestream.benchmarks.time_to_accuracy import Settings, simulated
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


def sweep(slowest: list[float], partition: str, s: Settings, progress=print) -> list[dict]:
    rows = []
    for value in slowest:
        rates = rates_with_slowest(value)
        started = time.monotonic()
        reports = simulated(s, [partition], ["bsp", "scadles"], rates=rates)[partition]
        tta = {r["mode"]: r["tta_s"] for r in reports}
        acc = {r["mode"]: r["final_accuracy"] for r in reports}
        row = {
            "partition": partition, "slowest_rate": value, "rates": rates, "rate_bound": rate_bound(rates),
            "tta_s": tta, "final_accuracy": acc, "seconds": time.monotonic() - started,
        }
        for mode in ("oracle", "scadles"):
            ok = tta.get("bsp") is not None and tta.get(mode) is not None
            row[f"{mode}_vs_bsp"] = tta["bsp"] / tta[mode] if ok else None
        rows.append(row)
        progress(f"{partition}, slowest {value:g}/s: bound {row['rate_bound']:.2f}, "
                 f"TTA oracle {_s(tta.get('oracle'))}, bsp {_s(tta.get('bsp'))}, scadles {_s(tta.get('scadles'))} "
                 f"({row['seconds']:.0f} s)")
    return rows


def _s(value: float | None) -> str:
    return "missed" if value is None else f"{value:.1f} s"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(rows: list[dict], s: Settings) -> str:
    lines = [
        f"Simulated clock, rates x{s.scale:g} (slowest device varied, others as in ScaDLES), "
        f"window {s.window_s:g} s, BSP batch 64/device, target {s.target:.0%}, budget {s.budget_s:.0f} s.",
        "",
        "| partition | slowest rate/s | rate bound | TTA oracle s | TTA BSP s | TTA ScaDLES s | oracle vs BSP "
        "| ScaDLES vs BSP | acc at end BSP | acc at end ScaDLES |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t, a = r["tta_s"], r["final_accuracy"]
        lines.append(
            f"| {r['partition']} | {r['slowest_rate']:g} | {r['rate_bound']:.2f} | {_s(t.get('oracle'))} | {_s(t.get('bsp'))} "
            f"| {_s(t.get('scadles'))} | {_x(r['oracle_vs_bsp'])} | {_x(r['scadles_vs_bsp'])} "
            f"| {a.get('bsp', 0):.3f} | {a.get('scadles', 0):.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slowest", default="22,15,10,7,5",
                        help="comma list of rates (records/s, before --scale) for the slowest device")
    parser.add_argument("--partitions", default="iid,dirichlet", help="comma list of iid, dirichlet")
    parser.add_argument("--budget", type=float, default=300.0,
                        help="simulated seconds per run (BSP slows down with the slowest device)")
    parser.add_argument("--out", default=str(RESULTS / "scadles_rate_sweep"), help="output path without suffix")
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
    s = Settings(budget_s=args.budget)
    rows = []
    for partition in partitions:
        rows += sweep(slowest, partition, s, progress=lambda line: print(line, flush=True))
    md = markdown(rows, s)
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(md + "\n")
    out.with_suffix(".json").write_text(json.dumps({
        "benchmark": "scadles_rate_sweep", "clock": "simulated", "partitions": partitions,
        "settings": s.__dict__, "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "rows": rows,
    }, indent=1, default=list))
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
