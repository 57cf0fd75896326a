"""Shared sparse (index, value) encoding and fast exact top-k selection for the sparsifying codecs.

Sparse payload, three parts:

* ``block_counts`` int32 [ceil(numel / 65536)]: how many kept indices fall in
  each 65536-element block;
* ``low`` uint16 [k]: each kept index modulo 65536, in strictly increasing
  order of the full index;
* ``values`` float32 | float16 | bfloat16 [k].

Splitting indices into a per-block count and a 16-bit offset costs 2 bytes per
kept element instead of 4 (int32) or 8 (torch's int64), for 4 bytes per 65536
elements of overhead: top-k at 1 % with fp32 values is ~66x smaller than dense.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from edgestream.compression import errors
from edgestream.compression.base import Compressor, LayerContext, expect_numel
from edgestream.compression.errors import CompressorConfigError, PayloadDecodeError
from edgestream.compression.fp16 import fp16_error_bound, to_fp16_saturating

BLOCK_BITS = 16
BLOCK = 1 << BLOCK_BITS
VALUE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
# Sampling only pays off on large tensors; below this, partition the whole tensor.
_SAMPLE_SIZE = 16384
_MIN_SAMPLED_NUMEL = 4 * _SAMPLE_SIZE


def num_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def sparse_part_sizes(numel: int, k: int, value_dtype: torch.dtype) -> tuple[int, int, int]:
    """Byte sizes of the three sparse parts for ``k`` kept elements."""
    itemsize = torch.empty(0, dtype=value_dtype).element_size()
    return (4 * num_blocks(numel), 2 * k, itemsize * k)


def keep_count(numel: int, ratio: float) -> int:
    """Elements kept at density ``ratio``: ceil, at least one, at most all."""
    # The epsilon stops 0.01 * 100 = 1.0000000000000002 from rounding up to 2.
    return min(numel, max(1, math.ceil(ratio * numel - 1e-9)))


def check_ratio(ratio: float, what: str = "ratio") -> float:
    ratio = float(ratio)
    if not 0.0 < ratio <= 1.0:
        raise CompressorConfigError(f"{what} must be in (0, 1], got {ratio}")
    return ratio


def value_dtype_of(name: str) -> torch.dtype:
    try:
        return VALUE_DTYPES[name]
    except KeyError:
        raise CompressorConfigError(
            f"value_dtype must be one of {sorted(VALUE_DTYPES)}, got {name!r}"
        ) from None


def cast_values(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast kept values for the wire, saturating instead of overflowing to inf."""
    if dtype == torch.float16:
        return to_fp16_saturating(values)
    if dtype == torch.bfloat16:
        return values.clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16)
    return values


def rounding_bound(values: torch.Tensor, dtype: torch.dtype) -> float:
    """Bound on the L2 error of ``cast_values(values, dtype)``."""
    if dtype == torch.float32:
        return 0.0
    if dtype == torch.float16:
        return fp16_error_bound(values)
    flat = values.detach().reshape(-1).double()
    excess = (flat.abs() - BF16_MAX).clamp(min=0.0)
    return (
        float(torch.linalg.vector_norm(flat)) * 2.0**-8
        + math.sqrt(flat.numel()) * 2.0**-134
        + float(torch.linalg.vector_norm(excess))
    )


def select_topk(magnitude: np.ndarray, k: int) -> np.ndarray:
    """Sorted int64 indices of ``k`` largest entries of ``magnitude`` (ties broken arbitrarily).

    Exact. On large tensors a strided sample gives a threshold expected to
    admit about 2k candidates; whenever at least k pass it, every true top-k
    entry is among them (the k-th largest value is >= the threshold), so a
    partition of the candidates finishes the job. An unlucky sample falls back
    to partitioning the whole tensor. Several times faster than ``torch.topk``
    on one CPU thread.
    """
    numel = magnitude.size
    if k >= numel:
        return np.arange(numel, dtype=np.int64)
    if numel >= _MIN_SAMPLED_NUMEL and 8 * k <= numel:
        sample = magnitude[:: numel // _SAMPLE_SIZE]
        sample_len = sample.size
        wanted = min(sample_len, int(2 * k * sample_len / numel) + 16)
        threshold = np.partition(sample, sample_len - wanted)[sample_len - wanted]
        candidates = np.flatnonzero(magnitude >= threshold)
        if candidates.size >= k:
            if candidates.size > k:
                keep = np.argpartition(magnitude[candidates], candidates.size - k)[
                    candidates.size - k :
                ]
                keep.sort()  # candidates are ascending, so sorted positions keep indices sorted
                candidates = candidates[keep]
            return candidates.astype(np.int64, copy=False)
    idx = np.argpartition(magnitude, numel - k)[numel - k :]
    idx.sort()
    return idx.astype(np.int64, copy=False)


def encode_sparse(
    indices: np.ndarray, values: torch.Tensor, numel: int, value_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Parts for strictly increasing int64 ``indices`` and their float32 ``values``."""
    counts = np.bincount(indices >> BLOCK_BITS, minlength=num_blocks(numel)).astype(np.int32)
    low = (indices & (BLOCK - 1)).astype(np.uint16)
    return torch.from_numpy(counts), torch.from_numpy(low), cast_values(values, value_dtype)


def decode_sparse(parts: Sequence[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """Dense float32 vector from sparse parts; rejects bad counts, ranges and orders."""
    if len(parts) != 3:
        raise PayloadDecodeError(
            errors.LENGTH_MISMATCH, f"sparse payload needs 3 parts, got {len(parts)}"
        )
    counts, low, values = parts
    if (
        counts.dtype != torch.int32
        or low.dtype != torch.uint16
        or values.dtype not in VALUE_DTYPES.values()
    ):
        raise PayloadDecodeError(
            errors.DTYPE,
            f"sparse parts are {counts.dtype}/{low.dtype}/{values.dtype}, want int32/uint16/float",
        )
    numel = math.prod(shape)
    nblocks = num_blocks(numel)
    expect_numel(counts, nblocks, "block counts")
    kept = low.numel()
    expect_numel(values, kept, "values")
    if kept > numel:
        raise PayloadDecodeError(
            errors.LENGTH_MISMATCH, f"{kept} kept elements in a tensor of {numel}"
        )
    count_arr = counts.numpy()
    if bool((count_arr < 0).any()):
        raise PayloadDecodeError(errors.LENGTH_MISMATCH, "negative block count")
    # Checked before np.repeat so hostile counts cannot size an allocation.
    if int(count_arr.sum(dtype=np.int64)) != kept:
        raise PayloadDecodeError(
            errors.LENGTH_MISMATCH, f"block counts sum to {count_arr.sum()}, {kept} indices sent"
        )
    out = np.zeros(numel, dtype=np.float32)
    if kept:
        bases = np.repeat(np.arange(nblocks, dtype=np.int64) << BLOCK_BITS, count_arr)
        indices = bases + low.numpy().astype(np.int64)
        if kept > 1 and not bool((indices[1:] > indices[:-1]).all()):
            raise PayloadDecodeError(errors.INDEX_ORDER, "indices are not strictly increasing")
        if indices[-1] >= numel:
            raise PayloadDecodeError(
                errors.INDEX_OUT_OF_RANGE, f"index {indices[-1]} >= numel {numel}"
            )
        out[indices] = values.to(torch.float32).numpy()
    return torch.from_numpy(out)


class SparseCompressor(Compressor):
    """Base of codecs that keep a subset of elements (top-k, random-k, threshold).

    Invariant: the kept indices are strictly increasing and the values are the
    input's values at them (times ``value_scale``), cast to ``value_dtype``.
    """

    def __init__(self, value_dtype: str = "float32") -> None:
        self.value_dtype_name = value_dtype
        self.value_dtype = value_dtype_of(value_dtype)

    @abstractmethod
    def select(self, flat: np.ndarray, ctx: LayerContext) -> np.ndarray:
        """Sorted int64 indices to keep from a 1-D float32 array."""

    def value_scale(self, numel: int, kept: int) -> float:
        """Factor applied to kept values (random-k's unbiased mode uses numel / k)."""
        return 1.0

    def params(self) -> dict[str, Any]:
        return {"value_dtype": self.value_dtype_name}

    def _compress(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: LayerContext
    ) -> Sequence[torch.Tensor]:
        arr = flat.numpy()
        indices = self.select(arr, ctx)
        values = torch.from_numpy(arr[indices])
        scale = self.value_scale(arr.size, indices.size)
        if scale != 1.0:
            values = values * scale
        return encode_sparse(indices, values, arr.size, self.value_dtype)

    def _decompress(self, parts: Sequence[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        return decode_sparse(parts, shape)
