"""Gradient compression for edgestream: compressors, error feedback, controllers, wire format.

Pure torch / numpy, no Kafka: tensors in, bytes out. ``trainers/`` and
``pipeline/`` build on this API (keep it stable; docs/compression.md has the
long form).

Per layer (``compression.base``)::

    Compressor.name: str                      # registry name, e.g. "topk"
    Compressor.codec_id: int                  # wire id, unique and never reused
    Compressor.compress(tensor, ctx: LayerContext | None = None) -> Compressed
    Compressor.decompress(compressed: Compressed) -> torch.Tensor
    Compressor.encode(name, tensor, ctx=None) -> bytes       # one-layer message
    Compressor.decode(data, expected_shape=None, max_numel=..., max_bytes=...) -> torch.Tensor
    Compressor.error_bound(tensor, ctx=None) -> float        # max ||round trip - x||_2
    Compressor.part_sizes(shape, ctx=None) -> tuple[int, ...] | None
    Compressor.payload_nbytes(shape, ctx=None) / nominal_ratio(shape, ctx=None) / frame_nbytes(name, shape, ctx=None)
    Compressor.unbiased: bool; Compressor.budget_knob: "ratio" | "rank" | None
    Compressor.reset() / state_dict() / load_state_dict()   # per-layer state (PowerSGD warm start)
    LayerContext(name="", ratio=None, rank=None)             # per-call overrides from controllers

Registry (``compression.registry``)::

    register(name) -> class decorator;  create(name, **params) -> Compressor;  names() -> list[str]
    decoder_for(codec_id) -> Compressor;  compressor_class(name) -> type[Compressor]

    dense (fp32 reference), fp16, topk(ratio=0.01, value_dtype="float32"),
    randomk(ratio=0.01, seed=0, unbiased=False, value_dtype="float32"),
    threshold(threshold=1e-3, value_dtype="float32"), qsgd(levels=7, bucket_size=512, seed=0),
    int8_block(block_size=256), powersgd(rank=4, seed=0, warm_start=True), sign(),
    nonzero() (lossless: every entry but +0.0, float32)

Error feedback (``compression.memory``)::

    Memory.compensate(name, grad) -> grad + residual;  Memory.update(name, compensated, sent)
    ErrorFeedback(), NoMemory();  .residual(name), .reset(), .state_dict(), .load_state_dict()

Composition (``compression.pipeline``)::

    GradientCodec(compressor, memory=None, *, allowed_codecs=None, max_bytes=..., max_numel=...)
        .encode(grads: Mapping[str, Tensor], *, compress=True, contexts=None) -> bytes
        .encode_with_stats(...) -> tuple[bytes, EncodeStats]
        .decode(data, expected_shapes=None, *, max_bytes=None) -> dict[str, Tensor]
        .predicted_nbytes(shapes, contexts=None) -> int | None;  .reset(); .state_dict(); .load_state_dict()
    encode_tensors(named, compressor=None, contexts=None) -> bytes
    decode_tensors(data, expected=None, *, max_bytes=..., max_numel=None, allowed_codecs=None) -> dict[str, Tensor]
    CompressionConfig(compressor="dense", params={}, error_feedback=True, max_bytes=...)
        .from_mapping(table) -> CompressionConfig;  .build() -> GradientCodec

Wire format (``compression.wire``): versioned, self-describing (codec id per
layer, so a receiver decodes dense and compressed steps alike)::

    encode_layers(Mapping[str, Compressed]) -> bytes;  decode_layers(data, expected=None, *, max_bytes, max_numel)
    parse_layout(data, *, max_bytes, max_numel) -> list[LayerLayout];  encoded_size(layers) -> int

Controllers (``compression.controllers``): ``ScadlesSignal``, ``ScadlesVote``,
``compression_signal``, ``scadles_signal``, ``topk_norm``, ``AccordionSwitch``,
``ByteBudgetController``, ``BudgetDecision``, ``BandwidthEstimator``.

Errors (``compression.errors``): ``CompressionError(reason, message, layer=None)``,
``PayloadDecodeError`` (bytes rejected) and ``CompressorConfigError`` (also a ValueError).
"""

from edgestream.compression import (  # noqa: F401  (importing registers each compressor)
    dense,
    fp16,
    int8_block,
    nonzero,
    powersgd,
    qsgd,
    randomk,
    sign,
    threshold,
    topk,
)
from edgestream.compression.base import Compressed, Compressor, LayerContext
from edgestream.compression.errors import (
    CompressionError,
    CompressorConfigError,
    PayloadDecodeError,
)
from edgestream.compression.memory import ErrorFeedback, Memory, NoMemory
from edgestream.compression.pipeline import (
    CompressionConfig,
    EncodeStats,
    GradientCodec,
    decode_tensors,
    encode_tensors,
)
from edgestream.compression.registry import create, names, register

__all__ = [
    "CompressionConfig",
    "CompressionError",
    "Compressed",
    "Compressor",
    "CompressorConfigError",
    "EncodeStats",
    "ErrorFeedback",
    "GradientCodec",
    "LayerContext",
    "Memory",
    "NoMemory",
    "PayloadDecodeError",
    "create",
    "decode_tensors",
    "encode_tensors",
    "names",
    "register",
]
