"""Time to accuracy: ScaDLES vs BSP (fixed batch) vs the PyTorch DDP peer, on the real broker.

Ten devices stream at the ScaDLES rates (92 38 62 42 48 88 90 22 44 28 records/s) times
``--scale``; one worker process per device; every mode reads the same streams (same
seeds, partitioning, model, initial weights) and trains for the same time budget:

  bsp                     fixed batch of 64 per device, waits for it (the "waiting streamer")
  scadles                 time windows (``--window`` s), weighted aggregation, LR scaling
  scadles+compress        + top-k 10 % with error feedback, switched by the ScaDLES vote
  scadles+compress+inject + data injection (alpha = beta = 0.25)
  ddp                     torch.distributed DDP (gloo), one rank per device, fixed batch 64

Wall time is measured from the first record produced. TTA = the first of 3 consecutive
held-out evaluations >= ``--target``. Also reported: accuracy at the budget, max / p99
backlog per device (records produced but not yet trained on), gradient bytes sent,
fraction of compressed steps, mean staleness. The same comparison runs in the
simulated-clock runner (seconds, no Kafka) with its oracle (zero compute, zero transfer)
as the lower bound. Repeat r runs seed ``r`` (streams, shares, initial weights), real and
simulated alike; medians over the seeds. Writes benchmarks/results/time_to_accuracy.{json,md,png}.
Never asserts.

    python -m edgestream bench time_to_accuracy [--repeats 3] [--partitions iid,dirichlet]
        [--modes bsp,scadles,...] [--budget 60] [--scale 2] [--bootstrap HOST:PORT]
        [--sim-only | --no-sim] [--tune-lr [--lr-grid 0.5,1,2] [--tune-seed 1000]]

``--tune-lr`` (benchmarks/tuning.py, as ``bench strategies``) tunes on the simulated clock:
every simulated row, the oracle and BSP included, runs at each multiplier of ``--lr-grid`` on
the tuning seed (default 1000, never a reporting seed); the chooser picks one per (partition,
row), and the simulated reporting seeds run at it. The real runs take the simulated choice
for their (partition, mode), DDP BSP's (the same synchronous algorithm): tuning on the real
broker would cost the grid's size in hour-long sweeps, and the simulated clock is this
comparison's model of them (its costs are fitted to these runs). Not with ``--no-sim``.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from edgestream.benchmarks import censored, tuning
from edgestream.benchmarks.censored import censored_median, censored_ratio, median_bound
from edgestream.job.config import JobConfig, load_config
from edgestream.monitoring.scrape import scrape
from edgestream.pipeline.run import RunContext, run_job
from edgestream.streams.profiles import SCADLES_RATES
from edgestream.trainers.evaluation import time_to_target

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODES = ("bsp", "scadles", "scadles+compress", "scadles+compress+inject", "ddp")
SLOWDOWN = (1, 1, 1, 2, 2, 2, 4, 4, 8, 8)
BATCH = 64
#: ScaDLES's cap on one device's step batch (a window's records beyond it persist to the next).
MAX_BATCH = 2 * BATCH


@dataclass
class Settings:
    scale: float = 2.0
    window_s: float = 0.5
    budget_s: float = 60.0
    target: float = 0.9
    delta: float = 0.3
    eval_every_s: float = 0.5
    lr: float = 0.3
    momentum: float = 0.9
    seed: int = 0
    slowdown: tuple[float, ...] = SLOWDOWN


@dataclass
class ModeRun:
    """One mode on one partition in one repeat."""

    mode: str
    partition: str
    repeat: int
    seed: int = 0
    lr: float = 0.3
    tta_s: float | None = None
    final_accuracy: float = 0.0
    steps: int = 0
    bytes_sent: int = 0
    compressed_fraction: float = 0.0
    mean_staleness: float = 0.0
    max_backlog: dict[str, float] = field(default_factory=dict)
    p99_backlog: dict[str, float] = field(default_factory=dict)
    backlog_samples: dict[str, list[float]] = field(default_factory=dict)
    timeline: list[tuple[float, float]] = field(default_factory=list)
    error: str | None = None


def job_config(mode: str, partition: str, s: Settings, state: Path, tag: str, seed: int | None = None,
               lr: float | None = None, heldout_seed: int | None = None) -> JobConfig:
    """The job of one run: same streams for every mode, differing only in what is compared
    (``seed``: streams, shares and initial weights, default ``s.seed``; ``lr``: default ``s.lr``;
    ``heldout_seed``: the test split's own seed, default the job's)."""
    overrides = [
        f"job.name=tta{tag}", f"job.seed={s.seed if seed is None else seed}", f"run.state_dir={state / tag}",
        "devices.count=10", f"devices.ids={','.join(f'tta{tag}d{i}' for i in range(10))}",
        f"devices.rates_hz={','.join(str(r) for r in SCADLES_RATES)}", f"devices.time_scale={s.scale}",
        "devices.profile=poisson", "devices.message_interval_s=0.05",
        "workers.count=10", f"workers.slowdown={','.join(str(f) for f in s.slowdown)}",
        "data.source=digits", f"data.partition={partition}", "data.dirichlet_alpha=0.3",
        "buffer.policy=persist", "buffer.capacity=1000000",
        "train.enabled=true", "train.model=mlp", f"train.lr={s.lr if lr is None else lr}", f"train.momentum={s.momentum}",
        f"train.eval_every_s={s.eval_every_s}", "train.checkpoint_every_steps=1000000",
        f"train.max_step_batch={MAX_BATCH}",
        f"run.duration_s={s.budget_s}", "run.drain_timeout_s=30",
        f"data.heldout_seed={'job' if heldout_seed is None else heldout_seed}",
    ]
    if mode in ("bsp", "ddp"):
        overrides += ["batcher.mode=fixed", f"batcher.batch_size={BATCH}", "train.strategy=bsp"]
    else:
        params = [f"reference_per_worker={BATCH}"]
        overrides += ["batcher.mode=window", f"batcher.window_s={s.window_s}", f"batcher.max_batch={MAX_BATCH}",
                      "train.strategy=scadles"]
        if "compress" in mode:
            params += ["adaptive_compression=true", f"delta={s.delta}", "epoch_steps=10", "ratio=0.1"]
            overrides += ["train.codec=topk", "train.codec_params=ratio=0.1", "train.error_feedback=true"]
        if "inject" in mode:
            overrides += ["train.injection_alpha=0.25", "train.injection_beta=0.25"]
        overrides.append("train.strategy_params=" + ",".join(params))
    return load_config(overrides=overrides, env={})


class Sampler:
    """While a run streams: w0's evaluation log and every device's backlog, every 0.25 s."""

    def __init__(self) -> None:
        self.backlog: dict[str, list[float]] = {}

    def sample(self, ctx: RunContext) -> None:
        sim = scrape(ctx.simulator_url) if ctx.simulator_url else None
        if sim is None:
            return
        for w in ctx.workers:
            s = scrape(w.metrics_url) if w.metrics_url else None
            if s is None:
                continue
            trained = s.get("edgestream_trained_records_total", worker=w.name)
            for device in w.devices:  # one device per worker in this benchmark
                produced = sim.get("edgestream_records_produced_total", device=device)
                self.backlog.setdefault(device, []).append(max(0.0, produced - trained))

    def __call__(self, ctx: RunContext) -> None:
        while not ctx.stop.wait(0.25):  # poll interval of a sampler, not synchronisation
            self.sample(ctx)


def run_pipeline_mode(mode: str, partition: str, repeat: int, s: Settings, bootstrap: str, state: Path,
                      seed: int = 0, lr: float | None = None, heldout_seed: int | None = None) -> ModeRun:
    tag = uuid.uuid4().hex[:6]
    cfg = job_config(mode, partition, s, state, tag, seed, lr, heldout_seed)
    sampler = Sampler()
    result = run_job(cfg, bootstrap, console=Console(file=io.StringIO()), live=False,
                     on_streaming=sampler, drain=False)
    origin = json.loads((cfg.state_path() / "simulation.json").read_text())["started_at"]
    evals = [json.loads(line) for line in
             (cfg.state_path() / "workers" / "w0" / "evaluations.jsonl").read_text().splitlines()]
    timeline = [(e["t"] - origin, e["accuracy"]) for e in evals if e["t"] - origin <= s.budget_s]
    workers = [t for name, t in result.training.items() if name != "server"]
    steps = workers[0]["steps"]
    staleness = [t["staleness"].get("mean", 0.0) for t in workers if t.get("staleness")]
    run = ModeRun(mode, partition, repeat, seed, cfg.train.lr, timeline=timeline, steps=steps,
                  tta_s=time_to_target(timeline, s.target),
                  final_accuracy=timeline[-1][1] if timeline else 0.0,
                  bytes_sent=sum(t.get("bytes_sent", 0) for t in workers),
                  compressed_fraction=(sum(t.get("compressed_steps", 0) for t in workers)
                                       / max(1, sum(t["steps"] for t in workers))),
                  mean_staleness=statistics.fmean(staleness) if staleness else 0.0)
    fill_backlog(run, sampler.backlog)
    return run


def fill_backlog(run: ModeRun, samples: dict[str, list[float]]) -> None:
    run.backlog_samples = {device: [float(v) for v in values] for device, values in sorted(samples.items())}
    for device, values in sorted(samples.items()):
        run.max_backlog[device] = float(max(values)) if values else 0.0
        run.p99_backlog[device] = float(np.percentile(values, 99)) if values else 0.0


def run_ddp(partition: str, repeat: int, s: Settings, bootstrap: str, state: Path, seed: int = 0,
            lr: float | None = None, heldout_seed: int | None = None) -> ModeRun:
    """The DDP peer: the same simulators, one gloo rank per device reading its topic."""
    from edgestream.benchmarks import ddp_peer
    from edgestream.job.topics import sensor_topics_for
    from edgestream.pipeline.kafka_io import ensure_topics
    from edgestream.pipeline.simulate import simulate

    tag = uuid.uuid4().hex[:6]
    cfg = job_config("ddp", partition, s, state, tag, seed, lr, heldout_seed)
    out = cfg.state_path() / "ddp"
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = cfg.state_path() / "job.json"
    cfg_path.write_text(json.dumps(cfg.to_dict()))
    ensure_topics(bootstrap, sensor_topics_for(cfg.devices.device_ids()))
    procs = ddp_peer.launch(cfg_path, bootstrap, out, batch=BATCH, slowdown=list(s.slowdown),
                            duration_s=s.budget_s, target_accuracy=0.0, eval_every_s=s.eval_every_s)
    try:
        ddp_peer.wait_ready(out, procs, timeout_s=180)
        stop = threading.Event()
        report = simulate(cfg, bootstrap, s.budget_s, stop=stop)
        ddp_peer.stop(out, procs, timeout_s=60)
        result = ddp_peer.collect(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    origin = report.started_at
    timeline = [(t - origin, acc) for t, acc, _step in result["timeline_wall"] if t - origin <= s.budget_s]
    run = ModeRun("ddp", partition, repeat, seed, cfg.train.lr, timeline=timeline, steps=int(result["steps"]),
                  tta_s=time_to_target(timeline, s.target),
                  final_accuracy=timeline[-1][1] if timeline else 0.0,
                  bytes_sent=int(result["bytes_sent"]))
    fill_backlog(run, {d: v for d, v in result["backlog_samples"].items()})
    return run


def simulated(s: Settings, partitions: list[str], modes: list[str],
              rates: list[float] | None = None) -> dict[str, Any]:
    """The comparison on the simulated clock (plus its oracle) on ``s.seed`` at ``s.lr``, other base
    ``rates`` if given: ``{partition: [run, ...], "seconds": wall time}`` (benchmarks/scadles_rate_sweep.py)."""
    started = time.monotonic()
    out: dict[str, Any] = {p: sim_runs(s, p, modes, s.seed, 1.0, True, rates) for p in partitions}
    out["seconds"] = time.monotonic() - started
    return out


#: The simulated comparison's rows: the oracle (zero compute, zero transfer) and every mode but DDP.
SIM_ROWS = ("oracle",) + tuple(m for m in MODES if m != "ddp")


def sim_runs(s: Settings, partition: str, modes: list[str], seed: int, mult: float, with_oracle: bool,
             rates: list[float] | None = None, split: str = "seed") -> list[dict[str, Any]]:
    """The simulated comparison's runs of ``modes`` (and the oracle) on one seed at ``mult`` x the LR,
    its data split as ``split`` says (``tuning.SPLITS``)."""
    from edgestream.trainers import simclock

    if not modes and not with_oracle:
        return []
    reports = simclock.benchmark_comparison(
        partition=partition, scale=s.scale, window_s=s.window_s, batch=BATCH, target=s.target,
        budget_s=s.budget_s, slowdown=list(s.slowdown), lr=s.lr * mult, momentum=s.momentum, seed=seed,
        delta=s.delta, modes=modes, eval_every_s=s.eval_every_s, max_batch=MAX_BATCH, epoch_steps=10,
        message_interval_s=0.05, rates=rates, with_oracle=with_oracle, costs=sim_costs(s),
        on_validation=split == "tuning", **tuning.split_params(split))
    # Per-process and per-device detail stays out of the results (the backlog maxima are kept).
    return [{**{k: v for k, v in r.items() if k not in _SIM_DETAIL}, "partition": partition, "seed": seed,
             "lr_mult": mult, "lr": s.lr * mult, "acc_at_budget": r["final_accuracy"], "split": split}
            for r in reports]


_SIM_DETAIL = frozenset({"processes", "devices", "worker_timelines", "consensus_timeline"})


def sim_costs(s: Settings) -> Any:
    """The real runs' costs on this machine, as the simulated clock models them."""
    from edgestream.trainers import simclock

    # Per step on this machine: ~1 ms of torch, but ~20 ms of executor hops and Kafka round
    # trips with ten workers sharing two cores; a 100 Mbit/s, 10 ms link. A --slowdown
    # shorter than the devices repeats, as the real run's workers.slowdown does (the default
    # gives one per device; "1" is all 1 either way).
    return simclock.CostModel(compute_base_s=0.02, compute_per_record_s=2e-5, slowdowns=tuple(s.slowdown),
                              latency_s=0.01, bandwidth_bytes_per_s=12.5e6, fill="cycle")


def _sim_cell(r: dict[str, Any]) -> tuple[str, str]:
    return (r["partition"], r["mode"])


def simulated_seeds(s: Settings, partitions: list[str], modes: list[str], seeds: list[int],
                    tune: tuning.TuneSpec | None = None, progress=print,
                    rates: list[float] | None = None) -> dict[str, Any]:
    """The simulated comparison on every seed, each row (the oracle included) at its learning rate:
    with ``tune``, the multiplier chosen per (partition, row) on the tuning seeds (benchmarks/tuning.py);
    other base ``rates`` (one per device, before ``s.scale``) if given."""
    started = time.monotonic()
    rows = [m for m in SIM_ROWS if m == "oracle" or m in modes]
    tune_raw: list[dict[str, Any]] = []
    choices: dict[Any, dict[str, Any]] = {}
    if tune is not None:
        for partition in partitions:
            for seed in tune.seeds:
                for mult in tune.grid:
                    tune_raw += sim_runs(s, partition, rows[1:], seed, mult, True, rates, "tuning")
                    progress(f"tuning {partition} seed {seed} lr x{mult:g}: " + ", ".join(
                        f"{r['mode']} {_tta_text(r['tta_s'])}" for r in tune_raw[-len(rows):]))
        choices = tuning.choose_cells(tune_raw, tune, _sim_cell)
    raw: list[dict[str, Any]] = []
    for partition in partitions:
        mults = {row: choices.get((partition, row), {}).get("chosen_mult", 1.0) for row in rows}
        for seed in seeds:
            for mult in sorted(set(mults.values())):
                at = [row for row in rows[1:] if mults[row] == mult]
                raw += sim_runs(s, partition, at, seed, mult, mults["oracle"] == mult, rates, tuning.run_split(tune))
            progress(f"{partition} seed {seed}: " + ", ".join(
                f"{r['mode']} {_tta_text(r['tta_s'])}" for r in raw if r["partition"] == partition
                and r["seed"] == seed))
    return {"seeds": seeds, "rows": rows, "partitions": partitions, "runs": raw,
            "summary": sim_summary(raw, partitions, rows, seeds, s.budget_s),
            "tuning": None if tune is None else {
                **tune.to_json(), "choices": {f"{p}/{row}": rec for (p, row), rec in choices.items()},
                "runs": tune_raw},
            "seconds": time.monotonic() - started}


def _tta_text(tta: float | None) -> str:
    return "missed" if tta is None else f"{tta:.1f} s"


def sim_summary(raw: list[dict[str, Any]], partitions: list[str], rows: list[str], seeds: list[int],
                budget_s: float) -> dict[str, Any]:
    """Per (partition, row): the median over seeds of the TTA, of its ratio to BSP's and of its
    multiple of the oracle's on the same seed (misses kept as bounds), and of the other figures."""
    by = {(r["partition"], r["mode"], r["seed"]): r for r in raw}
    out: dict[str, Any] = {}
    for partition in partitions:
        for row in rows:
            runs = [by[k] for seed in seeds if (k := (partition, row, seed)) in by]
            if not runs:
                continue

            out[f"{partition}/{row}"] = {
                "partition": partition, "mode": row, "seeds": [r["seed"] for r in runs],
                "lr_mult": runs[0]["lr_mult"], "lr": runs[0]["lr"],
                "tta": censored_median([r["tta_s"] for r in runs], budget_s),
                "tta_all": [r["tta_s"] for r in runs],
                "speedup_vs_bsp": _per_seed_ratio(by, runs, "bsp", budget_s, invert=True),
                "x_oracle": _per_seed_ratio(by, runs, "oracle", budget_s, invert=False),
                "final_accuracy": statistics.median(r["final_accuracy"] for r in runs),
                "max_backlog": max(max(r["max_backlog"].values(), default=0.0) for r in runs),
                "bytes_sent": statistics.median(r["bytes_sent"] for r in runs),
                "compressed_fraction": statistics.median(r["compressed_fraction"] for r in runs),
            }
    return out


def _per_seed_ratio(by: dict[tuple[str, str, int], dict[str, Any]], runs: list[dict[str, Any]], base: str,
                    budget_s: float, invert: bool) -> dict[str, Any] | None:
    """The median over ``runs``' seeds of their TTA / ``base``'s on the same seed (``invert``: the
    other way round), a miss counted as the budget and marked."""
    values = []
    for r in runs:
        other = by.get((r["partition"], base, r["seed"]))
        if other is r:  # the base itself: 1, even when it missed
            values.append({"value": 1.0, "bound": "="})
        elif other is not None:
            a, b = (other["tta_s"], r["tta_s"]) if invert else (r["tta_s"], other["tta_s"])
            values.append(censored_ratio(a, b, budget_s))
    return median_bound(values)


def _tta_cell(tta: dict[str, Any] | None) -> str:
    """A censored median TTA with its min-max: ``>60.0`` when most runs missed."""
    return censored.text(tta, 1)


def _bound_text(v: dict[str, Any] | None, suffix: str = "") -> str:
    return censored.text(v, 2, suffix)


def sim_seeds_markdown(sim: dict[str, Any], s: Settings) -> str:
    seeds = ", ".join(map(str, sim["seeds"]))
    lines = [f"Simulated clock (no Kafka), {sim['seconds']:.0f} s for all runs; same streams and settings; seeds "
             f"{seeds} (streams, shares, initial weights); medians over the seeds with the min-max. \"vs BSP\": "
             "BSP's TTA / the row's on the same seed (> 1 is faster than BSP); \"x oracle\": the row's TTA / the "
             "oracle's; `>` / `<`: a seed missed the target within the budget (counted as the budget).", "",
             "| partition | mode | LR | TTA s | vs BSP | x oracle | acc @ budget | max backlog | MB sent | compressed |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in sim["summary"].values():
        lines.append(f"| {row['partition']} | {row['mode']} | {row['lr']:.3g} | {_tta_cell(row['tta'])} | "
                     f"{_bound_text(row['speedup_vs_bsp'], 'x')} | {_bound_text(row['x_oracle'])} | "
                     f"{row['final_accuracy']:.3f} | {row['max_backlog']:.0f} | {row['bytes_sent'] / 1e6:.1f} | "
                     f"{row['compressed_fraction']:.0%} |")
    if sim.get("tuning"):
        tune = tuning.TuneSpec(tuple(sim["tuning"]["grid"]), tuple(sim["tuning"]["seeds"]))
        choices = {tuple(k.split("/", 1))[::-1]: rec for k, rec in sim["tuning"]["choices"].items()}
        lines += ["", *tuning.markdown_table(choices, sim["rows"], sim["partitions"], tune,
                                             "Learning rate chosen on the simulated tuning seed (row: mode; column: "
                                             "partition)")]
    return "\n".join(lines)


def summarise(runs: list[ModeRun], partitions: list[str], modes: list[str], budget_s: float) -> dict[str, Any]:
    """Per (partition, mode) of the real runs: the median TTA (a miss kept as ``> budget``), the
    median over seeds of BSP's TTA / the mode's on the same seed, and medians of the rest."""
    ok = [r for r in runs if r.error is None]
    by = {(r.partition, r.mode, r.seed): {"partition": r.partition, "seed": r.seed, "tta_s": r.tta_s} for r in ok}
    table: dict[str, Any] = {}
    for partition in partitions:
        for mode in modes:
            sel = [r for r in ok if r.partition == partition and r.mode == mode]
            if not sel:
                continue
            table[f"{partition}/{mode}"] = {
                "partition": partition, "mode": mode, "repeats": len(sel), "lr": sel[0].lr,
                "seeds": [r.seed for r in sel],
                "tta": censored_median([r.tta_s for r in sel], budget_s), "tta_all": [r.tta_s for r in sel],
                "speedup_vs_bsp": _per_seed_ratio(by, [by[(partition, mode, r.seed)] for r in sel], "bsp", budget_s,
                                                  invert=True),
                "final_accuracy": statistics.median(r.final_accuracy for r in sel),
                "max_backlog": max(max(r.max_backlog.values(), default=0.0) for r in sel),
                "p99_backlog": max(max(r.p99_backlog.values(), default=0.0) for r in sel),
                "bytes_sent": statistics.median(r.bytes_sent for r in sel),
                "compressed_fraction": statistics.median(r.compressed_fraction for r in sel),
                "mean_staleness": statistics.median(r.mean_staleness for r in sel),
                "steps": statistics.median(r.steps for r in sel),
            }
    return table


def markdown(table: dict[str, Any], s: Settings, seeds: list[int] | None = None, tuned: bool = False) -> str:
    where = (" LR: the multiplier the simulated clock's tuning chose for the same partition and mode (below; "
             "ddp: bsp's)." if tuned else f" LR {s.lr:g} for every mode.")
    lines = [
        f"Real broker, real processes. Target {s.target:.0%} held for 3 evaluations; budget {s.budget_s:.0f} s; "
        f"rates x{s.scale:g}; window {s.window_s:g} s; slowdown {' '.join(f'{x:g}' for x in s.slowdown)}; seeds "
        f"{', '.join(map(str, seeds or [s.seed]))} (streams, shares, initial weights), one run each; medians with the "
        f"min-max; vs BSP: BSP's TTA / the mode's on the same seed; `>`: a run missed (counted as the budget).{where}",
        "",
        "| partition | mode | LR | TTA s | vs BSP | acc @ budget | max backlog | p99 backlog "
        "| MB sent | compressed | staleness | steps | seeds |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in table.values():
        lines.append(
            f"| {row['partition']} | {row['mode']} | {row['lr']:.3g} | {_tta_cell(row['tta'])} | "
            f"{_bound_text(row['speedup_vs_bsp'], 'x')} | {row['final_accuracy']:.3f} "
            f"| {row['max_backlog']:.0f} | {row['p99_backlog']:.0f} | {row['bytes_sent'] / 1e6:.1f} "
            f"| {row['compressed_fraction']:.0%} | {row['mean_staleness']:.2f} | {row['steps']:.0f} "
            f"| {row['repeats']} |"
        )
    return "\n".join(lines)


def plot(runs: list[ModeRun], partitions: list[str], s: Settings, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(partitions), figsize=(6.5 * len(partitions), 4.2), squeeze=False)
    for ax, partition in zip(axes[0], partitions, strict=True):
        for mode in MODES:
            sel = [r for r in runs if r.partition == partition and r.mode == mode and r.timeline]
            if not sel:
                continue
            r = sel[0]
            ax.plot([t for t, _ in r.timeline], [a for _, a in r.timeline], label=mode, linewidth=1.4)
        ax.axhline(s.target, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{partition}: held-out accuracy vs wall time (repeat 0)")
        ax.set_xlabel("seconds since the first record")
        ax.set_ylabel("held-out accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def real_learning_rates(sim: dict[str, Any] | None, s: Settings, partitions: list[str],
                        modes: list[str]) -> dict[tuple[str, str], float]:
    """Each real run's LR: the simulated clock's choice for its (partition, mode) when it tuned
    (ddp: bsp's, the same synchronous algorithm), else ``s.lr``."""
    choices = (sim or {}).get("tuning") or {}
    out = {}
    for partition in partitions:
        for mode in modes:
            rec = choices.get("choices", {}).get(f"{partition}/{'bsp' if mode == 'ddp' else mode}")
            out[(partition, mode)] = s.lr * (rec["chosen_mult"] if rec else 1.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode and partition (interleaved)")
    parser.add_argument("--partitions", default="iid,dirichlet",
                        help="comma list of label partitions across devices: iid, dirichlet")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of modes (default all: {', '.join(MODES)})")
    parser.add_argument("--budget", type=float, default=Settings.budget_s, help="seconds of streaming per run")
    parser.add_argument("--scale", type=float, default=Settings.scale, help="multiplies every device rate")
    parser.add_argument("--window", type=float, default=Settings.window_s, help="ScaDLES window, seconds")
    parser.add_argument("--target", type=float, default=Settings.target,
                        help="test accuracy the time-to-accuracy figure waits for")
    parser.add_argument("--delta", type=float, default=Settings.delta, help="ScaDLES vote threshold")
    parser.add_argument("--slowdown", default=" ".join(str(f) for f in SLOWDOWN),
                        help="per-device compute slowdown factors, applied by waiting (\"1\" for none)")
    parser.add_argument("--no-sim", action="store_true", help="skip the simulated-clock comparison")
    parser.add_argument("--sim-only", action="store_true", help="only the simulated-clock comparison (no Kafka)")
    parser.add_argument("--bootstrap", help="existing cluster (default: start a local broker)")
    parser.add_argument("--out", default=str(RESULTS / "time_to_accuracy"), help="output path without suffix")
    tuning.add_arguments(parser)
    args = parser.parse_args()
    # A terminated benchmark still stops the broker and the processes of the run in progress.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    s = Settings(scale=args.scale, window_s=args.window, budget_s=args.budget, target=args.target, delta=args.delta,
                 slowdown=tuple(float(x) for x in args.slowdown.replace(",", " ").split()))
    partitions = [p for p in args.partitions.split(",") if p]
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    seeds = [s.seed + r for r in range(args.repeats)]
    tune = tuning.from_args(parser, args, seeds)
    if tune is not None and args.no_sim:
        parser.error("--tune-lr tunes on the simulated clock (the real runs take its choices): not with --no-sim")
    console = Console(stderr=True)

    from edgestream.deploy.kafka.broker import LocalBroker, kafka_version

    work = Path(tempfile.mkdtemp(prefix="bench-tta-"))
    broker = None
    bootstrap = args.bootstrap
    runs: list[ModeRun] = []
    sim: dict[str, Any] | None = None
    try:
        if not args.no_sim:
            console.print("[bold]simulated clock[/bold]: running the same comparison without Kafka ...")
            sim = simulated_seeds(s, partitions, modes, seeds, tune, progress=console.print)
            console.print(sim_seeds_markdown(sim, s))
        real_lr = real_learning_rates(sim, s, partitions, modes)
        # Tuned, every real run is tested on the simulated runs' fixed split (benchmarks/tuning.py).
        split_seed = tuning.split_params(tuning.run_split(tune)).get("heldout_seed")
        if args.sim_only:
            runs = []
        elif not bootstrap:
            broker = LocalBroker(work / "kafka").start()
            bootstrap = broker.bootstrap
        total = 0 if args.sim_only else args.repeats * len(partitions) * len(modes)
        done = 0
        for repeat in range(args.repeats if total else 0):
            for partition in partitions:
                for mode in modes:  # modes interleaved within a repeat (A B C ... A B C)
                    done += 1
                    seed, lr = seeds[repeat], real_lr[(partition, mode)]
                    console.print(f"[{done}/{total}] seed {seed} {partition} {mode} (LR {lr:.3g}) ...")
                    try:
                        run = (run_ddp(partition, repeat, s, bootstrap, work, seed, lr, split_seed) if mode == "ddp"
                               else run_pipeline_mode(mode, partition, repeat, s, bootstrap, work, seed, lr,
                                                      split_seed))
                    except Exception as exc:  # one failed run must not lose the others' figures
                        console.print(f"  [red]failed[/red]: {exc}")
                        run = ModeRun(mode, partition, repeat, seed, lr, error=str(exc))
                    else:
                        tta = f"{run.tta_s:.1f} s" if run.tta_s is not None else "missed"
                        console.print(f"  TTA {tta}, accuracy at budget {run.final_accuracy:.3f}, "
                                      f"steps {run.steps}, max backlog {max(run.max_backlog.values(), default=0):.0f}")
                    runs.append(run)
    finally:
        if broker is not None:
            broker.stop()
    shutil.rmtree(work, ignore_errors=True)  # its broker's log and the processes' logs; a run that failed keeps them (it raised above)
    table = summarise(runs, partitions, modes, s.budget_s)
    parts = [markdown(table, s, seeds, tuned=tune is not None)] if runs else []  # --sim-only: no real table
    if sim is not None:
        parts.append(sim_seeds_markdown(sim, s))
    md = "\n\n".join(parts)
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if runs:
        plot(runs, partitions, s, out.with_suffix(".png"))
    out.with_suffix(".md").write_text(md + "\n")
    out.with_suffix(".json").write_text(json.dumps({
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": __import__("os").cpu_count()},
        "kafka": kafka_version(), "settings": s.__dict__, "partitions": partitions, "modes": modes, "seeds": seeds,
        "real_lr": {f"{p}/{m}": lr for (p, m), lr in real_lr.items()},
        "table": table, "runs": [r.__dict__ for r in runs], "simulated": sim,
    }, indent=2, default=str))
    console.print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}"
                  + (f", {out.with_suffix('.png')}" if runs else ""))


if __name__ == "__main__":
    main()
