"""Bulk-synchronous SGD: every member's gradient for step t, sample-weighted, on every replica.

Protocol (each worker runs the same deterministic state machine):

1. Step ``t`` is computed on model version ``t`` (``step == version``). The worker
   publishes its gradient on ``gradients`` and may not train again until step
   ``t`` is aggregated (``can_train()`` is false meanwhile).
2. Every worker consumes the ``gradients`` channel *including its own messages*:
   a worker's own gradient counts only when it comes back, so all replicas decide
   from the same sequence of messages.
3. Step ``t`` completes when the gradients of all members of the step are in.
   They are combined with :func:`trainers.aggregation.weighted_mean` in sorted
   worker order (weights ``b_i / B_t``), the learning rate is optionally scaled by
   ``B_t / reference_batch`` (ScaDLES linear scaling), BatchNorm buffer deltas are
   averaged the same way, and the version becomes ``t + 1``. Same inputs, same
   order, same arithmetic: replicas stay bitwise identical.
   With robust aggregation (``aggregation=trimmed_mean|median``, ``max_update_norm``;
   :class:`trainers.aggregation.RobustAggregation`) each gradient first passes the norm
   bound (clipped, or rejected: then it counts as absent from step ``t``, which still
   completes), and the kept ones are combined coordinate-wise, still in sorted worker
   order; every decision depends on the logged gradients only, so replicas still agree.
4. Membership changes are ``control`` messages (``op: view``) on the *same*
   ``gradients`` channel, so everyone applies them at the same point of that log.
   A view applies to the pending step at once for leavers (nobody waits for a
   worker that is gone) and from the next step for joiners; the lowest surviving
   member sends each joiner a full snapshot (parameters, buffers, momentum) on
   ``models`` when the joiner's first step begins.
5. A worker a view removed keeps following the views (only them); a later view that
   names it again makes it a joiner: its model is stale, so it waits for the snapshot
   like any joiner (a killed worker restarted from its checkpoint after the others
   dropped it comes back this way). A ``sync_request`` from a member that still counts
   as holding the model means it lost its state (restarted without a checkpoint): the
   proposer takes it out with one view and lets it back in, as a joiner, with the next.

Requirements on the pipeline: ``gradients`` is one totally ordered log (a single
partition) that every worker reads from before it announces itself; messages
addressed ``to`` someone are delivered only to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from edgestream.trainers.aggregation import RobustAggregation, linear_lr_scale, weighted_mean
from edgestream.trainers.errors import AggregationError, StrategyError
from edgestream.trainers.local import StepResult
from edgestream.trainers.messages import Outgoing, UpdateMessage
from edgestream.trainers.strategies.base import (
    StrategyContext,
    SyncStrategy,
    register,
    snapshot_message,
)


@register("bsp")
class BSPStrategy(SyncStrategy):
    """Synchronous all-reduce through the gradients log, with elastic membership.

    Invariant: after step ``t`` completes, every active member holds the same
    parameters, buffers and momentum, and ``trainer.version == t + 1``; a worker
    never applies a gradient that was not computed on its current version.
    """

    name = "bsp"
    role = "worker"
    subscribes = ("gradients", "models")
    replicas_identical = True

    def __init__(
        self,
        ctx: StrategyContext,
        *,
        reference_batch: int | None = None,
        max_future_steps: int = 2,
        max_prejoin_messages: int = 10_000,
        sync_retry_s: float = 5.0,
        aggregation: str = "mean",
        trim: int | None = None,
        max_update_norm: float | None = None,
        norm_policy: str = "clip",
        krum_f: int | None = None,
    ) -> None:
        """``reference_batch``: ``B_ref`` for linear LR scaling ``lr * B_t / B_ref`` (None: no
        scaling). ``max_future_steps``: gradients more than this many steps ahead are
        dropped (bounds memory). ``max_prejoin_messages``: how many messages a joining
        worker buffers while it waits for its snapshot. ``sync_retry_s``: a joiner still
        without a snapshot after this long asks again (from ``poll``). ``aggregation``
        (``mean`` | ``trimmed_mean`` | ``median`` | ``krum``), ``trim``, ``krum_f``, ``max_update_norm`` and
        ``norm_policy`` (``clip`` | ``reject``): robust aggregation, see
        :class:`trainers.aggregation.RobustAggregation`."""
        super().__init__(ctx)
        if reference_batch is not None and reference_batch <= 0:
            raise StrategyError(f"reference_batch must be > 0, got {reference_batch}")
        try:
            self.robust = RobustAggregation.from_params(
                aggregation=aggregation, trim=trim, max_update_norm=max_update_norm, norm_policy=norm_policy,
                krum_f=krum_f,
            )
        except AggregationError as exc:
            raise StrategyError(f"{self.name}: {exc}") from None
        workers = len(set(ctx.members) | {ctx.worker_id})
        if workers < self.robust.min_contributions:
            raise StrategyError(
                f"{self.name}: {self.robust.requirement} needs at least "
                f"{self.robust.min_contributions} workers per step, the job starts with {workers}"
            )
        self.reference_batch = reference_batch
        self.max_future_steps = max_future_steps
        self.max_prejoin_messages = max_prejoin_messages
        initial = set(ctx.members) | ({ctx.worker_id} if not ctx.joining else set())
        self._members: tuple[str, ...] = tuple(sorted(initial))
        self._next_members: tuple[str, ...] | None = None
        self._view_id = 0
        self._synced = not ctx.joining
        self._active = True
        self._published_step: int | None = None
        self._pending: dict[int, dict[str, UpdateMessage]] = {}
        self._prejoin: list[UpdateMessage] = []
        self.sync_retry_s = sync_retry_s
        # Members known to hold the model: the contributors of the last completed step.
        self._veterans: tuple[str, ...] = self._members if self._synced else ()
        self._desired: tuple[str, ...] | None = None
        # Members that asked for the model although they count as holding it (lost state):
        # proposals leave them out until a view without them is applied.
        self._resync: tuple[str, ...] = ()
        self._proposed_view: int | None = None
        self._sync_wait_since: float | None = None
        self._last_global_batch = 0

    # -- read-only view -------------------------------------------------------------

    @property
    def members(self) -> tuple[str, ...]:
        """Workers whose gradients the pending step waits for, sorted."""
        return self._members

    @property
    def view_id(self) -> int:
        """Number of membership views applied so far."""
        return self._view_id

    @property
    def active(self) -> bool:
        """False once a view removed this worker; it then ignores everything."""
        return self._active

    @property
    def synced(self) -> bool:
        """False for a joining worker until it adopted its snapshot."""
        return self._synced

    # -- hooks ----------------------------------------------------------------------

    def can_train(self) -> bool:
        return (
            self._synced
            and self._active
            and self.worker_id in self._members
            and self._published_step != self.trainer.version
        )

    def on_local_step(self, result: StepResult) -> list[Outgoing]:
        if not self.can_train():
            raise StrategyError(f"bsp {self.worker_id}: local step while waiting ({self._waiting_reason()})")
        if result.base_version != self.trainer.version:
            raise StrategyError(
                f"bsp {self.worker_id}: result computed on version {result.base_version}, "
                f"model is at {self.trainer.version}"
            )
        step = self.trainer.version
        self._published_step = step
        self.counters["gradients_sent"] += 1
        msg = UpdateMessage(
            kind="gradient",
            sender=self.worker_id,
            step=step,
            base_version=step,
            batch_size=result.batch_size,
            tensors=result.gradients,
            buffers=result.buffer_deltas,
            meta={"loss": result.loss, "view_id": self._view_id},
        )
        return [Outgoing("gradients", msg)]

    def on_message(self, msg: UpdateMessage) -> list[Outgoing]:
        if not self._active:
            if msg.kind == "control" and msg.meta.get("op") == "view":
                return self._on_view(msg)  # a removed worker follows the views: one may readmit it
            self.counters["ignored_inactive"] += 1
            return []
        if not self._synced:
            if msg.kind == "model":
                return self._adopt_snapshot(msg)
            if len(self._prejoin) >= self.max_prejoin_messages:
                self._prejoin.pop(0)
                self.counters["prejoin_dropped"] += 1
            self._prejoin.append(msg)
            return []
        if msg.kind == "gradient":
            return self._on_gradient(msg)
        if msg.kind == "control" and msg.meta.get("op") == "view":
            return self._on_view(msg)
        if msg.kind == "control" and msg.meta.get("op") == "sync_request":
            return self._on_sync_request(msg)
        if msg.kind == "model":
            self.counters["snapshots_ignored"] += 1
            return []
        self.counters["ignored_messages"] += 1
        return []

    def on_membership(self, workers: Sequence[str]) -> list[Outgoing]:
        """Record the live workers; the lowest surviving member proposes the new view."""
        self._desired = tuple(sorted(set(workers)))
        return self._maybe_propose()

    def poll(self, now: float) -> list[Outgoing]:
        """A joiner still waiting for its snapshot after ``sync_retry_s`` asks for one.

        Covers a coordinator that died between admitting the joiner and sending the
        snapshot: the request travels on the gradients log, and the lowest veteran
        member at that point of the log answers.
        """
        if self._synced or not self._active:
            return []
        if self._sync_wait_since is None:
            self._sync_wait_since = now
            return []
        if now - self._sync_wait_since < self.sync_retry_s:
            return []
        self._sync_wait_since = now
        self.counters["sync_requests"] += 1
        request = UpdateMessage(
            kind="control", sender=self.worker_id, step=0, base_version=0, meta={"op": "sync_request"}
        )
        return [Outgoing("gradients", request)]

    # -- gradients and aggregation --------------------------------------------------

    def _on_gradient(self, msg: UpdateMessage) -> list[Outgoing]:
        version = self.trainer.version
        if msg.base_version != msg.step:
            self.counters["rejected_inconsistent"] += 1
            return []
        if msg.step < version:
            # Already aggregated (or from before we joined): a late copy or a duplicate.
            self.counters["late_gradients"] += 1
            return []
        if msg.step > version + self.max_future_steps:
            self.counters["rejected_future"] += 1
            return []
        bucket = self._pending.setdefault(msg.step, {})
        if msg.sender in bucket:
            self.counters["duplicates"] += 1
            return []
        bucket[msg.sender] = msg
        return self._try_complete()

    def _try_complete(self) -> list[Outgoing]:
        out: list[Outgoing] = []
        while self._active:
            step = self.trainer.version
            bucket = self._pending.get(step, {})
            if not self._members or any(member not in bucket for member in self._members):
                break
            contributions = [bucket[member] for member in self._members]  # sorted order
            kept, gradients, buffer_deltas = self._aggregate(contributions)
            global_batch = self.robust.global_batch([c.batch_size for c in kept])
            lr_scale = linear_lr_scale(global_batch, self.reference_batch)
            for contribution in kept:
                self.staleness.record(step - contribution.base_version)
            self.counters["non_member_gradients"] += len(bucket) - len(contributions)
            if gradients is None:
                # Every contribution was rejected by the norm bound: the step completes on
                # every replica alike, applying nothing (parameters and momentum untouched).
                self.trainer.set_parameters(self.trainer.get_parameters(), version=step + 1)
                self.counters["steps_without_update"] += 1
            else:
                self.trainer.apply_gradient(gradients, lr_scale=lr_scale, buffer_deltas=buffer_deltas)
            self._last_global_batch = global_batch
            self._veterans = self._members
            self.counters["steps"] += 1
            self._after_step(step, contributions)
            for old in [s for s in self._pending if s <= step]:
                del self._pending[old]
            if self._published_step == step:
                self._published_step = None
            if self._next_members is not None:
                out += self._enter_next_view()
        return out

    def _aggregate(
        self, contributions: list[UpdateMessage]
    ) -> tuple[list[UpdateMessage], dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
        """The contributions kept, their aggregate gradient (None if none was kept) and buffer
        deltas. Plain BSP: all of them, :meth:`_combine`. With robust aggregation: each gradient
        passes the norm bound (clipped or rejected, counted per sender), and the kept ones are
        combined by the rule in the given (member) order; a trimmed mean over fewer than
        ``2 * trim + 1`` kept contributions trims less (counted ``trim_reduced``)."""
        if not self.robust.active:
            gradients, buffer_deltas = self._combine(contributions)
            return contributions, gradients, buffer_deltas
        kept: list[UpdateMessage] = []
        tensors = []
        for contribution in contributions:
            bounded = self.robust.bound_counted(contribution.tensors, contribution.sender, self.counters)
            if bounded is not None:
                kept.append(contribution)
                tensors.append(bounded)
        if not kept:
            return [], None, None
        if len(kept) < self.robust.min_contributions:
            self.counters["trim_reduced"] += 1
        samples = [c.batch_size for c in kept]
        gradients, buffer_deltas = self.robust.aggregate(tensors, [c.buffers for c in kept], samples)
        if buffer_deltas is None and len({frozenset(c.buffers) for c in kept}) > 1:
            self.counters["buffer_sync_skipped"] += 1
        return kept, gradients, buffer_deltas

    def _combine(
        self, contributions: list[UpdateMessage]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """The sample-weighted means (``b_i / B``) of the contributions' tensors and of their
        buffers, in the given (member) order; buffers only when every contribution carries the
        same names (else None, counted: the same decision on every replica)."""
        samples = [c.batch_size for c in contributions]
        tensors = weighted_mean([c.tensors for c in contributions], samples)
        buffer_names = {frozenset(c.buffers) for c in contributions}
        if len(buffer_names) == 1 and contributions[0].buffers:
            return tensors, weighted_mean([c.buffers for c in contributions], samples)
        if len(buffer_names) > 1:
            self.counters["buffer_sync_skipped"] += 1
        return tensors, None

    def _after_step(self, step: int, contributions: list[UpdateMessage]) -> None:
        """Hook for subclasses: step ``step`` was applied from ``contributions`` (member order).

        Runs on every replica at the same point of the log, so decisions taken here
        from the contributions' ``meta`` are the same everywhere.
        """

    # -- membership -----------------------------------------------------------------

    def _on_view(self, msg: UpdateMessage) -> list[Outgoing]:
        view_id = msg.meta.get("view_id")
        proposed = _worker_list(msg.meta.get("members"))
        if isinstance(view_id, bool) or view_id != self._view_id + 1 or not proposed:
            self.counters["views_ignored"] += 1  # duplicate, superseded or malformed proposal
            return []
        self._view_id = view_id
        self.counters["views"] += 1
        self._resync = tuple(w for w in self._resync if w in proposed)  # out now: may come back
        if self.worker_id not in proposed:
            self._active = False
            self._pending.clear()
            return []
        if not self._active:
            return self._readmitted(proposed)
        current = tuple(sorted(set(self._members) & set(proposed)))
        self._members = current
        self._next_members = proposed if proposed != current else None
        return self._try_complete() + self._maybe_propose()

    def _readmitted(self, proposed: tuple[str, ...]) -> list[Outgoing]:
        """A view names this removed worker again: it joins from the next step, with the
        snapshot the coordinator sends then (its own model is stale)."""
        self._active = True
        self._synced = False
        self._members = tuple(m for m in proposed if m != self.worker_id)
        self._next_members = proposed
        self._veterans = ()
        self._pending.clear()
        self._prejoin = []
        self._published_step = None
        self._sync_wait_since = None
        self.counters["readmitted"] += 1
        return []

    def _enter_next_view(self) -> list[Outgoing]:
        assert self._next_members is not None
        before, after = self._members, self._next_members
        self._members, self._next_members = after, None
        joiners = sorted(set(after) - set(before))
        if not joiners or not self._is_coordinator():
            return []
        return [self._snapshot_for(joiner) for joiner in joiners]

    def _on_sync_request(self, msg: UpdateMessage) -> list[Outgoing]:
        if msg.sender in self._members and msg.sender in self._veterans and msg.sender != self.worker_id:
            # It counts as holding the model but asks for it: it lost its state (restarted
            # without a checkpoint). Every replica notes it at this point of the log; the
            # proposer takes it out with a view, and the next view brings it back as a joiner.
            if msg.sender not in self._resync:
                self._resync = tuple(sorted({*self._resync, msg.sender}))
                self.counters["resyncs"] += 1
            if self._desired is None:  # no live set reported yet: bring it back afterwards
                self._desired = self._next_members or self._members
            return self._maybe_propose()
        # Only a member of the pending step that never contributed needs the model, and
        # only one worker (decided by the log prefix) answers.
        if msg.sender not in self._members or msg.sender in self._veterans or not self._is_coordinator():
            self.counters["sync_requests_ignored"] += 1
            return []
        return [self._snapshot_for(msg.sender)]

    def _is_coordinator(self) -> bool:
        """True if this worker is the lowest member of the pending step that holds the model."""
        holders = sorted(set(self._members) & set(self._veterans))
        return bool(holders) and holders[0] == self.worker_id

    def _snapshot_for(self, joiner: str) -> Outgoing:
        self.counters["snapshots_sent"] += 1
        snapshot = snapshot_message(self.trainer, self.worker_id, include_momentum=True, meta=self._view_meta())
        return Outgoing("models", snapshot, to=joiner)

    def _maybe_propose(self) -> list[Outgoing]:
        if not (self._synced and self._active):
            return []
        target = self._next_members or self._members
        desired = self._desired
        if self._resync:
            desired = tuple(w for w in (desired if desired is not None else target) if w not in self._resync)
        if desired is None or not desired or desired == target:
            return []
        survivors = sorted(set(self._members) & set(desired))
        next_view = self._view_id + 1
        if not survivors or survivors[0] != self.worker_id or self._proposed_view == next_view:
            return []
        self._proposed_view = next_view
        self.counters["views_proposed"] += 1
        version = self.trainer.version
        proposal = UpdateMessage(
            kind="control",
            sender=self.worker_id,
            step=version,
            base_version=version,
            meta={"op": "view", "view_id": next_view, "members": list(desired)},
        )
        return [Outgoing("gradients", proposal)]

    def _adopt_snapshot(self, msg: UpdateMessage) -> list[Outgoing]:
        members = _worker_list(msg.meta.get("members"))
        view_id = msg.meta.get("view_id")
        veterans = _worker_list(msg.meta.get("veterans"))
        next_members = _worker_list(msg.meta.get("next_members"))
        if (
            members is None
            or self.worker_id not in members
            or not isinstance(view_id, int)
            or isinstance(view_id, bool)
            or veterans is None
        ):
            self.counters["snapshots_ignored"] += 1
            return []
        self.trainer.load_snapshot(msg.tensors, msg.buffers, msg.base_version, momentum=msg.optimizer)
        self._members = members
        self._next_members = next_members or None
        self._view_id = view_id
        self._veterans = veterans
        self._synced = True
        self._published_step = None
        self.counters["snapshots_adopted"] += 1
        buffered, self._prejoin = self._prejoin, []
        out: list[Outgoing] = []
        for earlier in buffered:  # replay in arrival (= log) order
            out += self.on_message(earlier)
        return out + self._maybe_propose()

    def _view_meta(self) -> dict[str, Any]:
        return {
            "op": "bsp_snapshot",
            "view_id": self._view_id,
            "members": list(self._members),
            "next_members": list(self._next_members) if self._next_members else None,
            "veterans": list(self._veterans),
        }

    def _waiting_reason(self) -> str:
        if not self._synced:
            return "waiting for a model snapshot"
        if not self._active:
            return "removed from the job"
        if self.worker_id not in self._members:
            return f"joins at the next step (members {list(self._members)})"
        missing = [m for m in self._members if m not in self._pending.get(self.trainer.version, {})]
        return f"step {self.trainer.version} waits for {missing}"

    # -- persistence and stats --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            {
                "members": list(self._members),
                "next_members": list(self._next_members) if self._next_members is not None else None,
                "view_id": self._view_id,
                "synced": self._synced,
                "active": self._active,
                "published_step": self._published_step,
                "pending": [m.to_state() for bucket in self._pending.values() for m in bucket.values()],
                "prejoin": [m.to_state() for m in self._prejoin],
                "veterans": list(self._veterans),
                "desired": list(self._desired) if self._desired is not None else None,
                "resync": list(self._resync),
                "proposed_view": self._proposed_view,
                "sync_wait_since": self._sync_wait_since,
                "last_global_batch": self._last_global_batch,
            }
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._members = tuple(state["members"])
        self._next_members = tuple(state["next_members"]) if state["next_members"] is not None else None
        self._view_id = int(state["view_id"])
        self._synced = bool(state["synced"])
        self._active = bool(state["active"])
        self._published_step = state["published_step"]
        self._pending = {}
        for item in state["pending"]:
            msg = UpdateMessage.from_state(item)
            self._pending.setdefault(msg.step, {})[msg.sender] = msg
        self._prejoin = [UpdateMessage.from_state(item) for item in state["prejoin"]]
        self._veterans = tuple(state["veterans"])
        self._desired = tuple(state["desired"]) if state["desired"] is not None else None
        self._resync = tuple(state.get("resync", ()))  # absent in checkpoints of older versions
        self._proposed_view = state["proposed_view"]
        self._sync_wait_since = state["sync_wait_since"]
        self._last_global_batch = int(state["last_global_batch"])

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats.update(
            {
                "view_id": self._view_id,
                "members": list(self._members),
                "next_members": list(self._next_members) if self._next_members else None,
                "synced": self._synced,
                "active": self._active,
                "last_global_batch": self._last_global_batch,
                "aggregation": self.robust.describe(),
                "waiting": None if self.can_train() else self._waiting_reason(),
            }
        )
        return stats


def _worker_list(value: object) -> tuple[str, ...] | None:
    """Sorted, de-duplicated worker ids from a meta field; None if it is not a list of strings."""
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        return None
    return tuple(sorted(set(value)))
