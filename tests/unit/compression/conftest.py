"""Factory fixtures for the compression tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from edgestream.compression import registry
from edgestream.compression.base import Compressor
from tests.unit.compression.helpers import make_gradient


@pytest.fixture
def gradient() -> Callable[..., torch.Tensor]:
    """``gradient(shape, seed=0, scale=1.0)``: a seeded heavy-tailed tensor."""
    return make_gradient


@pytest.fixture
def gradients() -> Callable[..., dict[str, torch.Tensor]]:
    """``gradients(shapes, seed=0)``: one seeded tensor per named shape."""

    def build(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
        return {
            name: make_gradient(shape, seed=seed * 1000 + i)
            for i, (name, shape) in enumerate(shapes.items())
        }

    return build


@pytest.fixture
def compressor_factory() -> Callable[..., Compressor]:
    """``compressor_factory(name, **params)``: a fresh registered compressor."""
    return registry.create
