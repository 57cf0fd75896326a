"""The SyncStrategy interface, its context, and the name -> strategy registry.

A strategy is a synchronous, deterministic state machine. The pipeline feeds it
decoded, validated messages and local step results, and publishes what it returns;
strategies never import Kafka, never sleep and never read the clock (``poll`` is
handed the time). All hooks run on the one training thread, next to the trainer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from edgestream import plugins
from edgestream.streams.topics import SERVER_NAME
from edgestream.trainers.errors import StrategyError, UnknownStrategyError
from edgestream.trainers.local import LocalTrainer, StepResult
from edgestream.trainers.messages import Channel, MessageKind, Outgoing, UpdateMessage
from edgestream.trainers.observations import Observations
from edgestream.trainers.staleness import StalenessTracker
from edgestream.trainers.validation import TensorSpec

Role = Literal["worker", "server"]

__all__ = [
    "Channel",
    "MessageKind",
    "Observations",
    "Outgoing",
    "Role",
    "SERVER_NAME",
    "StrategyContext",
    "SyncStrategy",
    "UpdateMessage",
    "create",
    "names",
    "register",
    "roles",
    "snapshot_message",
    "strategy_class",
    "subscribing",
]


@dataclass(frozen=True)
class StrategyContext:
    """What a strategy instance is bound to.

    ``worker_id`` is this process's stable id (also the ``sender`` on its messages);
    ``trainer`` is the model the strategy updates; ``members`` is the initial set of
    workers of the job (for a server: the workers it expects); ``joining`` is true
    for a worker that enters a running job and must first receive the model.
    """

    worker_id: str
    trainer: LocalTrainer
    role: Role = "worker"
    members: tuple[str, ...] = ()
    joining: bool = False


class SyncStrategy(ABC):
    """How one process turns local steps and peers' messages into model updates.

    Hooks (all return the messages to publish, possibly none):

    - :meth:`on_local_step` after the trainer computed a gradient (workers only);
    - :meth:`on_message` for every decoded, validated message on a subscribed channel;
    - :meth:`poll` with the current time, for timers;
    - :meth:`on_membership` when the pipeline learns the set of live workers changed.

    :meth:`can_train` says whether the pipeline may run the next local step.

    Invariant: every update a strategy applies was computed on a known model
    version, and the staleness it was applied at is recorded in ``staleness``.
    """

    name: ClassVar[str]
    role: ClassVar[Role]
    subscribes: ClassVar[tuple[Channel, ...]]
    """Channels whose messages the pipeline must feed to :meth:`on_message`."""

    def __init__(self, ctx: StrategyContext) -> None:
        if ctx.role != self.role:
            raise StrategyError(f"{type(self).__name__} plays role {self.role!r}, context says {ctx.role!r}")
        self.ctx = ctx
        self.trainer = ctx.trainer
        self.worker_id = ctx.worker_id
        self.staleness = StalenessTracker()
        self.counters: Counter[str] = Counter()

    @abstractmethod
    def can_train(self) -> bool:
        """True when the pipeline may call ``trainer.compute_gradient`` and then :meth:`on_local_step`."""

    @abstractmethod
    def on_local_step(self, result: StepResult) -> list[Outgoing]:
        """Take the result of one local step computed on ``trainer.version``."""

    @abstractmethod
    def on_message(self, msg: UpdateMessage) -> list[Outgoing]:
        """Take one message from a subscribed channel (already validated, addressed to us or to all)."""

    def poll(self, now: float) -> list[Outgoing]:
        """Run timers against ``now`` (seconds, any monotonic origin). Default: nothing."""
        return []

    def on_membership(self, workers: Sequence[str]) -> list[Outgoing]:
        """The pipeline's current view of live workers changed. Default: ignore."""
        return []

    def on_leave(self) -> list[Outgoing]:
        """This process stops on purpose (a graceful stop: SIGTERM, or the end of a run),
        after its last step and before its final checkpoint: what it sends so no progress
        stays behind (ADSP commits its uncommitted local steps). Default: nothing."""
        return []

    def on_restore(self) -> list[Outgoing]:
        """This process was restarted and its state restored from a checkpoint
        (:meth:`load_state_dict` ran; peers went on meanwhile). Called once, before any
        message or step of the new run; not called for an in-process copy. Gossip uses
        it to re-base its neighbours. Default: nothing."""
        return []

    # -- optional hooks: the driver (trainers/driver.py) calls these; defaults suit BSP/ASP --

    #: Whether this role holds a model worth evaluating on the held-out set.
    evaluates_model: ClassVar[bool] = True
    #: The batcher mode the strategy is designed for (``window`` for ScaDLES); None: any.
    preferred_batcher: ClassVar[str | None] = None
    #: Whether the live runtime publishes this strategy's messages from a sender task (in
    #: order, settling each step's records once its messages are out), so the next local step
    #: does not wait for the uplink, as on the simulated clock; checkpoints wait for the
    #: queue (DLion: a message sized for a link goes while the next step computes).
    background_sends: ClassVar[bool] = False
    #: Whether worker replicas at the same model version hold bitwise identical parameters,
    #: whatever the delivery order and duplicates (BSP, ScaDLES); the conformance suite
    #: (tests/unit/trainers/test_strategy_conformance.py) checks it when True.
    replicas_identical: ClassVar[bool] = False
    #: Whether each worker holds one stage of a split model (``train.stages``; its trainer is a
    #: ``trainers.stages.StageTrainer``, one worker per stage, stage 0 reads every device).
    stage_split: ClassVar[bool] = False
    #: Whether the strategy decides from a score of its own model (:meth:`on_evaluation`:
    #: EdgeGossip's mixing and plateau decay, DLion's knowledge transfer). The adapters then
    #: score the model on the job's validation split (``Driver.validate``) at every
    #: evaluation; the held-out test split never reaches a strategy.
    uses_validation: ClassVar[bool] = False

    def compression_signal_ratio(self) -> float | None:
        """Top-k ratio at which the driver computes the compression signal of every new
        gradient, against the outgoing link's error-feedback residual, and hands it to
        :meth:`observe_signal` before :meth:`on_local_step`; None: not wanted (default).
        Needed by ScaDLES's adaptive-compression vote."""
        return None

    def observe_signal(self, signal: float) -> None:
        """The compression signal of the gradient :meth:`on_local_step` gets next."""
        return None

    def compression_decision(self) -> bool | None:
        """The replicated compress/dense decision for the pending step, if the strategy
        takes one (ScaDLES); the driver logs each switch. Default None."""
        return None

    def batch_size_wanted(self) -> int | None:
        """Most records the next local step should train on (dynamic batching: DLion,
        EdgeGossip); None: the job's ``train.max_step_batch`` (default)."""
        return None

    def tensor_spec(self, kind: str, spec: TensorSpec) -> TensorSpec:
        """What a message of ``kind`` may carry; ``spec`` is the full model's. Stage
        activations (synthetic gradients) return their own spec. Default: ``spec``."""
        return spec

    def accepts_partial(self, kind: str) -> bool:
        """True if a message of ``kind`` may carry a subset of the parameters (per-link
        top-k exchange: DLion); each tensor it carries is still checked. Default False."""
        return False

    def local_step(self, trainer: LocalTrainer, features: Any, labels: Any) -> StepResult:
        """The local step on one batch. Default: full-model cross-entropy
        (``trainer.compute_gradient``); a stage trainer overrides it (synthetic gradients)."""
        return trainer.compute_gradient(features, labels)

    def local_step_rejected(self) -> None:
        """The step :meth:`local_step` just computed (or failed to: a ``BatchError``) is
        refused: nothing of it is applied or published (a strategy that prepared messages in
        ``local_step`` drops them). Default: nothing."""
        return None

    def probe_step(self, trainer: LocalTrainer, features: Any, labels: Any) -> StepResult:
        """A step on part of a refused batch, computed only to be judged (the driver's culprit
        search): nothing of it is applied, published or counted, whatever it shows. Default:
        :meth:`local_step`, then :meth:`local_step_discarded` (also when it raises)."""
        try:
            return self.local_step(trainer, features, labels)
        finally:
            self.local_step_discarded()

    def local_step_discarded(self) -> None:
        """Drop what :meth:`local_step` just prepared, for a probe (:meth:`probe_step`): like
        :meth:`local_step_rejected` but counted as nothing. Default: ``local_step_rejected``."""
        self.local_step_rejected()

    def queued_steps(self) -> int:
        """Local steps this worker can take now on inputs it received in messages rather than
        from its streams (a later stage of a split model: activations); the adapter runs them
        (``local_step`` with ``features`` and ``labels`` None) before stream steps, whatever
        :meth:`can_train` says. Default 0."""
        return 0

    def on_evaluation(self, accuracy: float, loss: float) -> list[Outgoing]:
        """The score of this process's model on the validation split (never the held-out
        test split), for a strategy with ``uses_validation`` (accuracy-aware mixing:
        EdgeGossip). Default: nothing."""
        return []

    def on_transfer(self, peer: str | None, nbytes: int, seconds: float) -> None:
        """Feedback on one message this process sent: its size and how long it took to
        reach ``peer`` (None: a broadcast). Per-link bandwidth estimates: DLion."""
        return None

    def on_arrival(self, peer: str, nbytes: int, seconds: float) -> None:
        """A message from ``peer`` of ``nbytes`` arrived ``seconds`` after it was produced
        (produce-to-consume transit, measured by the adapter; always > 0 and finite).
        Called by the driver for accepted messages only, right before :meth:`on_message`.
        Per-link bandwidth estimates: DLion. Default: nothing."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume after a restart; tensors and primitives only."""
        return {"counters": dict(self.counters), "staleness": self.staleness.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (on a fresh instance with the same context)."""
        self.counters = Counter({str(k): int(v) for k, v in state["counters"].items()})
        self.staleness.load_state_dict(state["staleness"])

    def stats(self) -> dict[str, Any]:
        """JSON-able observability snapshot: version, staleness summary, event counters."""
        return {
            "strategy": self.name,
            "role": self.role,
            "worker": self.worker_id,
            "version": self.trainer.version,
            "staleness": self.staleness.summary(),
            "counters": dict(self.counters),
        }

    def observations(self) -> Observations:
        """The strategy's numbers for the live metrics, from the fixed vocabulary of
        :class:`Observations` (commit target, committed local steps, blocked seconds, clock
        gap, loss-curve fit). The runtime calls it about once a second on the training
        thread; it must be cheap and must not change state. Default: what the norm bound of
        robust aggregation clipped or rejected, per sender (``norm_bound_observations``)."""
        return Observations(**norm_bound_observations(self.counters))


def norm_bound_observations(counters: Mapping[str, int]) -> dict[str, dict[str, float] | None]:
    """``updates_clipped`` / ``updates_norm_rejected`` per sender from a strategy's counters
    (``updates_clipped:<sender>``, ``updates_rejected:<sender>``); None where it counted none."""
    out: dict[str, dict[str, float] | None] = {}
    for field_name, prefix in (("updates_clipped", "updates_clipped:"), ("updates_norm_rejected", "updates_rejected:")):
        per = {key[len(prefix):]: float(v) for key, v in counters.items() if key.startswith(prefix)}
        out[field_name] = per or None
    return out


def snapshot_message(
    trainer: LocalTrainer,
    sender: str,
    *,
    include_momentum: bool = False,
    meta: dict[str, Any] | None = None,
) -> UpdateMessage:
    """A ``model`` message carrying ``trainer``'s parameters and buffers at its version."""
    return UpdateMessage(
        kind="model",
        sender=sender,
        step=trainer.version,
        base_version=trainer.version,
        tensors=trainer.get_parameters(),
        buffers=trainer.get_buffers(),
        optimizer=trainer.get_momentum() if include_momentum else {},
        meta=dict(meta or {}),
    )


# -- registry -----------------------------------------------------------------------

StrategyFactory = Callable[..., SyncStrategy]


@dataclass(frozen=True)
class _Entry:
    factory: StrategyFactory
    #: The class the factory builds for each role it plays (its ClassVars are the strategy's).
    classes: Mapping[Role, type[SyncStrategy]]

    @property
    def roles(self) -> tuple[Role, ...]:
        return tuple(role for role in ("worker", "server") if role in self.classes)


_REGISTRY: dict[str, _Entry] = {}


def register(
    name: str, *, builds: Sequence[type[SyncStrategy]] = ()
) -> Callable[[StrategyFactory], StrategyFactory]:
    """Register ``factory(ctx, **params) -> SyncStrategy`` under ``name``.

    A class registers itself: it builds itself, for its ``role``. A function declares the
    classes it builds, one per role (``builds=(Worker, Server)``), so the registry reads
    the same ClassVars (``subscribes``, ``stage_split``, ...) whichever way a strategy is
    registered. The roles are those of the classes; a job whose strategy plays ``server``
    needs a server process besides its workers.
    """

    def decorate(factory: StrategyFactory) -> StrategyFactory:
        if name in _REGISTRY:
            raise StrategyError(f"strategy {name!r} is already registered")
        built = tuple(builds) or ((factory,) if isinstance(factory, type) else ())
        if not built:
            raise StrategyError(
                f"strategy {name!r} is registered as a function: declare the classes it builds, "
                f"@register({name!r}, builds=(WorkerClass, ServerClass))")
        classes: dict[Role, type[SyncStrategy]] = {}
        for cls in built:
            if not (isinstance(cls, type) and issubclass(cls, SyncStrategy)):
                raise StrategyError(f"strategy {name!r}: {cls!r} is not a SyncStrategy class")
            if cls.role in classes:
                raise StrategyError(f"strategy {name!r}: two classes for role {cls.role!r}")
            classes[cls.role] = cls
        _REGISTRY[name] = _Entry(factory=factory, classes=classes)
        return factory

    return decorate


def _registered() -> dict[str, _Entry]:
    """The registry, with the installed plugins' strategies (``edgestream.strategies``) loaded."""
    plugins.load_group(plugins.STRATEGIES)
    return _REGISTRY


def names() -> list[str]:
    """Registered strategy names (installed plugins' included), sorted."""
    return sorted(_registered())


def _entry(name: str) -> _Entry:
    entry = _REGISTRY.get(name)
    if entry is None:
        entry = _registered().get(name)
    if entry is None:
        raise UnknownStrategyError(name, names(), note=plugins.failure_note(plugins.STRATEGIES))
    return entry


def roles(name: str) -> tuple[Role, ...]:
    """Roles strategy ``name`` can play (``("worker",)`` or ``("worker", "server")``)."""
    return _entry(name).roles


def strategy_class(name: str, role: Role = "worker") -> type[SyncStrategy]:
    """The class :func:`create` builds for strategy ``name`` in ``role`` (its ClassVars)."""
    entry = _entry(name)
    try:
        return entry.classes[role]
    except KeyError:
        raise UnknownStrategyError(name, names(), role=role) from None


def stage_split_names() -> list[str]:
    """Registered strategies whose workers each hold one stage of a split model (``stage_split``)."""
    return sorted(n for n, e in _registered().items() if "worker" in e.classes and e.classes["worker"].stage_split)


def subscribing(channel: str) -> list[str]:
    """Registered strategies whose workers read ``channel`` (e.g. ``inbox``: a topic per worker)."""
    return sorted(n for n, e in _registered().items()
                  if "worker" in e.classes and channel in e.classes["worker"].subscribes)


def create(name: str, ctx: StrategyContext, **params: Any) -> SyncStrategy:
    """Build strategy ``name`` for ``ctx.role`` with keyword ``params`` from the job config."""
    entry = _entry(name)
    if ctx.role not in entry.classes:
        raise UnknownStrategyError(name, names(), role=ctx.role)
    return entry.factory(ctx, **params)
