"""DLion (HPDC 2021): decentralised training across nodes whose compute and links differ.

Every worker trains its own replica and exchanges *gradients* with every peer (all to
all, point-to-point on the ``inbox`` channel), with three mechanisms, each a parameter
(the per-link exchange and the knowledge transfer are our reconstruction of the
paper's ideas, not its code; see docs/training.md):

1. **Weighted dynamic batching** (``weighted_batching``). Each worker measures its
   capacity online: the smaller of what it can train (samples per second over the time
   between its steps minus the time the lag bound held it back) and what its stream
   delivers (measured on steps that got fewer records than they asked for), EWMAs over
   its steps. Capacities ride in every message's ``meta.capacity``. Every ``rebalance_every`` iterations a worker
   sets ``b_i = B_total c_i / sum c`` (clamped to ``[min_batch, max_batch]``), but
   only when some capacity moved by more than ``rebalance_threshold`` since the last
   rebalance. Gradients are aggregated with weights ``b_j / sum b``
   (``trainers.aggregation``'s rule).
2. **Per-link prioritised exchange** (``prioritised``). Per directed link ``i -> j`` a
   bandwidth estimate: the receiver measures each message's produce-to-consume transit
   (``on_arrival``), keeps an EWMA of ``bytes / seconds`` and reports it back in
   ``meta.link_bw``; before any report the sender's produce-acknowledged time
   (``on_transfer``) stands in, and before that ``initial_bandwidth``. Each iteration
   the worker sends peer ``j`` the largest-magnitude entries of ``residual_ij + g``
   that fit ``budget_safety * bandwidth_ij * compute_time`` bytes (the mean time of its
   recent iterations not held back by the lag bound: communication overlaps the next
   step), at least ``min_ratio`` of the entries and as many as the message's fixed cost
   buys (``min_entries``): a *partial* message, only those
   entries travel (``meta.sparse``, the driver's lossless sparse encoding), and tensors
   without any selected entry are left out. What is left stays in ``residual_ij`` and
   goes later: per link, everything sent plus the residual is exactly the sum of the
   gradients. A window bounds what is in flight: a peer confirms the newest of our steps
   it got (``meta.ack``); while more than ``max_in_flight`` of our iterations are
   unconfirmed, that link carries only the minimum (its queue drains; the rest waits in
   the residual). The links of one host share its uplink: when the per-link budgets add
   up to more than the worker's own uplink carries in the compute time (its estimate:
   bytes of a step's messages so far over the time the latest took, ``on_transfer``),
   they are scaled down together.
3. **Direct knowledge transfer** (``knowledge_transfer``). The validation accuracy of
   the worker's last evaluation (``on_evaluation``) rides in ``meta.score``. Every
   ``transfer_every`` iterations, the worker whose score is the best it knows (ties:
   the smallest id) sends its parameters (a ``model`` message) to every peer scoring
   more than ``transfer_gap`` below it; the receiver merges ``x = (1 - lambda) x +
   lambda x_best`` unless its own score has meanwhile reached the sender's.

Synchronisation: asynchronous by default; with ``max_lag`` a worker at iteration ``k``
does not start ``k + 1`` while some live peer's newest message is older than ``k -
max_lag``. Every gradient, its own at the local step and each peer's when it arrives,
is one optimizer step with the learning rate times ``w_j = b_j / sum b`` (the latest batch size of every member),
so the steps of one iteration of all members add up to one step of the trainer's
learning rate on the sample-weighted mean gradient. Messages carry the sender's
incarnation; a gradient is applied at most once per ``(sender, incarnation, step)``.

Restarts and joiners: a worker restored from a checkpoint (``on_restore``) becomes a new
incarnation and says ``hello`` to every peer, naming one (the smallest id) that answers
with its model, which the restored worker adopts (its clock jumps to the sender's); a
joiner waits for that model before its first step; a worker that gets a gradient more
than ``max_lag + 1`` iterations ahead of its own (it was cut off) asks that peer the same
way. Peers drop the link residual and the
duplicate record of a worker that says hello.

Pure and synchronous: no clock (time comes from ``poll``), no I/O.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from edgestream.trainers.errors import StrategyError
from edgestream.trainers.local import StepResult
from edgestream.trainers.messages import Outgoing, UpdateMessage
from edgestream.trainers.seen import StepSet
from edgestream.trainers.strategies.base import (
    Observations,
    StrategyContext,
    SyncStrategy,
    register,
)
from edgestream.trainers.strategies.gossip import balanced_batch_size

Tensors = dict[str, torch.Tensor]

#: Wire bytes per entry of a partial message (a 16-bit index offset and a float32 value;
#: compression.sparse), and a bound on the fixed cost of a message and of each tensor.
SPARSE_ENTRY_BYTES = 6
DENSE_ENTRY_BYTES = 4
MESSAGE_OVERHEAD_BYTES = 1024
TENSOR_OVERHEAD_BYTES = 64


# -- pure pieces (unit-tested on their own) ------------------------------------------------


class LinkEstimate:
    """EWMA of one link's throughput in bytes/s from ``(bytes, seconds)`` transfers.

    A transfer of ``n`` bytes on a link of bandwidth ``B`` and latency ``L`` takes ``L +
    n / B`` (plus queueing). Messages are pipelined, so the latency is not charged to
    the budget: the floor ``L`` is the shortest of the previous ``window`` transfers, and
    a transfer's throughput is ``n / (seconds - floor)``, at most ``max_gain`` times the
    plain ``n / seconds`` (a transfer hardly longer than the floor says little; a message
    sized by the estimate then grows until its time on the wire shows, and messages are
    never larger than the dense gradient). With a compute time ``c`` per message the
    estimate settles at ``B`` while ``c > L / max_gain``. The first transfer counts plainly. Invariant: every observation taken
    is positive and finite."""

    def __init__(self, alpha: float = 0.3, value: float | None = None, *, window: int = 64,
                 max_gain: float = 16.0) -> None:
        self.alpha = alpha
        self.value = value
        self.max_gain = max_gain
        self._recent: deque[float] = deque(maxlen=window)

    def observe(self, nbytes: int, seconds: float) -> float | None:
        if nbytes <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return self.value
        on_wire = max(seconds - min(self._recent), seconds / self.max_gain) if self._recent else seconds
        self._recent.append(seconds)
        rate = nbytes / on_wire
        self.value = rate if self.value is None else self.alpha * rate + (1 - self.alpha) * self.value
        return self.value


def entries_for_budget(budget_bytes: float, total: int, tensors: int, min_entries: int) -> int:
    """Entries of a partial message that fit ``budget_bytes`` (at least ``min_entries``,
    at most ``total``); all of them once a dense message is no larger than the sparse one."""
    room = budget_bytes - MESSAGE_OVERHEAD_BYTES - TENSOR_OVERHEAD_BYTES * tensors
    k = int(max(0.0, room) // SPARSE_ENTRY_BYTES)
    k = max(min_entries, min(total, k))
    if k * SPARSE_ENTRY_BYTES >= total * DENSE_ENTRY_BYTES:
        return total
    return k


class LinkResidual:
    """The gradient mass one link still owes its peer.

    ``select(g, k)`` adds ``g`` to the residual, takes the ``k`` largest-magnitude
    entries over all tensors (ties: the lower flat index), returns them (tensors with no
    entry taken are left out) and keeps the rest. Invariant: the sum of everything
    returned plus ``residual`` equals the sum of every ``g`` given, entry by entry."""

    def __init__(self) -> None:
        self.residual: Tensors = {}

    def select(self, gradient: Mapping[str, torch.Tensor], k: int) -> tuple[Tensors, int]:
        names = sorted(gradient)
        owed = {name: (self.residual[name] + gradient[name]) if name in self.residual
                else gradient[name].detach().clone().float() for name in names}
        flat = torch.cat([owed[name].reshape(-1) for name in names])
        total = int(flat.numel())
        if k >= total:
            self.residual = {name: torch.zeros_like(t) for name, t in owed.items()}
            return owed, total
        keep = torch.zeros(total, dtype=torch.bool)
        if k > 0:
            # Stable order for equal magnitudes: sort by (-|x|, index).
            order = torch.argsort(flat.abs(), descending=True, stable=True)
            keep[order[:k]] = True
        sent: Tensors = {}
        offset = 0
        for name in names:
            n = owed[name].numel()
            mask = keep[offset:offset + n].reshape(owed[name].shape)
            offset += n
            if bool(mask.any()):
                sent[name] = torch.where(mask, owed[name], torch.zeros_like(owed[name]))
                owed[name] = torch.where(mask, torch.zeros_like(owed[name]), owed[name])
        self.residual = owed
        return sent, int(keep.sum())

    def owed_bytes(self) -> float:
        return float(sum(float(t.abs().sum()) for t in self.residual.values()))


class CapacityBalancer:
    """Weighted dynamic batching: ``b_i`` proportional to capacity, rebalanced every
    ``every`` iterations when some capacity moved by more than ``threshold`` (relative)."""

    def __init__(self, *, total_batch: int, min_batch: int, max_batch: int, every: int,
                 threshold: float, initial: int) -> None:
        self.total_batch = total_batch
        self.min_batch, self.max_batch = min_batch, max_batch
        self.every = every
        self.threshold = threshold
        self.batch = initial
        self.basis: dict[str, float] = {}  # capacities at the last rebalance
        self.rebalances = 0

    def moved(self, capacities: Mapping[str, float]) -> bool:
        if set(capacities) != set(self.basis):
            return True
        return any(abs(c - self.basis[name]) > self.threshold * self.basis[name] for name, c in capacities.items())

    def maybe_rebalance(self, iteration: int, me: str, capacities: Mapping[str, float], members: int) -> bool:
        """At an iteration multiple of ``every``: set the batch if capacities moved."""
        if iteration % self.every or me not in capacities or not self.moved(capacities):
            return False
        self.batch = balanced_batch_size(self.total_batch, capacities[me], list(capacities.values()), members,
                                         self.min_batch, self.max_batch)
        self.basis = dict(capacities)
        self.rebalances += 1
        return True


@dataclass
class _Peer:
    """What a worker knows of one peer."""

    incarnation: int = 0
    steps: StepSet = field(default_factory=StepSet)
    batch: int | None = None
    capacity: float | None = None
    score: float | None = None
    #: The peer's estimate of the link from us to it (bytes/s), from its ``meta.link_bw``.
    reported_bw: float | None = None
    #: The newest knowledge-transfer round of this peer merged (duplicates are dropped).
    transfer_round: int = 0
    #: The newest of our steps the peer says it has received (``meta.ack``).
    acked: int = 0


def _as_positive(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    return None


def _as_score(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value <= 1:
        return float(value)
    return None


def _as_index(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


@register("dlion")
class DLionStrategy(SyncStrategy):
    """All-to-all gradient exchange with weighted dynamic batching, per-link prioritised
    partial messages and direct knowledge transfer (see the module docstring).

    Invariant: one optimizer step per gradient applied; a peer's gradient of one ``(incarnation,
    step)`` is added at most once; per link, sent plus residual equals the gradients given.
    """

    name = "dlion"
    role = "worker"
    subscribes = ("inbox",)
    background_sends = True
    uses_validation = True

    def __init__(
        self,
        ctx: StrategyContext,
        *,
        max_lag: int | None = None,
        max_in_flight: int | None = 16,
        lr_scale: float = 1.0,
        weighted_batching: bool = True,
        batch_size: int = 32,
        total_batch: int | None = None,
        min_batch: int = 4,
        max_batch: int = 256,
        rebalance_every: int = 10,
        rebalance_threshold: float = 0.1,
        rate_alpha: float = 0.3,
        prioritised: bool = True,
        initial_bandwidth: float = 12.5e6,
        link_alpha: float = 0.3,
        budget_safety: float = 0.9,
        min_ratio: float = 0.001,
        initial_iteration_s: float = 0.1,
        knowledge_transfer: bool = True,
        transfer_every: int = 20,
        transfer_lambda: float = 0.5,
        transfer_gap: float = 0.02,
        stats_window: int = 50,
    ) -> None:
        """``max_lag``: iterations a worker may run ahead of its slowest live peer's newest
        message (None: no bound, asynchronous). ``max_in_flight``: per link, iterations of
        ours the peer has not confirmed yet beyond which the link carries only the minimum
        (None: no window). ``lr_scale``: factor on the trainer's learning rate.
        Batching: ``batch_size`` before capacities are known (and always, with
        ``weighted_batching=false``); ``total_batch`` ``B_total`` (None: ``batch_size``
        times the member count); ``min_batch``/``max_batch`` clamp ``b_i``;
        ``rebalance_every`` K iterations; ``rebalance_threshold`` the relative capacity
        change that triggers a rebalance; ``rate_alpha`` the capacity EWMA weight.
        Exchange: ``prioritised=false`` sends every peer the whole gradient (dense);
        ``initial_bandwidth`` bytes/s before a link was measured; ``link_alpha`` the
        bandwidth EWMA weight; ``budget_safety`` the share of ``bandwidth x compute
        time`` a message may take; ``min_ratio`` the least share of entries sent;
        ``initial_iteration_s`` the iteration time assumed before one was measured.
        Knowledge transfer: every ``transfer_every`` iterations, merge weight
        ``transfer_lambda``, only to peers more than ``transfer_gap`` (accuracy) worse."""
        super().__init__(ctx)
        if max_lag is not None and max_lag < 0:
            raise StrategyError(f"max_lag must be >= 0, got {max_lag}")
        if max_in_flight is not None and max_in_flight < 1:
            raise StrategyError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if not (lr_scale > 0 and math.isfinite(lr_scale)):
            raise StrategyError(f"lr_scale must be finite and > 0, got {lr_scale}")
        if batch_size <= 0 or (total_batch is not None and total_batch <= 0) or not 0 < min_batch <= max_batch:
            raise StrategyError("need batch_size > 0, total_batch > 0 (or None), 0 < min_batch <= max_batch")
        if rebalance_every <= 0 or transfer_every <= 0 or stats_window <= 0:
            raise StrategyError("rebalance_every, transfer_every and stats_window must be > 0")
        for label, value in (("rate_alpha", rate_alpha), ("link_alpha", link_alpha), ("budget_safety", budget_safety),
                             ("min_ratio", min_ratio), ("transfer_lambda", transfer_lambda)):
            if not 0 < value <= 1:
                raise StrategyError(f"{label} must be in (0, 1], got {value}")
        if not rebalance_threshold >= 0 or not transfer_gap >= 0:
            raise StrategyError("rebalance_threshold and transfer_gap must be >= 0")
        if not (initial_bandwidth > 0 and math.isfinite(initial_bandwidth)) or not initial_iteration_s > 0:
            raise StrategyError("initial_bandwidth and initial_iteration_s must be finite and > 0")
        self.max_lag = max_lag
        self.max_in_flight = max_in_flight
        self.lr_scale = float(lr_scale)
        self.weighted_batching = bool(weighted_batching)
        self.prioritised = bool(prioritised)
        self.knowledge_transfer = bool(knowledge_transfer)
        self.rate_alpha = rate_alpha
        self.initial_bandwidth = float(initial_bandwidth)
        self.link_alpha = link_alpha
        self.budget_safety = budget_safety
        self.min_ratio = min_ratio
        self.initial_iteration_s = float(initial_iteration_s)
        self.transfer_every = transfer_every
        self.transfer_lambda = transfer_lambda
        self.transfer_gap = transfer_gap
        self._members: tuple[str, ...] = tuple(sorted(set(ctx.members) | {ctx.worker_id}))
        self.balancer = CapacityBalancer(
            total_batch=total_batch if total_batch is not None else batch_size * len(self._members),
            min_batch=min_batch, max_batch=max_batch, every=rebalance_every, threshold=rebalance_threshold,
            initial=batch_size)
        self._fixed_total = total_batch is not None
        self._synced = not ctx.joining
        self._hello_due = ctx.joining      # a joiner asks a peer for its model at the first poll
        self._awaiting_adopt = False       # restored: a peer's model replaces ours when it comes
        self._iteration = 0
        self._incarnation = 0
        self._peers: dict[str, _Peer] = {}
        self._links: dict[str, LinkResidual] = {}
        self._uplink: dict[str, LinkEstimate] = {}    # from on_transfer (produce acknowledged)
        #: This worker's uplink, shared by all its links: bytes of the step's messages so far
        #: over the time the latest took from the step (on_transfer), an EWMA.
        self._own_uplink = LinkEstimate(link_alpha)
        self._sent_since_step = 0
        self._inbound: dict[str, LinkEstimate] = {}   # from on_arrival: the link peer -> us
        self._ratio: dict[str, float] = {}
        self._link_bytes: Counter[str] = Counter()
        self._transfers_in: Counter[str] = Counter()
        self._transfers_out: Counter[str] = Counter()
        self._score: float | None = None
        self._last_transfer_round = 0
        # Time, all from poll(now).
        self._now: float | None = None
        self._blocked_s = 0.0
        self._blocked_at_poll = False
        self._last_step_at: float | None = None
        self._blocked_at_last_step = 0.0
        self._iteration_times: deque[float] = deque(maxlen=stats_window)
        self._work_times: deque[float] = deque(maxlen=stats_window)
        self._compute_rate: float | None = None  # samples/s over the time it computed or waited
        self._stream_rate: float | None = None   # samples/s its stream delivered (short batches only)

    # -- who and when ----------------------------------------------------------------------

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(m for m in self._members if m != self.worker_id)

    @property
    def iteration(self) -> int:
        return self._iteration

    def _peer(self, name: str) -> _Peer:
        peer = self._peers.get(name)
        if peer is None:
            peer = self._peers[name] = _Peer()
        return peer

    def can_train(self) -> bool:
        return self._synced and not self.lag_blocked()

    def lag_blocked(self) -> bool:
        """True while some live peer's newest message is older than ``iteration - max_lag``."""
        if self.max_lag is None:
            return False
        floor = self._iteration - self.max_lag
        return any(self._newest(name) < floor for name in self.peers)

    def _newest(self, name: str) -> int:
        peer = self._peers.get(name)
        return 0 if peer is None else peer.steps.newest

    def batch_size_wanted(self) -> int | None:
        return self.balancer.batch

    def poll(self, now: float) -> list[Outgoing]:
        if self._now is not None and now > self._now and self._blocked_at_poll:
            self._blocked_s += now - self._now
        if self._now is None or now >= self._now:
            self._now = float(now)
            self._blocked_at_poll = self._synced and self.lag_blocked()
        if self._hello_due and self.peers:
            self._hello_due = False
            return [self._hello(self.peers[0], self.peers[0])]
        return []

    # -- the local step ----------------------------------------------------------------------

    def on_local_step(self, result: StepResult) -> list[Outgoing]:
        if not self._synced:
            raise StrategyError(f"dlion worker {self.worker_id}: local step before it adopted a model")
        own = result.batch_size
        wanted = self.balancer.batch
        weight = own / self._global_batch(own)
        self.trainer.apply_gradient(result.gradients, lr_scale=self.lr_scale * weight,
                                    buffer_deltas=result.buffer_deltas)
        self._iteration += 1
        self._observe_step(own, wanted)
        if self.weighted_batching and self.balancer.maybe_rebalance(
                self._iteration, self.worker_id, self._capacities(), len(self._members)):
            self.counters["rebalances"] += 1
        # The peers in an order rotating with the iteration: messages of one step leave one
        # after another, and a shared uplink's queue must not always fall on the same links.
        peers = self.peers
        turn = self._iteration % len(peers) if peers else 0
        budgets = self._budgets()
        self._sent_since_step = 0
        out = [self._gradient_to(name, result.gradients, own, budgets[name]) for name in peers[turn:] + peers[:turn]]
        out.extend(self._transfers())
        return out

    def _global_batch(self, own: int) -> int:
        """Samples behind one iteration of every member: our batch and each peer's latest
        (a peer not heard of yet counts as ours)."""
        total = own
        for name in self.peers:
            batch = self._peer(name).batch
            total += batch if batch is not None else own
        return total

    def _capacities(self) -> dict[str, float]:
        out = {name: self._peers[name].capacity for name in self.peers
               if name in self._peers and self._peers[name].capacity is not None}
        if self.capacity is not None:
            out[self.worker_id] = self.capacity
        return out  # type: ignore[return-value]

    def _observe_step(self, batch: int, wanted: int) -> None:
        """Iteration time and capacity from the poll stamps.

        Compute rate: samples over the interval minus the time the lag bound held the
        worker back (as in EdgeGossip: in lockstep every interval is the same, and a rate
        of ``b_i / T`` would keep whatever batches there are). Stream rate: a step that got
        fewer records than it asked for took everything its stream had delivered since the
        last one, so ``batch / interval`` is what the stream delivers; a full step says
        the stream delivers at least ``batch / interval`` (a lower bound the estimate is
        raised to). Compute time: the interval minus the time held back, what the links
        have to carry a message while the next step is computed."""
        now = self._now
        if now is None:
            return
        if self._last_step_at is not None:
            interval = now - self._last_step_at
            self._iteration_times.append(interval)
            working = interval - (self._blocked_s - self._blocked_at_last_step)
            if working > 0:
                self._compute_rate = self._ewma(self._compute_rate, batch / working)
                self._work_times.append(working)
            if batch < wanted and interval > 0:
                self._stream_rate = self._ewma(self._stream_rate, batch / interval)
            elif self._stream_rate is not None and interval > 0:
                self._stream_rate = max(self._stream_rate, batch / interval)
        self._last_step_at = now
        self._blocked_at_last_step = self._blocked_s

    def _ewma(self, value: float | None, observed: float) -> float:
        return observed if value is None else (1 - self.rate_alpha) * value + self.rate_alpha * observed

    @property
    def capacity(self) -> float | None:
        """Samples/s this worker trains: its compute rate, or what its stream delivers if less."""
        if self._compute_rate is None:
            return None
        return self._compute_rate if self._stream_rate is None else min(self._compute_rate, self._stream_rate)

    def iteration_time(self) -> float:
        times = self._iteration_times
        return math.fsum(times) / len(times) if times else self.initial_iteration_s

    def compute_time(self) -> float:
        """Mean seconds of a recent iteration not held back by the lag bound (computing or
        waiting for data): the time a message has to reach its peer."""
        times = self._work_times
        return math.fsum(times) / len(times) if times else self.initial_iteration_s

    def min_entries(self, total: int) -> int:
        """The fewest entries a partial message carries: ``min_ratio`` of them, and never
        fewer than the message's fixed cost buys (below that it is mostly overhead, and the
        residual it leaves grows into large stale entries)."""
        return min(total, max(math.ceil(self.min_ratio * total), MESSAGE_OVERHEAD_BYTES // SPARSE_ENTRY_BYTES))

    def in_flight(self, peer: str) -> int:
        """Our iterations the peer has not confirmed receiving (its ``meta.ack``)."""
        known = self._peers.get(peer)
        return self._iteration - (0 if known is None else known.acked)

    def link_bandwidth(self, peer: str) -> float:
        """Bytes/s of the link to ``peer``: its report, else our produce time, else the default."""
        known = self._peers.get(peer)
        reported = None if known is None else known.reported_bw
        if reported is not None:
            return reported
        uplink = self._uplink.get(peer)
        if uplink is not None and uplink.value is not None:
            return uplink.value
        return self.initial_bandwidth

    def _meta(self, peer: str) -> dict[str, Any]:
        meta: dict[str, Any] = {"incarnation": self._incarnation, "batch": self.balancer.batch}
        if self.capacity is not None:
            meta["capacity"] = self.capacity
        if self._score is not None:
            meta["score"] = self._score
        inbound = self._inbound.get(peer)
        if inbound is not None and inbound.value is not None:
            meta["link_bw"] = inbound.value
        if peer in self._peers:
            meta["ack"] = self._newest(peer)
        return meta

    def _budgets(self) -> dict[str, float]:
        """Bytes each link may carry this iteration: ``budget_safety x bandwidth x compute
        time`` per link, scaled down together when they add up to more than the worker's own
        uplink carries in that time (the links of one host share it)."""
        span = self.budget_safety * self.compute_time()
        budgets = {name: span * self.link_bandwidth(name) for name in self.peers}
        uplink = self._own_uplink.value
        total = math.fsum(budgets.values())
        if uplink is not None and total > span * uplink > 0:
            scale = span * uplink / total
            budgets = {name: b * scale for name, b in budgets.items()}
            self.counters["uplink_capped"] += 1
        return budgets

    def _gradient_to(self, peer: str, gradient: Mapping[str, torch.Tensor], batch: int, budget: float) -> Outgoing:
        meta = self._meta(peer)
        total = sum(int(t.numel()) for t in gradient.values())
        if self.prioritised:
            least = self.min_entries(total)
            if self.in_flight(peer) > (self.max_in_flight if self.max_in_flight is not None else math.inf):
                # The peer is behind on what we sent (its link is queueing): only the least goes
                # until it catches up; the rest waits in the residual.
                k = least
                self.counters["window_full"] += 1
            else:
                k = entries_for_budget(budget, total, len(gradient), least)
            link = self._links.get(peer)
            if link is None:
                link = self._links[peer] = LinkResidual()
            tensors, sent = link.select(gradient, k)
            if sent < total:
                meta["sparse"] = True
            else:
                meta["compress"] = False
        else:
            tensors, sent = {name: g.detach().float() for name, g in gradient.items()}, total
            meta["compress"] = False
        self._ratio[peer] = sent / total if total else 1.0
        msg = UpdateMessage(kind="gradient", sender=self.worker_id, step=self._iteration,
                            base_version=self.trainer.version, batch_size=batch, tensors=tensors, meta=meta)
        self.counters["gradients_sent"] += 1
        return Outgoing("inbox", msg, to=peer)

    # -- knowledge transfer -------------------------------------------------------------------

    def on_evaluation(self, accuracy: float, loss: float) -> list[Outgoing]:
        if math.isfinite(accuracy):
            self._score = float(accuracy)
        return []

    def _transfers(self) -> list[Outgoing]:
        """At a transfer round: the best worker sends its model to the peers well below it."""
        if not self.knowledge_transfer or self._iteration % self.transfer_every or self._score is None:
            return []
        round_ = self._iteration // self.transfer_every
        if round_ <= self._last_transfer_round:
            return []
        self._last_transfer_round = round_
        scores = {name: self._peers[name].score for name in self.peers
                  if name in self._peers and self._peers[name].score is not None}
        best = min([(self._score, self.worker_id)] + [(s, n) for n, s in scores.items()],
                   key=lambda item: (-item[0], item[1]))  # the best score; ties: the smallest id
        if best[1] != self.worker_id:
            return []
        out = []
        for name, score in sorted(scores.items()):
            if score is not None and self._score - score > self.transfer_gap:
                out.append(self._model_to(name, transfer=round_))
                self._transfers_out[name] += 1
                self.counters["transfers_sent"] += 1
        return out

    def _model_to(self, peer: str, *, transfer: int | None = None, adopt: bool = False) -> Outgoing:
        meta = self._meta(peer)
        if transfer is not None:
            meta["transfer"] = transfer
        if adopt:
            meta["adopt"] = True
        msg = UpdateMessage(kind="model", sender=self.worker_id, step=self._iteration,
                            base_version=self.trainer.version, tensors=self.trainer.get_parameters(),
                            buffers=self.trainer.get_buffers(), meta=meta)
        self.counters["models_sent"] += 1
        return Outgoing("inbox", msg, to=peer)

    # -- messages in ---------------------------------------------------------------------------

    def on_message(self, msg: UpdateMessage) -> list[Outgoing]:
        if msg.sender == self.worker_id:
            self.counters["own_messages"] += 1
            return []
        if msg.sender not in self.peers:
            self.counters["not_peer"] += 1
            return []
        peer = self._peer(msg.sender)
        incarnation = _as_index(msg.meta.get("incarnation"))
        if incarnation < peer.incarnation:
            self.counters["old_incarnation"] += 1
            return []
        if incarnation > peer.incarnation:
            self._new_incarnation(msg.sender, incarnation)
        if msg.kind == "control":
            return self._take_control(msg)
        if msg.kind not in ("gradient", "model"):
            self.counters["ignored_messages"] += 1
            return []
        self._note_meta(peer, msg)
        if msg.kind == "model":
            return self._take_model(msg)
        if not peer.steps.add(msg.step):
            self.counters["duplicate_gradients"] += 1
            return []
        if not self._synced:
            self.counters["gradients_before_model"] += 1  # our model (adopted next) holds it
            return []
        out: list[Outgoing] = []
        if (self.max_lag is not None and not self._awaiting_adopt
                and msg.step > self._iteration + self.max_lag + 1):
            # A peer far ahead (we were cut off, or left and came back): catching up step by
            # step would hold every peer back; ask it for its model instead.
            self._awaiting_adopt = True
            self.counters["far_behind"] += 1
            out.append(self._hello(msg.sender, msg.sender))
        # One optimizer step per peer gradient, weighted b_j / sum b (entries the message
        # does not carry are zero: they come later, from the sender's link residual).
        weight = msg.batch_size / self._global_batch(self.balancer.batch)
        full = {name: msg.tensors[name] if name in msg.tensors else torch.zeros_like(param)
                for name, param in self.trainer.get_parameters().items()}
        self.trainer.apply_gradient(full, lr_scale=self.lr_scale * weight)
        self.counters["gradients_applied"] += 1
        self.staleness.record(max(0, self._iteration - msg.step))
        return out

    def _note_meta(self, peer: _Peer, msg: UpdateMessage) -> None:
        meta = msg.meta
        batch = meta.get("batch")
        if isinstance(batch, int) and not isinstance(batch, bool) and batch > 0:
            peer.batch = batch
        elif msg.kind == "gradient":
            peer.batch = msg.batch_size
        capacity = _as_positive(meta.get("capacity"))
        if capacity is not None:
            peer.capacity = capacity
        score = _as_score(meta.get("score"))
        if score is not None:
            peer.score = score
        reported = _as_positive(meta.get("link_bw"))
        if reported is not None:
            peer.reported_bw = reported
        ack = meta.get("ack")
        if isinstance(ack, int) and not isinstance(ack, bool) and ack >= 0:
            peer.acked = ack

    def _take_model(self, msg: UpdateMessage) -> list[Outgoing]:
        if msg.meta.get("adopt") is True and (not self._synced or self._awaiting_adopt):
            self.trainer.set_parameters(msg.tensors, version=self.trainer.version + 1)
            buffers = {n: t for n, t in msg.buffers.items() if n in self.trainer.get_buffers()}
            if buffers:
                self.trainer.set_buffers(buffers)
            self._iteration = max(self._iteration, msg.step)
            if self.max_lag is not None:
                # The adopted model holds what its sender had of every peer: their older
                # gradients are in it, and waiting for them would deadlock (the peers wait
                # for this worker's first step of the new numbering).
                for name in self.peers:
                    self._peer(name).steps.raise_floor(self._iteration - self.max_lag)
            self._synced = True
            self._awaiting_adopt = False
            self.counters["adopted_models"] += 1
            return []
        if "transfer" not in msg.meta:
            self.counters["ignored_models"] += 1
            return []
        peer = self._peer(msg.sender)
        round_ = _as_index(msg.meta.get("transfer"))
        if round_ <= peer.transfer_round:
            self.counters["duplicate_transfers"] += 1
            return []
        peer.transfer_round = round_
        sender_score = _as_score(msg.meta.get("score"))
        if self._score is not None and sender_score is not None and self._score >= sender_score:
            self.counters["transfers_declined"] += 1
            return []
        lam = self.transfer_lambda
        own = self.trainer.get_parameters()
        merged = {name: (1 - lam) * own[name] + lam * msg.tensors[name].to(own[name].dtype) for name in own}
        self.trainer.set_parameters(merged, version=self.trainer.version + 1)
        float_buffers = {n: b for n, b in self.trainer.get_buffers().items() if b.is_floating_point()}
        merged_buffers = {n: (1 - lam) * b + lam * msg.buffers[n].to(b.dtype)
                          for n, b in float_buffers.items() if n in msg.buffers}
        if merged_buffers:
            self.trainer.set_buffers(merged_buffers)
        self._transfers_in[msg.sender] += 1
        self.counters["transfers_merged"] += 1
        return []

    def _take_control(self, msg: UpdateMessage) -> list[Outgoing]:
        if msg.meta.get("op") != "hello":
            self.counters["ignored_messages"] += 1
            return []
        self.counters["hellos_received"] += 1
        if msg.meta.get("ask") == self.worker_id and self._synced:
            return [self._model_to(msg.sender, adopt=True)]
        return []

    def _new_incarnation(self, name: str, incarnation: int) -> None:
        """``name`` restarted: its step numbers start again; what our link owed it is void
        (it adopts a peer's model)."""
        peer = self._peer(name)
        peer.incarnation = incarnation
        peer.steps = StepSet(floor=0)
        self._links.pop(name, None)
        self.counters["peer_restarts"] += 1

    # -- restarts and membership ---------------------------------------------------------------

    def on_restore(self) -> list[Outgoing]:
        self._incarnation += 1
        self.counters["restores"] += 1
        peers = self.peers
        if not peers:
            return []
        self._awaiting_adopt = True
        return [self._hello(name, peers[0]) for name in peers]

    def _hello(self, peer: str, ask: str) -> Outgoing:
        msg = UpdateMessage(kind="control", sender=self.worker_id, step=self._iteration, base_version=0,
                            meta={"op": "hello", "ask": ask, "incarnation": self._incarnation})
        return Outgoing("inbox", msg, to=peer)

    def on_membership(self, workers: Sequence[str]) -> list[Outgoing]:
        members = tuple(sorted(set(workers) | {self.worker_id}))
        if members == self._members:
            return []
        before = set(self._members)
        self._members = members
        self.counters["membership_changes"] += 1
        for gone in before - set(members):
            self._peers.pop(gone, None)
            self._links.pop(gone, None)
            self._inbound.pop(gone, None)
            self._uplink.pop(gone, None)
            self._ratio.pop(gone, None)
        if not self._fixed_total:
            self.balancer.total_batch = self.balancer.total_batch // max(1, len(before)) * len(members)
        if not self._synced:
            self._hello_due = True  # ask a peer of the new view for the model (next poll)
        return []

    # -- link feedback ---------------------------------------------------------------------------

    def on_transfer(self, peer: str | None, nbytes: int, seconds: float) -> None:
        if peer is None or peer not in self.peers:
            return
        self._link_bytes[peer] += nbytes
        self._sent_since_step += nbytes
        self._own_uplink.observe(self._sent_since_step, seconds)
        estimate = self._uplink.get(peer)
        if estimate is None:
            estimate = self._uplink[peer] = LinkEstimate(self.link_alpha)
        estimate.observe(nbytes, seconds)

    def on_arrival(self, peer: str, nbytes: int, seconds: float) -> None:
        if peer not in self.peers:
            return
        estimate = self._inbound.get(peer)
        if estimate is None:
            estimate = self._inbound[peer] = LinkEstimate(self.link_alpha)
        estimate.observe(nbytes, seconds)

    # -- checkpoint and observability ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update({
            "members": list(self._members),
            "synced": self._synced,
            "hello_due": self._hello_due,
            "awaiting_adopt": self._awaiting_adopt,
            "iteration": self._iteration,
            "incarnation": self._incarnation,
            "peers": {name: {"incarnation": p.incarnation, "floor": p.steps.floor, "above": sorted(p.steps.above),
                             "batch": p.batch, "capacity": p.capacity, "score": p.score,
                             "reported_bw": p.reported_bw, "transfer_round": p.transfer_round, "acked": p.acked}
                      for name, p in sorted(self._peers.items())},
            "residuals": {name: dict(link.residual) for name, link in sorted(self._links.items())},
            "uplink": {name: e.value for name, e in sorted(self._uplink.items())},
            "own_uplink": self._own_uplink.value,
            "sent_since_step": self._sent_since_step,
            "inbound": {name: e.value for name, e in sorted(self._inbound.items())},
            "ratio": dict(self._ratio),
            "link_bytes": dict(self._link_bytes),
            "transfers_in": dict(self._transfers_in),
            "transfers_out": dict(self._transfers_out),
            "score": self._score,
            "last_transfer_round": self._last_transfer_round,
            "balancer": {"batch": self.balancer.batch, "basis": dict(self.balancer.basis),
                         "rebalances": self.balancer.rebalances, "total_batch": self.balancer.total_batch},
            "time": {"now": self._now, "blocked_s": self._blocked_s, "blocked_at_poll": self._blocked_at_poll,
                     "last_step_at": self._last_step_at, "blocked_at_last_step": self._blocked_at_last_step,
                     "iteration_times": list(self._iteration_times), "work_times": list(self._work_times),
                     "compute_rate": self._compute_rate,
                     "stream_rate": self._stream_rate},
        })
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._members = tuple(str(m) for m in state["members"])
        self._synced = bool(state["synced"])
        self._hello_due = bool(state["hello_due"])
        self._awaiting_adopt = bool(state["awaiting_adopt"])
        self._iteration = int(state["iteration"])
        self._incarnation = int(state["incarnation"])
        self._peers = {str(name): _Peer(int(p["incarnation"]), StepSet(int(p["floor"]), [int(s) for s in p["above"]]),
                                        p["batch"], p["capacity"], p["score"], p["reported_bw"],
                                        int(p["transfer_round"]), int(p["acked"]))
                       for name, p in state["peers"].items()}
        self._links = {}
        for name, residual in state["residuals"].items():
            link = self._links[str(name)] = LinkResidual()
            link.residual = {n: t.clone() for n, t in residual.items()}
        self._uplink = {str(n): LinkEstimate(self.link_alpha, v) for n, v in state["uplink"].items()}
        self._own_uplink = LinkEstimate(self.link_alpha, state["own_uplink"])
        self._sent_since_step = int(state["sent_since_step"])
        self._inbound = {str(n): LinkEstimate(self.link_alpha, v) for n, v in state["inbound"].items()}
        self._ratio = {str(n): float(v) for n, v in state["ratio"].items()}
        self._link_bytes = Counter({str(n): int(v) for n, v in state["link_bytes"].items()})
        self._transfers_in = Counter({str(n): int(v) for n, v in state["transfers_in"].items()})
        self._transfers_out = Counter({str(n): int(v) for n, v in state["transfers_out"].items()})
        self._score = state["score"]
        self._last_transfer_round = int(state["last_transfer_round"])
        balancer = state["balancer"]
        self.balancer.batch = int(balancer["batch"])
        self.balancer.basis = {str(n): float(v) for n, v in balancer["basis"].items()}
        self.balancer.rebalances = int(balancer["rebalances"])
        self.balancer.total_batch = int(balancer["total_batch"])
        time = state["time"]
        self._now = time["now"]
        self._blocked_s = float(time["blocked_s"])
        self._blocked_at_poll = bool(time["blocked_at_poll"])
        self._last_step_at = time["last_step_at"]
        self._blocked_at_last_step = float(time["blocked_at_last_step"])
        self._iteration_times = deque((float(t) for t in time["iteration_times"]), maxlen=self._iteration_times.maxlen)
        self._work_times = deque((float(t) for t in time["work_times"]), maxlen=self._work_times.maxlen)
        self._compute_rate, self._stream_rate = time["compute_rate"], time["stream_rate"]

    def observations(self) -> Observations:
        mean = math.fsum(self._iteration_times) / len(self._iteration_times) if self._iteration_times else None
        return Observations(
            blocked_seconds=self._blocked_s,
            iteration_time_s=mean,
            neighbour_lag={name: max(0, self._iteration - self._newest(name)) for name in self.peers},
            link_bandwidth={name: self.link_bandwidth(name) for name in self.peers},
            link_ratio=dict(self._ratio),
            link_bytes={name: float(v) for name, v in self._link_bytes.items()},
            batch_size=self.balancer.batch,
            capacity=self.capacity,
            knowledge_transfers={name: float(v) for name, v in self._transfers_in.items()},
        )

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats.update({
            "members": list(self._members),
            "iteration": self._iteration,
            "incarnation": self._incarnation,
            "batch_size": self.balancer.batch,
            "capacity_samples_per_s": self.capacity,
            "compute_samples_per_s": self._compute_rate,
            "stream_samples_per_s": self._stream_rate,
            "capacities": self._capacities(),
            "rebalances": self.balancer.rebalances,
            "iteration_time_s": self.iteration_time(),
            "compute_time_s": self.compute_time(),
            "uplink_bytes_per_s": self._own_uplink.value,
            "blocked_seconds": self._blocked_s,
            "score": self._score,
            "links": {name: {"bandwidth_bytes_per_s": self.link_bandwidth(name), "ratio": self._ratio.get(name),
                             "in_flight": self.in_flight(name),
                             "bytes_sent": self._link_bytes.get(name, 0),
                             "reported": name in self._peers and self._peers[name].reported_bw is not None}
                      for name in self.peers},
            "transfers_in": dict(self._transfers_in),
            "transfers_out": dict(self._transfers_out),
            "parts": {"weighted_batching": self.weighted_batching, "prioritised": self.prioritised,
                      "knowledge_transfer": self.knowledge_transfer},
        })
        return stats

    def accepts_partial(self, kind: str) -> bool:
        return kind == "gradient"

