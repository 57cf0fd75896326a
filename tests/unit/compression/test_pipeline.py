"""GradientCodec composition, config, and multi-codec decoding."""

from __future__ import annotations

import pytest
import torch

from edgestream.compression import registry
from edgestream.compression.base import LayerContext
from edgestream.compression.errors import CompressorConfigError, PayloadDecodeError
from edgestream.compression.memory import ErrorFeedback, NoMemory
from edgestream.compression.pipeline import (
    CompressionConfig,
    GradientCodec,
    decode_tensors,
    encode_tensors,
)

SHAPES = {"conv.weight": (16, 3, 3, 3), "fc.weight": (64, 48), "fc.bias": (64,)}


def test_receiver_decodes_dense_and_compressed_steps_alike(gradients):
    sender = GradientCodec(registry.create("topk", ratio=0.05), ErrorFeedback())
    receiver = GradientCodec(registry.create("dense"))
    grads = gradients(SHAPES, seed=1)

    dense = receiver.decode(sender.encode(grads, compress=False), SHAPES)
    sparse = receiver.decode(sender.encode(grads), SHAPES)

    assert set(dense) == set(sparse) == set(SHAPES)
    assert all(
        torch.count_nonzero(sparse[n]) < torch.count_nonzero(dense[n])
        for n in ("conv.weight", "fc.weight")
    )


def test_stats_report_sizes_and_norms(gradients):
    grads = gradients(SHAPES, seed=2)
    codec = GradientCodec(registry.create("topk", ratio=0.01), NoMemory())
    data, stats = codec.encode_with_stats(grads)

    numel = sum(g.numel() for g in grads.values())
    assert stats.compressed and stats.codec == "topk"
    assert (stats.dense_bytes, stats.wire_bytes) == (4 * numel, len(data))
    assert stats.ratio == pytest.approx(4 * numel / len(data))
    assert stats.grad_norm_sum == pytest.approx(
        sum(float(g.norm()) for g in grads.values()), rel=1e-6
    )
    assert 0 < stats.sent_norm_sum < stats.grad_norm_sum
    _, dense_stats = codec.encode_with_stats(grads, compress=False)
    assert not dense_stats.compressed and dense_stats.codec == "dense"
    assert dense_stats.sent_norm_sum == pytest.approx(dense_stats.grad_norm_sum, rel=1e-6)


def test_predicted_size_is_exact(gradients):
    codec = GradientCodec(registry.create("topk", ratio=0.02))
    contexts = {"fc.weight": LayerContext(ratio=0.3)}
    assert codec.predicted_nbytes(SHAPES, contexts) == len(
        codec.encode(gradients(SHAPES), contexts=contexts)
    )
    assert GradientCodec(registry.create("threshold")).predicted_nbytes(SHAPES) is None


def test_contexts_steer_each_layer(gradients):
    codec = GradientCodec(registry.create("topk", ratio=0.01))
    out = decode_tensors(
        codec.encode(gradients(SHAPES), contexts={"fc.weight": LayerContext(ratio=0.5)}), SHAPES
    )
    assert torch.count_nonzero(out["fc.weight"]) == 64 * 48 // 2
    assert torch.count_nonzero(out["fc.bias"]) == 1


def test_allowed_codecs_restricts_what_a_receiver_accepts(gradients):
    data = encode_tensors(gradients(SHAPES), registry.create("sign"))
    receiver = GradientCodec(registry.create("topk"), allowed_codecs={"topk", "dense"})
    with pytest.raises(PayloadDecodeError) as err:
        receiver.decode(data, SHAPES)
    assert err.value.reason == "codec_not_allowed"


def test_unknown_codec_id_is_rejected():
    data = bytearray(encode_tensors({"w": torch.ones(3)}))
    data[12 + 2 + 1 : 12 + 2 + 1 + 2] = (999).to_bytes(2, "little")
    with pytest.raises(PayloadDecodeError) as err:
        decode_tensors(bytes(data))
    assert (err.value.reason, err.value.layer) == ("unknown_codec", "w")


def test_codec_state_dict_carries_memory_and_compressor_state(gradients):
    codec = GradientCodec(registry.create("powersgd", rank=2), ErrorFeedback())
    grads = gradients(SHAPES, seed=3)
    codec.encode(grads)
    state = codec.state_dict()
    assert {k.split("/")[0] for k in state} == {"memory", "compressor"}

    twin = GradientCodec(registry.create("powersgd", rank=2, seed=7), ErrorFeedback())
    twin.load_state_dict(state)
    following = gradients(SHAPES, seed=4)
    assert twin.encode(following) == codec.encode(following)
    codec.reset()
    assert codec.state_dict() == {}


def test_state_dict_can_travel_in_the_wire_format(gradients):
    codec = GradientCodec(registry.create("topk"), ErrorFeedback())
    codec.encode(gradients(SHAPES))
    state = codec.state_dict()
    restored = decode_tensors(encode_tensors(state), {k: v.shape for k, v in state.items()})
    assert all(torch.equal(restored[k], state[k]) for k in state)


def test_config_builds_a_codec_by_name():
    codec = CompressionConfig.from_mapping(
        {
            "compressor": "topk",
            "params": {"ratio": 0.1, "value_dtype": "float16"},
            "error_feedback": True,
        }
    ).build()
    assert codec.compressor.name == "topk" and codec.compressor.ratio == 0.1
    assert isinstance(codec.memory, ErrorFeedback)
    assert isinstance(CompressionConfig(error_feedback=False).build().memory, NoMemory)


@pytest.mark.parametrize(
    "table",
    [{"compressor": "nope"}, {"compresor": "topk"}, {"compressor": "topk", "params": [1]}],
)
def test_config_rejects_mistakes(table):
    with pytest.raises(CompressorConfigError):
        CompressionConfig.from_mapping(table)


def test_config_rejects_bad_params_when_built():
    with pytest.raises(CompressorConfigError):
        CompressionConfig(compressor="topk", params={"ratio": 7}).build()
