"""Sync strategies, one module each; importing this package registers them all."""

from edgestream.trainers.strategies import (  # noqa: F401  (registry entries: one line per strategy)
    adsp,
    asp,
    bsp,
    dlion,
    gossip,
    localsgd,
    scadles,
    ssp,
    staged,
)
from edgestream.trainers.strategies.base import (
    Observations,
    Outgoing,
    StrategyContext,
    SyncStrategy,
    UpdateMessage,
    create,
    names,
    register,
    roles,
    stage_split_names,
    strategy_class,
    subscribing,
)

__all__ = [
    "Observations",
    "Outgoing",
    "StrategyContext",
    "SyncStrategy",
    "UpdateMessage",
    "create",
    "names",
    "register",
    "roles",
    "stage_split_names",
    "strategy_class",
    "subscribing",
]
