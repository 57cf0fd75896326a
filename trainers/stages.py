"""Model splitting for pipelined (synthetic-gradient) training: stages and their trainer.

A stageable model is an ``nn.Sequential`` whose top-level children are named blocks
(``conv8``: block1..block3, fc1, fc2; ``mlp``: "0", "1", ...). Cutting after a child
name gives stages that share the model's modules, keep the model's parameter names
and, chained, compute exactly what the model computes. No I/O, no clocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from edgestream.trainers.errors import BatchError, ModelConfigError, StrategyError
from edgestream.trainers.local import LocalTrainer, StepResult
from edgestream.trainers.models import InputStandardizer, build_model


def boundary_names(model: nn.Module) -> list[str]:
    """Names of the top-level children the model can be cut after (all but the last)."""
    if not isinstance(model, nn.Sequential):
        raise ModelConfigError(
            f"only an nn.Sequential of named blocks can be split, got {type(model).__name__}"
        )
    return [name for name, _ in model.named_children()][:-1]


def split_model(model: nn.Module, boundaries: Sequence[str]) -> list[nn.Sequential]:
    """Cut ``model`` after each of ``boundaries`` (in model order) into ``len(boundaries) + 1`` stages
    (no boundaries: one stage, the whole model, which is then its own top).

    Stage k holds the children after ``boundaries[k-1]`` up to and including
    ``boundaries[k]``. The modules are shared with ``model`` (same Parameter objects) and
    keep their names, so a stage's ``named_parameters()`` is the model's restricted to it.
    Stage 0 runs the model's :class:`InputStandardizer` if :func:`build_model` installed one.
    """
    valid = boundary_names(model)
    cuts = list(boundaries)
    position = {name: i for i, name in enumerate(valid)}
    for name in cuts:
        if name not in position:
            raise ModelConfigError(
                f"unknown boundary {name!r}; valid boundaries: {', '.join(valid)}"
            )
    indices = [position[name] for name in cuts]
    if any(b <= a for a, b in zip(indices, indices[1:], strict=False)):
        raise ModelConfigError(
            f"boundaries {cuts} must be distinct and in model order; valid boundaries: {', '.join(valid)}"
        )
    children = list(model.named_children())
    starts = [0] + [i + 1 for i in indices]
    ends = [i + 1 for i in indices] + [len(children)]
    stages = [nn.Sequential(OrderedDict(children[a:b])) for a, b in zip(starts, ends, strict=True)]
    standardizer = getattr(model, "input_standardizer", None)
    if isinstance(standardizer, InputStandardizer):
        _install_standardizer(stages[0], standardizer)
    for stage in stages:
        stage.train(model.training)
    return stages


def build_stage(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    seed: int,
    boundaries: Sequence[str],
    stage: int,
    *,
    standardize: tuple[Any, Any] | None = None,
    **options: Any,
) -> nn.Sequential:
    """Stage ``stage`` of model ``name`` cut at ``boundaries``: the same weights as the full model's slice."""
    model = build_model(name, input_shape, num_classes, seed, standardize=standardize, **options)
    stages = split_model(model, boundaries)
    if not 0 <= stage < len(stages):
        raise ModelConfigError(
            f"stage {stage} out of range: {len(boundaries)} boundaries give {len(stages)} stages"
        )
    return stages[stage]


def boundary_shapes(
    model: nn.Module, boundaries: Sequence[str], input_shape: Sequence[int]
) -> list[tuple[int, ...]]:
    """Per-sample activation shape at each boundary (one zero sample, no grad, eval mode; model left as it was)."""
    stages = split_model(model, boundaries)
    modes = {module: module.training for module in model.modules()}
    shapes: list[tuple[int, ...]] = []
    try:
        model.eval()
        with torch.no_grad():
            x = torch.zeros((1, *(int(d) for d in input_shape)), dtype=torch.float32)
            for stage in stages[:-1]:
                x = stage(x)
                shapes.append(tuple(x.shape[1:]))
    finally:
        for module, training in modes.items():
            module.training = training
    return shapes


def compose(stages: Sequence[nn.Module]) -> nn.Module:
    """One module running ``stages`` in order.

    Stages that are all ``nn.Sequential`` with distinct child names (as from
    :func:`split_model`) are merged into one ``nn.Sequential`` of their children, so the
    result has the full model's parameter names; stage 0's standardizer is kept.
    Otherwise the result is ``nn.Sequential(*stages)``.
    """
    if not stages:
        raise ModelConfigError("compose needs at least one stage")
    children = [
        child
        for stage in stages
        if isinstance(stage, nn.Sequential)
        for child in stage.named_children()
    ]
    names = [name for name, _ in children]
    if not all(isinstance(s, nn.Sequential) for s in stages) or len(set(names)) != len(names):
        return nn.Sequential(*stages)
    composed = nn.Sequential(OrderedDict(children))
    standardizer = getattr(stages[0], "input_standardizer", None)
    if isinstance(standardizer, InputStandardizer):
        _install_standardizer(composed, standardizer)
    return composed


def _install_standardizer(module: nn.Module, standardizer: InputStandardizer) -> None:
    module.register_forward_pre_hook(standardizer)
    module.input_standardizer = standardizer


def stage_trainer(model: nn.Module, boundaries: Sequence[str], stage: int, input_shape: Sequence[int],
                  num_classes: int, **trainer_kwargs: Any) -> StageTrainer:
    """The :class:`StageTrainer` of stage ``stage`` of ``model`` (a whole model, as
    ``build_model`` made it) cut at ``boundaries``, with its boundary shapes filled in.
    ``ModelConfigError`` for bad boundaries or a stage out of range."""
    stages = split_model(model, boundaries)
    if not 0 <= stage < len(stages):
        raise ModelConfigError(f"stage {stage} out of range: {len(boundaries)} boundaries make {len(stages)} stages")
    shapes = [tuple(int(d) for d in input_shape), *boundary_shapes(model, boundaries, input_shape)]
    output = shapes[stage + 1] if stage + 1 < len(shapes) else (int(num_classes),)
    return StageTrainer(stages[stage], stage=stage, stages=len(stages), input_shape=shapes[stage],
                        output_shape=output, num_classes=num_classes, **trainer_kwargs)


@dataclass
class StageForward:
    """One stage's forward pass, kept until its backward (one backward per forward)."""

    #: The stage's input: a leaf requiring grad for stages > 0; a no-grad tensor for stage 0.
    inputs: torch.Tensor | None
    #: The stage's output, with its autograd graph.
    output: torch.Tensor
    batch_size: int
    base_version: int
    #: Change the forward made to floating-point buffers (restored at once; empty without BatchNorm).
    buffer_deltas: dict[str, torch.Tensor] = field(default_factory=dict)
    _used: bool = field(default=False, init=False, repr=False)

    def activation(self) -> torch.Tensor:
        """The output detached: a contiguous float32 CPU copy (what goes on the wire)."""
        return self.output.detach().to("cpu", torch.float32).contiguous().clone()


class StageTrainer(LocalTrainer):
    """A :class:`LocalTrainer` over one stage's module (stage ``stage`` of ``stages``).

    :meth:`forward` then exactly one of :meth:`backward` (not top) or
    :meth:`loss_backward` (top) computes the stage's parameter gradients and the gradient
    w.r.t. its input; neither applies anything (use :meth:`apply_gradient`). As in
    :class:`LocalTrainer`, floating-point buffers are restored after the forward and
    their change reported as ``buffer_deltas``.
    """

    def __init__(self, model: nn.Module, *, stage: int, stages: int, input_shape: Sequence[int] = (),
                 output_shape: Sequence[int] = (), num_classes: int = 0, **trainer_kwargs: Any) -> None:
        """``input_shape`` / ``output_shape``: per-sample shapes at the stage's input and
        output boundaries; ``num_classes``: the model's classes (what the labels a stage
        receives may be). Strategies read them to validate and synthesise."""
        if stages < 1 or not 0 <= stage < stages:
            raise ValueError(f"stage {stage} out of range for {stages} stages")
        if not any(p.requires_grad for p in model.parameters()):
            raise ModelConfigError(
                f"stage {stage} has no trainable parameters: cut after a block that has some"
            )
        super().__init__(model, **trainer_kwargs)
        self.stage = int(stage)
        self.stages = int(stages)
        self.input_shape = tuple(int(d) for d in input_shape)
        self.output_shape = tuple(int(d) for d in output_shape)
        self.num_classes = int(num_classes)

    @property
    def top(self) -> bool:
        """Whether this is the last stage (it owns the loss)."""
        return self.stage == self.stages - 1

    def forward(self, inputs: Any) -> StageForward:
        """Run the stage in train mode on raw features (stage 0) or the previous boundary's activation."""
        if self.stage == 0:
            x = self._features_tensor(inputs)
        else:
            if not isinstance(inputs, torch.Tensor):
                raise BatchError(
                    f"stage {self.stage} takes a torch tensor activation, got {type(inputs).__name__}"
                )
            if inputs.ndim < 1 or inputs.shape[0] == 0:
                raise BatchError(
                    f"activation must be [N, ...] with N > 0, got shape {tuple(inputs.shape)}"
                )
            x = inputs.detach().to(self.device, torch.float32).clone()
            if not bool(torch.isfinite(x).all()):
                raise BatchError("activation contains NaN or infinity")
            x.requires_grad_(True)
        self.model.train()
        # The forward runs on copies of the floating-point buffers (BatchNorm's running
        # statistics), which the graph may keep for the backward; the model's own buffers are
        # left as they were, and what the forward would have done to them is reported.
        originals: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        for module in self.model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    originals.append((module._buffers, key, buffer))
                    module._buffers[key] = buffer.detach().clone()
        try:
            output = self.model(x)
        finally:
            copies = [(table, key, table[key]) for table, key, _ in originals]
            for table, key, buffer in originals:
                table[key] = buffer
        deltas = {}
        by_id = {id(buffer): name for name, buffer in self._float_buffers().items()}
        with torch.no_grad():
            for (_, _, buffer), (_, _, copy) in zip(originals, copies, strict=True):
                name = by_id.get(id(buffer))
                if name is not None:
                    deltas[name] = (copy - buffer).to("cpu", torch.float32)
        if output.shape[0] != x.shape[0]:
            raise BatchError(
                f"stage output {tuple(output.shape)} lost the batch dimension of {tuple(x.shape)}"
            )
        return StageForward(
            inputs=x,
            output=output,
            batch_size=int(x.shape[0]),
            base_version=self._version,
            buffer_deltas=deltas,
        )

    def backward(
        self, fwd: StageForward, grad_output: torch.Tensor
    ) -> tuple[StepResult, torch.Tensor | None]:
        """Backprop ``grad_output`` (dL/d output, true or synthetic) through a non-top stage.

        Returns the stage's parameter gradients (loss 0.0, correct None) and dL/d inputs
        (detached float32 CPU; None for stage 0).
        """
        if self.top:
            raise StrategyError(f"stage {self.stage} is the top stage: use loss_backward")
        grad = (
            grad_output.detach()
            if isinstance(grad_output, torch.Tensor)
            else torch.as_tensor(grad_output)
        )
        if tuple(grad.shape) != tuple(fwd.output.shape):
            raise BatchError(
                f"grad_output shape {tuple(grad.shape)} does not match the stage output {tuple(fwd.output.shape)}"
            )
        if not bool(torch.isfinite(grad).all()):
            raise BatchError("grad_output contains NaN or infinity")
        grad = grad.to(fwd.output.device, fwd.output.dtype)
        gradients, input_grad = self._backprop(fwd, fwd.output, grad)
        result = StepResult(
            gradients=gradients,
            loss=0.0,
            batch_size=fwd.batch_size,
            base_version=fwd.base_version,
            buffer_deltas=fwd.buffer_deltas,
        )
        return result, input_grad

    def loss_backward(
        self, fwd: StageForward, labels: Any
    ) -> tuple[StepResult, torch.Tensor | None]:
        """Top stage: mean cross-entropy of ``fwd.output`` against ``labels``, backpropagated.

        Returns gradients, loss, the prequential ``correct`` mask (argmax == label) and
        dL/d inputs (None if this is stage 0 of a 1-stage split).
        """
        if not self.top:
            raise StrategyError(
                f"stage {self.stage} of {self.stages} is not the top stage: use backward"
            )
        logits = fwd.output
        if logits.ndim != 2:
            raise BatchError(
                f"top stage returned logits of shape {tuple(logits.shape)}, expected [N, C]"
            )
        targets = self._labels(labels, fwd.batch_size, logits.shape[1])
        loss = F.cross_entropy(logits, targets)
        if not bool(torch.isfinite(loss)):
            raise BatchError(f"non-finite training loss {loss.item()}", reason="non_finite_loss")
        correct = (logits.detach().argmax(dim=1) == targets).cpu().numpy()
        gradients, input_grad = self._backprop(fwd, loss, None)
        result = StepResult(
            gradients=gradients,
            loss=float(loss.detach()),
            batch_size=fwd.batch_size,
            base_version=fwd.base_version,
            buffer_deltas=fwd.buffer_deltas,
            correct=correct,
        )
        return result, input_grad

    # -- helpers --------------------------------------------------------------------

    def _backprop(
        self, fwd: StageForward, root: torch.Tensor, grad: torch.Tensor | None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """Gradients of ``root`` (seeded with ``grad``) w.r.t. every parameter and the stage input."""
        if fwd._used:
            raise StrategyError(
                "this StageForward was already backpropagated (one backward per forward)"
            )
        fwd._used = True
        trainable = [(name, p) for name, p in self._params.items() if p.requires_grad]
        wrt: list[torch.Tensor] = [p for _, p in trainable]
        want_input = self.stage > 0 and fwd.inputs is not None and fwd.inputs.requires_grad
        if want_input:
            wrt.append(fwd.inputs)
        if not wrt:
            return {}, None
        try:
            grads = torch.autograd.grad(root, wrt, grad_outputs=grad, allow_unused=True)
        except RuntimeError as exc:  # e.g. parameters changed in place since the forward
            raise StrategyError(f"stage {self.stage} backward failed: {exc}") from exc
        by_param = {name: g for (name, _), g in zip(trainable, grads, strict=False)}
        gradients = {
            name: (
                by_param[name].detach().to("cpu", torch.float32).clone()
                if by_param.get(name) is not None
                else torch.zeros(p.shape, dtype=torch.float32)
            )
            for name, p in self._params.items()
        }
        input_grad = None
        if want_input:
            g = grads[-1]
            input_grad = (
                torch.zeros(fwd.inputs.shape, dtype=torch.float32)
                if g is None
                else g.detach().to("cpu", torch.float32).contiguous().clone()
            )
        return gradients, input_grad

    def _labels(self, labels: Any, count: int, classes: int) -> torch.Tensor:
        """Integer class ids ``[count]`` in ``[0, classes)`` as an int64 tensor on the device."""
        targets = self._labels_tensor(labels, count)
        if int(targets.max()) >= classes:
            raise BatchError(f"label {int(targets.max())} out of range for {classes} classes")
        return targets
