"""Behaviour specific to each codec, and payloads that are well-formed bytes but wrong for the codec."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from edgestream.compression import registry, wire
from edgestream.compression.base import LayerContext
from edgestream.compression.errors import CompressorConfigError, PayloadDecodeError
from edgestream.compression.qsgd import code_bits, pack_codes, unpack_codes
from edgestream.compression.sparse import select_topk
from tests.unit.compression.helpers import make_gradient


def _forged(
    name: str, shape: tuple[int, ...], *parts: torch.Tensor, dtype=torch.float32
) -> wire.Compressed:
    return wire.Compressed(registry.compressor_class(name).codec_id, shape, dtype, tuple(parts))


def _rejects(name: str, forged: wire.Compressed) -> str:
    """Reason for rejecting ``forged``, checked both directly and after a trip through the wire."""
    with pytest.raises(PayloadDecodeError) as direct:
        registry.decoder_for(forged.codec_id).decompress(forged)
    data = wire.encode_layers({"w": forged})
    with pytest.raises(PayloadDecodeError) as via_wire:
        registry.create(name).decode(data)
    assert via_wire.value.reason == direct.value.reason
    assert via_wire.value.layer == "w"
    return direct.value.reason


# ---- top-k and the sparse format -------------------------------------------------


@pytest.mark.parametrize(
    "magnitudes",
    [
        np.random.default_rng(0).standard_normal(200_000).astype(np.float32),
        np.exp(np.random.default_rng(1).standard_normal(200_000)).astype(np.float32),
        np.arange(200_000, dtype=np.float32),  # sorted: the tail is all at the end
        np.ones(200_000, dtype=np.float32),  # all ties
        # Large values exactly where a stride-12 sample never looks.
        np.where(np.arange(200_000) % 12 == 5, 10.0, 1.0).astype(np.float32),
        np.random.default_rng(2).standard_normal(1000).astype(np.float32),
    ],
    ids=["normal", "lognormal", "sorted", "ties", "adversarial_stride", "small"],
)
@pytest.mark.parametrize("fraction", [1e-4, 0.01, 0.1, 0.5])
def test_select_topk_is_exact(magnitudes, fraction):
    magnitudes = np.abs(magnitudes)
    k = max(1, int(fraction * magnitudes.size))
    chosen = select_topk(magnitudes, k)

    assert chosen.dtype == np.int64 and chosen.size == k
    assert np.all(np.diff(chosen) > 0)
    kth_largest = np.partition(magnitudes, magnitudes.size - k)[magnitudes.size - k]
    assert magnitudes[chosen].min() >= kth_largest
    assert math.isclose(
        float(np.sort(magnitudes[chosen]).sum()),
        float(np.sort(magnitudes)[-k:].sum()),
        rel_tol=1e-6,
    )


def test_topk_keeps_the_largest_magnitudes_and_zeroes_the_rest():
    x = make_gradient((100, 50), seed=1)
    comp = registry.create("topk", ratio=0.05)
    y = comp.decompress(comp.compress(x))
    kept = y != 0
    assert int(kept.sum()) == 250
    assert torch.equal(y[kept], x[kept])
    assert x.abs()[~kept].max() <= x.abs()[kept].min()


def test_topk_context_ratio_overrides_configured_ratio():
    x = make_gradient((1000,), seed=2)
    comp = registry.create("topk", ratio=0.01)
    y = comp.decompress(comp.compress(x, LayerContext("w", ratio=0.2)))
    assert int((y != 0).sum()) == 200
    assert comp.part_sizes((1000,), LayerContext("w", ratio=0.2)) == (4, 400, 800)


@pytest.mark.parametrize(
    ("value_dtype", "value_bytes"), [("float32", 4), ("float16", 2), ("bfloat16", 2)]
)
def test_topk_value_dtype_sets_value_bytes(value_dtype, value_bytes):
    comp = registry.create("topk", ratio=0.01, value_dtype=value_dtype)
    assert comp.part_sizes((1_000_000,)) == (4 * 16, 2 * 10_000, value_bytes * 10_000)
    assert comp.compress(make_gradient((3000,), seed=3)).parts[2].element_size() == value_bytes


def test_topk_at_one_percent_is_over_fifty_times_smaller_than_dense():
    shapes = {"a": (1024, 768), "b": (768,), "c": (256, 256)}
    topk, dense = registry.create("topk", ratio=0.01), registry.create("dense")
    topk_bytes = wire.MESSAGE_HEADER_SIZE + sum(topk.frame_nbytes(n, s) for n, s in shapes.items())
    dense_bytes = wire.MESSAGE_HEADER_SIZE + sum(
        dense.frame_nbytes(n, s) for n, s in shapes.items()
    )
    assert dense_bytes / topk_bytes >= 50


def test_sparse_rejects_out_of_range_index():
    counts, low, values = (
        torch.tensor([2], dtype=torch.int32),
        torch.tensor([1, 9], dtype=torch.uint16),
        torch.ones(2),
    )
    assert _rejects("topk", _forged("topk", (9,), counts, low, values)) == "index_out_of_range"


@pytest.mark.parametrize("low", [[3, 3], [4, 2]], ids=["duplicate", "descending"])
def test_sparse_rejects_indices_out_of_order(low):
    forged = _forged(
        "topk",
        (9,),
        torch.tensor([2], dtype=torch.int32),
        torch.tensor(low, dtype=torch.uint16),
        torch.ones(2),
    )
    assert _rejects("topk", forged) == "index_order"


@pytest.mark.parametrize(
    ("counts", "n_low", "n_values", "shape"),
    [
        ([3], 2, 2, (9,)),  # counts do not sum to the index count
        ([-1, 3], 2, 2, (70_000,)),  # negative count
        ([2, 0], 2, 2, (9,)),  # one block too many for the shape
        ([2], 2, 3, (9,)),  # values and indices disagree
        ([20], 20, 20, (9,)),  # more kept than the tensor has
    ],
)
def test_sparse_rejects_inconsistent_lengths(counts, n_low, n_values, shape):
    forged = _forged(
        "topk",
        shape,
        torch.tensor(counts, dtype=torch.int32),
        torch.arange(n_low, dtype=torch.int32).to(torch.uint16),
        torch.ones(n_values),
    )
    assert _rejects("topk", forged) == "length_mismatch"


def test_sparse_indices_in_a_later_block_decode_to_their_position():
    forged = _forged(
        "topk",
        (70_000,),
        torch.tensor([1, 1], dtype=torch.int32),
        torch.tensor([5, 7], dtype=torch.uint16),
        torch.tensor([1.0, 2.0]),
    )
    y = registry.decoder_for(forged.codec_id).decompress(forged)
    assert y.nonzero().flatten().tolist() == [5, 65536 + 7]


def test_sparse_rejects_a_value_overflowing_the_layer_dtype():
    forged = _forged(
        "topk",
        (4,),
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([0], dtype=torch.uint16),
        torch.tensor([1e6]),
        dtype=torch.float16,
    )
    assert _rejects("topk", forged) == "non_finite"


# ---- random-k and threshold --------------------------------------------------------


def test_randomk_keeps_k_distinct_entries_with_uniform_coverage():
    comp = registry.create("randomk", ratio=0.1, seed=3)
    x = torch.arange(1.0, 101.0)
    hits = torch.zeros(100)
    for _ in range(400):
        y = comp.decompress(comp.compress(x))
        kept = y != 0
        assert int(kept.sum()) == 10 and torch.equal(y[kept], x[kept])
        hits += kept
    # Each index expects 40 hits (sd ~6); a biased sampler leaves some far off.
    assert hits.min() >= 15 and hits.max() <= 65


def test_randomk_seeds_differ_and_unbiased_mode_scales():
    x = make_gradient((500,), seed=4)
    a = registry.create("randomk", seed=1).compress(x).parts[1]
    b = registry.create("randomk", seed=2).compress(x).parts[1]
    assert not torch.equal(a, b)
    scaled = registry.create("randomk", ratio=0.1, unbiased=True)
    y = scaled.decompress(scaled.compress(x))
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] * 10)
    assert scaled.unbiased and not registry.create("randomk").unbiased


def test_threshold_keeps_exactly_entries_at_or_above_it():
    x = torch.tensor([0.5, -0.2, 0.1, -0.7, 0.3])
    comp = registry.create("threshold", threshold=0.3)
    compressed = comp.compress(x)
    assert torch.equal(comp.decompress(compressed), torch.tensor([0.5, 0.0, 0.0, -0.7, 0.3]))
    assert comp.part_sizes((5,)) is None and comp.part_sizes_for(x) == (4, 6, 12)


def test_threshold_with_nothing_above_sends_an_empty_selection():
    comp = registry.create("threshold", threshold=10.0)
    x = make_gradient((50,), seed=5, scale=0.1)
    compressed = comp.compress(x)
    assert compressed.parts[1].numel() == 0
    assert torch.equal(comp.decode(comp.encode("w", x)), torch.zeros(50))


# ---- QSGD ---------------------------------------------------------------------------


@pytest.mark.parametrize("levels", [1, 3, 7, 8, 127])
def test_qsgd_codes_pack_and_unpack(levels):
    bits = code_bits(levels)
    codes = np.random.default_rng(levels).integers(0, 2 * levels + 1, size=1001).astype(np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.size == math.ceil(1001 * bits / 8)
    assert np.array_equal(unpack_codes(packed, bits, 1001), codes)


def test_qsgd_levels_choose_the_bit_width():
    assert [code_bits(s) for s in (1, 2, 7, 8, 127)] == [2, 4, 4, 8, 8]
    assert registry.create("qsgd", levels=1).nominal_ratio((512 * 100,)) > 15


def test_qsgd_each_element_within_one_level_of_its_bucket():
    comp = registry.create("qsgd", levels=4, bucket_size=64)
    x = make_gradient((640,), seed=6)
    y = comp.decompress(comp.compress(x))
    norms = x.view(10, 64).norm(dim=1, keepdim=True)
    assert torch.all((y - x).view(10, 64).abs() <= norms / 4 * (1 + 1e-5))
    # Decoded values sit on the level grid of their bucket.
    levels = (y.view(10, 64) / norms * 4).abs()
    torch.testing.assert_close(levels, levels.round(), atol=1e-4, rtol=0)


def test_qsgd_zero_bucket_decodes_to_zero():
    comp = registry.create("qsgd", bucket_size=4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -2.0])
    y = comp.decompress(comp.compress(x))
    assert torch.equal(y[:4], torch.zeros(4))


def _qsgd_parts(levels=7, bucket=4, norms=(1.0, 1.0), codes=None, numel=6):
    codes = (
        np.full(numel, levels, dtype=np.uint8)
        if codes is None
        else np.asarray(codes, dtype=np.uint8)
    )
    packed = torch.from_numpy(pack_codes(codes, code_bits(levels)))
    return (torch.tensor([levels, bucket], dtype=torch.int32), torch.tensor(norms), packed)


@pytest.mark.parametrize(
    ("parts", "reason"),
    [
        (_qsgd_parts(codes=[15, 7, 7, 7, 7, 7]), "value_out_of_range"),  # 15 > 2 * 7
        (_qsgd_parts(norms=(1.0, -1.0)), "value_out_of_range"),
        (_qsgd_parts(norms=(1.0,)), "length_mismatch"),
        (_qsgd_parts(numel=9), "length_mismatch"),
    ],
)
def test_qsgd_rejects_bad_payloads(parts, reason):
    assert _rejects("qsgd", _forged("qsgd", (6,), *parts)) == reason


@pytest.mark.parametrize("header", [[0, 4], [128, 4], [7, 0], [7, 1 << 30]])
def test_qsgd_rejects_bad_header(header):
    _, norms, packed = _qsgd_parts()
    assert (
        _rejects(
            "qsgd", _forged("qsgd", (6,), torch.tensor(header, dtype=torch.int32), norms, packed)
        )
        == "value_out_of_range"
    )


# ---- int8 blocks ------------------------------------------------------------------


def test_int8_error_is_at_most_half_a_step_per_element():
    comp = registry.create("int8_block", block_size=32)
    x = make_gradient((320,), seed=7)
    y = comp.decompress(comp.compress(x))
    step = x.view(10, 32).abs().amax(dim=1, keepdim=True) / 127
    assert torch.all((y - x).view(10, 32).abs() <= step / 2 * (1 + 1e-5))


def test_int8_rejects_minus_128_negative_scale_and_overflow():
    header = torch.tensor([4], dtype=torch.int32)
    q = torch.tensor([1, 2, 3, -128], dtype=torch.int8)
    assert (
        _rejects("int8_block", _forged("int8_block", (4,), header, torch.tensor([1.0]), q))
        == "value_out_of_range"
    )
    ok_q = torch.tensor([1, 2, 3, 127], dtype=torch.int8)
    assert (
        _rejects("int8_block", _forged("int8_block", (4,), header, torch.tensor([-1.0]), ok_q))
        == "value_out_of_range"
    )
    assert (
        _rejects("int8_block", _forged("int8_block", (4,), header, torch.tensor([3e38]), ok_q))
        == "non_finite"
    )
    assert (
        _rejects(
            "int8_block",
            _forged(
                "int8_block", (4,), torch.tensor([0], dtype=torch.int32), torch.tensor([1.0]), ok_q
            ),
        )
        == "value_out_of_range"
    )
    assert (
        _rejects("int8_block", _forged("int8_block", (4,), header, torch.tensor([1.0, 1.0]), ok_q))
        == "length_mismatch"
    )


# ---- PowerSGD -----------------------------------------------------------------------


def test_powersgd_reconstructs_a_rank_one_matrix_exactly():
    u, v = make_gradient((50,), seed=8), make_gradient((30,), seed=9)
    matrix = torch.outer(u, v)
    comp = registry.create("powersgd", rank=2)
    y = comp.decompress(comp.compress(matrix, LayerContext("w")))
    torch.testing.assert_close(y, matrix, atol=1e-4, rtol=1e-4)


def test_powersgd_warm_start_converges_on_a_fixed_matrix():
    matrix = make_gradient((80, 60), seed=10)
    warm, cold = (
        registry.create("powersgd", rank=2),
        registry.create("powersgd", rank=2, warm_start=False),
    )
    ctx = LayerContext("w")
    warm_errors = [
        float((warm.decompress(warm.compress(matrix, ctx)) - matrix).norm()) for _ in range(8)
    ]
    cold_errors = [
        float((cold.decompress(cold.compress(matrix, ctx)) - matrix).norm()) for _ in range(8)
    ]
    # Power iteration approaches the best rank-2 error (Eckart-Young) only with warm starts.
    singular = torch.linalg.svdvals(matrix.double())
    best = float(singular[2:].norm())
    assert warm_errors[-1] < warm_errors[0]
    assert warm_errors[-1] <= best * 1.02
    assert min(cold_errors) > best * 1.02


def test_powersgd_state_is_per_layer_and_checkpointable():
    a, b = make_gradient((40, 30), seed=11), make_gradient((40, 30), seed=12)
    comp = registry.create("powersgd", rank=3)
    comp.compress(a, LayerContext("a"))
    comp.compress(b, LayerContext("b"))
    state = comp.state_dict()
    assert set(state) == {"a", "b"}

    clone = registry.create("powersgd", rank=3, seed=99)
    clone.load_state_dict(state)
    assert comp.encode("a", a) == clone.encode("a", a)
    comp.reset()
    assert comp.state_dict() == {}


def test_powersgd_sends_vectors_and_unprofitable_ranks_dense():
    comp = registry.create("powersgd", rank=4)
    bias = make_gradient((30,), seed=13)
    assert torch.equal(comp.decompress(comp.compress(bias)), bias)
    assert comp.part_sizes((30,)) == (4, 120)
    assert comp.part_sizes((6, 6)) == (4, 144)  # (6 + 6) * 4 >= 36
    assert comp.part_sizes((100, 50), LayerContext(rank=2)) == (4, 800, 400)


def test_powersgd_rejects_bad_rank_and_lengths():
    rank = lambda r: torch.tensor([r], dtype=torch.int32)  # noqa: E731
    assert (
        _rejects("powersgd", _forged("powersgd", (10, 8), rank(9), torch.ones(90), torch.ones(72)))
        == "value_out_of_range"
    )
    assert (
        _rejects("powersgd", _forged("powersgd", (10,), rank(1), torch.ones(10), torch.ones(1)))
        == "value_out_of_range"
    )
    assert (
        _rejects("powersgd", _forged("powersgd", (10, 8), rank(2), torch.ones(19), torch.ones(16)))
        == "length_mismatch"
    )
    assert (
        _rejects("powersgd", _forged("powersgd", (10, 8), rank(0), torch.ones(79)))
        == "length_mismatch"
    )
    assert (
        _rejects(
            "powersgd",
            _forged("powersgd", (10, 8), rank(1), torch.full((10,), 1e30), torch.full((8,), 1e30)),
        )
        == "non_finite"
    )


# ---- sign, fp16, dense ------------------------------------------------------------


def test_sign_sends_mean_magnitude_times_sign():
    x = torch.tensor([1.0, -3.0, 0.0, 2.0])
    comp = registry.create("sign")
    assert torch.equal(comp.decompress(comp.compress(x)), torch.tensor([1.5, -1.5, 1.5, 1.5]))
    assert comp.nominal_ratio((8000,)) == pytest.approx(4 * 8000 / (4 + 1000))


def test_sign_rejects_negative_scale_and_short_bits():
    bits = torch.tensor([0xFF], dtype=torch.uint8)
    assert (
        _rejects("sign", _forged("sign", (8,), torch.tensor([-1.0]), bits)) == "value_out_of_range"
    )
    assert _rejects("sign", _forged("sign", (9,), torch.tensor([1.0]), bits)) == "length_mismatch"


def test_fp16_saturates_instead_of_overflowing():
    comp = registry.create("fp16")
    y = comp.decompress(comp.compress(torch.tensor([1e6, -1e6, 1.0])))
    assert y.tolist() == [65504.0, -65504.0, 1.0]


@pytest.mark.parametrize("name", ["dense", "fp16"])
def test_plain_codecs_reject_wrong_lengths(name):
    dtype = torch.float32 if name == "dense" else torch.float16
    assert _rejects(name, _forged(name, (5,), torch.ones(4, dtype=dtype))) == "length_mismatch"


# ---- configuration ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("topk", {"ratio": 0.0}),
        ("topk", {"ratio": 1.5}),
        ("topk", {"value_dtype": "int8"}),
        ("randomk", {"ratio": -1}),
        ("threshold", {"threshold": 0.0}),
        ("threshold", {"threshold": float("nan")}),
        ("qsgd", {"levels": 0}),
        ("qsgd", {"bucket_size": 0}),
        ("int8_block", {"block_size": 0}),
        ("powersgd", {"rank": 0}),
        ("topk", {"no_such_param": 1}),
        ("no_such_codec", {}),
    ],
)
def test_bad_configuration_is_rejected_at_creation(name, params):
    with pytest.raises(CompressorConfigError):
        registry.create(name, **params)


def test_bad_context_override_is_rejected():
    with pytest.raises(CompressorConfigError):
        registry.create("topk").compress(torch.ones(10), LayerContext(ratio=2.0))
    with pytest.raises(CompressorConfigError):
        registry.create("powersgd").compress(torch.ones(10, 10), LayerContext(rank=0))
