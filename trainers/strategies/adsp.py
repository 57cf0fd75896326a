"""ADSP (AAAI 2020): local SGD without waiting, with commits equalised across workers.

Workers never wait. Each applies its own gradients locally (local SGD through the
trainer's optimizer) and, every ``max(min_interval_s, period_s / C - overhead_s)``
seconds (``trainers.commit_rate``), commits its change since the last commit or pull,
``delta = w - w_base``, as a ``delta`` message stamped with the server version it is
based on. All workers use the same ``C``, so fast and slow ones commit about equally
often; fast ones simply put more local steps into each commit.

The server applies ``W += delta / N`` on arrival (optional server momentum), records
staleness ``server_version - base_version``, and answers the committing worker alone
with the new model. It also fits the global loss (from the losses in the commits) per
check period and broadcasts ``C`` on the control channel when its search changes it.

Pulling keeps local progress: a worker that adopts a model ``S`` while it holds
uncommitted progress ``w - w_base`` continues from ``S + (w - w_base)`` (the progress
is committed with its next delta, not thrown away).

Robust aggregation (server side, :class:`trainers.aggregation.RobustAggregation`): a
per-commit norm bound (``max_update_norm``, clip or reject, counted per sender), and
coordinate-wise ``trimmed_mean`` / ``median`` over a window of one slot per committer
(:class:`trainers.aggregation.UpdateWindow`; a worker's commits within a window are
summed into its slot, being successive pieces of its progress). Once
``aggregate_window`` committers hold a slot (default: the job's workers; at most the
live ones) the server applies ``W += (slots / N) * aggregate`` and answers each of them
with the new model; until then a committer gets no answer and keeps training on its
own model, as it does between commits anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from edgestream.trainers.commit_rate import CommitRateSearch, CommitScheduler, commit_interval
from edgestream.trainers.errors import StrategyError
from edgestream.trainers.local import StepResult
from edgestream.trainers.messages import Outgoing, UpdateMessage
from edgestream.trainers.strategies.base import (
    Observations,
    StrategyContext,
    SyncStrategy,
    norm_bound_observations,
    register,
    snapshot_message,
)
from edgestream.trainers.strategies.windowed import WindowedServer

#: ``meta.op`` of the control message that carries the commit target.
COMMIT_RATE_OP = "commit_rate"


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StrategyError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _check_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise StrategyError(f"{name} must be a number, got {value!r}")
    return float(value)


def _clone(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in named.items()}


class ADSPWorker(SyncStrategy):
    """Worker side: local SGD, timed commits of the accumulated delta, pulls that keep progress.

    State: ``_base`` (parameters and floating-point buffers at the last commit or pull:
    the next delta is measured against it), ``_base_version`` (server version of the
    last adopted model, stamped on commits), the commit counter (``step`` of each
    delta, strictly increasing) and the loss and samples since the last commit.

    Invariants: ``_base_version`` only increases; the trainer's ``version`` is set to
    the server version on every pull and counts local steps in between (so it can drop
    back when a pull follows many local steps); staleness is recorded by the server only.
    """

    name = "adsp"
    role = "worker"
    subscribes = ("models", "control")

    def __init__(
        self,
        ctx: StrategyContext,
        *,
        period_s: float = 60.0,
        commit_rate: int = 20,
        min_interval_s: float = 1.0,
        overhead_s: float = 0.0,
    ) -> None:
        """``period_s``: check period; ``commit_rate``: ``C`` until the server sends one;
        ``min_interval_s``: shortest interval between commits; ``overhead_s``: time a
        commit costs, taken off the interval."""
        super().__init__(ctx)
        self.period_s = _check_number("period_s", period_s)
        self.min_interval_s = _check_number("min_interval_s", min_interval_s)
        self.overhead_s = _check_number("overhead_s", overhead_s)
        self.c = _check_positive_int("commit_rate", commit_rate)
        try:
            self.scheduler = CommitScheduler(self._interval())
        except ValueError as exc:
            raise StrategyError(f"adsp worker: {exc}") from exc
        self._synced = not ctx.joining
        self._base = self._current()
        self._base_version = self.trainer.version
        self._commit = 0
        self._control_seq = -1
        self._steps = 0
        self._samples = 0
        self._loss_sum = 0.0

    def _interval(self) -> float:
        return commit_interval(self.period_s, self.c, self.min_interval_s, self.overhead_s)

    def _current(self) -> dict[str, dict[str, torch.Tensor]]:
        buffers = {n: b for n, b in self.trainer.get_buffers().items() if b.is_floating_point()}
        return {"params": self.trainer.get_parameters(), "buffers": buffers}

    # -- hooks -------------------------------------------------------------------------------

    def can_train(self) -> bool:
        return self._synced

    def on_local_step(self, result: StepResult) -> list[Outgoing]:
        """Apply the step's gradient (and BatchNorm buffer change) locally; nothing is sent."""
        if not self._synced:
            raise StrategyError(f"adsp worker {self.worker_id}: local step before the first model")
        self.trainer.apply_gradient(result.gradients, buffer_deltas=result.buffer_deltas or None)
        self._steps += 1
        self._samples += result.batch_size
        self._loss_sum += result.loss
        self.counters["local_steps"] += 1
        return []

    def poll(self, now: float) -> list[Outgoing]:
        """Commit when the scheduler says so and there is something to commit."""
        if not self._synced or not self.scheduler.due(now) or self._steps == 0:
            return []
        return self._commit_now(now)

    def on_leave(self) -> list[Outgoing]:
        """A graceful stop: commit the local steps not committed yet, whatever the schedule
        (they would otherwise reach the server only if this worker came back)."""
        if not self._synced or self._steps == 0:
            return []
        return self._commit_now(None)  # the schedule does not move: the process is leaving

    def _commit_now(self, now: float | None) -> list[Outgoing]:
        current = self._current()
        delta = {n: current["params"][n] - self._base["params"][n] for n in current["params"]}
        buffers = {n: current["buffers"][n] - self._base["buffers"][n] for n in current["buffers"]}
        msg = UpdateMessage(
            kind="delta",
            sender=self.worker_id,
            step=self._commit,
            base_version=self._base_version,
            batch_size=self._samples,
            tensors=delta,
            buffers=buffers,
            meta={"loss": self._loss_sum / self._steps, "local_steps": self._steps},
        )
        self.counters["commits"] += 1
        self.counters["committed_local_steps"] += self._steps
        self._commit += 1
        self._base = current
        self._steps, self._samples, self._loss_sum = 0, 0, 0.0
        if now is not None:
            self.scheduler.committed(now)
        return [Outgoing("gradients", msg)]

    def on_message(self, msg: UpdateMessage) -> list[Outgoing]:
        if msg.kind == "model":
            self._adopt(msg)
        elif msg.kind == "control" and msg.meta.get("op") == COMMIT_RATE_OP:
            self._set_commit_rate(msg)
        else:
            self.counters["ignored_messages"] += 1
        return []

    def _adopt(self, msg: UpdateMessage) -> None:
        last = msg.meta.get("last_step")
        committed_elsewhere = False
        if msg.meta.get("worker") == self.worker_id and isinstance(last, int) and not isinstance(last, bool):
            # Addressed to us (a pull or a (re)join): number further commits after the last
            # one the server has, so a worker restarted without its counter is not dropped.
            if last + 1 > self._commit:
                # The server holds a commit we do not remember making: this worker was
                # restored from a checkpoint older than its last commits, which already
                # carried the progress it holds uncommitted. Keeping that progress would
                # apply it twice: take the model as it is.
                committed_elsewhere = self._synced and msg.base_version >= self._base_version
                self._commit = last + 1
                self.counters["commit_counter_resumed"] += 1
        if self._synced and msg.base_version <= self._base_version and not committed_elsewhere:
            self.counters["snapshots_ignored"] += 1  # duplicate or older than what we have
            return
        if committed_elsewhere:
            params, buffers = dict(msg.tensors), dict(msg.buffers)
            self._steps, self._samples, self._loss_sum = 0, 0, 0.0
            self.counters["uncommitted_progress_dropped"] += 1
        elif self._synced:
            # Keep the uncommitted progress: continue from model + (w - base).
            current = self._current()
            params = {n: msg.tensors[n] + (current["params"][n] - self._base["params"][n]) for n in msg.tensors}
            buffers = dict(msg.buffers)
            for n, value in current["buffers"].items():
                if n in buffers:
                    buffers[n] = buffers[n] + (value - self._base["buffers"][n])
        else:
            params, buffers = dict(msg.tensors), dict(msg.buffers)
        self.trainer.load_snapshot(params, buffers, msg.base_version)
        self._base = {
            "params": _clone(msg.tensors),
            "buffers": {n: b.detach().clone() for n, b in msg.buffers.items() if b.is_floating_point()},
        }
        self._base_version = msg.base_version
        self._synced = True
        self.counters["snapshots_adopted"] += 1

    def _set_commit_rate(self, msg: UpdateMessage) -> None:
        seq, c = msg.meta.get("seq"), msg.meta.get("c")
        if isinstance(seq, bool) or not isinstance(seq, int) or isinstance(c, bool) or not isinstance(c, int) or c < 1:
            self.counters["bad_control"] += 1
            return
        if seq <= self._control_seq:
            self.counters["control_ignored"] += 1  # duplicate or reordered older target
            return
        self._control_seq = seq
        self.c = c
        self.scheduler.set_interval(self._interval())
        self.counters["commit_rate_changes"] += 1

    # -- persistence and observability --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update({
            "synced": self._synced, "base": {k: dict(v) for k, v in self._base.items()},
            "base_version": self._base_version, "commit": self._commit, "c": self.c,
            "control_seq": self._control_seq, "steps": self._steps, "samples": self._samples,
            "loss_sum": self._loss_sum, "scheduler": self.scheduler.state_dict(),
        })
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._synced = bool(state["synced"])
        self._base = {k: _clone(v) for k, v in state["base"].items()}
        self._base_version = int(state["base_version"])
        self._commit = int(state["commit"])
        self.c = int(state["c"])
        self._control_seq = int(state["control_seq"])
        self._steps = int(state["steps"])
        self._samples = int(state["samples"])
        self._loss_sum = float(state["loss_sum"])
        self.scheduler.load_state_dict(state["scheduler"])

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        commits = self.counters["commits"]
        stats.update({
            "commit_rate": self.c, "commit_interval_s": self.scheduler.interval_s,
            "base_version": self._base_version,
            "local_steps_per_commit": self.counters["committed_local_steps"] / commits if commits else 0.0,
        })
        return stats

    def observations(self) -> Observations:
        """The ``C`` this worker commits by, the local steps in its commits so far and those its
        next timed commit will carry."""
        return Observations(commit_target=self.c, committed_local_steps=self.counters["committed_local_steps"],
                            steps_awaiting_commit=self._steps)


class ADSPServer(WindowedServer, SyncStrategy):
    """Server side: apply ``W += delta / N`` on arrival, answer with the model, search ``C``.

    ``N`` is the number of live workers: the context's members at start, then the set
    the last ``on_membership`` named (at least 1). A commit from a worker outside that
    set is still applied with the current ``N``. Dividing by the live count keeps the
    step size of one "round" of commits (one from each worker) equal to the mean delta
    when workers join or leave.

    Invariants: a commit is applied at most once per ``(sender, step)`` (a ``step`` not
    above the sender's last is a duplicate or out of order: counted, dropped);
    ``staleness`` holds exactly the applied commits; the model version counts them.
    """

    name = "adsp"
    role = "server"
    subscribes = ("gradients",)

    def __init__(
        self,
        ctx: StrategyContext,
        *,
        period_s: float = 60.0,
        commit_rate: int = 20,
        search: bool = True,
        target_loss: float | None = None,
        min_commit_rate: int = 1,
        max_commit_rate: int = 64,
        research_every_periods: int = 10,
        jump_ratio: float = 0.3,
        server_momentum: float = 0.0,
        aggregation: str = "mean",
        trim: int | None = None,
        max_update_norm: float | None = None,
        norm_policy: str = "clip",
        krum_f: int | None = None,
        aggregate_window: int | None = None,
    ) -> None:
        """``period_s``, ``commit_rate`` (initial ``C``), ``target_loss``,
        ``min_commit_rate``/``max_commit_rate``, ``research_every_periods`` and
        ``jump_ratio`` configure the :class:`CommitRateSearch`; ``search=False`` keeps
        ``C`` fixed (fixed-rate local SGD); ``server_momentum`` in ``[0, 1)``:
        ``m = mu m + delta / N; W += m`` (0: plain ``W += delta / N``). ``aggregation``,
        ``trim``, ``krum_f``, ``max_update_norm``, ``norm_policy``: robust aggregation
        (:class:`trainers.aggregation.RobustAggregation`); ``aggregate_window``: committers
        per aggregate (default: none for ``mean``, the job's workers for the robust rules)."""
        super().__init__(ctx)
        self._setup_robust("adsp server", "sum", ctx.members, aggregate_window, aggregation=aggregation, trim=trim,
                           krum_f=krum_f, max_update_norm=max_update_norm, norm_policy=norm_policy)
        if not 0.0 <= float(server_momentum) < 1.0:
            raise StrategyError(f"server_momentum must be in [0, 1), got {server_momentum}")
        self.server_momentum = float(server_momentum)
        self.search_enabled = bool(search)
        try:
            self.search = CommitRateSearch(
                period_s, initial_c=_check_positive_int("commit_rate", commit_rate), target_loss=target_loss,
                min_c=min_commit_rate, max_c=max_commit_rate, research_every_periods=research_every_periods,
                jump_ratio=jump_ratio,
            )
        except ValueError as exc:
            raise StrategyError(f"adsp server: {exc}") from exc
        self._workers: set[str] = set(ctx.members)
        self._last_step: dict[str, int] = {}
        self._losses: dict[str, float] = {}
        self._new_loss = False
        self._momentum: dict[str, torch.Tensor] = {}
        self._control_seq = 0

    @property
    def n(self) -> int:
        """The divisor of commits: live workers, at least 1."""
        return max(1, len(self._workers))

    def can_train(self) -> bool:
        return False

    def on_local_step(self, result: StepResult) -> list[Outgoing]:
        raise StrategyError("the adsp server does not run local steps")

    def on_message(self, msg: UpdateMessage) -> list[Outgoing]:
        if msg.kind != "delta":
            self.counters["ignored_messages"] += 1
            return []
        last = self._last_step.get(msg.sender)
        if last is not None and msg.step <= last:
            self.counters["duplicates"] += 1
            # Per sender too: a worker restored from a checkpoint older than its last commits
            # re-sends commit numbers the server has (their progress is in it already).
            self.counters[f"duplicates:{msg.sender}"] += 1
            return []
        staleness = self.trainer.version - msg.base_version
        if staleness < 0:
            self.counters["rejected_future"] += 1  # based on a version this server never had
            return []
        self._last_step[msg.sender] = msg.step
        self.counters[f"commits:{msg.sender}"] += 1
        loss = msg.meta.get("loss")
        if isinstance(loss, int | float) and not isinstance(loss, bool):
            self._losses[msg.sender] = float(loss)
            self._new_loss = True
        delta = msg.tensors
        if self.robust.max_update_norm is not None:
            delta = self.robust.bound_counted(msg.tensors, msg.sender, self.counters)
            if delta is None:
                # Left out: the committer gets the model as it is (without its delta).
                return [Outgoing("models", self._snapshot(msg.sender), to=msg.sender)]
        if self._window is not None:
            return self._collect(msg, delta)
        self._apply(delta, msg.buffers, 1.0 / self.n)
        self.staleness.record(staleness)
        self.counters["applied"] += 1
        return [Outgoing("models", self._snapshot(msg.sender), to=msg.sender)]

    def _collect(self, msg: UpdateMessage, delta: dict[str, torch.Tensor]) -> list[Outgoing]:
        """Add a commit to its sender's slot; once the window is full apply
        ``W += (slots / N) * aggregate`` and answer every committer in it."""
        window = self._fill_window(msg, delta)
        if window is None:
            return []
        self._apply(window.tensors, window.buffers or {}, len(window.slots) / self.n)
        self._settle_window(window)
        return [Outgoing("models", self._snapshot(slot.sender), to=slot.sender) for slot in window.slots]

    def _apply(self, tensors: dict[str, torch.Tensor], buffer_deltas: dict[str, torch.Tensor], scale: float) -> None:
        """``W += scale * delta`` (through the server momentum), buffers likewise; one version up."""
        params = self.trainer.get_parameters()
        for name, delta in tensors.items():
            step = delta.to(params[name].dtype) * scale
            if self.server_momentum:
                previous = self._momentum.get(name)
                step = step if previous is None else previous * self.server_momentum + step
                self._momentum[name] = step.clone()
            params[name] = params[name] + step
        self.trainer.set_parameters(params, version=self.trainer.version + 1)
        if buffer_deltas:
            current = self.trainer.get_buffers()
            self.trainer.set_buffers({n: current[n] + d.to(current[n].dtype) * scale for n, d in buffer_deltas.items()})

    def poll(self, now: float) -> list[Outgoing]:
        """Feed the global loss (mean of each live worker's latest) to the search; broadcast a new ``C``."""
        if not self.search_enabled:
            return []
        if self._new_loss:
            losses = [v for w, v in self._losses.items() if w in self._workers] or list(self._losses.values())
            self.search.observe_loss(now, sum(losses) / len(losses))
            self._new_loss = False
        changed = self.search.poll(now)
        if changed is None:
            return []
        self.counters["commit_rate_changes"] += 1
        return [Outgoing("control", self._commit_rate_message())]

    def on_membership(self, workers: Sequence[str]) -> list[Outgoing]:
        """Take the new live set (``N``); send each newly seen worker the model and ``C``."""
        joined = sorted(set(workers) - self._workers)
        self._workers = set(workers)
        self.counters["snapshots_sent"] += len(joined)
        out = []
        for worker in joined:
            out.append(Outgoing("models", self._snapshot(worker), to=worker))
            out.append(Outgoing("control", self._commit_rate_message(), to=worker))
        return out

    def _commit_rate_message(self) -> UpdateMessage:
        self._control_seq += 1
        return UpdateMessage(kind="control", sender=self.worker_id, step=self._control_seq,
                             base_version=self.trainer.version,
                             meta={"op": COMMIT_RATE_OP, "c": self.search.c, "seq": self._control_seq})

    def _snapshot(self, worker: str) -> UpdateMessage:
        meta = {"worker": worker, "last_step": self._last_step.get(worker, -1)}
        return snapshot_message(self.trainer, self.worker_id, meta=meta)

    # -- persistence and observability --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update({
            "workers": sorted(self._workers), "last_step": dict(self._last_step), "losses": dict(self._losses),
            "new_loss": self._new_loss, "momentum": dict(self._momentum), "control_seq": self._control_seq,
            "search": self.search.state_dict(),
            "window": self._window.state_dict() if self._window is not None else None,
        })
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._workers = set(state["workers"])
        self._last_step = {str(k): int(v) for k, v in state["last_step"].items()}
        self._losses = {str(k): float(v) for k, v in state["losses"].items()}
        self._new_loss = bool(state["new_loss"])
        self._momentum = _clone(state["momentum"])
        self._control_seq = int(state["control_seq"])
        self.search.load_state_dict(state["search"])
        if self._window is not None:
            self._window.load_state_dict(state.get("window") or {})  # absent in older checkpoints

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats.update({
            "workers": sorted(self._workers), "n": self.n, "commit_rate": self.search.c,
            "search": self.search.stats(),
            "aggregation": {**self.robust.describe(), "aggregate_window": self.aggregate_window},
            "window_senders": self._window.senders if self._window is not None else None,
            "commits_per_worker": {w: self.counters[f"commits:{w}"] for w in sorted(self._last_step)},
        })
        return stats

    def observations(self) -> Observations:
        """The search's ``C`` and its last fitted loss curve (none before the first period ends)."""
        fit = self.search.last_fit
        bounded = norm_bound_observations(self.counters)
        if fit is None:
            return Observations(commit_target=self.search.c, **bounded)
        return Observations(commit_target=self.search.c, fit_a2=fit.a2, fit_b=fit.b, fit_c0=fit.c0, fit_rmse=fit.rmse,
                            **bounded)


_WORKER_PARAMS = frozenset({"period_s", "commit_rate", "min_interval_s", "overhead_s"})
_SERVER_PARAMS = frozenset({
    "period_s", "commit_rate", "search", "target_loss", "min_commit_rate", "max_commit_rate",
    "research_every_periods", "jump_ratio", "server_momentum",
    "aggregation", "trim", "krum_f", "max_update_norm", "norm_policy", "aggregate_window",
})


@register("adsp", builds=(ADSPWorker, ADSPServer))
def create_adsp(ctx: StrategyContext, **params: Any) -> SyncStrategy:
    """Build the ADSP worker or server for ``ctx.role``. The job's parameters are shared:
    each role takes the ones it uses (see :class:`ADSPWorker` and :class:`ADSPServer`)."""
    unknown = set(params) - _WORKER_PARAMS - _SERVER_PARAMS
    if unknown:
        raise StrategyError(
            f"unknown adsp parameters {sorted(unknown)}; known: {sorted(_WORKER_PARAMS | _SERVER_PARAMS)}"
        )
    if ctx.role == "server":
        return ADSPServer(ctx, **{k: v for k, v in params.items() if k in _SERVER_PARAMS})
    return ADSPWorker(ctx, **{k: v for k, v in params.items() if k in _WORKER_PARAMS})
