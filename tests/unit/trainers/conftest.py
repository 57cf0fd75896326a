"""Fixtures for the trainers unit suite: one torch thread, the digits split, factories."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from edgestream.trainers.local import LocalTrainer, limit_torch_threads
from edgestream.trainers.models import build_model
from tests.unit.trainers.fakes import BatchStream, FakeBus, Node, build_node


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> None:
    # Two cores are shared with a Kafka broker and other suites.
    limit_torch_threads(1)


@dataclass(frozen=True)
class DigitsSplit:
    """sklearn digits scaled to [0, 1]: 80 % train, 20 % held out (never trained on)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    def shards(self, count: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
        """IID split of the training part into ``count`` disjoint worker shards."""
        order = np.random.default_rng(seed).permutation(len(self.y_train))
        return [(self.x_train[idx], self.y_train[idx]) for idx in np.array_split(order, count)]


@pytest.fixture(scope="session")
def digits() -> DigitsSplit:
    data = load_digits()
    features = (data.data / 16.0).astype(np.float32)
    labels = data.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        features, labels, test_size=0.2, stratify=labels, random_state=0
    )
    return DigitsSplit(x_train, y_train, x_test, y_test)


TrainerFactory = Callable[..., LocalTrainer]


@pytest.fixture
def make_trainer() -> TrainerFactory:
    """``make_trainer(model="mlp", seed=0, lr=0.1, momentum=0.9)`` for 64-feature, 10-class digits."""

    def factory(model: str = "mlp", seed: int = 0, lr: float = 0.1, momentum: float = 0.9) -> LocalTrainer:
        return LocalTrainer(build_model(model, (64,), 10, seed), lr=lr, momentum=momentum)

    return factory


@pytest.fixture
def bus() -> FakeBus:
    return FakeBus()


NodeFactory = Callable[..., Node]


@pytest.fixture
def make_node(bus: FakeBus, make_trainer: TrainerFactory) -> NodeFactory:
    """Build a trainer + strategy behind a training driver, subscribe it to the bus,
    attach a batch stream. ``codec`` / ``codec_params`` configure the driver's links
    (a strategy that votes on compression needs a compressing codec)."""

    def factory(
        name: str,
        strategy: str,
        *,
        role: str = "worker",
        members: tuple[str, ...] = (),
        joining: bool = False,
        data: tuple[np.ndarray, np.ndarray] | None = None,
        batch_size: int = 32,
        model: str = "mlp",
        seed: int = 0,
        lr: float = 0.1,
        momentum: float = 0.9,
        codec: str = "dense",
        codec_params: dict[str, object] | None = None,
        **params: object,
    ) -> Node:
        batches = None
        if data is not None:
            batches = BatchStream(data[0], data[1], batch_size, seed=zlib.crc32(name.encode()))
        return build_node(
            bus, name, strategy, make_trainer(model=model, seed=seed, lr=lr, momentum=momentum),
            role=role, members=members, joining=joining, batches=batches,
            codec=codec, codec_params=codec_params, **params,
        )

    return factory
