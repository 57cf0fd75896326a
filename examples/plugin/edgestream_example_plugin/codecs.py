"""``example_bf16``: gradients rounded to bfloat16, half the bytes of fp32 with fp32's range."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from edgestream.compression.base import Compressor, LayerContext, expect_numel, expect_parts
from edgestream.compression.registry import register

#: The largest finite bfloat16 (fp32's exponent range, 8 bits of significand).
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
#: Half an ulp, relative (8-bit significand), and an absolute floor for bfloat16's subnormals.
BF16_REL_ERR = 2.0**-8
BF16_ABS_ERR = 2.0**-133


@register("example_bf16")
class BFloat16Compressor(Compressor):
    """Rounds to bfloat16 (saturating at its largest finite value). Error per element
    <= 2^-8 relative, plus the subnormal floor and any saturation excess."""

    #: A wire id of its own: a plugin picks one no other codec uses (the registry refuses a clash).
    codec_id = 0xE0B1

    def _compress(self, flat: torch.Tensor, shape: tuple[int, ...], ctx: LayerContext) -> Sequence[torch.Tensor]:
        return (flat.clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16),)

    def _decompress(self, parts: Sequence[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        expect_parts(parts, (torch.bfloat16,))
        expect_numel(parts[0], math.prod(shape), "values")
        return parts[0].to(torch.float32)

    def error_bound(self, tensor: torch.Tensor, ctx: LayerContext | None = None) -> float:
        flat = tensor.detach().reshape(-1).double()
        excess = (flat.abs() - BF16_MAX).clamp(min=0.0)
        return (float(torch.linalg.vector_norm(flat)) * BF16_REL_ERR + math.sqrt(flat.numel()) * BF16_ABS_ERR
                + float(torch.linalg.vector_norm(excess)))

    def part_sizes(self, shape: Sequence[int], ctx: LayerContext | None = None) -> tuple[int, ...]:
        return (2 * math.prod(shape),)
