"""Atomic, integrity-checked checkpoints of model, optimizer, strategy state and offsets.

File layout (one file is the atomic unit)::

    MAGIC (16 bytes) | sha256(payload) (32 bytes) | payload

``payload`` is ``torch.save`` of a dict of tensors and primitives; ``offsets`` and
``meta`` are stored inside it as JSON text. Loading verifies the magic and the
digest before ``torch.load(..., weights_only=True)`` ever sees the bytes.

Directory layout (:class:`CheckpointStore`, one directory per worker)::

    checkpoint-000000041.bin    older, kept as a fallback
    checkpoint-000000042.bin    newest
    checkpoint.bin              legacy single file (before the store): the oldest candidate
                                (``legacy_path=`` names it if it lives elsewhere)
    rejected/                   files a restore skipped before it found a usable one
        checkpoint-000000043.bin          (moved here, never read, pruned or counted again)
        checkpoint-000000043.bin.reason   why it was rejected, one line

Each save writes a new file whose sequence number is one above the highest existing
one (and above any this store has used), so a name is never reused, then prunes.

Refusal rule: a floating-point (or complex) tensor holding NaN/inf anywhere in the
model, optimizer or strategy state - or, when a ``max_abs`` bound is given, any
value with a larger magnitude - is never saved (:class:`CheckpointRefused`, nothing
written) and never restored (:class:`CheckpointUnsound`, nothing loaded). Scalars
(learning rates, timestamps, counters) are not checked: they are not where a blown-up
gradient lands, and timestamps would trip any useful bound.

Keep/fallback rule: after a save the store keeps the ``keep`` newest files and
deletes older ones (only names it owns: ``checkpoint-<seq>.bin``, the legacy
``checkpoint.bin`` and its own orphaned temporary files). Restore tries the newest
file first and falls back to older ones, skipping (with a logged warning naming file
and reason) any that is missing bytes, corrupt, not safely loadable, unsound, or does
not fit the trainer/strategy. Once an older file is restored, the skipped ones are
moved into ``rejected/`` with their reason, so they never count toward ``keep`` nor
push good files out, and stay for inspection (deleting them is the operator's call).
When every file is rejected nothing is moved (:class:`NoUsableCheckpoint`): whether to
start from scratch or put a good file back is the operator's decision, and a restart
must fail the same way, not silently start fresh. A skipped candidate leaves trainer
and strategy exactly as they were: soundness is checked before anything is loaded,
and a load that fails part-way is rolled back to a snapshot.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import io
import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from edgestream.trainers.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    CheckpointRefused,
    CheckpointUnsound,
    NoUsableCheckpoint,
)
from edgestream.trainers.local import LocalTrainer
from edgestream.trainers.strategies.base import SyncStrategy

log = logging.getLogger(__name__)

MAGIC = b"EDGESTREAM-CKPT1"
FORMAT_VERSION = 1
MODEL_VERSION_KEY = "model_version"
"""Key under which :func:`save_training_checkpoint` stores ``trainer.version`` in ``meta``."""
#: The start of the reason a checkpoint whose state does not fit the job's model (or
#: strategy) is rejected with.
SHAPE_MISMATCH = "state does not fit this job"

LEGACY_NAME = "checkpoint.bin"
"""The single, overwritten checkpoint file of workers from before :class:`CheckpointStore`."""
REJECTED_DIR = "rejected"
"""Subdirectory of a store's directory that rejected files are moved into (see the module doc)."""
REASON_SUFFIX = ".reason"

_DIGEST_BYTES = 32
_SEQ_DIGITS = 9
_NAME = re.compile(r"checkpoint-(\d{9,})\.bin")
# save_checkpoint's temporary files: ".<target name>.<random>.tmp".
_TEMP_NAME = re.compile(r"\.checkpoint-(\d{9,})\.bin\..+\.tmp")


def checkpoint_name(seq: int) -> str:
    """File name of sequence number ``seq`` (``checkpoint-000000042.bin``)."""
    if seq < 0:
        raise ValueError(f"sequence number must be >= 0, got {seq}")
    return f"checkpoint-{seq:0{_SEQ_DIGITS}d}.bin"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: the five parts passed to :func:`save_checkpoint`, and its path."""

    path: Path
    model_state: dict[str, Any]
    optimizer_state: dict[str, Any]
    strategy_state: dict[str, Any]
    offsets: dict[str, Any]
    meta: dict[str, Any]


# -- soundness ------------------------------------------------------------------------


def _tensors(state: Any, label: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor nested in dicts/lists/tuples under ``state``, labelled ``part['key'][0]``."""
    if isinstance(state, torch.Tensor):
        yield label, state
    elif isinstance(state, Mapping):
        for key, value in state.items():
            yield from _tensors(value, f"{label}[{key!r}]")
    elif isinstance(state, list | tuple):
        for index, value in enumerate(state):
            yield from _tensors(value, f"{label}[{index}]")


def find_unsound_tensor(parts: Mapping[str, Any], max_abs: float | None = None) -> str | None:
    """Describe the first unsound tensor in ``parts`` (``{"model": state, ...}``), or None.

    A floating-point or complex tensor is unsound if it holds NaN/inf or, with
    ``max_abs``, a value whose magnitude exceeds it. The description names part and
    key, e.g. ``model['fc1.weight']: 12 non-finite values``. Parts are searched in
    the mapping's order, keys in their stored order.
    """
    _check_max_abs(max_abs)
    for part, state in parts.items():
        for label, tensor in _tensors(state, part):
            if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
                continue
            finite = torch.isfinite(tensor)
            bad = int(finite.numel() - int(finite.sum()))
            if bad:
                return f"{label}: {bad} non-finite value{'s' if bad != 1 else ''}"
            if max_abs is not None:
                magnitude = tensor.detach().abs()
                over = int((magnitude > max_abs).sum())
                if over:
                    return (
                        f"{label}: {over} value{'s' if over != 1 else ''} beyond max_abs={max_abs:g} "
                        f"(largest |value| {float(magnitude.max()):.3g})"
                    )
    return None


def _check_max_abs(max_abs: float | None) -> None:
    if max_abs is not None and not (max_abs > 0 and math.isfinite(max_abs)):
        raise ValueError(f"max_abs must be finite and > 0 (or None), got {max_abs}")


# -- one file -------------------------------------------------------------------------


def save_checkpoint(
    path: str | Path,
    model_state: Mapping[str, Any],
    optimizer_state: Mapping[str, Any],
    strategy_state: Mapping[str, Any],
    offsets: Mapping[str, Any],
    meta: Mapping[str, Any],
    *,
    max_abs: float | None = None,
) -> Path:
    """Write a checkpoint to ``path`` atomically: readers see the old file or the new one, whole.

    ``offsets`` (e.g. ``{"sensors.dev1:0": 1234}``) and ``meta`` must be JSON-able.
    The states may hold tensors, dicts, lists and primitives only; a state that
    could not be read back with ``weights_only=True`` is refused before writing.
    Unsound state (NaN/inf, or beyond ``max_abs``) raises :class:`CheckpointRefused`
    and writes nothing.
    """
    target = Path(path)
    # Step 1. Refuse unsound state: a checkpoint of blown-up weights only turns one
    # crash into a crash loop, and the previous file is a better restart point.
    problem = find_unsound_tensor(
        {"model": model_state, "optimizer": optimizer_state, "strategy": strategy_state}, max_abs
    )
    if problem is not None:
        raise CheckpointRefused(target, f"refused to save unsound state: {problem}; nothing written")
    # Step 2. Serialise in memory, refusing anything a safe load could not read back.
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
        raise CheckpointError(target, f"state holds objects a weights_only load refuses: {_load_error(exc)}") from exc
    data = MAGIC + hashlib.sha256(payload).digest() + payload

    # Step 3. Write a temporary file in the same directory, flush and fsync it.
    # Every OSError on the way (a directory that became a file, a full or read-only disk) is a
    # CheckpointError naming the target, wherever in the write it happens.
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        if isinstance(exc, FileExistsError):  # mkdir's word for "a file is where the directory goes"
            exc = NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(target.parent))
        raise CheckpointError(target, f"write failed: {exc}") from exc
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        # Step 4. Atomically replace the old checkpoint.
        os.replace(tmp_name, target)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        if isinstance(exc, OSError):
            raise CheckpointError(target, f"write failed: {exc}") from exc
        raise
    # Step 5. fsync the directory so the rename itself survives a crash.
    try:
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise CheckpointError(target, f"directory sync failed: {exc}") from exc
    return target


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read and verify a checkpoint written by :func:`save_checkpoint`.

    Raises :class:`CheckpointNotFound` if there is no file, :class:`CheckpointCorrupt`
    if it is truncated, altered or not a checkpoint. It does not judge the values, so
    an unsound file can still be inspected; the restore functions refuse it.
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
        raise CheckpointCorrupt(source, f"payload does not load safely: {_load_error(exc)}") from exc
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


#: Paragraphs of torch's weights-only load errors that are boilerplate, not the reason
#: (one of them advises ``weights_only=False``, which is exactly what must not be done).
_TORCH_BOILERPLATE = ("Weights only load failed", "Check the documentation of torch.load", "Please file an issue")


def _load_error(exc: Exception) -> str:
    """What a failed ``torch.load``/``torch.save`` says, without torch's boilerplate, on one line."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", str(exc))]
    kept = [p for p in paragraphs if p and not p.startswith(_TORCH_BOILERPLATE)]
    return "; ".join(kept) or type(exc).__name__


# -- trainer + strategy -----------------------------------------------------------------


def save_training_checkpoint(
    path: str | Path,
    trainer: LocalTrainer,
    strategy: SyncStrategy,
    offsets: Mapping[str, Any],
    meta: Mapping[str, Any] | None = None,
    *,
    max_abs: float | None = None,
) -> Path:
    """Checkpoint a trainer and its strategy together; ``trainer.version`` goes into ``meta``.

    Raises :class:`CheckpointRefused` (nothing written) if the state is unsound.
    """
    state = trainer.state_dict()
    return save_checkpoint(
        path,
        model_state=state["model"],
        optimizer_state=state["optimizer"],
        strategy_state=strategy.state_dict(),
        offsets=offsets,
        meta={**dict(meta or {}), MODEL_VERSION_KEY: state["version"]},
        max_abs=max_abs,
    )


def restore_training_checkpoint(
    path: str | Path,
    trainer: LocalTrainer,
    strategy: SyncStrategy,
    *,
    max_abs: float | None = None,
) -> Checkpoint:
    """Load ``path`` into ``trainer`` and ``strategy``; return it (for offsets and meta).

    Raises :class:`CheckpointUnsound` (a :class:`CheckpointCorrupt`) if the file holds
    NaN/inf or values beyond ``max_abs``, :class:`CheckpointCorrupt` if the states do
    not fit this trainer/strategy; either way ``trainer`` and ``strategy`` are left
    exactly as they were.
    """
    checkpoint = load_checkpoint(path)
    _apply(checkpoint, trainer, strategy, max_abs=max_abs)
    return checkpoint


@dataclass(frozen=True)
class _Snapshot:
    """Trainer and strategy state taken before a load attempt, to roll a failed one back."""

    trainer_state: dict[str, Any]
    strategy_state: dict[str, Any]

    @classmethod
    def take(cls, trainer: LocalTrainer, strategy: SyncStrategy) -> _Snapshot:
        # Deep copies: strategy state may share tensors with live messages.
        return cls(copy.deepcopy(trainer.state_dict()), copy.deepcopy(strategy.state_dict()))

    def restore(self, trainer: LocalTrainer, strategy: SyncStrategy) -> None:
        # Copy again so the snapshot stays pristine for the next rollback (optimizer
        # and strategy loads may keep references to the tensors they are given).
        # A failure here is a bug (this state came from these very objects): let it raise.
        trainer.load_state_dict(copy.deepcopy(self.trainer_state))
        strategy.load_state_dict(copy.deepcopy(self.strategy_state))


def _apply(
    checkpoint: Checkpoint,
    trainer: LocalTrainer,
    strategy: SyncStrategy,
    *,
    max_abs: float | None,
    snapshot: _Snapshot | None = None,
) -> None:
    """Load ``checkpoint`` into trainer and strategy, or raise and leave both untouched."""
    # Verify before touching anything: soundness needs no trainer at all.
    problem = find_unsound_tensor(
        {
            "model": checkpoint.model_state,
            "optimizer": checkpoint.optimizer_state,
            "strategy": checkpoint.strategy_state,
        },
        max_abs,
    )
    if problem is not None:
        raise CheckpointUnsound(checkpoint.path, f"holds unsound state: {problem}")
    if not isinstance(checkpoint.meta, dict) or MODEL_VERSION_KEY not in checkpoint.meta:
        raise CheckpointCorrupt(checkpoint.path, f"meta lacks {MODEL_VERSION_KEY!r}: not a training checkpoint")
    if snapshot is None:
        snapshot = _Snapshot.take(trainer, strategy)
    try:
        trainer.load_state_dict(
            {
                "model": checkpoint.model_state,
                "optimizer": checkpoint.optimizer_state,
                "version": checkpoint.meta[MODEL_VERSION_KEY],
            }
        )
        strategy.load_state_dict(checkpoint.strategy_state)
    except Exception as exc:  # noqa: BLE001 - any failure means "does not fit"; roll back first
        # model.load_state_dict copies matching tensors before it reports a mismatch,
        # and a strategy may have set some fields before a missing key: undo both.
        snapshot.restore(trainer, strategy)
        raise CheckpointCorrupt(checkpoint.path, f"{SHAPE_MISMATCH}: {exc}") from exc


# -- a directory of checkpoints -----------------------------------------------------------


class SkippedCheckpoint(NamedTuple):
    """A candidate :meth:`CheckpointStore.restore` rejected, and why (unpacks as ``path, reason``)."""

    path: Path
    reason: str


@dataclass(frozen=True)
class RestoreResult:
    """What :meth:`CheckpointStore.restore` loaded, and which newer files it skipped.

    ``checkpoint`` carries ``offsets`` and ``meta`` to resume from; its state dicts
    may share tensors with the trainer after loading, so read them, do not keep them.
    ``skipped`` lists rejected candidates newest first (empty when the newest was used).
    """

    checkpoint: Checkpoint
    skipped: tuple[SkippedCheckpoint, ...] = ()

    @property
    def path(self) -> Path:
        """The file that was restored."""
        return self.checkpoint.path


@dataclass(eq=False)
class CheckpointStore:
    """The last ``keep`` checkpoints of one worker in ``directory``, newest restored first.

    Invariants: file names are ``checkpoint-<seq>.bin`` with ``seq`` strictly
    increasing over the directory's life (never reused, also after pruning or after a
    file was moved into ``rejected/``); every file this store writes is whole (atomic
    write) and sound (unsound state is refused); a failed :meth:`restore` attempt
    leaves trainer and strategy unchanged.
    Single writer: one store per directory. Synchronous and clock-free; call it from
    the training thread. See the module docstring for the keep/fallback rule.
    """

    directory: Path
    keep: int = 3
    max_abs: float | None = None
    legacy_path: Path | None = None
    """The pre-store single file, if it lived elsewhere; ``None``: ``directory / "checkpoint.bin"``."""
    _legacy: Path = field(init=False, repr=False)
    _last_seq: int = field(default=0, init=False, repr=False)  # so the first file is seq 1
    _rejected: set[Path] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self._legacy = Path(self.legacy_path) if self.legacy_path is not None else self.directory / LEGACY_NAME
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")
        _check_max_abs(self.max_abs)

    def candidates(self) -> list[Path]:
        """Checkpoint files newest first; the legacy file (if any) last."""
        numbered = sorted(self._numbered(), reverse=True)
        paths = [self.directory / name for _, name in numbered]
        if self._legacy.exists():
            paths.append(self._legacy)
        return paths

    def save(
        self,
        trainer: LocalTrainer,
        strategy: SyncStrategy,
        offsets: Mapping[str, Any],
        meta: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write a new checkpoint, prune old ones, return the new file's path.

        Raises :class:`CheckpointRefused` if the state is unsound: nothing is written
        or pruned then, so the previous checkpoints stay as they were.
        """
        # Step 1. Name it above every file on disk and every name this store used, so
        # a name is never reused even if files were deleted behind our back.
        # Files moved into rejected/ keep their numbers too.
        used = [*self._numbered(), *self._numbered(self.rejected_directory)]
        seq = max([self._last_seq, *(s for s, _ in used)]) + 1
        path = self.directory / checkpoint_name(seq)
        # Step 2. Write it atomically (refusing unsound state).
        save_training_checkpoint(path, trainer, strategy, offsets, meta, max_abs=self.max_abs)
        self._last_seq = seq
        # Step 3. Prune only after the new file is durable, so a crash in between
        # leaves one file too many, never one too few.
        self._prune(seq)
        return path

    def restore(self, trainer: LocalTrainer, strategy: SyncStrategy) -> RestoreResult:
        """Load the newest usable checkpoint into ``trainer`` and ``strategy``.

        Raises :class:`CheckpointNotFound` if there are no checkpoint files (a fresh
        start), :class:`NoUsableCheckpoint` if there are but every one was rejected;
        then trainer and strategy are exactly as they were before the call.
        """
        candidates = self.candidates()
        if not candidates:
            raise CheckpointNotFound(self.directory, "no checkpoint files in this directory")
        snapshot = _Snapshot.take(trainer, strategy)
        skipped: list[SkippedCheckpoint] = []
        for path in candidates:
            try:
                checkpoint = load_checkpoint(path)
                _apply(checkpoint, trainer, strategy, max_abs=self.max_abs, snapshot=snapshot)
            except CheckpointError as exc:
                log.warning("checkpoint %s rejected: %s", path, exc.detail)
                skipped.append(SkippedCheckpoint(path, exc.detail))
                self._rejected.add(path)
                continue
            if skipped:
                log.warning(
                    "restored the older checkpoint %s after rejecting %d newer one(s)", path, len(skipped)
                )
                self._move_aside(skipped)
            return RestoreResult(checkpoint, tuple(skipped))
        # Nothing moved: a restart must meet the same files, and the operator decides.
        raise NoUsableCheckpoint(self.directory, [(s.path, s.reason) for s in skipped])

    @property
    def rejected_directory(self) -> Path:
        """Where :meth:`restore` moves the files it skipped before a usable one."""
        return self.directory / REJECTED_DIR

    def _move_aside(self, skipped: list[SkippedCheckpoint]) -> None:
        """Move each skipped file into ``rejected/`` with a ``.reason`` file beside it.

        A file that cannot be moved stays where it is, remembered as rejected so it
        still does not count toward ``keep`` (it goes with the next prune).
        """
        target_dir = self.rejected_directory
        for path, reason in skipped:
            try:
                target_dir.mkdir(exist_ok=True)
                target = target_dir / path.name
                n = 0
                while target.exists():  # only the legacy name can recur
                    n += 1
                    target = target_dir / f"{path.name}.{n}"
                os.replace(path, target)
            except FileNotFoundError:
                self._rejected.discard(path)  # gone behind our back: nothing to keep apart
                continue
            except OSError as exc:
                log.warning("could not move the rejected checkpoint %s into %s: %s", path, target_dir, exc)
                continue
            self._rejected.discard(path)
            with contextlib.suppress(OSError):
                target.with_name(target.name + REASON_SUFFIX).write_text(" ".join(reason.split()) + "\n")
            log.warning("moved the rejected checkpoint %s to %s", path, target)

    def _numbered(self, directory: Path | None = None) -> list[tuple[int, str]]:
        """``(seq, name)`` of this store's numbered files present in ``directory`` (default: its own)."""
        return [(int(m[1]), name) for name in self._listdir(directory) if (m := _NAME.fullmatch(name))]

    def _listdir(self, directory: Path | None = None) -> list[str]:
        directory = self.directory if directory is None else directory
        try:
            return os.listdir(directory)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CheckpointError(directory, f"cannot list checkpoint directory: {exc}") from exc

    def _prune(self, newest: int) -> None:
        """Delete files beyond the ``keep`` newest not-rejected ones, and orphaned temp files."""
        doomed: list[Path] = []
        counted = 0
        for path in self.candidates():
            if counted >= self.keep:
                doomed.append(path)
            elif path not in self._rejected:
                counted += 1
        # A temporary file of an older sequence number is left over from a crashed
        # save (a single writer is only ever writing the newest).
        doomed += [
            self.directory / name
            for name in self._listdir()
            if (m := _TEMP_NAME.fullmatch(name)) and int(m[1]) < newest
        ]
        for path in doomed:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                # The new checkpoint is written; a file we cannot delete costs disk, not safety.
                log.warning("could not delete old checkpoint %s: %s", path, exc)
            self._rejected.discard(path)
