"""Exceptions raised by the trainers package, each carrying enough context to act on."""

from __future__ import annotations

from pathlib import Path


class TrainerError(Exception):
    """Base class of every error raised by ``trainers``."""


class ModelConfigError(TrainerError, ValueError):
    """A model was requested by an unknown name or with an input shape it cannot take."""


class BatchError(TrainerError, ValueError):
    """A training or evaluation batch is malformed (shapes, dtypes, label range), or a step
    on it went non-finite; ``reason`` is a stable slug (``bad_batch``, ``non_finite_loss``)."""

    def __init__(self, message: str, *, reason: str = "bad_batch") -> None:
        super().__init__(message)
        self.reason = reason


class AggregationError(TrainerError, ValueError):
    """Gradients handed to an aggregation rule do not line up (names, shapes, weights)."""


class StrategyError(TrainerError):
    """A sync strategy was driven out of contract (e.g. a local step while it cannot train)."""


class UnknownStrategyError(StrategyError, LookupError):
    """No strategy is registered under the requested name, or not for the requested role."""

    def __init__(self, name: str, available: list[str], role: str | None = None, note: str = "") -> None:
        """``note``: appended to the message (e.g. a plugin that failed to load, ``edgestream.plugins``)."""
        self.name = name
        self.available = available
        self.role = role
        where = f" for role {role!r}" if role is not None else ""
        super().__init__(f"no sync strategy {name!r}{where}; registered: {', '.join(available) or '(none)'}{note}")


class UpdateRejected(TrainerError):
    """An incoming update failed validation; it must be dead-lettered, never applied.

    ``reason`` is a short stable code suitable for a metric label and a DLQ header
    (``bad_header``, ``unknown_kind``, ``missing_tensor``, ``unexpected_tensor``,
    ``shape_mismatch``, ``bad_dtype``, ``non_finite``, ``bad_meta``); ``detail`` is a
    human-readable explanation naming the offending tensor or field.
    """

    REASONS = frozenset(
        {
            "bad_header",
            "unknown_kind",
            "missing_tensor",
            "unexpected_tensor",
            "shape_mismatch",
            "bad_dtype",
            "non_finite",
            "bad_meta",
        }
    )

    def __init__(
        self, reason: str, detail: str, *, sender: str | None = None, step: int | None = None
    ) -> None:
        if reason not in self.REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        self.reason = reason
        self.detail = detail
        self.sender = sender
        self.step = step
        super().__init__(f"update from {sender!r} step {step} rejected ({reason}): {detail}")


class CheckpointError(TrainerError):
    """A checkpoint could not be written or read; ``path`` names the file."""

    def __init__(self, path: str | Path, detail: str) -> None:
        self.path = Path(path)
        self.detail = detail
        super().__init__(f"checkpoint {self.path}: {detail}")


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No checkpoint exists at the given path (a fresh start, not a failure, for most callers)."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint exists but is truncated, tampered with or not a checkpoint at all."""


class CheckpointRefused(CheckpointError):
    """State was not saved because it is unsound: NaN/inf, or beyond the ``max_abs`` bound.

    The message names the first offending tensor (``model['fc1.weight']: 12 non-finite
    values``). Nothing was written, so the previous checkpoints are intact.
    """


class CheckpointUnsound(CheckpointCorrupt):
    """A checkpoint is intact on disk but holds NaN/inf (or values beyond ``max_abs``).

    It is refused before anything is loaded from it, so the trainer and strategy
    keep the state they had.
    """


class NoUsableCheckpoint(CheckpointError):
    """Checkpoint files exist in a directory but every one of them was rejected.

    ``path`` is the directory; ``rejected`` lists ``(file, reason)`` newest first.
    Starting from scratch is an operator decision, so this is not a
    :class:`CheckpointNotFound`: the message, one line, gives every file's reason and
    what to do (a restart alone meets the same files).
    """

    #: Characters of one file's reason the message keeps (the store logs each one whole).
    REASON_CHARS = 200

    def __init__(self, path: str | Path, rejected: list[tuple[Path, str]]) -> None:
        self.rejected = list(rejected)
        directory = Path(path)
        # Files outside the directory (a legacy checkpoint.bin) need their full path.
        outside = [file for file, _ in self.rejected if file.parent != directory]
        reasons = "; ".join(
            f"{file if file in outside else file.name}: {_clip(reason, self.REASON_CHARS)}"
            for file, reason in self.rejected
        )
        also = "".join(f", and {file} too" for file in outside)
        super().__init__(
            directory,
            f"none of the {len(self.rejected)} checkpoint file(s) is usable ({reasons}); a restart cannot "
            f"help: to start this worker from scratch (initial model, topics re-read from the consumer "
            f"group's committed offsets) move them aside, e.g. `mv {directory} {directory}.rejected`{also} "
            f"(keep them for inspection), or put a good checkpoint file back into {directory}",
        )


def _clip(text: str, limit: int) -> str:
    """``text`` on one line (whitespace collapsed), cut to ``limit`` characters with '...'."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3].rstrip() + "..."
