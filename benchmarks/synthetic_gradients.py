"""Synthetic gradients (HotEdge 2019, after Jaderberg et al.'s DNI) on the real broker:
whole-model backprop vs the stage-split strategies pipeline_bp, dni and cdni.

One model (``conv8``, BatchNorm, ``--width`` channels, ``--hidden`` FC units) on the digits
set, the same data, initial weights, stream, fixed batches of 32, LR 0.05, momentum 0.9, one
torch thread per process. Arms:

  backprop     one process, the whole model (bsp with one worker = plain SGD backprop)
  pipeline_bp  3 stages (cut after block1 and block3), one process each, true gradients
               only, one batch in flight (the model-parallel baseline)
  dni / cdni   the same 3 stages, each updating at once from a (label-conditioned for
               cdni) synthetic gradient; trust gate on (the default); a synthesiser with one
               hidden layer of ``--synth-hidden`` (64) units
  cdni_linear  cdni with the strategy's default linear synthesiser (at block1 of width 48 its
               input and output are 3072 values: 9.5M weights, ~110 ms per Adam update)

Weak devices: every process has ``workers.slowdown = [S]`` (a step measured at t then
waits (S-1)t: the compute of a slow device, by waiting, so the two cores are not what is
measured). Devices stream a fixed number of records N (``constant`` profile, rates x
duration, a multiple of 32 per device) faster than any arm trains; the run then drains
until every record is trained, so every arm trains the same N samples:

- accuracy at N samples: the final model on the held-out 20 % (stage arms: the run's
  ``assembled`` entry, the stages' final checkpoints put together; backprop: the worker's
  final held-out evaluation at shutdown, training.json ``accuracy``: both are the final
  weights evaluated by ``trainers.evaluation.evaluate`` on the same held-out set);
- steady-state samples/s: least-squares slope of the top stage's cumulative samples
  (``observations.stage_samples`` of the last worker in evaluations.jsonl; backprop:
  steps x 32) over wall time, between 20 % and 80 % of its final count;
- synthesiser loss per stage over time (``observations.synthesizer_loss`` of every stage
  but the top); prequential accuracy of the top stage over samples and time.

A deeper split (``--deep-arms``, default backprop, pipeline_bp, cdni): the same with 5
stages (cut after block1, block2, block3, fc1). Repeats are interleaved, the arm order
rotated per repeat. Writes benchmarks/results/synthetic_gradients.{json,md,png}. Never
asserts; exits 1 after writing the results if a run failed (its log directory is printed).

``--tune-lr [--lr-grid 0.5,1,2] [--tune-seed 1000]`` (benchmarks/tuning.py): before the
reporting runs, every (split, arm) runs once per multiplier of the trainer LR on the tuning
seed (its own stream, shares and initial weights), measured on its **validation split**
(``data.evaluate_on = validation``: the test split is not in a tuning job), and the arm
reports at the multiplier with the highest validation accuracy at N (then the lowest
validation loss; ties towards x1). Every run, tuning or reporting, then draws its test
split with seed 0 (``data.heldout_seed``). The synthesiser's own Adam LR (``synth_lr``) is
not scaled. ``--stop-by`` applies to the reporting runs.

    scripts/with-venv.sh python -m edgestream bench synthetic_gradients [--repeats 3]
        [--deep-repeats 2] [--quick] [--arms backprop,pipeline_bp,dni,cdni] [--out DIR]
        [--tune-lr [--lr-grid 0.5,1,2]]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edgestream.benchmarks import tuning
from edgestream.job.config import JobConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ARMS = ("backprop", "pipeline_bp", "dni", "cdni", "cdni_linear")
DEEP_ARMS = ("backprop", "pipeline_bp", "cdni")
SPLIT3 = ("block1", "block3")
SPLIT5 = ("block1", "block2", "block3", "fc1")
BATCH = 32


@dataclass
class Settings:
    width: int = 48
    hidden: int = 256
    slowdown: float = 4.0
    devices: int = 3
    rate_hz: float = 320.0
    duration_s: float = 10.0
    message_interval_s: float = 0.05
    drain_timeout_s: float = 300.0
    lr: float = 0.05
    momentum: float = 0.9
    eval_every_s: float = 1.0
    max_in_flight: int = 4
    #: dni/cdni synthesiser: one hidden layer of this width (0: linear, the strategy's default;
    #: the ``cdni_linear`` arm always uses 0).
    synth_hidden: int = 64
    #: train.grad_norm_spike for every arm (0: off). The default (100) rejected every step of
    #: a 5-stage cdni's stage 0 once its trust gate opened (see the results).
    grad_norm_spike: float = 0.0
    #: Devices of the 5-stage runs (the config wants at least one device per worker) and
    #: each one's rate: the same N as the 3-stage runs.
    deep_devices: int = 6
    seed: int = 0
    repeats: int = 3
    deep_repeats: int = 2
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    deep_arms: list[str] = field(default_factory=lambda: list(DEEP_ARMS))

    def per_device(self, devices: int | None = None) -> int:
        rate = self.rate_hz * self.devices / (devices or self.devices)
        return int(round(self.duration_s / self.message_interval_s)) * int(round(rate * self.message_interval_s))

    def n(self, devices: int | None = None) -> int:
        return (devices or self.devices) * self.per_device(devices)


def quick(s: Settings) -> Settings:
    """1 repeat of each arm and of the deep split (none with --deep-repeats 0), 3 s of streaming
    (2880 samples)."""
    return replace(s, repeats=1, deep_repeats=min(s.deep_repeats, 1), duration_s=3.0)


# -- the job ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """What a run changes from the benchmark's settings: the trainer LR's multiplier, the seed
    (None: ``Settings.seed``) and the data split (``tuning.SPLITS``)."""

    lr_mult: float = 1.0
    seed: int | None = None
    split: str = "seed"


def job_toml(arm: str, split: tuple[str, ...], s: Settings, state: Path, tag: str, variant: Variant = Variant()
             ) -> str:
    """The job of one run as TOML (model_params are a list of strings: not through --set)."""
    stages = [] if arm == "backprop" else list(split)
    workers = 1 if arm == "backprop" else len(split) + 1
    strategy = "bsp" if arm == "backprop" else arm.split("_")[0] if arm == "cdni_linear" else arm
    params = [] if arm == "backprop" else [f"max_in_flight={s.max_in_flight}"]
    if arm in ("dni", "cdni"):
        params.append(f"synth_hidden={s.synth_hidden}")
    devices = s.devices if len(split) + 1 <= s.devices else s.deep_devices
    rate = s.rate_hz * s.devices / devices
    q = json.dumps
    data = [f"heldout_seed = {q(str(v))}" for v in tuning.split_params(variant.split).values()]
    if variant.split == "tuning":
        data.append('evaluate_on = "validation"')
    return "\n".join([
        "[job]", f"name = {q('sg' + tag)}", f"seed = {s.seed if variant.seed is None else variant.seed}",
        "[data]", 'source = "digits"', 'partition = "iid"', *data,
        "[devices]", f"count = {devices}", f"ids = {q([f'sg{tag}d{i}' for i in range(devices)])}",
        f"rates_hz = {q([rate] * devices)}", 'profile = "constant"',
        f"message_interval_s = {s.message_interval_s}",
        "[buffer]", 'policy = "persist"', "capacity = 1000000",
        "[batcher]", 'mode = "fixed"', f"batch_size = {BATCH}",
        "[workers]", f"count = {workers}", f"slowdown = [{s.slowdown}]",
        "[train]", "enabled = true", 'model = "conv8"',
        f"model_params = {q(['norm=batch', f'width={s.width}', f'hidden={s.hidden}'])}",
        f"stages = {q(stages)}", f"strategy = {q(strategy)}", f"strategy_params = {q(params)}",
        f"max_step_batch = {BATCH}", f"lr = {s.lr * variant.lr_mult}", f"momentum = {s.momentum}", "torch_threads = 1",
        f"eval_every_s = {s.eval_every_s}", "checkpoint_every_steps = 1000000",
        f"grad_norm_spike = {s.grad_norm_spike}",
        "[run]", f"duration_s = {s.duration_s}", f"drain_timeout_s = {s.drain_timeout_s}",
        f"state_dir = {q(str(state / tag))}", "",
    ])


def job(arm: str, split: tuple[str, ...], s: Settings, state: Path, tag: str, variant: Variant = Variant()
        ) -> JobConfig:
    path = state / f"{tag}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(job_toml(arm, split, s, state, tag, variant))
    return load_config(path, env={})


# -- reading a run ---------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def slope(points: list[tuple[float, float]], lo: float = 0.2, hi: float = 0.8) -> float | None:
    """Samples/s: least-squares slope of (t, samples) between ``lo`` and ``hi`` of the final count."""
    if not points:
        return None
    final = points[-1][1]
    sel = [(t, n) for t, n in points if lo * final <= n <= hi * final]
    if len(sel) < 3 or sel[-1][0] <= sel[0][0]:
        return None
    t, n = np.array(sel).T
    return float(np.polyfit(t, n, 1)[0])


def run_one(arm: str, split: tuple[str, ...], group: str, repeat: int, s: Settings, bootstrap: str,
            state: Path, variant: Variant = Variant()) -> dict[str, Any]:
    from rich.console import Console

    from edgestream.pipeline.run import run_job

    tag = uuid.uuid4().hex[:6]
    entry: dict[str, Any] = {"arm": arm, "group": group, "split": list(split), "repeat": repeat, "tag": tag,
                             "state_dir": str(state / tag), "logs": str(state / tag / "logs"),
                             "seed": s.seed if variant.seed is None else variant.seed, "lr_mult": variant.lr_mult,
                             "lr": s.lr * variant.lr_mult, "data_split": variant.split,
                             "loadavg_before": os.getloadavg()}
    started = time.monotonic()
    try:
        cfg = job(arm, split, s, state, tag, variant)
        result = run_job(cfg, bootstrap, console=Console(file=io.StringIO(), width=200), live=False)
    except Exception as exc:  # one failed run must not lose the others' figures
        entry.update(error=f"{type(exc).__name__}: {exc}", wall_s=round(time.monotonic() - started, 1),
                     loadavg_after=os.getloadavg())
        return entry
    entry["wall_s"] = round(time.monotonic() - started, 1)
    entry["loadavg_after"] = os.getloadavg()
    origin = json.loads((cfg.state_path() / "simulation.json").read_text())["started_at"]
    produced = sum(result.produced.values())
    entry.update(produced=produced, balanced=result.balanced, restarts=list(result.restarted),
                 deaths=list(result.deaths))
    wdir = cfg.state_path() / "workers"
    names = cfg.worker_names()
    top = names[-1]
    evals = {w: read_jsonl(wdir / w / "evaluations.jsonl") for w in names}
    if arm == "backprop":
        ev = evals[top]
        samples = [(round(e["t"] - origin, 3), int(e["steps"]) * BATCH) for e in ev]
        entry["heldout"] = [(round(e["t"] - origin, 3), int(e["steps"]) * BATCH, round(e["accuracy"], 4))
                            for e in ev if "accuracy" in e]
        final = result.training[top]
        last = next((e for e in reversed(ev) if "loss" in e), {})  # shutdown's held-out evaluation
        entry.update(accuracy=float(final["accuracy"]), loss=last.get("loss"),
                     accuracy_source="final held-out evaluation (training.json; loss: its evaluations.jsonl line)")
    else:
        ev = evals[top]
        samples = [(round(e["t"] - origin, 3), int(e["observations"].get("stage_samples", 0))) for e in ev]
        asm = result.assembled or {}
        entry.update(accuracy=asm.get("accuracy"), loss=asm.get("loss"), assembled_versions=asm.get("versions"),
                     accuracy_source="assembled (stages' final checkpoints)")
        entry["synth_loss"] = {w: [(round(e["t"] - origin, 3), e["observations"].get("synthesizer_loss"))
                                   for e in evals[w] if e.get("observations", {}).get("synthesizer_loss") is not None]
                               for w in names[:-1]}
        entry["stage_samples_final"] = {w: (evals[w][-1]["observations"].get("stage_samples") if evals[w] else None)
                                        for w in names}
        entry["strategy_stats"] = {w: result.training[w].get("strategy_stats", {}) for w in names}
    entry["samples"] = samples
    entry["prequential"] = [(round(e["t"] - origin, 3), n, round(e.get("prequential_accuracy") or 0.0, 4))
                            for e, (_, n) in zip(ev, samples, strict=True)]
    entry["trained"] = samples[-1][1] if samples else 0
    entry["samples_per_s"] = slope(samples)
    done = [t for t, n in samples if n >= entry["trained"]]
    entry["time_to_all_s"] = done[0] if done else None
    entry["steps"] = {w: result.training[w].get("steps") for w in names}
    entry["rejected_steps"] = sum(int(result.training[w].get("rejected_steps") or 0) for w in names)
    entry["dead_lettered_records"] = sum(int(result.training[w].get("dead_lettered_records") or 0) for w in names)
    return entry


# -- learning-rate tuning (--tune-lr) -------------------------------------------------------
def tuning_plan(s: Settings, spec: tuning.TuneSpec) -> list[tuple[str, tuple[str, ...], str, Variant]]:
    """The tuning runs: every (split, arm) at every multiplier on every tuning seed, measured
    on its validation split: ``(group, split, arm, variant)``."""
    groups = [("3 stages", SPLIT3, s.arms)] + ([("5 stages", SPLIT5, s.deep_arms)] if s.deep_repeats else [])
    return [(group, split, arm, Variant(m, seed, "tuning")) for group, split, arms in groups
            for seed in spec.seeds for m in spec.grid for arm in arms]


def choose_arms(runs: list[dict[str, Any]], spec: tuning.TuneSpec) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (arm, group), the record of its choice (``tuning.record``): the highest validation
    accuracy at N, then the lowest validation loss, ties towards x1 (no target: every arm
    trains the same N samples). A failed tuning run has no accuracy and ranks last."""
    return tuning.choose_cells(runs, spec, lambda r: (r["arm"], r["group"]), acc="accuracy", loss="loss")


def chosen_variant(choices: dict[tuple[str, str], dict[str, Any]] | None, arm: str, group: str) -> Variant:
    """A reporting run's variant: the arm's chosen multiplier on the fixed test split when
    tuned, else the base LR on the seed's own split."""
    if choices is None:
        return Variant()
    return Variant(choices[(arm, group)]["chosen_mult"], None, "fixed")


# -- summary ---------------------------------------------------------------------------------
def spread(values: list[float]) -> dict[str, Any] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals), "all": vals}


def paired_ratio(runs: list[dict], group: str, a: str, b: str, key: str = "samples_per_s") -> dict | None:
    """a / b of ``key`` within each repeat (same invocation, back to back), then medians."""
    ratios = []
    for r in sorted({e["repeat"] for e in runs if e["group"] == group}):
        x = next((e.get(key) for e in runs if e["group"] == group and e["repeat"] == r and e["arm"] == a), None)
        y = next((e.get(key) for e in runs if e["group"] == group and e["repeat"] == r and e["arm"] == b), None)
        if x is not None and y:
            ratios.append(x / y)
    return spread(ratios)


def paired_gap(runs: list[dict], group: str, a: str, b: str = "backprop") -> dict | None:
    """(accuracy of a - accuracy of b) in points, within each repeat."""
    gaps = []
    for r in sorted({e["repeat"] for e in runs if e["group"] == group}):
        x = next((e.get("accuracy") for e in runs if e["group"] == group and e["repeat"] == r and e["arm"] == a), None)
        y = next((e.get("accuracy") for e in runs if e["group"] == group and e["repeat"] == r and e["arm"] == b), None)
        if x is not None and y is not None:
            gaps.append(100.0 * (x - y))
    return spread(gaps)


def summarise(runs: list[dict], s: Settings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for group, arms in (("3 stages", s.arms), ("5 stages", s.deep_arms)):
        sel = [e for e in runs if e["group"] == group and "error" not in e]
        if not sel:
            continue
        g: dict[str, Any] = {"arms": {}, "ratios": {}, "gaps": {}}
        for arm in arms:
            es = [e for e in sel if e["arm"] == arm]
            if es:
                g["arms"][arm] = {k: spread([e.get(k) for e in es]) for k in
                                  ("samples_per_s", "accuracy", "loss", "trained", "time_to_all_s", "wall_s")}
        for a, b in (("cdni", "pipeline_bp"), ("cdni", "backprop"), ("dni", "pipeline_bp"), ("dni", "backprop"),
                     ("pipeline_bp", "backprop"), ("cdni", "dni"),
                     ("cdni_linear", "pipeline_bp"), ("cdni_linear", "backprop")):
            if a in arms and b in arms:
                g["ratios"][f"{a}/{b}"] = paired_ratio(sel, group, a, b)
        for a in arms:
            if a != "backprop" and "backprop" in arms:
                g["gaps"][a] = paired_gap(sel, group, a)
        out[group] = g
    return out


def fmt(x: dict | None, f: str = ".0f", scale: float = 1.0) -> str:
    if x is None:
        return "-"
    med = format(x["median"] * scale, f)
    return med if x["n"] == 1 else f"{med} ({format(x['min'] * scale, f)} to {format(x['max'] * scale, f)})"


def markdown(table: dict[str, Any], runs: list[dict], s: Settings, meta: dict[str, Any]) -> str:
    lr_tuned = " times the arm's tuned multiplier (below)" if meta.get("tuning") else ""
    lines = [
        *([meta["note"], ""] if meta.get("note") else []),
        f"Command: `{meta['command']}` ({meta['seconds'] / 60:.1f} min, {meta['started']} to {meta['ended']} UTC; "
        f"commit {meta['commit']}).", "",
        f"Set-up: digits (held-out 20 %), `conv8` norm=batch width={s.width} hidden={s.hidden} "
        f"({meta['parameters']:,} parameters); {s.devices} devices at {s.rate_hz:g} records/s each (constant profile, "
        f"{s.message_interval_s:g} s messages) for {s.duration_s:g} s = **N = {s.n()} samples** per run "
        f"({s.per_device()} per device; the 5-stage runs: {s.deep_devices} devices at "
        f"{s.rate_hz * s.devices / s.deep_devices:g} records/s, the same N: the stream of the first "
        f"runs of this benchmark, when a job could not have more workers than devices), then drained (drain timeout {s.drain_timeout_s:g} s) until every "
        f"record is trained; fixed batches of {BATCH}, max_step_batch {BATCH}, LR {s.lr}{lr_tuned}, momentum {s.momentum}, "
        f"torch_threads 1, train.grad_norm_spike {s.grad_norm_spike:g} (0 = the spike guard off, every arm), every process slowed x{s.slowdown:g} by waiting (workers.slowdown). Stage split "
        f"3 stages: cut after {', '.join(SPLIT3)}; 5 stages: after {', '.join(SPLIT5)}; dni/cdni max_in_flight "
        f"{s.max_in_flight}, trust gate on (default); dni and cdni with a synthesiser of one hidden layer of "
        f"{s.synth_hidden} (`synth_hidden`), `cdni_linear` = cdni with the default linear synthesiser.",
        f"Measured compute of one step of 32 (this machine, 1 thread, before the slowdown): "
        f"{meta['step_ms']}.", "",
        f"Machine: {meta['machine']['cpus']} cores (1-min load average after the runs "
        f"{meta['load_min']:.1f}-{meta['load_max']:.1f}: the broker, the processes of the run and any other work); Python "
        f"{meta['machine']['python']}, torch {meta['versions']['torch']}, numpy {meta['versions']['numpy']}, "
        f"Kafka {meta['versions']['kafka']}, {meta['machine']['platform']}.", "",
        "Accuracy at N samples = the final weights on the held-out set (stage arms: the run's `assembled` entry "
        "from the stages' final checkpoints; backprop: the worker's final held-out evaluation at shutdown). "
        "Samples/s = slope of the top stage's cumulative samples (backprop: steps x 32) between 20 % and 80 % of "
        "its final count. Ratios and gaps are paired within a repeat (same invocation, back to back, arm order "
        "rotated per repeat); medians (min to max) over repeats.", "",
    ]
    for group, g in table.items():
        lines += [f"### {group}", "",
                  "| arm | samples/s | accuracy at N | held-out loss | gap to backprop (points) | samples trained "
                  "| s to train all | run s | repeats |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for arm, a in g["arms"].items():
            lines.append(f"| {arm} | {fmt(a['samples_per_s'])} | {fmt(a['accuracy'], '.3f')} | {fmt(a['loss'], '.3f')} "
                         f"| {fmt(g['gaps'].get(arm), '+.1f') if arm != 'backprop' else '-'} | {fmt(a['trained'])} "
                         f"| {fmt(a['time_to_all_s'], '.1f')} | {fmt(a['wall_s'])} | {a['samples_per_s']['n'] if a['samples_per_s'] else 0} |")
        lines += ["", "| ratio of samples/s | median (min to max) |", "|---|---:|"]
        for k, v in g["ratios"].items():
            lines.append(f"| {k} | {fmt(v, '.2f')} |")
        lines.append("")
    tuned = meta.get("tuning")
    if tuned:
        spec = tuning.TuneSpec(tuple(tuned["grid"]), tuple(tuned["seeds"]))
        keyed = {(key.split("/", 1)[1], key.split("/", 1)[0]): rec for key, rec in tuned["choices"].items()}
        arms = list(dict.fromkeys(arm for arm, _ in keyed))
        lines += [*tuning.markdown_table(keyed, arms, [g for g in ("3 stages", "5 stages") if g in table], spec,
                                         "Learning rate chosen on the tuning seed (validation accuracy at N)"), ""]
    if meta.get("skipped"):
        lines += [f"Not run (past --stop-by): {'; '.join(meta['skipped'])}.", ""]
    lines += ["### Against the issue's figures", "", *claims(table), ""]
    problems = [e for e in runs if "error" in e or not e.get("balanced", True) or e.get("deaths")
                or e.get("rejected_steps")
                or (e.get("trained") is not None and e.get("produced") and e["trained"] != e["produced"])]
    if problems:
        lines += ["### Runs with problems", ""]
        for e in problems:
            what = e.get("error") or ", ".join(
                x for x in [("accounting not balanced" if not e.get("balanced", True) else ""),
                            (f"deaths {e['deaths']}" if e.get("deaths") else ""),
                            (f"{e['rejected_steps']} steps rejected by the step guard, "
                             f"{e['dead_lettered_records']} records dead-lettered" if e.get("rejected_steps") else ""),
                            (f"top stage trained {e.get('trained')} of {e.get('produced')} produced"
                             if e.get("trained") != e.get("produced") else "")] if x)
            lines.append(f"- {e['group']} {e['arm']} repeat {e['repeat']}: {what} (logs: {e['logs']})")
        lines.append("")
    lines += ["Per run (group, arm, repeat: samples/s, accuracy, samples trained, run s):", ""]
    for e in runs:
        if "error" in e:
            lines.append(f"- {e['group']} {e['arm']} #{e['repeat']}: failed")
        else:
            sps = f"{e['samples_per_s']:.0f}" if e.get("samples_per_s") else "-"
            acc = f"{e['accuracy']:.3f}" if e.get("accuracy") is not None else "-"
            lines.append(f"- {e['group']} {e['arm']} #{e['repeat']}: {sps} samples/s, accuracy {acc}, "
                         f"{e['trained']}/{e['produced']} samples, {e['wall_s']:.0f} s")
    return "\n".join(lines)


def claims(table: dict[str, Any]) -> list[str]:
    out = []
    g = table.get("3 stages")
    if g:
        r = g["ratios"].get("cdni/pipeline_bp")
        if r:
            out.append(f"- cdni/pipeline_bp samples/s {fmt(r, '.2f')}: the paper's >= 1.11x "
                       f"{'met' if r['median'] >= 1.11 else 'NOT met'} (median).")
        r = g["ratios"].get("cdni/backprop")
        if r:
            out.append(f"- cdni/backprop samples/s {fmt(r, '.2f')}: > 1 {'met' if r['median'] > 1 else 'NOT met'} "
                       "(median).")
        r = g["ratios"].get("dni/pipeline_bp")
        if r:
            out.append(f"- dni/pipeline_bp samples/s {fmt(r, '.2f')}.")
        gap = g["gaps"].get("cdni")
        if gap:
            out.append(f"- cdni accuracy gap to backprop {fmt(gap, '+.1f')} points: within 2 points "
                       f"{'met' if gap['median'] >= -2 else 'NOT met'} (median).")
        r = g["ratios"].get("cdni_linear/pipeline_bp")
        if r:
            out.append(f"- cdni with the default linear synthesiser (cdni_linear): /pipeline_bp {fmt(r, '.2f')}, "
                       f"/backprop {fmt(g['ratios'].get('cdni_linear/backprop'), '.2f')}, gap to backprop "
                       f"{fmt(g['gaps'].get('cdni_linear'), '+.1f')} points.")
        gap = g["gaps"].get("dni")
        if gap:
            out.append(f"- dni accuracy gap to backprop {fmt(gap, '+.1f')} points.")
    d = table.get("5 stages")
    if d:
        r, gap = d["ratios"].get("cdni/pipeline_bp"), d["gaps"].get("cdni")
        out.append(f"- deeper split (5 stages): cdni/pipeline_bp {fmt(r, '.2f')}, cdni/backprop "
                   f"{fmt(d['ratios'].get('cdni/backprop'), '.2f')}, cdni gap to backprop {fmt(gap, '+.1f')} points, "
                   f"pipeline_bp gap {fmt(d['gaps'].get('pipeline_bp'), '+.1f')} points.")
    return out


# -- plots -----------------------------------------------------------------------------------
COLORS = {"backprop": "black", "pipeline_bp": "tab:blue", "dni": "tab:orange", "cdni": "tab:green",
          "cdni_linear": "tab:red"}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [g for g in ("3 stages", "5 stages") if any(e["group"] == g and "error" not in e for e in runs)]
    fig, axes = plt.subplots(len(groups), 3, figsize=(17, 4.3 * len(groups)), squeeze=False)
    for row, group in zip(axes, groups, strict=True):
        ax_n, ax_t, ax_s = row
        for e in runs:
            if e["group"] != group or "error" in e:
                continue
            c, first = COLORS.get(e["arm"]), e["repeat"] == min(x["repeat"] for x in runs
                                                                 if x["group"] == group and x["arm"] == e["arm"])
            alpha = 1.0 if first else 0.35
            label = e["arm"] if first else None
            if e["prequential"]:
                t, n, a = zip(*e["prequential"], strict=True)
                ax_n.plot(n, a, color=c, alpha=alpha, label=f"{label} (prequential)" if label else None)
                ax_t.plot(t, a, color=c, alpha=alpha, label=f"{label} (prequential)" if label else None)
            if e.get("heldout"):
                t, n, a = zip(*e["heldout"], strict=True)
                ax_n.plot(n, a, color=c, alpha=alpha, linestyle="--", label=f"{label} (held-out)" if label else None)
                ax_t.plot(t, a, color=c, alpha=alpha, linestyle="--", label=f"{label} (held-out)" if label else None)
            if e.get("accuracy") is not None:
                ax_n.scatter([e["trained"]], [e["accuracy"]], color=c, marker="*", s=90, alpha=alpha, zorder=5)
                if e.get("time_to_all_s") is not None:
                    ax_t.scatter([e["time_to_all_s"]], [e["accuracy"]], color=c, marker="*", s=90, alpha=alpha,
                                 zorder=5)
            for k, (w, xs) in enumerate(sorted((e.get("synth_loss") or {}).items())):
                if xs and first:
                    t, v = zip(*xs, strict=True)
                    ax_s.plot(t, v, color=c, linestyle=["-", "--", ":", "-."][k % 4], label=f"{e['arm']} {w}")
        ax_n.set(title=f"{group}: accuracy vs samples (* final held-out)", xlabel="samples trained by the top stage",
                 ylabel="accuracy", ylim=(0, 1))
        ax_t.set(title=f"{group}: accuracy vs wall time (* final held-out)", xlabel="s since the first record",
                 ylabel="accuracy", ylim=(0, 1))
        ax_s.set(title=f"{group}: synthesiser loss (MSE to the true gradient)", xlabel="s since the first record",
                 ylabel="synthesizer_loss")
        if ax_s.lines:
            ax_s.set_yscale("log")
            ax_s.legend(fontsize=7)
        for ax in (ax_n, ax_t):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- main ------------------------------------------------------------------------------------
def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def step_times(s: Settings) -> tuple[str, int]:
    """Median ms of one training step of 32 (forward + backward) per stage of the 3-stage
    split and of the whole model, one thread; and the model's parameter count."""
    import torch

    from edgestream.trainers.models import build_model
    from edgestream.trainers.stages import split_model

    torch.set_num_threads(1)
    model = build_model("conv8", (64,), 10, s.seed, norm="batch", width=s.width, hidden=s.hidden)
    x, y = torch.rand(BATCH, 64), torch.randint(0, 10, (BATCH,))

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        ts = []
        for _ in range(15):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return 1000 * statistics.median(ts)

    def whole() -> None:
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()

    parts = [f"whole model {timed(whole):.1f} ms"]
    for split in (SPLIT3, SPLIT5):
        h, ms = x, []
        stages = split_model(model, split)
        last = len(stages) - 1
        for k, stage in enumerate(stages):
            inp = h.detach().requires_grad_(k > 0)

            def step(stage=stage, inp=inp, top=k == last) -> None:
                stage.zero_grad()
                out = stage(inp)
                (torch.nn.functional.cross_entropy(out, y) if top else (out * out).mean()).backward()

            ms.append(timed(step))
            with torch.no_grad():
                h = stage(inp)
        parts.append(f"{len(stages)} stages {' / '.join(f'{m:.1f}' for m in ms)} ms")
    return "; ".join(parts), sum(p.numel() for p in model.parameters())


def write(runs: list[dict], s: Settings, meta: dict[str, Any], stem: Path, note: str = "") -> None:
    table = summarise(runs, s)
    md = note + markdown(table, runs, s, meta)
    print(md)
    stem.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, stem.with_suffix(".png"))
    stem.with_suffix(".md").write_text("## Synthetic gradients: backprop vs pipeline_bp vs dni vs cdni on the real "
                                       "broker\n\n" + md + f"\n\nPlot: {stem.name}.png\n")
    stem.with_suffix(".json").write_text(json.dumps({
        "benchmark": "synthetic_gradients", "clock": "wall (real processes, real Kafka)", **meta,
        "settings": asdict(s), "n": s.n(), "table": table, "runs": runs}, indent=1, default=str))
    print(f"wrote {stem.with_suffix('.json')}, {stem.with_suffix('.md')}, {stem.with_suffix('.png')}", flush=True)


def resummarise(path: Path, stem: Path, argv: str) -> None:
    """Tables and plot again from an earlier JSON (runs and settings as recorded)."""
    data = json.loads(path.read_text())
    s = Settings(**{k: v for k, v in data["settings"].items() if k in Settings.__dataclass_fields__})
    meta = {k: v for k, v in data.items() if k not in ("benchmark", "clock", "settings", "n", "table", "runs")}
    note = (f"Summarised again from the runs' JSON by `scripts/with-venv.sh python -m edgestream bench "
            f"synthetic_gradients {argv}`.\n\n")
    write(data["runs"], s, meta, stem, note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=Settings.repeats, help="runs of each 3-stage arm")
    parser.add_argument("--deep-repeats", type=int, default=Settings.deep_repeats,
                        help="runs of each arm of the 5-stage split (0: skip it)")
    parser.add_argument("--quick", action="store_true", help="smoke run: " + (quick.__doc__ or ""))
    parser.add_argument("--arms", default=",".join(ARMS), help="3-stage arms (comma list)")
    parser.add_argument("--deep-arms", default=",".join(DEEP_ARMS), help="5-stage arms (comma list)")
    parser.add_argument("--width", type=int, default=Settings.width)
    parser.add_argument("--hidden", type=int, default=Settings.hidden)
    parser.add_argument("--slowdown", type=float, default=Settings.slowdown)
    parser.add_argument("--synth-hidden", type=int, default=Settings.synth_hidden,
                        help="dni/cdni synthesiser hidden width (0: linear)")
    parser.add_argument("--grad-norm-spike", type=float, default=Settings.grad_norm_spike,
                        help="train.grad_norm_spike of every arm (0: off; the product default is 100)")
    parser.add_argument("--rate", type=float, default=Settings.rate_hz, help="records/s of each device")
    parser.add_argument("--duration", type=float, default=Settings.duration_s, help="seconds of streaming")
    parser.add_argument("--stop-by", default="", help="HH:MM UTC: start no run after this (they are listed as skipped)")
    parser.add_argument("--from-json", metavar="PATH",
                        help="run nothing: summarise the runs of an earlier JSON again (tables, plot)")
    parser.add_argument("--out", default=str(RESULTS), help="output directory")
    parser.add_argument("--name", default="synthetic_gradients", help="file name stem of the results")
    tuning.add_arguments(parser)
    args = parser.parse_args()
    if args.from_json and args.tune_lr:
        parser.error("--from-json summarises earlier runs: not with --tune-lr")
    if args.from_json:
        resummarise(Path(args.from_json), Path(args.out) / args.name, " ".join(sys.argv[1:]))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    s = Settings(repeats=args.repeats, deep_repeats=args.deep_repeats, width=args.width, hidden=args.hidden,
                 slowdown=args.slowdown, synth_hidden=args.synth_hidden, grad_norm_spike=args.grad_norm_spike, rate_hz=args.rate, duration_s=args.duration,
                 arms=[a for a in args.arms.split(",") if a], deep_arms=[a for a in args.deep_arms.split(",") if a])
    if args.quick:
        s = quick(s)
    tune = tuning.from_args(parser, args, [s.seed])
    unknown = (set(s.arms) | set(s.deep_arms)) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    if s.per_device() % BATCH or s.per_device(s.deep_devices) % BATCH:
        raise SystemExit(f"records per device ({s.per_device()}) must be a multiple of {BATCH}: change --rate or "
                         "--duration")
    command = "scripts/with-venv.sh python -m edgestream bench synthetic_gradients " + " ".join(sys.argv[1:])
    from edgestream.deploy.kafka.broker import LocalBroker, kafka_version

    began, started = time.monotonic(), time.strftime("%H:%M", time.gmtime())
    step_ms, parameters = step_times(s)
    print(f"step compute (1 thread, before slowdown x{s.slowdown:g}): {step_ms}", flush=True)
    # 3-stage repeats 0 and 1 first, then the deep split and the rest, alternating.
    main = [("3 stages", SPLIT3, s.arms, r) for r in range(s.repeats)]
    deep = [("5 stages", SPLIT5, s.deep_arms, r) for r in range(s.deep_repeats)]
    plan = main[:2]
    for k in range(max(len(main) - 2, len(deep))):
        plan += deep[k:k + 1] + main[2 + k:3 + k]
    skipped: list[str] = []
    total = sum(len(arms) for _, _, arms, _ in plan)
    work = Path(tempfile.mkdtemp(prefix="bench-sg-"))
    runs: list[dict[str, Any]] = []
    tune_runs: list[dict[str, Any]] = []
    choices: dict[tuple[str, str], dict[str, Any]] | None = None
    broker = LocalBroker(work / "kafka").start()
    try:
        if tune is not None:
            grid = tuning_plan(s, tune)
            print(f"tuning the learning rate: {len(grid)} runs (grid {', '.join(f'x{m:g}' for m in tune.grid)}, "
                  f"tuning seed {', '.join(map(str, tune.seeds))}, scored on the validation split) ...", flush=True)
            for k, (group, split, arm, variant) in enumerate(grid, 1):
                e = run_one(arm, split, group, -1, s, broker.bootstrap, work, variant)
                acc = f"{e['accuracy']:.3f}" if e.get("accuracy") is not None else "-"
                print(f"  tuning [{k}/{len(grid)}] {group} {arm} seed {variant.seed} lr x{variant.lr_mult:g} "
                      f"({e['lr']:.3g}): validation accuracy {acc}"
                      + (f" FAILED: {e['error']}" if "error" in e else ""), flush=True)
                tune_runs.append(e)
            choices = choose_arms(tune_runs, tune)
            for (arm, group), rec in choices.items():
                print(f"chosen: {group} {arm} {tuning.mult_text(rec)}", flush=True)
        done = 0
        for group, split, arms, repeat in plan:
            order = arms[repeat % len(arms):] + arms[:repeat % len(arms)]  # rotated per repeat
            for arm in order:
                done += 1
                if args.stop_by and time.strftime("%H:%M", time.gmtime()) >= args.stop_by:
                    skipped.append(f"{group} repeat {repeat} {arm}")
                    print(f"[{done}/{total}] skipped {group} repeat {repeat} {arm}: past --stop-by {args.stop_by} UTC",
                          flush=True)
                    continue
                print(f"[{done}/{total}] {group} repeat {repeat} {arm} (elapsed {time.monotonic() - began:.0f} s) ...",
                      flush=True)
                e = run_one(arm, split, group, repeat, s, broker.bootstrap, work, chosen_variant(choices, arm, group))
                if "error" in e:
                    print(f"  FAILED after {e['wall_s']} s: {e['error']} (logs: {e['logs']})", flush=True)
                else:
                    sps = f"{e['samples_per_s']:.0f}" if e.get("samples_per_s") else "-"
                    acc = f"{e['accuracy']:.3f}" if e.get("accuracy") is not None else "-"
                    print(f"  {sps} samples/s, accuracy {acc}, trained {e['trained']}/{e['produced']}, "
                          f"{e['wall_s']} s, balanced {e['balanced']}", flush=True)
                runs.append(e)
    finally:
        broker.stop()
    shutil.rmtree(work, ignore_errors=True)  # its broker's log and the processes' logs; a run that failed keeps them (it raised above)
    import torch

    loads = [e["loadavg_after"][0] for e in runs]
    meta = {"command": command, "seconds": time.monotonic() - began, "started": started,
            "ended": time.strftime("%H:%M", time.gmtime()), "commit": _git("rev-parse", "--short", "HEAD"),
            "step_ms": step_ms, "skipped": skipped, "parameters": parameters, "load_min": min(loads), "load_max": max(loads),
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "cpus": os.cpu_count(), "processor": platform.processor()},
            "versions": {"torch": torch.__version__, "numpy": np.__version__, "kafka": kafka_version()},
            "tuning": None if tune is None else {
                **tune.to_json(), "choices": {f"{group}/{arm}": rec for (arm, group), rec in choices.items()},
                "runs": tune_runs}}
    write(runs, s, meta, Path(args.out) / args.name)
    failed = [e for e in runs if "error" in e]
    if failed:
        for e in failed:
            print(f"run failed: {e['group']} {e['arm']} repeat {e['repeat']}: {e['error']} (logs: {e['logs']})",
                  file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
