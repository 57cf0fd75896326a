"""Stale synchronous parallel (SSP): parameter-server SGD where fast workers block.

Each worker counts its local steps: its *clock* is the number of gradients it has
sent, and a gradient's ``step`` is the sender's clock before that step. The server
applies every gradient on arrival (as the ASP server does), tracks each live
worker's clock (``last step received + 1``) and puts the slowest live worker's
clock, ``min_clock``, in the ``meta`` of every model snapshot it sends. A worker
whose clock is more than ``staleness`` (s) steps ahead of the last ``min_clock`` it
was told may not train (``can_train()`` is false) until a snapshot says the slowest
worker caught up. With s = 0 this is lockstep: nobody starts step t + 1 before every
live worker's step t reached the server.

Bound on version staleness. With N live workers, every gradient the server applies
has ``server_version - base_version <= s + (N - 1) * (2 * s + 1)``. Worker i computes
step c on a model at least as new as the snapshot (version v0) that told it a
``min_clock`` m with ``c <= m + s``. Between v0 and the arrival of step c the server
applies at most ``c - m <= s`` earlier gradients of i (its clock was >= m at v0), and
of every other worker j only steps ``m .. c + s``: j's clock was >= m at v0, and j
can compute a step k only when ``k <= min_clock + s``, where that ``min_clock`` is at
most i's clock before step c arrives, i.e. at most c. That is at most
``c + s - m + 1 <= 2 * s + 1`` per other worker. The server also keeps the clock
gap ``max clock - min clock`` of its live workers, which never exceeds ``s + 1``.

Membership: a worker that leaves no longer counts towards ``min_clock`` (blocked
workers are released by a snapshot sent at once); one that joins starts at the
current ``min_clock`` (its addressed snapshot moves its step counter there). A
gradient from a sender the server does not count as live is dropped
(``not_member``): it could neither be held back nor bounded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from edgestream.trainers.errors import StrategyError
from edgestream.trainers.local import StepResult
from edgestream.trainers.messages import Outgoing, UpdateMessage
from edgestream.trainers.strategies.asp import ASPServer, ASPWorker, StalenessLR
from edgestream.trainers.strategies.base import (
    Observations,
    StrategyContext,
    SyncStrategy,
    register,
)

DEFAULT_STALENESS = 3


def staleness_bound(staleness: int, workers: int) -> int:
    """Largest version staleness an applied gradient can have with clock bound
    ``staleness`` and ``workers`` live workers (see the module docstring)."""
    return staleness + max(0, workers - 1) * (2 * staleness + 1)


def _check_bound(staleness: Any) -> int:
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise StrategyError(f"staleness must be an int >= 0, got {staleness!r}")
    return staleness


def _clock_of(meta: dict[str, Any]) -> int | None:
    value = meta.get("min_clock")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


class SSPWorker(ASPWorker):
    """Worker side: ASP's worker, blocked while its clock is more than s ahead of the
    slowest live worker's clock as last told by the server.

    Invariant: a gradient of step c is only ever produced when ``c <= min_clock + s``;
    ``min_clock`` only grows. Blocked polls and blocked time (measured between
    ``poll(now)`` calls, so at the resolution of the adapter's loop) are counted.
    """

    name = "ssp"

    def __init__(self, ctx: StrategyContext, *, staleness: int = DEFAULT_STALENESS) -> None:
        super().__init__(ctx)
        self.bound = _check_bound(staleness)
        self._min_clock = 0
        self._blocked_at: float | None = None  # time of the last poll that found us blocked
        self.blocked_seconds = 0.0

    @property
    def clock(self) -> int:
        """Local steps sent so far (the ``step`` of the next gradient)."""
        return self._local_step

    @property
    def min_clock(self) -> int:
        return self._min_clock

    @property
    def blocked(self) -> bool:
        """True when SSP (not a missing model) keeps this worker from training."""
        return self._synced and self._local_step > self._min_clock + self.bound

    def can_train(self) -> bool:
        return super().can_train() and not self.blocked

    def on_local_step(self, result: StepResult) -> list[Outgoing]:
        if self.blocked:
            raise StrategyError(
                f"ssp worker {self.worker_id}: local step at clock {self._local_step} while the slowest "
                f"worker is at {self._min_clock} (bound {self.bound})"
            )
        return super().on_local_step(result)

    def on_message(self, msg: UpdateMessage) -> list[Outgoing]:
        if msg.kind == "model":
            told = _clock_of(msg.meta)
            if told is not None and told > self._min_clock:
                self._min_clock = told  # read from any snapshot, adopted or not: reordering is harmless
        return super().on_message(msg)

    def poll(self, now: float) -> list[Outgoing]:
        if self.blocked:
            self.counters["blocked_polls"] += 1
            if self._blocked_at is None:
                self.counters["blocked_episodes"] += 1
            else:
                self.blocked_seconds += max(0.0, now - self._blocked_at)
            self._blocked_at = now
        elif self._blocked_at is not None:
            self.blocked_seconds += max(0.0, now - self._blocked_at)
            self._blocked_at = None
        return []

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            {"min_clock": self._min_clock, "blocked_at": self._blocked_at, "blocked_seconds": self.blocked_seconds}
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._min_clock = int(state["min_clock"])
        self._blocked_at = None if state["blocked_at"] is None else float(state["blocked_at"])
        self.blocked_seconds = float(state["blocked_seconds"])

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats.update(
            {
                "staleness_bound": self.bound,
                "clock": self._local_step,
                "min_clock": self._min_clock,
                "blocked": self.blocked,
                "blocked_seconds": self.blocked_seconds,
            }
        )
        return stats

    def observations(self) -> Observations:
        """Time blocked so far (measured at ``poll``)."""
        return Observations(blocked_seconds=self.blocked_seconds)


class SSPServer(ASPServer):
    """Server side: ASP's server plus per-worker clocks; every snapshot carries the
    slowest live worker's clock, and one is broadcast whenever that clock advances.

    Invariant: ``min_clock`` never decreases; the gap between the fastest and the
    slowest live worker's clock (``max_clock_gap``, the largest seen) stays <= s + 1.
    """

    name = "ssp"

    def __init__(
        self,
        ctx: StrategyContext,
        *,
        staleness: int = DEFAULT_STALENESS,
        publish_every: int = 1,
        publish_interval_s: float | None = None,
        staleness_lr: StalenessLR = "none",
    ) -> None:
        super().__init__(
            ctx, publish_every=publish_every, publish_interval_s=publish_interval_s, staleness_lr=staleness_lr
        )
        self.bound = _check_bound(staleness)
        self._clocks: dict[str, int] = {worker: 0 for worker in ctx.members}
        self._min_clock = 0
        self._published_min = 0  # min_clock carried by the last broadcast snapshot
        self.max_clock_gap = 0
        # The most workers live at once so far: the version-staleness bound in force then is
        # the largest an applied gradient can have had (a leaver at the end lowers only the
        # current bound, not what the run was held to).
        self.most_workers = len(self._workers)

    @property
    def min_clock(self) -> int:
        return self._min_clock

    def clocks(self) -> dict[str, int]:
        """Clocks of the live workers."""
        return {worker: self._clocks.get(worker, 0) for worker in sorted(self._workers)}

    def on_message(self, msg: UpdateMessage) -> list[Outgoing]:
        if msg.kind == "gradient":
            if msg.sender not in self._workers:
                self.counters["not_member"] += 1
                return []
            last = self._last_step.get(msg.sender)
            if last is None or msg.step > last:
                # Before ASP applies it, so the snapshot it may publish carries the new min clock.
                self._clocks[msg.sender] = max(self._clocks.get(msg.sender, 0), msg.step + 1)
                self._update_min()
        out = super().on_message(msg)  # duplicates, future versions, apply, staleness, publish_every
        return out + self._release(out)

    def on_membership(self, workers: Sequence[str]) -> list[Outgoing]:
        live = set(workers)
        joined = sorted(live - self._workers)
        left = self._workers - live
        self._workers -= left
        self._update_min()  # the survivors' min: leavers no longer hold anyone back
        for worker in joined:
            clock = max(self._clocks.get(worker, 0), self._last_step.get(worker, -1) + 1, self._min_clock)
            self._clocks[worker] = clock
            if clock > 0:
                self._last_step[worker] = clock - 1  # its step counter goes on from here
        self.counters["workers_left"] += len(left)
        self.counters["workers_joined"] += len(joined)
        out = super().on_membership(workers)  # addressed snapshots (with min_clock) to joiners
        self.most_workers = max(self.most_workers, len(self._workers))
        self._update_min()
        return out + self._release(out)

    def _update_min(self) -> None:
        if not self._workers:
            return
        clocks = [self._clocks.get(worker, 0) for worker in self._workers]
        self._min_clock = max(self._min_clock, min(clocks))
        self.max_clock_gap = max(self.max_clock_gap, max(clocks) - min(clocks))

    def _release(self, out: list[Outgoing]) -> list[Outgoing]:
        """A broadcast snapshot if the min clock moved past the last one published."""
        if self._min_clock <= self._published_min or any(o.to is None for o in out):
            return []
        self.counters["release_snapshots"] += 1
        return [self._publish()]

    def _snapshot(self, worker: str | None = None) -> UpdateMessage:
        msg = super()._snapshot(worker)
        msg.meta["min_clock"] = self._min_clock
        return msg

    def _publish(self) -> Outgoing:
        self._published_min = max(self._published_min, self._min_clock)
        return super()._publish()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            {
                "clocks": dict(self._clocks),
                "min_clock": self._min_clock,
                "published_min": self._published_min,
                "max_clock_gap": self.max_clock_gap,
                "most_workers": self.most_workers,
            }
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._clocks = {str(k): int(v) for k, v in state["clocks"].items()}
        self._min_clock = int(state["min_clock"])
        self._published_min = int(state["published_min"])
        self.max_clock_gap = int(state["max_clock_gap"])
        self.most_workers = max(int(state.get("most_workers", 0)), len(self._workers))

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats.pop("max_staleness", None)
        stats.update(
            {
                "staleness_bound": self.bound,
                # What the run was held to: the bound with the most workers live at once.
                "version_staleness_bound": staleness_bound(self.bound, self.most_workers),
                "clocks": self.clocks(),
                "min_clock": self._min_clock,
                "max_clock_gap": self.max_clock_gap,
            }
        )
        return stats

    def observations(self) -> Observations:
        """The live workers' current clock gap (0 with none)."""
        clocks = self.clocks().values()
        return Observations(clock_gap_steps=max(clocks) - min(clocks) if clocks else 0)


_SERVER_PARAMS = frozenset({"publish_every", "publish_interval_s", "staleness_lr"})


@register("ssp", builds=(SSPWorker, SSPServer))
def create_ssp(ctx: StrategyContext, **params: Any) -> SyncStrategy:
    """Build the SSP worker or server for ``ctx.role``. ``staleness`` (s, default 3) is
    job-wide (both roles need it); the other parameters are the ASP server's."""
    unknown = set(params) - _SERVER_PARAMS - {"staleness"}
    if unknown:
        known = sorted(_SERVER_PARAMS | {"staleness"})
        raise StrategyError(f"unknown ssp parameters {sorted(unknown)}; known: {known}")
    staleness = _check_bound(params.pop("staleness", DEFAULT_STALENESS))
    if ctx.role == "server":
        return SSPServer(ctx, staleness=staleness, **params)
    return SSPWorker(ctx, staleness=staleness)
