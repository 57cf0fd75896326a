"""Byzantine workers for tests and benchmarks: a strategy wrapper that corrupts what it sends.

A Byzantine worker trains like any other (its own step guard sees honest gradients), then
corrupts the gradients and deltas its strategy publishes, after the guard and before the
codec, so every value stays finite and of the right shape: the receivers' validation and
norm check (``train.max_grad_norm``) let it through, and only the aggregation rule stands
between it and the model. Attacks (:data:`ATTACKS`):

- ``sign_flip``: ``-g`` (pushes the model uphill);
- ``scale100``: ``100 g`` (one contribution outweighs the rest of a mean);
- ``noise``: Gaussian noise with the L2 norm of ``g`` (carries no signal), seeded.

:func:`byzantine` wraps an existing strategy instance (unit tests);
:func:`register_byzantine` registers ``byzantine-<strategy>`` for runners that build
strategies by name (the simulated clock in ``benchmarks/byzantine.py``): parameters
``byzantine=[worker ids]``, ``attack``, ``attack_seed``, and the wrapped strategy's own.
Never imported by the strategies package, so the registry (and the conformance suite)
does not see it unless a benchmark registers it.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from edgestream.trainers.aggregation import update_norm
from edgestream.trainers.errors import StrategyError
from edgestream.trainers.messages import Outgoing
from edgestream.trainers.strategies.base import (
    StrategyContext,
    SyncStrategy,
    create,
    names,
    register,
    roles,
    strategy_class,
)

#: The attacks :func:`corrupt` knows.
ATTACKS = ("sign_flip", "scale100", "noise")
#: Message kinds a Byzantine worker corrupts: the updates that reach an aggregate.
CORRUPTED_KINDS = frozenset({"gradient", "delta"})


def corrupt(
    tensors: Mapping[str, torch.Tensor], attack: str, generator: torch.Generator | None = None
) -> dict[str, torch.Tensor]:
    """``tensors`` corrupted by ``attack`` (new tensors, finite for finite input)."""
    if attack == "sign_flip":
        return {name: -tensor for name, tensor in tensors.items()}
    if attack == "scale100":
        return {name: tensor * 100.0 for name, tensor in tensors.items()}
    if attack == "noise":
        noise = {
            name: torch.randn(tensor.shape, generator=generator, dtype=torch.float32).to(tensor.dtype)
            for name, tensor in sorted(tensors.items())
        }
        target, drawn = update_norm(tensors), update_norm(noise)
        factor = target / drawn if drawn > 0 else 0.0
        return {name: noise[name] * factor for name in tensors}
    raise StrategyError(f"unknown attack {attack!r}; known: {list(ATTACKS)}")


class ByzantineStrategy:
    """A strategy whose outgoing gradients and deltas are corrupted; everything else is the
    wrapped strategy's (attributes and hooks are delegated, so a driver drives it as usual).

    Invariant: only messages this worker sends as its own update (kind ``gradient`` or
    ``delta``, ``sender`` its id) change; its own model and state follow the wrapped
    strategy exactly (a BSP attacker aggregates its corrupted gradient from the log like
    everyone else, so BSP replicas stay identical).
    """

    def __init__(self, inner: SyncStrategy, attack: str, *, seed: int = 0) -> None:
        if attack not in ATTACKS:
            raise StrategyError(f"unknown attack {attack!r}; known: {list(ATTACKS)}")
        self.inner = inner
        self.attack = attack
        self._generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(inner.worker_id.encode()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _corrupt(self, outgoing: list[Outgoing]) -> list[Outgoing]:
        out = []
        for item in outgoing:
            msg = item.message
            if msg.kind in CORRUPTED_KINDS and msg.sender == self.inner.worker_id:
                msg = dataclasses.replace(msg, tensors=corrupt(msg.tensors, self.attack, self._generator))
                item = dataclasses.replace(item, message=msg)
                self.inner.counters["byzantine_corrupted"] += 1
            out.append(item)
        return out

    def on_local_step(self, result: Any) -> list[Outgoing]:
        return self._corrupt(self.inner.on_local_step(result))

    def on_message(self, msg: Any) -> list[Outgoing]:
        return self._corrupt(self.inner.on_message(msg))

    def poll(self, now: float) -> list[Outgoing]:
        return self._corrupt(self.inner.poll(now))

    def on_membership(self, workers: Sequence[str]) -> list[Outgoing]:
        return self._corrupt(self.inner.on_membership(workers))

    def on_leave(self) -> list[Outgoing]:
        return self._corrupt(self.inner.on_leave())

    def on_restore(self) -> list[Outgoing]:
        return self._corrupt(self.inner.on_restore())

    def on_evaluation(self, accuracy: float, loss: float) -> list[Outgoing]:
        return self._corrupt(self.inner.on_evaluation(accuracy, loss))


def byzantine(inner: SyncStrategy, attack: str, *, seed: int = 0) -> SyncStrategy:
    """``inner`` turned Byzantine (typed as a strategy: it is one by delegation)."""
    return ByzantineStrategy(inner, attack, seed=seed)  # type: ignore[return-value]


def register_byzantine(strategy: str) -> str:
    """Register ``byzantine-<strategy>`` (once) with ``strategy``'s roles; return its name.

    Its factory takes ``byzantine`` (the worker ids that attack), ``attack`` (default
    ``sign_flip``), ``attack_seed`` (default 0) and passes every other parameter to
    ``strategy``; a worker whose id is listed is wrapped, every other process (the
    server too) is the plain strategy.
    """
    name = f"byzantine-{strategy}"
    if name in names():
        return name

    def factory(
        ctx: StrategyContext,
        *,
        byzantine: Sequence[str] = (),
        attack: str = "sign_flip",
        attack_seed: int = 0,
        **params: Any,
    ) -> SyncStrategy:
        if attack not in ATTACKS:
            raise StrategyError(f"unknown attack {attack!r}; known: {list(ATTACKS)}")
        inner = create(strategy, ctx, **params)
        if ctx.role == "worker" and ctx.worker_id in set(byzantine):
            return ByzantineStrategy(inner, attack, seed=int(attack_seed))  # type: ignore[return-value]
        return inner

    # The plain strategy's classes: a wrapped worker delegates to one (and reads its ClassVars).
    register(name, builds=tuple(strategy_class(strategy, role) for role in roles(strategy)))(factory)
    return name
