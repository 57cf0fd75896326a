"""Fixed-period local SGD: every worker trains alone for H steps, then all replicas average.

Protocol (BSP's, with a round of H local steps where BSP has one step):

1. Round ``r`` starts from a model every member holds bitwise identically (the
   *anchor*, at version ``v_r``). Each member takes ``period_steps`` (H) local SGD
   steps on its own gradients (``trainer.apply_gradient``: version ``v_r + k`` after
   ``k`` steps), then publishes its change since the anchor, ``delta = w - anchor``
   (parameters, and floating-point BatchNorm buffers), as a ``delta`` message on the
   ``gradients`` log: ``step = r``, ``base_version = v_r``, ``batch_size`` = the
   samples of its H steps. It may not train again until round ``r`` is averaged.
2. Every worker reads the log including its own deltas; its own counts only when it
   comes back, so all replicas decide from the same sequence.
3. Round ``r`` completes when the deltas of every member of the round are in. Each
   replica sets ``anchor + weighted_mean(deltas)`` (weights ``b_i / B``, sorted
   worker order) as its model, with version ``v_{r+1} = v_r + H + 1``: the same
   anchor, inputs, order and arithmetic everywhere, so parameters and buffers are
   bitwise identical after every round (not in between: local steps diverge).
4. Optimizer momentum (``momentum_policy``): ``"local"`` (default) keeps each worker's own
   momentum buffer across rounds, as in the local SGD literature; only parameters
   and buffers are averaged. ``"reset"`` clears it at every average, so the whole
   optimizer state is identical too (and H = 1 is then plain averaged SGD without
   momentum). With ``"local"`` and H = 1, constant batch sizes give BSP's update
   up to rounding (the weighted sum of momenta is the momentum of the weighted sum).
5. Membership is BSP's (views on the gradients log; this class is a
   :class:`~trainers.strategies.bsp.BSPStrategy`): a view that removes a worker
   releases the pending round at once; joiners enter at the next round and get a
   snapshot of the round's anchor (parameters and buffers, fresh momentum, the
   round number in ``meta.round``) from the lowest model holder.

Staleness: every delta is applied to the anchor it was computed from, so each one
records 0 when its round is averaged. Local steps are the worker's own and record
nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from edgestream.trainers.errors import StrategyError
from edgestream.trainers.local import StepResult
from edgestream.trainers.messages import Outgoing, UpdateMessage
from edgestream.trainers.strategies.base import Observations, StrategyContext, register
from edgestream.trainers.strategies.bsp import BSPStrategy

MOMENTUM_POLICIES = ("local", "reset")


class LocalSGDStrategy(BSPStrategy):
    """Model averaging every ``period_steps`` local steps, over BSP's log and views.

    Invariant: after round ``r`` is averaged, every active member holds the same
    parameters and buffers at version ``v_{r+1}``; a delta is only ever added to the
    anchor it was computed from.
    """

    name = "localsgd"
    role = "worker"
    subscribes = ("gradients", "models")
    replicas_identical = True

    def __init__(
        self,
        ctx: StrategyContext,
        *,
        period_steps: int = 4,
        momentum_policy: str = "local",
        max_future_steps: int = 2,
        max_prejoin_messages: int = 10_000,
        sync_retry_s: float = 5.0,
    ) -> None:
        """``period_steps``: local steps per round (H). ``momentum_policy``: ``"local"`` (each
        worker keeps its own) or ``"reset"`` (cleared at every average).
        ``max_future_steps``: deltas more than this many *rounds* ahead are dropped.
        The other parameters are BSP's."""
        super().__init__(
            ctx,
            max_future_steps=max_future_steps,
            max_prejoin_messages=max_prejoin_messages,
            sync_retry_s=sync_retry_s,
        )
        if isinstance(period_steps, bool) or not isinstance(period_steps, int) or period_steps < 1:
            raise StrategyError(f"period_steps must be an int >= 1, got {period_steps!r}")
        if momentum_policy not in MOMENTUM_POLICIES:
            raise StrategyError(f"momentum_policy must be one of {MOMENTUM_POLICIES}, got {momentum_policy!r}")
        self.period_steps = period_steps
        self.momentum_policy = momentum_policy
        self._round = 0
        self._local_steps = 0
        self._round_samples = 0
        self._round_loss = 0.0
        # The round's starting model; None means "the trainer holds it" (no local step yet).
        self._anchor: dict[str, dict[str, torch.Tensor]] | None = None
        self._anchor_version = self.trainer.version
        #: ``parameter_digest()`` of the model the last averaged round produced ("" before one).
        self._round_digest = ""

    # -- read-only view -------------------------------------------------------------

    @property
    def round(self) -> int:
        """The round whose deltas are being collected."""
        return self._round

    @property
    def local_steps(self) -> int:
        """Local steps taken in the current round (0..H)."""
        return self._local_steps

    # -- hooks ----------------------------------------------------------------------

    def can_train(self) -> bool:
        return (
            self._synced
            and self._active
            and self.worker_id in self._members
            and self._local_steps < self.period_steps
        )

    def on_local_step(self, result: StepResult) -> list[Outgoing]:
        if not self.can_train():
            raise StrategyError(f"localsgd {self.worker_id}: local step while waiting ({self._waiting_reason()})")
        if result.base_version != self.trainer.version:
            raise StrategyError(
                f"localsgd {self.worker_id}: result computed on version {result.base_version}, "
                f"model is at {self.trainer.version}"
            )
        anchor = self._current_anchor()
        self.trainer.apply_gradient(result.gradients, buffer_deltas=result.buffer_deltas)
        self._local_steps += 1
        self._round_samples += result.batch_size
        self._round_loss += result.loss * result.batch_size
        self.counters["local_steps"] += 1
        if self._local_steps < self.period_steps:
            return []
        self.counters["deltas_sent"] += 1
        params = self.trainer.get_parameters()
        buffers = self.trainer.get_buffers()
        msg = UpdateMessage(
            kind="delta",
            sender=self.worker_id,
            step=self._round,
            base_version=self._anchor_version,
            batch_size=self._round_samples,
            tensors={n: params[n] - anchor["params"][n] for n in params},
            buffers={n: buffers[n] - anchor["buffers"][n] for n in buffers if buffers[n].is_floating_point()},
            meta={
                "loss": self._round_loss / max(1, self._round_samples),
                "view_id": self._view_id,
                "local_steps": self._local_steps,
            },
        )
        return [Outgoing("gradients", msg)]

    def on_message(self, msg: UpdateMessage) -> list[Outgoing]:
        if msg.kind == "gradient":
            self.counters["ignored_messages"] += 1  # not part of this protocol
            return []
        if msg.kind == "delta" and self._active and self._synced:
            return self._on_delta(msg)
        return super().on_message(msg)  # views, sync requests, snapshots; buffering while joining

    # -- deltas and averaging -------------------------------------------------------

    def _on_delta(self, msg: UpdateMessage) -> list[Outgoing]:
        if msg.step < self._round:
            self.counters["late_deltas"] += 1  # averaged already (or from before we joined)
            return []
        if msg.step > self._round + self.max_future_steps:
            self.counters["rejected_future"] += 1
            return []
        if msg.step == self._round and msg.base_version != self._anchor_version:
            self.counters["rejected_inconsistent"] += 1
            return []
        bucket = self._pending.setdefault(msg.step, {})
        if msg.sender in bucket:
            self.counters["duplicates"] += 1
            return []
        bucket[msg.sender] = msg
        return self._try_complete()

    def _try_complete(self) -> list[Outgoing]:
        out: list[Outgoing] = []
        while self._active and self._synced:
            bucket = self._pending.get(self._round, {})
            if not self._members or any(member not in bucket for member in self._members):
                break
            contributions = [bucket[member] for member in self._members]  # sorted order
            anchor = self._current_anchor()
            mean, buffer_mean = self._combine(contributions)
            params = {n: anchor["params"][n] + mean[n] for n in anchor["params"]}
            buffers = dict(anchor["buffers"])
            for n, d in (buffer_mean or {}).items():
                buffers[n] = anchor["buffers"][n] + d
            for contribution in contributions:
                self.staleness.record(self._anchor_version - contribution.base_version)
            self.counters["non_member_gradients"] += len(bucket) - len(contributions)
            version = self._anchor_version + self.period_steps + 1
            self.trainer.set_parameters(params, version=version)
            self.trainer.set_buffers(buffers)
            if self.momentum_policy == "reset":
                self.trainer.set_momentum({})
            self._veterans = self._members
            self.counters["rounds"] += 1
            # What every replica holds right after this average (the next round's anchor):
            # identical everywhere, unlike the model a moment later (local steps diverge).
            self._round_digest = self.trainer.parameter_digest()
            for old in [r for r in self._pending if r <= self._round]:
                del self._pending[old]
            self._start_round(self._round + 1, version)
            self._drop_inconsistent()
            if self._next_members is not None:
                out += self._enter_next_view()
        return out

    def _start_round(self, round_index: int, version: int) -> None:
        self._round = round_index
        self._anchor_version = version
        self._anchor = None  # the trainer holds it until the first local step
        self._local_steps = 0
        self._round_samples = 0
        self._round_loss = 0.0

    def _drop_inconsistent(self) -> None:
        """Deltas that arrived a round early are checked against the new anchor now."""
        bucket = self._pending.get(self._round, {})
        for sender in [s for s, m in bucket.items() if m.base_version != self._anchor_version]:
            del bucket[sender]
            self.counters["rejected_inconsistent"] += 1

    def _current_anchor(self) -> dict[str, dict[str, torch.Tensor]]:
        if self._anchor is None:
            if self._local_steps:
                raise StrategyError(f"localsgd {self.worker_id}: lost the anchor of round {self._round}")
            self._anchor = {"params": self.trainer.get_parameters(), "buffers": self.trainer.get_buffers()}
        return self._anchor

    # -- membership: BSP's views; snapshots carry the anchor and the round ------------------

    def _snapshot_for(self, joiner: str) -> Outgoing:
        self.counters["snapshots_sent"] += 1
        anchor = self._current_anchor()
        snapshot = UpdateMessage(
            kind="model",
            sender=self.worker_id,
            step=self._anchor_version,
            base_version=self._anchor_version,
            tensors=dict(anchor["params"]),
            buffers=dict(anchor["buffers"]),
            meta={**self._view_meta(), "op": "localsgd_snapshot", "round": self._round},
        )
        return Outgoing("models", snapshot, to=joiner)

    def _adopt_snapshot(self, msg: UpdateMessage) -> list[Outgoing]:
        round_index = msg.meta.get("round")
        if isinstance(round_index, bool) or not isinstance(round_index, int) or round_index < 0:
            self.counters["snapshots_ignored"] += 1
            return []
        # Set the round before BSP adopts and replays what was buffered meanwhile. If BSP
        # refuses the snapshot the worker stays unsynced and the next snapshot resets this.
        self._start_round(round_index, msg.base_version)
        self._pending.clear()
        return super()._adopt_snapshot(msg)

    def _readmitted(self, proposed: tuple[str, ...]) -> list[Outgoing]:
        out = super()._readmitted(proposed)
        self._start_round(self._round, self.trainer.version)  # replaced by the snapshot's
        return out

    def _waiting_reason(self) -> str:
        if not self._synced or not self._active or self.worker_id not in self._members:
            return super()._waiting_reason()
        missing = [m for m in self._members if m not in self._pending.get(self._round, {})]
        return f"round {self._round} waits for {missing}"

    # -- persistence and stats --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            {
                "round": self._round,
                "local_steps": self._local_steps,
                "round_samples": self._round_samples,
                "round_loss": self._round_loss,
                "anchor": self._anchor,
                "anchor_version": self._anchor_version,
                "round_digest": self._round_digest,
            }
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._round = int(state["round"])
        self._local_steps = int(state["local_steps"])
        self._round_samples = int(state["round_samples"])
        self._round_loss = float(state["round_loss"])
        anchor = state["anchor"]
        self._anchor = (
            None if anchor is None else {part: dict(anchor[part]) for part in ("params", "buffers")}
        )
        self._anchor_version = int(state["anchor_version"])
        self._round_digest = str(state.get("round_digest", ""))

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats.update(
            {
                "round": self._round,
                "local_steps": self._local_steps,
                "rounds_averaged": self.counters["rounds"],
                "round_digest": self._round_digest,
                "period_steps": self.period_steps,
                "momentum_policy": self.momentum_policy,
            }
        )
        return stats

    def observations(self) -> Observations:
        """Local steps committed so far: ``period_steps`` in every delta sent."""
        return Observations(committed_local_steps=self.counters["deltas_sent"] * self.period_steps)


_PARAMS = frozenset({"period_steps", "momentum_policy", "max_future_steps", "max_prejoin_messages", "sync_retry_s"})


@register("localsgd", builds=(LocalSGDStrategy,))
def create_localsgd(ctx: StrategyContext, **params: Any) -> LocalSGDStrategy:
    """Build a local SGD worker; an unknown parameter is refused by name (a typo in the
    job file must not silently fall back to a default)."""
    unknown = set(params) - _PARAMS
    if unknown:
        raise StrategyError(f"unknown localsgd parameters {sorted(unknown)}; known: {sorted(_PARAMS)}")
    return LocalSGDStrategy(ctx, **params)
