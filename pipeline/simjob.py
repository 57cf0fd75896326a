"""A job file's settings as simulated-clock inputs (``trainers.simclock``).

The simulated-clock runner is Kafka-free and knows nothing of job files; these two
conveniences read a :class:`~job.config.JobConfig` into its ``StreamSet`` and
``RunConfig``, with the same data the live simulators stream (``job_fleet_data``).
"""

from __future__ import annotations

from typing import Any

from job.config import ConfigError, JobConfig
from job.sources import job_fleet_data
from pipeline.training import parse_params
from trainers.simclock import RunConfig, StreamSet


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
    """Model, lr, momentum, eval cadence, target, seed, torch threads and message cap of ``cfg``.

    ``overrides`` are ``RunConfig`` fields that win over the job's (e.g. ``time_budget_s``).
    """
    train = cfg.train
    if train.stages:
        raise ConfigError("the simulated clock runs whole-model strategies; a stage-split job (train.stages) "
                          "runs on the broker: edgestream run")
    values: dict[str, Any] = {
        "model": train.model,
        "model_options": parse_params(train.model_params),
        "lr": train.lr,
        "momentum": train.momentum,
        "seed": cfg.job.seed,
        "eval_every_s": train.eval_every_s,
        "target_accuracy": train.target_accuracy or None,
        "torch_threads": train.torch_threads,
        "max_message_bytes": cfg.kafka.max_message_bytes,
    }
    values.update(overrides)
    return RunConfig(**values)
