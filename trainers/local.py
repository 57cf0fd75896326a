"""The local training step: one model, one optimizer, a version counter, no I/O."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from edgestream.trainers.errors import AggregationError, BatchError, TrainerError


def limit_torch_threads(num_threads: int) -> None:
    """Cap torch's intra-op (and, if still possible, inter-op) CPU threads for this process.

    Call once at worker start-up, before the first step: the cores are shared with the
    Kafka broker and the event loop. Inter-op threads can only be set before any
    parallel work has started; later calls keep the existing inter-op setting.
    """
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    torch.set_num_threads(num_threads)
    try:
        torch.set_num_interop_threads(num_threads)
    except RuntimeError:
        pass  # already fixed by earlier parallel work; intra-op is what matters here


@dataclass(frozen=True)
class StepResult:
    """Outcome of one :meth:`LocalTrainer.compute_gradient` call.

    ``gradients`` maps every trainable parameter name to a float32 CPU tensor of its
    shape; ``buffer_deltas`` maps every floating-point buffer (BatchNorm running
    statistics) to the change this batch's forward pass would have made, so the
    strategy decides how buffers move, exactly like parameters.
    """

    gradients: dict[str, torch.Tensor]
    loss: float
    batch_size: int
    base_version: int
    buffer_deltas: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Per sample, whether the model (before this step) predicted its label: the
    #: prequential (test-then-train) score of the batch. None if the step cannot tell.
    correct: np.ndarray | None = None
    #: The gradient follows a prediction, not a loss (a stage updated from its synthetic
    #: gradient): its scale grows as the predictor learns, so the step guard's spike rule
    #: (against recent norms) does not apply; its absolute bound does.
    synthetic: bool = False


class LocalTrainer:
    """Holds a model and its SGD optimizer and counts applied updates as ``version``.

    Invariant: parameters, floating-point buffers and optimizer state change only
    through :meth:`apply_gradient`, :meth:`set_parameters`/:meth:`load_snapshot`
    and :meth:`load_state_dict`; :meth:`compute_gradient` leaves them untouched.
    ``version`` is the number of updates the parameters embody; strategies stamp it
    on every update as the base version. Not thread-safe: drive it from one thread
    (the pipeline's single-thread executor); it never touches asyncio.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        device: str | torch.device = "cpu",
        version: int = 0,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.lr = lr
        self.optimizer = torch.optim.SGD(
            self.model.parameters(),
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        self._params: dict[str, nn.Parameter] = dict(self.model.named_parameters())
        self._buffers: dict[str, torch.Tensor] = dict(self.model.named_buffers())
        self._version = int(version)

    # -- identity -----------------------------------------------------------------

    @property
    def version(self) -> int:
        """Number of updates applied to the parameters (model version)."""
        return self._version

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Trainable parameter names and shapes, in module order."""
        return {name: tuple(p.shape) for name, p in self._params.items()}

    def buffer_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Buffer names with shape and dtype (integer buffers such as BatchNorm counters too)."""
        return {name: (tuple(b.shape), b.dtype) for name, b in self._buffers.items()}

    def parameter_digest(self) -> str:
        """sha256 (hex) over parameters and floating-point buffers, sorted by name.

        Two replicas with equal digests compute identical outputs. Integer buffers
        (BatchNorm's ``num_batches_tracked``) are left out: they count forward passes
        and do not affect outputs while BatchNorm momentum is set.
        """
        digest = hashlib.sha256()
        named = {**self._params, **self._float_buffers()}
        for name in sorted(named):
            tensor = named[name].detach().to("cpu").contiguous()
            digest.update(name.encode())
            digest.update(str(tensor.dtype).encode())
            digest.update(str(tuple(tensor.shape)).encode())
            digest.update(tensor.numpy().tobytes())
        return digest.hexdigest()

    # -- the step -----------------------------------------------------------------

    def compute_gradient(self, features: np.ndarray, labels: np.ndarray) -> StepResult:
        """Forward + backward on one batch; return gradients without updating anything.

        ``features``: float array ``[N, ...]`` matching the model's input; ``labels``:
        integer class ids ``[N]``. BatchNorm statistics are restored after the
        forward pass and returned as ``buffer_deltas`` instead.
        """
        inputs, targets = self._to_tensors(features, labels)
        self.model.train()
        float_buffers = self._float_buffers()
        buffers_before = {name: b.detach().clone() for name, b in float_buffers.items()}
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(inputs)
        if logits.ndim != 2:
            raise BatchError(f"model returned logits of shape {tuple(logits.shape)}, expected [N, C]")
        if int(targets.max()) >= logits.shape[1]:
            raise BatchError(f"label {int(targets.max())} out of range for {logits.shape[1]} classes")
        loss = F.cross_entropy(logits, targets)
        correct = (logits.detach().argmax(dim=1) == targets).cpu().numpy()
        if not torch.isfinite(loss):
            raise BatchError(f"non-finite training loss {loss.item()}", reason="non_finite_loss")
        loss.backward()
        gradients = {
            name: (
                p.grad.detach().to("cpu", torch.float32).clone()
                if p.grad is not None
                else torch.zeros(p.shape, dtype=torch.float32)
            )
            for name, p in self._params.items()
        }
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            deltas = {}
            for name, buffer in float_buffers.items():
                deltas[name] = (buffer - buffers_before[name]).to("cpu", torch.float32)
                buffer.copy_(buffers_before[name])
        return StepResult(
            gradients=gradients,
            loss=float(loss.detach()),
            batch_size=int(targets.shape[0]),
            base_version=self._version,
            buffer_deltas=deltas,
            correct=correct,
        )

    def apply_gradient(
        self,
        named_grads: Mapping[str, torch.Tensor],
        lr_scale: float = 1.0,
        buffer_deltas: Mapping[str, torch.Tensor] | None = None,
    ) -> int:
        """Take one optimizer step along ``named_grads`` with ``lr * lr_scale``; return the new version.

        ``named_grads`` must name every trainable parameter with its shape.
        ``buffer_deltas`` (optional, any subset of floating-point buffers) are added to
        the buffers. The learning rate is restored after the step, so scaling is per step.
        """
        self._check_names(named_grads, self._params, "gradient")
        if not (lr_scale > 0 and np.isfinite(lr_scale)):
            raise ValueError(f"lr_scale must be finite and > 0, got {lr_scale}")
        float_buffers = self._float_buffers()
        for name, delta in (buffer_deltas or {}).items():
            if name not in float_buffers or tuple(delta.shape) != tuple(float_buffers[name].shape):
                raise AggregationError(f"buffer delta {name!r} does not match a float buffer")
        for name, param in self._params.items():
            param.grad = named_grads[name].detach().to(self.device, param.dtype).clone()
        saved_lrs = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * lr_scale
        try:
            self.optimizer.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, saved_lrs, strict=True):
                group["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, delta in (buffer_deltas or {}).items():
                float_buffers[name].add_(delta.to(self.device, float_buffers[name].dtype))
        self._version += 1
        return self._version

    # -- parameters, buffers, optimizer slots ---------------------------------------

    def get_parameters(self) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the parameters, by name."""
        return {name: p.detach().to("cpu").clone() for name, p in self._params.items()}

    def set_parameters(self, named: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Overwrite every parameter (all names required); optionally set ``version``."""
        self._check_names(named, self._params, "parameter")
        with torch.no_grad():
            for name, param in self._params.items():
                param.copy_(named[name].to(self.device, param.dtype))
        if version is not None:
            self._set_version(version)

    def get_buffers(self) -> dict[str, torch.Tensor]:
        """Detached CPU copies of all buffers (float and integer), by name."""
        return {name: b.detach().to("cpu").clone() for name, b in self._buffers.items()}

    def set_buffers(self, named: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the named buffers (any subset)."""
        with torch.no_grad():
            for name, value in named.items():
                if name not in self._buffers or self._buffers[name].shape != value.shape:
                    raise AggregationError(f"buffer {name!r} does not match the model")
                self._buffers[name].copy_(value.to(self.device, self._buffers[name].dtype))

    def get_momentum(self) -> dict[str, torch.Tensor]:
        """SGD momentum buffers by parameter name (parameters without one are omitted)."""
        slots = {}
        for name, param in self._params.items():
            buf = self.optimizer.state.get(param, {}).get("momentum_buffer")
            if buf is not None:
                slots[name] = buf.detach().to("cpu").clone()
        return slots

    def set_momentum(self, named: Mapping[str, torch.Tensor]) -> None:
        """Replace SGD momentum buffers; parameters not named lose theirs (fresh momentum)."""
        for name in named:
            if name not in self._params:
                raise AggregationError(f"momentum for unknown parameter {name!r}")
        for name, param in self._params.items():
            state = self.optimizer.state[param]
            if name in named:
                state["momentum_buffer"] = named[name].detach().to(self.device, param.dtype).clone()
            else:
                state.pop("momentum_buffer", None)

    def load_snapshot(
        self,
        parameters: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        version: int,
        momentum: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Adopt a model snapshot: parameters, buffers, version and optionally momentum."""
        self.set_parameters(parameters)
        self.set_buffers(buffers)
        if momentum is not None:
            self.set_momentum(momentum)
        self._set_version(version)

    # -- persistence ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ..., "version": int}``; tensors and primitives only."""
        return {
            "model": {k: v.detach().to("cpu").clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "version": self._version,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (model, optimizer and version)."""
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            version = int(state["version"])
        except (KeyError, RuntimeError, ValueError) as exc:
            raise TrainerError(f"trainer state does not fit this model: {exc}") from exc
        self._set_version(version)

    # -- helpers --------------------------------------------------------------------

    def _set_version(self, version: int) -> None:
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self._version = int(version)

    def _float_buffers(self) -> dict[str, torch.Tensor]:
        return {name: b for name, b in self._buffers.items() if b.is_floating_point()}

    def _to_tensors(self, features: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = self._features_tensor(features)
        return inputs, self._labels_tensor(labels, inputs.shape[0])

    def _features_tensor(self, features: Any) -> torch.Tensor:
        """Raw numeric features ``[N, ...]`` (N > 0, finite; numpy or torch) as float32 on the device."""
        if isinstance(features, torch.Tensor):
            features = features.detach().cpu().numpy()
        features = np.asarray(features)
        if features.ndim < 2 or features.shape[0] == 0:
            raise BatchError(f"features must be [N, ...] with N > 0, got shape {features.shape}")
        if not (np.issubdtype(features.dtype, np.floating) or np.issubdtype(features.dtype, np.integer)):
            raise BatchError(f"features must be numeric, got {features.dtype}")
        if not np.all(np.isfinite(features)):
            raise BatchError("features contain NaN or infinity")
        return torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)).to(self.device)

    def _labels_tensor(self, labels: Any, count: int) -> torch.Tensor:
        """Integer class ids ``[count]`` (>= 0; numpy or torch) as int64 on the device."""
        if isinstance(labels, torch.Tensor):
            labels = labels.detach().cpu().numpy()
        labels = np.asarray(labels)
        if labels.shape != (count,):
            raise BatchError(f"labels shape {labels.shape} does not match {count} samples")
        if not np.issubdtype(labels.dtype, np.integer):
            raise BatchError(f"labels must be integers, got {labels.dtype}")
        if labels.min() < 0:
            raise BatchError(f"negative label {int(labels.min())}")
        return torch.from_numpy(labels.astype(np.int64)).to(self.device)

    @staticmethod
    def _check_names(named: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], what: str) -> None:
        missing = reference.keys() - named.keys()
        extra = named.keys() - reference.keys()
        if missing or extra:
            raise AggregationError(
                f"{what} names do not match the model: missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        for name, tensor in named.items():
            if tuple(tensor.shape) != tuple(reference[name].shape):
                raise AggregationError(
                    f"{what} {name!r} has shape {tuple(tensor.shape)}, model has {tuple(reference[name].shape)}"
                )
