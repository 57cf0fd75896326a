"""Composition of compressor and memory into bytes for a gradient message, and the way back."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from edgestream.compression import errors, registry, wire
from edgestream.compression.base import Compressor, LayerContext
from edgestream.compression.dense import DenseCompressor
from edgestream.compression.errors import (
    CompressionError,
    CompressorConfigError,
    PayloadDecodeError,
)
from edgestream.compression.memory import ErrorFeedback, Memory, NoMemory
from edgestream.compression.wire import Compressed

__all__ = [
    "CompressionConfig",
    "EncodeStats",
    "GradientCodec",
    "decode_tensors",
    "encode_tensors",
]


@dataclass(frozen=True)
class EncodeStats:
    """What one ``GradientCodec.encode`` produced, for metrics and for the ScaDLES signal."""

    compressed: bool
    codec: str
    dense_bytes: int
    wire_bytes: int
    grad_norm_sum: float
    compensated_norm_sum: float
    sent_norm_sum: float

    @property
    def ratio(self) -> float:
        """Dense fp32 bytes over wire bytes (framing included)."""
        return self.dense_bytes / self.wire_bytes if self.wire_bytes else 0.0


def encode_tensors(
    named: Mapping[str, torch.Tensor],
    compressor: Compressor | None = None,
    contexts: Mapping[str, LayerContext] | None = None,
) -> bytes:
    """Compress each tensor with ``compressor`` (dense fp32 by default) into one message.

    No error feedback here; use ``GradientCodec`` for gradients. Also the
    format for checkpoints of memories and model snapshots (dense).
    """
    codec = compressor if compressor is not None else DenseCompressor()
    layers: dict[str, Compressed] = {}
    for name, tensor in named.items():
        try:
            layers[name] = codec.compress(tensor, _context(name, contexts))
        except CompressionError as err:
            raise err.with_layer(name) from None
    return wire.encode_layers(layers)


def decode_tensors(
    data: bytes | bytearray | memoryview,
    expected: Mapping[str, Sequence[int]] | None = None,
    *,
    max_bytes: int = wire.DEFAULT_MAX_BYTES,
    max_numel: int | None = None,
    allowed_codecs: Collection[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Decode a message from any registered codec into dense tensors.

    Raises ``PayloadDecodeError`` (with ``reason`` and ``layer``) for anything
    malformed; nothing is returned unless every layer decoded. With
    ``expected``, names and shapes must match exactly and the allocation bound
    is their total size; otherwise ``max_numel`` (default
    ``wire.DEFAULT_MAX_NUMEL``) bounds the total dense elements.
    """
    if max_numel is None:
        max_numel = (
            sum(math.prod(shape) for shape in expected.values())
            if expected is not None
            else wire.DEFAULT_MAX_NUMEL
        )
    layers = wire.decode_layers(data, expected, max_bytes=max_bytes, max_numel=max_numel)
    out: dict[str, torch.Tensor] = {}
    for name, comp in layers.items():
        try:
            decoder = registry.decoder_for(comp.codec_id)
            if allowed_codecs is not None and decoder.name not in allowed_codecs:
                raise PayloadDecodeError(
                    errors.CODEC_NOT_ALLOWED, f"codec {decoder.name!r} is not accepted here"
                )
            out[name] = decoder.decompress(comp)
        except CompressionError as err:
            raise err.with_layer(name) from None
    return out


def _context(name: str, contexts: Mapping[str, LayerContext] | None) -> LayerContext:
    ctx = contexts.get(name) if contexts is not None else None
    return LayerContext(name=name) if ctx is None else dataclasses.replace(ctx, name=name)


def _norm(tensor: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(tensor.detach().float()))


class GradientCodec:
    """One gradient link: compensate -> compress -> update memory -> bytes; and bytes -> tensors.

    Invariant: the memory learns exactly the tensors a receiver decodes from the
    returned bytes, and only once those bytes exist: if any layer fails
    (non-finite, bad shape), ``encode`` raises and no residual changes.

    ``compress=False`` sends the compensated gradient dense (ScaDLES's dense
    steps), which also flushes the residual. Keep one codec per outgoing link;
    receiving needs no state, so one codec (or ``decode_tensors``) serves all
    incoming links.
    """

    def __init__(
        self,
        compressor: Compressor,
        memory: Memory | None = None,
        *,
        allowed_codecs: Collection[str] | None = None,
        max_bytes: int = wire.DEFAULT_MAX_BYTES,
        max_numel: int = wire.DEFAULT_MAX_NUMEL,
    ) -> None:
        self.compressor = compressor
        self.memory: Memory = memory if memory is not None else NoMemory()
        self.dense: Compressor = DenseCompressor()
        self.allowed_codecs = None if allowed_codecs is None else frozenset(allowed_codecs)
        self.max_bytes = max_bytes
        self.max_numel = max_numel

    def encode(
        self,
        grads: Mapping[str, torch.Tensor],
        *,
        compress: bool = True,
        contexts: Mapping[str, LayerContext] | None = None,
    ) -> bytes:
        """Bytes for one step's gradients (see ``encode_with_stats``)."""
        return self.encode_with_stats(grads, compress=compress, contexts=contexts)[0]

    def encode_with_stats(
        self,
        grads: Mapping[str, torch.Tensor],
        *,
        compress: bool = True,
        contexts: Mapping[str, LayerContext] | None = None,
    ) -> tuple[bytes, EncodeStats]:
        """Encode one step's named gradients and report sizes and norms.

        ``contexts`` optionally overrides density / rank per layer (from a controller).
        """
        codec = self.compressor if compress else self.dense
        layers: dict[str, Compressed] = {}
        pending: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        grad_norm_sum = compensated_norm_sum = sent_norm_sum = 0.0
        dense_bytes = 0
        for name, grad in grads.items():
            try:
                # Step 1. Add what this link still owes for the layer (pure: no state yet).
                compensated = self.memory.compensate(name, grad)
                # Step 2. Compress; this also rejects empty, non-float and non-finite input.
                comp = codec.compress(compensated, _context(name, contexts))
                # Step 3. Decode locally: the residual must be against what the receiver sees.
                sent = codec.decompress(comp)
            except CompressionError as err:
                raise err.with_layer(name) from None
            layers[name] = comp
            pending.append((name, compensated, sent))
            grad_norm_sum += _norm(grad)
            compensated_norm_sum += _norm(compensated)
            sent_norm_sum += _norm(sent)
            dense_bytes += 4 * grad.numel()
        # Step 4. Frame the message; it may still refuse (e.g. too many layers).
        data = wire.encode_layers(layers)
        # Step 5. Only now commit the residuals.
        for name, compensated, sent in pending:
            self.memory.update(name, compensated, sent)
        stats = EncodeStats(
            compressed=compress,
            codec=codec.name,
            dense_bytes=dense_bytes,
            wire_bytes=len(data),
            grad_norm_sum=grad_norm_sum,
            compensated_norm_sum=compensated_norm_sum,
            sent_norm_sum=sent_norm_sum,
        )
        return data, stats

    def decode(
        self,
        data: bytes | bytearray | memoryview,
        expected_shapes: Mapping[str, Sequence[int]] | None = None,
        *,
        max_bytes: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Decode a gradient message from any accepted codec (see ``decode_tensors``)."""
        return decode_tensors(
            data,
            expected_shapes,
            max_bytes=self.max_bytes if max_bytes is None else max_bytes,
            max_numel=None if expected_shapes is not None else self.max_numel,
            allowed_codecs=self.allowed_codecs,
        )

    def predicted_nbytes(
        self,
        shapes: Mapping[str, Sequence[int]],
        contexts: Mapping[str, LayerContext] | None = None,
    ) -> int | None:
        """Exact message length for layers of these shapes, or None if the codec's size depends on values."""
        total = wire.MESSAGE_HEADER_SIZE
        for name, shape in shapes.items():
            frame = self.compressor.frame_nbytes(name, shape, _context(name, contexts))
            if frame is None:
                return None
            total += frame
        return total

    def reset(self) -> None:
        """Forget residuals and compressor state (after the model is replaced)."""
        self.memory.reset()
        self.compressor.reset()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Residuals and compressor state under ``memory/`` and ``compressor/`` prefixes."""
        state = {f"memory/{k}": v for k, v in self.memory.state_dict().items()}
        state.update({f"compressor/{k}": v for k, v in self.compressor.state_dict().items()})
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore what ``state_dict`` returned."""
        self.memory.load_state_dict({k[7:]: v for k, v in state.items() if k.startswith("memory/")})
        self.compressor.load_state_dict(
            {k[11:]: v for k, v in state.items() if k.startswith("compressor/")}
        )


@dataclass(frozen=True)
class CompressionConfig:
    """Typed job configuration of gradient compression (a TOML table, e.g. ``[compression]``).

    ``compressor`` is a registry name, ``params`` its keyword arguments, and
    ``error_feedback`` adds an ``ErrorFeedback`` memory.
    """

    compressor: str = "dense"
    params: Mapping[str, Any] = field(default_factory=dict)
    error_feedback: bool = True
    max_bytes: int = wire.DEFAULT_MAX_BYTES

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> CompressionConfig:
        """Build from a parsed TOML / JSON table; unknown keys are an error, not ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise CompressorConfigError(
                f"unknown compression config keys {unknown}; known: {sorted(known)}"
            )
        config = cls(**dict(raw))
        if not isinstance(config.params, Mapping):
            raise CompressorConfigError("compression params must be a table")
        registry.compressor_class(config.compressor)
        return config

    def build(self) -> GradientCodec:
        """A codec for one outgoing link (each link needs its own: residuals are per link)."""
        memory: Memory = ErrorFeedback() if self.error_feedback else NoMemory()
        compressor = registry.create(self.compressor, **dict(self.params))
        return GradientCodec(compressor, memory, max_bytes=self.max_bytes)
