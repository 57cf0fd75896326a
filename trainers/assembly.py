"""Building one training process (trainer, strategy, driver) from a ``trainers.plan.TrainingPlan``.

The live runtime (``pipeline.training``), the simulated clock (``trainers.simclock``) and
the test bus (``tests/unit/trainers/fakes.py``) all build their processes here; only
what differs per runtime is passed in (the process's name, role and members, the data
it trains on, a decode cache shared by simulated workers, a test's own injector).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from edgestream.trainers.byzantine import byzantine
from edgestream.trainers.driver import DecodeMemo, DriverConfig, TrainingDriver
from edgestream.trainers.errors import ModelConfigError, TrainerError
from edgestream.trainers.injection import DataInjector, shared_pool
from edgestream.trainers.local import LocalTrainer
from edgestream.trainers.models import CHECK_ROWS, build_model, check_model
from edgestream.trainers.stages import stage_trainer
from edgestream.trainers.strategies import StrategyContext, create, stage_split_names

if TYPE_CHECKING:
    from edgestream.streams.simulator import FleetData
    from edgestream.trainers.plan import TrainingPlan

Injector = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, int]]
"""``(features, labels) -> (features, labels, injected samples)``, as ``TrainingDriver`` takes it."""


class AssemblyError(TrainerError, ValueError):
    """A process cannot be built from the plan; the message names the ``train.*`` key to change."""


def driver_config(plan: TrainingPlan) -> DriverConfig:
    """The driver's settings: limits, codec, compression controller, step guard, observed range."""
    return DriverConfig(
        job=plan.job, max_message_bytes=plan.max_message_bytes, max_step_batch=plan.max_step_batch,
        codec=plan.codec, codec_params=dict(plan.codec_params), error_feedback=plan.error_feedback,
        max_grad_norm=plan.max_grad_norm, grad_norm_spike=plan.grad_norm_spike,
        max_abs_weight=plan.max_abs_weight, culprit_max_probes=plan.culprit_max_probes,
        observed_margin=plan.observed_margin, observed_warmup=plan.observed_warmup,
        controller=plan.controller, controller_params=dict(plan.controller_params),
    )


def build_trainer(plan: TrainingPlan, name: str, data: FleetData) -> LocalTrainer:
    """The model of process ``name``: the whole model, or its stage (``train.stages``).

    Every process of every runtime builds its model here, so every one checks it here, once,
    before it trains: the model builds for the job's input shape and classes, and on a batch
    of the job's streamed data (never the held-out split) returns one finite score per class
    (``trainers.models.check_model``). ``AssemblyError`` naming ``train.model`` otherwise."""
    try:
        model = build_model(plan.model, data.feature_shape, data.num_classes, seed=plan.seed,
                            standardize=data.input_stats, **dict(plan.model_params))
        sample = data.train.features[:CHECK_ROWS]
        if len(sample) == 0:  # no streamed rows to take: the shape alone is checked
            sample = np.zeros((2, *data.feature_shape), dtype=np.float32)
        check_model(model, sample, data.num_classes)
    except ModelConfigError as exc:
        given = f" with train.model_params={dict(plan.model_params)}" if plan.model_params else ""
        raise AssemblyError(f"train.model={plan.model!r}{given}: {exc}") from None
    if not plan.stages:
        return LocalTrainer(model, lr=plan.lr, momentum=plan.momentum)
    if plan.strategy not in stage_split_names():
        raise AssemblyError(f"train.stages splits the model; train.strategy={plan.strategy!r} trains whole "
                            f"models: use one of {', '.join(stage_split_names())}")
    try:
        return stage_trainer(model, list(plan.stages), plan.workers.index(name), data.feature_shape,
                             data.num_classes, lr=plan.lr, momentum=plan.momentum)
    except ModelConfigError as exc:
        raise AssemblyError(f"train.stages = {list(plan.stages)} for train.model={plan.model!r}: {exc}") from None


def plan_injector(plan: TrainingPlan, name: str, data: FleetData) -> Injector | None:
    """Worker ``name``'s ScaDLES data injection (``train.injection_*``), None when off."""
    if not plan.injects:
        return None
    pool = shared_pool(data.train.features, data.train.labels, plan.injection_pool_per_class, seed=plan.seed)
    injection = DataInjector(pool, data.num_classes, alpha=plan.injection_alpha, beta=plan.injection_beta,
                             seed=plan.seed * 7919 + name_index(name))

    def injector(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        x, y, done = injection.augment(x, y)
        return x, y, done.samples

    return injector


def build_driver(
    plan: TrainingPlan,
    name: str,
    data: FleetData | None,
    *,
    role: str = "worker",
    joining: bool = False,
    members: Sequence[str] | None = None,
    injector: Injector | None = None,
    shared_decodes: DecodeMemo | None = None,
    trainer: LocalTrainer | None = None,
) -> TrainingDriver:
    """The trainer, strategy (Byzantine when ``workers.byzantine`` names ``name``), data
    injector and driver of process ``name`` (no I/O).

    ``members``: the strategy's initial members (default the plan's initial workers, less
    ``name`` when ``joining``: it enters a running job and must first receive the model).
    ``injector`` replaces the plan's data injection (a simulated mode's own hook);
    ``trainer`` replaces the model the plan builds (a test's own). Raises ``AssemblyError``
    naming the key when the model, strategy or codec cannot be built (its cause: what they
    raised). ``data`` (what the process trains on) may be None only with ``trainer`` given
    and the plan's data injection off.
    """
    if trainer is None:
        if data is None:
            raise AssemblyError(f"{name}: no data to build train.model={plan.model!r} for (pass data or a trainer)")
        trainer = build_trainer(plan, name, data)
    if members is None:
        members = [w for w in plan.initial_workers if not (joining and w == name)]
    params: dict[str, Any] = dict(plan.strategy_params)
    try:
        strategy = create(
            plan.strategy,
            StrategyContext(name, trainer, role=role, members=tuple(members), joining=joining),  # type: ignore[arg-type]
            **params,
        )
    except Exception as exc:
        raise AssemblyError(f"train.strategy={plan.strategy!r}: {exc}") from exc
    attack = plan.attack_of(name) if role == "worker" else None
    if attack is not None:  # fault injection (workers.byzantine): corrupts what it sends
        strategy = byzantine(strategy, attack, seed=plan.attack_seed)
    if injector is None and role == "worker" and data is not None:
        injector = plan_injector(plan, name, data)
    try:
        return TrainingDriver(name, trainer, strategy, driver_config(plan), injector=injector,
                              shared_decodes=shared_decodes)
    except Exception as exc:
        raise AssemblyError(f"train.codec={plan.codec!r} with train.strategy={plan.strategy!r}: {exc}") from exc


def name_index(name: str) -> int:
    """A stable small integer from a process name (seeds per-worker randomness)."""
    return sum((i + 1) * ord(ch) for i, ch in enumerate(name))
