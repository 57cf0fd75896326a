"""A job config read into the simulated-clock runner's streams and run config."""

from __future__ import annotations

import numpy as np

from edgestream.job.config import JobConfig
from edgestream.job.sources import job_fleet_data
from edgestream.pipeline.simjob import run_config_from_job, streams_from_job


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
