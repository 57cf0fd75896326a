"""Adaptive compression controllers: the ScaDLES vote, the Accordion switch and the byte budget."""

from edgestream.compression.controllers.accordion import AccordionSwitch
from edgestream.compression.controllers.budget import (
    BandwidthEstimator,
    BudgetDecision,
    ByteBudgetController,
)
from edgestream.compression.controllers.scadles import (
    ScadlesSignal,
    ScadlesVote,
    compression_signal,
    scadles_signal,
    topk_norm,
)

__all__ = [
    "AccordionSwitch",
    "BandwidthEstimator",
    "BudgetDecision",
    "ByteBudgetController",
    "ScadlesSignal",
    "ScadlesVote",
    "compression_signal",
    "scadles_signal",
    "topk_norm",
]
