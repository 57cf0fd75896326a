"""The dense fp32 reference codec: sends every value unchanged."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from edgestream.compression.base import Compressor, LayerContext, expect_numel, expect_parts
from edgestream.compression.registry import register


@register("dense")
class DenseCompressor(Compressor):
    """Lossless for fp32 gradients (fp64 is rounded to fp32); the baseline every ratio is quoted against."""

    codec_id = 1

    def _compress(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: LayerContext
    ) -> Sequence[torch.Tensor]:
        # Copy: ``flat`` may alias the caller's gradient, which optimisers reuse in place.
        return (flat.clone(),)

    def _decompress(self, parts: Sequence[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        expect_parts(parts, (torch.float32,))
        expect_numel(parts[0], math.prod(shape), "values")
        return parts[0]

    def error_bound(self, tensor: torch.Tensor, ctx: LayerContext | None = None) -> float:
        if tensor.dtype in (torch.float32, torch.float16, torch.bfloat16):
            return 0.0
        # Wider inputs lose their low bits in the fp32 cast: half an ulp relative.
        return float(torch.linalg.vector_norm(tensor.double())) * 2.0**-24

    def part_sizes(self, shape: Sequence[int], ctx: LayerContext | None = None) -> tuple[int, ...]:
        return (4 * math.prod(shape),)
