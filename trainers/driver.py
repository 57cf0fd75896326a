"""The training driver: every step a worker (or the server) takes with its model, once.

One Kafka-free, clock-free, synchronous object per process. The adapters (the live
runtime in ``pipeline/training.py``, the simulated clock in ``trainers/simclock.py``,
the unit tests' bus) only move bytes and time; what happens to a model is here, in
the order a worker does it:

1. ``handle(value, to, transit_s)``: an update message from a subscribed channel: drop
   it if it is addressed to someone else; decode and validate it (the strategy says what
   a kind may carry: ``tensor_spec``, ``accepts_partial``; gradients above the norm bound
   are refused) -> ``strategy.on_arrival`` (if the adapter measured the transit) ->
   ``strategy.on_message`` -> encode what it answers.
2. ``poll(now)``: the strategy's timers.
3. ``can_train()`` and ``batch_limit()``: may the next local step run, on how many
   records (``strategy.batch_size_wanted`` or the job's ``max_step_batch``).
4. ``step(features, labels)``: score the batch with the model before training on it
   (prequential evaluation) -> the local step (``strategy.local_step``) -> the step
   guard -> the compression signal if the strategy wants it -> ``on_local_step`` ->
   encode every outgoing message on its own link's codec. A rejected step publishes
   nothing; the adapter dead-letters its records. An accepted one: the adapter
   publishes, then acknowledges the records behind it.
   When the adapter says which group (device) each record came from (``groups``), a
   refused step is not the end: the culprit search (``trainers.guard.CulpritSearch``)
   judges sub-steps (``strategy.probe_step``, nothing applied) to find the records that
   make it unsound, and the step is taken again on the others alone; ``Stepped.dead``
   names the records to dead-letter, each group with its own reason. A stream without a
   declared range (``observed_margin`` set) first has its records checked against the
   per-feature bounds learned from what it trained so far (``trainers.observed``): those
   outside are dead (``outside_observed_range``) before any step sees them.
   ``queued_steps()`` / ``step_queued()``: the same on an input the strategy received in a
   message instead of stream records (a later stage of a split model); the adapter runs
   them before stream steps. A refused step of either kind calls
   ``strategy.local_step_rejected``.
5. ``evaluate(features, labels)``: held-out evaluation, for reporting only;
   ``validate(features, labels)``: the validation split's score, handed to the strategy.

Checkpoints (``trainers.checkpoint.CheckpointStore``) hold the trainer and strategy;
the adapter decides when (every ``train.checkpoint_every_steps`` accepted steps).

Invariant: the trainer and the strategy are touched only through this object, one
call at a time; no call reads a clock, sleeps, or does I/O.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgestream.compression import registry as compressors
from edgestream.compression.controllers.policy import create_policy
from edgestream.compression.controllers.scadles import link_signal
from edgestream.compression.memory import ErrorFeedback, NoMemory
from edgestream.compression.pipeline import GradientCodec
from edgestream.trainers.errors import BatchError, StrategyError
from edgestream.trainers.evaluation import EvalResult, evaluate, predict, predict_proba
from edgestream.trainers.guard import Culprits, CulpritSearch, StepGuard, StepRejection
from edgestream.trainers.local import LocalTrainer
from edgestream.trainers.messages import Outgoing, UpdateMessage
from edgestream.trainers.observed import REASON as OUTSIDE_OBSERVED_RANGE
from edgestream.trainers.observed import ObservedRange
from edgestream.trainers.strategies.base import SyncStrategy
from edgestream.trainers.validation import TensorSpec
from edgestream.trainers.wire import HEADER_CODEC, MessageRejected, decode_update, encode_update

#: Kinds whose tensors may go through a link's codec. Gradients and deltas are
#: compressed unless the strategy marks one ``meta["compress"] = False``; model
#: snapshots only when it marks them ``meta["compress"] = True`` (a replica's snapshot
#: must usually be exact).
COMPRESSIBLE_KINDS = frozenset({"gradient", "delta", "model"})
#: Kinds a strategy may mark ``meta["sparse"] = True``: already sparse tensors (the
#: strategy chose the entries and keeps its own residuals, e.g. DLion), sent with the
#: lossless ``nonzero`` codec whatever ``train.codec`` is, on no link's codec.
SPARSE_KINDS = frozenset({"gradient", "delta"})
SPARSE_CODEC = "nonzero"


@dataclass(frozen=True)
class DriverConfig:
    """What the driver needs of the job: names, limits, the codec, the guard's bounds."""

    job: str
    max_message_bytes: int = 16 * 1024 * 1024
    max_step_batch: int = 256
    codec: str = "dense"
    codec_params: dict[str, Any] = field(default_factory=dict)
    error_feedback: bool = True
    max_grad_norm: float = 1.0e4
    grad_norm_spike: float = 100.0
    #: Model snapshots holding a value above this are refused on receipt (0: no bound).
    max_abs_weight: float = 1.0e6
    #: Per-link compression policy (``compression.controllers.policy``): none | accordion | budget.
    controller: str = "none"
    controller_params: dict[str, Any] = field(default_factory=dict)
    #: Prequential accuracy/loss over the last this many scored batches (beside the totals).
    prequential_window: int = 50
    #: Most sub-steps the culprit search of one refused step judges (0: no search; the
    #: whole batch is dead-lettered).
    culprit_max_probes: int = 128
    #: Learned per-feature bounds (``trainers.observed.ObservedRange``) for a stream that
    #: declares no range: their margin (None: not used), and the records seen before they apply.
    observed_margin: float | None = None
    observed_warmup: int = 512


@dataclass(frozen=True)
class Outbound:
    """One encoded message for an adapter to put on ``channel`` (to ``to``, or everyone)."""

    channel: str
    to: str | None
    kind: str
    value: bytes
    headers: dict[str, bytes]
    codec: str
    dense_bytes: int  # fp32 bytes of the tensors, before any compression
    #: The density or rank the link's compression policy chose for it (None: the codec's own).
    setting: float | None = None

    @property
    def compressed(self) -> bool:
        return self.codec != "dense"


@dataclass(frozen=True)
class Handled:
    """What ``handle`` did with one update message.

    ``skipped``: addressed to another process; ``rejection``: refused before the
    strategy saw it (dead-letter it); otherwise the strategy took it and ``staleness``
    holds the staleness of every update the strategy applied since the driver last
    asked (one BSP message can complete a step and apply every member's gradient).
    """

    outbound: list[Outbound] = field(default_factory=list)
    skipped: bool = False
    rejection: MessageRejected | None = None
    message: UpdateMessage | None = None
    staleness: tuple[int, ...] = ()
    vote_switched_to: bool | None = None


@dataclass(frozen=True)
class Stepped:
    """What ``step`` did with one batch: ``rejection`` set means nothing was applied or
    published and the batch's records must be dead-lettered with its reason.

    After a culprit search, ``dead`` lists the records to dead-letter (positions in the
    batch, each group with its own reason; with ``rejection`` set they cover the whole
    batch) and ``trained`` the positions the accepted step trained on (None: all)."""

    rejection: StepRejection | None
    outbound: list[Outbound]
    records: int
    loss: float = math.nan
    #: Per trained streamed record (``trained``, in order), whether the model before this
    #: step predicted it (the prequential score); None if the step was rejected or could not tell.
    correct_mask: np.ndarray | None = None
    #: Samples the injector added to the batch (trained on, not scored).
    injected: int = 0
    vote_switched_to: bool | None = None
    #: Samples the step trained on (a queued step trains on a received activation: 0 records).
    samples: int = 0
    #: Staleness of the updates the strategy applied during the step (queued steps).
    staleness: tuple[int, ...] = ()
    #: Records to dead-letter, found by the culprit search (empty: none, or all of them
    #: for ``rejection`` when there was no search).
    dead: tuple[Culprits, ...] = ()
    #: Positions of the streamed records the step trained on (None: all of them).
    trained: np.ndarray | None = None
    #: Sub-steps the culprit search judged.
    probes: int = 0
    #: Why the step on the whole batch was refused (None: it was not; records may still be
    #: dead, refused before the step: outside the observed range).
    refused: StepRejection | None = None

    @property
    def trained_records(self) -> int:
        if self.rejection is not None:
            return 0
        return self.records if self.trained is None else int(len(self.trained))


@dataclass
class Prequential:
    """Test-then-train scores: every batch is scored by the current model before it is
    trained on. Totals since start and a sliding window of the last ``window`` batches."""

    window: int = 50
    records: int = 0
    correct: int = 0
    loss_sum: float = 0.0
    _recent: collections.deque = field(default_factory=collections.deque)

    def add(self, records: int, correct: int, loss: float) -> None:
        self.records += records
        self.correct += correct
        self.loss_sum += loss * records
        self._recent.append((records, correct, loss * records))
        while len(self._recent) > self.window:
            self._recent.popleft()

    @property
    def accuracy(self) -> float:
        return self.correct / self.records if self.records else 0.0

    @property
    def loss(self) -> float:
        return self.loss_sum / self.records if self.records else 0.0

    @property
    def window_accuracy(self) -> float:
        n = sum(r for r, _, _ in self._recent)
        return sum(c for _, c, _ in self._recent) / n if n else 0.0

    @property
    def window_loss(self) -> float:
        n = sum(r for r, _, _ in self._recent)
        return sum(s for _, _, s in self._recent) / n if n else 0.0


class DecodeMemo:
    """Decoded update records shared by the drivers of one process that read the same log
    with equal specs (same model, same strategy): the simulated clock's workers. A record
    decoded (and validated) by one is reused by the others; rejected records are not kept.
    Bounded to the ``size`` most recent records."""

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self._entries: collections.OrderedDict[bytes, UpdateMessage] = collections.OrderedDict()

    def get(self, value: bytes) -> UpdateMessage | None:
        return self._entries.get(value)

    def put(self, value: bytes, msg: UpdateMessage) -> UpdateMessage:
        self._entries[value] = msg
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return msg


class TrainingDriver:
    """The model-side life of one process: messages in, steps, messages out.

    ``injector`` (optional) is ``(features, labels) -> (features, labels, injected)``
    applied to a batch before the step (ScaDLES data injection); its samples are
    trained on but not scored. ``shared_decodes``: see ``DecodeMemo``.
    """

    def __init__(
        self,
        name: str,
        trainer: LocalTrainer,
        strategy: SyncStrategy,
        config: DriverConfig,
        *,
        spec: TensorSpec | None = None,
        injector: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, int]] | None = None,
        shared_decodes: DecodeMemo | None = None,
    ) -> None:
        self.name = name
        self.trainer = trainer
        self.strategy = strategy
        self.config = config
        self.spec = spec if spec is not None else TensorSpec.from_trainer(trainer)
        self.injector = injector
        self.shared_decodes = shared_decodes
        self.guard = StepGuard(config.max_grad_norm, config.grad_norm_spike)
        self.culprit_search = CulpritSearch(config.culprit_max_probes)
        self.observed = (ObservedRange(config.observed_margin, config.observed_warmup)
                         if config.observed_margin is not None else None)
        self.outside_records = 0
        self.searches = 0
        self.probes = 0
        self.culprit_records = 0
        self.unresolved_records = 0
        self.prequential = Prequential(config.prequential_window)
        # Build one codec now: a bad codec name or parameter fails at start, not at the
        # first step.
        self._codecs: dict[tuple[str | None, str], GradientCodec] = {}
        self._sparse: GradientCodec | None = None
        self.policy = create_policy(config.controller, self._new_codec().compressor, **config.controller_params)
        self._decision = strategy.compression_decision()
        if strategy.compression_signal_ratio() is not None and config.codec == "dense":
            raise StrategyError(
                f"{strategy.name} computes a compression signal (adaptive compression) and needs a "
                "compressing train.codec (e.g. train.codec=topk, train.codec_params=[\"ratio=0.1\"])"
            )
        #: (model version, decision) at every switch of the replicated compression decision.
        self.vote_log: collections.deque[tuple[int, bool]] = collections.deque(maxlen=1000)
        self.injected_records = 0
        self.accepted_steps = 0
        self.compressed_steps = 0

    # -- 1. messages in ----------------------------------------------------------------
    def handle(self, value: bytes, to: str | None = None, transit_s: float | None = None) -> Handled:
        """One record of a subscribed channel (``to``: the recipient named in its headers).

        ``transit_s``: seconds from when the record was produced to now (the adapter's
        measure; None: unknown). A positive finite one is handed to
        ``strategy.on_arrival(sender, len(value), transit_s)`` once the message is
        accepted, before ``on_message``."""
        if to is not None and to != self.name:
            return Handled(skipped=True)
        try:
            msg = self._decode(value)
        except MessageRejected as exc:
            return Handled(rejection=exc)
        if transit_s is not None and math.isfinite(transit_s) and transit_s > 0:
            self.strategy.on_arrival(msg.sender, len(value), float(transit_s))
        try:
            out = self.strategy.on_message(msg)
        except MessageRejected as exc:  # the strategy's own checks (it changed nothing)
            return Handled(rejection=exc)
        return Handled(self.encode(out), message=msg, staleness=tuple(self.strategy.staleness.take_new()),
                       vote_switched_to=self._decision_switch())

    def _decode(self, value: bytes) -> UpdateMessage:
        """Decode and validate; the kind's spec and partial rule come from the strategy."""
        memo = self.shared_decodes
        if memo is not None:
            msg = memo.get(value)
            if msg is None:
                msg = memo.put(value, self._decode_uncached(value))
            return msg
        return self._decode_uncached(value)

    def _decode_uncached(self, value: bytes) -> UpdateMessage:
        return decode_update(
            value, expected_shapes=lambda kind: self.strategy.tensor_spec(kind, self.spec),
            max_bytes=self.config.max_message_bytes, job=self.config.job,
            max_norm=self.config.max_grad_norm or None, partial=self.strategy.accepts_partial,
            max_abs=self.config.max_abs_weight or None,
        )

    # -- 2. timers --------------------------------------------------------------------------
    def poll(self, now: float) -> list[Outbound]:
        return self.encode(self.strategy.poll(now))

    def leave(self) -> list[Outbound]:
        """The process stops on purpose: what the strategy sends before its final
        checkpoint (``on_leave``)."""
        return self.encode(self.strategy.on_leave())

    def restored(self) -> list[Outbound]:
        """The process restarted from a checkpoint (after ``load_state_dict``): what the
        strategy sends on that (``on_restore``)."""
        return self.encode(self.strategy.on_restore())

    def membership(self, workers: list[str]) -> list[Outbound]:
        """The adapter's view of the live workers changed."""
        return self.encode(self.strategy.on_membership(workers))

    # -- 3. may we train, on how much ----------------------------------------------------------
    def can_train(self) -> bool:
        return self.strategy.role == "worker" and self.strategy.can_train()

    def queued_steps(self) -> int:
        """Steps the strategy can take now on inputs that came in messages (a later stage of
        a split model): the adapter runs them with :meth:`step_queued`, before stream steps."""
        return self.strategy.queued_steps() if self.strategy.role == "worker" else 0

    def next_step(self) -> str | None:
        """What the next local step may be: ``"queued"`` (``queued_steps() > 0``, run first),
        ``"stream"`` (``can_train()``: a step on stream records, if there are any) or None."""
        if self.queued_steps():
            return "queued"
        return "stream" if self.can_train() else None

    def batch_limit(self) -> int:
        """Most records the next local step takes."""
        wanted = self.strategy.batch_size_wanted()
        return max(1, int(wanted)) if wanted is not None else self.config.max_step_batch

    # -- 4. the local step ----------------------------------------------------------------------
    def step(self, features: np.ndarray, labels: np.ndarray | None, groups: np.ndarray | None = None) -> Stepped:
        """Train on one batch (the records of one or several device batches).

        ``groups`` (optional): one key per record, the device it came from. With it, a
        refused step goes through the culprit search: only the records that make it
        unsound are dead-lettered (``Stepped.dead``), the step is taken on the rest."""
        records = int(len(features))
        if labels is None:
            return self._rejected(StepRejection("bad_batch", "records carry no labels"), records)
        x = np.ascontiguousarray(features, dtype=np.float32)
        y = np.asarray(labels, dtype=np.int64)
        keys = None if groups is None else np.asarray(groups)
        outside = self.observed.outside(x) if self.observed is not None else None
        if outside is None or not outside.any():
            stepped = self._step_searched(x, y, keys)
        else:
            stepped = self._step_inside(x, y, keys, outside)
        if self.observed is not None and stepped.rejection is None:
            self.observed.observe(x if stepped.trained is None else x[stepped.trained])
        return stepped

    def _step_searched(self, x: np.ndarray, y: np.ndarray, groups: np.ndarray | None) -> Stepped:
        """The step, and the culprit search if it is refused (and ``groups`` are known)."""
        records = int(len(x))
        stepped, rejection = self._try_step(x, y)
        if rejection is None:
            return stepped
        if groups is None or not self.culprit_search.max_probes or records < 2:
            return self._rejected(rejection, records)
        return self._search(x, y, groups, rejection)

    def _step_inside(self, x: np.ndarray, y: np.ndarray, groups: np.ndarray | None,
                     outside: np.ndarray) -> Stepped:
        """The records outside the observed range are dead before the step; the step (and
        its search) runs on the others; positions are mapped back to the whole batch."""
        assert self.observed is not None
        records = int(len(x))
        refused = Culprits(np.flatnonzero(outside),
                           StepRejection(OUTSIDE_OBSERVED_RANGE, self.observed.describe(x[outside])))
        self.outside_records += len(refused.indices)
        keep = np.flatnonzero(~outside)
        if not len(keep):
            return Stepped(refused.rejection, [], records, dead=(refused,))
        inner = self._step_searched(x[keep], y[keep], None if groups is None else groups[keep])
        dead = [refused, *(Culprits(keep[c.indices], c.rejection, c.resolved) for c in inner.dead)]
        if inner.rejection is not None and not inner.dead:  # refused whole, without a search
            dead.append(Culprits(keep, inner.rejection, resolved=False))
        dead.sort(key=lambda c: int(c.indices[0]))
        if inner.rejection is not None:
            return dataclasses.replace(inner, records=records, dead=tuple(dead), trained=None)
        trained = keep if inner.trained is None else keep[inner.trained]
        return dataclasses.replace(inner, records=records, dead=tuple(dead), trained=trained)

    def _try_step(self, x: np.ndarray, y: np.ndarray,
                  trained: np.ndarray | None = None) -> tuple[Stepped, StepRejection | None]:
        """One local step on streamed records ``x, y`` through the guard; on a refusal,
        nothing is applied and the strategy is told (``local_step_rejected``)."""
        records = int(len(x))
        injected = 0
        if self.injector is not None:
            x, y, injected = self.injector(x, y)
        try:
            result = self.strategy.local_step(self.trainer, x, y)
        except BatchError as exc:
            self.strategy.local_step_rejected()
            rejection = self.guard.reject_batch(exc)
            return self._rejected(rejection, records), rejection
        rejection = self.guard.check(result)
        if rejection is not None:
            self.strategy.local_step_rejected()
            return self._rejected(rejection, records), rejection
        mask = None if result.correct is None else np.asarray(result.correct[:records], dtype=bool)
        if mask is not None:
            self.prequential.add(records, int(mask.sum()), result.loss)
        self.injected_records += injected
        ratio = self.strategy.compression_signal_ratio()
        if ratio is not None:
            # Before on_local_step (so this gradient's vote includes it) and before encoding
            # (the broadcast link's residuals are still those this gradient will meet).
            self.strategy.observe_signal(link_signal(self._codec(None, "gradient").memory, result.gradients, ratio))
        outgoing = self.strategy.on_local_step(result)
        encoded = self.encode(outgoing)
        self.accepted_steps += 1
        if any(o.compressed and o.kind in ("gradient", "delta") for o in encoded):
            self.compressed_steps += 1
        return Stepped(None, encoded, records, result.loss, mask, injected, self._decision_switch(),
                       samples=result.batch_size, staleness=tuple(self.strategy.staleness.take_new()),
                       trained=trained), None

    def _search(self, x: np.ndarray, y: np.ndarray, groups: np.ndarray, rejection: StepRejection) -> Stepped:
        """The culprit search of a refused step, then the step on the records it cleared.

        Probes are judged against the model the refused step saw (nothing was applied), so
        the step on the clean records scores and trains them exactly as if the culprits had
        never been in the batch. Only this worker's own step is involved: replicas of a
        replicated strategy (BSP) see one ordinary gradient of fewer samples."""
        records = int(len(x))

        def probe(indices: np.ndarray) -> StepRejection | None:
            try:
                result = self.strategy.probe_step(self.trainer, x[indices], y[indices])
            except BatchError as exc:
                return StepRejection(getattr(exc, "reason", "bad_batch"), str(exc))
            return self.guard.judge(result)

        outcome = self.culprit_search.run(groups, rejection, probe)
        self.searches += 1
        self.probes += outcome.probes
        dead = list(outcome.culprits)
        stepped: Stepped | None = None
        if len(outcome.clean):
            stepped, final = self._try_step(x[outcome.clean], y[outcome.clean], trained=outcome.clean)
            if final is not None:  # the clean records together still fail: nothing is trained
                dead.append(Culprits(outcome.clean, final, resolved=False))
                stepped = None
        dead.sort(key=lambda c: int(c.indices[0]))
        self.culprit_records += sum(len(c.indices) for c in dead if c.resolved)
        self.unresolved_records += sum(len(c.indices) for c in dead if not c.resolved)
        if stepped is None:
            return Stepped(rejection, [], records, dead=tuple(dead), probes=outcome.probes, refused=rejection)
        return dataclasses.replace(stepped, records=records, dead=tuple(dead), probes=outcome.probes,
                                   refused=rejection)

    def step_queued(self) -> Stepped:
        """One step on the strategy's next queued input (``queued_steps() > 0``): no stream
        records; the guard, the prequential score (if the step can tell) and the encoding as
        in :meth:`step`. A rejected one publishes nothing (its input is dropped, counted)."""
        try:
            result = self.strategy.local_step(self.trainer, None, None)
        except BatchError as exc:
            self.strategy.local_step_rejected()
            return self._rejected(self.guard.reject_batch(exc), 0)
        rejection = self.guard.check(result)
        if rejection is not None:
            self.strategy.local_step_rejected()
            return self._rejected(rejection, 0)
        mask = None if result.correct is None else np.asarray(result.correct, dtype=bool)
        if mask is not None:
            self.prequential.add(len(mask), int(mask.sum()), result.loss)
        encoded = self.encode(self.strategy.on_local_step(result))
        self.accepted_steps += 1
        return Stepped(None, encoded, 0, result.loss, mask, samples=result.batch_size,
                       staleness=tuple(self.strategy.staleness.take_new()))

    def _rejected(self, rejection: StepRejection, records: int) -> Stepped:
        return Stepped(rejection, [], records, refused=rejection)

    # -- 5. evaluation --------------------------------------------------------------------------
    def evaluate(self, features: np.ndarray, labels: np.ndarray) -> EvalResult:
        """Accuracy and loss of the model on the held-out test split, for reporting only:
        nothing of it reaches the strategy (decisions are scored by :meth:`validate`)."""
        return evaluate(self.trainer.model, features, labels)

    def predict(self, features: np.ndarray) -> np.ndarray:
        """The classes the model predicts for ``features`` now (readings waiting for a
        label are scored by it when the label comes); nothing reaches the strategy."""
        return predict(self.trainer.model, features)

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        """The class probabilities the model gives ``features`` now (float32 ``[N, C]``): what a
        worker publishes for the records of a batch just before it trains on them
        (``serve.predictions``); nothing reaches the strategy."""
        return predict_proba(self.trainer.model, features)

    def validate(self, features: np.ndarray, labels: np.ndarray) -> tuple[EvalResult, list[Outbound]]:
        """Accuracy and loss of the model on the validation split, handed to the strategy
        (``on_evaluation``) with what it sends in answer. Only for a strategy with
        ``uses_validation``; never given the held-out test split."""
        result = evaluate(self.trainer.model, features, labels)
        return result, self.encode(self.strategy.on_evaluation(result.accuracy, result.loss))

    def transferred(self, item: Outbound, seconds: float) -> None:
        """Transfer feedback for one sent message (adapters that can measure it): to the
        link's compression policy and to the strategy."""
        self.policy.observe_sent((item.to, item.kind), len(item.value), seconds)
        self.strategy.on_transfer(item.to, len(item.value), seconds)

    # -- encoding, one codec per link -----------------------------------------------------------
    def encode(self, outgoing: list[Outgoing]) -> list[Outbound]:
        """Encode each message on the codec of its own link: ``(recipient, kind)``.

        A gradient or delta marked ``meta["sparse"] = True`` goes on the driver's one
        lossless ``nonzero`` codec instead (no memory; no link's codec or residual is
        touched; ``meta["compress"]`` is ignored for it)."""
        out = []
        for item in outgoing:
            msg = item.message
            flag = msg.meta.get("compress")
            codec = None
            if msg.kind in SPARSE_KINDS and msg.meta.get("sparse") is True:
                value, headers = encode_update(msg, job=self.config.job, codec=self._sparse_codec(), to=item.to)
                dense = 4 * sum(int(t.numel()) for t in msg.tensors.values())
                out.append(Outbound(item.channel, item.to, msg.kind, value, headers,
                                    headers.get(HEADER_CODEC, b"dense").decode(), dense))
                continue
            if msg.kind in COMPRESSIBLE_KINDS and self.config.codec != "dense" and (msg.kind != "model" or flag is True):
                # A gradient marked compress=False still goes through its link's codec, dense:
                # the link's residual is kept for the next compressed one.
                codec = self._codec(item.to, msg.kind)
            compress = flag is not False
            contexts = None
            if codec is not None and compress:
                contexts = self.policy.contexts((item.to, msg.kind), msg.tensors)
            value, headers = encode_update(msg, job=self.config.job, codec=codec, compress=compress, to=item.to,
                                           contexts=contexts)
            if msg.kind == "model" and item.to is not None and (codec is None or not compress):
                # The recipient now holds our exact model: what the other links to it still
                # owed it (error-feedback residuals) is void.
                for (to, kind), link in self._codecs.items():
                    if to == item.to and kind != "model":
                        link.memory.reset()
            dense = 4 * sum(int(t.numel()) for t in msg.tensors.values())
            out.append(Outbound(item.channel, item.to, msg.kind, value, headers,
                                headers.get(HEADER_CODEC, b"dense").decode(), dense,
                                self.policy.setting() if contexts is not None else None))
        return out

    def _codec(self, to: str | None, kind: str) -> GradientCodec:
        key = (to, kind)
        codec = self._codecs.get(key)
        if codec is None:
            codec = self._codecs[key] = self._new_codec()
        return codec

    def _sparse_codec(self) -> GradientCodec:
        """The lossless codec of messages marked ``meta["sparse"]`` (one per driver)."""
        if self._sparse is None:
            self._sparse = GradientCodec(compressors.create(SPARSE_CODEC), NoMemory(),
                                         max_bytes=self.config.max_message_bytes)
        return self._sparse

    def _new_codec(self) -> GradientCodec:
        compressor = compressors.create(self.config.codec, **self.config.codec_params)
        memory = ErrorFeedback() if self.config.error_feedback and self.config.codec != "dense" else NoMemory()
        return GradientCodec(compressor, memory, max_bytes=self.config.max_message_bytes)

    def _decision_switch(self) -> bool | None:
        decision = self.strategy.compression_decision()
        if decision is None or decision == self._decision:
            return None
        self._decision = decision
        self.vote_log.append((self.trainer.version, decision))
        return decision

    # -- observability ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        stats = self.strategy.stats()
        stats["prequential"] = {
            "records": self.prequential.records, "accuracy": self.prequential.accuracy,
            "loss": self.prequential.loss, "window_accuracy": self.prequential.window_accuracy,
            "window_loss": self.prequential.window_loss,
        }
        stats["guard"] = {"accepted": self.guard.accepted, "rejected": self.guard.rejected,
                          "culprit_searches": self.searches, "culprit_probes": self.probes,
                          "culprit_records": self.culprit_records, "unresolved_records": self.unresolved_records,
                          "outside_observed_range": self.outside_records}
        return stats
