"""Held-out evaluation: accuracy and mean loss of a model on numpy arrays, batched, no grad."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from edgestream.trainers.errors import BatchError


@dataclass(frozen=True)
class EvalResult:
    """Accuracy in [0, 1] and mean cross-entropy over ``count`` held-out samples."""

    accuracy: float
    loss: float
    count: int


def evaluate(
    model: nn.Module, features: np.ndarray, labels: np.ndarray, *, batch_size: int = 512
) -> EvalResult:
    """Evaluate ``model`` in eval mode (BatchNorm uses running stats); its mode is restored after."""
    features = np.asarray(features)
    labels = np.asarray(labels)
    if features.shape[0] == 0 or labels.shape != (features.shape[0],):
        raise BatchError(f"need [N, ...] features and [N] labels, got {features.shape} and {labels.shape}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0
    loss_sum = 0.0
    try:
        with torch.no_grad():
            for start in range(0, features.shape[0], batch_size):
                inputs = torch.from_numpy(
                    np.ascontiguousarray(features[start : start + batch_size], dtype=np.float32)
                ).to(device)
                targets = torch.from_numpy(labels[start : start + batch_size].astype(np.int64)).to(device)
                logits = model(inputs)
                loss_sum += float(F.cross_entropy(logits, targets, reduction="sum"))
                correct += int((logits.argmax(dim=1) == targets).sum())
    finally:
        model.train(was_training)
    count = int(features.shape[0])
    return EvalResult(accuracy=correct / count, loss=loss_sum / count, count=count)


def _logits(model: nn.Module, features: np.ndarray) -> torch.Tensor:
    """``model``'s outputs for ``features``, in eval mode without gradients (its mode restored after)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)).to(device))
    finally:
        model.train(was_training)


def predict(model: nn.Module, features: np.ndarray) -> np.ndarray:
    """The classes ``model`` predicts for ``features`` (int64 [N]), in eval mode, restored after."""
    return _logits(model, features).argmax(dim=1).cpu().numpy()


def predict_proba(model: nn.Module, features: np.ndarray) -> np.ndarray:
    """The class probabilities ``model`` gives ``features`` (softmax of its logits, float32
    ``[N, C]``), in eval mode, restored after; ``predict`` is their argmax."""
    logits = _logits(model, features)
    if logits.ndim != 2:
        raise BatchError(f"model returned logits of shape {tuple(logits.shape)}, expected [N, C]")
    return torch.softmax(logits.float(), dim=1).cpu().numpy()


#: Evaluations in a row that must reach the target for it to count (BENCHMARKS.md).
TARGET_HOLD_EVALUATIONS = 3


def time_to_target(
    timeline: Sequence[tuple[float, float]], target: float, hold: int = TARGET_HOLD_EVALUATIONS
) -> float | None:
    """Time to accuracy: the time of the first of ``hold`` consecutive evaluations >= ``target``.

    ``timeline`` is ``(time, accuracy)`` pairs in time order; None if the target is
    never held that long.
    """
    if hold < 1:
        raise ValueError(f"hold must be >= 1, got {hold}")
    run_start: float | None = None
    run_length = 0
    for t, accuracy in timeline:
        if accuracy >= target:
            if run_length == 0:
                run_start = t
            run_length += 1
            if run_length >= hold:
                return run_start
        else:
            run_length = 0
    return None
