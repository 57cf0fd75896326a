"""Serverless gossip training: decentralised SGD over a neighbour graph (``gossip``) and
EdgeGossip (``edgegossip``: balanced iterations, data- and accuracy-weighted mixing).

No server and no barrier. Each worker keeps its own model ``x_i`` and the newest
model it has of each graph neighbour ``x_j`` (see :mod:`trainers.topology`), and
trains on the mix of them (combine, then adapt):

    psi_i = sum_j W_ij x_j          (its own x_i included with W_ii)
    x_i   = psi_i - lr * grad f_i(psi_i)

The trainer always holds ``psi_i``: it is re-evaluated after each local step (with
the new ``x_i``) and whenever a newer neighbour model arrives. A worker never waits:
it mixes whatever neighbour models it holds; a neighbour it holds nothing of (yet)
gives its weight to the worker itself (row ``i`` still sums to 1). When every worker
steps once per round on its neighbours' models of the previous round this is exactly
synchronous decentralised SGD, and with no gradient (``lr_scale=0``) exactly
``x <- W x``: every worker converges to the average of the initial models.

Messages (all on ``models``, one per neighbour, ``to=neighbour``, so the driver
encodes each on that link's own codec and error-feedback residual):

- ``model`` (dense): the full model ``x_i`` at iteration ``k`` (``step = k``), sent to
  a neighbour on first contact (the start, a membership change, an adopted model).
  The receiver replaces what it held of the sender if ``k`` is newer.
- ``delta``: ``x_i(k) - x_i(k - 1)`` after each later local step (``step = k``,
  ``batch_size`` = the samples of that step; float buffers likewise). The receiver
  adds it to its copy, so its copy is the sender's model (minus the link's
  compression residual, when a compressing codec is on). A delta is applied once per
  ``(sender, step)``; deltas commute, so reordering is harmless; duplicates and
  deltas already inside the held model are counted and dropped.

Staleness: every applied delta records ``own iteration - sender iteration`` (>= 0)
in ``staleness`` (an *update* in the repository's sense); ``mix_lag`` records, at each
local step, the lag of every neighbour model in the mix.

Bounded lag (``max_lag`` = L, optional): a worker does not start iteration ``k + 1``
while a neighbour's newest model it has received is older than ``k - L`` (or while
it has nothing of a neighbour yet); the time it spends so is counted in
``blocked_seconds``. With a bound the mix is also *aligned*: the copy of a neighbour
that enters ``psi_i(k)`` is its model at iteration ``k`` at the newest (deltas of
later iterations wait in the copy's ``future`` until this worker gets there). With
``L = 0`` this is neighbour-synchronous decentralised SGD, ``x(k+1) = W x(k) - lr G``:
no global barrier, each worker waits for its own neighbours only, and with
``lr_scale=0`` the average of the models is preserved exactly (the consensus test).
Without a bound (default) the worker never waits and mixes the newest it holds.

Start and rebase: a worker sends its model to every neighbour that has none of it
(with a lag bound at its first ``poll``, so iteration 0 is mixed too; without one with
its first step; after a membership change; after a restart). A worker restarted from a checkpoint is a new *incarnation* (``meta
incarnation``, counted up by :meth:`on_restore`): its neighbours replace their copy of it
with the model it sends, whatever its iteration, and drop deltas of an older
incarnation. A worker that receives a model of a neighbour ahead of its own clock
moves its clock there (``clock_jumps``) and re-sends its model, so a worker that was
away rejoins at its peers' iteration instead of lagging behind them (and blocking them).

Membership: :meth:`on_membership` rebuilds the graph from the new member list
(deterministically: every worker with the same view builds the same graph), drops
what it held of workers that are no longer neighbours and sends its model to new
neighbours. ``init_noise`` > 0 adds a seeded per-worker Gaussian to the initial model
(:func:`initial_noise`): distinct initial models for consensus experiments. A joining worker (``ctx.joining``) does not train or send until it has
adopted the first neighbour model it receives.

EdgeGossip adds, on the same mechanism (parts *reconstructed* from the paper's ideas,
each a parameter):

1. Balanced iterations. Throughput ``r_i`` (samples/s) is measured as an EWMA over the
   step times handed in by ``poll(now)`` (waiting for data included), gossiped in
   message metadata as a table ``{worker: [rate, iteration]}`` (newest per worker
   wins, so rates spread beyond neighbours), and :meth:`batch_size_wanted` returns
   ``b_i = B_total * r_i / sum r`` clamped to ``[min_batch, max_batch]``
   (:func:`balanced_batch_size`; workers whose rate is not known yet count at the
   mean known rate).
2. Data-weighted mixing. Row ``i`` becomes a Metropolis-Hastings chain with target
   ``pi_k`` proportional to the samples behind ``k``'s latest iteration (the one
   weighting rule ``b_k / sum b``, :func:`trainers.aggregation.sample_weights`):
   ``P_ij = W_ij * min(1, pi_j / pi_i)``, ``P_ii = 1 - sum_j P_ij``. Weights stay in
   ``[0, W_ij]`` and rows sum to 1; the matrix is **row-stochastic, not doubly
   stochastic**: it is reversible with stationary distribution ``pi``, so pure mixing
   drives the workers to the ``pi``-weighted (sample-weighted) mean instead of the
   plain mean. With equal ``pi`` it is exactly ``W``.
3. Accuracy-aware mixing. :meth:`on_evaluation` takes the validation score; every
   ``score_every`` (K) iterations it rides in message metadata. ``pi_k`` is multiplied
   by ``exp(accuracy_bias * (acc_k - best known acc))`` (in ``(e^-bias, 1]``: bounded),
   so the mix leans towards more accurate neighbours with the same guarantees as 2.
4. Plateau: when the validation accuracy has not improved by more than
   ``plateau_eps`` for ``plateau_patience`` evaluations, the step's learning-rate scale
   is multiplied by ``lr_decay`` (not below ``min_lr_scale``); with
   ``stop_after_decays`` set, the worker stops training after that many decays.

Time only comes from ``poll(now)``: no clock is read here.
"""

from __future__ import annotations

import math
import statistics
import zlib
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from edgestream.trainers.aggregation import sample_weights
from edgestream.trainers.consensus import ModelSketch
from edgestream.trainers.errors import StrategyError
from edgestream.trainers.local import StepResult
from edgestream.trainers.messages import Outgoing, UpdateMessage
from edgestream.trainers.staleness import StalenessTracker
from edgestream.trainers.strategies.base import (
    Observations,
    StrategyContext,
    SyncStrategy,
    register,
)
from edgestream.trainers.topology import TOPOLOGIES, Graph, build_graph

Tensors = dict[str, torch.Tensor]


def balanced_batch_size(
    total_batch: int,
    rate: float,
    known_rates: Sequence[float],
    member_count: int,
    min_batch: int,
    max_batch: int,
) -> int:
    """EdgeGossip's balancing rule ``b_i = B_total * r_i / sum r``, clamped.

    ``known_rates`` are the rates this worker knows (its own included); the members
    whose rate it does not know yet are counted at their mean, so
    ``sum r ~= sum(known) * member_count / len(known)``.
    """
    positive = [r for r in known_rates if r > 0]
    if rate <= 0 or not positive:
        return max(min_batch, min(max_batch, total_batch // max(1, member_count)))
    total_rate = math.fsum(positive) * max(member_count, len(positive)) / len(positive)
    wanted = int(round(total_batch * rate / total_rate))
    return max(min_batch, min(max_batch, wanted))


def initial_noise(worker_id: str, tensors: Mapping[str, torch.Tensor], std: float) -> Tensors:
    """``tensors`` plus a Gaussian of standard deviation ``std`` drawn from a seed that
    depends on ``worker_id`` only (CRC-32 of its name), the same in every process and run."""
    gen = torch.Generator().manual_seed(zlib.crc32(worker_id.encode()))
    return {name: t.detach() + std * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
            for name, t in sorted(tensors.items())}


@dataclass
class _Held:
    """What a worker holds of one neighbour: its model as received, and what it knows of it.

    Invariant: ``tensors`` is the sender's model at iteration ``base`` plus every delta
    in ``(base, upto]`` and in ``above``; ``iteration`` is the newest iteration included.
    ``future`` holds deltas received but not folded in yet (aligned mixing: iterations
    beyond the holder's own); ``received`` is the newest iteration received at all.
    """

    tensors: Tensors
    buffers: Tensors
    base: int
    upto: int
    above: set[int] = field(default_factory=set)
    iteration: int = 0
    batch: int | None = None
    accuracy: float | None = None
    incarnation: int = 0
    future: dict[int, tuple[Tensors, Tensors, int]] = field(default_factory=dict)

    @property
    def received(self) -> int:
        return max(self.iteration, *self.future) if self.future else self.iteration

    def has(self, step: int) -> bool:
        return step <= self.upto or step in self.above or step in self.future

    def state(self) -> dict[str, Any]:
        return {"tensors": dict(self.tensors), "buffers": dict(self.buffers), "base": self.base,
                "upto": self.upto, "above": sorted(self.above), "iteration": self.iteration,
                "batch": self.batch, "accuracy": self.accuracy, "incarnation": self.incarnation,
                "future": {str(step): {"tensors": dict(t), "buffers": dict(b), "batch": n}
                           for step, (t, b, n) in sorted(self.future.items())}}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> _Held:
        held = cls({k: v.clone() for k, v in state["tensors"].items()},
                   {k: v.clone() for k, v in state["buffers"].items()},
                   int(state["base"]), int(state["upto"]), {int(s) for s in state["above"]},
                   int(state["iteration"]), None if state["batch"] is None else int(state["batch"]),
                   None if state["accuracy"] is None else float(state["accuracy"]),
                   int(state.get("incarnation", 0)))
        held.future = {int(step): (_clone(entry["tensors"]), _clone(entry["buffers"]), int(entry["batch"]))
                       for step, entry in state.get("future", {}).items()}
        return held


def _clone(named: Mapping[str, torch.Tensor]) -> Tensors:
    return {name: t.detach().clone() for name, t in named.items()}


def _as_count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _incarnation(msg: UpdateMessage) -> int:
    value = msg.meta.get("incarnation", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _as_score(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value <= 1:
        return float(value)
    return None


@register("gossip")
class GossipStrategy(SyncStrategy):
    """Asynchronous decentralised SGD with Metropolis-Hastings mixing (the baseline).

    Invariant: the trainer holds the mix ``psi_i`` of this worker's own model and the
    neighbour models it holds (weights non-negative, summing to 1); ``own`` is the
    model after the last local step; a delta is applied at most once per
    ``(sender, step)``.
    """

    name = "gossip"
    role = "worker"
    subscribes = ("inbox",)
    #: EdgeGossip shares rates and scores in metadata and weights the mix; the baseline not.
    balanced: ClassVar[bool] = False

    def __init__(
        self,
        ctx: StrategyContext,
        *,
        topology: str = "ring",
        degree: int = 3,
        topology_seed: int = 0,
        max_lag: int | None = None,
        batch_size: int | None = None,
        lr_scale: float = 1.0,
        rate_alpha: float = 0.3,
        stats_window: int = 50,
        init_noise: float = 0.0,
        sketch_dim: int = 32,
    ) -> None:
        """``topology``: ring | torus | regular | complete; ``degree`` and ``topology_seed``
        shape the regular graph. ``max_lag``: neighbour models more than this many
        iterations behind are left out of the mix (None: no bound). ``batch_size``: the
        fixed batch of every step (None: the job's ``train.max_step_batch``).
        ``lr_scale``: multiplies the trainer's learning rate on every step (0: mixing
        only, no gradient is applied: the consensus test). ``rate_alpha``: EWMA weight
        of a new throughput observation. ``stats_window``: iterations in the
        iteration-time statistics. ``init_noise``: standard deviation of the seeded
        per-worker noise added to the initial model (0: every worker starts from the job's
        model). ``sketch_dim``: length of the model sketch in :meth:`observations`."""
        super().__init__(ctx)
        if topology not in TOPOLOGIES:
            raise StrategyError(f"topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}")
        if max_lag is not None and max_lag < 0:
            raise StrategyError(f"max_lag must be >= 0, got {max_lag}")
        if batch_size is not None and batch_size <= 0:
            raise StrategyError(f"batch_size must be > 0, got {batch_size}")
        if not (lr_scale >= 0 and math.isfinite(lr_scale)):
            raise StrategyError(f"lr_scale must be finite and >= 0, got {lr_scale}")
        if not 0 < rate_alpha <= 1:
            raise StrategyError(f"rate_alpha must be in (0, 1], got {rate_alpha}")
        if not (init_noise >= 0 and math.isfinite(init_noise)):
            raise StrategyError(f"init_noise must be finite and >= 0, got {init_noise}")
        if sketch_dim <= 0:
            raise StrategyError(f"sketch_dim must be > 0, got {sketch_dim}")
        self.topology = topology
        self.degree = degree
        self.topology_seed = topology_seed
        self.max_lag = max_lag
        self.batch_size = batch_size
        self.rate_alpha = rate_alpha
        self._lr_scale = float(lr_scale)
        self._members: tuple[str, ...] = tuple(sorted(set(ctx.members) | {ctx.worker_id}))
        self._graph: Graph = self._build(self._members)
        self._synced = not ctx.joining
        self._iteration = 0
        self._incarnation = 0
        if init_noise > 0 and not ctx.joining:
            self.trainer.set_parameters(initial_noise(self.worker_id, self.trainer.get_parameters(), init_noise))
        self._own: Tensors = self.trainer.get_parameters()
        self._own_buffers: Tensors = self._float_buffers()
        self._held: dict[str, _Held] = {}
        self._based: set[str] = set()  # neighbours that were sent a full model of ours
        #: Lag of every neighbour model in the mix, recorded at each local step.
        self.mix_lag = StalenessTracker()
        # Time, all from poll(now).
        self._now: float | None = None
        self._stepped_since_poll = False
        self._busy_s = 0.0
        self._idle_s = 0.0
        self._blocked_s = 0.0
        self._blocked_at_poll = False
        self._sketch = ModelSketch(sketch_dim)
        self._last_step_at: float | None = None
        self._iteration_times: deque[float] = deque(maxlen=stats_window)
        self._rate: float | None = None
        self._rate_mark: float | None = None
        self._rate_pending = 0
        self._rate_blocked = 0.0  # blocked seconds at the rate mark
        self._last_batch: int | None = None

    # -- the graph ----------------------------------------------------------------------

    def _build(self, members: Sequence[str]) -> Graph:
        return build_graph(self.topology, members, degree=self.degree, seed=self.topology_seed)

    @property
    def graph(self) -> Graph:
        return self._graph

    @property
    def neighbours(self) -> tuple[str, ...]:
        return tuple(self._graph.neighbours[self.worker_id])

    def own_model(self) -> Tensors:
        """A copy of this worker's own model ``x_i`` (after its last local step)."""
        return _clone(self._own)

    def neighbour_model(self, name: str) -> Tensors | None:
        """A copy of the model this worker holds of neighbour ``name`` (None: nothing yet)."""
        held = self._held.get(name)
        return None if held is None else _clone(held.tensors)

    @property
    def iteration(self) -> int:
        """Local steps this worker's model embodies (its gossip clock)."""
        return self._iteration

    # -- hooks ------------------------------------------------------------------------------

    def can_train(self) -> bool:
        return self._synced and not self.lag_blocked()

    def lag_blocked(self) -> bool:
        """True while the lag bound keeps this worker from its next iteration: some
        neighbour's newest model received is older than ``iteration - max_lag``, or
        nothing of it has arrived yet."""
        if self.max_lag is None:
            return False
        floor = self._iteration - self.max_lag
        return any(name not in self._held or self._held[name].received < floor for name in self.neighbours)

    def batch_size_wanted(self) -> int | None:
        return self.batch_size

    def poll(self, now: float) -> list[Outgoing]:
        # Step 1. Charge the interval since the last poll as busy if a step ran in it.
        if self._now is not None and now > self._now:
            if self._stepped_since_poll:
                self._busy_s += now - self._now
            else:
                self._idle_s += now - self._now
                if self._blocked_at_poll:  # held back by the lag bound since the last poll
                    self._blocked_s += now - self._now
        # Step 2. Later steps are stamped with this time.
        if self._now is None or now >= self._now:
            self._now = float(now)
            self._stepped_since_poll = False
            self._blocked_at_poll = self._synced and self.lag_blocked()
        # Step 3. With a lag bound, neighbours holding nothing of us (the start, a restart)
        # get our model now: they wait for it. (Without one, the first step sends it.)
        if not self._synced or self.max_lag is None:
            return []
        return [self._model_to(name) for name in self.neighbours if name not in self._based]

    def on_local_step(self, result: StepResult) -> list[Outgoing]:
        if not self._synced:
            raise StrategyError(f"gossip worker {self.worker_id}: local step before it adopted a model")
        # Step 1. Adapt: the trainer holds psi_i, on which the gradient was computed.
        scale = self.step_lr_scale()
        if scale > 0:
            self.trainer.apply_gradient(result.gradients, lr_scale=scale, buffer_deltas=result.buffer_deltas)
        else:  # mixing only: the model moves by consensus alone
            self.trainer.set_parameters(self.trainer.get_parameters(), version=self.trainer.version + 1)
        self._iteration += 1
        self._observe_step(result.batch_size)
        self._fold_due()
        # Step 2. Send x_i(k): a delta to neighbours holding our model, the model to others.
        own, own_buffers = self.trainer.get_parameters(), self._float_buffers()
        out = self._send(own, own_buffers, result.batch_size)
        self._own, self._own_buffers = own, own_buffers
        # Step 3. Combine again with what we hold (the next step's psi_i, until newer arrives).
        for name in sorted(self._held):
            self.mix_lag.record(self._lag(self._held[name]))
        for name in self.neighbours:
            if name not in self._held:
                self.counters["missing_in_mix"] += 1
        self._remix(bump=False)
        return out

    def on_message(self, msg: UpdateMessage) -> list[Outgoing]:
        if msg.kind not in ("model", "delta"):
            self.counters["ignored_messages"] += 1
            return []
        if msg.sender == self.worker_id:
            self.counters["own_messages"] += 1
            return []
        if msg.sender not in self.neighbours:
            self.counters["not_neighbour"] += 1
            return []
        if msg.kind == "model":
            return self._take_model(msg)
        return self._take_delta(msg)

    def on_restore(self) -> list[Outgoing]:
        """Restarted from a checkpoint: become a new incarnation and send our model to every
        neighbour (they may hold iterations of ours that we are about to redo differently;
        the new incarnation makes them replace their copy and drop our older deltas)."""
        self._incarnation += 1
        self._based.clear()
        self.counters["restores"] += 1
        if not self._synced:
            return []
        return [self._model_to(name) for name in self.neighbours]

    def on_membership(self, workers: Sequence[str]) -> list[Outgoing]:
        members = tuple(sorted(set(workers) | {self.worker_id}))
        if members == self._members:
            return []
        before = set(self.neighbours)
        self._members = members
        self._graph = self._build(members)
        self.counters["membership_changes"] += 1
        after = set(self.neighbours)
        for gone in sorted(before - after):
            self._held.pop(gone, None)
            self._based.discard(gone)
        self._forget_departed(members)
        out: list[Outgoing] = []
        if self._synced:
            out = [self._model_to(name) for name in sorted(after - self._based)]
            self._remix(bump=True)
        return out

    # -- messages in ----------------------------------------------------------------------------

    def _take_model(self, msg: UpdateMessage) -> list[Outgoing]:
        held = self._held.get(msg.sender)
        incarnation = _incarnation(msg)
        if held is not None and (incarnation < held.incarnation
                                 or (incarnation == held.incarnation and msg.step <= held.upto)):
            self.counters["old_models"] += 1  # a duplicate, or older than what we hold
            return []
        self._held[msg.sender] = _Held(
            _clone(msg.tensors), {n: t.clone() for n, t in msg.buffers.items() if n in self._own_buffers},
            base=msg.step, upto=msg.step, iteration=msg.step,
            batch=_as_count(msg.meta.get("batch")), accuracy=_as_score(msg.meta.get("accuracy")),
            incarnation=incarnation,
        )
        self._note_meta(msg)
        self.counters["models_received"] += 1
        out: list[Outgoing] = []
        if self._synced and msg.step > self._iteration:
            # A neighbour ahead of our clock (we were away, or it is new to us): move our
            # clock to its iteration and re-send our model under the new numbering.
            self._iteration = msg.step
            self._based.clear()
            self._fold_due()
            self.counters["clock_jumps"] += 1
            out = [self._model_to(name) for name in self.neighbours]
        if not self._synced:
            # A joiner starts from the first neighbour model it gets, not from a fresh init.
            self._own = _clone(msg.tensors)
            self._own_buffers = {n: t.clone() for n, t in self._held[msg.sender].buffers.items()}
            self._iteration = max(self._iteration, msg.step)
            self._synced = True
            self.counters["adopted_models"] += 1
            out = [self._model_to(name) for name in self.neighbours if name not in self._based]
        self._remix(bump=True)
        return out

    def _take_delta(self, msg: UpdateMessage) -> list[Outgoing]:
        held = self._held.get(msg.sender)
        incarnation = _incarnation(msg)
        if held is None or incarnation > held.incarnation:
            self.counters["delta_without_model"] += 1  # its model (first, or after a restart) comes first
            return []
        if incarnation < held.incarnation:
            self.counters["old_incarnation"] += 1  # sent before the sender restarted
            return []
        if held.has(msg.step):
            self.counters["duplicate_deltas"] += 1
            return []
        accuracy = _as_score(msg.meta.get("accuracy"))
        if accuracy is not None:
            held.accuracy = accuracy
        self._note_meta(msg)
        if self.max_lag is not None and msg.step > self._iteration:
            # Aligned mixing: a neighbour's iteration beyond ours waits until we get there.
            held.future[msg.step] = (_clone(msg.tensors), _clone(msg.buffers), msg.batch_size)
            self.counters["deltas_deferred"] += 1
            return []
        self._fold(held, msg.step, msg.tensors, msg.buffers, msg.batch_size)
        self.counters["deltas_applied"] += 1
        self.staleness.record(self._lag(held))
        self._remix(bump=True)
        return []

    @staticmethod
    def _fold(held: _Held, step: int, tensors: Tensors, buffers: Tensors, batch: int) -> None:
        """Add the delta of iteration ``step`` to the copy."""
        for name, tensor in held.tensors.items():
            tensor.add_(tensors[name].to(tensor.dtype))
        for name, tensor in held.buffers.items():
            if name in buffers:
                tensor.add_(buffers[name].to(tensor.dtype))
        held.above.add(step)
        while held.upto + 1 in held.above:
            held.upto += 1
            held.above.discard(held.upto)
        held.iteration = max(held.iteration, step)
        held.batch = batch

    def _fold_due(self) -> None:
        """Fold deferred deltas of iterations we have reached into their copies."""
        for name in sorted(self._held):
            held = self._held[name]
            for step in sorted(s for s in held.future if s <= self._iteration):
                tensors, buffers, batch = held.future.pop(step)
                self._fold(held, step, tensors, buffers, batch)
                self.counters["deltas_applied"] += 1
                self.staleness.record(self._lag(held))

    def _note_meta(self, msg: UpdateMessage) -> None:
        """Metadata EdgeGossip reads (rates, scores); nothing for the baseline."""
        return None

    def _forget_departed(self, members: Sequence[str]) -> None:
        return None

    # -- messages out ---------------------------------------------------------------------------

    def _meta(self, batch: int | None) -> dict[str, Any]:
        return {}

    def _send(self, own: Tensors, own_buffers: Tensors, batch: int) -> list[Outgoing]:
        meta = {**self._meta(batch), "incarnation": self._incarnation}
        deltas = {name: own[name] - self._own[name] for name in own}
        buffer_deltas = {name: own_buffers[name] - self._own_buffers[name] for name in own_buffers}
        out = []
        for name in self.neighbours:
            if name not in self._based:
                out.append(self._model_to(name, own, own_buffers, batch))
                continue
            msg = UpdateMessage(kind="delta", sender=self.worker_id, step=self._iteration,
                                base_version=self.trainer.version, batch_size=batch, tensors=deltas,
                                buffers=buffer_deltas, meta=dict(meta))
            out.append(Outgoing("inbox", msg, to=name))
        self.counters["messages_sent"] += len(out)
        return out

    def _model_to(
        self, name: str, own: Tensors | None = None, own_buffers: Tensors | None = None, batch: int | None = None
    ) -> Outgoing:
        own = self._own if own is None else own
        buffers = self.trainer.get_buffers()
        buffers.update(self._own_buffers if own_buffers is None else own_buffers)
        msg = UpdateMessage(kind="model", sender=self.worker_id, step=self._iteration,
                            base_version=self.trainer.version, tensors=own, buffers=buffers,
                            meta={**self._meta(self._last_batch if batch is None else batch),
                                  "incarnation": self._incarnation})
        self._based.add(name)
        self.counters["models_sent"] += 1
        return Outgoing("inbox", msg, to=name)

    # -- mixing -----------------------------------------------------------------------------------

    def _lag(self, held: _Held) -> int:
        return max(0, self._iteration - held.iteration)

    def _in_mix(self) -> list[str]:
        """Neighbours whose held model enters the mix (all those we hold a model of)."""
        return [name for name in self.neighbours if name in self._held]

    def mixing_row(self) -> dict[str, float]:
        """This worker's current mixing weights (itself included): non-negative, sum 1."""
        base = self._graph.weights[self.worker_id]
        row = {name: base[name] for name in self._in_mix()}
        row[self.worker_id] = 1.0 - math.fsum(row.values())
        return row

    def _remix(self, *, bump: bool) -> None:
        """Set the trainer to ``psi_i = sum_j P_ij x_j`` (float64 sums in sorted order)."""
        row = self.mixing_row()
        sources = {name: (self._held[name].tensors, self._held[name].buffers)
                   for name in row if name != self.worker_id}
        sources[self.worker_id] = (self._own, self._own_buffers)
        order = sorted(row)
        params = {name: sum((sources[k][0][name].double() * row[k] for k in order),
                            torch.zeros_like(self._own[name], dtype=torch.float64)).float()
                  for name in self._own}
        buffers = {name: sum((sources[k][1][name].double() * row[k] for k in order if name in sources[k][1]),
                             torch.zeros_like(self._own_buffers[name], dtype=torch.float64)).float()
                   / math.fsum(row[k] for k in order if name in sources[k][1])
                   for name in self._own_buffers}
        self.trainer.set_parameters(params, version=self.trainer.version + 1 if bump else None)
        if buffers:
            self.trainer.set_buffers(buffers)

    # -- learning rate ----------------------------------------------------------------------------

    def step_lr_scale(self) -> float:
        """The factor on the trainer's learning rate for the next step."""
        return self._lr_scale

    # -- time -------------------------------------------------------------------------------------

    def _observe_step(self, batch: int) -> None:
        """Iteration time and throughput from the step stamps ``poll`` handed in."""
        self._stepped_since_poll = True
        self._last_batch = batch
        now = self._now
        if now is None:
            return
        if self._last_step_at is not None:
            self._iteration_times.append(now - self._last_step_at)
        self._last_step_at = now
        # Throughput is the worker's own capacity: samples over the time it computed or
        # waited for data, not the time the lag bound held it back (else, in lockstep,
        # every r_i would be b_i / T and balancing would keep whatever batches it has).
        working = None if self._rate_mark is None else (now - self._rate_mark) - (self._blocked_s - self._rate_blocked)
        if self._rate_mark is None:
            self._rate_mark, self._rate_pending, self._rate_blocked = now, batch, self._blocked_s
        elif working is not None and working > 0:
            observed = self._rate_pending / working
            self._rate = observed if self._rate is None else (
                (1 - self.rate_alpha) * self._rate + self.rate_alpha * observed)
            self._rate_mark, self._rate_pending, self._rate_blocked = now, batch, self._blocked_s
            self._rate_updated()
        else:
            self._rate_pending += batch

    def _rate_updated(self) -> None:
        return None

    @property
    def rate(self) -> float | None:
        """EWMA of samples per second (None before two step times were seen)."""
        return self._rate

    def idle_fraction(self) -> float:
        """Share of the time between polls in which no local step ran."""
        total = self._busy_s + self._idle_s
        return self._idle_s / total if total > 0 else 0.0

    def iteration_time_stats(self) -> tuple[float, float]:
        """(mean, coefficient of variation) of the last ``stats_window`` iteration times."""
        times = list(self._iteration_times)
        if not times:
            return 0.0, 0.0
        mean = math.fsum(times) / len(times)
        cv = statistics.pstdev(times) / mean if len(times) > 1 and mean > 0 else 0.0
        return mean, cv

    def _float_buffers(self) -> Tensors:
        return {name: b for name, b in self.trainer.get_buffers().items() if b.is_floating_point()}

    # -- checkpoint and observability -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update({
            "members": list(self._members),
            "synced": self._synced,
            "iteration": self._iteration,
            "incarnation": self._incarnation,
            "own": dict(self._own),
            "own_buffers": dict(self._own_buffers),
            "held": {name: held.state() for name, held in sorted(self._held.items())},
            "based": sorted(self._based),
            "mix_lag": self.mix_lag.state_dict(),
            "lr_scale": self._lr_scale,
            "time": {
                "now": self._now, "stepped_since_poll": self._stepped_since_poll, "busy_s": self._busy_s,
                "idle_s": self._idle_s, "blocked_s": self._blocked_s,
                "blocked_at_poll": self._blocked_at_poll, "last_step_at": self._last_step_at,
                "iteration_times": list(self._iteration_times), "rate": self._rate,
                "rate_mark": self._rate_mark, "rate_pending": self._rate_pending,
                "rate_blocked": self._rate_blocked, "last_batch": self._last_batch,
            },
        })
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._members = tuple(str(m) for m in state["members"])
        self._graph = self._build(self._members)
        self._synced = bool(state["synced"])
        self._iteration = int(state["iteration"])
        self._incarnation = int(state["incarnation"])
        self._own = _clone(state["own"])
        self._own_buffers = _clone(state["own_buffers"])
        self._held = {str(name): _Held.from_state(held) for name, held in state["held"].items()}
        self._based = {str(name) for name in state["based"]}
        self.mix_lag.load_state_dict(state["mix_lag"])
        self._lr_scale = float(state["lr_scale"])
        time = state["time"]
        self._now = time["now"]
        self._stepped_since_poll = bool(time["stepped_since_poll"])
        self._busy_s, self._idle_s = float(time["busy_s"]), float(time["idle_s"])
        self._blocked_s = float(time["blocked_s"])
        self._blocked_at_poll = bool(time["blocked_at_poll"])
        self._last_step_at = time["last_step_at"]
        self._iteration_times = deque((float(t) for t in time["iteration_times"]),
                                      maxlen=self._iteration_times.maxlen)
        self._rate, self._rate_mark = time["rate"], time["rate_mark"]
        self._rate_pending = int(time["rate_pending"])
        self._rate_blocked = float(time["rate_blocked"])
        self._last_batch = time["last_batch"]

    def observations(self) -> Observations:
        mean, cv = self.iteration_time_stats()
        return Observations(
            blocked_seconds=self._blocked_s,
            idle_fraction=self.idle_fraction(),
            iteration_time_s=mean if self._iteration_times else None,
            iteration_time_cv=cv if len(self._iteration_times) > 1 else None,
            neighbour_lag={name: self._lag_received(held) for name, held in sorted(self._held.items())},
            mixing_weights=self.mixing_row(),
            model_sketch=self._sketch(self._own),
        )

    def _lag_received(self, held: _Held) -> int:
        return max(0, self._iteration - held.received)

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        mean, cv = self.iteration_time_stats()
        stats.update({
            "topology": self.topology,
            "members": list(self._members),
            "neighbours": list(self.neighbours),
            "iteration": self._iteration,
            "mixing_weights": self.mixing_row(),
            "neighbour_lag": {name: self._lag_received(held) for name, held in sorted(self._held.items())},
            "incarnation": self._incarnation,
            "blocked_seconds": self._blocked_s,
            "mix_lag": self.mix_lag.summary(),
            "rate_samples_per_s": self._rate,
            "idle_fraction": self.idle_fraction(),
            "iteration_time_mean_s": mean,
            "iteration_time_cv": cv,
            "lr_scale": self.step_lr_scale(),
            "batch_size_wanted": self.batch_size_wanted(),
        })
        return stats


@register("edgegossip")
class EdgeGossipStrategy(GossipStrategy):
    """Gossip with balanced iterations, data- and accuracy-weighted mixing, plateau LR decay.

    Invariant (beyond the baseline's): every mixing weight lies in ``[0, W_ij]`` and each
    row sums to 1; the learning-rate scale only decreases, never below ``min_lr_scale``.
    """

    name = "edgegossip"
    balanced = True
    uses_validation = True

    def __init__(
        self,
        ctx: StrategyContext,
        *,
        total_batch: int | None = None,
        batch_size: int = 32,
        min_batch: int = 4,
        max_batch: int = 256,
        data_weighted: bool = True,
        min_link_share: float = 0.5,
        score_every: int = 10,
        accuracy_bias: float = 4.0,
        plateau_eps: float = 0.002,
        plateau_patience: int = 3,
        lr_decay: float = 0.5,
        min_lr_scale: float = 0.01,
        stop_after_decays: int | None = None,
        **gossip: Any,
    ) -> None:
        """``total_batch``: ``B_total`` shared by all workers (None: ``batch_size`` times
        the member count); ``batch_size``: the batch before any rate is known;
        ``min_batch``/``max_batch``: the clamp of ``b_i``. ``min_link_share``: no link's
        weight falls below this share of its Metropolis weight ``W_ij`` (0: none; with
        balanced batches 64x apart, a node with a large batch would otherwise hardly mix
        and drift on its own data). ``data_weighted``: weight the
        mix by the samples behind each model. ``score_every``: K, iterations between
        shared scores. ``accuracy_bias``: beta of ``exp(beta * (acc - best))`` (0: off).
        ``plateau_eps``/``plateau_patience``/``lr_decay``/``min_lr_scale``: LR decay after
        ``patience`` evaluations without a gain above ``eps``. ``stop_after_decays``: stop
        training after that many decays (None: never). The rest: :class:`GossipStrategy`."""
        super().__init__(ctx, batch_size=batch_size, **gossip)
        if not 0 < min_batch <= max_batch:
            raise StrategyError(f"need 0 < min_batch <= max_batch, got {min_batch}, {max_batch}")
        if total_batch is not None and total_batch <= 0:
            raise StrategyError(f"total_batch must be > 0, got {total_batch}")
        if score_every <= 0 or plateau_patience <= 0:
            raise StrategyError("score_every and plateau_patience must be > 0")
        if accuracy_bias < 0 or not 0 < lr_decay <= 1 or not 0 < min_lr_scale:
            raise StrategyError("need accuracy_bias >= 0, 0 < lr_decay <= 1, min_lr_scale > 0")
        self.total_batch = total_batch
        self.min_batch, self.max_batch = min_batch, max_batch
        self.data_weighted = data_weighted
        if not 0 <= min_link_share <= 1:
            raise StrategyError(f"min_link_share must be in [0, 1], got {min_link_share}")
        self.min_link_share = min_link_share
        self.score_every = score_every
        self.accuracy_bias = accuracy_bias
        self.plateau_eps = plateau_eps
        self.plateau_patience = plateau_patience
        self.lr_decay = lr_decay
        self.min_lr_scale = min_lr_scale
        self.stop_after_decays = stop_after_decays
        self._rates: dict[str, tuple[float, int]] = {}  # worker -> (samples/s, its iteration then)
        self._accuracy: float | None = None
        self._best: float | None = None
        self._since_best = 0
        self._decays = 0
        self._decay_factor = 1.0

    # -- balanced iterations ------------------------------------------------------------------

    def batch_size_wanted(self) -> int | None:
        if self._rate is None:
            return self.batch_size
        total = self.total_batch if self.total_batch is not None else self.batch_size * len(self._members)
        known = [rate for name, (rate, _) in self._rates.items() if name in self._members]
        return balanced_batch_size(total, self._rate, known, len(self._members), self.min_batch, self.max_batch)

    def _rate_updated(self) -> None:
        if self._rate is not None:
            self._rates[self.worker_id] = (self._rate, self._iteration)

    def _meta(self, batch: int | None) -> dict[str, Any]:
        meta: dict[str, Any] = {"rates": {name: [rate, stamp] for name, (rate, stamp) in sorted(self._rates.items())}}
        if batch:
            meta["batch"] = batch
        if self._accuracy is not None and self._iteration % self.score_every == 0:
            meta["accuracy"] = self._accuracy
        return meta

    def _note_meta(self, msg: UpdateMessage) -> None:
        rates = msg.meta.get("rates")
        if not isinstance(rates, dict):
            return
        for name, entry in rates.items():
            if name == self.worker_id or name not in self._members:
                continue
            if not (isinstance(entry, list) and len(entry) == 2):
                self.counters["bad_rate_entries"] += 1
                continue
            rate, stamp = entry
            if not (isinstance(rate, int | float) and not isinstance(rate, bool) and math.isfinite(rate)
                    and rate > 0 and isinstance(stamp, int) and not isinstance(stamp, bool)):
                self.counters["bad_rate_entries"] += 1
                continue
            held = self._rates.get(name)
            if held is None or stamp > held[1]:
                self._rates[name] = (float(rate), stamp)

    def _forget_departed(self, members: Sequence[str]) -> None:
        for name in [n for n in self._rates if n not in members]:
            del self._rates[name]

    # -- data- and accuracy-weighted mixing -----------------------------------------------------

    def mixing_row(self) -> dict[str, float]:
        """``P_ij = W_ij * max(min_link_share, min(1, pi_j / pi_i))``, ``P_ii = 1 - sum``: see
        the module docstring."""
        present = self._in_mix()
        base = self._graph.weights[self.worker_id]
        if not present:
            return {self.worker_id: 1.0}
        nodes = [self.worker_id, *present]
        batches = [self._last_batch] + [self._held[name].batch for name in present]
        scores = [self._accuracy] + [self._held[name].accuracy for name in present]
        target = [1.0] * len(nodes)
        if self.data_weighted:
            known = [b for b in batches if b]
            fill = max(1, round(math.fsum(known) / len(known))) if known else 1
            target = sample_weights([b if b else fill for b in batches])
        known_scores = [s for s in scores if s is not None]
        if self.accuracy_bias > 0 and known_scores:
            fill_score = math.fsum(known_scores) / len(known_scores)
            best = max(known_scores)
            target = [t * math.exp(self.accuracy_bias * ((fill_score if s is None else s) - best))
                      for t, s in zip(target, scores, strict=True)]
        own = target[0]
        row = {name: base[name] * max(self.min_link_share, min(1.0, pi / own))
               for name, pi in zip(present, target[1:], strict=True)}
        row[self.worker_id] = 1.0 - math.fsum(row.values())
        return row

    # -- accuracy: scores and plateau -----------------------------------------------------------

    def on_evaluation(self, accuracy: float, loss: float) -> list[Outgoing]:
        if not (math.isfinite(accuracy) and 0 <= accuracy <= 1):
            self.counters["bad_evaluations"] += 1
            return []
        self._accuracy = float(accuracy)
        self.counters["evaluations"] += 1
        if self._best is None or accuracy > self._best + self.plateau_eps:
            self._best = float(accuracy)
            self._since_best = 0
            return []
        self._since_best += 1
        if self._since_best >= self.plateau_patience:
            self._since_best = 0
            self._decays += 1
            self._decay_factor = self._decay_factor * self.lr_decay
            self.counters["lr_decays"] += 1
        return []

    def step_lr_scale(self) -> float:
        if self._lr_scale == 0:
            return 0.0
        return max(self.min_lr_scale, self._lr_scale * self._decay_factor)

    def can_train(self) -> bool:
        stopped = self.stop_after_decays is not None and self._decays >= self.stop_after_decays
        return super().can_train() and not stopped

    @property
    def decays(self) -> int:
        return self._decays

    # -- checkpoint and observability -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["edge"] = {
            "rates": {name: [rate, stamp] for name, (rate, stamp) in sorted(self._rates.items())},
            "accuracy": self._accuracy, "best": self._best, "since_best": self._since_best,
            "decays": self._decays, "decay_factor": self._decay_factor,
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        edge = state["edge"]
        self._rates = {str(name): (float(rate), int(stamp)) for name, (rate, stamp) in edge["rates"].items()}
        self._accuracy = edge["accuracy"]
        self._best = edge["best"]
        self._since_best = int(edge["since_best"])
        self._decays = int(edge["decays"])
        self._decay_factor = float(edge["decay_factor"])

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats.update({
            "known_rates": {name: rate for name, (rate, _) in sorted(self._rates.items())},
            "accuracy": self._accuracy,
            "best_accuracy": self._best,
            "lr_decays": self._decays,
        })
        return stats
