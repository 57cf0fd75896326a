"""Accordion-style switch: compress gently in critical phases, where per-layer gradient norms change fast."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from edgestream.compression.base import LayerContext
from edgestream.compression.errors import CompressorConfigError


class AccordionSwitch:
    """Per-layer regime detector after Accordion (Agarwal et al., MLSys 2021).

    Gradients are summed over an interval (an epoch, or K steps). At its end,
    a layer is *critical* when ``| ||D_prev|| - ||D_cur|| | / ||D_prev|| >= eta``
    (D = accumulated gradient); critical layers get the ``gentle`` setting
    (larger density or rank), others the ``aggressive`` one. Invariant: a layer
    without a previous complete interval is critical, as training starts in a
    critical phase.
    """

    def __init__(
        self,
        eta: float = 0.5,
        *,
        knob: str = "ratio",
        gentle: float = 0.1,
        aggressive: float = 0.01,
    ) -> None:
        if knob not in ("ratio", "rank"):
            raise CompressorConfigError(f"knob must be 'ratio' or 'rank', got {knob!r}")
        if not math.isfinite(eta) or eta <= 0:
            raise CompressorConfigError(f"eta must be positive, got {eta}")
        if knob == "ratio" and not 0 < aggressive <= gentle <= 1:
            raise CompressorConfigError("ratios need 0 < aggressive <= gentle <= 1")
        if knob == "rank" and not (
            int(aggressive) == aggressive and int(gentle) == gentle and 1 <= aggressive <= gentle
        ):
            raise CompressorConfigError("ranks need integers 1 <= aggressive <= gentle")
        self.eta = float(eta)
        self.knob = knob
        self.gentle = gentle if knob == "ratio" else int(gentle)
        self.aggressive = aggressive if knob == "ratio" else int(aggressive)
        self._sums: dict[str, torch.Tensor] = {}
        self._previous: dict[str, float] = {}
        self._critical: dict[str, bool] = {}

    def accumulate(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add one step's gradients to the current interval."""
        for name, grad in grads.items():
            g = grad.detach().to(device="cpu", dtype=torch.float32)
            owed = self._sums.get(name)
            self._sums[name] = g.clone() if owed is None else owed + g

    def end_interval(self, norms: Mapping[str, float] | None = None) -> dict[str, bool]:
        """Close the interval and return ``{layer: critical}`` for the layers seen in it.

        ``norms`` gives the accumulated-gradient norms directly (scripted tests,
        or when another component accumulated); otherwise the sums from
        ``accumulate`` are used and cleared.
        """
        if norms is None:
            norms = {
                name: float(torch.linalg.vector_norm(total)) for name, total in self._sums.items()
            }
        self._sums = {}
        decisions: dict[str, bool] = {}
        for name, current in norms.items():
            previous = self._previous.get(name)
            if previous is None:
                critical = True
            elif previous == 0.0:
                critical = current > 0.0
            else:
                critical = abs(previous - current) / previous >= self.eta
            self._previous[name] = float(current)
            self._critical[name] = decisions[name] = critical
        return decisions

    def is_critical(self, name: str) -> bool:
        return self._critical.get(name, True)

    def setting(self, name: str) -> float | int:
        """The ratio or rank for ``name`` in the current regime."""
        return self.gentle if self.is_critical(name) else self.aggressive

    def context(self, name: str) -> LayerContext:
        value = self.setting(name)
        if self.knob == "ratio":
            return LayerContext(name=name, ratio=float(value))
        return LayerContext(name=name, rank=int(value))

    def contexts(self, names: Iterable[str]) -> dict[str, LayerContext]:
        """Per-layer contexts to pass to ``GradientCodec.encode(..., contexts=...)``."""
        return {name: self.context(name) for name in names}
