"""The Compressor interface: one layer's tensor to compact parts and bytes, and back."""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from edgestream.compression import errors, wire
from edgestream.compression.errors import CompressionError, PayloadDecodeError
from edgestream.compression.wire import Compressed

__all__ = ["Compressed", "Compressor", "LayerContext", "expect_parts"]


@dataclass(frozen=True)
class LayerContext:
    """Per-call information for one layer.

    ``name`` keys per-layer state (PowerSGD warm start). ``ratio`` / ``rank``
    override the compressor's configured density / rank for this call; they are
    how controllers (Accordion, byte budget) steer a compressor, and are ignored
    by compressors without that knob (see ``Compressor.budget_knob``).
    """

    name: str = ""
    ratio: float | None = None
    rank: int | None = None


class Compressor(ABC):
    """Turns one dense float tensor into ``Compressed`` parts and back.

    Invariants every registered compressor keeps (the conformance suite checks
    them): ``decompress`` depends only on the payload, never on instance state,
    so any instance of the class (or the registry's default one) can decode what
    another produced; ``||decompress(compress(x)) - x|| <= error_bound(x)``; the
    parts' byte sizes equal ``part_sizes_for(x)``; ``decompress`` validates
    every part and raises ``PayloadDecodeError`` instead of trusting it.

    Subclasses implement ``_compress`` / ``_decompress`` on 1-D float32 CPU
    tensors; this class handles dtype, device, shape and finiteness checks.
    ``_compress`` receives a tensor that may alias the caller's gradient and must
    not modify it in place.
    """

    name: ClassVar[str] = ""
    codec_id: ClassVar[int] = 0
    # "ratio" (fraction of elements kept) or "rank" if the byte size can be steered.
    budget_knob: ClassVar[str | None] = None

    @property
    def unbiased(self) -> bool:
        """True when E[decompress(compress(x))] == x over the compressor's randomness."""
        return False

    def params(self) -> dict[str, Any]:
        """Constructor parameters, for logs and for recreating the compressor by name."""
        return {}

    # ---- the per-layer contract ------------------------------------------------

    def compress(self, tensor: torch.Tensor, ctx: LayerContext | None = None) -> Compressed:
        """Compress one layer. Raises ``CompressionError`` for empty, non-float or non-finite input."""
        ctx = ctx if ctx is not None else LayerContext()
        flat, shape, dtype = _prepare(tensor, ctx.name)
        parts = self._compress(flat, shape, ctx)
        return Compressed(self.codec_id, shape, dtype, tuple(p.contiguous() for p in parts))

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        """Restore the dense tensor; validates the parts and that the result is finite."""
        if compressed.codec_id != self.codec_id:
            raise PayloadDecodeError(
                errors.CODEC_MISMATCH,
                f"codec id {compressed.codec_id} given to {self.name!r} ({self.codec_id})",
            )
        numel = compressed.numel
        if numel <= 0:
            raise PayloadDecodeError(errors.SHAPE_MISMATCH, f"empty shape {compressed.shape}")
        flat = self._decompress(compressed.parts, compressed.shape)
        if flat.dtype != torch.float32 or flat.numel() != numel:
            raise AssertionError(
                f"{self.name} produced {flat.dtype} x {flat.numel()}, want float32 x {numel}"
            )
        out = flat.reshape(compressed.shape).to(compressed.dtype)
        # Finite parts can still overflow (scale * level, P @ Q^T, a cast to fp16).
        if not _is_finite(out):
            raise PayloadDecodeError(errors.NON_FINITE, "decoded tensor holds NaN or inf")
        return out

    @abstractmethod
    def _compress(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: LayerContext
    ) -> Sequence[torch.Tensor]:
        """Parts for a finite, non-empty, 1-D float32 CPU tensor."""

    @abstractmethod
    def _decompress(self, parts: Sequence[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """A 1-D float32 tensor of ``prod(shape)`` elements; must validate ``parts``."""

    @abstractmethod
    def error_bound(self, tensor: torch.Tensor, ctx: LayerContext | None = None) -> float:
        """Upper bound on ``||decompress(compress(tensor)) - tensor||_2`` for any draw.

        Stated for float32 input; restoring into a narrower dense dtype (fp16,
        bf16) adds that dtype's own rounding.
        """

    @abstractmethod
    def part_sizes(
        self, shape: Sequence[int], ctx: LayerContext | None = None
    ) -> tuple[int, ...] | None:
        """Exact byte size of each part for a layer of ``shape``; None if it depends on values."""

    def part_sizes_for(
        self, tensor: torch.Tensor, ctx: LayerContext | None = None
    ) -> tuple[int, ...]:
        """Exact byte size of each part for this tensor (value-dependent compressors override)."""
        sizes = self.part_sizes(tuple(tensor.shape), ctx)
        if sizes is None:
            raise NotImplementedError(f"{self.name} must override part_sizes_for")
        return sizes

    def payload_nbytes(self, shape: Sequence[int], ctx: LayerContext | None = None) -> int | None:
        """Raw payload bytes of one layer (None if value-dependent)."""
        sizes = self.part_sizes(shape, ctx)
        return None if sizes is None else sum(sizes)

    def nominal_ratio(self, shape: Sequence[int], ctx: LayerContext | None = None) -> float | None:
        """Dense fp32 bytes over payload bytes for this shape (framing excluded)."""
        payload = self.payload_nbytes(shape, ctx)
        return None if payload is None else 4 * math.prod(shape) / payload

    def frame_nbytes(
        self, name: str, shape: Sequence[int], ctx: LayerContext | None = None
    ) -> int | None:
        """Exact wire bytes of this layer's frame, framing included (None if value-dependent)."""
        sizes = self.part_sizes(shape, ctx)
        return None if sizes is None else wire.frame_size(name, len(shape), sizes)

    # ---- state (stateful compressors override) -----------------------------------

    def reset(self) -> None:
        """Forget per-layer state (e.g. after the model is replaced)."""
        return None  # stateless by default

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Per-layer state worth checkpointing; tensors only, so the wire format can store it."""
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore what ``state_dict`` returned."""
        return None  # stateless by default

    # ---- one-layer bytes ---------------------------------------------------------

    def encode(self, name: str, tensor: torch.Tensor, ctx: LayerContext | None = None) -> bytes:
        """One layer as a complete wire message."""
        ctx = LayerContext(name=name) if ctx is None else dataclasses.replace(ctx, name=name)
        try:
            return wire.encode_layers({name: self.compress(tensor, ctx)})
        except CompressionError as err:
            raise err.with_layer(name) from None

    def decode(
        self,
        data: bytes | bytearray | memoryview,
        expected_shape: Sequence[int] | None = None,
        max_numel: int = wire.DEFAULT_MAX_NUMEL,
        max_bytes: int = wire.DEFAULT_MAX_BYTES,
    ) -> torch.Tensor:
        """Decode a one-layer message produced by ``encode`` of this codec.

        ``expected_shape`` also caps the allocation at its own size.
        """
        if expected_shape is not None:
            max_numel = min(max_numel, math.prod(expected_shape))
        layers = wire.decode_layers(data, max_bytes=max_bytes, max_numel=max_numel)
        if len(layers) != 1:
            raise PayloadDecodeError(
                errors.LENGTH_MISMATCH, f"expected one layer, message has {len(layers)}"
            )
        ((name, comp),) = layers.items()
        if expected_shape is not None and comp.shape != tuple(int(d) for d in expected_shape):
            raise PayloadDecodeError(
                errors.SHAPE_MISMATCH,
                f"shape {comp.shape} but expected {tuple(expected_shape)}",
                layer=name,
            )
        try:
            return self.decompress(comp)
        except CompressionError as err:
            raise err.with_layer(name) from None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


def _prepare(tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, tuple[int, ...], torch.dtype]:
    if not isinstance(tensor, torch.Tensor):
        raise CompressionError(
            errors.DTYPE,
            f"expected a torch.Tensor, got {type(tensor).__name__}",
            layer=name or None,
        )
    if tensor.dtype not in wire.FLOAT_DTYPES:
        raise CompressionError(
            errors.DTYPE, f"cannot compress dtype {tensor.dtype}", layer=name or None
        )
    if tensor.numel() == 0:
        raise CompressionError(errors.EMPTY, "cannot compress an empty tensor", layer=name or None)
    if tensor.dim() > wire.MAX_NDIM:
        raise CompressionError(
            errors.SHAPE_MISMATCH, f"{tensor.dim()} dims exceed {wire.MAX_NDIM}", layer=name or None
        )
    flat = tensor.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous()
    if not wire.all_finite(flat.numpy()):
        raise CompressionError(errors.NON_FINITE, "gradient holds NaN or inf", layer=name or None)
    return flat, tuple(int(d) for d in tensor.shape), tensor.dtype


def _is_finite(tensor: torch.Tensor) -> bool:
    flat = tensor.reshape(-1)
    if flat.dtype == torch.bfloat16:
        return wire.all_finite(flat.view(torch.int16).numpy(), bfloat16=True)
    # numpy's checks are several times faster than torch's on one CPU thread.
    return wire.all_finite(flat.numpy())


def expect_parts(parts: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]) -> None:
    """Raise ``PayloadDecodeError`` unless ``parts`` has exactly these dtypes, in order."""
    if len(parts) != len(dtypes):
        raise PayloadDecodeError(
            errors.LENGTH_MISMATCH, f"expected {len(dtypes)} parts, got {len(parts)}"
        )
    for index, (part, dtype) in enumerate(zip(parts, dtypes, strict=True)):
        if part.dtype != dtype:
            raise PayloadDecodeError(
                errors.DTYPE, f"part {index} is {part.dtype}, expected {dtype}"
            )
        if part.dim() != 1:
            raise PayloadDecodeError(errors.SHAPE_MISMATCH, f"part {index} is not 1-D")


def expect_numel(part: torch.Tensor, numel: int, what: str) -> None:
    """Raise ``PayloadDecodeError`` unless ``part`` has exactly ``numel`` elements."""
    if part.numel() != numel:
        raise PayloadDecodeError(
            errors.LENGTH_MISMATCH, f"{what} has {part.numel()} elements, expected {numel}"
        )
