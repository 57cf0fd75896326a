"""A job file's settings as simulated-clock inputs (``trainers.simclock``).

The simulated-clock runner is Kafka-free and knows nothing of job files; these two
conveniences read a :class:`~job.config.JobConfig` into its ``StreamSet`` and
``RunConfig``, with the same data the live simulators stream (``job_fleet_data``) and the
job's ``TrainingPlan`` (every ``train.*`` setting the live run builds its processes from),
and its ``[batcher]`` and ``[buffer]`` into a ``Mode``.
"""

from __future__ import annotations

from typing import Any

from edgestream.job.config import JobConfig
from edgestream.job.plan import parse_params, training_plan
from edgestream.job.sources import job_fleet_data
from edgestream.trainers.simclock import Mode, RunConfig, StreamSet


def streams_from_job(cfg: JobConfig, *, profile: str = "poisson") -> StreamSet:
    """The job's devices, data, partition, rates (times ``time_scale``), interval and seed.

    ``profile`` defaults to Poisson arrivals whatever ``devices.profile`` says; pass
    ``cfg.devices.profile`` to use the job's own.
    """
    rates = tuple(cfg.devices.rate_of(i) for i in range(len(cfg.devices.device_ids())))
    return StreamSet(
        job_fleet_data(cfg), rates, profile, cfg.devices.message_interval_s, cfg.job.seed
    )


def run_config_from_job(cfg: JobConfig, **overrides: Any) -> RunConfig:
    """Model, lr, momentum, eval cadence, target, seed, torch threads, message cap, step-guard
    bounds and training plan of ``cfg`` (its codec, compression controller, ``max_abs_weight``,
    culprit search, injection, Byzantine workers and stage split reach every simulated process).

    ``overrides`` are ``RunConfig`` fields that win over the job's (e.g. ``time_budget_s``).
    """
    train = cfg.train
    values: dict[str, Any] = {
        "model": train.model,
        "model_options": parse_params(train.model_params),
        "lr": train.lr,
        "momentum": train.momentum,
        "seed": cfg.job.seed,
        "job": cfg.job.name,
        "eval_every_s": train.eval_every_s,
        "target_accuracy": train.target_accuracy or None,
        "torch_threads": train.torch_threads,
        "max_message_bytes": cfg.kafka.max_message_bytes,
        "max_grad_norm": train.max_grad_norm,
        "grad_norm_spike": train.grad_norm_spike,
        "plan": training_plan(cfg),
        "member_timeout_s": train.member_timeout_s,
        "checkpoint_every_steps": train.checkpoint_every_steps,
    }
    values.update(overrides)
    return RunConfig(**values)


def mode_from_job(cfg: JobConfig) -> Mode:
    """The job's strategy (and its parameters), batching (``[batcher]``), buffer (``[buffer]``)
    and step batch cap (``train.max_step_batch``) as a simulated-clock mode; the codec is
    left to the plan (``run_config_from_job``), so the job's own reaches the run.

    ``buffer.policy = "backpressure"`` becomes ``persist``: the simulated clock pauses no
    device (it reports the whole backlog as depth instead; docs/simclock.md, limits)."""
    batcher, buffer = cfg.batcher, cfg.buffer
    return Mode(
        name=cfg.train.strategy, strategy=cfg.train.strategy,
        strategy_params=parse_params(cfg.train.strategy_params),
        batcher=batcher.mode, batch_size=batcher.batch_size, window_s=batcher.window_s,
        max_batch=batcher.max_batch, window_overflow=batcher.window_overflow,
        max_batch_widen=batcher.max_batch_widen, max_step_batch=cfg.train.max_step_batch,
        buffer_policy="truncate" if buffer.policy == "truncate" else "persist",
        buffer_capacity=buffer.capacity,
    )
