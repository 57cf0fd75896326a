"""``warmup_bsp``: bulk-synchronous SGD whose steps ramp up over the first versions."""

from __future__ import annotations

from typing import Any

import torch

from edgestream.trainers.errors import StrategyError
from edgestream.trainers.messages import UpdateMessage
from edgestream.trainers.strategies.base import StrategyContext, register
from edgestream.trainers.strategies.bsp import BSPStrategy


@register("warmup_bsp")
class WarmupBSPStrategy(BSPStrategy):
    """BSP (every member's gradient for step t, on every replica) with the aggregated
    gradient of step ``t`` scaled by ``min(1, (t + 1) / warmup_steps)``: a linear warm-up.

    The scale depends on the model version alone, so replicas stay identical.
    """

    name = "warmup_bsp"

    def __init__(self, ctx: StrategyContext, *, warmup_steps: int = 20, **params: Any) -> None:
        """``warmup_steps``: versions over which the step grows to its full size (0: plain BSP);
        every other parameter is BSP's."""
        if warmup_steps < 0:
            raise StrategyError(f"warmup_bsp: warmup_steps must be >= 0, got {warmup_steps}")
        super().__init__(ctx, **params)
        self.warmup_steps = warmup_steps

    def _aggregate(
        self, contributions: list[UpdateMessage]
    ) -> tuple[list[UpdateMessage], dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
        kept, gradients, buffer_deltas = super()._aggregate(contributions)
        if gradients is not None and self.warmup_steps:
            scale = min(1.0, (self.trainer.version + 1) / self.warmup_steps)
            gradients = {name: g * scale for name, g in gradients.items()}
        return kept, gradients, buffer_deltas
