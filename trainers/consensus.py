"""Consensus distance: how far apart the workers' models are, measured without moving them.

Exact consensus distance needs every model in one place; the simulated clock has them
(:func:`consensus_distance`). Live workers each export a *sketch* of their own model
instead (:class:`ModelSketch`): the same fixed random projection ``S x`` in every process
(a Johnson-Lindenstrauss map: ``S`` is ``dim x P`` with entries drawn N(0, 1/dim) from
a fixed seed, so ``E ||S v||^2 = ||v||^2``). The spread of the sketches across workers
then estimates the spread of the models, with a relative error of about
``sqrt(2 / dim)``:

    (1/N) sum_i ||x_i - mean x||^2  ~=  (1/N) sum_i ||S x_i - mean S x||^2
                                     =   sum_d  var_i (S x_i)_d

which Prometheus computes from the per-index gauges as
``sum(stdvar by (index) (edgestream_model_sketch))``; its square root is the
root-mean-square distance of the models to their average.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

#: Sketch length: 32 numbers per worker; relative error of the distance about 25 %.
DEFAULT_SKETCH_DIM = 32


class ModelSketch:
    """A fixed random projection of named tensors to ``dim`` numbers.

    Invariant: two instances with the same ``dim`` and ``seed`` map the same named
    tensors (same names, same shapes) to the same numbers, in any process.
    """

    def __init__(self, dim: int = DEFAULT_SKETCH_DIM, seed: int = 0) -> None:
        if dim <= 0:
            raise ValueError(f"sketch dim must be > 0, got {dim}")
        self.dim = dim
        self.seed = seed
        self._matrices: dict[tuple[str, int], torch.Tensor] = {}

    def _matrix(self, index: int, name: str, numel: int) -> torch.Tensor:
        key = (name, numel)
        matrix = self._matrices.get(key)
        if matrix is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            matrix = torch.randn(self.dim, numel, generator=gen, dtype=torch.float64) / math.sqrt(self.dim)
            self._matrices[key] = matrix
        return matrix

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> tuple[float, ...]:
        """``S x`` for the tensors taken in sorted name order."""
        total = torch.zeros(self.dim, dtype=torch.float64)
        for index, name in enumerate(sorted(tensors)):
            flat = tensors[name].detach().reshape(-1).to(torch.float64)
            total += self._matrix(index, name, flat.numel()) @ flat
        return tuple(float(v) for v in total)


def consensus_distance(models: Sequence[Mapping[str, torch.Tensor]]) -> float:
    """Exact root-mean-square distance of ``models`` to their average (0 for fewer than 2)."""
    if len(models) < 2:
        return 0.0
    names = sorted(models[0])
    flat = torch.stack([torch.cat([m[n].detach().reshape(-1).to(torch.float64) for n in names]) for m in models])
    return float(((flat - flat.mean(0)) ** 2).sum(1).mean().sqrt())


def sketch_spread(sketches: Sequence[Sequence[float]]) -> float:
    """The estimate Prometheus computes: ``sqrt(sum_d var_i sketch_i[d])`` (population variance)."""
    if len(sketches) < 2:
        return 0.0
    rows = torch.tensor([list(s) for s in sketches], dtype=torch.float64)
    return float(rows.var(0, unbiased=False).sum().sqrt())
