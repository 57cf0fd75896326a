"""The lossless ``nonzero`` codec: exact round trips of sparse tensors, sizes, bad payloads.

(The conformance suite in test_conformance.py also runs on it, being registered.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgestream.compression import registry, wire
from edgestream.compression.errors import PayloadDecodeError
from edgestream.compression.nonzero import NonzeroCompressor
from edgestream.compression.pipeline import decode_tensors
from edgestream.compression.sparse import num_blocks

CODEC = registry.create("nonzero")


def _bits(t: torch.Tensor) -> np.ndarray:
    flat = t.detach().reshape(-1).contiguous()
    view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[flat.dtype]
    return flat.view(view).numpy()


def _sparse(shape: tuple[int, ...], density: float, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen)
    mask = torch.rand(shape, generator=gen) < density
    return torch.where(mask, values, torch.zeros(())).to(dtype)


def _round_trip(t: torch.Tensor) -> torch.Tensor:
    data = CODEC.encode("w", t)
    out = registry.decoder_for(NonzeroCompressor.codec_id).decode(data, tuple(t.shape))
    assert out.dtype == t.dtype and out.shape == t.shape
    return out


def test_registered_with_the_next_codec_id_and_no_knob():
    assert registry.compressor_class("nonzero") is NonzeroCompressor
    assert NonzeroCompressor.codec_id == 10
    assert registry.name_of_codec(10) == "nonzero"
    assert NonzeroCompressor.budget_knob is None
    assert CODEC.params() == {}


@pytest.mark.parametrize("shape", [(1,), (7,), (33, 5), (4, 3, 5, 2), (3, 1, 7), (70_000,), (300, 301)], ids=str)
@pytest.mark.parametrize("density", [0.001, 0.01, 0.3])
def test_round_trip_is_bit_exact_on_random_sparse_tensors(shape, density):
    for seed in range(2):
        t = _sparse(shape, density, seed)
        out = _round_trip(t)
        assert np.array_equal(_bits(out), _bits(t))
        kept = CODEC.compress(t).parts[1].numel()
        assert kept == int(torch.count_nonzero(t))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_narrow_dtypes_round_trip_bit_exact(dtype):
    t = _sparse((50, 20), 0.05, 3, dtype)
    assert np.array_equal(_bits(_round_trip(t)), _bits(t))


def test_negative_zero_is_kept_and_positive_zero_dropped():
    t = torch.tensor([0.0, -0.0, 1.5, 0.0, -0.0, -2.0])
    compressed = CODEC.compress(t)
    low = compressed.parts[1].numpy().astype(np.int64)
    assert low.tolist() == [1, 2, 4, 5]  # -0.0 entries are kept (bit pattern != 0)
    out = CODEC.decompress(compressed)
    assert np.array_equal(_bits(out), _bits(t))
    assert torch.signbit(out).tolist() == [False, True, False, False, True, True]


@pytest.mark.parametrize("shape", [(1,), (5, 5), (70_000,), (200_001,)], ids=str)
def test_all_zero_tensor_keeps_nothing(shape):
    t = torch.zeros(shape)
    counts, low, values = CODEC.compress(t).parts
    assert low.numel() == 0 and values.numel() == 0
    assert counts.numel() == num_blocks(t.numel()) and int(counts.sum()) == 0
    assert CODEC.part_sizes_for(t) == (4 * num_blocks(t.numel()), 0, 0)
    out = _round_trip(t)
    assert np.array_equal(_bits(out), _bits(t))


def test_fully_dense_tensor_round_trips_and_costs_six_bytes_per_entry():
    t = torch.randn(40, 30, generator=torch.Generator().manual_seed(4)) + 10.0  # no zeros
    assert int(torch.count_nonzero(t)) == t.numel()
    out = _round_trip(t)
    assert np.array_equal(_bits(out), _bits(t))
    assert CODEC.part_sizes_for(t) == (4, 2 * 1200, 4 * 1200)


def test_more_than_65536_entries_span_several_blocks():
    n = 3 * 65536 + 17
    t = torch.zeros(n)
    hits = [0, 65535, 65536, 131071, 131072 + 9, n - 1]
    t[hits] = torch.arange(1, len(hits) + 1, dtype=torch.float32)
    counts, low, values = CODEC.compress(t).parts
    assert counts.tolist() == [2, 2, 1, 1]
    assert values.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert np.array_equal(_bits(_round_trip(t)), _bits(t))
    big = _sparse((280_000,), 0.02, 5)
    assert np.array_equal(_bits(_round_trip(big)), _bits(big))


def test_one_percent_dense_is_much_smaller_than_dense():
    t = _sparse((100_000,), 0.01, 6)
    dense = registry.create("dense").encode("w", t)
    sparse = CODEC.encode("w", t)
    assert len(sparse) * 10 < len(dense)


def test_multi_layer_message_decodes_through_the_generic_path():
    grads = {"a": _sparse((64, 40), 0.02, 7), "b": torch.zeros(9), "c": _sparse((70_000,), 0.001, 8)}
    data = wire.encode_layers({n: CODEC.compress(t) for n, t in grads.items()})
    out = decode_tensors(data, {n: tuple(t.shape) for n, t in grads.items()})
    for n, t in grads.items():
        assert np.array_equal(_bits(out[n]), _bits(t))


def _forged(shape: tuple[int, ...], *parts: torch.Tensor) -> wire.Compressed:
    return wire.Compressed(NonzeroCompressor.codec_id, shape, torch.float32, tuple(parts))


def _reason(forged: wire.Compressed) -> str:
    with pytest.raises(PayloadDecodeError) as direct:
        registry.decoder_for(NonzeroCompressor.codec_id).decompress(forged)
    with pytest.raises(PayloadDecodeError) as via_wire:
        CODEC.decode(wire.encode_layers({"w": forged}))
    assert via_wire.value.reason == direct.value.reason and via_wire.value.layer == "w"
    return direct.value.reason


def _i32(*v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int32)


def _u16(*v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int32).to(torch.uint16)


@pytest.mark.parametrize(
    ("parts", "shape", "reason"),
    [
        ((_i32(2), _u16(1, 3), torch.tensor([1.0, 2.0], dtype=torch.float16)), (10,), "dtype"),
        ((_i32(2), _u16(1, 3), torch.tensor([1.0, 2.0], dtype=torch.bfloat16)), (10,), "dtype"),
        ((_i32(2), _u16(3, 1), torch.tensor([1.0, 2.0])), (10,), "index_order"),
        ((_i32(2), _u16(3, 3), torch.tensor([1.0, 2.0])), (10,), "index_order"),
        ((_i32(1), _u16(10), torch.tensor([1.0])), (10,), "index_out_of_range"),
        ((_i32(3), _u16(1, 3), torch.tensor([1.0, 2.0])), (10,), "length_mismatch"),
        ((_i32(2), _u16(1, 3), torch.tensor([1.0])), (10,), "length_mismatch"),
        ((_i32(2, 0), _u16(1, 3), torch.tensor([1.0, 2.0])), (10,), "length_mismatch"),
        ((_i32(-1, 3), _u16(1, 3), torch.tensor([1.0, 2.0])), (70_000,), "length_mismatch"),
        ((_i32(2), _u16(1, 3)), (10,), "length_mismatch"),
    ],
    ids=["fp16_values", "bf16_values", "order", "duplicate", "range", "count_sum",
         "short_values", "extra_block", "negative_count", "two_parts"],
)
def test_corrupted_payloads_raise_payload_decode_error(parts, shape, reason):
    # (NaN / inf values, truncations and random byte corruption: test_conformance.py.)
    assert _reason(_forged(shape, *parts)) == reason
