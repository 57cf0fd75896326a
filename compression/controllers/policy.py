"""Per-link compression policies: which density or rank each outgoing message uses.

A policy wraps one controller for the training driver, which asks it, for every
compressed message, the per-layer ``LayerContext`` to encode with, and tells it how
long each message took to leave. Links are ``(recipient, kind)`` pairs (None: a
broadcast), the same keys as the driver's per-link codecs.

- ``none``: the codec's own setting (e.g. ``codec_params=["ratio=0.1"]``);
- ``accordion``: ``AccordionSwitch``; gradients summed over ``interval`` messages of a
  link, then each layer gentle (critical regime) or aggressive;
- ``budget``: ``ByteBudgetController``; per link an EWMA of the observed bandwidth,
  and the largest setting whose message leaves within ``interval_s`` at that rate.

Pure and synchronous; the caller measures time. Invariant: ``setting()`` is the value
of the last decision (the mean over layers for Accordion), or None before any.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, Protocol

import torch

from edgestream.compression.base import Compressor, LayerContext
from edgestream.compression.controllers.accordion import AccordionSwitch
from edgestream.compression.controllers.budget import BandwidthEstimator, ByteBudgetController
from edgestream.compression.errors import CompressorConfigError

POLICIES = ("none", "accordion", "budget")


class LinkPolicy(Protocol):
    """What the driver needs of a compression policy."""

    def contexts(self, link: Hashable, tensors: Mapping[str, torch.Tensor]) -> dict[str, LayerContext] | None:
        """Per-layer settings for the next message on ``link`` (None: the codec's default)."""

    def observe_sent(self, link: Hashable, nbytes: int, seconds: float) -> None:
        """One message of ``nbytes`` left on ``link`` in ``seconds``."""

    def setting(self) -> float | None:
        """The value last chosen (density or rank), for metrics."""


class FixedPolicy:
    """The codec's own setting for every message."""

    def contexts(self, link: Hashable, tensors: Mapping[str, torch.Tensor]) -> dict[str, LayerContext] | None:
        return None

    def observe_sent(self, link: Hashable, nbytes: int, seconds: float) -> None:
        return None

    def setting(self) -> float | None:
        return None


class AccordionPolicy:
    """One ``AccordionSwitch`` per link; an interval is ``interval`` messages of that link."""

    def __init__(self, *, interval: int = 10, **switch: Any) -> None:
        if interval < 1:
            raise CompressorConfigError(f"interval must be >= 1, got {interval}")
        self.interval = int(interval)
        self._switch_params = switch
        AccordionSwitch(**switch)  # fail at construction on bad parameters
        self._switches: dict[Hashable, AccordionSwitch] = {}
        self._counts: dict[Hashable, int] = {}
        self._last: float | None = None

    def contexts(self, link: Hashable, tensors: Mapping[str, torch.Tensor]) -> dict[str, LayerContext] | None:
        switch = self._switches.get(link)
        if switch is None:
            switch = self._switches[link] = AccordionSwitch(**self._switch_params)
        switch.accumulate(tensors)
        self._counts[link] = self._counts.get(link, 0) + 1
        if self._counts[link] % self.interval == 0:
            switch.end_interval()
        chosen = switch.contexts(tensors)
        values = [float(ctx.ratio if switch.knob == "ratio" else ctx.rank) for ctx in chosen.values()]
        self._last = sum(values) / len(values) if values else None
        return chosen

    def observe_sent(self, link: Hashable, nbytes: int, seconds: float) -> None:
        return None

    def setting(self) -> float | None:
        return self._last


class BudgetPolicy:
    """Per link, the largest setting whose message leaves within ``interval_s`` at the link's
    observed bandwidth (``initial_bytes_per_s`` until a transfer was seen)."""

    def __init__(self, compressor: Compressor, *, interval_s: float = 0.5,
                 initial_bytes_per_s: float = 12.5e6, alpha: float = 0.3, **limits: Any) -> None:
        if not interval_s > 0 or not initial_bytes_per_s > 0:
            raise CompressorConfigError("interval_s and initial_bytes_per_s must be > 0")
        self.controller = ByteBudgetController(compressor, **limits)
        self.interval_s = float(interval_s)
        self.initial = float(initial_bytes_per_s)
        self.alpha = float(alpha)
        self._links: dict[Hashable, BandwidthEstimator] = {}
        self._last: float | None = None

    def contexts(self, link: Hashable, tensors: Mapping[str, torch.Tensor]) -> dict[str, LayerContext] | None:
        bandwidth = self._estimator(link).bytes_per_s or self.initial
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        decision = self.controller.choose_for_link(shapes, bandwidth, self.interval_s)
        self._last = float(decision.value)
        return decision.contexts(tensors)

    def observe_sent(self, link: Hashable, nbytes: int, seconds: float) -> None:
        if seconds > 0:
            self._estimator(link).observe(nbytes, seconds)

    def setting(self) -> float | None:
        return self._last

    def _estimator(self, link: Hashable) -> BandwidthEstimator:
        estimator = self._links.get(link)
        if estimator is None:
            estimator = self._links[link] = BandwidthEstimator(self.alpha, None)
        return estimator


def create_policy(name: str, compressor: Compressor, **params: Any) -> LinkPolicy:
    """The policy ``name`` (one of ``POLICIES``) for links compressed with ``compressor``."""
    if name == "none":
        if params:
            raise CompressorConfigError(f"the 'none' compression controller takes no parameters, got {params}")
        return FixedPolicy()
    if compressor.budget_knob is None:
        raise CompressorConfigError(
            f"compression controller {name!r} needs a codec with a density or rank knob "
            f"(topk, randomk, powersgd), not {compressor.name!r}")
    if name == "accordion":
        params.setdefault("knob", compressor.budget_knob)
        return AccordionPolicy(**params)
    if name == "budget":
        return BudgetPolicy(compressor, **params)
    raise CompressorConfigError(f"unknown compression controller {name!r}; use one of {', '.join(POLICIES)}")
