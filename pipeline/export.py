"""Exporting a job's trained model: which process holds it, its newest good checkpoint, the model
restored (a stage-split job's stages put together), scored on the held-out split, and written by
``trainers.export`` with the card's provenance. No Kafka; reads the job's state directory only.

Which model: the server's for strategies with a server role (ASP, SSP, ADSP: it holds the
job's model), else the first worker's (``--worker`` picks another); a stage-split job
(``train.stages``) is assembled from every stage worker's checkpoint into one whole model.
Which checkpoint: each process's newest one that its ``CheckpointStore`` would restore, the
store's own checks applied (digest, soundness, fit to the job's model and strategy); a file
refused is skipped for the next older one and said so. Nothing in the state directory is
moved or written: a running worker's store has one writer, itself.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgestream import __version__ as edgestream_version
from edgestream.job.config import JobConfig
from edgestream.job.plan import training_plan
from edgestream.job.sources import DataNames, job_fleet_data, source_named
from edgestream.pipeline.exits import worker_state_dir
from edgestream.streams.simulator import FleetData
from edgestream.streams.topics import SERVER_NAME
from edgestream.trainers import assembly
from edgestream.trainers.checkpoint import (
    MODEL_VERSION_KEY,
    SHAPE_MISMATCH,
    Checkpoint,
    CheckpointStore,
    load_checkpoint,
    restore_training_checkpoint,
)
from edgestream.trainers.driver import TrainingDriver
from edgestream.trainers.errors import CheckpointError, CheckpointNotFound
from edgestream.trainers.evaluation import evaluate
from edgestream.trainers.export import (
    FORMATS,
    ExportError,
    ExportReport,
    check_writable,
    export_model,
)
from edgestream.trainers.local import LocalTrainer
from edgestream.trainers.plan import TrainingPlan
from edgestream.trainers.stages import compose
from edgestream.trainers.strategies import roles

Say = Callable[[str], None]

#: A process's end-of-run summary in its state dir (``pipeline.worker``), where prequential accuracy is.
TRAINING_SUMMARY = "training.json"
#: A store's checkpoint file name and its sequence number (the legacy ``checkpoint.bin`` has none).
_SEQUENCE = re.compile(r"checkpoint-(\d+)\.bin")
#: Characters of a checkpoint's refusal reason shown on a line.
REASON_CHARS = 240


class ExportRefused(Exception):
    """The export cannot start: no checkpoint, an unknown worker, a model of another shape, an
    unwritable output directory. One line that says what to do (the CLI exits 2)."""


@dataclass(frozen=True)
class Restored:
    """One process's model as a checkpoint left it, and the newer files refused on the way."""

    process: str
    trainer: LocalTrainer
    checkpoint: Checkpoint
    skipped: tuple[tuple[Path, str], ...] = ()


def _short(text: str) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= REASON_CHARS else line[: REASON_CHARS - 3] + "..."


def processes(cfg: JobConfig) -> list[str]:
    """The job's processes that hold a model: its workers, and the server if its strategy has one."""
    names = list(cfg.worker_names())
    return [*names, SERVER_NAME] if "server" in roles(cfg.train.strategy) else names


def default_process(cfg: JobConfig) -> str:
    """The process whose model is the job's: the server where the strategy has one, else the first worker."""
    return SERVER_NAME if "server" in roles(cfg.train.strategy) else cfg.worker_names()[0]


def _role(name: str) -> str:
    return "server" if name == SERVER_NAME else "worker"


def _build(plan: TrainingPlan, name: str, data: FleetData) -> TrainingDriver:
    try:
        return assembly.build_driver(plan, name, data, role=_role(name))
    except assembly.AssemblyError as exc:
        raise ExportRefused(f"cannot build {name}'s model from the job file: {exc}") from exc


def _unfit(name: str, where: Path, reason: str, cfg: JobConfig) -> ExportRefused:
    return ExportRefused(
        f"the checkpoint of {name} in {where} holds a model of another shape (or another strategy's state) "
        f"than the job file's (train.model={cfg.train.model!r}, train.model_params={list(cfg.train.model_params)}, "
        f"train.strategy={cfg.train.strategy!r}): {_short(reason)}; export with the job file (and --set "
        "overrides) the run used")


def restore_newest(cfg: JobConfig, plan: TrainingPlan, name: str, data: FleetData, say: Say) -> Restored:
    """Process ``name``'s model from its newest usable checkpoint (older ones if newer are refused)."""
    state = worker_state_dir(cfg, name)
    store = CheckpointStore(state / "checkpoints", keep=plan.checkpoint_keep, max_abs=plan.max_abs_weight or None,
                            legacy_path=state / "checkpoint.bin")
    candidates = store.candidates()
    if not candidates:
        raise ExportRefused(f"no checkpoint of {name} in {state / 'checkpoints'}: run the job first "
                            f"(edgestream run --job ...), or point --state-dir at the run.state_dir it ran with")
    driver = _build(plan, name, data)
    skipped: list[tuple[Path, str]] = []
    for path in candidates:
        try:
            checkpoint = restore_training_checkpoint(path, driver.trainer, driver.strategy,
                                                     max_abs=plan.max_abs_weight or None)
        except CheckpointError as exc:
            skipped.append((path, exc.detail))
            say(f"checkpoint {path.name} of {name} refused: {_short(exc.detail)}")
            continue
        if skipped:
            say(f"using the older checkpoint {path.name} of {name} (skipped {len(skipped)} newer, left in place)")
        return Restored(name, driver.trainer, checkpoint, tuple(skipped))
    if all(reason.startswith(SHAPE_MISMATCH) for _, reason in skipped):
        raise _unfit(name, store.directory, skipped[0][1], cfg)
    reasons = "; ".join(f"{path.name}: {_short(reason)}" for path, reason in skipped)
    raise ExportRefused(f"none of the {len(skipped)} checkpoint(s) of {name} in {store.directory} is usable "
                        f"({reasons}); pass --checkpoint with a good file (e.g. a backup)")


def restore_file(cfg: JobConfig, plan: TrainingPlan, path: Path, data: FleetData, say: Say) -> Restored:
    """The model in checkpoint file ``path``, restored as the process that wrote it (its meta
    names it; else the job's default process)."""
    try:
        meta = load_checkpoint(path).meta
    except CheckpointNotFound:
        raise ExportRefused(f"--checkpoint {path}: no such file") from None
    except CheckpointError as exc:
        raise ExportRefused(f"--checkpoint {path} refused: {_short(exc.detail)}") from None
    writer = meta.get("worker") if isinstance(meta, dict) else None
    name = writer if writer in processes(cfg) else default_process(cfg)
    say(f"restoring {name}'s model from {path}")
    driver = _build(plan, name, data)
    try:
        checkpoint = restore_training_checkpoint(path, driver.trainer, driver.strategy,
                                                 max_abs=plan.max_abs_weight or None)
    except CheckpointError as exc:
        if exc.detail.startswith(SHAPE_MISMATCH):
            raise _unfit(name, path, exc.detail, cfg) from None
        raise ExportRefused(f"--checkpoint {path} refused: {_short(exc.detail)}") from None
    return Restored(name, driver.trainer, checkpoint)


def prequential(cfg: JobConfig, name: str, version: int) -> dict[str, Any]:
    """The prequential (test-then-train) accuracy process ``name``'s end-of-run summary reports,
    or ``accuracy: None`` with the reason it has none."""
    path = worker_state_dir(cfg, name) / TRAINING_SUMMARY
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        return {"accuracy": None, "reason": f"no {TRAINING_SUMMARY} of {name}: its run did not end (or not cleanly)"}
    except (OSError, ValueError) as exc:
        return {"accuracy": None, "reason": f"{TRAINING_SUMMARY} of {name} unreadable: {_short(str(exc))}"}
    preq = summary.get("prequential") or {}
    if not preq.get("records"):
        return {"accuracy": None, "reason": f"{name} scored no records before training on them "
                                            "(a server or a lower stage: the workers / top stage score them)"}
    out = {"accuracy": float(preq["accuracy"]), "records": int(preq["records"]),
           "window_accuracy": preq.get("window_accuracy"), "source": f"workers/{name}/{TRAINING_SUMMARY}",
           "summary_model_version": summary.get("version")}
    if summary.get("version") != version:
        out["note"] = (f"the summary is of model version {summary.get('version')}, the exported checkpoint of "
                       f"version {version}")
    return out


def _version_of(restored: Restored) -> dict[str, Any]:
    meta = restored.checkpoint.meta
    sequence = _SEQUENCE.fullmatch(restored.checkpoint.path.name)
    return {"process": restored.process, "model_version": int(meta[MODEL_VERSION_KEY]),
            "checkpoint": restored.checkpoint.path.name, "checkpoint_sequence": int(sequence[1]) if sequence else None, "steps": int(meta.get("steps", 0)),
            "trained_records": int(meta.get("trained_records", 0)), "saved_at": meta.get("saved_at"),
            "skipped_newer": [path.name for path, _ in restored.skipped]}


def _class_names(names: DataNames, data: FleetData) -> dict[str, Any]:
    """The card's ``classes``: the count, and the source's names when it gives one per class."""
    if names.class_names is not None and len(names.class_names) == data.num_classes:
        return {"count": data.num_classes, "names": list(names.class_names)}
    return {"count": data.num_classes, "names": None,
            "names_reason": "the job's data source does not name its classes: labels are 0..count-1"}


def _feature_names(names: DataNames, data: FleetData) -> dict[str, Any]:
    """The card's ``input.feature_names``: one per flattened feature where the source names them."""
    width = math.prod(data.feature_shape)
    if names.feature_names is not None and len(names.feature_names) == width:
        return {"feature_names": list(names.feature_names)}
    return {"feature_names": None,
            "feature_names_reason": "the job's data source does not name its features"}


def export_job(cfg: JobConfig, out: Path, *, worker: str | None = None, checkpoint: Path | None = None,
               formats: Sequence[str] = tuple(FORMATS), say: Say = print) -> ExportReport:
    """Export job ``cfg``'s trained model to ``out`` (see the module doc for which model).

    ``ExportRefused`` (one line: what to do) when it cannot start; what ``export_model`` raises
    when writing or checking fails.
    """
    if not cfg.train.enabled:
        raise ExportRefused("the job does not train (train.enabled = false): there is no model to export")
    plan = training_plan(cfg)
    if plan.stages and (worker is not None or checkpoint is not None):
        raise ExportRefused(f"train.stages splits the model over {', '.join(plan.workers)}; export puts every "
                            "stage's newest checkpoint together: drop --worker / --checkpoint")
    if worker is not None and worker not in processes(cfg):
        raise ExportRefused(f"unknown worker {worker!r}: the job's processes are {', '.join(processes(cfg))}")
    try:
        check_writable(out)
    except ExportError as exc:
        raise ExportRefused(str(exc)) from None
    say(f"loading the job's data ({cfg.data.source})")
    data = job_fleet_data(cfg)
    # Step 1. The model, from its checkpoint(s).
    if plan.stages:
        say(f"assembling the {len(plan.workers)} stages ({', '.join(plan.workers)}) from their newest checkpoints")
        parts = [restore_newest(cfg, plan, name, data, say) for name in plan.workers]
        model = compose([p.trainer.model for p in parts])
        top = parts[-1]
    else:
        if checkpoint is not None:
            top = restore_file(cfg, plan, checkpoint, data, say)
        else:
            name = worker or default_process(cfg)
            say(f"restoring {name}'s model from its newest good checkpoint")
            top = restore_newest(cfg, plan, name, data, say)
        parts, model = [top], top.trainer.model
    for part in parts:
        v = _version_of(part)
        say(f"{part.process}: {v['checkpoint']}, model version {v['model_version']}, step {v['steps']}, "
            f"{v['trained_records']} records trained")
    # Step 2. Scores: held-out (reporting only, computed now), prequential (from the run's summary).
    split = "validation" if cfg.data.evaluate_on == "validation" else "heldout"
    say(f"scoring on the {split} split ({len(data.heldout)} samples)")
    scored = evaluate(model, data.heldout.features, data.heldout.labels)
    version = int(top.checkpoint.meta[MODEL_VERSION_KEY])
    versions = [_version_of(p) for p in parts]
    names = source_named(cfg.data.source).data_names(cfg)
    card = {
        "job": cfg.job.name,
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "edgestream": edgestream_version,
        "strategy": cfg.train.strategy,
        "worker": top.process if not plan.stages else None,
        "stages": list(plan.stages) if plan.stages else None,
        "model": {"name": plan.model, "params": dict(plan.model_params),
                  "parameters": sum(p.numel() for p in model.parameters())},
        "input": _feature_names(names, data),
        "classes": _class_names(names, data),
        "version": {"model_version": version, "checkpoint": versions[-1]["checkpoint"],
                    "checkpoint_sequence": versions[-1]["checkpoint_sequence"], "steps": versions[-1]["steps"], "trained_records": versions[0]["trained_records"],
                    "processes": versions},
        "evaluation": {
            "heldout": {"split": split, "accuracy": scored.accuracy, "loss": scored.loss, "samples": scored.count,
                        "note": "computed at export, for reporting: nothing that trained saw this split"},
            "prequential": prequential(cfg, top.process, version),
        },
    }
    say(f"{split} accuracy {scored.accuracy:.4f} over {scored.count} samples")
    # Step 3. The files, each checked on the held-out features.
    return export_model(model, out, input_shape=data.feature_shape, num_classes=data.num_classes,
                        check_features=data.heldout.features, formats=formats, card=card, progress=say)
