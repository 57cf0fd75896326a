"""Sync strategies, one module each; importing this package registers them all."""

from trainers.strategies import adsp, asp, bsp, dlion, gossip, localsgd, scadles, ssp, staged  # noqa: F401  (registry entries: one line per strategy)
from trainers.strategies.base import (
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
