"""Atomic, integrity-checked checkpoints of model, optimizer, strategy state and offsets.

File layout (one file is the atomic unit)::

    MAGIC (16 bytes) | sha256(payload) (32 bytes) | payload

``payload`` is ``torch.save`` of a dict of tensors and primitives; ``offsets`` and
``meta`` are stored inside it as JSON text. Loading verifies the magic and the
digest before ``torch.load(..., weights_only=True)`` ever sees the bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainers.errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound, TrainerError
from trainers.local import LocalTrainer
from trainers.strategies.base import SyncStrategy

MAGIC = b"EDGESTREAM-CKPT1"
FORMAT_VERSION = 1
MODEL_VERSION_KEY = "model_version"
"""Key under which :func:`save_training_checkpoint` stores ``trainer.version`` in ``meta``."""

_DIGEST_BYTES = 32


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: the five parts passed to :func:`save_checkpoint`, and its path."""

    path: Path
    model_state: dict[str, Any]
    optimizer_state: dict[str, Any]
    strategy_state: dict[str, Any]
    offsets: dict[str, Any]
    meta: dict[str, Any]


def save_checkpoint(
    path: str | Path,
    model_state: Mapping[str, Any],
    optimizer_state: Mapping[str, Any],
    strategy_state: Mapping[str, Any],
    offsets: Mapping[str, Any],
    meta: Mapping[str, Any],
) -> Path:
    """Write a checkpoint to ``path`` atomically: readers see the old file or the new one, whole.

    ``offsets`` (e.g. ``{"sensors.dev1:0": 1234}``) and ``meta`` must be JSON-able.
    The states may hold tensors, dicts, lists and primitives only; a state that
    could not be read back with ``weights_only=True`` is refused before writing.
    """
    target = Path(path)
    # Step 1. Serialise in memory, refusing anything a safe load could not read back.
    try:
        payload_obj = {
            "format": FORMAT_VERSION,
            "model": dict(model_state),
            "optimizer": dict(optimizer_state),
            "strategy": dict(strategy_state),
            "offsets_json": json.dumps(dict(offsets), allow_nan=False, sort_keys=True),
            "meta_json": json.dumps(dict(meta), allow_nan=False, sort_keys=True),
        }
    except (TypeError, ValueError) as exc:
        raise CheckpointError(target, f"offsets/meta are not JSON-able: {exc}") from exc
    buffer = io.BytesIO()
    try:
        torch.save(payload_obj, buffer)
        payload = buffer.getvalue()
        torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - pickling and the safe unpickler raise many types
        raise CheckpointError(target, f"state holds objects a weights_only load refuses: {exc}") from exc
    data = MAGIC + hashlib.sha256(payload).digest() + payload

    # Step 2. Write a temporary file in the same directory, flush and fsync it.
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        # Step 3. Atomically replace the old checkpoint.
        os.replace(tmp_name, target)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        if isinstance(exc, OSError):
            raise CheckpointError(target, f"write failed: {exc}") from exc
        raise
    # Step 4. fsync the directory so the rename itself survives a crash.
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read and verify a checkpoint written by :func:`save_checkpoint`.

    Raises :class:`CheckpointNotFound` if there is no file, :class:`CheckpointCorrupt`
    if it is truncated, altered or not a checkpoint.
    """
    source = Path(path)
    try:
        data = source.read_bytes()
    except FileNotFoundError:
        raise CheckpointNotFound(source, "no checkpoint at this path") from None
    except OSError as exc:
        raise CheckpointError(source, f"read failed: {exc}") from exc
    header = len(MAGIC) + _DIGEST_BYTES
    if len(data) < header or not data.startswith(MAGIC):
        raise CheckpointCorrupt(source, "not an edgestream checkpoint (bad magic or too short)")
    digest, payload = data[len(MAGIC) : header], data[header:]
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointCorrupt(source, "payload digest mismatch (truncated or altered)")
    try:
        obj = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - digest matched, so this is a foreign payload
        raise CheckpointCorrupt(source, f"payload does not load safely: {exc}") from exc
    try:
        if obj["format"] != FORMAT_VERSION:
            raise CheckpointCorrupt(source, f"unsupported format {obj['format']!r}")
        return Checkpoint(
            path=source,
            model_state=obj["model"],
            optimizer_state=obj["optimizer"],
            strategy_state=obj["strategy"],
            offsets=json.loads(obj["offsets_json"]),
            meta=json.loads(obj["meta_json"]),
        )
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise CheckpointCorrupt(source, f"payload lacks a checkpoint field: {exc}") from exc


def save_training_checkpoint(
    path: str | Path,
    trainer: LocalTrainer,
    strategy: SyncStrategy,
    offsets: Mapping[str, Any],
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Checkpoint a trainer and its strategy together; ``trainer.version`` goes into ``meta``."""
    state = trainer.state_dict()
    return save_checkpoint(
        path,
        model_state=state["model"],
        optimizer_state=state["optimizer"],
        strategy_state=strategy.state_dict(),
        offsets=offsets,
        meta={**dict(meta or {}), MODEL_VERSION_KEY: state["version"]},
    )


def restore_training_checkpoint(
    path: str | Path, trainer: LocalTrainer, strategy: SyncStrategy
) -> Checkpoint:
    """Load ``path`` into ``trainer`` and ``strategy``; return it (for offsets and meta).

    Raises :class:`CheckpointCorrupt` if the states do not fit this trainer/strategy.
    """
    checkpoint = load_checkpoint(path)
    try:
        trainer.load_state_dict(
            {
                "model": checkpoint.model_state,
                "optimizer": checkpoint.optimizer_state,
                "version": checkpoint.meta[MODEL_VERSION_KEY],
            }
        )
        strategy.load_state_dict(checkpoint.strategy_state)
    except (KeyError, TypeError, ValueError, TrainerError) as exc:
        raise CheckpointCorrupt(checkpoint.path, f"state does not fit this job: {exc}") from exc
    return checkpoint
