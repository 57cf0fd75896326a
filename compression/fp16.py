"""Half-precision codec: values rounded to fp16 (saturating), 2x smaller than fp32."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from edgestream.compression.base import Compressor, LayerContext, expect_numel, expect_parts
from edgestream.compression.registry import register

FP16_MAX = 65504.0
# Relative rounding error of fp16 (half an ulp, 10-bit mantissa) and the absolute
# error floor in its subnormal range.
FP16_REL_ERR = 2.0**-11
FP16_ABS_ERR = 2.0**-25


def fp16_error_bound(values: torch.Tensor) -> float:
    """Bound on ``||fp16_saturate(values) - values||_2`` for fp32 input."""
    flat = values.detach().reshape(-1).double()
    excess = (flat.abs() - FP16_MAX).clamp(min=0.0)
    return (
        float(torch.linalg.vector_norm(flat)) * FP16_REL_ERR
        + math.sqrt(flat.numel()) * FP16_ABS_ERR
        + float(torch.linalg.vector_norm(excess))
    )


def to_fp16_saturating(values: torch.Tensor) -> torch.Tensor:
    """fp16 copy of ``values``; magnitudes beyond fp16 range saturate instead of becoming inf.

    Saturating keeps the message finite; with error feedback the clipped excess
    stays in the residual and is sent later.
    """
    return values.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


@register("fp16")
class Fp16Compressor(Compressor):
    """Rounds to fp16. Error per element <= 2^-11 relative (+ subnormal floor, + saturation excess)."""

    codec_id = 2

    def _compress(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: LayerContext
    ) -> Sequence[torch.Tensor]:
        return (to_fp16_saturating(flat),)

    def _decompress(self, parts: Sequence[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        expect_parts(parts, (torch.float16,))
        expect_numel(parts[0], math.prod(shape), "values")
        return parts[0].to(torch.float32)

    def error_bound(self, tensor: torch.Tensor, ctx: LayerContext | None = None) -> float:
        return fp16_error_bound(tensor)

    def part_sizes(self, shape: Sequence[int], ctx: LayerContext | None = None) -> tuple[int, ...]:
        return (2 * math.prod(shape),)
