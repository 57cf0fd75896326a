"""One assembly (trainers/assembly.py): the live runtime and the simulated clock build every
process from the same ``trainers.plan.TrainingPlan``; the simulated clock honours the job's
``train.*`` keys and runs the stage-split strategies' queued steps."""

from __future__ import annotations

import numpy as np
import pytest

from edgestream.job.config import load_config
from edgestream.job.plan import training_plan
from edgestream.job.sources import job_fleet_data
from edgestream.pipeline.simjob import mode_from_job, run_config_from_job, streams_from_job
from edgestream.pipeline.training import build_driver
from edgestream.trainers import simclock, strategies
from edgestream.trainers.strategies import stage_split_names

#: A two-stage MLP (Flatten, Linear, ReLU | Linear): one device and worker per stage.
STAGED = ["train.model=mlp", "train.stages=2", "devices.count=2", "workers.count=2"]
#: Settings the live run has always honoured and the simulated clock used to drop or lack.
KEYS = ["train.max_grad_norm=123.0", "train.grad_norm_spike=50.0", "train.max_abs_weight=5e5",
        "train.culprit_max_probes=7", "train.codec=topk", "train.codec_params=ratio=0.1"]


def job_for(strategy: str, *extra: str):
    split = STAGED if strategy in stage_split_names() else []
    return load_config(overrides=["train.enabled=true", f"train.strategy={strategy}", "devices.count=3", "workers.count=3",
                                  "job.seed=5", *split, *KEYS, *extra], env={})


def settings(driver) -> dict:
    """What a process was built with: driver config, strategy, members, optimiser, initial weights."""
    trainer = driver.trainer
    return {
        "config": driver.config,
        "strategy": (type(driver.strategy), driver.strategy.name, driver.strategy.role),
        "lr": [g["lr"] for g in trainer.optimizer.param_groups],
        "momentum": [g["momentum"] for g in trainer.optimizer.param_groups],
        "weights": {k: v.tolist() for k, v in trainer.get_parameters().items()},
        "injects": driver.injector is not None,
    }


@pytest.mark.parametrize("strategy", strategies.names())
def test_live_and_simulated_processes_are_built_from_one_plan_with_equal_settings(strategy):
    cfg = job_for(strategy)
    data = job_fleet_data(cfg)
    config = run_config_from_job(cfg, time_budget_s=1.0)

    simulated = simclock.processes(mode_from_job(cfg), streams_from_job(cfg), config)
    live = {name: build_driver(cfg, name, data) for name in cfg.worker_names()}
    if "server" in strategies.roles(strategy):
        live["server"] = build_driver(cfg, "server", data, role="server")

    assert config.plan == training_plan(cfg)
    assert sorted(simulated) == sorted(live)
    for name, driver in live.items():
        assert settings(simulated[name]) == settings(driver), name
    assert live["w0"].config.max_grad_norm == 123.0 and live["w0"].config.codec == "topk"


def test_the_plan_reads_every_setting_once():
    cfg = job_for("bsp", "train.compression_controller=accordion", "train.injection_alpha=0.2",
                  "train.injection_beta=0.1", "workers.byzantine=w2", "train.initial_workers=w0,w2")

    plan = training_plan(cfg)

    assert (plan.job, plan.seed, plan.workers, plan.initial_workers) == (cfg.job.name, 5, ("w0", "w1", "w2"),
                                                                       ("w0", "w2"))
    assert (plan.codec, plan.codec_params, plan.controller) == ("topk", {"ratio": 0.1}, "accordion")
    assert (plan.max_grad_norm, plan.grad_norm_spike, plan.max_abs_weight, plan.culprit_max_probes) == (
        123.0, 50.0, 5e5, 7)
    assert plan.attacks == {"w2": cfg.workers.attack} and plan.attack_of("w0") is None
    assert plan.injects


def test_the_compression_controller_byzantine_worker_and_injection_reach_the_simulated_clock():
    cfg = job_for("bsp", "train.compression_controller=accordion", "train.injection_alpha=0.2",
                  "train.injection_beta=0.1", "workers.byzantine=w2")

    drivers = simclock.processes(mode_from_job(cfg), streams_from_job(cfg), run_config_from_job(cfg))

    assert {name: d.config.controller for name, d in drivers.items()} == dict.fromkeys(drivers, "accordion")
    assert type(drivers["w2"].strategy).__name__ == "ByzantineStrategy"
    assert type(drivers["w0"].strategy).__name__ != "ByzantineStrategy"
    assert all(drivers[w].injector is not None for w in ("w0", "w1", "w2"))


def test_max_grad_norm_reaches_the_simulated_run():
    """A bound no gradient stays under rejects every step; the job's default bound none."""
    rejecting = job_for("bsp", "train.max_grad_norm=1e-9", "train.codec=dense", "train.codec_params=")
    plain = job_for("bsp", "train.codec=dense", "train.codec_params=")

    reports = {}
    for name, cfg in (("rejecting", rejecting), ("plain", plain)):
        reports[name] = simclock.run(mode_from_job(cfg), streams_from_job(cfg), None,
                                     run_config_from_job(cfg, time_budget_s=4.0, target_accuracy=None))

    assert reports["rejecting"].rejected_steps > 0 and reports["rejecting"].local_steps == 0
    assert reports["plain"].rejected_steps == 0 and reports["plain"].local_steps > 0


def test_the_jobs_codec_reaches_the_simulated_run():
    """The mode names no codec: the job's (``train.codec``) compresses the gradient messages."""
    compressed = job_for("asp")
    dense = job_for("asp", "train.codec=dense", "train.codec_params=")

    reports = {}
    for name, cfg in (("compressed", compressed), ("dense", dense)):
        reports[name] = simclock.run(mode_from_job(cfg), streams_from_job(cfg), None,
                                     run_config_from_job(cfg, time_budget_s=4.0, target_accuracy=None))

    assert reports["compressed"].gradient_messages > 0
    assert reports["compressed"].compressed_messages == reports["compressed"].gradient_messages
    assert reports["dense"].gradient_messages > 0 and reports["dense"].compressed_messages == 0


@pytest.mark.parametrize("strategy", stage_split_names())
def test_stage_split_strategies_make_progress_on_the_simulated_clock(strategy):
    cfg = job_for(strategy, "train.codec=dense", "train.codec_params=", "train.lr=0.05")

    report = simclock.run(mode_from_job(cfg), streams_from_job(cfg), None,
                          run_config_from_job(cfg, time_budget_s=30.0, eval_every_s=2.0, target_accuracy=None))

    steps = {p.name: p.local_steps for p in report.processes}
    assert set(steps) == {"w0", "w1"}
    assert all(n > 0 for n in steps.values()), steps  # the later stages ran their queued steps
    losses = [loss for _, loss in report.loss_timeline]
    assert len(losses) >= 10 and np.isfinite(losses).all()
    assert np.mean(losses[-3:]) < losses[0], losses
