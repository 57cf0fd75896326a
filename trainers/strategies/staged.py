"""One model split into stages on different workers: ``pipeline_bp``, ``dni`` and ``cdni``.

The fifth technique (synthetic gradients across cloud and edge, HotEdge 2019, after
Jaderberg et al.'s decoupled neural interfaces). The job's model is cut at the boundaries
``train.stages`` into K stages; worker ``members[k]`` holds stage ``k`` only (its trainer is
a ``trainers.stages.StageTrainer``). Stage 0 reads the device streams; every later stage is
fed by messages.

Messages (kind ``activation``, on the recipient's ``inbox``):

- forward, stage k -> k+1: ``{"h": [N, *shape_k], "y": [N]}`` (the labels travel with the
  activation, as floats holding class ids), ``meta = {"dir": "fwd", "inc": incarnation}``,
  ``step`` = the sender's sequence number for this incarnation;
- backward, stage k+1 -> k: ``{"g": [N, *shape_k]}`` = dL/dh_k for the forward message
  ``(inc, step)`` it answers, ``meta = {"dir": "bwd", "inc": inc}``.

Validation: the driver checks names, shapes (batch dim free) and finiteness against
:meth:`tensor_spec`; this module refuses (``MessageRejected``, dead-lettered by the
adapter) a forward whose labels are not class ids, whose batch dims disagree or exceed
``max_batch``, and a message without a direction. Nothing but the ``refused`` counter changes
before a refusal.

Modes (class attributes, never name checks):

- ``pipeline_bp`` (``decoupled = False``): the model-parallel baseline. Stage k forwards and
  waits: its update is the true gradient, back-propagated from the top stage's loss; one
  batch is in flight in the whole pipeline.
- ``dni`` / ``cdni`` (``decoupled = True``; ``cdni`` conditions on the label): stage k updates
  at once from ``M_k(h_k[, y])`` and sends the activation on; up to ``max_in_flight`` of its
  activations wait for their true gradient, which then trains ``M_k`` (MSE). The gradient a
  stage sends back is back-propagated through it from its own synthetic gradient (the
  bootstrapped target of DNI), or from the loss at the top stage.
- Trust gate (``trust_gate``, on by default; our addition): a stage's step along its
  synthetic gradient is scaled by its synthesiser's ``trust`` (1 - relative error of its
  recent predictions, ``trainers.synthesizer``) as a learning-rate scale (at least
  ``MIN_TRUST_STEP``); the gradient it sends back is not scaled. Without it, ``conv8``'s
  lower stages followed their early, poor synthetic gradients and lost their activations
  within a few steps (chance accuracy); the step guard then sees the synthetic gradient at
  its own scale, not shrunk by a trust near 0 (whose growth it would take for spikes).

Every computation is a local step (:meth:`local_step`): a stage-0 step on stream records
(``can_train``), or a *queued* step (:meth:`queued_steps`) on a received activation, or
(``pipeline_bp``) on a received gradient. Only ``dni``'s synthesiser updates run inside
:meth:`on_message` (small, no model change). Queued inputs and activations awaiting their
gradient are part of :meth:`state_dict`, so a checkpoint loses none of them.

Restarts: a restored stage takes a new incarnation (its new messages cannot be mistaken for
the old ones); an activation whose gradient has not come back after ``ack_timeout_s`` (time
handed in by :meth:`poll`) is given up, counted ``expired`` (``pipeline_bp``: its update is
lost, counted; ``dni``: its synthesiser target is).

Staleness: for every true gradient used, the stage's versions between its forward and that
gradient (``dni``: how far behind the synthesiser's target is; ``pipeline_bp``: 0).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from edgestream.trainers.errors import StrategyError
from edgestream.trainers.local import StepResult
from edgestream.trainers.messages import Outgoing, UpdateMessage
from edgestream.trainers.seen import StepSet
from edgestream.trainers.stages import StageForward, StageTrainer
from edgestream.trainers.strategies.base import (
    Observations,
    StrategyContext,
    SyncStrategy,
    register,
)
from edgestream.trainers.synthesizer import Synthesizer
from edgestream.trainers.validation import TensorSpec
from edgestream.trainers.wire import MessageRejected

__all__ = ["CDNIStrategy", "DNIStrategy", "PipelineBPStrategy", "StagedStrategy"]

Key = tuple[int, int]  # (incarnation, sequence number) of one forward message
#: The step scale of a stage whose synthesiser has no trust yet (apply_gradient needs > 0).
MIN_TRUST_STEP = 1e-6


@dataclass
class _Input:
    """A forward message waiting for this stage's step."""

    sender: str
    key: Key
    h: torch.Tensor
    y: torch.Tensor  # int64 class ids


@dataclass
class _Pending:
    """One of our activations waiting for its true gradient."""

    version: int  # our model version at its forward
    sent_at: float  # last poll time when it left
    h: torch.Tensor | None  # the activation (dni: the synthesiser's input)
    y: torch.Tensor
    #: pipeline_bp: the stage's input (stage 0: the features), to redo the forward after a restore.
    inputs: torch.Tensor | None = None
    #: pipeline_bp, stage > 0: the forward message this activation was computed from.
    source: tuple[str, Key] | None = None
    forward: StageForward | None = None  # the live autograd graph (not checkpointed)


@dataclass
class _Answer:
    """A true gradient for one of our activations, waiting for a step (pipeline_bp)."""

    key: Key
    g: torch.Tensor


class StagedStrategy(SyncStrategy):
    """Shared machinery of the stage-split strategies; see the module docstring."""

    role = "worker"
    subscribes = ("inbox",)
    evaluates_model = False  # a stage alone has no logits; see trainers.stages.compose
    stage_split: ClassVar[bool] = True
    decoupled: ClassVar[bool] = False
    conditioned: ClassVar[bool] = False

    def __init__(
        self,
        ctx: StrategyContext,
        *,
        max_in_flight: int = 4,
        synth_hidden: int = 0,
        synth_lr: float = 1e-3,
        ack_timeout_s: float = 60.0,
        max_batch: int = 4096,
        trust_gate: bool = True,
    ) -> None:
        super().__init__(ctx)
        trainer = ctx.trainer
        if not isinstance(trainer, StageTrainer):
            raise StrategyError(f"{self.name} needs a stage-split model: set train.stages (the boundaries)")
        members = list(ctx.members) or [ctx.worker_id]
        if ctx.worker_id not in members:
            raise StrategyError(f"{self.name}: worker {ctx.worker_id!r} is not one of the stages {members}")
        self.stage = members.index(ctx.worker_id)
        if len(members) != trainer.stages or self.stage != trainer.stage:
            raise StrategyError(
                f"{self.name}: {len(members)} workers for {trainer.stages} stages (worker {ctx.worker_id} is "
                f"stage {self.stage}, its model is stage {trainer.stage}); one worker per stage")
        if max_in_flight < 1 or not ack_timeout_s > 0 or max_batch < 1:
            raise StrategyError("max_in_flight and max_batch must be >= 1 and ack_timeout_s > 0")
        self.st: StageTrainer = trainer
        self.previous = members[self.stage - 1] if self.stage > 0 else None
        self.next = members[self.stage + 1] if self.stage + 1 < len(members) else None
        self.max_in_flight = max_in_flight if self.decoupled else 1
        self.ack_timeout_s = float(ack_timeout_s)
        self.max_batch = int(max_batch)
        self.trust_gate = bool(trust_gate)
        self.synth: Synthesizer | None = None
        if self.decoupled and self.next is not None:
            self.synth = Synthesizer(trainer.output_shape, trainer.num_classes, conditioned=self.conditioned,
                                     hidden=synth_hidden, lr=synth_lr, seed=1000 + self.stage)
        self._incarnation = 0
        self._sequence = 0
        self._now = 0.0
        self._inputs: collections.deque[_Input] = collections.deque()
        self._answers: collections.deque[_Answer] = collections.deque()
        self._pending: dict[Key, _Pending] = {}
        self._seen: dict[tuple[str, int], StepSet] = {}
        self._answered: dict[int, StepSet] = {}
        self._outgoing: list[Outgoing] = []
        self._deferred: list[tuple[str, Key]] = []  # inputs to give up at the next poll or step
        self._step_key: Key | None = None
        self._step_scale = 1.0  # the learning-rate scale of the step in progress (the trust gate)
        self._step_source: tuple[str, Key] | None = None  # the input of the step in progress
        self._samples = 0
        self._step_samples = 0  # samples of the step in progress, counted once it is applied
        self._restamp = False  # restored: waiting times restart at the next poll
        self._synth_loss: float | None = None

    # -- what may arrive ------------------------------------------------------------------------
    def tensor_spec(self, kind: str, spec: TensorSpec) -> TensorSpec:
        if kind != "activation":
            return spec
        shapes: dict[str, tuple[int | None, ...]] = {}
        if self.previous is not None:
            shapes["h"] = (None, *self.st.input_shape)
            shapes["y"] = (None,)
        if self.next is not None:
            shapes["g"] = (None, *self.st.output_shape)
        return TensorSpec(parameters=shapes)

    def accepts_partial(self, kind: str) -> bool:
        return kind == "activation"  # a forward carries h and y, a backward g

    # -- scheduling --------------------------------------------------------------------------------
    def can_train(self) -> bool:
        """Stage 0 steps on stream records while its window has room."""
        return self.stage == 0 and self._window_open()

    def queued_steps(self) -> int:
        if self._answers:
            return len(self._answers)
        return len(self._inputs) if self.stage > 0 and self._window_open() else 0

    def _window_open(self) -> bool:
        if self.next is None:
            return True
        if not self.decoupled and self._answers:
            return False
        return len(self._pending) < self.max_in_flight

    def poll(self, now: float) -> list[Outgoing]:
        self._now = float(now)
        if self._restamp:  # restored: the checkpoint's times are another process's clock
            for pending in self._pending.values():
                pending.sent_at = self._now
            self._restamp = False
        for key in [k for k, p in self._pending.items() if now - p.sent_at > self.ack_timeout_s]:
            pending = self._pending.pop(key)
            self.counters["expired"] += 1
            if pending.source is not None:  # pipeline_bp: nor will its input's gradient come
                self._deferred.append(pending.source)
        out, self._deferred = [self._drop(source) for source in self._deferred], []
        return out

    # -- the step -----------------------------------------------------------------------------------
    def local_step(self, trainer: Any, features: Any, labels: Any) -> StepResult:
        """A stage-0 step on records, else the next queued gradient (pipeline_bp) or activation."""
        self._outgoing, self._step_key, self._step_source = [], None, None
        self._step_scale, self._step_samples = 1.0, 0
        if features is not None:
            y = torch.as_tensor(np.asarray(labels), dtype=torch.int64)
            return self._forward_step(self.st.forward(features), y, source=None,
                                      inputs=torch.as_tensor(np.asarray(features, dtype=np.float32)))
        if self._answers:
            return self._backward_step(self._answers.popleft())
        if not self._inputs:
            raise StrategyError(f"{self.name}: a queued step with nothing queued")
        item = self._inputs.popleft()
        self._step_source = (item.sender, item.key)
        return self._forward_step(self.st.forward(item.h), item.y, source=(item.sender, item.key), inputs=item.h)

    def _forward_step(self, fwd: StageForward, y: torch.Tensor, *, source: tuple[str, Key] | None,
                      inputs: torch.Tensor) -> StepResult:
        self._step_samples = fwd.batch_size
        if self.next is None:  # the top stage: the loss, and the true gradient back
            result, grad_in = self.st.loss_backward(fwd, y)
            if source is not None and grad_in is not None:
                self._answer(source, grad_in, fwd.base_version)
            return result
        h = fwd.activation()
        key = (self._incarnation, self._sequence + 1)
        if self.decoupled:
            assert self.synth is not None
            result, grad_in = self.st.backward(fwd, self.synth.predict(h, y if self.conditioned else None))
            result = dataclasses.replace(result, synthetic=True)  # the guard's spike rule does not apply
            if self.trust_gate:  # follow the synthesiser only as far as it predicts well
                self._step_scale = max(self.synth.trust, MIN_TRUST_STEP)
            if source is not None and grad_in is not None:
                self._answer(source, grad_in, fwd.base_version)
            pending = _Pending(fwd.base_version, self._now, h, y)
        else:
            result = StepResult(gradients={}, loss=0.0, batch_size=fwd.batch_size, base_version=fwd.base_version)
            pending = _Pending(fwd.base_version, self._now, None, y, inputs=inputs.detach(), source=source,
                               forward=fwd)
        self._sequence += 1
        self._pending[key] = pending
        self._step_key = key
        self._outgoing.append(Outgoing("inbox", UpdateMessage(
            kind="activation", sender=self.worker_id, step=key[1], base_version=fwd.base_version,
            batch_size=fwd.batch_size, tensors={"h": h, "y": y.to(torch.float32)},
            meta={"dir": "fwd", "inc": key[0]}), to=self.next))
        return result

    def _backward_step(self, answer: _Answer) -> StepResult:
        """pipeline_bp: our activation's true gradient arrived; back-propagate it now."""
        pending = self._pending.pop(answer.key, None)
        if pending is None:  # given up meanwhile (expired)
            return StepResult(gradients={}, loss=0.0, batch_size=int(answer.g.shape[0]),
                              base_version=self.trainer.version)
        self._step_source = pending.source
        fwd = pending.forward
        if fwd is None:  # restored from a checkpoint: redo the forward (deterministic)
            assert pending.inputs is not None
            fwd = self.st.forward(pending.inputs.numpy() if self.stage == 0 else pending.inputs)
        result, grad_in = self.st.backward(fwd, answer.g)
        self.staleness.record(max(0, self.trainer.version - pending.version))
        if pending.source is not None and grad_in is not None:
            self._answer(pending.source, grad_in, self.trainer.version)
        return result

    def _answer(self, source: tuple[str, Key], grad: torch.Tensor, version: int) -> None:
        sender, (inc, step) = source
        self._outgoing.append(Outgoing("inbox", UpdateMessage(
            kind="activation", sender=self.worker_id, step=step, base_version=version,
            batch_size=int(grad.shape[0]), tensors={"g": grad.detach().to(torch.float32).contiguous()},
            meta={"dir": "bwd", "inc": inc}), to=sender))

    def local_step_rejected(self) -> None:
        """The guard refused the step: its messages are dropped, its activation is not awaited,
        and the stage that sent its input is told not to wait for that input's gradient."""
        self.counters["rejected_steps"] += 1
        self.local_step_discarded()

    def local_step_discarded(self) -> None:
        """Drop the step's messages and pending activation; tell the stage that sent its input
        not to wait for that input's gradient (a probe on stream records has no such input)."""
        self._outgoing = []
        if self._step_key is not None:
            self._pending.pop(self._step_key, None)
            self._step_key = None
        if self._step_source is not None:  # published at the next poll or step
            self._deferred.append(self._step_source)
            self._step_source = None

    def on_local_step(self, result: StepResult) -> list[Outgoing]:
        if result.gradients:
            self.trainer.apply_gradient(result.gradients, lr_scale=self._step_scale, buffer_deltas=result.buffer_deltas)
        self._samples += self._step_samples
        self._step_samples = 0
        out = [self._drop(source) for source in self._deferred] + self._outgoing
        self._outgoing, self._deferred = [], []
        return out

    # -- messages --------------------------------------------------------------------------------------
    def on_message(self, msg: UpdateMessage) -> list[Outgoing]:
        if msg.kind != "activation":
            self.counters["ignored_kind"] += 1
            return []
        direction = msg.meta.get("dir")
        inc = msg.meta.get("inc")
        if direction not in ("fwd", "bwd", "drop") or isinstance(inc, bool) or not isinstance(inc, int) or inc < 0:
            raise self._refuse(msg, "bad_meta", "an activation needs meta dir = fwd | bwd | drop and inc >= 0")
        if direction == "fwd":
            return self._on_forward(msg, inc)
        if direction == "drop":
            return self._on_drop(msg, inc)
        return self._on_backward(msg, inc)

    def _on_drop(self, msg: UpdateMessage, inc: int) -> list[Outgoing]:
        """The next stage refused its step on one of our activations: no gradient will come."""
        if msg.sender != self.next or msg.tensors:
            raise self._refuse(msg, "unexpected_tensor", f"only {self.next} may give up our activations")
        if not self._answered.setdefault(inc, StepSet()).add(msg.step):
            return []
        pending = self._pending.pop((inc, msg.step), None)
        if pending is None:
            return []
        self.counters["dropped_by_next"] += 1
        # pipeline_bp: the gradient of the input it came from will not come either.
        return [self._drop(pending.source)] if pending.source is not None else []

    def _drop(self, source: tuple[str, Key]) -> Outgoing:
        sender, (inc, step) = source
        return Outgoing("inbox", UpdateMessage(kind="activation", sender=self.worker_id, step=step,
                                               base_version=self.trainer.version, meta={"dir": "drop", "inc": inc}),
                        to=sender)

    def _on_forward(self, msg: UpdateMessage, inc: int) -> list[Outgoing]:
        if msg.sender != self.previous or set(msg.tensors) != {"h", "y"}:
            raise self._refuse(msg, "unexpected_tensor",
                               f"stage {self.stage} takes forward activations (h, y) from {self.previous} only")
        h, y = msg.tensors["h"], msg.tensors["y"]
        n = int(h.shape[0])
        if int(y.shape[0]) != n or n == 0 or n > self.max_batch:
            raise self._refuse(msg, "shape_mismatch", f"{n} activations, {int(y.shape[0])} labels "
                                                      f"(1..{self.max_batch} each)")
        if bool(((y != torch.round(y)) | (y < 0) | (y >= self.st.num_classes)).any()):
            raise self._refuse(msg, "out_of_range", f"labels must be class ids 0..{self.st.num_classes - 1}")
        if not self._seen.setdefault((msg.sender, inc), StepSet()).add(msg.step):
            self.counters["duplicate"] += 1
            return []
        self._inputs.append(_Input(msg.sender, (inc, msg.step), h.to(torch.float32), y.to(torch.int64)))
        return []

    def _on_backward(self, msg: UpdateMessage, inc: int) -> list[Outgoing]:
        if msg.sender != self.next or set(msg.tensors) != {"g"}:
            raise self._refuse(msg, "unexpected_tensor",
                               f"stage {self.stage} takes gradients (g) from {self.next} only")
        key = (inc, msg.step)
        pending = self._pending.get(key)
        g = msg.tensors["g"]
        if pending is not None and int(g.shape[0]) != int(pending.y.shape[0]):
            raise self._refuse(msg, "shape_mismatch", f"gradient for {int(g.shape[0])} samples, "
                                                      f"activation had {int(pending.y.shape[0])}")
        if not self._answered.setdefault(inc, StepSet()).add(msg.step) or pending is None:
            self.counters["unexpected_gradient"] += 1  # a duplicate, or given up (expired)
            return []
        if not self.decoupled:
            self._answers.append(_Answer(key, g.to(torch.float32)))
            return []
        del self._pending[key]
        assert self.synth is not None and pending.h is not None
        self._synth_loss = self.synth.update(pending.h, pending.y if self.conditioned else None, g)
        self.counters["synth_updates"] += 1
        self.staleness.record(max(0, self.trainer.version - pending.version))
        return []

    def _refuse(self, msg: UpdateMessage, reason: str, detail: str) -> MessageRejected:
        self.counters["refused"] += 1
        return MessageRejected(reason, detail, sender=msg.sender, step=msg.step)

    def on_restore(self) -> list[Outgoing]:
        """A new incarnation: what we send from now on cannot be confused with the old run's."""
        self._incarnation += 1
        self._sequence = 0
        self._restamp = True
        return []

    # -- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update({
            "incarnation": self._incarnation,
            "sequence": self._sequence,
            "now": self._now,
            "samples": self._samples,
            "synth_loss": -1.0 if self._synth_loss is None else self._synth_loss,
            "synth": self.synth.state_dict() if self.synth is not None else {},
            "inputs": [{"sender": i.sender, "key": list(i.key), "h": i.h, "y": i.y} for i in self._inputs],
            "answers": [{"key": list(a.key), "g": a.g} for a in self._answers],
            "deferred": [{"sender": sender, "key": list(key)} for sender, key in self._deferred],
            "pending": [
                {"key": list(k), "version": p.version, "sent_at": p.sent_at, "y": p.y,
                 **({"h": p.h} if p.h is not None else {}),
                 **({"inputs": p.inputs} if p.inputs is not None else {}),
                 **({"source_sender": p.source[0], "source_key": list(p.source[1])} if p.source else {})}
                for k, p in self._pending.items()
            ],
            "seen": [{"sender": s, "inc": i, "floor": v.floor, "above": sorted(v.above)}
                     for (s, i), v in self._seen.items()],
            "answered": [{"inc": i, "floor": v.floor, "above": sorted(v.above)} for i, v in self._answered.items()],
        })
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._incarnation = int(state["incarnation"])
        self._sequence = int(state["sequence"])
        self._now = float(state["now"])
        self._samples = int(state["samples"])
        loss = float(state["synth_loss"])
        self._synth_loss = None if loss < 0 else loss
        if self.synth is not None:
            self.synth.load_state_dict(state["synth"])
        self._inputs = collections.deque(
            _Input(str(i["sender"]), _key(i["key"]), i["h"], i["y"]) for i in state["inputs"])
        self._answers = collections.deque(_Answer(_key(a["key"]), a["g"]) for a in state["answers"])
        self._deferred = [(str(d["sender"]), _key(d["key"])) for d in state["deferred"]]
        self._pending = {
            _key(p["key"]): _Pending(int(p["version"]), float(p["sent_at"]), p.get("h"), p["y"],
                                     inputs=p.get("inputs"),
                                     source=(str(p["source_sender"]), _key(p["source_key"]))
                                     if "source_sender" in p else None)
            for p in state["pending"]
        }
        self._seen = {(str(s["sender"]), int(s["inc"])): StepSet(int(s["floor"]), [int(x) for x in s["above"]])
                      for s in state["seen"]}
        self._answered = {int(a["inc"]): StepSet(int(a["floor"]), [int(x) for x in a["above"]])
                          for a in state["answered"]}

    # -- observability ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats.update({"stage": self.stage, "incarnation": self._incarnation, "samples": self._samples,
                      "in_flight": len(self._pending),
                      "queued": len(self._inputs) + len(self._answers), "synth_loss": self._synth_loss,
                      "synth_trust": self.synth.trust if self.synth is not None else None})
        return stats

    def observations(self) -> Observations:
        return Observations(
            stage=self.stage, stage_samples=self._samples,
            synthesizer_loss=self._synth_loss if self._synth_loss is not None and math.isfinite(self._synth_loss)
            else None,
            boundary_in_flight=len(self._pending) if self.next is not None else None,
            queued_inputs=len(self._inputs) + len(self._answers),
        )


def _key(value: Any) -> Key:
    return int(value[0]), int(value[1])


@register("pipeline_bp")
class PipelineBPStrategy(StagedStrategy):
    """Stage-split model trained with true gradients only (the model-parallel baseline)."""

    name = "pipeline_bp"


@register("dni")
class DNIStrategy(StagedStrategy):
    """Stage-split model, each stage updated at once from a synthetic gradient ``M_k(h_k)``."""

    name = "dni"
    decoupled = True


@register("cdni")
class CDNIStrategy(StagedStrategy):
    """Like ``dni`` with label-conditioned synthesisers ``M_k(h_k, y)``."""

    name = "cdni"
    decoupled = True
    conditioned = True
