"""Synthetic gradient modules (DNI / cDNI): predict dL/dh at a stage boundary.

A :class:`Synthesizer` maps a boundary activation ``h`` (and, conditioned, the label)
to an estimate of the gradient of the batch-mean loss w.r.t. ``h``. It starts out
predicting exactly zero (last layer zero-initialised) and is regressed by MSE onto the
true gradients when they come back. No I/O, no clocks, the global torch RNG untouched.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

_OPTIMIZERS = ("adam", "sgd")


class Synthesizer:
    """M(h) or M(h, y): predicts dL/dh for a boundary activation h ([N, *shape]) from h (and the label, cDNI).

    Scale invariant: the stage's loss is a mean over the batch, so a true per-sample
    gradient is about 1/N of a per-sample quantity. The module regresses ``N * dL/dh``
    (independent of N) and :meth:`predict` divides by N, so one module serves any batch size.
    ``y`` (integer labels [N]) is required when ``conditioned`` and ignored otherwise.

    Normalised: the module sees ``h`` divided by a running RMS of the activations and
    regresses targets divided by a running RMS of the targets (both exponential averages,
    rate ``stats_rate``), so its optimizer's step (Adam moves each weight by about ``lr``
    whatever the scale) means the same at every boundary. Without it the first updates of
    a synthesiser over large activations predict gradients many times the true ones, and
    the stage that follows them kills its ReLUs within a few steps (seen on ``conv8``).

    :attr:`trust` (0..1) is ``1 - relative error``: the running MSE of the predictions
    (measured on each target before learning from it) over the running mean square of the
    targets, clamped. 0 until the first target; a synthesiser no better than predicting
    zero has trust 0.
    """

    def __init__(
        self,
        shape: Sequence[int],
        num_classes: int,
        *,
        conditioned: bool,
        hidden: int = 0,
        lr: float = 1e-3,
        seed: int = 0,
        optimizer: str = "adam",
        stats_rate: float = 0.05,
    ) -> None:
        self.shape = tuple(int(d) for d in shape)
        if not self.shape or any(d <= 0 for d in self.shape):
            raise ValueError(f"shape must be positive dims, got {self.shape}")
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        if hidden < 0:
            raise ValueError(f"hidden must be >= 0, got {hidden}")
        if not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"lr must be finite and > 0, got {lr}")
        if optimizer not in _OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {_OPTIMIZERS}, got {optimizer!r}")
        self.num_classes = int(num_classes)
        self.conditioned = bool(conditioned)
        self.hidden = int(hidden)
        self.lr = float(lr)
        self.seed = int(seed)
        self.optimizer_name = optimizer
        self.width = math.prod(self.shape)
        self.updates = 0
        if not 0 < stats_rate <= 1:
            raise ValueError(f"stats_rate must be in (0, 1], got {stats_rate}")
        self.stats_rate = float(stats_rate)
        self.h_rms = 0.0  # running RMS of h (0: not seen yet)
        self.target_rms = 0.0  # running RMS of N * dL/dh
        self.error_ms = 0.0  # running MSE of the predictions, per-sample scale
        self.target_ms = 0.0  # running mean square of the targets, per-sample scale
        in_features = self.width + (self.num_classes if self.conditioned else 0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            if self.hidden == 0:
                layers: list[nn.Module] = [nn.Linear(in_features, self.width)]
            else:
                layers = [
                    nn.Linear(in_features, self.hidden),
                    nn.ReLU(),
                    nn.Linear(self.hidden, self.width),
                ]
        last = layers[-1]
        assert isinstance(last, nn.Linear)
        with torch.no_grad():
            last.weight.zero_()
            last.bias.zero_()
        self.module = nn.Sequential(*layers)
        if optimizer == "adam":
            self.optimizer: torch.optim.Optimizer = torch.optim.Adam(
                self.module.parameters(), lr=self.lr
            )
        else:
            self.optimizer = torch.optim.SGD(self.module.parameters(), lr=self.lr)

    @property
    def num_parameters(self) -> int:
        """Number of scalar parameters of the module."""
        return sum(p.numel() for p in self.module.parameters())

    def predict(self, h: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """Synthetic dL/dh for the batch ``h``: float32, shape of ``h``, no graph."""
        with torch.no_grad():
            x = self._inputs(h, y)
            return (self.module(x) * (self.target_rms / h.shape[0])).reshape(h.shape).contiguous()

    @property
    def trust(self) -> float:
        """``1 - relative error`` of recent predictions, in [0, 1] (0 before any target)."""
        if self.target_ms <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.error_ms / self.target_ms))

    def update(self, h: torch.Tensor, y: torch.Tensor | None, target: torch.Tensor) -> float:
        """One optimizer step of MSE(module(h, y), N * target); return that MSE before the step."""
        target = torch.as_tensor(target).detach()
        if tuple(target.shape) != tuple(h.shape):
            raise ValueError(
                f"target shape {tuple(target.shape)} does not match h {tuple(h.shape)}"
            )
        if not bool(torch.isfinite(target).all()):
            raise ValueError("target contains NaN or infinity")
        goal = target.to(torch.float32).reshape(h.shape[0], self.width) * h.shape[0]
        rate = self.stats_rate if self.updates else 1.0
        with torch.no_grad():
            # The error of what predict would have said, before learning from this target.
            error = float(F.mse_loss(self.module(self._inputs(h, y)) * self.target_rms, goal))
            goal_ms = float(goal.pow(2).mean())
            self.error_ms += rate * (error - self.error_ms)
            self.target_ms += rate * (goal_ms - self.target_ms)
            self.target_rms += rate * (math.sqrt(goal_ms) - self.target_rms)
            h_rms = float(h.detach().to(torch.float32).pow(2).mean().sqrt())
            self.h_rms += rate * (h_rms - self.h_rms)
        x = self._inputs(h, y)
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.module(x), goal / max(self.target_rms, 1e-12))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        return error

    def state_dict(self) -> dict[str, Any]:
        """Module, optimizer, update count and configuration; tensors and primitives only."""
        return {
            "config": {
                "shape": list(self.shape),
                "num_classes": self.num_classes,
                "conditioned": self.conditioned,
                "hidden": self.hidden,
                "optimizer": self.optimizer_name,
            },
            "module": {k: v.detach().clone() for k, v in self.module.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "updates": self.updates,
            "stats": [self.h_rms, self.target_rms, self.error_ms, self.target_ms],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; ValueError if it was saved by a differently shaped synthesizer."""
        try:
            config = dict(state["config"])
            config["shape"] = tuple(int(d) for d in config["shape"])
            mine = {
                "shape": self.shape,
                "num_classes": self.num_classes,
                "conditioned": self.conditioned,
                "hidden": self.hidden,
                "optimizer": self.optimizer_name,
            }
            if config != mine:
                raise ValueError(f"synthesizer state was saved for {config}, this one is {mine}")
            self.module.load_state_dict(state["module"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.updates = int(state["updates"])
            self.h_rms, self.target_rms, self.error_ms, self.target_ms = (float(v) for v in state["stats"])
        except (KeyError, TypeError, RuntimeError) as exc:
            raise ValueError(f"synthesizer state does not fit: {exc}") from exc

    def _inputs(self, h: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        """``[h_flat, onehot(y)]`` (conditioned) or ``h_flat``: float32 [N, D(+classes)], no graph to h."""
        if h.ndim < 1 or tuple(h.shape[1:]) != self.shape or h.shape[0] == 0:
            raise ValueError(f"h must be [N > 0, *{self.shape}], got {tuple(h.shape)}")
        flat = h.detach().to(torch.float32).reshape(h.shape[0], self.width)
        if not bool(torch.isfinite(flat).all()):
            raise ValueError("h contains NaN or infinity")
        flat = flat / max(self.h_rms, 1e-12) if self.h_rms > 0 else flat
        if not self.conditioned:
            return flat
        if y is None:
            raise ValueError("a conditioned synthesizer (cDNI) needs the labels y")
        labels = torch.as_tensor(y).detach()
        if (
            tuple(labels.shape) != (h.shape[0],)
            or labels.dtype.is_floating_point
            or labels.dtype == torch.bool
        ):
            raise ValueError(
                f"y must be integer labels [{h.shape[0]}], got {labels.dtype} {tuple(labels.shape)}"
            )
        if bool((labels < 0).any()) or bool((labels >= self.num_classes).any()):
            raise ValueError(f"labels must be in [0, {self.num_classes})")
        onehot = F.one_hot(labels.to(torch.int64), self.num_classes).to(torch.float32)
        return torch.cat([flat, onehot], dim=1)
