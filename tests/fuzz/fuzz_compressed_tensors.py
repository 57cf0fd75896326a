"""Fuzz target: compressed tensor messages (``compression.wire`` and every registered codec).

Input: one mode byte, then an ``ESTW`` message (docs/compression.md, "Wire format").
The low 2 bits pick the entry point:

* 0: ``decode_tensors(data, EXPECTED)``: the receiver knows names and shapes
  (``w (8, 16)``, ``b (16,)``, ``c (2, 3, 4)``, ``one (1,)``);
* 1: ``decode_tensors(data, max_numel=4096)``: any names and shapes;
* 2: ``decode_tensors(data, max_numel=4096, allowed_codecs=("dense", "topk", "nonzero"))``;
* 3: ``Compressor.decode`` (one-layer message) of the codec ``registry.names()[(mode >> 2) & 15]``
  (modulo their number), expected shape ``(8, 16)`` when bit 6 is set.

Bit 7: set the header's ``body_len`` to the bytes present, so inserting or erasing
bytes still reaches the layer checks.

Allowed to escape: ``PayloadDecodeError`` ("Anything wrong raises PayloadDecodeError
with reason and layer"; the conformance suite says random corruption never escapes as
anything else). Also a bug: an accepted message whose tensors are not finite, not of
their declared shape and float dtype; one that is not the canonical encoding of its
layers (``encode_layers(decode_layers(data)) != data``); or a layer that a fresh
instance of its codec decodes differently (decoding must be stateless).
"""

from __future__ import annotations

import math

import torch

from edgestream.compression import registry, wire
from edgestream.compression.errors import PayloadDecodeError
from edgestream.compression.pipeline import decode_tensors, encode_tensors
from tests.fuzz.targets import FuzzFinding

MAX_LEN = 8192
ALLOWED = (PayloadDecodeError,)

EXPECTED = {"w": (8, 16), "b": (16,), "c": (2, 3, 4), "one": (1,)}
MAX_NUMEL = 4096
ALLOWED_CODECS = ("dense", "topk", "nonzero")
FIX_BODY_LEN = 128
_NAMES = registry.names()


def _check(out: dict[str, torch.Tensor], data: bytes, expected: dict | None) -> None:
    layers = wire.decode_layers(data, max_numel=MAX_NUMEL if expected is None else 1 << 20)
    if list(out) != list(layers):
        raise FuzzFinding(f"decoded layers {list(out)}, message holds {list(layers)}")
    for name, tensor in out.items():
        comp = layers[name]
        if tuple(tensor.shape) != comp.shape or tensor.dtype != comp.dtype or not tensor.is_floating_point():
            raise FuzzFinding(f"layer {name!r}: {tensor.dtype} {tuple(tensor.shape)}, declared {comp.dtype} {comp.shape}")
        if expected is not None and tuple(tensor.shape) != tuple(expected[name]):
            raise FuzzFinding(f"layer {name!r} of shape {tuple(tensor.shape)} accepted, expected {expected[name]}")
        if not bool(torch.isfinite(tensor).all()):
            raise FuzzFinding(f"layer {name!r} decoded to NaN or infinity")
        fresh = registry.compressor_class(registry.name_of_codec(comp.codec_id))()
        if not torch.equal(fresh.decompress(comp), tensor):
            raise FuzzFinding(f"layer {name!r}: a fresh {fresh.name} instance decodes differently")
    if wire.encode_layers(layers) != data:
        raise FuzzFinding("an accepted message is not the canonical encoding of its layers")


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, msg = data[0], bytes(data[1:])
    if mode & FIX_BODY_LEN and len(msg) >= wire.MESSAGE_HEADER_SIZE:
        body = len(msg) - wire.MESSAGE_HEADER_SIZE
        msg = msg[:8] + body.to_bytes(4, "little") + msg[wire.MESSAGE_HEADER_SIZE :]
    entry = mode & 3
    try:
        if entry == 0:
            _check(decode_tensors(msg, EXPECTED), msg, EXPECTED)
        elif entry == 1:
            _check(decode_tensors(msg, max_numel=MAX_NUMEL), msg, None)
        elif entry == 2:
            out = decode_tensors(msg, max_numel=MAX_NUMEL, allowed_codecs=ALLOWED_CODECS)
            for comp in wire.decode_layers(msg, max_numel=MAX_NUMEL).values():
                if registry.name_of_codec(comp.codec_id) not in ALLOWED_CODECS:
                    raise FuzzFinding(f"codec id {comp.codec_id} accepted, not in {ALLOWED_CODECS}")
            _check(out, msg, None)
        else:
            codec = registry.decoder_for(registry.compressor_class(_NAMES[((mode >> 2) & 15) % len(_NAMES)]).codec_id)
            shape = (8, 16) if mode & 64 else None
            tensor = codec.decode(msg, expected_shape=shape, max_numel=MAX_NUMEL)
            ((name, comp),) = wire.decode_layers(msg, max_numel=MAX_NUMEL).items()
            if comp.codec_id != codec.codec_id:
                raise FuzzFinding(f"{codec.name} decoded a layer of codec id {comp.codec_id}")
            _check({name: tensor}, msg, None if shape is None else {name: shape})
    except PayloadDecodeError:
        return


def seeds() -> dict[str, bytes]:
    """Messages of every registered codec (several shapes and dense dtypes) and each entry point."""
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(8, 16, generator=gen),
        "b": torch.randn(16, generator=gen).to(torch.bfloat16),
        "c": torch.randn(2, 3, 4, generator=gen).to(torch.float16),
        "one": torch.tensor([0.5], dtype=torch.float64),
    }
    sparse = {"w": torch.where(torch.rand(8, 16, generator=gen) < 0.2, torch.randn(8, 16, generator=gen), 0.0)}
    out: dict[str, bytes] = {}
    for index, name in enumerate(_NAMES):
        params = {"value_dtype": "float16"} if name in ("topk", "randomk") else {}
        compressor = registry.create(name, **params)
        out[f"expected_{name}"] = bytes([FIX_BODY_LEN]) + encode_tensors(tensors, compressor)
        out[f"any_{name}"] = bytes([1]) + encode_tensors(sparse if name == "nonzero" else {"x": tensors["w"]}, compressor)
        one_layer = compressor.encode("w", sparse["w"] if name == "nonzero" else tensors["w"])
        out[f"single_{name}"] = bytes([3 | index << 2 | 64]) + one_layer
    out["allowed_mixed"] = bytes([2]) + wire.encode_layers({
        "a": registry.create("dense").compress(tensors["b"]),
        "z": registry.create("topk", ratio=0.25).compress(tensors["w"]),
    })
    assert all(math.isfinite(float(t.float().abs().max())) for t in tensors.values())
    return out


def dictionary() -> list[bytes]:
    """Tokens for libFuzzer: the magic, the expected names, every codec id, NaN and inf."""
    ids = [registry.compressor_class(n).codec_id for n in _NAMES]
    return [b"ESTW\x01\x00", *(len(n).to_bytes(2, "little") + n.encode() for n in EXPECTED),
            *(i.to_bytes(2, "little") for i in ids), b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x7c",
            b"\x80\x7f", b"\x10\x00\x00\x00", b"\x80\x00\x00\x00", b"\x00\x00\x01\x00"]
