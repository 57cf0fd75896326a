"""The one translation of a job's ``train`` / ``workers`` sections into a ``TrainingPlan``.

``training_plan(cfg)`` reads a job config once; ``trainers.assembly`` builds every process
(the live runtime's, the simulated clock's, the test bus's) from the plan
(``trainers.plan.TrainingPlan``), so a ``train.*`` key honoured by one runtime is honoured
by all of them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from edgestream.trainers.plan import TrainingPlan

if TYPE_CHECKING:
    from edgestream.job.config import JobConfig

__all__ = ["TrainingPlan", "parse_params", "training_plan"]


def parse_params(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``["ratio=0.01", "rank=4"]`` -> ``{"ratio": 0.01, "rank": 4}`` (JSON values, else strings)."""
    out: dict[str, Any] = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw.strip()
    return out


def training_plan(cfg: JobConfig) -> TrainingPlan:
    """The plan of job ``cfg`` (a validated ``JobConfig``)."""
    train, workers = cfg.train, cfg.workers
    names = tuple(cfg.worker_names())
    wanted = set(train.initial_workers)
    return TrainingPlan(
        job=cfg.job.name,
        seed=cfg.job.seed,
        workers=names,
        initial_workers=tuple(w for w in names if not wanted or w in wanted),
        strategy=train.strategy,
        strategy_params=parse_params(train.strategy_params),
        model=train.model,
        model_params=parse_params(train.model_params),
        lr=train.lr,
        momentum=train.momentum,
        stages=tuple(train.stages),
        attacks={w: a for w in names if (a := workers.attack_of(w)) is not None},
        attack_seed=workers.attack_seed,
        injection_alpha=train.injection_alpha,
        injection_beta=train.injection_beta,
        injection_pool_per_class=train.injection_pool_per_class,
        max_message_bytes=cfg.kafka.max_message_bytes,
        max_step_batch=train.max_step_batch,
        codec=train.codec,
        codec_params=parse_params(train.codec_params),
        error_feedback=train.error_feedback,
        controller=train.compression_controller,
        controller_params=parse_params(train.controller_params),
        max_grad_norm=train.max_grad_norm,
        grad_norm_spike=train.grad_norm_spike,
        max_abs_weight=train.max_abs_weight,
        culprit_max_probes=train.culprit_max_probes,
        observed_margin=(cfg.data.value_margin if cfg.data.value_range.strip().lower() == "none"
                         and cfg.data.observed_warmup > 0 else None),
        observed_warmup=max(1, cfg.data.observed_warmup),
        checkpoint_every_steps=train.checkpoint_every_steps,
        checkpoint_keep=train.checkpoint_keep,
    )

