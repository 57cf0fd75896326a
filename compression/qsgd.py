"""QSGD: unbiased stochastic quantisation to s levels per bucket of a layer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from edgestream.compression import errors
from edgestream.compression.base import Compressor, LayerContext, expect_numel, expect_parts
from edgestream.compression.blockwise import scale_per_block
from edgestream.compression.errors import (
    CompressionError,
    CompressorConfigError,
    PayloadDecodeError,
)
from edgestream.compression.registry import register

MAX_LEVELS = 127
MAX_BUCKET = 1 << 20
_FP32_MAX = float(np.finfo(np.float32).max)


def code_bits(levels: int) -> int:
    """Bits per element for codes in [0, 2 * levels]: 2, 4 or 8 (whole elements per byte)."""
    span = 2 * levels + 1
    return 2 if span <= 4 else 4 if span <= 16 else 8


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint8 codes < 2**bits, lowest element in the lowest bits."""
    if bits == 8:
        return codes
    per_byte = 8 // bits
    padded = np.zeros(-(-codes.size // per_byte) * per_byte, dtype=np.uint8)
    padded[: codes.size] = codes
    lanes = padded.reshape(-1, per_byte)
    packed = lanes[:, 0].copy()
    for lane in range(1, per_byte):
        packed |= lanes[:, lane] << np.uint8(lane * bits)
    return packed


def unpack_codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of ``pack_codes``; returns ``count`` codes."""
    if bits == 8:
        return packed[:count]
    per_byte = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    lanes = np.empty((packed.size, per_byte), dtype=np.uint8)
    for lane in range(per_byte):
        lanes[:, lane] = (packed >> np.uint8(lane * bits)) & mask
    return lanes.reshape(-1)[:count]


def bucket_norms(flat: np.ndarray, bucket_size: int) -> np.ndarray:
    """L2 norm of each bucket of ``bucket_size`` consecutive elements (last may be short).

    float32 unless a sum of squares overflows, then recomputed in float64
    (the caller decides whether the norm itself still fits in fp32).
    """
    full = flat.size // bucket_size
    norms = _sum_squares(flat, full, bucket_size)
    if not bool(np.isfinite(norms).all()):
        norms = _sum_squares(flat.astype(np.float64), full, bucket_size)
    return np.sqrt(norms)


def _sum_squares(flat: np.ndarray, full: int, bucket_size: int) -> np.ndarray:
    head = flat[: full * bucket_size].reshape(full, bucket_size)
    with np.errstate(over="ignore"):
        sums = np.einsum("ij,ij->i", head, head)
        if full * bucket_size < flat.size:
            tail = flat[full * bucket_size :]
            sums = np.append(sums, tail @ tail)
    return sums


@register("qsgd")
class QSGDCompressor(Compressor):
    """QSGD (Alistarh et al.): per bucket, ``x_i -> ||x_b|| * sign(x_i) * l_i / s`` with random ``l_i``.

    ``l_i = floor(s |x_i| / ||x_b|| + u)``, ``u ~ U[0, 1)``, so E[l_i / s] =
    |x_i| / ||x_b||: unbiased, each element off by less than ``||x_b|| / s``.
    Codes ``sign * l + s`` in [0, 2s] are bit-packed (2 bits for s = 1, 4 for
    s <= 7, else 8), plus one fp32 norm per bucket. Randomness comes from a
    numpy PCG64 stream seeded by ``seed`` (one seed per worker).
    """

    codec_id = 6

    def __init__(self, levels: int = 7, bucket_size: int = 512, seed: int = 0) -> None:
        self.levels = int(levels)
        self.bucket_size = int(bucket_size)
        self.seed = int(seed)
        if not 1 <= self.levels <= MAX_LEVELS:
            raise CompressorConfigError(f"levels must be in 1..{MAX_LEVELS}, got {levels}")
        if not 1 <= self.bucket_size <= MAX_BUCKET:
            raise CompressorConfigError(
                f"bucket_size must be in 1..{MAX_BUCKET}, got {bucket_size}"
            )
        self.bits = code_bits(self.levels)
        self._rng = np.random.default_rng(self.seed)

    @property
    def unbiased(self) -> bool:
        return True

    def params(self) -> dict[str, Any]:
        return {"levels": self.levels, "bucket_size": self.bucket_size, "seed": self.seed}

    def reset(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    def _compress(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: LayerContext
    ) -> Sequence[torch.Tensor]:
        x = flat.numpy()
        norms = bucket_norms(x, self.bucket_size)
        if float(norms.max(initial=0.0)) > _FP32_MAX:
            raise CompressionError(
                errors.NON_FINITE, "a bucket norm overflows fp32", layer=ctx.name or None
            )
        norms32 = norms.astype(np.float32)
        inv = np.zeros_like(norms32)
        np.divide(np.float32(self.levels), norms32, out=inv, where=norms32 > 0)
        scaled = scale_per_block(np.abs(x), inv, self.bucket_size)
        scaled += self._rng.random(x.size, dtype=np.float32)
        # In place from here on: this codec is bound by passes over memory.
        np.floor(scaled, out=scaled)
        # |x_i| <= ||x_b||, but rounding may nudge a level to s + 1.
        np.minimum(scaled, np.float32(self.levels), out=scaled)
        np.copysign(scaled, x, out=scaled)
        scaled += np.float32(self.levels)
        codes = scaled.astype(np.uint8)
        meta = torch.tensor([self.levels, self.bucket_size], dtype=torch.int32)
        return meta, torch.from_numpy(norms32), torch.from_numpy(pack_codes(codes, self.bits))

    def _decompress(self, parts: Sequence[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        expect_parts(parts, (torch.int32, torch.float32, torch.uint8))
        meta, norms, packed = parts
        expect_numel(meta, 2, "qsgd header")
        levels, bucket_size = (int(v) for v in meta.tolist())
        if not 1 <= levels <= MAX_LEVELS or not 1 <= bucket_size <= MAX_BUCKET:
            raise PayloadDecodeError(
                errors.VALUE_OUT_OF_RANGE, f"levels={levels} bucket_size={bucket_size}"
            )
        numel = math.prod(shape)
        bits = code_bits(levels)
        expect_numel(norms, -(-numel // bucket_size), "bucket norms")
        expect_numel(packed, -(-numel * bits // 8), "packed codes")
        norm_arr = norms.numpy()
        if bool((norm_arr < 0).any()):
            raise PayloadDecodeError(errors.VALUE_OUT_OF_RANGE, "negative bucket norm")
        codes = unpack_codes(packed.numpy(), bits, numel)
        if bool((codes > 2 * levels).any()):
            raise PayloadDecodeError(
                errors.VALUE_OUT_OF_RANGE, f"code above 2 * levels = {2 * levels}"
            )
        signed = codes.astype(np.float32) - np.float32(levels)
        return torch.from_numpy(scale_per_block(signed, norm_arr / np.float32(levels), bucket_size))

    def error_bound(self, tensor: torch.Tensor, ctx: LayerContext | None = None) -> float:
        flat = tensor.detach().reshape(-1).float().numpy()
        norms = bucket_norms(flat, self.bucket_size)
        sizes = np.full(norms.size, self.bucket_size, dtype=np.float64)
        sizes[-1] = flat.size - self.bucket_size * (norms.size - 1)
        # Each element is off by less than its bucket norm / s; small slack for fp32.
        return float(np.sqrt((sizes * norms**2).sum())) / self.levels * (1 + 1e-5)

    def part_sizes(self, shape: Sequence[int], ctx: LayerContext | None = None) -> tuple[int, ...]:
        numel = math.prod(shape)
        return (8, 4 * -(-numel // self.bucket_size), -(-numel * self.bits // 8))
