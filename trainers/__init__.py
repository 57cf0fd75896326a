"""Models, the local training step, sync strategies, checkpoints and evaluation (no Kafka).

The names below are loaded on first use (PEP 562), so a torch-free module of this package
(``trainers.observations``, read by ``monitoring.metrics``) can be imported without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainers.aggregation import sample_weights, weighted_mean
    from trainers.evaluation import EvalResult, evaluate
    from trainers.local import LocalTrainer, StepResult, limit_torch_threads
    from trainers.messages import Outgoing, UpdateMessage
    from trainers.models import build_model, model_names, register_model
    from trainers.validation import TensorSpec, validate_update

#: Each re-exported name and the module that defines it.
_HOME = {
    "sample_weights": "trainers.aggregation",
    "weighted_mean": "trainers.aggregation",
    "EvalResult": "trainers.evaluation",
    "evaluate": "trainers.evaluation",
    "LocalTrainer": "trainers.local",
    "StepResult": "trainers.local",
    "limit_torch_threads": "trainers.local",
    "Outgoing": "trainers.messages",
    "UpdateMessage": "trainers.messages",
    "build_model": "trainers.models",
    "model_names": "trainers.models",
    "register_model": "trainers.models",
    "TensorSpec": "trainers.validation",
    "validate_update": "trainers.validation",
}

__all__ = [
    "EvalResult",
    "LocalTrainer",
    "Outgoing",
    "StepResult",
    "TensorSpec",
    "UpdateMessage",
    "build_model",
    "evaluate",
    "limit_torch_threads",
    "model_names",
    "register_model",
    "sample_weights",
    "validate_update",
    "weighted_mean",
]


def __getattr__(name: str) -> Any:
    try:
        home = _HOME[name]
    except KeyError:
        raise AttributeError(f"module 'trainers' has no attribute {name!r}") from None
    return getattr(import_module(home), name)
