"""A stage-split job (``train.stages``): config checks, device assignment, the driver it builds."""

from __future__ import annotations

import pytest
from torch import nn

from edgestream.job.config import ConfigError, load_config
from edgestream.job.sources import job_fleet_data
from edgestream.pipeline.simjob import run_config_from_job
from edgestream.pipeline.training import build_driver
from edgestream.trainers.stages import StageTrainer

SPLIT = ["train.model=conv8", "train.stages=block1,fc1", "workers.count=3"]


def job(*overrides: str):
    return load_config(overrides=list(overrides), env={})


@pytest.fixture(scope="module")
def data():
    return job_fleet_data(job(*SPLIT, "train.strategy=dni"))


def test_stages_need_one_worker_each_and_the_error_names_the_count_to_set():
    with pytest.raises(ConfigError, match=r"set workers.count = 3 \(it is 2\)"):
        job("train.model=conv8", "train.stages=block1,fc1", "workers.count=2")
    with pytest.raises(ConfigError, match="set workers.count = 2"):
        job("train.model=conv8", "train.stages=block1", "workers.count=4")


def test_stages_refuse_initial_workers():
    with pytest.raises(ConfigError, match="train.initial_workers cannot be used with train.stages"):
        job(*SPLIT, "train.initial_workers=w0,w1")


def test_the_first_stage_reads_every_device_and_the_others_none():
    cfg = job(*SPLIT, "train.strategy=dni")

    assert cfg.devices_of("w0") == cfg.devices.device_ids() and len(cfg.devices_of("w0")) == cfg.devices.count
    assert cfg.devices_of("w1") == [] and cfg.devices_of("w2") == []
    whole = job("workers.count=3")
    assert whole.devices_of("w1") and whole.devices_of("w0") != whole.devices.device_ids()


def test_a_whole_model_strategy_on_stages_is_refused_naming_the_stage_split_ones(data):
    cfg = job(*SPLIT, "train.strategy=bsp")

    with pytest.raises(ConfigError, match="train.strategy='bsp'") as caught:
        build_driver(cfg, "w1", data)
    for name in ("pipeline_bp", "dni", "cdni"):
        assert name in str(caught.value)


def test_a_stage_split_strategy_without_stages_is_refused(data):
    cfg = job("train.model=conv8", "workers.count=3", "train.strategy=dni")

    with pytest.raises(ConfigError, match="train.stages"):
        build_driver(cfg, "w0", data)


def test_an_unknown_boundary_is_refused_listing_the_valid_ones(data):
    cfg = job("train.model=conv8", "train.stages=block1,block9", "workers.count=3", "train.strategy=dni")

    with pytest.raises(ConfigError, match="block9.*valid boundaries: block1, block2, block3, fc1"):
        build_driver(cfg, "w0", data)


@pytest.mark.parametrize("strategy", ["pipeline_bp", "dni", "cdni"])
def test_each_worker_gets_its_stage(data, strategy):
    cfg = job(*SPLIT, f"train.strategy={strategy}")

    drivers = [build_driver(cfg, name, data) for name in cfg.worker_names()]

    assert [d.trainer.stage for d in drivers] == [0, 1, 2]  # type: ignore[attr-defined]
    assert all(isinstance(d.trainer, StageTrainer) and d.trainer.stages == 3 for d in drivers)
    assert [d.strategy.stage for d in drivers] == [0, 1, 2]  # type: ignore[attr-defined]


def test_model_params_reach_the_model(data):
    plain = build_driver(job(*SPLIT, "train.strategy=dni"), "w1", data)
    normed = build_driver(job(*SPLIT, "train.strategy=dni", "train.model_params=norm=batch"), "w1", data)

    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in plain.trainer.model.modules())
    assert any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in normed.trainer.model.modules())
    whole = build_driver(job("train.model=conv8", "train.model_params=norm=batch"), "w0", data)
    assert any(isinstance(m, nn.BatchNorm2d) for m in whole.trainer.model.modules())


def test_the_simulated_clock_takes_a_stage_split_job_with_its_stages():
    config = run_config_from_job(job(*SPLIT, "train.strategy=dni"))

    assert config.plan is not None
    assert (config.plan.strategy, config.plan.stages, config.model) == ("dni", ("block1", "fc1"), "conv8")
    assert run_config_from_job(job("train.model=conv8")).model == "conv8"
