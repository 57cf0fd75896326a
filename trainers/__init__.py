"""Models, the local training step, sync strategies, checkpoints and evaluation (no Kafka).

The names below are loaded on first use (PEP 562), so a torch-free module of this package
(``trainers.observations``, read by ``monitoring.metrics``) can be imported without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgestream.trainers.aggregation import sample_weights, weighted_mean
    from edgestream.trainers.evaluation import EvalResult, evaluate
    from edgestream.trainers.local import LocalTrainer, StepResult, limit_torch_threads
    from edgestream.trainers.messages import Outgoing, UpdateMessage
    from edgestream.trainers.models import build_model, model_names, register_model
    from edgestream.trainers.validation import TensorSpec, validate_update

#: Each re-exported name and the module that defines it.
_HOME = {
    "sample_weights": "edgestream.trainers.aggregation",
    "weighted_mean": "edgestream.trainers.aggregation",
    "EvalResult": "edgestream.trainers.evaluation",
    "evaluate": "edgestream.trainers.evaluation",
    "LocalTrainer": "edgestream.trainers.local",
    "StepResult": "edgestream.trainers.local",
    "limit_torch_threads": "edgestream.trainers.local",
    "Outgoing": "edgestream.trainers.messages",
    "UpdateMessage": "edgestream.trainers.messages",
    "build_model": "edgestream.trainers.models",
    "model_names": "edgestream.trainers.models",
    "register_model": "edgestream.trainers.models",
    "TensorSpec": "edgestream.trainers.validation",
    "validate_update": "edgestream.trainers.validation",
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
