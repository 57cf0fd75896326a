"""Top-k sparsification: keep the k largest-magnitude entries of each layer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from edgestream.compression.base import LayerContext
from edgestream.compression.registry import register
from edgestream.compression.sparse import (
    SparseCompressor,
    check_ratio,
    keep_count,
    rounding_bound,
    select_topk,
    sparse_part_sizes,
)


@register("topk")
class TopKCompressor(SparseCompressor):
    """Keeps ``k = ceil(ratio * numel)`` largest-magnitude entries per layer (``ctx.ratio`` overrides).

    Biased; pair it with ``ErrorFeedback`` so dropped mass is sent later.
    Deterministic: equal inputs give equal bytes.
    """

    codec_id = 3
    budget_knob = "ratio"

    def __init__(self, ratio: float = 0.01, value_dtype: str = "float32") -> None:
        super().__init__(value_dtype)
        self.ratio = check_ratio(ratio)

    def params(self) -> dict[str, Any]:
        return {"ratio": self.ratio, **super().params()}

    def k_for(self, numel: int, ctx: LayerContext | None = None) -> int:
        ratio = ctx.ratio if ctx is not None and ctx.ratio is not None else self.ratio
        return keep_count(numel, check_ratio(ratio, "ctx.ratio"))

    def select(self, flat: np.ndarray, ctx: LayerContext) -> np.ndarray:
        return select_topk(np.abs(flat), self.k_for(flat.size, ctx))

    def error_bound(self, tensor: torch.Tensor, ctx: LayerContext | None = None) -> float:
        numel = tensor.numel()
        kept = self.k_for(numel, ctx)
        # The dropped entries are the numel - k smallest, so their energy is at
        # most (numel - k) / numel of the total.
        drop = math.sqrt(max(0.0, 1.0 - kept / numel)) * float(
            torch.linalg.vector_norm(tensor.double())
        )
        return drop + rounding_bound(tensor, self.value_dtype)

    def part_sizes(self, shape: Sequence[int], ctx: LayerContext | None = None) -> tuple[int, ...]:
        numel = math.prod(shape)
        return sparse_part_sizes(numel, self.k_for(numel, ctx), self.value_dtype)
