"""Exceptions raised by the trainers package, each carrying enough context to act on."""

from __future__ import annotations

from pathlib import Path


class TrainerError(Exception):
    """Base class of every error raised by ``trainers``."""


class ModelConfigError(TrainerError, ValueError):
    """A model was requested by an unknown name or with an input shape it cannot take."""


class BatchError(TrainerError, ValueError):
    """A training or evaluation batch is malformed (shapes, dtypes, label range)."""


class AggregationError(TrainerError, ValueError):
    """Gradients handed to an aggregation rule do not line up (names, shapes, weights)."""


class StrategyError(TrainerError):
    """A sync strategy was driven out of contract (e.g. a local step while it cannot train)."""


class UnknownStrategyError(StrategyError, LookupError):
    """No strategy is registered under the requested name, or not for the requested role."""

    def __init__(self, name: str, available: list[str], role: str | None = None) -> None:
        self.name = name
        self.available = available
        self.role = role
        where = f" for role {role!r}" if role is not None else ""
        super().__init__(f"no sync strategy {name!r}{where}; registered: {', '.join(available) or '(none)'}")


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
