"""End to end over MQTT: how long from a device's MQTT publish to the step that trains its
reading, and what the model reaches, on real smartwatch data.

Runs the `make demo-mqtt` chain (``scripts/demo_mqtt.py``: a local Kafka broker and
Mosquitto, `edgestream bridge mqtt`, six watches publishing BasicMotions readings as JSON at
QoS 1 in real time, two workers training with BSP) ``--repeats`` times. Each watch stamps a
reading with its publish time; each worker keeps every trained record's age (wall clock at
the step minus that stamp: ``record_age_s`` in its summary), so the figures are publish ->
MQTT broker -> bridge -> Kafka -> worker buffer and window -> step applied.

Prints a markdown table and writes benchmarks/results/mqtt_e2e.{json,md}. Never asserts.

    python -m edgestream bench mqtt_e2e [--publish 40] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def one_run(publish_s: float, sets: list[str], work: Path, index: int) -> dict:
    report = work / f"run{index}.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "demo_mqtt.py"), "--publish", f"{publish_s:g}", "--report",
           str(report), "--set", f"run.state_dir={work / f'state{index}'}"]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if not report.exists():
        raise RuntimeError(f"the demo wrote no report (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    data = json.loads(report.read_text())
    data["exit_code"] = proc.returncode
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--publish", type=float, default=40.0, help="seconds the watches publish per run")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.publish <= 0 or args.repeats < 1:
        parser.error("--publish must be > 0 and --repeats at least 1")
    sets: list[str] = []
    name = "mqtt_e2e"
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-mqtt-e2e-") as tmp:
        for i in range(args.repeats):
            run = one_run(args.publish, sets, Path(tmp), i)
            runs.append(run)
            ages = [s for s in run["publish_to_trained_s"].values() if s.get("kept")]
            print(f"run {i + 1}/{args.repeats}: exit {run['exit_code']}, balanced {run['balanced']}, "
                  + ", ".join(f"p50 {s['p50']:.2f} s p99 {s['p99']:.2f} s" for s in ages), flush=True)
    rows = []
    for i, run in enumerate(runs):
        for worker, s in sorted(run["publish_to_trained_s"].items()):
            if s.get("kept"):
                rows.append({"run": i + 1, "worker": worker, "records": s["count"], "p50_s": s["p50"],
                             "p90_s": s["p90"], "p99_s": s["p99"], "max_s": s["max"],
                             "accuracy": run["accuracy"].get(worker), "balanced": run["balanced"]})
    summary = {key: statistics.median(r[key] for r in rows) for key in ("p50_s", "p90_s", "p99_s")} if rows else {}
    result = {"benchmark": name, "publish_s": args.publish, "repeats": args.repeats,
              "rows": rows, "median_over_workers_and_runs": summary, "chains": [r["chain"] for r in runs],
              "machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count()}}
    lines = [f"MQTT publish -> trained, BasicMotions over `make demo-mqtt`'s chain, {args.publish:g} s of publishing "
             f"per run, {args.repeats} runs",
             "", "| run | worker | records | p50 (s) | p90 (s) | p99 (s) | max (s) | held-out acc | balanced |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['run']} | {r['worker']} | {r['records']} | {r['p50_s']:.2f} | {r['p90_s']:.2f} | {r['p99_s']:.2f} "
              f"| {r['max_s']:.2f} | {r['accuracy']:.3f} | {'yes' if r['balanced'] else 'NO'} |" for r in rows]
    if summary:
        lines += ["", f"median over workers and runs: p50 {summary['p50_s']:.2f} s, p90 {summary['p90_s']:.2f} s, "
                      f"p99 {summary['p99_s']:.2f} s"]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(text)


if __name__ == "__main__":
    main()
