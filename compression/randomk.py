"""Random-k sparsification: keep k uniformly chosen entries of each layer."""

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
    sparse_part_sizes,
)


@register("randomk")
class RandomKCompressor(SparseCompressor):
    """Keeps ``k = ceil(ratio * numel)`` entries drawn uniformly without replacement.

    ``unbiased=True`` scales kept values by numel / k so the estimate is
    unbiased (at a large variance); the default sends them unscaled, the
    better partner for error feedback. Indices come from a numpy PCG64 stream
    seeded by ``seed`` (give each worker its own), so runs are reproducible and
    the sender's choice does not depend on the torch build. The indices travel
    with the values: a receiver never has to replay the generator.
    """

    codec_id = 4
    budget_knob = "ratio"

    def __init__(
        self,
        ratio: float = 0.01,
        seed: int = 0,
        unbiased: bool = False,
        value_dtype: str = "float32",
    ) -> None:
        super().__init__(value_dtype)
        self.ratio = check_ratio(ratio)
        self.seed = int(seed)
        self.scaled = bool(unbiased)
        self._rng = np.random.default_rng(self.seed)

    @property
    def unbiased(self) -> bool:
        return self.scaled

    def params(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "seed": self.seed, "unbiased": self.scaled, **super().params()}

    def reset(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    def k_for(self, numel: int, ctx: LayerContext | None = None) -> int:
        ratio = ctx.ratio if ctx is not None and ctx.ratio is not None else self.ratio
        return keep_count(numel, check_ratio(ratio, "ctx.ratio"))

    def select(self, flat: np.ndarray, ctx: LayerContext) -> np.ndarray:
        indices = self._rng.choice(flat.size, size=self.k_for(flat.size, ctx), replace=False)
        indices.sort()
        return indices.astype(np.int64, copy=False)

    def value_scale(self, numel: int, kept: int) -> float:
        return numel / kept if self.scaled else 1.0

    def error_bound(self, tensor: torch.Tensor, ctx: LayerContext | None = None) -> float:
        numel = tensor.numel()
        scale = self.value_scale(numel, self.k_for(numel, ctx))
        norm = float(torch.linalg.vector_norm(tensor.double()))
        # Dropped entries contribute -x_i, kept ones (scale - 1) x_i.
        return max(1.0, scale - 1.0) * norm + rounding_bound(tensor * scale, self.value_dtype)

    def part_sizes(self, shape: Sequence[int], ctx: LayerContext | None = None) -> tuple[int, ...]:
        numel = math.prod(shape)
        return sparse_part_sizes(numel, self.k_for(numel, ctx), self.value_dtype)
