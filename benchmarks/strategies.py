"""Strategy matrix: which strategy wins where (BENCHMARKS.md, "Strategy matrix").

Rows: every registered strategy in a sensible configuration, plus today's ScaDLES
ablations, plus the zero-wait oracle:

  bsp                      fixed batch of 64 per device, waits for it (the "waiting streamer")
  asp                      parameter server, fixed batch 64 per worker, never waits for peers;
                           staleness bound ``max_staleness`` (4): staler gradients rejected;
                           per-update LR ``lr * 64 / (64 N)`` (the linear rule every row uses)
  ssp(s=3), ssp(s=40)      SSP (ADSP paper's baselines): ASP's server and LR, no staleness rejection;
                           a worker more than s clocks ahead of the slowest blocks; server steps
                           scaled by 1 / (1 + staleness) (``staleness_lr = "inverse"``)
  adsp                     local SGD at the BSP LR (0.3) on each worker, fixed batch 64, never waits;
                           commits every max(0.2 s, period / C) with period 10 s and C = 10 at the
                           start (a commit a second), online search for C on; server W += delta / N
  localsgd                 fixed-period local SGD: H = 4 local steps at the BSP LR, then the
                           weighted average of the deltas (BSP-like rounds), momentum kept locally
  scadles                  time windows, weighted aggregation, linear LR scaling
  scadles+compress         + top-k 10 % with error feedback, switched by the ScaDLES vote
  scadles+compress+inject  + data injection (alpha = beta = 0.25)
  gossip                   serverless decentralised SGD on a ring (Metropolis weights), fixed batch 64,
                           LR 0.3 per local step, asynchronous (max_lag unset); point-to-point inbox
  edgegossip               + balanced batches b_i = B_total r_i / sum r (B_total = 64 N, window batcher
                           with 0.3 s windows), data- and accuracy-weighted mixing, plateau LR decay
  dlion                    DLion (trainers/strategies/dlion.py): all-to-all gradient exchange, one optimizer
                           step per gradient at LR 0.3 x b_j / sum b; weighted dynamic batching (B_total = 64 N,
                           window batcher with 0.3 s windows, b_i in [4, 256]), per-link prioritised partial
                           messages with per-link residuals, knowledge transfer (the best node's model merged
                           with lambda 0.5 into nodes > 2 points worse, every 20 iterations);
                           asynchronous (max_lag None; the strategy's default is 2)
  dlion-wb                 dlion without weighted batching (fixed b_i = 64 per node: weighted_batching=false)
  dlion-prio               dlion without the prioritised exchange (every peer gets the dense gradient:
                           prioritised=false)
  dlion-kt                 dlion without knowledge transfer (knowledge_transfer=false)
  oracle                   BSP on window batches at zero compute and transfer cost

The dlion rows' parameters differing from the strategy's defaults are ``dlion_params``
(``Settings.dlion_*``; benchmarks/dlion.py has the full comparison and why).

The gossip and dlion rows have no server and no common model: every worker evaluates its own
model (``RunConfig.evaluate_workers``) and their accuracy is the mean of the nodes'
held-out accuracies (benchmarks/gossip.py has the full comparison).

The stage-split strategies (pipeline_bp, dni, cdni) have their own table (a model cut in
two stages, one worker and device each: ``stage_split_runs``), run with the default matrix.
A registered whole-model strategy without a configuration here still gets a row (its preferred
batcher, default parameters) and a note. Columns: the heterogeneity regimes of
BENCHMARKS.md, each with IID and Dirichlet(0.3) digits:

  rates    ScaDLES rates 92 38 62 42 48 88 90 22 44 28 /s, compute all 1, links equal
  compute  every rate the mean of that list, slowdowns 1 1 1 2 2 2 4 4 8 8, links equal
  both     ScaDLES rates, slowdowns 1 1 1 2 2 2 4 4 8 8, links equal
  network  ScaDLES rates, compute all 1, host links 100 100 20 20 5 5 1 1 100 100 Mbit/s

(the issue's "(d) = (c) with Dirichlet" is the ``both`` column with Dirichlet data).
All rates times ``--scale`` (2, as benchmarks/time_to_accuracy.py). Every cell runs on the
simulated clock (trainers/simclock.py) with each cost model of ``--cost-model`` (by default
two: the simulator's default ``CostModel`` and ``calibrated``, one calibrated to this
machine: ``compute_gradient`` timed with one torch thread, fitted ``c0 + c1 * b``; transfer
as the default: 100 Mbit/s, 2 ms, real encoded message sizes). ``--cost-model SPEC``
(repeatable; ``--costs a,b`` is the older spelling, one spec per item) takes ``calibrated``
or any spec of trainers/costmodels.py: a preset (``default``, ``edge-compute``,
``edge-network``), a ``.toml`` file, either with ``:KEY=VALUE,...`` overrides; each is one
cost model of the matrix, by its name. The regime's slowdowns and host links apply unless
the cost model sets its own lists (``slowdowns``, ``links_mbit``; its ``fill`` rule then
applies). "Equal links" are hosts at the cost model's ``bandwidth_mbit`` (100 Mbit/s for
default and calibrated); the network regime's links are absolute Mbit/s. With per-host links
the simulator also charges downloads (every record of a subscribed channel, over the host's
link). Figures: TTA (90 % held for 3 evaluations) as a ratio to BSP's on the same seed
and as a multiple of the oracle's, and accuracy at ``--acc-budget``; medians of
``--repeats`` seeds with the min-max spread.

``--real REGIME/PARTITION:ROWS`` also runs that subset on the real broker (real processes,
wall time, one worker per device, as benchmarks/time_to_accuracy.py does) and puts the
simulated prediction for the same job beside it. Writes benchmarks/results/strategies.{json,md,png}.
Never asserts.

    python -m edgestream bench strategies [--repeats 3] [--jobs 2] [--budget 120] [--acc-budget 60]
        [--regimes rates,compute,both,network] [--partitions iid,dirichlet] [--rows bsp,asp,...]
        [--cost-model default --cost-model calibrated --cost-model edge-network --cost-model my.toml ...]
        [--real both/iid:bsp,scadles,asp] [--real-repeats 1] [--real-workers 10] [--bootstrap HOST:PORT]
        [--reuse-matrix results/strategies.json [--rerun ROWS]] [--real-from OLD.json] [--real-first-seed N]
        [--tune-lr [--lr-grid 0.5,1,2] [--tune-seed 1000]]

``--tune-lr`` (off by default) tunes every cell's learning rate before the reporting runs
(benchmarks/tuning.py): each (cost model, regime, partition, row) cell, BSP and the oracle
included, runs once per multiplier of ``--lr-grid`` (default 0.5, 1, 2) on the tuning seed
(``--tune-seed``, default 1000 + the first seed; a reporting seed is refused). A multiplier
scales the run's LR and the row's own LR where it sets one (ASP's and SSP's per-update
``lr * 64 / (64 N)``), so every row's LR rule keeps its shape. The chooser takes the smallest
TTA on the tuning seed; if every multiplier missed, the highest accuracy at ``--acc-budget``,
then the lowest held-out loss; ties towards x1, then the smaller multiplier. The reporting
seeds then run at the chosen multiplier: every ratio is against tuned BSP and the tuned
oracle. The JSON's ``tuning`` holds the grid, seeds, rule, every tuning run and the choice
per cell (``choices``, keyed ``COST/REGIME/PARTITION/ROW``, ``zero/...`` for the oracle),
and each cell its ``tuning`` record (``points``: every multiplier's TTA, accuracy and loss;
``chosen_mult``, ``lr``); every run records ``lr_mult`` and its trainer ``lr``. The markdown
has a table of the chosen multipliers per cost model. ``--reuse-matrix`` of a tuned file needs
the same ``--tune-lr --lr-grid --tune-seed`` (its tuning runs are reused; ``--rerun`` rows are
tuned again); ``--real`` is refused with it, and the stage-split table is not tuned.

``--real-workers N`` runs the real subset on the regime's first N devices (e.g. ``--real
both/iid:bsp,adsp --real-workers 4``). Real-broker entries are kept across invocations: those
of the ``--reuse-matrix`` file and of ``--real-from`` files (a new run of the same subset,
seed and row replaces its entry). ``--real-step-cost BASE,PER_RECORD`` gives the live workers
an emulated device compute cost (``workers.step_base_s``, ``workers.step_per_record_s``: a
step on n records lasts at least (BASE + PER_RECORD n) x slowdown); by default the
simulator's default cost model (0.01,0.002) when the real workers have compute slowdowns, so
the live runs match the default prediction beside them. ``--real-row-params
adsp:commit_rate=2,search=false`` replaces a row's strategy parameters in the real subset and
its prediction alike.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np

from edgestream.benchmarks import censored, claims, parallel, tuning
from edgestream.benchmarks.censored import censored_median, censored_ratio, median_bound
from edgestream.streams.profiles import SCADLES_RATES
from edgestream.trainers import costmodels, simclock, strategies

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BATCH = 64
#: ScaDLES's cap on one device's step batch (as benchmarks/time_to_accuracy.py).
MAX_BATCH = 2 * BATCH
SLOWDOWN = (1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0)
#: The testbed's host links (BENCHMARKS.md: "100 100 20 20 5 5 1 1 ..."), the pattern
#: repeated for ten hosts.
NETWORK_MBIT = (100.0, 100.0, 20.0, 20.0, 5.0, 5.0, 1.0, 1.0, 100.0, 100.0)
EQUAL_MBIT = 100.0
#: DLion's prioritised exchange in the dlion rows: the strategy's defaults, stated (flags of
#: benchmarks/dlion.py; its results/dlion.md has a sweep of ``budget_safety``).
MIN_RATIO = 0.001
BUDGET_SAFETY = 0.9
ROWS = ("bsp", "asp", "ssp(s=3)", "ssp(s=40)", "adsp", "localsgd", "scadles", "scadles+compress",
        "scadles+compress+inject", "gossip", "edgegossip", "dlion", "dlion-wb", "dlion-prio", "dlion-kt")
#: DLion and its ablations: each row switches one part off (benchmarks/dlion.py).
#: ``dlion-base`` (all three off: dense all-to-all SGD with the lag bound) is benchmarks/dlion.py's
#: reference for them, not a matrix row.
DLION_ROWS = {"dlion": {}, "dlion-wb": {"weighted_batching": False}, "dlion-prio": {"prioritised": False},
              "dlion-kt": {"knowledge_transfer": False},
              "dlion-base": {"weighted_batching": False, "prioritised": False, "knowledge_transfer": False}}
#: Serverless rows without identical replicas: every worker's model is evaluated and the
#: job's accuracy is the mean of the nodes' (``RunConfig.evaluate_workers``).
MEAN_OF_NODES_ROWS = ("gossip", "edgegossip", *DLION_ROWS)
PARTITIONS = ("iid", "dirichlet")
#: The matrix's cost models without ``--cost-model``: ``calibrated`` is this benchmark's own
#: (measured at the start of a run), every other name a spec of trainers/costmodels.py.
COST_MODELS = ("default", "calibrated")
CALIBRATED = "calibrated"


@dataclass(frozen=True)
class Regime:
    name: str
    rates: tuple[float, ...]
    slowdowns: tuple[float, ...]
    links_mbit: tuple[float, ...]
    what: str


def regimes() -> dict[str, Regime]:
    scadles = tuple(float(r) for r in SCADLES_RATES)
    mean = sum(scadles) / len(scadles)
    ones = (1.0,) * len(scadles)
    equal = (EQUAL_MBIT,) * len(scadles)
    return {
        "rates": Regime("rates", scadles, ones, equal, "ScaDLES rates, compute all 1, links equal"),
        "compute": Regime("compute", (mean,) * len(scadles), SLOWDOWN, equal,
                          f"all rates {mean:g}/s, slowdowns {' '.join(f'{x:g}' for x in SLOWDOWN)}, links equal"),
        "both": Regime("both", scadles, SLOWDOWN, equal,
                       f"ScaDLES rates, slowdowns {' '.join(f'{x:g}' for x in SLOWDOWN)}, links equal"),
        "network": Regime("network", scadles, ones, NETWORK_MBIT,
                          f"ScaDLES rates, compute all 1, links {' '.join(f'{x:g}' for x in NETWORK_MBIT)} Mbit/s"),
    }


def heterogeneity(values: tuple[float, ...]) -> float:
    """H = sum(x) / (N * min(x))."""
    return sum(values) / (len(values) * min(values))


@dataclass
class Settings:
    """The time-to-accuracy benchmark's settings (so the real subset is the same job)."""

    scale: float = 2.0
    window_s: float = 0.5
    budget_s: float = 120.0
    acc_budget_s: float = 60.0
    target: float = 0.9
    delta: float = 0.3
    epoch_steps: int = 10
    eval_every_s: float = 0.5
    message_interval_s: float = 0.05
    lr: float = 0.3
    momentum: float = 0.9
    asp_max_staleness: int = 4
    adsp_period_s: float = 10.0
    adsp_commit_rate: int = 10
    adsp_min_interval_s: float = 0.2
    localsgd_period_steps: int = 4
    gossip_topology: str = "ring"
    edge_window_s: float = 0.3
    dlion_min_ratio: float = MIN_RATIO
    dlion_budget_safety: float = BUDGET_SAFETY
    dlion_max_lag: int | None = None
    repeats: int = 3
    first_seed: int = 0


# -- the rows --------------------------------------------------------------------------------


def row_modes(streams: simclock.StreamSet, s: Settings) -> dict[str, simclock.Mode]:
    """Every configured row, and a default-configured row for any other registered strategy."""
    n = len(streams.devices)
    reference = BATCH * n
    sc = simclock.default_modes(streams, batch_size=BATCH, window_s=s.window_s, max_batch=MAX_BATCH,
                                delta=s.delta, epoch_steps=s.epoch_steps, ratio=0.1, alpha=0.25, beta=0.25)
    by_name = {m.name: m for m in sc}
    out = {
        "bsp": by_name["bsp"],
        # Each worker's gradient is applied on its own: the same linear rule lr * b / B_ref.
        "asp": simclock.Mode("asp", "asp", {"max_staleness": s.asp_max_staleness}, batcher="fixed",
                             batch_size=BATCH, lr=s.lr * BATCH / reference),
        # SSP: ASP's server and per-update LR, fast workers block s clocks ahead of the slowest;
        # steps scaled by 1 / (1 + staleness) (without it, momentum 0.9 on stale gradients
        # oscillates: s = 3 stayed below 50 % in the compute and both regimes).
        **{f"ssp(s={bound})": simclock.Mode(f"ssp(s={bound})", "ssp", {"staleness": bound, "staleness_lr": "inverse"},
                                            batcher="fixed",
                                            batch_size=BATCH, lr=s.lr * BATCH / reference) for bound in (3, 40)},
        # ADSP: local SGD at the BSP LR on each worker, commits W += delta / N every period / C s.
        "adsp": simclock.Mode("adsp", "adsp", adsp_params(s), batcher="fixed", batch_size=BATCH),
        # Local SGD: H local steps at the BSP LR, then a BSP-like average of the deltas.
        "localsgd": simclock.Mode("localsgd", "localsgd", {"period_steps": s.localsgd_period_steps},
                                  batcher="fixed", batch_size=BATCH),
        "scadles": by_name["scadles"],
        "scadles+compress": by_name["scadles+compress"],
        "scadles+compress+inject": by_name["scadles+compress+inject"],
        # Gossip: every node steps at the BSP LR on its own batch of 64 and mixes with its ring
        # neighbours; EdgeGossip balances b_i = B_total r_i / sum r (B_total = 64 N) through the
        # window batcher (a step takes up to b_i of the records waiting).
        "gossip": simclock.Mode("gossip", "gossip", {"topology": s.gossip_topology}, batcher="fixed",
                                batch_size=BATCH),
        "edgegossip": simclock.Mode("edgegossip", "edgegossip",
                                    {"topology": s.gossip_topology, "batch_size": BATCH, "max_batch": 256},
                                    batcher="window", window_s=s.edge_window_s, max_batch=256),
    }
    for row, off in DLION_ROWS.items():
        # DLion's own batch rule through the window batcher (a step takes up to b_i records).
        out[row] = simclock.Mode(row, "dlion", {**dlion_params(s), **off}, batcher="window", window_s=s.edge_window_s,
                                 max_batch=256)
    configured = {m.strategy for m in out.values()}
    for name in strategies.names():
        if name not in configured:
            batcher = _preferred_batcher(name) or "fixed"
            out[name] = simclock.Mode(name, name, {}, batcher=batcher, batch_size=BATCH, window_s=s.window_s,
                                      max_batch=MAX_BATCH)
    return out


def adsp_params(s: Settings) -> dict[str, Any]:
    """ADSP's parameters for runs of 10-120 simulated seconds: a check period of
    ``adsp_period_s`` (the paper's 60 s would not end one period before most runs reach
    the target) with ``C`` starting at ``adsp_commit_rate`` (a commit every second), the
    online search on (halving time of the loss: no target loss is assumed)."""
    return {"period_s": s.adsp_period_s, "commit_rate": s.adsp_commit_rate, "min_interval_s": s.adsp_min_interval_s,
            "search": True}


def dlion_params(s: Settings) -> dict[str, Any]:
    """DLion's parameters in every dlion row: b_i = 64 before capacities are known and
    B_total = 64 N (as BSP's 64 per device), b_i in [4, 256]; ``min_ratio``,
    ``budget_safety`` and ``max_lag`` from the settings: asynchronous (``max_lag`` None,
    as the gossip rows) instead of the strategy's default 2, with which every node waits
    for the slowest link most of the time (benchmarks/results/dlion.md has both); the rest
    the strategy's defaults."""
    return {"batch_size": BATCH, "min_batch": 4, "max_batch": 256, "min_ratio": s.dlion_min_ratio,
            "budget_safety": s.dlion_budget_safety, "max_lag": s.dlion_max_lag}


def _preferred_batcher(name: str) -> str | None:
    from edgestream.trainers.local import LocalTrainer
    from edgestream.trainers.models import build_model

    trainer = LocalTrainer(build_model("mlp", (4,), 2, 0))
    try:
        strategy = strategies.create(name, strategies.StrategyContext("probe", trainer, members=("probe",)))
    except Exception:
        return None
    return strategy.preferred_batcher


def unconfigured_strategies() -> list[str]:
    """Registered whole-model strategies without a tuned row (the stage-split ones have their
    own table: :func:`stage_split_runs`)."""
    configured = {"bsp", "asp", "ssp", "adsp", "localsgd", "scadles", "gossip", "edgegossip", "dlion",
                  *strategies.stage_split_names()}
    return [name for name in strategies.names() if name not in configured]


#: The stage-split rows: the matrix's model (mlp, one hidden layer of 64) cut after its first
#: ReLU into two stages, one worker (and one device) each.
STAGE_SPLIT_STAGES = ("2",)


def stage_split_runs(s: Settings, seeds: list[int], partitions: list[str]) -> list[dict[str, Any]]:
    """Every stage-split strategy (``pipeline_bp``, ``dni``, ``cdni``) on the simulated clock
    with the default cost model: two stages on the first two ScaDLES rates (times
    ``--scale``), stage 0 reading both devices, the later stage running its queued steps.
    Figures per run: TTA, accuracy at ``--acc-budget``, steps per stage, first and last loss."""
    from edgestream.trainers.plan import TrainingPlan

    rates = tuple(r * s.scale for r in SCADLES_RATES[:len(STAGE_SPLIT_STAGES) + 1])
    out = []
    for name in strategies.stage_split_names():
        for partition in partitions:
            for seed in seeds:
                streams = simclock.StreamSet.from_fleet("digits", rates, partition=partition, seed=seed,
                                                        message_interval_s=s.message_interval_s)
                config = simclock.RunConfig(model="mlp", lr=s.lr, momentum=s.momentum, seed=seed,
                                            eval_every_s=s.eval_every_s, target_accuracy=s.target,
                                            time_budget_s=s.acc_budget_s, stop_at_target=False,
                                            plan=TrainingPlan(stages=STAGE_SPLIT_STAGES))
                mode = simclock.Mode(name, name, {}, batcher="fixed", batch_size=BATCH)
                report = simclock.run(mode, streams, simclock.CostModel(), config)
                losses = [loss for _, loss in report.loss_timeline]
                out.append({"row": name, "partition": partition, "seed": seed, "tta_s": report.tta_s,
                            "acc_at_budget": accuracy_at(report.timeline, s.acc_budget_s),
                            "stage_steps": {p.name: p.local_steps for p in report.processes},
                            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None})
    return out


def stage_split_markdown(entries: list[dict[str, Any]], s: Settings) -> str:
    """The stage-split table: medians over seeds per strategy and partition."""
    lines = ["## Stage-split strategies (simulated clock, default cost model)", "",
             f"The mlp cut after block {', '.join(STAGE_SPLIT_STAGES)}: {len(STAGE_SPLIT_STAGES) + 1} stages, one "
             f"worker and one device each (ScaDLES rates x {s.scale}), stage 0 reading every device; accuracy of "
             f"the stages put together at {s.acc_budget_s:.0f} s.", "",
             "| strategy | partition | TTA (s) | accuracy at budget | steps per stage | loss first -> last |",
             "|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for e in entries:
        groups.setdefault((e["row"], e["partition"]), []).append(e)
    for (row, partition), runs in groups.items():
        ttas = [r["tta_s"] for r in runs if r["tta_s"] is not None]
        tta = f"{statistics.median(ttas):.1f}" if len(ttas) == len(runs) else f"{len(ttas)}/{len(runs)} reached"
        acc = statistics.median(r["acc_at_budget"] or 0.0 for r in runs)
        steps = " / ".join(str(int(statistics.median(r["stage_steps"][w] for r in runs)))
                           for w in runs[0]["stage_steps"])
        first = statistics.median(r["first_loss"] for r in runs if r["first_loss"] is not None)
        last = statistics.median(r["last_loss"] for r in runs if r["last_loss"] is not None)
        lines.append(f"| {row} | {partition} | {tta} | {acc:.3f} | {steps} | {first:.3f} -> {last:.3f} |")
    return "\n".join(lines)


# -- cost models -----------------------------------------------------------------------------


def calibrate(sizes: tuple[int, ...] = (8, 16, 32, 64, 128, 256), rounds: int = 7, calls: int = 60) -> dict[str, Any]:
    """Time ``LocalTrainer.compute_gradient`` of the benchmark's model (mlp on digits), one torch
    thread, on batches of ``sizes``; fit ``c0 + c1 * b`` by least squares to the per-size
    medians. Sizes are interleaved over ``rounds`` so drifting load hits all of them alike.
    Also times one gradient message's encode + decode (dense and top-k 10 %), which the
    simulator does not charge."""
    from edgestream.compression import registry as compressors
    from edgestream.compression.memory import ErrorFeedback
    from edgestream.compression.pipeline import GradientCodec
    from edgestream.streams.simulator import fleet_data
    from edgestream.trainers.local import LocalTrainer, limit_torch_threads
    from edgestream.trainers.messages import UpdateMessage
    from edgestream.trainers.models import build_model
    from edgestream.trainers.validation import TensorSpec
    from edgestream.trainers.wire import decode_update, encode_update

    limit_torch_threads(1)
    data = fleet_data("digits", ["dev00"], scheme="iid", seed=0)
    x, y = data.train.features, data.train.labels
    trainer = LocalTrainer(build_model("mlp", data.feature_shape, data.num_classes, 0), lr=0.1, momentum=0.9)
    rng = np.random.default_rng(0)
    batches = {}
    for b in sizes:
        idx = rng.integers(0, len(y), size=b)
        batches[b] = (np.ascontiguousarray(x[idx], dtype=np.float32), np.asarray(y[idx], dtype=np.int64))
    samples: dict[int, list[float]] = {b: [] for b in sizes}
    for b in sizes:  # warm-up
        for _ in range(10):
            trainer.compute_gradient(*batches[b])
    for _ in range(rounds):
        for b in sizes:
            for _ in range(calls):
                started = time.perf_counter()
                trainer.compute_gradient(*batches[b])
                samples[b].append(time.perf_counter() - started)
    medians = {b: statistics.median(v) for b, v in samples.items()}
    c1, c0 = np.polyfit(np.array(sizes, dtype=float), np.array([medians[b] for b in sizes]), 1)
    # One gradient message, encoded and decoded as the driver does.
    result = trainer.compute_gradient(*batches[BATCH])
    msg = UpdateMessage(kind="gradient", sender="w0", step=0, base_version=0, batch_size=BATCH,
                        tensors=result.gradients, meta={"loss": result.loss, "vote": True, "compress": True})
    spec = TensorSpec.from_trainer(trainer)
    messages = {}
    for codec_name, codec in (("dense", None),
                              ("topk 10 %", GradientCodec(compressors.create("topk", ratio=0.1), ErrorFeedback()))):
        value, _ = encode_update(msg, job="calibrate", codec=codec)
        enc, dec = [], []
        for _ in range(300):
            started = time.perf_counter()
            value, _ = encode_update(msg, job="calibrate", codec=codec)
            enc.append(time.perf_counter() - started)
            started = time.perf_counter()
            decode_update(value, expected_shapes=spec, max_bytes=1 << 24, job="calibrate")
            dec.append(time.perf_counter() - started)
        messages[codec_name] = {"bytes": len(value), "encode_s": statistics.median(enc),
                                "decode_s": statistics.median(dec)}
    return {
        "model": "mlp", "parameters": sum(int(p.numel()) for p in trainer.model.parameters()),
        "torch_threads": 1, "sizes": list(sizes), "median_s": {str(b): medians[b] for b in sizes},
        "p10_s": {str(b): float(np.percentile(samples[b], 10)) for b in sizes},
        "p90_s": {str(b): float(np.percentile(samples[b], 90)) for b in sizes},
        "compute_base_s": max(0.0, float(c0)), "compute_per_record_s": max(0.0, float(c1)),
        "messages": messages,
    }


def calibrated_model(calibration: dict[str, Any]) -> simclock.CostModel:
    """The default cost model with this machine's compute (``calibrate``'s fit)."""
    return replace(simclock.CostModel(), compute_base_s=calibration["compute_base_s"],
                   compute_per_record_s=calibration["compute_per_record_s"])


def equal_links(regime: Regime) -> bool:
    """The regime's hosts all have the same link (``EQUAL_MBIT``): "links equal"."""
    return all(m == EQUAL_MBIT for m in regime.links_mbit)


def cost_model(kind: str, regime: Regime, calibration: dict[str, Any] | None,
               models: dict[str, simclock.CostModel] | None = None) -> simclock.CostModel:
    """Cost model ``kind`` (a name of ``models``; ``default`` and ``calibrated`` without it) in
    ``regime``: the regime's slowdowns and host links where the model sets no lists of its own.
    Equal links are hosts at the model's own ``bandwidth_bytes_per_s`` (100 Mbit/s, as
    ``EQUAL_MBIT``, for default and calibrated); the network regime's links are absolute."""
    if models is not None and kind in models:
        base = models[kind]
    elif kind == CALIBRATED:
        base = calibrated_model(calibration)
    else:
        base = simclock.CostModel()
    links = ((base.bandwidth_bytes_per_s,) * len(regime.links_mbit) if equal_links(regime)
             else tuple(m * 1e6 / 8 for m in regime.links_mbit))
    return costmodels.with_worker_lists(base, regime.slowdowns, links)


def resolve_cost_model(parser: argparse.ArgumentParser, spec: str,
                       workers: tuple[int, ...] = ()) -> costmodels.NamedCostModel:
    """``--cost-model SPEC`` of a simulated benchmark (trainers/costmodels.py), checked for runs
    of each of ``workers`` workers (its own lists and fill rule); a bad one ends the program
    with one line naming the problem, exit 2 (a usage error)."""
    try:
        named = costmodels.resolve(spec)
        for n in sorted(set(workers)):
            costmodels.fit(named, n)
    except costmodels.CostModelError as exc:
        parser.exit(2, f"{parser.prog}: --cost-model: {exc}\n")
    return named


# -- one run ---------------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _streams(regime_name: str, partition: str, seed: int, scale: float, interval: float, split: str = "seed"
             ) -> simclock.StreamSet:
    regime = regimes()[regime_name]
    return tuning.fleet_streams(split, [r * scale for r in regime.rates], partition=partition, seed=seed,
                                message_interval_s=interval)


@dataclass
class Task:
    regime: str
    partition: str
    seed: int
    row: str  # a row name, or "oracle"
    cost: str | None  # None for the oracle (zero cost)
    lr_mult: float = 1.0  # scales every learning rate of the row (``--tune-lr``; benchmarks/tuning.py)
    split: str = "seed"  # the test split and what the run is measured on (tuning.SPLITS)


def _task_key(t: Task) -> tuple[Any, ...]:
    return (t.regime, t.partition, t.seed, t.row, t.cost, t.lr_mult, t.split)


def _run_key(r: dict[str, Any]) -> tuple[Any, ...]:
    """A run's key (runs written before ``lr_mult`` existed were at multiplier 1, before
    ``split`` on their own seed's split)."""
    return (r["regime"], r["partition"], r["seed"], r["row"], r["cost"], r.get("lr_mult", 1.0), r.get("split", "seed"))


def run_task(task: Task, s: Settings, calibration: dict[str, Any] | None,
             models: dict[str, simclock.CostModel] | None = None) -> dict[str, Any]:
    """One simulated run; a JSON-able dict of its raw figures (``models``: the cost models by
    name, see :func:`cost_model`). ``task.lr_mult`` scales the run's LR and the row's own LR
    if it sets one (``lr``: the trainer LR the run used)."""
    started = time.monotonic()
    streams = _streams(task.regime, task.partition, task.seed, s.scale, s.message_interval_s, task.split)
    config = simclock.RunConfig(model="mlp", lr=s.lr * task.lr_mult, momentum=s.momentum, seed=task.seed,
                                eval_every_s=s.eval_every_s, target_accuracy=s.target,
                                time_budget_s=s.budget_s, min_time_s=s.acc_budget_s,
                                evaluate_workers=task.row in MEAN_OF_NODES_ROWS)
    if task.row == "oracle":
        base = simclock.oracle_mode(streams, window_s=s.window_s, max_batch=MAX_BATCH, reference_per_worker=BATCH)
        report = simclock.oracle(streams, config, base)
        lr = config.lr
    else:
        mode = tuning.scaled_mode(row_modes(streams, s)[task.row], task.lr_mult)
        report = simclock.run(mode, streams, cost_model(task.cost, regimes()[task.regime], calibration, models),
                              config)
        lr = config.lr if mode.lr is None else mode.lr
    return {
        **asdict(task), "lr": lr, "tta_s": report.tta_s,
        "acc_at_budget": accuracy_at(report.timeline, s.acc_budget_s),
        "loss_at_budget": loss_at(report.loss_timeline, s.acc_budget_s),
        "acc_at": {str(t): accuracy_at(report.timeline, t) for t in (15, 30, 45, 60, 90, 120) if t <= s.budget_s},
        "final_accuracy": report.final_accuracy, "sim_time_s": report.sim_time_s, "stopped": report.stopped,
        "steps": report.steps, "local_steps": report.local_steps, "bytes_sent": report.bytes_sent,
        "gradient_messages": report.gradient_messages, "compressed_fraction": report.compressed_fraction,
        "mean_staleness": report.mean_staleness, "max_staleness": report.max_staleness,
        "server": report.server["counters"] if report.server else None,
        "max_backlog": max(d.max_depth for d in report.devices),
        "dropped": sum(d.dropped for d in report.devices),
        "rejected_steps": report.rejected_steps, "rejected_messages": report.rejected_messages,
        "wall_s": time.monotonic() - started,
    }


def accuracy_at(timeline: list[tuple[float, float, int]], t: float) -> float | None:
    """Held-out accuracy of the last evaluation at or before ``t`` (None if the run ended earlier)."""
    if not timeline or timeline[-1][0] < t - 1e-9:
        return None
    best = None
    for at, acc, _ in timeline:
        if at <= t + 1e-9:
            best = acc
    return best


def loss_at(timeline: list[tuple[float, float]], t: float) -> float | None:
    """Held-out loss of the last evaluation at or before ``t`` (None if the run ended earlier)."""
    return accuracy_at([(at, loss, 0) for at, loss in timeline], t)


def run_matrix(tasks: list[Task], s: Settings, calibration: dict[str, Any] | None, jobs: int,
               progress=print, models: dict[str, simclock.CostModel] | None = None,
               show_lr: bool = False) -> list[dict[str, Any]]:
    """Every task's run, in the order of ``tasks`` (``jobs`` > 1: a pool of spawned processes);
    a progress line per run as it ends (``show_lr``: with its LR multiplier and LR)."""
    return parallel.map_in_order(partial(run_task, s=s, calibration=calibration, models=models), tasks, jobs,
                                 lambda i, r: progress(_progress_line(i, len(tasks), r, show_lr)))


def _progress_line(i: int, n: int, r: dict[str, Any], show_lr: bool = False) -> str:
    tta = f"{r['tta_s']:.1f} s" if r["tta_s"] is not None else "missed"
    lr = f" lr x{r['lr_mult']:g} ({r['lr']:.3g})" if show_lr or r.get("lr_mult", 1.0) != 1.0 else ""
    return (f"[{i}/{n}] {r['cost'] or 'zero'} {r['regime']}/{r['partition']} seed {r['seed']} {r['row']}{lr}: "
            f"TTA {tta}, acc@budget {_f3(r['acc_at_budget'])} ({r['wall_s']:.1f} s)")


# -- learning-rate tuning (--tune-lr; benchmarks/tuning.py) ---------------------------------


def tuning_tasks(spec: tuning.TuneSpec, columns: list[tuple[str, str]], costs: list[str], rows: list[str]
                 ) -> list[Task]:
    """Every cell's grid on the tuning seeds: the oracle per column (zero cost), every row per
    column and cost model."""
    tasks = [Task(r, p, seed, "oracle", None, m, "tuning") for seed in spec.seeds for r, p in columns
             for m in spec.grid]
    tasks += [Task(r, p, seed, row, cost, m, "tuning") for seed in spec.seeds for r, p in columns for cost in costs
              for row in rows for m in spec.grid]
    return tasks


def tune_key(cost: str | None, regime: str, partition: str, row: str) -> str:
    """A tuned cell's key: ``COST/REGIME/PARTITION/ROW``, ``zero/REGIME/PARTITION/oracle`` for the oracle."""
    return f"{cost or 'zero'}/{regime}/{partition}/{row}"


def choose_lrs(tune_raw: list[dict[str, Any]], spec: tuning.TuneSpec) -> dict[str, dict[str, Any]]:
    """Per tuned cell, the record of its tuning (``tuning.record``): every grid point's TTA,
    accuracy and loss at the accuracy budget on the tuning seeds, the chosen multiplier and LR."""
    return tuning.choose_cells(tune_raw, spec, lambda r: tune_key(r["cost"], r["regime"], r["partition"], r["row"]))


def reporting_mult(tuned: dict[str, dict[str, Any]] | None, task: Task) -> float:
    """The multiplier a reporting run of ``task``'s cell runs at (1 untuned)."""
    if tuned is None:
        return 1.0
    return tuned[tune_key(task.cost, task.regime, task.partition, task.row)]["chosen_mult"]


def _f3(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


# -- summary ---------------------------------------------------------------------------------


def summarise(raw: list[dict[str, Any]], s: Settings, rows: list[str], columns: list[tuple[str, str]],
              costs: list[str], tuned: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per cost model, row and column: medians and min-max over seeds of TTA, its ratio to
    BSP's on the same seed, its multiple of the oracle's on the same seed, accuracy at budget;
    with ``tuned`` (``--tune-lr``), the cell's tuning record (``tuning``) too: the runs are then
    at the chosen multipliers, so the ratios are against tuned BSP and the tuned oracle.

    A missed target is censored at the budget: a ratio is then ``>`` (the row missed) or
    ``<`` (BSP missed) a bound, and the median is taken over the bounds with that mark.
    """
    by = {(r["cost"], r["regime"], r["partition"], r["seed"], r["row"]): r for r in raw}
    seeds = sorted({r["seed"] for r in raw})
    cells: dict[str, Any] = {}
    for cost in costs:
        for regime, partition in columns:
            for row in ["oracle", *rows]:
                cell_cost = None if row == "oracle" else cost
                runs = [by.get((cell_cost, regime, partition, seed, row)) for seed in seeds]
                runs = [r for r in runs if r is not None]
                if not runs:
                    continue
                ratios, multiples = [], []
                for r in runs:
                    bsp = by.get((cost, regime, partition, r["seed"], "bsp"))
                    orc = by.get((None, regime, partition, r["seed"], "oracle"))
                    ratios.append(censored_ratio(r["tta_s"], bsp["tta_s"] if bsp else None, s.budget_s))
                    multiples.append(censored_ratio(r["tta_s"], orc["tta_s"] if orc else None, s.budget_s))
                ttas = [r["tta_s"] for r in runs]
                accs = [r["acc_at_budget"] for r in runs if r["acc_at_budget"] is not None]
                cells[f"{cost}/{regime}/{partition}/{row}"] = {
                    "cost": cost, "regime": regime, "partition": partition, "row": row, "seeds": len(runs),
                    "tta_s": [t for t in ttas], "tta_median": censored_median(ttas, s.budget_s),
                    "vs_bsp": ratios, "vs_bsp_median": median_bound(ratios),
                    "x_oracle": multiples, "x_oracle_median": median_bound(multiples),
                    "acc_at_budget": accs, "acc_median": statistics.median(accs) if accs else None,
                    "missed": sum(t is None for t in ttas),
                    "mean_staleness": statistics.median(r["mean_staleness"] for r in runs),
                    "bytes_sent": statistics.median(r["bytes_sent"] for r in runs),
                    "compressed_fraction": statistics.median(r["compressed_fraction"] for r in runs),
                    "max_backlog": max(r["max_backlog"] for r in runs),
                    "lr_mult": runs[0].get("lr_mult", 1.0), "lr": runs[0].get("lr"),
                    "tuning": (tuned or {}).get(tune_key(cell_cost, regime, partition, row)),
                }
    return cells


def _cell(m: dict[str, Any] | None, digits: int = 2, spread: bool = True) -> str:
    return censored.text(m, digits, spread=spread, missing="missed")


def markdown(cells: dict[str, Any], s: Settings, rows: list[str], columns: list[tuple[str, str]], costs: list[str],
             calibration: dict[str, Any] | None, seconds: float, seeds: list[int], notes: list[str],
             models: dict[str, simclock.CostModel] | None = None, tune: tuning.TuneSpec | None = None) -> str:
    reg = regimes()
    lines = [
        f"Simulated clock, digits (held-out 20 %), 10 devices, one worker each; rates x{s.scale:g}; "
        f"target {s.target:.0%} held for 3 evaluations (every {s.eval_every_s:g} s); TTA budget {s.budget_s:.0f} s, "
        f"accuracy read at {s.acc_budget_s:.0f} s; seeds {', '.join(map(str, seeds))} (streams, shares and initial "
        f"weights); medians with the min-max over seeds. {seconds / 60:.1f} min for the whole matrix.",
        "",
        "| regime | rates /s (x scale) | compute slowdowns | links Mbit/s | H rates | H speeds | H links |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for name in dict.fromkeys(r for r, _ in columns):
        g = reg[name]
        lines.append(
            f"| {name} | {' '.join(f'{x:g}' for x in g.rates)} | {' '.join(f'{x:g}' for x in g.slowdowns)} "
            f"| {' '.join(f'{x:g}' for x in g.links_mbit)} | {heterogeneity(g.rates):.2f} "
            f"| {heterogeneity(tuple(1 / x for x in g.slowdowns)):.2f} | {heterogeneity(g.links_mbit):.2f} |")
    lines += ["", "Cost models: " + cost_line(calibration, models), "", "Rows: " + rows_line(s), ""]
    if tune is not None:
        lines += [tuning_line(tune), ""]
    header = "| row | " + " | ".join(f"{r} {p}" for r, p in columns) + " |"
    rule = "|---|" + "---:|" * len(columns)
    bsp = "tuned BSP" if tune is not None else "BSP"
    for cost in costs:
        if tune is not None:
            lines += [f"### {cost} cost model: learning rate chosen on the tuning seed (multiplier of the row's own, "
                      f"trainer LR)", "", header, rule]
            for row in ["oracle", *rows]:
                lines.append(f"| {row} | " + " | ".join(
                    tuning.mult_text(cells.get(f"{cost}/{r}/{p}/{row}", {}).get("tuning")) for r, p in columns) + " |")
            lines += ["", tuning.LEGEND, ""]
        lines += [f"### {cost} cost model: TTA / {bsp}'s TTA (same seed; < 1 is faster than {bsp})", "", header,
                  rule]
        for row in ["oracle", *rows]:
            lines.append(f"| {row} | " + " | ".join(
                _cell(cells.get(f"{cost}/{r}/{p}/{row}", {}).get("vs_bsp_median")) for r, p in columns) + " |")
        lines += ["", f"### {cost} cost model: TTA seconds (median) and x oracle", "", header, rule]
        for row in ["oracle", *rows]:
            parts = []
            for r, p in columns:
                c = cells.get(f"{cost}/{r}/{p}/{row}")
                if c is None:
                    parts.append("-")
                    continue
                tta = _cell(c["tta_median"], 1, spread=False)
                parts.append(f"{tta} s, {_cell(c['x_oracle_median'], spread=False)}x")
            lines.append(f"| {row} | " + " | ".join(parts) + " |")
        lines += ["", f"### {cost} cost model: held-out accuracy at {s.acc_budget_s:.0f} s (median, min-max)", "",
                  header, rule]
        for row in ["oracle", *rows]:
            parts = []
            for r, p in columns:
                c = cells.get(f"{cost}/{r}/{p}/{row}")
                accs = c["acc_at_budget"] if c else []
                parts.append(f"{statistics.median(accs):.3f} ({min(accs):.3f}-{max(accs):.3f})" if accs else "-")
            lines.append(f"| {row} | " + " | ".join(parts) + " |")
        lines.append("")
    lines += [
        "`>x`: the row missed the target within the budget on the median seed (ratio at least x); `<x`: BSP "
        "missed it (ratio at most x); `missed`: both missed. The oracle row is the zero-cost run "
        "(independent of the cost model); its ratio to BSP is the most any waiting-free synchronous mode could gain.",
    ]
    lines += [f"Note: {n}" for n in notes]
    return "\n".join(lines)


def tuning_line(tune: tuning.TuneSpec) -> str:
    return (f"Learning rates tuned (--tune-lr): every cell's row, BSP and the oracle included, ran at each "
            f"multiplier {', '.join(f'x{m:g}' for m in tune.grid)} of its own learning rate(s) (the LRs below) on "
            f"tuning seed{'s' if len(tune.seeds) > 1 else ''} {', '.join(map(str, tune.seeds))}, never reported; "
            f"the rule: {tuning.RULE}. The reported seeds ran at the chosen multiplier, so every ratio is against "
            f"tuned BSP and the tuned oracle. The stage-split table is not tuned.")


def rows_line(s: Settings) -> str:
    return (f"bsp fixed batch {BATCH}, LR {s.lr:g} on the aggregate; asp / ssp: fixed batch {BATCH}, server LR "
            f"{s.lr:g} x {BATCH} / ({BATCH} N) per gradient, asp rejects staleness > {s.asp_max_staleness}, ssp blocks a "
            f"worker s clocks ahead and scales steps by 1 / (1 + staleness); adsp: local SGD at LR {s.lr:g}, fixed "
            f"batch {BATCH}, period {s.adsp_period_s:g} s, C = {s.adsp_commit_rate} at the start (a commit every "
            f"{s.adsp_period_s / s.adsp_commit_rate:g} s), min interval {s.adsp_min_interval_s:g} s, search on, server "
            f"W += delta / N; localsgd: H = {s.localsgd_period_steps} local steps at LR {s.lr:g}, then the weighted "
            f"average (momentum kept locally); scadles rows: {s.window_s:g} s windows, batch cap {MAX_BATCH}, linear LR "
            f"scaling; gossip: {s.gossip_topology}, fixed batch {BATCH}, LR {s.lr:g} per local step, asynchronous; "
            f"edgegossip: the same graph, balanced b_i = {BATCH} N r_i / sum r through {s.edge_window_s:g} s windows, "
            f"data- and accuracy-weighted mixing, plateau LR decay; dlion: all-to-all gradients, LR {s.lr:g} x b_j / "
            f"sum b per gradient, b_i = {BATCH} N c_i / sum c through {s.edge_window_s:g} s windows, prioritised partial "
            f"messages (min ratio {s.dlion_min_ratio:g}, budget safety {s.dlion_budget_safety:g}), knowledge transfer, "
            f"max_lag {s.dlion_max_lag}; dlion-wb / -prio / -kt: without weighted batching / prioritised exchange / knowledge "
            f"transfer; gossip and dlion rows' accuracy is the mean of the nodes' "
            f"held-out accuracies (each evaluates its own model) (benchmarks/strategies.py has the details).")


def cost_line(calibration: dict[str, Any] | None, models: dict[str, simclock.CostModel] | None = None) -> str:
    """The cost models, one clause each: default and calibrated as always, then every other of
    ``models`` (by name)."""
    d = simclock.CostModel()
    text = (f"default: step {d.compute_base_s * 1e3:g} ms + {d.compute_per_record_s * 1e3:g} ms/record, "
            f"latency {d.latency_s * 1e3:g} ms, {d.bandwidth_bytes_per_s * 8 / 1e6:g} Mbit/s")
    if calibration:
        text += (f"; calibrated (this machine, mlp compute_gradient, 1 torch thread): step "
                 f"{calibration['compute_base_s'] * 1e3:.3f} ms + {calibration['compute_per_record_s'] * 1e6:.2f} "
                 f"us/record, transfer as the default")
    others = {name: m for name, m in (models or {}).items() if name not in ("default", CALIBRATED)}
    for name, model in others.items():
        text += f"; {name}: {costmodels.describe(model)}"
    equal = "100 Mbit/s" if not others else "the cost model's bandwidth (100 Mbit/s for default and calibrated)"
    return text + f". Step time x the device's slowdown; equal links = every host at {equal} (up and down)."


# -- heat map --------------------------------------------------------------------------------


def heat_map(cells: dict[str, Any], rows: list[str], columns: list[tuple[str, str]], costs: list[str],
             s: Settings, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    all_rows = ["oracle", *rows]
    fig, axes = plt.subplots(len(costs), 1, figsize=(1.45 * len(columns) + 3, 0.62 * len(all_rows) * len(costs) + 1.6),
                             squeeze=False)
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-math.log2(8), vmax=math.log2(8))
    image = None
    for ax, cost in zip(axes[:, 0], costs, strict=True):
        grid = np.full((len(all_rows), len(columns)), np.nan)
        for i, row in enumerate(all_rows):
            for j, (r, p) in enumerate(columns):
                c = cells.get(f"{cost}/{r}/{p}/{row}")
                m = c and c["vs_bsp_median"]
                if m:
                    grid[i, j] = math.log2(m["value"])
                    oracle = c["x_oracle_median"]
                    text = _cell(m, spread=False) + "\n" + (f"{_cell(oracle, spread=False)}x orc" if oracle else "")
                    ax.text(j, i, text, ha="center", va="center", fontsize=7)
                else:
                    ax.text(j, i, "missed", ha="center", va="center", fontsize=7)
        image = ax.imshow(np.clip(grid, -3, 3), cmap="RdYlGn_r", norm=norm, aspect="auto")
        ax.set_xticks(range(len(columns)), [f"{r}\n{p}" for r, p in columns], fontsize=8)
        ax.set_yticks(range(len(all_rows)), all_rows, fontsize=8)
        ax.set_title(f"{cost} cost model: TTA / BSP's TTA (green < 1 faster), and x oracle", fontsize=9)
    if image is not None:
        bar = fig.colorbar(image, ax=axes[:, 0].tolist(), shrink=0.8)
        ticks = [-3, -2, -1, 0, 1, 2, 3]
        bar.set_ticks(ticks, labels=[f"{2.0 ** t:g}" for t in ticks])
        bar.set_label("TTA ratio to BSP (log scale)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# -- the real-broker subset ------------------------------------------------------------------


@dataclass
class RealSpec:
    regime: str
    partition: str
    rows: list[str] = field(default_factory=lambda: ["bsp", "scadles", "asp"])
    workers: int = 10
    slowdowns: tuple[float, ...] | None = None
    """Replaces the regime's slowdowns (one per worker), e.g. to set a heterogeneity H."""
    step_cost: tuple[float, float] = (0.0, 0.0)
    """Emulated device compute cost of the live workers (``workers.step_base_s``,
    ``workers.step_per_record_s``): a step on n records lasts at least (base + per_record n)
    x the worker's slowdown. (0, 0): only the slowdown rule (wait (slowdown - 1) x measured)."""
    row_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    rates: tuple[float, ...] | None = None
    """Replaces the regime's record rates (one per worker), e.g. to make every worker compute-bound."""
    """Per row, strategy parameters replacing the row's own (real run and its simulated
    prediction alike), e.g. {"adsp": {"commit_rate": 2, "search": False}}."""

    @classmethod
    def parse(cls, text: str, workers: int = 10, slowdowns: tuple[float, ...] | None = None,
              step_cost: tuple[float, float] | None = None) -> RealSpec:
        """``step_cost`` None: the simulator's default cost model when the workers have
        compute slowdowns (so the live run matches its default prediction), else (0, 0)."""
        head, _, rows = text.partition(":")
        regime, _, partition = head.partition("/")
        spec = cls(regime, partition or "iid", [r for r in rows.split(",") if r] or ["bsp", "scadles", "asp"], workers,
                   slowdowns)
        if spec.regime not in regimes() or spec.regime == "network":
            raise ValueError(f"--real regime must be one of rates, compute, both (the broker has no link shaping), "
                             f"got {spec.regime!r}")
        if spec.partition not in PARTITIONS:
            raise ValueError(f"--real partition must be iid or dirichlet, got {spec.partition!r}")
        unknown = set(spec.rows) - set(ROWS)
        if unknown:
            raise ValueError(f"--real rows {sorted(unknown)} unknown; choose from {', '.join(ROWS)}")
        if not 1 <= spec.workers <= 10:
            raise ValueError(f"--real-workers must be in 1..10, got {spec.workers}")
        if spec.slowdowns is not None and (len(spec.slowdowns) != spec.workers or min(spec.slowdowns) < 1):
            raise ValueError(f"--real-slowdowns needs {spec.workers} factors >= 1, got {spec.slowdowns}")
        if spec.regime in regimes() and step_cost is None:
            default = simclock.CostModel()
            slowed = any(x > 1 for x in spec.regime_def().slowdowns)
            step_cost = (default.compute_base_s, default.compute_per_record_s) if slowed else (0.0, 0.0)
        if step_cost is not None:
            if len(step_cost) != 2 or not all(math.isfinite(v) and v >= 0 for v in step_cost):
                raise ValueError(f"--real-step-cost needs BASE,PER_RECORD (finite seconds >= 0), got {step_cost}")
            spec.step_cost = (float(step_cost[0]), float(step_cost[1]))
        return spec

    def regime_def(self) -> Regime:
        """The regime's first ``workers`` hosts, with ``slowdowns`` if given."""
        regime = _first(regimes()[self.regime], self.workers)
        if self.rates is not None:
            regime = replace(regime, rates=tuple(self.rates))
        return regime if self.slowdowns is None else replace(regime, slowdowns=tuple(self.slowdowns))


def _row_mode(row: str, s: Settings, regime: Regime, partition: str, n: int, seed: int,
              params: dict[str, Any] | None = None) -> simclock.Mode:
    """The simulated row's mode for the regime's first ``n`` devices (the LR rules depend on ``n``),
    with ``params`` replacing some of its strategy parameters."""
    streams = simclock.StreamSet.from_fleet("digits", regime.rates[:n], partition=partition, seed=seed)
    return _with_params(row_modes(streams, s)[row], params)


def _with_params(mode: simclock.Mode, params: dict[str, Any] | None) -> simclock.Mode:
    return replace(mode, strategy_params={**mode.strategy_params, **params}) if params else mode


def parse_row_params(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["adsp:commit_rate=2,search=false"]`` -> ``{"adsp": {"commit_rate": 2, "search": False}}``
    (values as JSON where they parse, else strings)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        row, colon, pairs = item.partition(":")
        if not colon or row not in ROWS:
            raise ValueError(f"--real-row-params wants ROW:KEY=VALUE[,KEY=VALUE] with a row of {', '.join(ROWS)}, "
                             f"got {item!r}")
        for pair in pairs.split(","):
            key, eq, value = pair.partition("=")
            if not eq or not key:
                raise ValueError(f"--real-row-params: {pair!r} is not KEY=VALUE")
            try:
                out.setdefault(row, {})[key] = json.loads(value)
            except json.JSONDecodeError:
                out.setdefault(row, {})[key] = value
    return out


def real_job(row: str, spec: RealSpec, s: Settings, state: Path, tag: str, seed: int):
    """The job of one real run: benchmarks/time_to_accuracy.py's job, with the regime's rates
    and slowdowns (the first ``spec.workers`` devices) and the row's strategy."""
    from edgestream.benchmarks.time_to_accuracy import Settings as TtaSettings
    from edgestream.benchmarks.time_to_accuracy import job_config

    regime = spec.regime_def()
    tta = TtaSettings(scale=s.scale, window_s=s.window_s, budget_s=s.acc_budget_s, target=s.target, delta=s.delta,
                      eval_every_s=s.eval_every_s, lr=s.lr, momentum=s.momentum, seed=seed, slowdown=regime.slowdowns)
    scadles = row.startswith("scadles")
    cfg = job_config(row if scadles else "bsp", spec.partition, tta, state, tag)
    n = spec.workers
    cfg.devices.rates_hz = list(regime.rates[:n])
    if n != cfg.devices.count:
        cfg.devices.count = n
        cfg.devices.ids = cfg.devices.ids[:n]
        cfg.workers.count = n
    cfg.workers.slowdown = list(regime.slowdowns)
    cfg.workers.step_base_s, cfg.workers.step_per_record_s = spec.step_cost
    if not scadles and row != "bsp":
        # The simulated row's strategy, parameters and LR (fixed batch 64, as BSP's job).
        mode = _row_mode(row, s, regime, spec.partition, n, seed, spec.row_params.get(row))
        cfg.train.strategy = mode.strategy
        cfg.train.strategy_params = [f"{k}={json.dumps(v)}" for k, v in mode.strategy_params.items()]
        if mode.lr is not None:
            cfg.train.lr = mode.lr
        if mode.batcher == "window":  # e.g. edgegossip: a step takes up to the strategy's batch
            cfg.batcher.mode = "window"
            cfg.batcher.window_s = mode.window_s
            cfg.batcher.max_batch = mode.max_batch
            cfg.train.max_step_batch = mode.max_batch
    return cfg.validate()


def mean_timeline(timelines: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The mean of several processes' accuracies over time: at each evaluation of the first,
    the mean of every process's latest evaluation so far (from the first time all have one)."""
    if not timelines or any(not t for t in timelines):
        return []
    out = []
    for t, _ in timelines[0]:
        latest = [next((a for at, a in reversed(tl) if at <= t + 1e-9), None) for tl in timelines]
        if all(a is not None for a in latest):
            out.append((t, sum(latest) / len(latest)))
    return out


def real_runs(spec: RealSpec, s: Settings, repeats: int, bootstrap: str | None, calibration: dict[str, Any] | None,
              progress=print, first_seed: int | None = None) -> list[dict[str, Any]]:
    """The subset on the real broker (rows interleaved within a repeat), each with the simulated
    prediction for the same job (``pipeline.simjob``: the same data and seed) under both cost models."""
    from rich.console import Console

    from edgestream.benchmarks.time_to_accuracy import Sampler, fill_backlog
    from edgestream.deploy.kafka.broker import LocalBroker
    from edgestream.pipeline.run import run_job
    from edgestream.pipeline.simjob import run_config_from_job, streams_from_job
    from edgestream.trainers.evaluation import time_to_target

    work = Path(tempfile.mkdtemp(prefix="bench-strategies-"))
    broker = None
    out = []
    try:
        if not bootstrap:
            broker = LocalBroker(work / "kafka").start()
            bootstrap = broker.bootstrap
        for repeat in range(repeats):
            seed = (s.first_seed if first_seed is None else first_seed) + repeat
            for row in spec.rows:
                tag = uuid.uuid4().hex[:6]
                cfg = real_job(row, spec, s, work, tag, seed)
                progress(f"real broker: {spec.regime}/{spec.partition} seed {seed} {row} "
                         f"({cfg.run.duration_s:.0f} s of streaming) ...")
                started = time.monotonic()
                entry: dict[str, Any] = {"regime": spec.regime, "partition": spec.partition, "seed": seed, "row": row,
                                         "workers": cfg.workers.count, "slowdowns": list(cfg.workers.slowdown),
                                         "step_cost": list(spec.step_cost),
                                         "row_params": spec.row_params.get(row, {}),
                                         "rates": list(cfg.devices.rates_hz),
                                         "server": "server" in strategies.roles(cfg.train.strategy),
                                         "loadavg_before": os.getloadavg()}
                try:
                    sampler = Sampler()
                    result = run_job(cfg, bootstrap, console=Console(file=io.StringIO()), live=False,
                                     on_streaming=sampler, drain=False)
                    origin = json.loads((cfg.state_path() / "simulation.json").read_text())["started_at"]

                    def timeline_of(process: str, origin: float = origin, cfg=cfg) -> list[tuple[float, float]]:
                        path = cfg.state_path() / "workers" / process / "evaluations.jsonl"
                        evals = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
                        return [(e["t"] - origin, e["accuracy"]) for e in evals if e["t"] - origin <= s.acc_budget_s]

                    # The job's model is the server's when there is one (as on the simulated clock);
                    # for serverless gossip rows the mean of the nodes' own accuracies.
                    workers = [f"w{i}" for i in range(cfg.workers.count)]
                    if row in MEAN_OF_NODES_ROWS:
                        evaluator = "workers"
                        timeline = mean_timeline([timeline_of(w) for w in workers])
                    else:
                        evaluator = "server" if entry["server"] else "w0"
                        timeline = timeline_of(evaluator)
                    w0 = timeline_of("w0") if evaluator != "w0" else timeline
                    from edgestream.benchmarks.time_to_accuracy import ModeRun

                    backlog = ModeRun(row, spec.partition, repeat)
                    fill_backlog(backlog, sampler.backlog)
                    training = result.training.get(evaluator if evaluator != "workers" else "w0", {})
                    entry["nodes"] = {w: node_traffic(result.training.get(w, {})) for w in workers}
                    entry.update({
                        "tta_s": time_to_target(timeline, s.target), "evaluated": evaluator,
                        "acc_at_budget": timeline[-1][1] if timeline else None,
                        "last_eval_s": timeline[-1][0] if timeline else None,
                        "w0_tta_s": time_to_target(w0, s.target), "w0_acc_at_budget": w0[-1][1] if w0 else None,
                        "steps": training.get("version"),
                        "server_counters": training.get("counters") if evaluator == "server" else None,
                        "staleness": training.get("staleness"),
                        "max_backlog": max(backlog.max_backlog.values(), default=0.0),
                        "timeline": [(round(t, 3), round(a, 4)) for t, a in timeline],
                        "w0_timeline": [(round(t, 3), round(a, 4)) for t, a in w0] if evaluator != "w0" else None,
                    })
                except Exception as exc:  # one failed run must not lose the others' figures
                    entry["error"] = f"{type(exc).__name__}: {exc}"
                entry["wall_s"] = time.monotonic() - started
                entry["loadavg_after"] = os.getloadavg()  # 1, 5, 15 min: was the machine shared meanwhile?
                # The simulated prediction for the same job: same data, seed, rates, slowdowns, settings.
                streams = streams_from_job(cfg)
                config = run_config_from_job(cfg, time_budget_s=s.acc_budget_s, target_accuracy=s.target,
                                             stop_at_target=False, evaluate_workers=row in MEAN_OF_NODES_ROWS)
                mode = _with_params(row_modes(streams, s)[row], spec.row_params.get(row))
                entry["simulated"] = {}
                for cost in COST_MODELS:
                    if cost == "calibrated" and calibration is None:
                        continue
                    report = simclock.run(mode, streams, cost_model(cost, spec.regime_def(), calibration),
                                          config)
                    entry["simulated"][cost] = {
                        "tta_s": report.tta_s, "acc_at_budget": report.final_accuracy, "steps": report.steps,
                        "nodes": {p.name: {"steps": p.local_steps, "bytes_in": p.consumed_bytes,
                                           "bytes_out": p.produced_bytes, "idle_fraction": p.idle_fraction,
                                           "iteration_time_cv": p.iteration_time_cv}
                                  for p in report.processes}}
                progress(f"  real TTA {_s(entry.get('tta_s'))} (error: {entry['error']})" if "error" in entry else
                         f"  real TTA {_s(entry['tta_s'])}, simulated default {_s(entry['simulated']['default']['tta_s'])}"
                         f", calibrated {_s(entry['simulated'].get('calibrated', {}).get('tta_s'))}")
                out.append(entry)
    finally:
        if broker is not None:
            broker.stop()
    if not any("error" in entry for entry in out):
        shutil.rmtree(work, ignore_errors=True)  # the broker's log and the processes' logs: kept when a run failed
    return out


def node_traffic(training: dict[str, Any]) -> dict[str, Any]:
    """One live process's steps, bytes in / out per channel and the strategy's own idle and
    iteration-time figures (from its training.json summary)."""
    stats = training.get("strategy_stats") or {}
    return {"steps": training.get("steps"), "version": training.get("version"),
            "bytes_in": training.get("bytes_in", {}), "bytes_out": training.get("bytes_out", {}),
            "messages_in": training.get("messages_in", {}), "messages_out": training.get("messages_out", {}),
            "idle_fraction": stats.get("idle_fraction"), "iteration_time_mean_s": stats.get("iteration_time_mean_s"),
            "iteration_time_cv": stats.get("iteration_time_cv")}


def _first(regime: Regime, n: int) -> Regime:
    """The regime's first ``n`` hosts (the real subset's workers)."""
    return replace(regime, rates=regime.rates[:n], slowdowns=regime.slowdowns[:n], links_mbit=regime.links_mbit[:n])


def _s(v: float | None) -> str:
    return "missed" if v is None else f"{v:.1f} s"


def _real_key(e: dict[str, Any]) -> tuple[Any, ...]:
    """The subset a real entry belongs to (older entries carry no ``slowdowns``: the regime's)."""
    regime = regimes()[e["regime"]]
    slow = tuple(e.get("slowdowns") or regime.slowdowns[: e["workers"]])
    rates = tuple(e.get("rates") or regime.rates[: e["workers"]])
    return (e["regime"], e["partition"], e["workers"], None if slow == regime.slowdowns[: e["workers"]] else slow,
            tuple(e.get("step_cost") or (0.0, 0.0)), None if rates == regime.rates[: e["workers"]] else rates)


def _slow(spec: RealSpec) -> str:
    rates = "" if spec.rates is None else f"; rates {' '.join(f'{x:g}' for x in spec.rates)} records/s instead"
    if spec.slowdowns is None:
        return rates
    return rates + (f"; slowdowns {' '.join(f'{x:g}' for x in spec.slowdowns)} instead, "
            f"H speeds {heterogeneity(tuple(1 / x for x in spec.slowdowns)):.2f}")


def _row_label(e: dict[str, Any]) -> str:
    """The row, with the strategy parameters that replaced its own if any."""
    params = e.get("row_params") or {}
    return e["row"] + (f" [{', '.join(f'{k}={json.dumps(v)}' for k, v in params.items())}]" if params else "")


def _step_cost(spec: RealSpec) -> str:
    base, per_record = spec.step_cost
    if not base and not per_record:
        return ("Without emulated compute cost: a worker slowed k times waits (k - 1) x its measured step "
                "(about a millisecond for this MLP), so no live worker is compute-bound.")
    return (f"With emulated device compute cost (`workers.step_base_s` = {base:g}, `workers.step_per_record_s` = "
            f"{per_record:g}): a step on n records lasts max(k x measured, ({base * 1e3:g} ms + {per_record * 1e3:g} "
            f"ms x n) x k) for a worker slowed k times, the simulator's default cost model when {base:g}, "
            f"{per_record:g} are its values, so the default sim column is the matching prediction; the calibrated "
            f"column models this machine's own compute (about a millisecond a step), which these runs do not use.")


def _hosts(n: int) -> str:
    return "" if n == 10 else f": the regime's first {n} hosts"


def real_markdown(entries: list[dict[str, Any]], spec: RealSpec, s: Settings) -> str:
    lines = [
        f"### Real broker: {spec.regime} / {spec.partition}, {entries[0]['workers']} workers (one per device"
        f"{_hosts(entries[0]['workers'])}{_slow(spec)}) "
        f"{'+ a server (' + ', '.join(sorted({e['row'] for e in entries if e['server']})) + ') ' if any(e['server'] for e in entries) else ''}on this machine; "
        f"{s.acc_budget_s:.0f} s of streaming; wall time from the first record. The sim columns are the "
        f"predictions made with the real run (the calibration of that invocation). Every row at its base "
        f"learning rate, real and simulated alike: these sections test the simulator's prediction of a real "
        f"run, they are not a tuned comparison (the matrix above is). {_step_cost(spec)}",
        "",
        "| seed | row | real TTA s | vs BSP | acc @ end | last evaluation s | sim TTA (default) | real / sim "
        "| sim TTA (calibrated) | real / sim | model version | notes |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for e in entries:
        if "error" in e:
            lines.append(f"| {e['seed']} | {_row_label(e)} | failed: {e['error']} | | | | | | | | | |")
            continue
        bsp = next((b for b in entries if b["seed"] == e["seed"] and b["row"] == "bsp" and "error" not in b), None)
        ratio = e["tta_s"] / bsp["tta_s"] if bsp and bsp["tta_s"] and e["tta_s"] else None
        sim = e["simulated"]

        def gap(cost: str, sim: dict[str, Any] = sim, real: float | None = e["tta_s"]) -> str:
            t = sim.get(cost, {}).get("tta_s")
            return f"{real / t:.2f}" if t and real else "-"

        notes = []
        if e.get("server_counters"):
            c = e["server_counters"]
            note = f"server applied {c.get('applied', 0)}"
            if "rejected_stale" in c or e["row"] == "asp":
                note += f", rejected as stale {c.get('rejected_stale', 0)}"
            notes.append(note)
        if e.get("w0_timeline") is not None:
            what = "w0 alone" if e.get("evaluated") == "workers" else "w0 (adopted snapshots)"
            notes.append(f"{what}: TTA {_s(e['w0_tta_s'])}, acc {_f3(e['w0_acc_at_budget'])}")
        nodes = [n for n in (e.get("nodes") or {}).values() if n.get("steps")]
        if nodes:  # bytes the nodes fetched per local step (heartbeats on control left out)
            def fetched(n: dict[str, Any]) -> int:
                return sum(v for k, v in n["bytes_in"].items() if k != "control")

            per = [fetched(n) / n["steps"] for n in nodes]
            text = (f"kB in per step {sum(map(fetched, nodes)) / sum(n['steps'] for n in nodes) / 1e3:.1f} "
                    f"(all nodes' bytes / all nodes' steps)")
            sim_nodes = [n for n in sim.get("default", {}).get("nodes", {}).values() if n.get("steps")]
            if sim_nodes:
                text += (f", sim {sum(map(fetched, sim_nodes)) / sum(n['steps'] for n in sim_nodes) / 1e3:.1f}")
            notes.append(text + f"; per node per own step {statistics.fmean(per) / 1e3:.1f} (max {max(per) / 1e3:.1f})")
        last = e.get("last_eval_s")
        lines.append(
            f"| {e['seed']} | {_row_label(e)} | {_s(e['tta_s'])} | {f'{ratio:.2f}' if ratio else '-'} "
            f"| {_f3(e['acc_at_budget'])} | {'-' if last is None else f'{last:.1f}'} "
            f"| {_s(sim.get('default', {}).get('tta_s'))} | {gap('default')} "
            f"| {_s(sim.get('calibrated', {}).get('tta_s'))} | {gap('calibrated')} | {e.get('steps')} "
            f"| {'; '.join(notes)} |")
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------


def cost_models_of(parser: argparse.ArgumentParser, specs: list[str], workers: tuple[int, ...]
                   ) -> tuple[list[str], dict[str, simclock.CostModel], dict[str, str]]:
    """``--cost-model`` specs as the matrix's cost model names (in order), the models by name
    (``calibrated`` left out: it is measured later) and where each came from. A bad spec, two
    with the same name, ``calibrated`` with overrides, or a list too short for ``workers``
    under ``fill = "error"`` ends the program with one line, exit 2."""
    names: list[str] = []
    models: dict[str, simclock.CostModel] = {}
    sources: dict[str, str] = {}
    for spec in specs:
        if spec.strip() == CALIBRATED:
            name, source = CALIBRATED, "measured on this machine (calibrate)"
        elif spec.strip().startswith(CALIBRATED + ":"):
            parser.exit(2, f"{parser.prog}: --cost-model: {CALIBRATED} is measured at the start of the run and takes "
                           f"no overrides; give a preset or a .toml file with the values instead\n")
        else:
            named = resolve_cost_model(parser, spec, workers)
            name, source = named.name, named.source
            models[name] = named.model
        if name in names:
            parser.exit(2, f"{parser.prog}: --cost-model: two cost models are named {name!r}; give one a `name` "
                           f"(in its file, or an override name=...)\n")
        names.append(name)
        sources[name] = source
    return names, models, sources


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=Settings.repeats, help="seeds per cell (median and min-max)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="simulations in parallel")
    parser.add_argument("--budget", type=float, default=Settings.budget_s, help="simulated seconds per run at most")
    parser.add_argument("--acc-budget", type=float, default=Settings.acc_budget_s,
                        help="the accuracy figure is read at this simulated time (runs last at least this long)")
    parser.add_argument("--regimes", default=",".join(regimes()), help="comma list of rates, compute, both, network")
    parser.add_argument("--partitions", default=",".join(PARTITIONS), help="comma list of iid, dirichlet")
    parser.add_argument("--rows", help=f"comma list of rows (default: {', '.join(ROWS)}, and any registered "
                                       "strategy without a tuned row, with its defaults)")
    parser.add_argument("--cost-model", action="append", metavar="SPEC", dest="cost_models",
                        help="one cost model of the matrix (repeatable): calibrated (measured on this machine at the "
                             "start), a preset (" + ", ".join(costmodels.PRESETS) + "), a .toml file, either with "
                             ":KEY=VALUE,... overrides (lists a/b/c), e.g. default:latency_s=0.05; `edgestream costs` "
                             "lists the presets. Default: " + ", ".join(COST_MODELS))
    parser.add_argument("--costs", metavar="SPEC,...",
                        help="the older spelling: a comma list of cost models, each as one --cost-model")
    parser.add_argument("--real", metavar="SUBSET",
                        help="also run REGIME/PARTITION:ROWS on the real broker, e.g. both/iid:bsp,scadles,asp")
    parser.add_argument("--real-repeats", type=int, default=1, help="seeds of the real subset")
    parser.add_argument("--real-first-seed", type=int, default=None,
                        help="first seed of the real subset (default: the matrix's first), e.g. to add a seed")
    parser.add_argument("--real-workers", type=int, default=10,
                        help="workers (and devices: the regime's first N) of the real subset")
    parser.add_argument("--real-slowdowns", help="comma list, one per real worker: replaces the regime's slowdowns")
    parser.add_argument("--real-rates", help="comma list of records/s, one per real worker (or one for all): "
                                              "replaces the regime's rates")
    parser.add_argument("--real-step-cost", metavar="BASE,PER_RECORD",
                        help="emulated device compute cost of the real workers in seconds (workers.step_base_s, "
                             "workers.step_per_record_s): a step on n records lasts at least (BASE + PER_RECORD n) x "
                             "slowdown. Default: the simulator's default cost model (0.01,0.002) when the real "
                             "workers have compute slowdowns, else 0,0 (the slowdown rule alone)")
    parser.add_argument("--real-row-params", action="append", default=[], metavar="ROW:KEY=VALUE,...",
                        help="strategy parameters replacing a row's own in the real subset and its simulated "
                             "prediction, e.g. adsp:commit_rate=2,search=false (repeatable)")
    parser.add_argument("--bootstrap", help="existing cluster for --real (default: start a local broker)")
    parser.add_argument("--real-from", action="append", metavar="JSON",
                        help="keep the real-broker entries of an earlier strategies.json (repeatable)")
    parser.add_argument("--reuse-matrix", metavar="JSON",
                        help="take the simulated runs (and calibration) from an earlier strategies.json with the same "
                             "settings instead of simulating again (e.g. to add a --real subset)")
    parser.add_argument("--rerun", metavar="ROWS",
                        help="with --reuse-matrix: simulate these rows again (comma list), reuse the others")
    tuning.add_arguments(parser)
    parser.add_argument("--out", default=str(RESULTS / "strategies"), help="output path without suffix")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    s = Settings(budget_s=args.budget, acc_budget_s=min(args.acc_budget, args.budget), repeats=args.repeats)
    reg = regimes()
    regime_names = [r for r in args.regimes.split(",") if r]
    partitions = [p for p in args.partitions.split(",") if p]
    bad = (set(regime_names) - set(reg)) | (set(partitions) - set(PARTITIONS))
    if bad:
        parser.error(f"unknown regimes or partitions: {sorted(bad)}")
    specs = [c for c in (args.costs or "").split(",") if c] + list(args.cost_models or [])
    costs, models, sources = cost_models_of(parser, specs or list(COST_MODELS),
                                            tuple(len(reg[r].rates) for r in regime_names))
    rows = [r for r in (args.rows or ",".join(ROWS)).split(",") if r]
    notes = []
    # Registered strategies without a tuned row join the default matrix (not an explicit --rows).
    extra = unconfigured_strategies() if args.rows is None else []
    if extra:
        rows += [r for r in extra if r not in rows]
        notes.append(f"registered strategies without a tuned row, run with defaults: {', '.join(extra)}")
    try:
        slow = tuple(float(x) for x in args.real_slowdowns.split(",")) if args.real_slowdowns else None
        step_cost = tuple(float(x) for x in args.real_step_cost.split(",")) if args.real_step_cost else None
        real = RealSpec.parse(args.real, args.real_workers, slow, step_cost) if args.real else None
        if real is not None:
            real.row_params = parse_row_params(args.real_row_params)
            if args.real_rates:
                rates = tuple(float(x) for x in args.real_rates.split(","))
                rates = rates * real.workers if len(rates) == 1 else rates
                if len(rates) != real.workers or not all(math.isfinite(r) and r > 0 for r in rates):
                    raise ValueError(f"--real-rates needs {real.workers} rates > 0 (or one), got {args.real_rates}")
                real.rates = rates
    except ValueError as exc:
        parser.error(str(exc))
    columns = [(r, p) for r in regime_names for p in partitions]
    seeds = [s.first_seed + i for i in range(s.repeats)]
    tune = tuning.from_args(parser, args, seeds)
    if tune is not None and real is not None:
        parser.error("--tune-lr tunes the simulated matrix only: run the --real subset in its own invocation "
                     "(without --tune-lr; it runs at the base learning rates)")

    calibration = None
    previous = json.loads(Path(args.reuse_matrix).read_text()) if args.reuse_matrix else None
    if previous is not None:
        # Settings added since the file was written (rows it does not hold) may be new keys.
        differ = {k for k in set(previous["settings"]) | set(asdict(s))
                  if k in previous["settings"] and previous["settings"][k] != asdict(s).get(k)}
        if differ:
            parser.error(f"--reuse-matrix: settings differ: {previous['settings']} vs {asdict(s)}")
        calibration = previous["cost_models"].get("calibrated")
        before = previous.get("tuning")
        if tune is None and before:
            parser.error(f"--reuse-matrix: {args.reuse_matrix} was tuned (--tune-lr --lr-grid "
                         f"{','.join(f'{m:g}' for m in before['grid'])} --tune-seed "
                         f"{','.join(map(str, before['seeds']))}): give the same flags to reuse it")
        if tune is not None and not before:
            parser.error(f"--reuse-matrix: {args.reuse_matrix} was not tuned (its runs are at the base learning "
                         f"rates): run the tuned matrix without --reuse-matrix")
        if tune is not None and (tuple(before["grid"]) != tune.grid or tuple(before["seeds"]) != tune.seeds):
            parser.error(f"--reuse-matrix: {args.reuse_matrix} was tuned on grid "
                         f"{','.join(f'{m:g}' for m in before['grid'])} and seeds "
                         f"{','.join(map(str, before['seeds']))}, not {','.join(f'{m:g}' for m in tune.grid)} and "
                         f"{','.join(map(str, tune.seeds))}")
    elif CALIBRATED in costs or real is not None:
        print("calibrating: timing compute_gradient (mlp, 1 torch thread) ...", flush=True)
        calibration = calibrate()
        print(f"  c0 = {calibration['compute_base_s'] * 1e3:.3f} ms, c1 = {calibration['compute_per_record_s'] * 1e6:.2f} "
              f"us/record; medians by batch size: "
              + ", ".join(f"{b}: {v * 1e3:.3f} ms" for b, v in calibration["median_s"].items()), flush=True)
    tasks = [Task(r, p, seed, "oracle", None) for seed in seeds for r, p in columns]
    tasks += [Task(r, p, seed, row, cost) for seed in seeds for r, p in columns for cost in costs for row in rows]
    rerun = [r for r in (args.rerun or "").split(",") if r]
    tuned, tune_raw, tune_seconds = None, [], 0.0
    if tune is not None:
        # The grid on the tuning seeds first (rows of --rerun tuned again, the rest reused), then
        # the reporting seeds at each cell's chosen multiplier.
        grid_tasks = tuning_tasks(tune, columns, costs, rows)
        todo = grid_tasks
        if previous is not None:
            have = {_run_key(r): r for r in previous["tuning"]["runs"]}
            wanted_grid = [t for t in grid_tasks if t.row not in rerun]
            tune_raw = [have[_task_key(t)] for t in wanted_grid if _task_key(t) in have]
            if len(tune_raw) < len(wanted_grid):
                parser.error(f"--reuse-matrix: {len(wanted_grid) - len(tune_raw)} of the {len(wanted_grid)} tuning "
                             f"runs asked for are not in {args.reuse_matrix}")
            todo = [t for t in grid_tasks if t.row in rerun]
        if todo:
            print(f"tuning the learning rate: {len(todo)} simulated runs (grid "
                  f"{', '.join(f'x{m:g}' for m in tune.grid)}, tuning seed {', '.join(map(str, tune.seeds))}) on "
                  f"{args.jobs} processes ...", flush=True)
            started = time.monotonic()
            tune_raw += run_matrix(todo, s, calibration, args.jobs, progress=lambda line: print("tuning " + line,
                                                                                                flush=True),
                                   models=models, show_lr=True)
            tune_seconds = time.monotonic() - started
        if previous is not None:
            tune_seconds += previous["tuning"].get("seconds", 0.0)
        order = {_task_key(t): i for i, t in enumerate(grid_tasks)}
        tune_raw.sort(key=lambda r: order[_run_key(r)])
        tuned = choose_lrs(tune_raw, tune)
        for key, rec in tuned.items():
            print(f"chosen: {key} {tuning.mult_text(rec)}", flush=True)
        tasks = [replace(t, lr_mult=reporting_mult(tuned, t), split=tuning.run_split(tune)) for t in tasks]
    if previous is not None:
        again = [t for t in tasks if t.row in rerun]
        wanted = {_task_key(t) for t in tasks if t.row not in rerun}
        raw = [r for r in previous["runs"] if _run_key(r) in wanted]
        missing = len(wanted) - len(raw)
        if missing:
            parser.error(f"--reuse-matrix: {missing} of the {len(wanted)} runs asked for are not in {args.reuse_matrix}")
        seconds = previous["matrix_seconds"]
        print(f"reusing {len(raw)} simulated runs from {args.reuse_matrix}", flush=True)
        if again:
            # Rows whose code changed since: simulated again, the rest kept (same settings and seeds).
            print(f"simulating {len(again)} runs of {', '.join(rerun)} again on {args.jobs} processes ...", flush=True)
            started = time.monotonic()
            raw += run_matrix(again, s, calibration, args.jobs, progress=lambda line: print(line, flush=True),
                              models=models, show_lr=tune is not None)
            notes.append(f"rows {', '.join(rerun)} simulated again ({(time.monotonic() - started) / 60:.1f} min) "
                         f"after a code change; the other rows are from the earlier run")
            order = {_task_key(t): i for i, t in enumerate(tasks)}
            raw.sort(key=lambda r: order[_run_key(r)])
    else:
        print(f"{len(tasks)} simulated runs on {args.jobs} processes ...", flush=True)
        started = time.monotonic()
        raw = run_matrix(tasks, s, calibration, args.jobs, progress=lambda line: print(line, flush=True),
                         models=models, show_lr=tune is not None)
        seconds = time.monotonic() - started
    cells = summarise(raw, s, rows, columns, costs, tuned)
    md = "## Strategy matrix (simulated clock)\n\n" + markdown(cells, s, rows, columns, costs, calibration, seconds,
                                                               seeds, notes, models, tune)
    judged = claims.judge(raw, costs, s.budget_s)
    if judged:
        md += "\n\n" + claims.markdown(judged, costs).rstrip("\n")
    staged = stage_split_runs(s, seeds, partitions) if args.rows is None else []
    if staged:
        md += "\n\n" + stage_split_markdown(staged, s)
    # Real-broker entries of earlier invocations are kept: those of the reused matrix file and of
    # --real-from (a file with other simulated settings: its own predictions stay beside it).
    kept: list[dict[str, Any]] = list(previous.get("real", [])) if previous is not None else []
    for path in args.real_from or []:
        kept += json.loads(Path(path).read_text()).get("real", [])
    new_entries: list[dict[str, Any]] = []
    if real is not None:
        new_entries = real_runs(real, s, args.real_repeats, args.bootstrap, calibration, first_seed=args.real_first_seed,
                                progress=lambda line: print(line, flush=True))
        # A new run of the same subset replaces the kept one.
        kept = [e for e in kept if _real_key(e) + (_row_label(e), e["seed"])
                not in {_real_key(n) + (_row_label(n), n["seed"]) for n in new_entries}]
    real_entries = kept + new_entries
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for e in real_entries:
        groups.setdefault(_real_key(e), []).append(e)
    for (regime, partition, workers, slow, step_cost, rates), entries in groups.items():
        spec = RealSpec(regime, partition, list(dict.fromkeys(e["row"] for e in entries)), workers, slow, step_cost,
                        rates=rates)
        md += "\n\n" + real_markdown(entries, spec, s)
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    heat_map(cells, rows, columns, costs, s, out.with_suffix(".png"))
    out.with_suffix(".md").write_text(md + "\n")
    import torch

    out.with_suffix(".json").write_text(json.dumps({
        "benchmark": "strategies", "clock": "simulated (matrix); wall (real)",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "processor": platform.processor()},
        "versions": {"torch": torch.__version__, "numpy": np.__version__},
        "settings": asdict(s), "seeds": seeds,
        "regimes": {name: {**asdict(reg[name]), "H_rates": heterogeneity(reg[name].rates),
                           "H_speeds": heterogeneity(tuple(1 / x for x in reg[name].slowdowns)),
                           "H_links": heterogeneity(reg[name].links_mbit)} for name in regime_names},
        "partitions": partitions, "rows": rows, "cost_models": {
            "default": asdict(simclock.CostModel()),
            **{name: asdict(model) for name, model in models.items()},
            **({"calibrated": calibration} if calibration else {})},
        "cost_model_sources": sources,
        "matrix_seconds": seconds, "jobs": args.jobs, "notes": notes,
        "runs": raw, "cells": cells, "claims": judged, "real": real_entries, "stage_split": staged,
        "tuning": None if tune is None else {**tune.to_json(), "seconds": tune_seconds, "choices": tuned,
                                             "runs": tune_raw},
    }, indent=1, default=str))
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
