"""Gatekeeping of decoded updates: names, shapes, dtypes, finiteness, header, meta."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from edgestream.trainers.errors import UpdateRejected
from edgestream.trainers.local import LocalTrainer
from edgestream.trainers.messages import MESSAGE_KINDS, UpdateMessage

Shape = tuple[int | None, ...]
"""A tensor shape; ``None`` in a position accepts any size there (e.g. a batch dim)."""

MAX_META_BYTES = 16_384
#: Deepest nesting of lists and objects in ``meta``: deeper JSON, though small, would make
#: every later copy of the message (``to_state``, checkpoints) exceed Python's recursion limit.
MAX_META_DEPTH = 32

Rejector = Callable[[str, str], UpdateRejected]


@dataclass(frozen=True)
class TensorSpec:
    """What a job's updates may contain: parameter shapes and buffer shapes/dtypes.

    Build it once per job with :meth:`from_trainer`; for stage boundaries
    (``activation`` messages) build it by hand with ``None`` for the batch dim.
    """

    parameters: dict[str, Shape]
    buffers: dict[str, tuple[Shape, torch.dtype]] = field(default_factory=dict)

    @classmethod
    def from_trainer(cls, trainer: LocalTrainer) -> TensorSpec:
        """The spec of ``trainer``'s model: every parameter and buffer."""
        return cls(parameters=dict(trainer.parameter_shapes()), buffers=dict(trainer.buffer_specs()))


def validate_update(
    msg: UpdateMessage,
    expected_shapes: TensorSpec | Mapping[str, Shape],
    *,
    max_meta_bytes: int = MAX_META_BYTES,
    partial: bool = False,
) -> None:
    """Raise :class:`UpdateRejected` unless ``msg`` is safe to hand to a strategy.

    Checks, in order: header fields; kind; ``meta`` is small JSON; for ``gradient``,
    ``delta`` and ``model``: ``tensors`` names exactly the spec's parameters with
    their shapes; ``activation``: names exactly the spec's entries; ``control``: no
    tensors at all; ``buffers`` only known buffers of matching shape and dtype class;
    ``optimizer`` slots only on ``model`` and shaped like their parameter; every
    floating tensor finite. A plain mapping is taken as the parameter shapes. With
    ``partial`` a parameter kind may carry any subset of the parameters (each one it
    carries is still checked), for strategies that exchange part of the model per link.
    """
    spec = (
        expected_shapes
        if isinstance(expected_shapes, TensorSpec)
        else TensorSpec(parameters=dict(expected_shapes))
    )

    def reject(reason: str, detail: str) -> UpdateRejected:
        return UpdateRejected(reason, detail, sender=getattr(msg, "sender", None), step=getattr(msg, "step", None))

    _check_header(msg, reject)
    _check_meta(msg, max_meta_bytes, reject)

    if msg.kind == "control":
        if msg.tensors or msg.buffers or msg.optimizer:
            raise reject("unexpected_tensor", "control messages carry no tensors")
        return

    _check_named(msg.tensors, spec.parameters, "tensor", reject, partial=partial)
    for name, tensor in msg.tensors.items():
        _check_float(name, tensor, reject)

    for name, tensor in msg.buffers.items():
        if name not in spec.buffers:
            raise reject("unexpected_tensor", f"unknown buffer {name!r}")
        shape, dtype = spec.buffers[name]
        _check_shape(f"buffer {name!r}", tensor, shape, reject)
        if tensor.is_floating_point() != dtype.is_floating_point:
            raise reject("bad_dtype", f"buffer {name!r} has dtype {tensor.dtype}, model has {dtype}")
        if msg.kind != "model" and not tensor.is_floating_point():
            raise reject("bad_dtype", f"buffer delta {name!r} must be floating point")
        if tensor.is_floating_point():
            _check_finite(f"buffer {name!r}", tensor, reject)

    if msg.optimizer and msg.kind != "model":
        raise reject("unexpected_tensor", "optimizer slots are only accepted on model snapshots")
    for name, tensor in msg.optimizer.items():
        if name not in spec.parameters:
            raise reject("unexpected_tensor", f"optimizer slot for unknown parameter {name!r}")
        _check_shape(f"optimizer slot {name!r}", tensor, spec.parameters[name], reject)
        _check_float(f"optimizer slot {name!r}", tensor, reject)


def _check_header(msg: UpdateMessage, reject: Rejector) -> None:
    if msg.kind not in MESSAGE_KINDS:
        raise reject("unknown_kind", f"kind {msg.kind!r} is not one of {sorted(MESSAGE_KINDS)}")
    if not isinstance(msg.sender, str) or not msg.sender:
        raise reject("bad_header", "sender must be a non-empty string")
    for field_name in ("step", "base_version", "batch_size"):
        value = getattr(msg, field_name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise reject("bad_header", f"{field_name} must be an int >= 0, got {value!r}")
    if msg.kind in ("gradient", "delta") and msg.batch_size <= 0:
        raise reject("bad_header", f"{msg.kind} needs batch_size > 0, got {msg.batch_size}")
    for field_name in ("tensors", "buffers", "optimizer", "meta"):
        if not isinstance(getattr(msg, field_name), dict):
            raise reject("bad_header", f"{field_name} must be a dict")


def _check_meta(msg: UpdateMessage, max_meta_bytes: int, reject: Rejector) -> None:
    depth = _nesting(msg.meta)
    if depth > MAX_META_DEPTH:
        raise reject("bad_meta", f"meta nests {depth} levels deep, limit {MAX_META_DEPTH}")
    try:
        encoded = json.dumps(msg.meta, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise reject("bad_meta", f"meta is not finite JSON: {exc}") from None
    if len(encoded.encode()) > max_meta_bytes:
        raise reject("bad_meta", f"meta is {len(encoded)} bytes, limit {max_meta_bytes}")


def _nesting(value: object) -> int:
    """How deeply lists, tuples and dicts nest in ``value`` (0 for a scalar); iterative,
    and it stops one level past ``MAX_META_DEPTH``."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, (list, tuple)):
            deepest = max(deepest, depth + 1)
            if deepest > MAX_META_DEPTH:
                break
            stack.extend((child, depth + 1) for child in item)
    return deepest


def _check_named(
    tensors: Mapping[str, torch.Tensor], expected: Mapping[str, Shape], what: str, reject: Rejector,
    *, partial: bool = False,
) -> None:
    missing = sorted(expected.keys() - tensors.keys())
    if missing and not partial:
        raise reject("missing_tensor", f"missing {what}s {missing}")
    extra = sorted(tensors.keys() - expected.keys())
    if extra:
        raise reject("unexpected_tensor", f"unexpected {what}s {extra}")
    for name, tensor in tensors.items():
        _check_shape(f"{what} {name!r}", tensor, expected[name], reject)


def _check_shape(label: str, tensor: object, shape: Shape, reject: Rejector) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise reject("bad_dtype", f"{label} is {type(tensor).__name__}, not a tensor")
    actual = tuple(tensor.shape)
    if len(actual) != len(shape) or any(
        want is not None and want != got for want, got in zip(shape, actual, strict=True)
    ):
        raise reject("shape_mismatch", f"{label} has shape {actual}, expected {shape}")


def _check_float(label: str, tensor: torch.Tensor, reject: Rejector) -> None:
    if not tensor.is_floating_point():
        raise reject("bad_dtype", f"{label} has dtype {tensor.dtype}, expected floating point")
    _check_finite(label, tensor, reject)


def _check_finite(label: str, tensor: torch.Tensor, reject: Rejector) -> None:
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise reject("non_finite", f"{label} has {bad} non-finite value(s)")


__all__ = ["MAX_META_BYTES", "MAX_META_DEPTH", "Shape", "TensorSpec", "validate_update"]
