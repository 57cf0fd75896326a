"""Soak with bursts: a long run on the real broker whose device rates burst to 10x for 30 s
every 5 minutes (``make soak``; not part of ``make test``).

Samples every few seconds, for the whole streaming phase:
- the resident memory of every process (the run's own, which holds the simulators; each
  worker; the server; the broker);
- each device's buffer depth and partition pause state;
- each worker's consumer lag.

Writes ``benchmarks/results/soak.json`` (every sample), ``soak.md`` (the verdicts) and
``soak.png`` (RSS, lag and buffer depth over time). The verdicts:
- **Memory:** RSS growth after warm-up under 10 %. The mean of the last 5 minutes is compared
  with the mean of the 5 minutes after the warm-up.
- **Buffers:** never above the configured capacity. Backpressure engaged during bursts (pauses
  counted) and released after them (no partition paused at the end of a cycle).
- **Lag:** consumer lag back to its pre-burst level before the next burst.
- **Accounting:** every record produced is trained, dropped by a counted policy, or
  dead-lettered.

    scripts/with-venv.sh python -m edgestream bench soak [--minutes 30] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from edgestream.deploy.kafka.broker import LocalBroker, kafka_version
from edgestream.job.config import load_config
from edgestream.monitoring.scrape import scrape
from edgestream.pipeline.run import RunContext, run_job

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
#: Growth of resident memory after warm-up that the soak accepts (fraction).
MAX_RSS_GROWTH = 0.10


def rss_mb(pid: int) -> float | None:
    """Resident memory of ``pid`` in MB (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def burst_factor_for(ratio: float, on_s: float, period_s: float) -> float:
    """The ``bursty`` profile's ``factor`` (on-phase rate over the mean) that makes the
    on-phase rate ``ratio`` times the off-phase rate."""
    off_s = period_s - on_s
    return ratio * period_s / (off_s + ratio * on_s)


def job(args, state: Path):
    factor = burst_factor_for(args.burst_ratio, args.burst_s, args.every_s)
    rates = ",".join(str(args.rate) for _ in range(args.devices))
    return load_config(overrides=[
        "job.name=soak", f"run.state_dir={state}", f"run.duration_s={args.minutes * 60}", "run.drain_timeout_s=300",
        f"devices.count={args.devices}", f"devices.rates_hz={rates}", "devices.message_interval_s=0.1",
        f"devices.profile=bursty:on={args.burst_s},off={args.every_s - args.burst_s},factor={factor:.6f}",
        f"workers.count={args.workers}", "train.enabled=true", f"train.strategy={args.strategy}",
        "train.model=mlp", "train.lr=0.03", "train.momentum=0.5", "train.eval_every_s=5",
        "train.checkpoint_every_steps=200", "batcher.window_s=0.5", "batcher.max_batch=128",
        "buffer.policy=backpressure", f"buffer.capacity={args.capacity}",
    ], env={})


def sample(ctx: RunContext, broker_pid: int | None, started: float) -> dict:
    out: dict = {"t": round(time.monotonic() - started, 2), "rss_mb": {}, "depth": {}, "paused": {},
                 "pauses": {}, "lag": {}}
    out["rss_mb"]["run+simulators"] = rss_mb(os.getpid())
    if broker_pid is not None:
        out["rss_mb"]["broker"] = rss_mb(broker_pid)
    for w in ctx.workers:
        out["rss_mb"][w.name] = rss_mb(w.proc.pid)
        s = scrape(w.metrics_url) if w.metrics_url else None
        if s is None:
            continue
        out["depth"].update(s.by_label("edgestream_buffer_depth_records", "device"))
        out["paused"].update(s.by_label("edgestream_partition_paused", "device"))
        out["pauses"].update(s.by_label("edgestream_partition_pauses_total", "device"))
        if w.name != "server":
            out["lag"][w.name] = sum(s.by_label("edgestream_consumer_lag_records", "device").values())
    return out


#: Seconds between a simulated device's messages (``devices.message_interval_s`` of the job).
MESSAGE_INTERVAL_S = 0.1


def burst_rates(args) -> tuple[float, float]:
    """(records/s outside bursts, records/s during a burst) per device: ``--rate`` is the mean."""
    factor = burst_factor_for(args.burst_ratio, args.burst_s, args.every_s)
    on = args.rate * factor
    return on / args.burst_ratio, on


def depth_bound(args) -> int:
    """What backpressure bounds a buffer by (docs/ingest.md, direct source): the capacity plus
    one message, the largest a device sends during a burst."""
    return args.capacity + math.ceil(burst_rates(args)[1] * MESSAGE_INTERVAL_S)


def verdicts(samples: list[dict], args, result) -> dict:
    """The soak's figures and whether each target holds (``result``: the run's, or a dict
    with ``balanced``, ``produced`` and ``trained`` when re-summarised from JSON)."""
    period, on, warm = args.every_s, args.burst_s, args.warmup_s
    end = samples[-1]["t"] if samples else 0.0
    procs = sorted({p for s in samples for p in s["rss_mb"]})
    rss = {}
    for p in procs:
        early = [s["rss_mb"][p] for s in samples if warm <= s["t"] < warm + 300 and s["rss_mb"].get(p)]
        late = [s["rss_mb"][p] for s in samples if s["t"] >= end - 300 and s["rss_mb"].get(p)]
        if early and late:
            growth = statistics.mean(late) / statistics.mean(early) - 1
            rss[p] = {"after_warmup_mb": round(statistics.mean(early), 1), "last_5min_mb": round(statistics.mean(late), 1),
                      "growth": round(growth, 4), "ok": growth < MAX_RSS_GROWTH}
    max_depth = max((d for s in samples for d in s["depth"].values()), default=0.0)
    cycles = []
    for k in range(int(end // period) + 1):
        start = k * period
        if start + period > end:
            break
        before = [sum(s["lag"].values()) for s in samples if start - 20 <= s["t"] < start] or [0.0]
        during = [sum(s["lag"].values()) for s in samples if start <= s["t"] < start + on + 30]
        tail = [s for s in samples if start + period - 20 <= s["t"] < start + period]
        cycles.append({
            "burst_at_s": start,
            "lag_before": round(statistics.mean(before), 1),
            "lag_peak": round(max(during, default=0.0), 1),
            "lag_at_cycle_end": round(statistics.mean([sum(s["lag"].values()) for s in tail]) if tail else math.nan, 1),
            "paused_at_cycle_end": int(sum(max(s["paused"].values(), default=0) for s in tail[-1:])),
        })
    pauses = max((sum(s["pauses"].values()) for s in samples), default=0.0)
    baseline = min((c["lag_before"] for c in cycles[1:]), default=0.0)
    recovered = all(c["lag_at_cycle_end"] <= max(2 * baseline, baseline + 50 * args.devices) for c in cycles)
    if isinstance(result, dict):
        balanced, produced, trained = result["balanced"], result["produced"], result["trained"]
    else:
        balanced, produced = result.balanced, sum(result.produced.values())
        trained = sum(t.get("trained_records", 0) for n, t in result.training.items() if n != "server")
    return {
        "rss": rss, "rss_ok": bool(rss) and all(v["ok"] for v in rss.values()),
        "max_buffer_depth": max_depth, "capacity": args.capacity, "depth_bound": depth_bound(args),
        "depth_ok": max_depth <= depth_bound(args),
        "backpressure_pauses": pauses, "released": all(c["paused_at_cycle_end"] == 0 for c in cycles),
        "cycles": cycles, "lag_recovered": recovered,
        "balanced": balanced, "produced": produced, "trained": trained,
    }


def plot(samples: list[dict], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for p in sorted({p for s in samples for p in s["rss_mb"]}):
        axes[0].plot(t, [s["rss_mb"].get(p) or math.nan for s in samples], label=p)
    axes[0].set_ylabel("RSS (MB)")
    axes[0].legend(fontsize=7, ncol=3)
    for w in sorted({w for s in samples for w in s["lag"]}):
        axes[1].plot(t, [s["lag"].get(w, math.nan) for s in samples], label=w)
    axes[1].set_ylabel("consumer lag (records)")
    axes[1].legend(fontsize=7)
    axes[2].plot(t, [max(s["depth"].values(), default=0) for s in samples], label="deepest device buffer")
    axes[2].axhline(args.capacity, color="red", linestyle="--", label="capacity")
    axes[2].set_ylabel("buffer depth (records)")
    axes[2].set_xlabel("minutes")
    axes[2].legend(fontsize=7)
    for ax in axes:
        for k in range(int(samples[-1]["t"] // args.every_s) + 1):
            ax.axvspan(k * args.every_s / 60, (k * args.every_s + args.burst_s) / 60, color="orange", alpha=0.15)
    fig.suptitle(f"soak: {args.devices} devices, {args.workers} workers + server ({args.strategy}), "
                 f"bursts x{args.burst_ratio:g} for {args.burst_s:g} s every {args.every_s / 60:g} min")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report_md(v: dict, args, elapsed_s: float) -> str:
    def yes(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines = [
        "## Soak with bursts",
        "",
        f"Command: `scripts/with-venv.sh python -m edgestream bench soak --minutes {args.minutes:g}` "
        f"({elapsed_s / 60:.1f} min wall time).",
        "",
        f"Set-up: {args.devices} devices at {burst_rates(args)[0]:.1f} records/s, bursting to "
        f"{burst_rates(args)[1]:.1f} ({args.burst_ratio:g}x) for {args.burst_s:g} s every {args.every_s:g} s "
        f"(`bursty` profile, mean {args.rate:g} records/s); {args.workers} workers and a server "
        f"(`{args.strategy}`), MLP on digits; buffer.policy=backpressure, capacity {args.capacity}; samples every "
        f"{args.sample_s:g} s. Machine: {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"Kafka {kafka_version()}.",
        "",
        "| target | measured | verdict |",
        "|---|---|---|",
        f"| RSS growth after warm-up < {MAX_RSS_GROWTH:.0%} (every process) | "
        + ", ".join(f"{p} {r['growth']:+.1%}" for p, r in sorted(v["rss"].items())) + f" | {yes(v['rss_ok'])} |",
        f"| buffer depth <= capacity + one message ({v['depth_bound']}: backpressure's bound, docs/ingest.md) | "
        f"max {v['max_buffer_depth']:.0f} (capacity {v['capacity']}) | {yes(v['depth_ok'])} |",
        f"| backpressure engaged and released | {v['backpressure_pauses']:.0f} pauses; none paused at a cycle's end: "
        f"{v['released']} | {yes(v['backpressure_pauses'] > 0 and v['released'])} |",
        f"| consumer lag recovers after each burst | see cycles | {yes(v['lag_recovered'])} |",
        f"| accounting balances | produced {v['produced']}, trained {v['trained']} | {yes(v['balanced'])} |",
        "",
        "| burst at (s) | lag before | lag peak | lag at cycle end | partitions paused at cycle end |",
        "|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {c['burst_at_s']:.0f} | {c['lag_before']:.0f} | {c['lag_peak']:.0f} | {c['lag_at_cycle_end']:.0f} | "
              f"{c['paused_at_cycle_end']} |" for c in v["cycles"]]
    lines += ["", "| process | RSS after warm-up (MB) | RSS last 5 min (MB) | growth |", "|---|---:|---:|---:|"]
    lines += [f"| {p} | {r['after_warmup_mb']} | {r['last_5min_mb']} | {r['growth']:+.1%} |"
              for p, r in sorted(v["rss"].items())]
    lines += ["", "Plot: soak.png (bursts shaded).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="edgestream bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--devices", type=int, default=10)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--strategy", default="asp", help="a strategy with a server (asp, ssp, adsp)")
    p.add_argument("--rate", type=float, default=20.0, help="records/s per device outside bursts")
    p.add_argument("--burst-ratio", type=float, default=10.0)
    p.add_argument("--burst-s", type=float, default=30.0)
    p.add_argument("--every-s", type=float, default=300.0)
    # Small enough that a burst (10x the rate for 30 s) fills it: backpressure must engage and release.
    p.add_argument("--capacity", type=int, default=16)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--warmup-s", type=float, default=300.0)
    p.add_argument("--bootstrap", help="an existing cluster (default: a local broker for the soak)")
    p.add_argument("--out", type=Path, default=RESULTS / "soak")
    p.add_argument("--from-json", type=Path, help="re-summarise a finished soak's JSON (no run)")
    args = p.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        v = verdicts(saved["samples"], args, saved["verdicts"])
        elapsed = float(saved.get("elapsed_s", saved["samples"][-1]["t"]))
        return _write(args, saved["samples"], v, elapsed)
    state = Path(tempfile.mkdtemp(prefix="soak-"))
    cfg = job(args, state / "run")
    broker = None
    if args.bootstrap:
        bootstrap, broker_pid = args.bootstrap, None
    else:
        broker = LocalBroker(state / "kafka").start()
        bootstrap, broker_pid = broker.bootstrap, broker.proc.pid
    samples: list[dict] = []
    done = threading.Event()
    started = time.monotonic()

    def sampler(ctx: RunContext) -> None:
        while not done.is_set() and time.monotonic() - started < cfg.run.duration_s + 5:
            samples.append(sample(ctx, broker_pid, started))
            if len(samples) % 12 == 0:
                last = samples[-1]
                print(f"[soak] {last['t'] / 60:5.1f} min  RSS " + " ".join(
                    f"{k}={v:.0f}" for k, v in last["rss_mb"].items() if v) +
                      f"  lag={sum(last['lag'].values()):.0f}  depth={max(last['depth'].values(), default=0):.0f}",
                      flush=True)
            done.wait(args.sample_s)

    try:
        result = run_job(cfg, bootstrap, live=False, on_streaming=sampler)
    finally:
        done.set()
        if broker is not None:
            broker.stop()
    elapsed = time.monotonic() - started
    return _write(args, samples, verdicts(samples, args, result), elapsed)


def _write(args, samples: list[dict], v: dict, elapsed: float) -> int:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(x) for k, x in vars(args).items()},
                                                         "elapsed_s": elapsed, "verdicts": v, "samples": samples},
                                                        indent=1))
    plot(samples, args.out.with_suffix(".png"), args)
    args.out.with_suffix(".md").write_text(report_md(v, args, elapsed))
    print(report_md(v, args, elapsed))
    ok = v["rss_ok"] and v["depth_ok"] and v["released"] and v["lag_recovered"] and v["balanced"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
