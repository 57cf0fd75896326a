"""The registry: names, codec ids, and refusal of clashes."""

from __future__ import annotations

import pytest

from edgestream.compression import registry
from edgestream.compression.dense import DenseCompressor
from edgestream.compression.errors import CompressorConfigError, PayloadDecodeError


def test_names_are_sorted_and_create_returns_fresh_instances():
    assert registry.names() == sorted(registry.names())
    assert registry.create("topk") is not registry.create("topk")


def test_name_clash_is_refused():
    class Impostor(DenseCompressor):
        codec_id = 60_001

    with pytest.raises(CompressorConfigError):
        registry.register("dense")(Impostor)
    assert registry.compressor_class("dense") is DenseCompressor


def test_codec_id_clash_is_refused():
    class SameId(DenseCompressor):
        codec_id = DenseCompressor.codec_id

    with pytest.raises(CompressorConfigError):
        registry.register("same_id_test")(SameId)
    assert "same_id_test" not in registry.names()


def test_invalid_codec_id_is_refused():
    class NoId(DenseCompressor):
        codec_id = 0

    with pytest.raises(CompressorConfigError):
        registry.register("no_id_test")(NoId)


def test_unknown_codec_id_is_a_decode_error():
    with pytest.raises(PayloadDecodeError) as err:
        registry.decoder_for(65_000)
    assert err.value.reason == "unknown_codec"
