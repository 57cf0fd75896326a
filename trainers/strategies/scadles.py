"""ScaDLES: synchronous training on whatever each device's stream delivered in a window.

The mechanism (SEEDS.md section 1) is split where each piece belongs:

- **Time-window batching** and the **persistence / truncation** overflow policies are
  the ingest path's: ``streams.batching.AdaptiveBatcher`` in ``window`` mode (window
  and cap from ``batcher.window_s`` / ``batcher.max_batch``) on a
  ``streams.buffering.StreamBuffer``. A step trains on what the window delivered,
  so ``b_i`` differs per device and per step.
- **Weighted aggregation** ``b_i / B_t`` and **linear LR scaling** ``lr * B_t / B_ref``
  are the shared rules of :mod:`trainers.aggregation`, applied by the BSP machinery
  this class extends (one totally ordered gradients log, bitwise-identical replicas).
- **Adaptive compression** is decided here: every gradient carries this worker's vote
  (``meta["vote"]``) and the step's decision (``meta["compress"]``). The decision for
  step ``t + 1`` is the majority (>= half) of the votes carried by step ``t``'s
  contributions, so every replica, reading the same log, takes the same decision;
  step 0 is dense. A worker's vote is "compress" when the mean of its compression
  signal ``c`` over the current epoch (``epoch_steps`` local steps) is ``<= delta``.
  The signal needs the link's error-feedback residual, which the codec owns, so the
  pipeline (or the simulated-clock runner) computes ``c`` of each new gradient and
  reports it with :meth:`ScadlesStrategy.observe_signal` *before* handing the step to
  :meth:`on_local_step`, so a gradient carries the vote that includes its own signal.
- **Data injection** for non-IID streams is :class:`trainers.injection.DataInjector`,
  applied to a batch before the local step.
"""

from __future__ import annotations

import math
from typing import Any

from edgestream.compression.controllers.scadles import ScadlesSignal, majority_compress
from edgestream.trainers.errors import StrategyError
from edgestream.trainers.local import StepResult
from edgestream.trainers.messages import Outgoing, UpdateMessage
from edgestream.trainers.strategies.base import StrategyContext, register
from edgestream.trainers.strategies.bsp import BSPStrategy


@register("scadles")
class ScadlesStrategy(BSPStrategy):
    """BSP over window batches, sample-weighted, LR-scaled, with the compression vote.

    Invariant (beyond BSP's): every replica holds the same ``compress`` decision for
    its pending step, and ``counters["compressed_steps"] <= counters["steps"]``.
    """

    name = "scadles"

    def __init__(
        self,
        ctx: StrategyContext,
        *,
        reference_batch: int | None = None,
        reference_per_worker: int | None = None,
        adaptive_compression: bool = False,
        delta: float = 0.2,
        epoch_steps: int = 20,
        ratio: float = 0.1,
        **bsp: Any,
    ) -> None:
        """``reference_batch`` is ``B_ref``; or give ``reference_per_worker`` (``b_ref``) and
        ``B_ref = b_ref * N`` with ``N`` the job's workers. ``adaptive_compression`` turns
        the vote on (the pipeline must then have a compressing codec, e.g. top-k 10 %
        with error feedback); ``delta`` is the vote threshold, ``epoch_steps`` the local
        steps over which the signal is averaged, ``ratio`` the top-k ratio the signal is
        computed for. Other keywords go to :class:`BSPStrategy`."""
        if reference_batch is not None and reference_per_worker is not None:
            raise StrategyError("give reference_batch or reference_per_worker, not both")
        if reference_per_worker is not None:
            if reference_per_worker <= 0:
                raise StrategyError(f"reference_per_worker must be > 0, got {reference_per_worker}")
            workers = len(set(ctx.members) | {ctx.worker_id})
            reference_batch = int(reference_per_worker) * workers
        if not isinstance(epoch_steps, int) or epoch_steps <= 0:
            raise StrategyError(f"epoch_steps must be a positive integer, got {epoch_steps!r}")
        if not (isinstance(ratio, int | float) and 0.0 < ratio <= 1.0):
            raise StrategyError(f"ratio must be in (0, 1], got {ratio!r}")
        if not (isinstance(delta, int | float) and math.isfinite(delta) and delta >= 0):
            raise StrategyError(f"delta must be a finite number >= 0, got {delta!r}")
        super().__init__(ctx, reference_batch=reference_batch, **bsp)
        self.adaptive_compression = bool(adaptive_compression)
        self.delta = float(delta)
        self.epoch_steps = epoch_steps
        self.ratio = float(ratio)
        self._signal = ScadlesSignal(self.delta)
        self._compress = False  # decision for the pending step; step 0 is dense
        self._local_steps = 0

    preferred_batcher = "window"

    # -- the vote ---------------------------------------------------------------------

    def compression_signal_ratio(self) -> float | None:
        """The top-k ratio of the signal, when the vote is on."""
        return self.ratio if self.adaptive_compression else None

    def compression_decision(self) -> bool | None:
        return self._compress if self.adaptive_compression else None

    @property
    def compress_next(self) -> bool:
        """The decision for the pending step (what this worker's next gradient uses)."""
        return self._compress if self.adaptive_compression else True

    def observe_signal(self, signal: float) -> None:
        """This worker's compression signal ``c`` of the gradient :meth:`on_local_step` gets next."""
        self._signal.observe(signal)
        self.counters["signals"] += 1

    def on_local_step(self, result: StepResult) -> list[Outgoing]:
        out = super().on_local_step(result)
        vote = self._signal.vote()
        for item in out:
            if item.message.kind == "gradient":
                # Our own, not yet published message: adding the vote fields is safe.
                item.message.meta["vote"] = vote
                if self.adaptive_compression:
                    item.message.meta["compress"] = self._compress
        self.counters["votes_compress"] += int(vote)
        self._local_steps += 1
        if self._local_steps % self.epoch_steps == 0:
            self._signal.new_epoch()
        return out

    def _after_step(self, step: int, contributions: list[UpdateMessage]) -> None:
        if not self.adaptive_compression:
            return
        self.counters["compressed_steps"] += int(self._compress)
        self._compress = majority_compress(c.meta.get("vote") is True for c in contributions)

    # -- persistence and stats -----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["scadles"] = {
            "compress": self._compress,
            "local_steps": self._local_steps,
            "signal": self._signal.state_dict(),
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        own = state["scadles"]
        self._compress = bool(own["compress"])
        self._local_steps = int(own["local_steps"])
        self._signal = ScadlesSignal(self.delta)
        self._signal.load_state_dict(own["signal"])

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        steps = self.counters.get("steps", 0)
        history = self._signal.history()
        stats.update(
            {
                "adaptive_compression": self.adaptive_compression,
                "compress_next": self.compress_next,
                # Adaptive runs only; without the vote the codec alone decides (see the metrics).
                "compressed_fraction": self.counters.get("compressed_steps", 0) / steps if steps else 0.0,
                "delta": self.delta,
                "signal_epoch_mean": self._signal.epoch_mean,
                "signal_quantiles": _quantiles(history),
            }
        )
        return stats


def _quantiles(values: list[float]) -> dict[str, float] | None:
    """p10 / p50 / p90 of the recent signals, for calibrating ``delta``."""
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p10": at(0.1), "p50": at(0.5), "p90": at(0.9)}
