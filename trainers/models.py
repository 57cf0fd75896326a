"""Model registry: small torch models chosen by name, built with a seeded, deterministic init."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from trainers.errors import ModelConfigError

ModelFactory = Callable[..., nn.Module]

_MODELS: dict[str, ModelFactory] = {}


def register_model(name: str) -> Callable[[ModelFactory], ModelFactory]:
    """Register ``factory(input_shape, num_classes, **options) -> nn.Module`` under ``name``."""

    def decorate(factory: ModelFactory) -> ModelFactory:
        if name in _MODELS:
            raise ModelConfigError(f"model {name!r} is already registered")
        _MODELS[name] = factory
        return factory

    return decorate


def model_names() -> list[str]:
    """Names accepted by :func:`build_model`, sorted."""
    return sorted(_MODELS)


class InputStandardizer:
    """A fixed per-feature standardisation ``x -> (x - mean) / std``, the model's first operation.

    Installed by :func:`build_model` as a forward pre-hook, so it runs in training and in
    evaluation alike. It holds plain tensors, never parameters or buffers: it is not in
    ``parameters()``, ``named_buffers()`` or ``state_dict()``, so it is never sent in
    gradient or model messages nor stored in checkpoints, and the model's parameter names
    are those of the same model without it. Every replica builds it from the same
    statistics (the job's data), so replicas stay identical. Deterministic: one
    subtraction and one multiplication per value, in float32.

    Statistics are over the flattened features (shape ``(F,)``, or scalars). A feature
    whose std is (nearly) zero is only centred: dividing by ~0 would turn the rounding
    noise of a constant column into huge inputs.
    """

    def __init__(self, mean: Any, std: Any, input_shape: tuple[int, ...]) -> None:
        width = math.prod(input_shape)
        mean_t = torch.as_tensor(mean, dtype=torch.float64).reshape(-1)
        std_t = torch.as_tensor(std, dtype=torch.float64).reshape(-1)
        for what, t in (("mean", mean_t), ("std", std_t)):
            if t.numel() not in (1, width):
                raise ModelConfigError(
                    f"standardize: {what} has {t.numel()} values; need 1 or {width} (one per feature of {input_shape})"
                )
            if not bool(torch.isfinite(t).all()):
                raise ModelConfigError(f"standardize: {what} must be finite")
        if bool((std_t < 0).any()):
            raise ModelConfigError("standardize: std must be >= 0")
        tiny = 1e-6 * torch.clamp(mean_t.abs(), min=1.0)
        scale = torch.where(std_t > tiny, 1.0 / std_t, torch.ones_like(std_t))
        self.width = width
        self.shift = mean_t.to(torch.float32)
        self.scale = scale.to(torch.float32)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ([N, *input_shape] or [N, F]) standardised, same shape and float32."""
        flat = x.reshape(x.shape[0], -1).to(torch.float32)
        return ((flat - self.shift) * self.scale).reshape(x.shape)

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (self.apply(args[0]), *args[1:])


def build_model(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    seed: int,
    *,
    standardize: tuple[Any, Any] | None = None,
    **options: Any,
) -> nn.Module:
    """Build model ``name`` for samples of ``input_shape`` (no batch dim) and ``num_classes``.

    The same ``(name, input_shape, num_classes, seed, options)`` gives bitwise identical
    initial weights in every process, so all replicas of a job start from the same
    model. The global torch RNG is left untouched (the init draws from a forked RNG).

    ``standardize=(mean, std)`` (per flattened feature, e.g. ``FleetData.input_stats``)
    makes :class:`InputStandardizer` the model's first operation (``model.input_standardizer``);
    without it the model is exactly the registered one.
    """
    try:
        factory = _MODELS[name]
    except KeyError:
        raise ModelConfigError(
            f"unknown model {name!r}; registered: {', '.join(model_names())}"
        ) from None
    shape = tuple(int(d) for d in input_shape)
    if not shape or any(d <= 0 for d in shape):
        raise ModelConfigError(f"model {name!r}: input_shape must be positive dims, got {shape}")
    if num_classes < 2:
        raise ModelConfigError(f"model {name!r}: num_classes must be >= 2, got {num_classes}")
    standardizer = None if standardize is None else InputStandardizer(standardize[0], standardize[1], shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = factory(shape, num_classes, **options)
    if standardizer is not None:
        model.register_forward_pre_hook(standardizer)
        # A plain attribute (not a Module, Parameter or buffer): invisible to state_dict.
        model.input_standardizer = standardizer
    return model


@register_model("mlp")
def _build_mlp(
    input_shape: tuple[int, ...], num_classes: int, hidden: Sequence[int] = (64,)
) -> nn.Module:
    """Fully connected ReLU network over flattened features of any input shape."""
    in_features = math.prod(input_shape)
    layers: list[nn.Module] = [nn.Flatten()]
    for width in hidden:
        layers += [nn.Linear(in_features, width), nn.ReLU()]
        in_features = width
    layers.append(nn.Linear(in_features, num_classes))
    return nn.Sequential(*layers)


@register_model("cnn1d")
def _build_cnn1d(
    input_shape: tuple[int, ...], num_classes: int, channels: Sequence[int] = (16, 32), kernel: int = 5
) -> nn.Module:
    """Temporal CNN over multichannel sensor windows shaped ``[C, T]``; length-agnostic."""
    if len(input_shape) != 2:
        raise ModelConfigError(f"cnn1d expects input_shape (channels, time), got {input_shape}")
    in_channels = input_shape[0]
    layers: list[nn.Module] = []
    for width in channels:
        layers += [nn.Conv1d(in_channels, width, kernel, padding=kernel // 2), nn.ReLU()]
        in_channels = width
    layers += [nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(in_channels, num_classes)]
    return nn.Sequential(*layers)


class DigitsCNN(nn.Module):
    """Two conv + BatchNorm blocks and a linear head for 8x8 single-channel images.

    Accepts ``[N, 64]`` or ``[N, 1, 8, 8]``. The BatchNorm running statistics are
    buffers, so strategies must keep them in sync too (see ``StepResult.buffer_deltas``).
    """

    def __init__(self, num_classes: int, width: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * width * 2 * 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], 1, 8, 8)
        return self.head(self.features(x).flatten(1))


@register_model("digits_cnn")
def _build_digits_cnn(input_shape: tuple[int, ...], num_classes: int, width: int = 8) -> nn.Module:
    if math.prod(input_shape) != 64 or input_shape not in ((64,), (1, 8, 8), (8, 8)):
        raise ModelConfigError(f"digits_cnn expects input_shape (64,) or (1, 8, 8), got {input_shape}")
    return DigitsCNN(num_classes, width=width)
