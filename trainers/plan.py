"""What builds the training processes of one job: ``TrainingPlan``, read once from its config.

``job.plan.training_plan(cfg)`` translates a job's ``train`` / ``workers`` sections into a
plan; ``trainers.assembly`` builds every process (the live runtime's, the simulated clock's,
the test bus's) from it, so a ``train.*`` key honoured by one runtime is honoured by all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def _own(params: Mapping[str, Any]) -> dict[str, Any]:
    """A copy the plan owns (a plan is pickled to benchmark processes: no mapping proxies)."""
    return dict(params)


@dataclass(frozen=True)
class TrainingPlan:
    """Everything that builds the training processes of one job, read once from its config.

    Invariant: it holds no object with state (no model, no data): two processes built
    from one plan start from the same settings and, with the same seed, the same weights.
    ``attacks`` maps each Byzantine worker to its attack; ``stages`` non-empty splits the
    model, worker ``workers[k]`` holding stage ``k``.
    """

    job: str = "job"
    seed: int = 0
    #: Every configured worker, in order, and the ones the job starts with (the strategy's members).
    workers: tuple[str, ...] = ("w0",)
    initial_workers: tuple[str, ...] = ("w0",)
    # -- the strategy
    strategy: str = "bsp"
    strategy_params: Mapping[str, Any] = field(default_factory=dict)
    # -- the model and its optimiser
    model: str = "mlp"
    model_params: Mapping[str, Any] = field(default_factory=dict)
    lr: float = 0.1
    momentum: float = 0.9
    stages: tuple[str, ...] = ()
    # -- fault injection (workers.byzantine) and data injection (ScaDLES)
    attacks: Mapping[str, str] = field(default_factory=dict)
    attack_seed: int = 0
    injection_alpha: float = 0.0
    injection_beta: float = 0.0
    injection_pool_per_class: int = 20
    # -- the driver: limits, codec, compression controller, step guard
    max_message_bytes: int = 16 * 1024 * 1024
    max_step_batch: int = 256
    codec: str = "dense"
    codec_params: Mapping[str, Any] = field(default_factory=dict)
    error_feedback: bool = True
    controller: str = "none"
    controller_params: Mapping[str, Any] = field(default_factory=dict)
    max_grad_norm: float = 1.0e4
    grad_norm_spike: float = 100.0
    max_abs_weight: float = 1.0e6
    culprit_max_probes: int = 128
    observed_margin: float | None = None
    observed_warmup: int = 512
    # -- checkpoints
    checkpoint_every_steps: int = 20
    checkpoint_keep: int = 3

    def __post_init__(self) -> None:
        for name in ("strategy_params", "model_params", "codec_params", "controller_params", "attacks"):
            object.__setattr__(self, name, _own(getattr(self, name)))
        object.__setattr__(self, "workers", tuple(self.workers))
        object.__setattr__(self, "initial_workers", tuple(self.initial_workers))
        object.__setattr__(self, "stages", tuple(self.stages))

    def attack_of(self, worker: str) -> str | None:
        """The attack ``worker`` makes (``workers.byzantine``), None for an honest process."""
        return self.attacks.get(worker)

    @property
    def injects(self) -> bool:
        """Whether workers add injected samples to their batches (``train.injection_*``)."""
        return self.injection_alpha > 0 and self.injection_beta > 0
