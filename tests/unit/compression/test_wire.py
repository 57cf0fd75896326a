"""The message format itself: layout, limits and structural rejection."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from edgestream.compression import wire
from edgestream.compression.errors import CompressionError, PayloadDecodeError
from edgestream.compression.pipeline import decode_tensors, encode_tensors
from tests.unit.compression.helpers import make_gradient, patch, shape_offset


def _reason(data: bytes, expected=None, **limits) -> str:
    with pytest.raises(PayloadDecodeError) as err:
        wire.decode_layers(data, expected, **limits)
    return err.value.reason


def _layers() -> dict[str, torch.Tensor]:
    return {
        "conv.weight": make_gradient((4, 2, 3, 3), seed=1),
        "fc.weight": make_gradient((10, 12), seed=2),
        "fc.bias": make_gradient((10,), seed=3),
        "ünïcode/名前": make_gradient((1,), seed=4),
    }


def test_multi_layer_round_trip_is_bit_exact_and_keeps_order():
    named = _layers()
    out = decode_tensors(encode_tensors(named), {k: v.shape for k, v in named.items()})
    assert list(out) == list(named)
    for name, tensor in named.items():
        assert torch.equal(out[name], tensor)


def test_header_fields_are_little_endian_at_documented_offsets():
    data = encode_tensors({"w": torch.ones(3)})
    magic, version, flags, n_layers, body_len = struct.unpack_from("<4sBBHI", data)
    assert (magic, version, flags, n_layers, body_len) == (b"ESTW", 1, 0, 1, len(data) - 12)
    # name_len, name, codec, dtype, ndim, n_parts, reserved, dim0, part dtype, part numel, 3 x f32
    assert struct.unpack_from("<H1sHBBBBIBI3f", data, 12) == (
        1,
        b"w",
        1,
        1,
        1,
        1,
        0,
        3,
        1,
        3,
        1.0,
        1.0,
        1.0,
    )


def test_decoded_tensors_do_not_alias_the_buffer():
    buffer = bytearray(encode_tensors({"w": torch.ones(4)}))
    out = decode_tensors(buffer)
    buffer[-4:] = struct.pack("<f", 5.0)
    assert torch.equal(out["w"], torch.ones(4))


def test_accepts_bytearray_and_memoryview():
    data = encode_tensors({"w": torch.arange(6.0)})
    assert torch.equal(decode_tensors(bytearray(data))["w"], torch.arange(6.0))
    assert torch.equal(decode_tensors(memoryview(data))["w"], torch.arange(6.0))


def test_empty_message_is_valid_and_expected_layers_then_missing():
    data = wire.encode_layers({})
    assert wire.decode_layers(data) == {}
    assert _reason(data, {"w": (1,)}) == "missing_layer"


def test_unexpected_layer_is_rejected():
    data = encode_tensors({"a": torch.ones(2), "b": torch.ones(2)})
    assert _reason(data, {"a": (2,)}) == "unexpected_layer"


def test_duplicate_layer_is_rejected():
    one = encode_tensors({"w": torch.ones(2)})
    frame = one[12:]
    doubled = struct.pack("<4sBBHI", b"ESTW", 1, 0, 2, 2 * len(frame)) + frame + frame
    assert _reason(doubled) == "duplicate_layer"


def test_layer_count_beyond_frames_is_truncated():
    data = encode_tensors({"w": torch.ones(2)})
    assert _reason(patch(data, 6, struct.pack("<H", 2))) == "truncated"


def test_name_that_is_not_utf8_is_rejected():
    data = encode_tensors({"w": torch.ones(2)})
    assert _reason(patch(data, 14, b"\xff")) == "bad_name"


def test_zero_length_name_is_rejected():
    data = encode_tensors({"w": torch.ones(2)})
    assert _reason(patch(data, 12, struct.pack("<H", 0))) == "bad_name"


def test_unknown_dtype_codes_are_rejected():
    data = encode_tensors({"w": torch.ones(2)})
    dense_dtype_at = 12 + 2 + 1 + 2
    assert (
        _reason(patch(data, dense_dtype_at, b"\x09")) == "dtype"
    )  # int32 is not a dense float dtype
    assert _reason(patch(data, dense_dtype_at, b"\xee")) == "dtype"
    part_dtype_at = wire.parse_layout(data)[0].parts[0].offset - 5
    assert _reason(patch(data, part_dtype_at, b"\xee")) == "dtype"


def test_reserved_byte_and_too_many_dims_are_rejected():
    data = encode_tensors({"w": torch.ones(2)})
    assert _reason(patch(data, 12 + 2 + 1 + 5, b"\x01")) == "bad_header"
    assert _reason(patch(data, 12 + 2 + 1 + 3, bytes([wire.MAX_NDIM + 1]))) == "bad_header"


def test_zero_dimension_is_rejected():
    data = encode_tensors({"w": torch.ones(2)})
    assert _reason(patch(data, shape_offset(data), struct.pack("<I", 0))) == "shape_mismatch"


def test_total_size_over_all_layers_is_bounded():
    data = encode_tensors({"a": torch.ones(60), "b": torch.ones(60)})
    wire.decode_layers(data, max_numel=120)
    assert _reason(data, max_numel=119) == "too_large"


def test_oversized_message_is_rejected_before_parsing():
    assert _reason(b"\x00" * 100, max_bytes=99) == "too_large"


def test_bfloat16_parts_round_trip_and_are_checked_by_bit_pattern():
    values = torch.tensor([1.0, -2.0, 3.0], dtype=torch.bfloat16)
    good = wire.encode_layers({"w": wire.Compressed(1, (3,), torch.float32, (values,))})
    assert torch.equal(wire.decode_layers(good)["w"].parts[0], values)
    part = wire.parse_layout(good)[0].parts[0]
    assert _reason(patch(good, part.offset, bytes([0x80, 0x7F]))) == "non_finite"  # +inf
    assert _reason(patch(good, part.offset, bytes([0xC0, 0x7F]))) == "non_finite"  # NaN
    nan = torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)
    with pytest.raises(CompressionError, match="non_finite"):
        wire.encode_layers({"w": wire.Compressed(1, (2,), torch.float32, (nan,))})


@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.int64]
)
def test_integer_parts_round_trip(dtype):
    values = torch.tensor([0, 1, 2, 100], dtype=dtype)
    data = wire.encode_layers({"w": wire.Compressed(1, (4,), torch.float32, (values,))})
    assert torch.equal(wire.decode_layers(data)["w"].parts[0], values)


def test_encoder_refuses_what_the_decoder_would_reject():
    ok = (torch.ones(2),)
    with pytest.raises(CompressionError, match="bad_name"):
        wire.encode_layers({"": wire.Compressed(1, (2,), torch.float32, ok)})
    with pytest.raises(CompressionError, match="dtype"):
        wire.encode_layers({"w": wire.Compressed(1, (2,), torch.int32, ok)})
    with pytest.raises(CompressionError, match="dtype"):
        wire.encode_layers(
            {"w": wire.Compressed(1, (2,), torch.float32, (torch.ones(2, dtype=torch.complex64),))}
        )
    with pytest.raises(CompressionError, match="shape_mismatch"):
        wire.encode_layers({"w": wire.Compressed(1, (0,), torch.float32, ok)})
    with pytest.raises(CompressionError, match="non_finite"):
        wire.encode_layers(
            {"w": wire.Compressed(1, (2,), torch.float32, (torch.tensor([1.0, float("inf")]),))}
        )


def test_parse_layout_reports_part_offsets_that_hold_the_values():
    data = encode_tensors({"w": torch.tensor([1.5, -2.0])})
    (layout,) = wire.parse_layout(data)
    (part,) = layout.parts
    assert np.frombuffer(data, "<f4", count=2, offset=part.offset).tolist() == [1.5, -2.0]
    assert (layout.name, layout.shape, part.numel, part.nbytes) == ("w", (2,), 2, 8)
