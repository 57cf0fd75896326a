"""Lossless sparse codec: keep every entry that is not +0.0, in the shared sparse payload.

For tensors that are already sparse (a strategy that chose its own entries per link and
keeps its own residuals, e.g. DLion): no selection, no loss, no size knob. The payload is
``compression.sparse``'s (per-65536-block int32 counts, uint16 offsets, float32 values),
so it costs ``4 * ceil(n / 65536) + 6 * nnz`` bytes: smaller than dense below ~2/3
density, larger above.

``-0.0``: entries are selected on their bit pattern (``bits != 0``), so a negative zero
is kept and comes back as ``-0.0``; only ``+0.0`` entries are dropped (they decode to
``+0.0``). Hence ``decode(encode(t))`` equals ``t`` bit for bit for float32 (and
float16 / bfloat16) input; float64 is rounded to float32 first, as by ``dense``. An
all-zero tensor keeps nothing: its payload holds only the zero block counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from edgestream.compression import errors
from edgestream.compression.base import LayerContext
from edgestream.compression.errors import PayloadDecodeError
from edgestream.compression.registry import register
from edgestream.compression.sparse import SparseCompressor, decode_sparse, sparse_part_sizes


def nonzero_indices(flat: np.ndarray) -> np.ndarray:
    """Sorted int64 indices of the entries of a float32 array whose bits are not +0.0."""
    return np.flatnonzero(flat.view(np.int32)).astype(np.int64, copy=False)


@register("nonzero")
class NonzeroCompressor(SparseCompressor):
    """Keeps exactly the non-(+0.0) entries, as float32: lossless, no ``budget_knob``.

    Deterministic; decoding accepts only float32 values (a lossless payload never holds
    narrower ones) and rejects what the shared sparse decoder rejects (bad block counts,
    indices out of order or out of range) with ``PayloadDecodeError``.
    """

    codec_id = 10
    budget_knob = None

    def __init__(self) -> None:
        super().__init__("float32")

    def params(self) -> dict[str, object]:
        return {}

    def select(self, flat: np.ndarray, ctx: LayerContext) -> np.ndarray:
        return nonzero_indices(flat)

    def _decompress(self, parts: Sequence[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        if len(parts) == 3 and parts[2].dtype != torch.float32:
            raise PayloadDecodeError(
                errors.DTYPE, f"nonzero values are {parts[2].dtype}, want torch.float32"
            )
        return decode_sparse(parts, shape)

    def error_bound(self, tensor: torch.Tensor, ctx: LayerContext | None = None) -> float:
        if tensor.dtype in (torch.float32, torch.float16, torch.bfloat16):
            return 0.0
        # Wider inputs lose their low bits in the fp32 cast: half an ulp relative.
        return float(torch.linalg.vector_norm(tensor.double())) * 2.0**-24

    def part_sizes(self, shape: Sequence[int], ctx: LayerContext | None = None) -> None:
        return None

    def part_sizes_for(
        self, tensor: torch.Tensor, ctx: LayerContext | None = None
    ) -> tuple[int, ...]:
        flat = tensor.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous()
        kept = int(np.count_nonzero(flat.numpy().view(np.int32)))
        return sparse_part_sizes(math.prod(tensor.shape), kept, torch.float32)
