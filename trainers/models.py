"""Model registry: small torch models chosen by name, built with a seeded, deterministic init.

``train.model`` names a registered model (the built-ins below, and what installed plugins
register through the ``edgestream.models`` entry-point group) or the user's own factory as
``"package.module:factory"``; :func:`check_model` is what a job checks the built model against.
"""

from __future__ import annotations

import importlib
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from edgestream import plugins
from edgestream.trainers.errors import ModelConfigError

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
    """Registered names accepted by :func:`build_model` (installed plugins' included), sorted."""
    plugins.load_group(plugins.MODELS)
    return sorted(_MODELS)


#: ``package.module:factory`` (``factory`` may be an attribute path, ``Class.build``).
_MODULE_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
#: How ``train.model`` names the user's own factory, for errors.
OWN_MODEL = '"package.module:factory"'


def is_module_path(name: str) -> bool:
    """Whether ``name`` names a factory by module path (it holds a colon) rather than a registered model."""
    return ":" in name


def resolve_model(name: str) -> ModelFactory:
    """The factory ``name`` names: a registered model (looked up in the installed plugins'
    ``edgestream.models`` entry points when not registered yet), or ``"package.module:factory"``
    (the module is imported, the attribute path followed). ``ModelConfigError`` with one line
    naming what failed: the module does not import, has no such attribute, it is not callable."""
    if not is_module_path(name):
        factory = _MODELS.get(name)
        if factory is None:
            plugins.load_group(plugins.MODELS)
            factory = _MODELS.get(name)
        if factory is None:
            raise ModelConfigError(
                f"unknown model {name!r}; registered: {', '.join(sorted(_MODELS))}; or your own "
                f"as {OWN_MODEL}{plugins.failure_note(plugins.MODELS)}")
        return factory
    if not _MODULE_PATH.match(name):
        raise ModelConfigError(f"{name!r} is not {OWN_MODEL}: a dotted module path, a colon and the name of "
                               "the factory in it (e.g. \"mypkg.nets:build\")")
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ModelConfigError(f"module {module_name!r} is not found ({_first_line(exc)}): install the "
                                   "package that holds it, or put its folder on PYTHONPATH") from None
        raise ModelConfigError(f"importing module {module_name!r} raised ModuleNotFoundError: "
                               f"{_first_line(exc)}") from None
    except Exception as exc:  # the user's module failed while it ran: say so, never a traceback
        raise ModelConfigError(f"importing module {module_name!r} raised {type(exc).__name__}: "
                               f"{_first_line(exc)}") from None
    factory: Any = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            where = f"module {module_name!r}" if factory is module else repr(factory)
            defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                             and getattr(v, "__module__", None) == module_name)
            hint = f" (it defines: {', '.join(defined[:10])})" if defined else ""
            raise ModelConfigError(f"{where} has no attribute {part!r}{hint}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ModelConfigError(f"{attribute!r} in module {module_name!r} is an object of type "
                               f"{type(factory).__name__}, not callable: name a function or class, "
                               "factory(input_shape, num_classes, **options) -> torch.nn.Module")
    return factory


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"


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

    ``name`` is resolved by :func:`resolve_model` (a registered name or ``"package.module:factory"``);
    the factory is called as ``factory(input_shape, num_classes, **options)``. A factory that
    raises (other than ``ModelConfigError``) or returns no ``nn.Module`` is a ``ModelConfigError``
    saying so in one line.
    """
    with torch.random.fork_rng(devices=[]):  # a user's module may draw from the RNG as it imports
        factory = resolve_model(name)
    shape = tuple(int(d) for d in input_shape)
    if not shape or any(d <= 0 for d in shape):
        raise ModelConfigError(f"model {name!r}: input_shape must be positive dims, got {shape}")
    if num_classes < 2:
        raise ModelConfigError(f"model {name!r}: num_classes must be >= 2, got {num_classes}")
    standardizer = None if standardize is None else InputStandardizer(standardize[0], standardize[1], shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = factory(shape, num_classes, **options)
        except ModelConfigError:
            raise
        except Exception as exc:  # the user's factory: its failure in one line, never a traceback
            raise ModelConfigError(f"the factory raised {type(exc).__name__}: {_first_line(exc)}") from exc
    if not isinstance(model, nn.Module):
        raise ModelConfigError(f"the factory returned a {type(model).__name__}, not a torch.nn.Module")
    if standardizer is not None:
        model.register_forward_pre_hook(standardizer)
        # A plain attribute (not a Module, Parameter or buffer): invisible to state_dict.
        model.input_standardizer = standardizer
    return model


#: Rows of the job's data :func:`check_model` runs the model on.
CHECK_ROWS = 8


def check_model(model: nn.Module, sample: Any, num_classes: int) -> None:
    """Check a built model against a job: it has trainable parameters, and on ``sample`` (a
    batch of the job's features, ``[N, *input_shape]``) its forward pass runs and returns
    finite floating-point scores of shape ``[N, num_classes]``: one score per class.

    The forward runs in eval mode, without grad and on a forked RNG; the model's modes are
    restored, so the check changes nothing (no BatchNorm statistics, no RNG draw). Raises
    ``ModelConfigError`` with one line naming what failed."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelConfigError(f"the model ({type(model).__name__}) has no trainable parameters")
    x = torch.as_tensor(np.asarray(sample), dtype=torch.float32)
    batch = f"a batch of the job's data of shape {tuple(x.shape)}"
    modes = {module: module.training for module in model.modules()}
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            scores = model(x)
    except Exception as exc:  # the user's forward: its failure in one line
        raise ModelConfigError(f"the forward pass on {batch} raised {type(exc).__name__}: "
                               f"{_first_line(exc)}") from None
    finally:
        for module, training in modes.items():
            module.training = training
    if not isinstance(scores, torch.Tensor):
        raise ModelConfigError(f"the forward pass on {batch} returns a {type(scores).__name__}, not a tensor "
                               f"of class scores [N, {num_classes}]")
    wanted = (int(x.shape[0]), int(num_classes))
    if tuple(scores.shape) != wanted:
        raise ModelConfigError(f"the forward pass on {batch} returns shape {tuple(scores.shape)}; the job has "
                               f"{num_classes} classes: one score per class, shape {wanted}")
    if not scores.is_floating_point():
        raise ModelConfigError(f"the forward pass on {batch} returns {scores.dtype} scores; class scores "
                               "are floating point (logits)")
    if not bool(torch.isfinite(scores).all()):
        raise ModelConfigError(f"the forward pass on {batch} returns non-finite scores (NaN or infinity)")


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


# -- stageable models ------------------------------------------------------------------
#
# Each is an ``nn.Sequential`` of named blocks (no BatchNorm, no dropout): the block names
# are the boundaries ``trainers.stages.split_model`` can cut at, and a stage's output
# depends only on its input and parameters.


class Reshape(nn.Module):
    """Reshape ``[N, ...]`` to ``[N, *shape]`` (no parameters)."""

    def __init__(self, shape: Sequence[int]) -> None:
        super().__init__()
        self.shape = tuple(int(d) for d in shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], *self.shape)

    def extra_repr(self) -> str:
        return f"shape={self.shape}"


def _conv_block(conv: Callable[..., nn.Module], c_in: int, c_out: int, kernel: int,
                norm: Callable[[int], nn.Module] | None = None) -> list[nn.Module]:
    """Two ``conv`` (same padding) + ReLU layers: ``c_in -> c_out -> c_out``; with ``norm``
    (a BatchNorm class) conv -> norm -> ReLU."""
    pad = kernel // 2
    layers: list[nn.Module] = []
    for a, b in ((c_in, c_out), (c_out, c_out)):
        layers.append(conv(a, b, kernel, padding=pad, bias=norm is None))
        if norm is not None:
            layers.append(norm(b))
        layers.append(nn.ReLU())
    return layers


def _dense_block(n_in: int, n_out: int, batch_norm: bool) -> list[nn.Module]:
    """Linear + ReLU; with ``batch_norm`` Linear -> BatchNorm1d -> ReLU."""
    if batch_norm:
        return [nn.Linear(n_in, n_out, bias=False), nn.BatchNorm1d(n_out), nn.ReLU()]
    return [nn.Linear(n_in, n_out), nn.ReLU()]


def _norm_class(name: str, norm: str, batch_norm: type[nn.Module]) -> type[nn.Module] | None:
    if norm not in ("none", "batch"):
        raise ModelConfigError(f"{name}: norm must be none or batch, got {norm!r}")
    return batch_norm if norm == "batch" else None


def _check_stageable_options(name: str, width: int, hidden: int) -> None:
    if width < 1 or hidden < 1:
        raise ModelConfigError(f"{name}: width and hidden must be >= 1, got width={width}, hidden={hidden}")


def _he_init(model: nn.Module) -> nn.Module:
    """He (fan-in, ReLU) init of every conv and linear weight, zero biases: with torch's
    default init a plain stack of 6 ReLU convs and 2 FC layers barely moves its input's
    signal, and backprop does not get it started on digits (checked: chance after 300 steps)."""
    for module in model.modules():
        if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Linear):
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return model


@register_model("conv8")
def _build_conv8(input_shape: tuple[int, ...], num_classes: int, width: int = 8, hidden: int = 64,
                 norm: str = "none") -> nn.Module:
    """6 conv (3x3) + 2 FC layers for 8x8 single-channel images, blocks block1..block3, fc1, fc2.

    Activations per sample: block1 [c, 8, 8], block2 [2c, 4, 4], block3 [4c, 2, 2],
    fc1 [hidden], fc2 [num_classes] (c = ``width``). ``norm="batch"``: BatchNorm after every
    conv and after fc1's linear layer (a stage fed synthetic gradients keeps its scale).
    """
    if input_shape not in ((64,), (1, 8, 8), (8, 8)):
        raise ModelConfigError(f"conv8 expects input_shape (64,), (8, 8) or (1, 8, 8), got {input_shape}")
    _check_stageable_options("conv8", width, hidden)
    bn = _norm_class("conv8", norm, nn.BatchNorm2d)
    c = width
    blocks = OrderedDict(
        block1=nn.Sequential(Reshape((1, 8, 8)), *_conv_block(nn.Conv2d, 1, c, 3, bn)),
        block2=nn.Sequential(nn.MaxPool2d(2), *_conv_block(nn.Conv2d, c, 2 * c, 3, bn)),
        block3=nn.Sequential(nn.MaxPool2d(2), *_conv_block(nn.Conv2d, 2 * c, 4 * c, 3, bn)),
        fc1=nn.Sequential(nn.Flatten(), *_dense_block(4 * c * 2 * 2, hidden, norm == "batch")),
        fc2=nn.Linear(hidden, num_classes),
    )
    return _he_init(nn.Sequential(blocks))


@register_model("conv8_1d")
def _build_conv8_1d(input_shape: tuple[int, ...], num_classes: int, width: int = 8, hidden: int = 64,
                    norm: str = "none") -> nn.Module:
    """6 conv (kernel 5) + 2 FC layers over sensor windows ``[C, T]`` (T >= 4 at build time).

    Blocks block1..block3 (max-pool by 2 opening block2 and block3), fc1 (global average
    pool over time + Linear + ReLU), fc2. Activations per sample: block1 [c, T],
    block2 [2c, T//2], block3 [4c, T//4], fc1 [hidden], fc2 [num_classes].
    """
    if len(input_shape) != 2:
        raise ModelConfigError(f"conv8_1d expects input_shape (channels, time), got {input_shape}")
    if input_shape[1] < 4:
        raise ModelConfigError(f"conv8_1d needs time >= 4 (two max-pools by 2), got {input_shape}")
    _check_stageable_options("conv8_1d", width, hidden)
    bn = _norm_class("conv8_1d", norm, nn.BatchNorm1d)
    c = width
    blocks = OrderedDict(
        block1=nn.Sequential(*_conv_block(nn.Conv1d, input_shape[0], c, 5, bn)),
        block2=nn.Sequential(nn.MaxPool1d(2), *_conv_block(nn.Conv1d, c, 2 * c, 5, bn)),
        block3=nn.Sequential(nn.MaxPool1d(2), *_conv_block(nn.Conv1d, 2 * c, 4 * c, 5, bn)),
        fc1=nn.Sequential(nn.AdaptiveAvgPool1d(1), nn.Flatten(), *_dense_block(4 * c, hidden, norm == "batch")),
        fc2=nn.Linear(hidden, num_classes),
    )
    return _he_init(nn.Sequential(blocks))
