"""Fuzz target: update messages (``trainers.wire.decode_update``, with ``validate_update``
and the compressed tensor sections it hands to ``compression``).

Input: one mode byte, then the record value. Mode bits select the receiver's options:

* 1: ``job="job-1"``; 2: ``allowed_codecs=("dense", "topk", "qsgd")``;
* 4: ``max_norm=1e3``; 8: ``max_abs=1e3``; 16: ``partial=True``;
* 32: a plain ``{name: shape}`` mapping instead of the ``TensorSpec`` (no buffers);
* 64: rewrite the prefix's lengths from the content (the JSON header's end, each
  ``ESTW`` section's own length, the rest for the integer section), so mutations that
  change the header's length still reach the header and section checks.

The receiver's spec: parameters ``fc.weight (4, 3)``, ``fc.bias (4,)``, float buffer
``bn.mean (4,)``, integer buffer ``bn.count ()``; ``activation`` messages are checked
against ``act (None, 4)`` (a wildcard batch dim, bounded by ``max_numel``).

Allowed to escape: ``MessageRejected`` only (trainers/wire.py: "Every failure raises
MessageRejected with a stable reason"). Also a bug: a reason outside
``MessageRejected.REASONS``; an accepted message that ``validate_update`` would refuse
(names, shapes, finiteness); one that does not survive ``to_state`` / ``from_state`` (how
strategies keep messages and checkpoint them); or one that, sent again dense
(``encode_update`` without a codec), does not decode to the same message.
"""

from __future__ import annotations

import json
import struct

import torch

from edgestream.compression import ErrorFeedback, GradientCodec, registry
from edgestream.trainers.messages import MESSAGE_KINDS, UpdateMessage
from edgestream.trainers.validation import TensorSpec, validate_update
from edgestream.trainers.wire import (
    MessageEncodeError,
    MessageRejected,
    decode_update,
    encode_update,
)
from tests.fuzz.targets import FuzzFinding

MAX_LEN = 8192
ALLOWED = (MessageRejected,)

JOB = "job-1"
MAX_BYTES = 1 << 16
SPEC = TensorSpec(
    parameters={"fc.weight": (4, 3), "fc.bias": (4,)},
    buffers={"bn.mean": ((4,), torch.float32), "bn.count": ((), torch.int64)},
)
ACTIVATION_SPEC = TensorSpec(parameters={"act": (None, 4)})
PLAIN = {"fc.weight": (4, 3), "fc.bias": (4,)}

JOB_CHECK, CODECS, MAX_NORM, MAX_ABS, PARTIAL, PLAIN_SPEC, FIX_LENGTHS = 1, 2, 4, 8, 16, 32, 64
_PREFIX = struct.Struct("<4sBBHIIIII")


def _options(mode: int) -> dict:
    def spec_for(kind: str):
        if kind == "activation":
            return ACTIVATION_SPEC
        return PLAIN if mode & PLAIN_SPEC else SPEC

    return {
        "expected_shapes": spec_for,
        "max_bytes": MAX_BYTES,
        "allowed_codecs": ("dense", "topk", "qsgd") if mode & CODECS else None,
        "job": JOB if mode & JOB_CHECK else None,
        "max_numel": 4096,
        "max_norm": 1e3 if mode & MAX_NORM else None,
        "partial": bool(mode & PARTIAL),
        "max_abs": 1e3 if mode & MAX_ABS else None,
    }


def fix_lengths(value: bytes) -> bytes:
    """``value`` with H, T, B, O, R recomputed from what follows the prefix."""
    size = _PREFIX.size
    if len(value) < size:
        return value
    try:  # latin-1: one character per byte, so the end offset is a byte offset
        _, header_len = json.JSONDecoder().raw_decode(value[size:].decode("latin-1"))
    except (ValueError, RecursionError):
        return value
    pos = size + header_len
    lengths = []
    for _ in range(3):  # tensors, buffers, optimizer: each an ESTW message or empty
        length = 0
        if value[pos : pos + 4] == b"ESTW" and len(value) >= pos + 12:  # 12-byte ESTW header
            length = min(12 + int.from_bytes(value[pos + 8 : pos + 12], "little"), len(value) - pos)
        lengths.append(length)
        pos += length
    head = _PREFIX.unpack_from(value, 0)
    prefix = _PREFIX.pack(*head[:4], header_len, *lengths, len(value) - pos)
    return prefix + value[size:]


def _decode(value: bytes, opts: dict) -> UpdateMessage | None:
    try:
        return decode_update(value, **opts)
    except MessageRejected as err:
        if err.reason not in MessageRejected.REASONS:
            raise FuzzFinding(f"unknown reason {err.reason!r}") from err
        return None


def _equal(a: UpdateMessage, b: UpdateMessage) -> bool:
    def same(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> bool:
        return list(x) == list(y) and all(
            x[n].dtype == y[n].dtype and x[n].shape == y[n].shape and torch.equal(x[n], y[n]) for n in x
        )

    return (
        (a.kind, a.sender, a.step, a.base_version, a.batch_size, a.meta)
        == (b.kind, b.sender, b.step, b.base_version, b.batch_size, b.meta)
        and same(a.tensors, b.tensors)
        and same(a.buffers, b.buffers)
        and same(a.optimizer, b.optimizer)
    )


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, value = data[0], bytes(data[1:])
    if mode & FIX_LENGTHS:
        value = fix_lengths(value)
    opts = _options(mode)
    msg = _decode(value, opts)
    if msg is None:
        return
    if msg.kind not in MESSAGE_KINDS:
        raise FuzzFinding(f"accepted kind {msg.kind!r}")
    spec = opts["expected_shapes"](msg.kind)
    try:
        validate_update(msg, spec, partial=opts["partial"])
    except Exception as err:
        raise FuzzFinding(f"decode_update accepted a message validate_update refuses: {err}") from err
    try:  # what a strategy does with a message it holds (BSP's pending state, checkpoints)
        kept = UpdateMessage.from_state(msg.to_state())
    except Exception as err:
        raise FuzzFinding(f"an accepted message cannot be kept: {type(err).__name__}: {err}") from err
    if not _equal(msg, kept):
        raise FuzzFinding("an accepted message changes through to_state / from_state")
    try:
        again, _ = encode_update(msg, job=JOB)
    except MessageEncodeError as err:
        raise FuzzFinding(f"an accepted message cannot be sent on: {err}") from err
    second = _decode(again, {**opts, "allowed_codecs": None})
    if second is None or not _equal(msg, second):
        raise FuzzFinding("an accepted message, sent again dense, decodes differently")


def seeds() -> dict[str, bytes]:
    """Valid records of every kind, the tensors section in every registered codec."""
    gen = torch.Generator().manual_seed(0)

    def params(scale: float = 1.0) -> dict[str, torch.Tensor]:
        return {
            "fc.weight": torch.randn(4, 3, generator=gen) * scale,
            "fc.bias": torch.randn(4, generator=gen) * scale,
        }

    out: dict[str, bytes] = {}
    base = {"sender": "w1", "step": 7, "base_version": 5, "batch_size": 16}
    for name in registry.names():
        codec = GradientCodec(registry.create(name), ErrorFeedback())
        msg = UpdateMessage(kind="gradient", tensors=params(), meta={"lr": 0.1}, **base)
        value, _ = encode_update(msg, job=JOB, codec=codec)
        out[f"gradient_{name}"] = bytes([JOB_CHECK | MAX_NORM | FIX_LENGTHS]) + value
    delta = UpdateMessage(kind="delta", tensors=params(0.01), buffers={"bn.mean": torch.randn(4, generator=gen)}, **base)
    out["delta_buffers"] = bytes([JOB_CHECK | CODECS]) + encode_update(delta, job=JOB)[0]
    model = UpdateMessage(
        kind="model",
        tensors={n: t.to(torch.bfloat16) if n == "fc.bias" else t for n, t in params().items()},
        buffers={"bn.mean": torch.zeros(4, dtype=torch.float64), "bn.count": torch.tensor(3, dtype=torch.int64)},
        optimizer={"fc.weight": torch.randn(4, 3, generator=gen).to(torch.float16)},
        meta={"version": 5, "tags": ["a", None, True, 1.5]},
        **base,
    )
    out["model_full"] = bytes([MAX_ABS | FIX_LENGTHS]) + encode_update(model, job=JOB)[0]
    out["model_full_exact"] = bytes([0]) + encode_update(model, job=JOB)[0]
    partial = UpdateMessage(kind="delta", tensors={"fc.bias": torch.ones(4)}, **base)
    out["delta_partial"] = bytes([PARTIAL]) + encode_update(partial, job=JOB)[0]
    control = UpdateMessage(kind="control", meta={"view": ["w0", "w1"], "epoch": 3}, **base)
    out["control"] = bytes([JOB_CHECK | FIX_LENGTHS]) + encode_update(control, job=JOB, to="w0")[0]
    act = UpdateMessage(kind="activation", tensors={"act": torch.randn(2, 4, generator=gen)}, **base)
    out["activation"] = bytes([PLAIN_SPEC]) + encode_update(act, job=JOB)[0]
    return out


def dictionary() -> list[bytes]:
    """Tokens for libFuzzer: both magics, the header's keys and values, the spec's names."""
    words = ["job", "kind", "sender", "step", "base_version", "batch_size", "codec", "meta", "tensors",
             "buffers", "optimizer", *MESSAGE_KINDS, *registry.names(), "float32", "float16", "bfloat16",
             "float64", "int64", "int32", "int16", "int8", "uint8", JOB, "fc.weight", "fc.bias", "bn.mean",
             "bn.count", "act"]
    return [b"EDGG\x01\x00\x00\x00", b"ESTW\x01\x00", *(f'"{w}"'.encode() for w in words), b"[]", b"{}",
            b"[4,3]", b"[4]", b"null", b"1e308", b"-1"]
