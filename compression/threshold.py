"""Threshold sparsification: keep every entry whose magnitude reaches a fixed threshold."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from edgestream.compression.base import LayerContext
from edgestream.compression.errors import CompressorConfigError
from edgestream.compression.registry import register
from edgestream.compression.sparse import SparseCompressor, rounding_bound, sparse_part_sizes


@register("threshold")
class ThresholdCompressor(SparseCompressor):
    """Keeps entries with ``|x| >= threshold``; the message size depends on the values.

    Cheap (one pass, no selection) but the byte count is not controlled: a
    layer whose entries all pass costs more than dense. Use top-k or the byte
    budget controller where the size must be bounded.
    """

    codec_id = 5

    def __init__(self, threshold: float = 1e-3, value_dtype: str = "float32") -> None:
        super().__init__(value_dtype)
        threshold = float(threshold)
        if not (math.isfinite(threshold) and threshold > 0.0):
            raise CompressorConfigError(
                f"threshold must be a positive finite number, got {threshold}"
            )
        self.threshold = threshold

    def params(self) -> dict[str, Any]:
        return {"threshold": self.threshold, **super().params()}

    def select(self, flat: np.ndarray, ctx: LayerContext) -> np.ndarray:
        return np.flatnonzero(np.abs(flat) >= self.threshold).astype(np.int64, copy=False)

    def error_bound(self, tensor: torch.Tensor, ctx: LayerContext | None = None) -> float:
        dropped = int((tensor.detach().float().abs() < self.threshold).sum())
        return self.threshold * math.sqrt(dropped) + rounding_bound(tensor, self.value_dtype)

    def part_sizes(self, shape: Sequence[int], ctx: LayerContext | None = None) -> None:
        return None

    def part_sizes_for(
        self, tensor: torch.Tensor, ctx: LayerContext | None = None
    ) -> tuple[int, ...]:
        kept = int((tensor.detach().float().abs() >= self.threshold).sum())
        return sparse_part_sizes(tensor.numel(), kept, self.value_dtype)
