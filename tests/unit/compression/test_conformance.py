"""Checks every registered compressor must pass; a newly registered one gets them automatically."""

from __future__ import annotations

import math
import random
import struct

import numpy as np
import pytest
import torch

from edgestream.compression import registry, wire
from edgestream.compression.base import LayerContext
from edgestream.compression.errors import CompressionError, PayloadDecodeError
from edgestream.compression.memory import ErrorFeedback
from edgestream.compression.pipeline import GradientCodec, decode_tensors
from tests.unit.compression.helpers import INF_BYTES, NAN_BYTES, make_gradient, patch, shape_offset

NAMES = registry.names()
# Scalars, odd vectors, a tall matrix (low rank pays), a 4-D kernel, and a vector
# that crosses the 65536-element block of the sparse index format.
SHAPES = [(1,), (7,), (64, 40), (4, 3, 5, 2), (70_000,)]
SMALL = (33, 5)


def _encode(name: str, x: torch.Tensor, layer: str = "layer.weight") -> bytes:
    return registry.create(name).encode(layer, x)


def test_every_expected_compressor_is_registered():
    assert set(NAMES) >= {
        "dense",
        "fp16",
        "topk",
        "randomk",
        "threshold",
        "qsgd",
        "int8_block",
        "powersgd",
        "sign",
        "nonzero",
    }


def test_codec_ids_are_unique_and_map_back_to_names():
    ids = {name: registry.compressor_class(name).codec_id for name in NAMES}
    assert len(set(ids.values())) == len(ids)
    for name, codec_id in ids.items():
        assert registry.name_of_codec(codec_id) == name


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_error_within_declared_bound(name, shape):
    comp = registry.create(name)
    ctx = LayerContext(name="w")
    for seed in range(3):
        x = make_gradient(shape, seed=seed, scale=1e-2)
        bound = comp.error_bound(x, ctx)
        y = comp.decompress(comp.compress(x, ctx))

        assert y.shape == x.shape and y.dtype == x.dtype
        assert torch.isfinite(y).all()
        assert float((y - x).double().norm()) <= bound + 1e-12


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_encoded_size_matches_declaration(name, shape):
    comp = registry.create(name)
    x = make_gradient(shape, seed=1, scale=1e-2)
    ctx = LayerContext(name="w")
    compressed = comp.compress(x, ctx)

    actual_parts = tuple(p.numel() * p.element_size() for p in compressed.parts)
    assert actual_parts == comp.part_sizes_for(x, ctx)
    declared = comp.part_sizes(shape, ctx)
    if declared is not None:
        assert actual_parts == declared
        assert comp.nominal_ratio(shape, ctx) == pytest.approx(
            4 * math.prod(shape) / sum(actual_parts)
        )
        assert len(comp.encode("w", x)) == wire.MESSAGE_HEADER_SIZE + comp.frame_nbytes(
            "w", shape, ctx
        )
    assert len(wire.encode_layers({"w": compressed})) == wire.encoded_size({"w": compressed})


@pytest.mark.parametrize("name", NAMES)
def test_decoding_needs_no_sender_state(name):
    sender = registry.create(name)
    x = make_gradient((64, 40), seed=2)
    for _ in range(2):  # second call exercises warm-started state
        data = sender.encode("w", x)
        expected = sender.decompress(wire.decode_layers(data)["w"])
        fresh = registry.decoder_for(sender.codec_id)

        assert fresh is not sender
        assert torch.equal(fresh.decode(data, (64, 40)), expected)
        assert torch.equal(decode_tensors(data, {"w": (64, 40)})["w"], expected)


@pytest.mark.parametrize("name", NAMES)
def test_same_parameters_give_same_bytes(name):
    first, second = registry.create(name), registry.create(name)
    for step in range(3):
        x = make_gradient((64, 40), seed=step)
        assert first.encode("w", x) == second.encode("w", x)


@pytest.mark.parametrize("name", NAMES)
def test_error_feedback_conserves_the_sum_of_gradients(name):
    shapes = {"conv.weight": (8, 3, 3, 3), "fc.weight": (40, 30), "fc.bias": (40,)}
    sender = GradientCodec(registry.create(name), ErrorFeedback())
    sent_total = {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()}
    true_total = {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()}

    for step in range(6):
        grads = {n: make_gradient(s, seed=10 * step + i) for i, (n, s) in enumerate(shapes.items())}
        received = decode_tensors(sender.encode(grads), shapes)
        for n in shapes:
            sent_total[n] += received[n].double()
            true_total[n] += grads[n].double()

    for n in shapes:
        residual = sender.memory.residual(n)
        assert residual is not None
        torch.testing.assert_close(
            sent_total[n] + residual.double(), true_total[n], atol=1e-4, rtol=1e-5
        )


@pytest.mark.parametrize("name", [n for n in NAMES if registry.create(n).unbiased])
def test_unbiased_compressors_average_to_the_input(name):
    comp = registry.create(name)
    x = make_gradient((48,), seed=4)
    draws = torch.stack([comp.decompress(comp.compress(x)) for _ in range(2000)]).double()
    mean, std = draws.mean(0), draws.std(0)
    # Five standard errors per element; a biased codec misses by far more.
    assert torch.all((mean - x.double()).abs() <= 5 * std / math.sqrt(2000) + 1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", NAMES)
def test_dense_dtype_and_shape_are_restored(name, dtype):
    comp = registry.create(name)
    x = make_gradient((20, 6), seed=5).to(dtype)
    y = comp.decode(comp.encode("w", x), (20, 6))
    assert y.dtype == dtype and y.shape == (20, 6)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", ["nan", "inf", "empty", "integer"])
def test_compress_rejects_unusable_input(name, bad):
    x = {
        "nan": torch.tensor([1.0, float("nan"), 2.0]),
        "inf": torch.tensor([1.0, float("-inf"), 2.0]),
        "empty": torch.zeros(0),
        "integer": torch.arange(5),
    }[bad]
    with pytest.raises(CompressionError) as err:
        registry.create(name).encode("w", x)
    assert (
        err.value.reason
        == {"nan": "non_finite", "inf": "non_finite", "empty": "empty", "integer": "dtype"}[bad]
    )
    assert err.value.layer == "w"


# ---- malformed payloads ---------------------------------------------------------


def _reason(data: bytes, expected=None, **limits) -> str:
    with pytest.raises(PayloadDecodeError) as err:
        decode_tensors(data, expected, **limits)
    return err.value.reason


@pytest.mark.parametrize("name", NAMES)
def test_every_truncation_is_rejected(name):
    data = _encode(name, make_gradient(SMALL, seed=6))
    cuts = (
        range(len(data))
        if len(data) <= 1024
        else sorted(set(np.linspace(0, len(data) - 1, 400, dtype=int)))
    )
    for cut in cuts:
        assert _reason(data[:cut]) == "truncated", cut


@pytest.mark.parametrize("name", NAMES)
def test_header_corruptions_are_rejected(name):
    data = _encode(name, make_gradient(SMALL, seed=7))
    assert _reason(b"XXXX" + data[4:]) == "bad_magic"
    assert _reason(patch(data, 4, bytes([wire.VERSION + 1]))) == "bad_version"
    assert _reason(patch(data, 5, b"\x01")) == "bad_header"
    assert _reason(data + b"\x00") == "trailing_bytes"
    assert _reason(data, max_bytes=len(data) - 1) == "too_large"
    assert _reason(data, {"layer.weight": (5, 33)}) == "shape_mismatch"
    assert _reason(data, {"other": SMALL}) == "missing_layer"
    assert _reason(data, {"layer.weight": SMALL, "other": (1,)}) == "missing_layer"


@pytest.mark.parametrize("name", NAMES)
def test_declared_huge_shape_is_rejected_before_allocating(name):
    data = _encode(name, make_gradient(SMALL, seed=8))
    huge = patch(data, shape_offset(data), struct.pack("<I", 0xFFFFFFFF))
    assert _reason(huge) == "too_large"
    assert _reason(huge, max_numel=10**12) in {"length_mismatch", "value_out_of_range"}
    # Expected shapes cap the allocation at their own total size.
    assert _reason(huge, {"layer.weight": SMALL}) == "too_large"


@pytest.mark.parametrize("name", NAMES)
def test_declared_huge_part_is_rejected_as_truncated(name):
    data = _encode(name, make_gradient(SMALL, seed=8))
    part = wire.parse_layout(data)[0].parts[0]
    header_at = part.offset - 5  # dtype u8 + numel u32 precede the data
    assert _reason(patch(data, header_at + 1, struct.pack("<I", 0xFFFFFFFF))) == "truncated"


@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("name", NAMES)
def test_non_finite_float_parts_are_rejected(name, poison):
    data = _encode(name, make_gradient(SMALL, seed=9))
    table = NAN_BYTES if poison == "nan" else INF_BYTES
    float_parts = [p for p in wire.parse_layout(data)[0].parts if p.dtype in table and p.numel]
    for part in float_parts:
        assert (
            _reason(
                patch(data, part.offset + part.nbytes - len(table[part.dtype]), table[part.dtype])
            )
            == "non_finite"
        )


@pytest.mark.parametrize("name", NAMES)
def test_random_corruption_is_rejected_or_decodes_to_a_finite_tensor(name):
    data = _encode(name, make_gradient(SMALL, seed=10))
    rng = random.Random(name)
    for _ in range(300):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        try:
            out = decode_tensors(bytes(mutated), {"layer.weight": SMALL})
        except PayloadDecodeError:
            continue  # any other exception type fails the test
        assert out["layer.weight"].shape == SMALL
        assert torch.isfinite(out["layer.weight"]).all()


@pytest.mark.parametrize("name", NAMES)
def test_wrong_part_dtype_is_rejected(name):
    comp = registry.create(name)
    compressed = comp.compress(make_gradient(SMALL, seed=11))
    wrong = tuple(
        p.to(torch.float64) if p.dtype != torch.float64 else p.float() for p in compressed.parts
    )
    forged = wire.Compressed(compressed.codec_id, compressed.shape, compressed.dtype, wrong)
    with pytest.raises(PayloadDecodeError) as err:
        comp.decompress(forged)
    assert err.value.reason == "dtype"


@pytest.mark.parametrize("name", NAMES)
def test_payload_of_another_codec_is_refused_by_this_codec(name):
    other = "dense" if name != "dense" else "fp16"
    data = _encode(other, make_gradient(SMALL, seed=12))
    with pytest.raises(PayloadDecodeError) as err:
        registry.create(name).decode(data)
    assert err.value.reason == "codec_mismatch"
