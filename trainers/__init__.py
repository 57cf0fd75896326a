"""Models, the local training step, sync strategies, checkpoints and evaluation (no Kafka)."""

from trainers.aggregation import sample_weights, weighted_mean
from trainers.evaluation import EvalResult, evaluate
from trainers.local import LocalTrainer, StepResult, limit_torch_threads
from trainers.messages import Outgoing, UpdateMessage
from trainers.models import build_model, model_names, register_model
from trainers.validation import TensorSpec, validate_update

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
