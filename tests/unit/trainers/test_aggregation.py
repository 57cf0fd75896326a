"""weighted_mean: the b_i / sum b rule, exact, order-stable, non-mutating, strict."""

from __future__ import annotations

import pytest
import torch

from edgestream.trainers.aggregation import sample_weights, weighted_mean
from edgestream.trainers.errors import AggregationError


def _grads(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 3), value), "b": torch.full((3,), -value)}


@pytest.mark.parametrize(
    ("batch_sizes", "expected_w"),
    [
        ([10, 10, 10], (1.0 + 2.0 + 6.0) / 3),
        ([16, 48, 32], (16 * 1.0 + 48 * 2.0 + 32 * 6.0) / 96),
        ([1, 1, 98], (1.0 + 2.0 + 98 * 6.0) / 100),
    ],
)
def test_weighted_mean_weights_each_contribution_by_its_share_of_samples(batch_sizes, expected_w):
    contributions = [_grads(1.0), _grads(2.0), _grads(6.0)]

    result = weighted_mean(contributions, batch_sizes)

    torch.testing.assert_close(result["w"], torch.full((2, 3), expected_w))
    torch.testing.assert_close(result["b"], torch.full((3,), -expected_w))


def test_sample_weights_sum_to_one():
    assert sum(sample_weights([3, 5, 8])) == pytest.approx(1.0)


def test_weighted_mean_is_bitwise_reproducible_and_leaves_inputs_alone():
    generator = torch.Generator().manual_seed(0)
    contributions = [{"w": torch.randn(50, generator=generator)} for _ in range(4)]
    copies = [{k: v.clone() for k, v in c.items()} for c in contributions]

    first = weighted_mean(contributions, [3, 7, 11, 13])
    second = weighted_mean(copies, [3, 7, 11, 13])

    assert torch.equal(first["w"], second["w"])
    assert all(torch.equal(c["w"], k["w"]) for c, k in zip(contributions, copies, strict=True))


@pytest.mark.parametrize(
    ("contributions", "batch_sizes", "message"),
    [
        ([_grads(1.0), {"w": torch.zeros(2, 3)}], [1, 1], "names"),
        ([_grads(1.0), {"w": torch.zeros(3, 2), "b": torch.zeros(3)}], [1, 1], "shape"),
        ([_grads(1.0), _grads(2.0)], [1, 0], "> 0"),
        ([_grads(1.0)], [1, 2], "contributions"),
        ([], [], "no batch sizes"),
    ],
)
def test_weighted_mean_rejects_contributions_that_do_not_line_up(contributions, batch_sizes, message):
    with pytest.raises(AggregationError, match=message):
        weighted_mean(contributions, batch_sizes)
