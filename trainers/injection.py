"""ScaDLES data injection: top up a non-IID device's batch with classes it never sees.

Each step, a device adds samples of ``ceil(alpha * num_classes)`` classes it does not
own, ``ceil(beta * b_i)`` samples of each, drawn from a small shared pool. A class is
"owned" once the device's own stream delivered it; until a device has seen anything,
it owns nothing and every class is a candidate.

Where the pool comes from: in a simulation, :func:`shared_pool` takes a few labelled
samples per class from the streamed (never the held-out) part of the data. In a real
deployment it is a small labelled seed set the operator publishes with the job (for
instance a compacted Kafka topic or a file shipped with the model); devices only read
it, and its size bounds what injection costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edgestream.trainers.errors import StrategyError


@dataclass(frozen=True)
class Pool:
    """Labelled samples shared by every device: features ``(n, ...)`` float32, labels ``(n,)``."""

    features: np.ndarray
    labels: np.ndarray

    def __post_init__(self) -> None:
        if self.features.shape[0] != self.labels.shape[0] or self.labels.ndim != 1:
            raise StrategyError(
                f"pool features {self.features.shape} and labels {self.labels.shape} do not match"
            )

    def classes(self) -> set[int]:
        return {int(c) for c in np.unique(self.labels)}


def shared_pool(features: np.ndarray, labels: np.ndarray, per_class: int, *, seed: int = 0) -> Pool:
    """``per_class`` samples of every class present (fewer if a class has fewer), seeded."""
    if per_class <= 0:
        raise StrategyError(f"per_class must be > 0, got {per_class}")
    rng = np.random.default_rng(seed)
    chosen: list[np.ndarray] = []
    for cls in np.unique(labels):
        index = np.flatnonzero(labels == cls)
        chosen.append(rng.choice(index, size=min(per_class, index.size), replace=False))
    picked = np.sort(np.concatenate(chosen))
    return Pool(np.ascontiguousarray(features[picked], dtype=np.float32), labels[picked].astype(np.int64))


@dataclass(frozen=True)
class Injection:
    """What one call of :meth:`DataInjector.augment` added."""

    classes: tuple[int, ...]
    samples: int


class DataInjector:
    """One device's injector; deterministic for a seed.

    Invariant: injected samples only ever come from classes the device did not own
    when the batch was augmented, and at most ``ceil(alpha * num_classes)`` of them.
    """

    def __init__(self, pool: Pool, num_classes: int, *, alpha: float, beta: float, seed: int = 0) -> None:
        if not 0.0 <= alpha <= 1.0 or not 0.0 <= beta:
            raise StrategyError(f"need 0 <= alpha <= 1 and beta >= 0, got alpha={alpha}, beta={beta}")
        if num_classes <= 0:
            raise StrategyError(f"num_classes must be > 0, got {num_classes}")
        self.pool = pool
        self.num_classes = num_classes
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.owned: set[int] = set()
        self.injected_total = 0
        self._rng = np.random.default_rng(seed)
        self._by_class = {c: np.flatnonzero(pool.labels == c) for c in pool.classes()}

    def observe(self, labels: np.ndarray) -> None:
        """Classes the device's own stream delivered become owned."""
        self.owned.update(int(c) for c in np.unique(labels))

    def choose_classes(self) -> tuple[int, ...]:
        """``ceil(alpha * num_classes)`` not-owned classes that the pool holds (fewer if not enough)."""
        want = math.ceil(self.alpha * self.num_classes)
        candidates = sorted(set(self._by_class) - self.owned)
        if want <= 0 or not candidates:
            return ()
        picked = self._rng.choice(len(candidates), size=min(want, len(candidates)), replace=False)
        return tuple(sorted(candidates[int(i)] for i in picked))

    def augment(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, Injection]:
        """The batch ``(x, y)`` of ``b_i`` records plus ``ceil(beta * b_i)`` pool samples per chosen class.

        The device's own labels are observed first, so a class in this very batch
        is never injected.
        """
        self.observe(y)
        per_class = math.ceil(self.beta * len(y))
        classes = self.choose_classes() if per_class > 0 else ()
        if not classes:
            return x, y, Injection((), 0)
        rows = np.concatenate(
            [self._rng.choice(self._by_class[c], size=per_class, replace=True) for c in classes]
        )
        extra_x = self.pool.features[rows].astype(x.dtype, copy=False)
        extra_y = self.pool.labels[rows].astype(y.dtype, copy=False)
        self.injected_total += int(rows.size)
        return (
            np.concatenate([x, extra_x.reshape((-1, *x.shape[1:]))]),
            np.concatenate([y, extra_y]),
            Injection(classes, int(rows.size)),
        )
