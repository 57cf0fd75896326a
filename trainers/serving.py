"""The model ``edgestream serve`` predicts with: loaded from a ``models.<job>`` snapshot, a
checkpoint or an export, checked against the job's model, and the rule that says whether it
replaces the one in use.

Every candidate is loaded into a fresh copy of the job's model (``assembly.build_trainer``:
the architecture of ``train.model`` / ``train.model_params`` and the input standardisation
of the job's data), so the model in use is never touched while a candidate is checked; a
candidate that does not fit, does not verify or is not newer raises ``ModelRefused`` with
one of ``REFUSAL_REASONS``. Its identity is ``(version, digest)``: the trainer's version and
``LocalTrainer.parameter_digest``, the same digest the training workers put in their
predictions, so a served model and a worker's of the same parameters carry the same digest.

The swap rule (``swap_decision``) is pure: a newer version replaces the model in use; the
same version with the same digest changes nothing; an older version, or the same version
with another digest, is refused (``backwards``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from edgestream.streams.predictions import top_k
from edgestream.trainers import assembly
from edgestream.trainers.checkpoint import (
    MODEL_VERSION_KEY,
    SHAPE_MISMATCH,
    restore_training_checkpoint,
)
from edgestream.trainers.errors import CheckpointError
from edgestream.trainers.evaluation import predict_proba
from edgestream.trainers.export import (
    CARD_FILE,
    FORMATS,
    ExportError,
    ExportTampered,
    standardizer_of,
    verify_export,
)
from edgestream.trainers.local import LocalTrainer
from edgestream.trainers.validation import TensorSpec
from edgestream.trainers.wire import MessageRejected, decode_update

if TYPE_CHECKING:
    from edgestream.streams.simulator import FleetData
    from edgestream.trainers.plan import TrainingPlan

#: Why a model is refused (the ``reason`` of ``edgestream_serve_models_refused_total``).
SHAPE, DIGEST, BACKWARDS, INVALID = "shape", "digest", "backwards", "invalid"
REFUSAL_REASONS = (SHAPE, DIGEST, BACKWARDS, INVALID)
#: What ``swap_decision`` answers for a candidate it does not refuse.
SWAP, SAME = "swap", "same"
#: Wire rejections that say the message's tensors are not the job's model's.
_SHAPE_REJECTIONS = frozenset({"shape_mismatch", "missing_tensor", "unexpected_tensor", "bad_dtype"})
#: How far the card's standardisation may be from the job's (float32 statistics, written as JSON).
_STANDARDIZATION_TOLERANCE = 1e-5


class ModelRefused(Exception):
    """A candidate model that is not used: ``reason`` (one of ``REFUSAL_REASONS``) and what was wrong."""

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in REFUSAL_REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


@dataclass(frozen=True)
class ModelId:
    """Which model: its version, its parameter digest, and where it came from (for log lines)."""

    version: int
    digest: str
    source: str

    def __str__(self) -> str:
        return f"version {self.version} ({self.digest[:12]}, {self.source})"


def swap_decision(current: ModelId | None, candidate: ModelId) -> str:
    """``SWAP`` if ``candidate`` replaces ``current`` (none yet, or a newer version), ``SAME`` if
    it is the model in use; ``ModelRefused(BACKWARDS)`` for an older version or the same
    version with another digest."""
    if current is None or candidate.version > current.version:
        return SWAP
    if candidate.version == current.version:
        if candidate.digest == current.digest:
            return SAME
        raise ModelRefused(BACKWARDS, f"version {candidate.version} again with another digest "
                                      f"({candidate.digest[:12]}, in use {current.digest[:12]})")
    raise ModelRefused(BACKWARDS, f"version {candidate.version} is older than version {current.version} in use")


class ServingModel:
    """A loaded, checked model in eval mode: what one micro-batch is predicted with.

    Invariant: never changed after it is built (a newer model is a new ``ServingModel``), so
    every record of a micro-batch is predicted by the version its ``ident`` names."""

    def __init__(self, model: nn.Module, ident: ModelId) -> None:
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.ident = ident

    def predict(self, features: np.ndarray, k: int, chunk: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` most probable classes of each row of ``features`` and their probabilities
        (softmax of the logits), most probable first: ``([N, k] int, [N, k] float)``; a forward
        pass per ``chunk`` rows (None: one for all), in one call (one handoff to the thread
        that runs it)."""
        if chunk is None or len(features) <= chunk:
            return top_k(predict_proba(self.model, features), k)
        parts = [top_k(predict_proba(self.model, features[i:i + chunk]), k) for i in range(0, len(features), chunk)]
        return np.concatenate([c for c, _ in parts]), np.concatenate([p for _, p in parts])


class ModelLoader:
    """Loads candidates for the job's model of process ``process`` (the server, or a worker)
    from each source; each call builds a fresh copy of the job's model (no I/O but the files
    named; call it off the event loop)."""

    def __init__(self, plan: TrainingPlan, data: FleetData, process: str, *, role: str = "worker") -> None:
        self.plan = plan
        self.data = data
        self.process = process
        self.role = role
        self.max_abs = plan.max_abs_weight or None

    def _trainer(self) -> LocalTrainer:
        return assembly.build_trainer(self.plan, self.process, self.data)

    def _serving(self, trainer: LocalTrainer, source: str) -> ServingModel:
        return ServingModel(trainer.model, ModelId(trainer.version, trainer.parameter_digest(), source))

    def from_message(self, value: bytes | None, source: str) -> ServingModel:
        """The ``model`` snapshot ``value`` of ``models.<job>`` (wire format, every tensor checked
        against the job's model)."""
        trainer = self._trainer()
        try:
            msg = decode_update(value, expected_shapes=TensorSpec.from_trainer(trainer),
                                max_bytes=self.plan.max_message_bytes, job=self.plan.job, max_abs=self.max_abs)
        except MessageRejected as exc:
            raise ModelRefused(SHAPE if exc.reason in _SHAPE_REJECTIONS else INVALID, str(exc)) from None
        if msg.kind != "model":
            raise ModelRefused(INVALID, f"a {msg.kind} message, not a model snapshot")
        try:
            trainer.load_snapshot(msg.tensors, msg.buffers, version=msg.base_version)
        except Exception as exc:  # a buffer of another shape: what the spec admits, the model does not
            raise ModelRefused(SHAPE, f"does not load into the job's model: {exc}") from None
        return self._serving(trainer, f"{source} from {msg.sender}")

    def from_checkpoint(self, path: Path) -> ServingModel:
        """The model in checkpoint file ``path`` (the store's checks: sha256, soundness, fit)."""
        driver = assembly.build_driver(self.plan, self.process, self.data, role=self.role)
        try:
            checkpoint = restore_training_checkpoint(path, driver.trainer, driver.strategy, max_abs=self.max_abs)
        except CheckpointError as exc:
            detail = exc.detail
            reason = SHAPE if detail.startswith(SHAPE_MISMATCH) else DIGEST if "digest" in detail else INVALID
            raise ModelRefused(reason, f"{path.name}: {detail}") from None
        version = int(checkpoint.meta.get(MODEL_VERSION_KEY, driver.trainer.version))
        if version != driver.trainer.version:
            raise ModelRefused(INVALID, f"{path.name}: meta says version {version}, the state {driver.trainer.version}")
        return self._serving(driver.trainer, f"checkpoint {path.name} of {self.process}")

    def from_export(self, directory: Path) -> ServingModel:
        """The model of the export in ``directory``: every file's digest checked against its card
        (``verify_export``, as ``load_exported`` does), the card's model and standardisation
        against the job's, then its safetensors weights loaded into the job's model."""
        try:
            card = verify_export(directory)
        except ExportTampered as exc:
            raise ModelRefused(DIGEST, str(exc)) from None
        except ExportError as exc:
            raise ModelRefused(INVALID, str(exc)) from None
        trainer = self._trainer()
        self._check_card(card, trainer.model, directory)
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(directory) / FORMATS["safetensors"]
        try:
            state = load_file(str(path))
            trainer.model.load_state_dict(state, strict=True)
        except (SafetensorError, OSError) as exc:
            raise ModelRefused(INVALID, f"{path}: unreadable ({exc})") from None
        except RuntimeError as exc:
            raise ModelRefused(SHAPE, f"{path}: does not load into the job's model: {_first_line(exc)}") from None
        try:
            version = int(card["version"]["model_version"])
            if version < 0:
                raise ValueError(version)
            trainer.load_snapshot(trainer.get_parameters(), trainer.get_buffers(), version=version)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelRefused(INVALID, f"{Path(directory) / CARD_FILE}: no model version ({exc!r})") from None
        return self._serving(trainer, f"export {directory}")

    def _check_card(self, card: dict[str, Any], model: nn.Module, directory: Path) -> None:
        where = Path(directory) / CARD_FILE
        if "model.safetensors" not in card["files"]:
            raise ModelRefused(INVALID, f"{where}: the export has no safetensors file: export with --formats "
                                        "including safetensors")
        named = card.get("model") or {}
        want = {"name": self.plan.model, "params": dict(self.plan.model_params)}
        if named.get("name") != want["name"] or dict(named.get("params") or {}) != want["params"]:
            raise ModelRefused(SHAPE, f"{where}: model {named.get('name')!r} {named.get('params')}, the job's is "
                                      f"{want['name']!r} {want['params']}")
        classes = ((card.get("output") or {}).get("shape") or [None, None])[-1]
        shape = (card.get("input") or {}).get("shape") or [None]
        if classes != self.data.num_classes or tuple(shape[1:]) != tuple(self.data.feature_shape):
            raise ModelRefused(SHAPE, f"{where}: input {shape[1:]} and {classes} classes, the job's "
                                      f"{list(self.data.feature_shape)} and {self.data.num_classes}")
        mine, theirs = standardizer_of(model), card.get("standardization")
        if (mine is None) != (theirs is None) or (mine is not None and not (
                _close(theirs.get("mean"), mine.shift) and _close(theirs.get("inv_std"), mine.scale))):
            raise ModelRefused(SHAPE, f"{where}: its input standardisation is not the one the job's data gives "
                                      "(another data set or job file)")


def _close(values: Any, tensor: torch.Tensor) -> bool:
    try:
        given = np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return False
    mine = tensor.detach().cpu().double().numpy().reshape(-1)
    return given.shape == mine.shape and bool(np.allclose(given, mine, rtol=_STANDARDIZATION_TOLERANCE,
                                                          atol=_STANDARDIZATION_TOLERANCE))


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
