"""A job config read into the simulated-clock runner's streams and run config."""

from __future__ import annotations

import numpy as np

from edgestream.job.config import JobConfig
from edgestream.job.sources import job_fleet_data
from edgestream.pipeline.simjob import mode_from_job, run_config_from_job, streams_from_job
from edgestream.trainers.simclock import DeviceBacklog, processes


def test_streams_and_run_config_come_from_a_job_config():
    cfg = JobConfig()
    cfg.devices.count, cfg.devices.rates_hz, cfg.devices.time_scale = 3, [10.0, 20.0], 2.0
    cfg.train.model, cfg.train.lr, cfg.train.target_accuracy = "digits_cnn", 0.2, 0.8

    streams = streams_from_job(cfg)
    config = run_config_from_job(cfg, time_budget_s=30.0)

    assert streams.devices == ("dev00", "dev01", "dev02")
    assert streams.rates_hz == (20.0, 40.0, 20.0)
    assert streams.profile == "poisson" and streams.seed == cfg.job.seed
    assert (
        len(streams.data.heldout) > 0
        and streams.message_interval_s == cfg.devices.message_interval_s
    )
    assert (config.model, config.lr, config.target_accuracy, config.time_budget_s) == (
        "digits_cnn",
        0.2,
        0.8,
        30.0,
    )
    assert config.max_message_bytes == cfg.kafka.max_message_bytes


def test_the_streams_are_the_data_the_live_simulators_stream():
    cfg = JobConfig()
    cfg.devices.count = 2

    streams = streams_from_job(cfg, profile="constant")
    live = job_fleet_data(cfg)

    assert streams.profile == "constant"
    assert streams.devices == tuple(live.shares)
    for device, rows in live.shares.items():
        assert np.array_equal(streams.data.shares[device], rows)
    assert np.array_equal(streams.data.heldout.labels, live.heldout.labels)


def test_the_mode_takes_the_jobs_batcher_buffer_and_step_cap():
    cfg = JobConfig()
    cfg.train.strategy, cfg.train.strategy_params = "ssp", ["staleness=3"]
    cfg.batcher.mode, cfg.batcher.window_s, cfg.batcher.max_batch = "window", 0.25, 48
    cfg.batcher.batch_size, cfg.batcher.window_overflow, cfg.batcher.max_batch_widen = 16, "truncate", 96
    cfg.buffer.policy, cfg.buffer.capacity = "truncate", 512
    cfg.train.max_step_batch = 200

    mode = mode_from_job(cfg)

    assert (mode.strategy, dict(mode.strategy_params)) == ("ssp", {"staleness": 3})
    assert (mode.batcher, mode.window_s, mode.max_batch, mode.batch_size) == ("window", 0.25, 48, 16)
    assert (mode.window_overflow, mode.max_batch_widen, mode.max_step_batch) == ("truncate", 96, 200)
    assert (mode.buffer_policy, mode.buffer_capacity) == ("truncate", 512)
    backlog = DeviceBacklog("dev00", mode)
    assert backlog.batcher.max_batch == 48 and backlog.buffer.capacity == 512
    config = run_config_from_job(cfg)
    drivers = processes(mode, streams_from_job(cfg), config)
    assert all(d.config.max_step_batch == 200 for d in drivers.values() if d.strategy.role == "worker")
    assert (config.member_timeout_s, config.checkpoint_every_steps) == (
        cfg.train.member_timeout_s, cfg.train.checkpoint_every_steps)


def test_backpressure_runs_as_persist_on_the_simulated_clock():
    cfg = JobConfig()
    cfg.buffer.policy = "backpressure"
    assert mode_from_job(cfg).buffer_policy == "persist"
