"""Consensus distance and the model sketch that estimates it (trainers/consensus.py)."""

from __future__ import annotations

import math

import pytest
import torch

from edgestream.trainers.consensus import ModelSketch, consensus_distance, sketch_spread


def _models(count: int, spread: float, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    centre = {"w": torch.randn(40, 30, generator=gen), "b": torch.randn(30, generator=gen)}
    return [{n: t + spread * torch.randn(t.shape, generator=gen) for n, t in centre.items()} for _ in range(count)]


def test_consensus_distance_is_the_rms_distance_to_the_average():
    models = [{"x": torch.tensor([0.0, 0.0])}, {"x": torch.tensor([2.0, 0.0])}]
    assert consensus_distance(models) == pytest.approx(1.0)
    assert consensus_distance(models[:1]) == 0.0
    assert consensus_distance([models[0], models[0]]) == 0.0


def test_the_same_sketch_in_every_process_and_a_linear_map():
    models = _models(2, 0.1)
    one, other = ModelSketch(16, seed=3), ModelSketch(16, seed=3)
    assert one(models[0]) == other(models[0])
    assert one(models[0]) != ModelSketch(16, seed=4)(models[0])
    total = {n: models[0][n] + models[1][n] for n in models[0]}
    assert [a + b for a, b in zip(one(models[0]), one(models[1]), strict=True)] == pytest.approx(list(one(total)))
    with pytest.raises(ValueError):
        ModelSketch(0)


@pytest.mark.parametrize("spread", [1e-4, 0.1, 3.0])
def test_the_sketch_spread_estimates_the_consensus_distance(spread):
    # Relative error about sqrt(2 / dim); 32 numbers per worker, 10 workers: within 50 %.
    models = _models(10, spread, seed=1)
    sketch = ModelSketch(32)
    exact = consensus_distance(models)
    estimate = sketch_spread([sketch(m) for m in models])
    assert exact == pytest.approx(spread * math.sqrt(1230 * 9 / 10), rel=0.1)
    assert estimate == pytest.approx(exact, rel=0.5)


def test_equal_models_have_zero_spread():
    models = _models(1, 0.0) * 4
    sketch = ModelSketch()
    assert sketch_spread([sketch(m) for m in models]) == 0.0
