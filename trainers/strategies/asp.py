"""Asynchronous parameter-server SGD (ASP), with an optional SSP-style staleness bound.

Workers never wait: each sends the gradient of every local step, stamped with the
model version it was computed on, and adopts any newer model snapshot it receives.
The server applies each gradient on arrival, measures its staleness
``server_version - base_version``, and publishes a snapshot every
``publish_every`` updates (and/or every ``publish_interval_s`` via ``poll``).
With ``max_staleness`` set, a staler gradient is rejected, counted and never
applied, and its sender gets a fresh snapshot. (Classic SSP instead makes fast
workers block; bounding by rejection keeps workers wait-free.)

Robust aggregation (server side, :class:`trainers.aggregation.RobustAggregation`): a
per-gradient norm bound (``max_update_norm``, clip or reject, counted per sender), and
coordinate-wise ``trimmed_mean`` / ``median``. A median needs several gradients at once,
so with those rules (or with ``aggregate_window`` set) the server collects gradients in a
window of one slot per sender (:class:`trainers.aggregation.UpdateWindow`; a sender's
gradients within a window are averaged into its slot) and, once ``aggregate_window``
senders hold a slot (default: the job's workers; at most the live ones), applies their
aggregate as one step with ``lr_scale = slots``, so a window moves the model as far as
its gradients applied one by one would on average.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from edgestream.trainers.aggregation import scale_tensors
from edgestream.trainers.errors import StrategyError
from edgestream.trainers.local import StepResult
from edgestream.trainers.messages import Outgoing, UpdateMessage
from edgestream.trainers.staleness import StalenessTracker
from edgestream.trainers.strategies.base import (
    StrategyContext,
    SyncStrategy,
    register,
    snapshot_message,
)
from edgestream.trainers.strategies.windowed import WindowedServer

StalenessLR = Literal["none", "inverse"]


class ASPWorker(SyncStrategy):
    """Worker side: send every local gradient, adopt newer snapshots.

    Invariant: the model version only moves forward, and only by adopting a server
    snapshot; ``step`` on outgoing gradients strictly increases (the server's
    duplicate filter relies on it).
    """

    name = "asp"
    role = "worker"
    subscribes = ("models",)

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self._synced = not ctx.joining
        self._local_step = 0

    def can_train(self) -> bool:
        return self._synced

    def on_local_step(self, result: StepResult) -> list[Outgoing]:
        if not self._synced:
            raise StrategyError(f"asp worker {self.worker_id}: local step before the first snapshot")
        msg = UpdateMessage(
            kind="gradient",
            sender=self.worker_id,
            step=self._local_step,
            base_version=result.base_version,
            batch_size=result.batch_size,
            tensors=result.gradients,
            buffers=result.buffer_deltas,
            meta={"loss": result.loss},
        )
        self._local_step += 1
        self.counters["gradients_sent"] += 1
        return [Outgoing("gradients", msg)]

    def on_message(self, msg: UpdateMessage) -> list[Outgoing]:
        if msg.kind != "model":
            self.counters["ignored_messages"] += 1
            return []
        last = msg.meta.get("last_step")
        if msg.meta.get("worker") == self.worker_id and isinstance(last, int) and not isinstance(last, bool):
            # A snapshot the server sent this worker alone (it joined or rejoined): go on
            # from the last step the server has of it, or its duplicate filter would drop
            # the gradients of a worker that restarted with an older (or no) step counter.
            if last + 1 > self._local_step:
                self._local_step = last + 1
                self.counters["step_counter_resumed"] += 1
        if self._synced and msg.base_version <= self.trainer.version:
            self.counters["snapshots_ignored"] += 1  # duplicate or reordered older snapshot
            return []
        self.trainer.load_snapshot(msg.tensors, msg.buffers, msg.base_version)
        self._synced = True
        self.counters["snapshots_adopted"] += 1
        return []

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update({"synced": self._synced, "local_step": self._local_step})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._synced = bool(state["synced"])
        self._local_step = int(state["local_step"])


class ASPServer(WindowedServer, SyncStrategy):
    """Server side: apply gradients on arrival, bound staleness, publish snapshots.

    Invariant: ``staleness`` holds only applied updates, so with ``max_staleness``
    set its max never exceeds the bound; rejected ones go to ``rejected_staleness``.
    A gradient is applied at most once per ``(sender, step)``.
    """

    name = "asp"
    role = "server"
    subscribes = ("gradients",)

    def __init__(
        self,
        ctx: StrategyContext,
        *,
        publish_every: int = 1,
        publish_interval_s: float | None = None,
        max_staleness: int | None = None,
        staleness_lr: StalenessLR = "none",
        aggregation: str = "mean",
        trim: int | None = None,
        max_update_norm: float | None = None,
        norm_policy: str = "clip",
        krum_f: int | None = None,
        aggregate_window: int | None = None,
    ) -> None:
        """``publish_every``: updates between snapshots (0: only by timer);
        ``publish_interval_s``: also publish from ``poll`` when this much time passed
        and something changed; ``max_staleness``: reject staler gradients (None: ASP,
        no bound); ``staleness_lr``: ``"inverse"`` scales the step by ``1 / (1 + staleness)``
        (with a window: each gradient, by its staleness on arrival). ``aggregation``,
        ``trim``, ``krum_f``, ``max_update_norm``, ``norm_policy``: robust aggregation
        (:class:`trainers.aggregation.RobustAggregation`); ``aggregate_window``: senders per
        aggregate (default: none for ``mean``, the job's workers for the robust rules)."""
        super().__init__(ctx)
        self._setup_robust("asp server", "mean", ctx.members, aggregate_window, aggregation=aggregation, trim=trim,
                           krum_f=krum_f, max_update_norm=max_update_norm, norm_policy=norm_policy)
        if publish_every < 0:
            raise StrategyError(f"publish_every must be >= 0, got {publish_every}")
        if max_staleness is not None and max_staleness < 0:
            raise StrategyError(f"max_staleness must be >= 0, got {max_staleness}")
        if staleness_lr not in ("none", "inverse"):
            raise StrategyError(f"staleness_lr must be 'none' or 'inverse', got {staleness_lr!r}")
        self.publish_every = publish_every
        self.publish_interval_s = publish_interval_s
        self.max_staleness = max_staleness
        self.staleness_lr = staleness_lr
        self.rejected_staleness = StalenessTracker()
        self._workers: set[str] = set(ctx.members)
        self._last_step: dict[str, int] = {}
        self._updates_since_publish = 0
        self._last_publish_at: float | None = None

    def can_train(self) -> bool:
        return False

    def on_local_step(self, result: StepResult) -> list[Outgoing]:
        raise StrategyError("the asp server does not run local steps")

    def on_message(self, msg: UpdateMessage) -> list[Outgoing]:
        if msg.kind != "gradient":
            self.counters["ignored_messages"] += 1
            return []
        last = self._last_step.get(msg.sender)
        if last is not None and msg.step <= last:
            self.counters["duplicates"] += 1
            return []
        self._last_step[msg.sender] = msg.step
        staleness = self.trainer.version - msg.base_version
        if staleness < 0:
            self.counters["rejected_future"] += 1  # computed on a version this server never had
            return []
        if self.max_staleness is not None and staleness > self.max_staleness:
            self.counters["rejected_stale"] += 1
            self.rejected_staleness.record(staleness)
            return [Outgoing("models", self._snapshot(msg.sender), to=msg.sender)]
        lr_scale = 1.0 / (1 + staleness) if self.staleness_lr == "inverse" else 1.0
        gradients = msg.tensors
        if self.robust.max_update_norm is not None:
            gradients = self.robust.bound_counted(msg.tensors, msg.sender, self.counters)
            if gradients is None:
                return []
        if self._window is not None:
            return self._collect(msg, gradients, lr_scale)
        self.trainer.apply_gradient(gradients, lr_scale=lr_scale, buffer_deltas=msg.buffers or None)
        self.staleness.record(staleness)
        self.counters["applied"] += 1
        return self._updated()

    def _updated(self) -> list[Outgoing]:
        self._updates_since_publish += 1
        if self.publish_every and self._updates_since_publish >= self.publish_every:
            return [self._publish()]
        return []

    def _collect(self, msg: UpdateMessage, gradients: dict[str, Any], lr_scale: float) -> list[Outgoing]:
        """Put a gradient into its sender's slot; apply the window's aggregate once it is full."""
        if lr_scale != 1.0:
            gradients = scale_tensors(gradients, lr_scale)
        window = self._fill_window(msg, gradients)
        if window is None:
            return []
        self.trainer.apply_gradient(window.tensors, lr_scale=float(len(window.slots)), buffer_deltas=window.buffers)
        self._settle_window(window)
        return self._updated()

    def poll(self, now: float) -> list[Outgoing]:
        if self.publish_interval_s is None or self._updates_since_publish == 0:
            return []
        if self._last_publish_at is not None and now - self._last_publish_at < self.publish_interval_s:
            return []
        self._last_publish_at = now
        return [self._publish()]

    def on_membership(self, workers: Sequence[str]) -> list[Outgoing]:
        """Send each newly seen worker the current model (and the last step the server has
        of it, so a worker that rejoins without its step counter goes on after it)."""
        joined = sorted(set(workers) - self._workers)
        self._workers = set(workers)
        self.counters["snapshots_sent"] += len(joined)
        return [Outgoing("models", self._snapshot(worker), to=worker) for worker in joined]

    def _snapshot(self, worker: str | None = None) -> UpdateMessage:
        """The current model; addressed to ``worker`` it also says the last step the server has of it."""
        meta = {} if worker is None else {"worker": worker, "last_step": self._last_step.get(worker, -1)}
        return snapshot_message(self.trainer, self.worker_id, meta=meta)

    def _publish(self) -> Outgoing:
        self._updates_since_publish = 0
        self.counters["snapshots_published"] += 1
        return Outgoing("models", self._snapshot())

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            {
                "rejected_staleness": self.rejected_staleness.state_dict(),
                "workers": sorted(self._workers),
                "last_step": dict(self._last_step),
                "updates_since_publish": self._updates_since_publish,
                "last_publish_at": self._last_publish_at,
                "window": self._window.state_dict() if self._window is not None else None,
            }
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rejected_staleness.load_state_dict(state["rejected_staleness"])
        self._workers = set(state["workers"])
        self._last_step = {str(k): int(v) for k, v in state["last_step"].items()}
        self._updates_since_publish = int(state["updates_since_publish"])
        self._last_publish_at = state["last_publish_at"]
        if self._window is not None:
            self._window.load_state_dict(state.get("window") or {})  # absent in older checkpoints

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats.update(
            {
                "max_staleness": self.max_staleness,
                "rejected_staleness": self.rejected_staleness.summary(),
                "workers": sorted(self._workers),
                "aggregation": {**self.robust.describe(), "aggregate_window": self.aggregate_window},
                "window_senders": self._window.senders if self._window is not None else None,
            }
        )
        return stats


_SERVER_PARAMS = frozenset({
    "publish_every", "publish_interval_s", "max_staleness", "staleness_lr",
    "aggregation", "trim", "krum_f", "max_update_norm", "norm_policy", "aggregate_window",
})



@register("asp", builds=(ASPWorker, ASPServer))
def create_asp(ctx: StrategyContext, **params: Any) -> SyncStrategy:
    """Build the ASP worker or server for ``ctx.role``; server params as in :class:`ASPServer`."""
    unknown = set(params) - _SERVER_PARAMS
    if unknown:
        raise StrategyError(f"unknown asp parameters {sorted(unknown)}; known: {sorted(_SERVER_PARAMS)}")
    if ctx.role == "server":
        return ASPServer(ctx, **params)
    return ASPWorker(ctx)  # server parameters are job-wide; the worker needs none of them
