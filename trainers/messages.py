"""Typed messages exchanged between sync strategies; the pipeline maps them onto Kafka."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

MessageKind = Literal["gradient", "delta", "model", "control", "activation"]
"""What an :class:`UpdateMessage` carries.

- ``gradient``: a gradient of the named parameters, computed on ``base_version``.
- ``delta``: a parameter change accumulated since ``base_version`` (local SGD, ADSP).
- ``model``: full parameters at version ``base_version`` (snapshots, knowledge transfer).
- ``control``: no tensors, only ``meta`` (membership views, commit targets, scores).
- ``activation``: stage-boundary tensors (synthetic gradients); names are stage-defined.
"""

Channel = Literal["gradients", "models", "control", "inbox"]
"""Logical channels. The pipeline maps ``gradients``, ``models`` and ``control`` to one
Kafka topic per job (``gradients.<job>``, ``models.<job>``, ``control.<job>``), read by
every subscriber. ``inbox`` is per recipient: a message on it must name its ``to`` and
goes to that process's own topic ``inbox.<job>.<to>``, which only that process reads
(point-to-point traffic whose cost per process scales with its in-degree, not with
the job's size: gossip)."""

MESSAGE_KINDS: frozenset[str] = frozenset(get_args(MessageKind))
CHANNELS: frozenset[str] = frozenset(get_args(Channel))
PARAMETER_KINDS: frozenset[str] = frozenset({"gradient", "delta", "model"})
"""Kinds whose ``tensors`` are keyed by model parameter name and shaped like them."""

JsonValue = None | bool | int | float | str | list[Any] | dict[str, Any]


@dataclass(frozen=True)
class UpdateMessage:
    """One decoded update as a strategy sees it: header fields plus named tensors.

    ``tensors`` holds parameter-shaped tensors for the parameter kinds; ``buffers``
    holds model buffers (BatchNorm running statistics) or, on ``gradient``/``delta``,
    their change during the step; ``optimizer`` holds per-parameter optimizer slots
    (SGD momentum), only on ``model`` snapshots that must make a replica bitwise
    identical. ``meta`` carries small JSON-able values only.

    Invariant: strategies treat a message as immutable; the same object may be
    delivered to several strategy instances (in tests) or kept in pending state.
    """

    kind: MessageKind
    sender: str
    step: int
    base_version: int
    batch_size: int = 0
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_state(self) -> dict[str, Any]:
        """Plain dict of tensors and primitives, loadable with ``torch.load(weights_only=True)``."""
        return {
            "kind": self.kind,
            "sender": self.sender,
            "step": self.step,
            "base_version": self.base_version,
            "batch_size": self.batch_size,
            "tensors": dict(self.tensors),
            "buffers": dict(self.buffers),
            "optimizer": dict(self.optimizer),
            "meta": copy.deepcopy(self.meta),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> UpdateMessage:
        """Inverse of :meth:`to_state`."""
        return cls(
            kind=state["kind"],
            sender=state["sender"],
            step=int(state["step"]),
            base_version=int(state["base_version"]),
            batch_size=int(state["batch_size"]),
            tensors=dict(state["tensors"]),
            buffers=dict(state["buffers"]),
            optimizer=dict(state["optimizer"]),
            meta=copy.deepcopy(state["meta"]),
        )


@dataclass(frozen=True)
class Outgoing:
    """A message a strategy asks the pipeline to publish.

    ``to`` names the single worker that should receive it (``None``: every
    subscriber of ``channel``). The pipeline carries ``to`` as a header and drops,
    on receipt, messages addressed to someone else, so strategies never see them.
    On the ``inbox`` channel ``to`` is required (the recipient's topic).
    """

    channel: Channel
    message: UpdateMessage
    to: str | None = None

    def __post_init__(self) -> None:
        if self.channel == "inbox" and not self.to:
            raise ValueError("a message on the inbox channel must name its recipient (to=...)")
