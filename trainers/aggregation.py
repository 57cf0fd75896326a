"""The one sample-weighting rule (b_i / sum b) and the linear LR scaling rule (B_t / B_ref),
shared by BSP, ScaDLES, DLion and gossip."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from trainers.errors import AggregationError


def sample_weights(batch_sizes: Sequence[int]) -> list[float]:
    """Weights ``b_i / B`` with ``B = sum(b_i)``; every batch size must be positive."""
    if not batch_sizes:
        raise AggregationError("no batch sizes to weight")
    if any(int(b) <= 0 for b in batch_sizes):
        raise AggregationError(f"batch sizes must be > 0, got {list(batch_sizes)}")
    total = sum(int(b) for b in batch_sizes)
    return [int(b) / total for b in batch_sizes]


def weighted_mean(
    named_tensors_list: Sequence[Mapping[str, torch.Tensor]], batch_sizes: Sequence[int]
) -> dict[str, torch.Tensor]:
    """Sample-weighted mean ``sum_i (b_i / B) * g_i`` of named tensors, in float32.

    Terms are summed in the order given, so callers that need bitwise identical
    results on every replica (BSP) must pass contributions in one agreed order
    (sorted by worker id). Inputs are never modified. All entries must carry the
    same names and shapes.
    """
    if len(named_tensors_list) != len(batch_sizes):
        raise AggregationError(
            f"{len(named_tensors_list)} contributions but {len(batch_sizes)} batch sizes"
        )
    weights = sample_weights(batch_sizes)
    reference = named_tensors_list[0]
    for index, contribution in enumerate(named_tensors_list[1:], start=1):
        if contribution.keys() != reference.keys():
            raise AggregationError(
                f"contribution {index} names {sorted(contribution)} differ from {sorted(reference)}"
            )
    result: dict[str, torch.Tensor] = {}
    for name in reference:
        shape = tuple(reference[name].shape)
        total = torch.zeros(shape, dtype=torch.float32)
        for contribution, weight in zip(named_tensors_list, weights, strict=True):
            tensor = contribution[name]
            if tuple(tensor.shape) != shape:
                raise AggregationError(f"{name!r}: shape {tuple(tensor.shape)} differs from {shape}")
            total.add_(tensor.to("cpu", torch.float32), alpha=weight)
        result[name] = total
    return result


def linear_lr_scale(global_batch: int, reference_batch: int | None) -> float:
    """ScaDLES linear scaling: the step's learning rate is ``lr * B_t / B_ref``.

    ``B_t`` is the samples aggregated into the step, ``B_ref = b_ref * N`` the global
    batch the base learning rate was tuned for. ``None`` turns scaling off (factor 1).
    """
    if reference_batch is None:
        return 1.0
    if reference_batch <= 0 or global_batch < 0:
        raise AggregationError(f"need B_ref > 0 and B_t >= 0, got B_ref={reference_batch}, B_t={global_batch}")
    return global_batch / reference_batch
