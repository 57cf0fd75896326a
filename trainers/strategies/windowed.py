"""What the ASP and ADSP servers share when robust aggregation collects a window of senders'
updates (``aggregate_window``, ``trainers.aggregation.UpdateWindow``) before it applies one
aggregate: filling the window, combining it, and recording what it applied."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from edgestream.trainers.aggregation import RobustAggregation, UpdateWindow, WindowSlot
from edgestream.trainers.errors import AggregationError, StrategyError
from edgestream.trainers.messages import UpdateMessage


@dataclass
class WindowAggregate:
    """A full window: its slots (sorted by sender), their aggregate and the model version it
    applies to."""

    slots: list[WindowSlot]
    tensors: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor] | None
    version: int


class WindowedServer:
    """Mixin of a server strategy with ``robust``, ``aggregate_window``, ``_window`` (an
    ``UpdateWindow`` or None), ``_workers``, ``trainer``, ``staleness`` and ``counters``."""

    robust: Any
    aggregate_window: int | None
    _window: UpdateWindow | None
    _workers: Any
    trainer: Any
    staleness: Any
    counters: Any

    def _setup_robust(self, who: str, fold: str, members: Any, aggregate_window: int | None,
                      **params: Any) -> None:
        """Set ``robust`` from the strategy parameters (``aggregation``, ``trim``, ``krum_f``,
        ``max_update_norm``, ``norm_policy``), ``aggregate_window`` (sized from ``members``
        when not given) and ``_window`` (an ``UpdateWindow(fold)``, or None without one);
        ``StrategyError`` naming ``who`` for a setting the server cannot honour."""
        try:
            self.robust = RobustAggregation.from_params(**params)
            self.aggregate_window = self.robust.window_size(aggregate_window, len(set(members)))
        except AggregationError as exc:
            raise StrategyError(f"{who}: {exc}") from None
        self._window = UpdateWindow(fold) if self.aggregate_window is not None else None

    def _window_target(self) -> int:
        """Slots that fill the window: ``aggregate_window``, or fewer when fewer workers are live."""
        assert self.aggregate_window is not None
        return max(1, min(self.aggregate_window, len(self._workers) or self.aggregate_window))

    def _fill_window(self, msg: UpdateMessage, tensors: dict[str, torch.Tensor]) -> WindowAggregate | None:
        """Put an update into its sender's slot; once the window is full, empty it and return
        its aggregate by the robust rule (a trimmed mean over too few slots trims less:
        counted ``trim_reduced``). None while it is not full."""
        assert self._window is not None
        self._window.add(msg.sender, tensors, msg.buffers or None, base_version=msg.base_version,
                         samples=msg.batch_size)
        self.counters["windowed"] += 1
        if len(self._window) < self._window_target():
            return None
        slots = self._window.take()
        if len(slots) < self.robust.min_contributions:
            self.counters["trim_reduced"] += 1
        samples = [slot.samples for slot in slots]
        tensors, buffers = self.robust.aggregate([slot.tensors for slot in slots],
                                                 [slot.buffers for slot in slots], samples)
        return WindowAggregate(slots, tensors, buffers, self.trainer.version)

    def _settle_window(self, window: WindowAggregate) -> None:
        """After the aggregate was applied: each update's staleness against the version it
        was applied to, counted ``applied``; one more ``windows``."""
        for slot in window.slots:
            for base_version in slot.base_versions:
                self.staleness.record(window.version - base_version)
            self.counters["applied"] += slot.count
        self.counters["windows"] += 1
