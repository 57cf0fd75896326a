"""A job with its own model (``train.model = "package.module:factory"``): checked at start by
what every runtime builds its processes with, one line naming ``train.model`` when it fails;
staged at the blocks it names; listed by ``edgestream models``."""

from __future__ import annotations

import itertools
import json
import sys

import pytest

from edgestream.job.config import ConfigError, load_config
from edgestream.job.sources import job_fleet_data
from edgestream.pipeline.simjob import mode_from_job, run_config_from_job, streams_from_job
from edgestream.pipeline.training import build_driver
from edgestream.pipeline.worker import check_training_config
from edgestream.trainers import simclock
from edgestream.trainers.stages import StageTrainer

USER_MODULE = '''
from collections import OrderedDict

from torch import nn


def build(input_shape, num_classes, hidden=16):
    return nn.Sequential(OrderedDict(
        stem=nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], hidden), nn.ReLU()),
        body=nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
        head=nn.Linear(hidden, num_classes),
    ))


def four_scores(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 4))


def picky(input_shape, num_classes):
    raise ValueError(f"picky wants (3, 16) windows, got {input_shape}")
'''

_counter = itertools.count()


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    name = f"job_nets_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def job(*overrides: str):
    return load_config(overrides=["train.enabled=true", "devices.count=2", "workers.count=2", *overrides], env={})


def test_a_jobs_own_model_passes_the_start_check_and_every_worker_builds_it(user_module):
    cfg = job(f"train.model={user_module}:build", "train.model_params=hidden=8")

    check_training_config(cfg)
    driver = build_driver(cfg, "w1", job_fleet_data(cfg))

    assert driver.trainer.model.stem[1].out_features == 8


@pytest.mark.parametrize(("attribute", "message"), [
    ("four_scores", "train.model='{module}:four_scores': the forward pass on a batch of the job's data of shape "
                    "(8, 64) returns shape (8, 4); the job has 10 classes: one score per class, shape (8, 10)"),
    ("picky", "train.model='{module}:picky': the factory raised ValueError: picky wants (3, 16) windows, got (64,)"),
    ("nosuch", "train.model='{module}:nosuch': module '{module}' has no attribute 'nosuch' (it defines: build, "
               "four_scores, picky)"),
])
def test_the_start_check_refuses_a_bad_model_in_one_line_naming_the_key(user_module, attribute, message):
    cfg = job(f"train.model={user_module}:{attribute}")

    with pytest.raises(ConfigError) as caught:
        check_training_config(cfg)

    assert str(caught.value) == message.format(module=user_module)


def test_the_model_params_are_named_when_the_factory_refuses_them(user_module):
    cfg = job(f"train.model={user_module}:build", "train.model_params=depth=3")

    with pytest.raises(ConfigError, match=r"^train.model='job_nets_\d+:build' with train.model_params=\{'depth': 3\}: "
                                          r"the factory raised TypeError: build\(\) got an unexpected keyword "
                                          r"argument 'depth'$"):
        check_training_config(cfg)


def test_the_simulated_clock_checks_the_model_the_same_way(user_module):
    cfg = job(f"train.model={user_module}:four_scores")

    with pytest.raises(ValueError, match=r"train.model='job_nets_\d+:four_scores': .* returns shape \(8, 4\)"):
        simclock.processes(mode_from_job(cfg), streams_from_job(cfg), run_config_from_job(cfg, time_budget_s=1.0))


def test_a_user_model_is_split_at_the_blocks_it_names(user_module):
    cfg = job(f"train.model={user_module}:build", "train.stages=stem", "train.strategy=dni")
    data = job_fleet_data(cfg)

    check_training_config(cfg)
    bottom, top = build_driver(cfg, "w0", data).trainer, build_driver(cfg, "w1", data).trainer

    assert isinstance(bottom, StageTrainer) and isinstance(top, StageTrainer)
    assert [name for name, _ in bottom.model.named_children()] == ["stem"]
    assert [name for name, _ in top.model.named_children()] == ["body", "head"]
    with pytest.raises(ConfigError, match=r"unknown boundary 'head'; valid boundaries: stem, body"):
        check_training_config(job(f"train.model={user_module}:build", "train.stages=head", "train.strategy=dni"))


def test_edgestream_models_lists_the_jobs_own_model_with_its_boundaries(user_module, capsys):
    from edgestream.cli.main import main

    assert main(["models", "--json", "--set", f"train.model={user_module}:build"]) == 0

    rows = {row["model"]: row for row in json.loads(capsys.readouterr().out)["models"]}
    own = rows[f"{user_module}:build"]
    assert own["parameters"] == 64 * 16 + 16 + 16 * 16 + 16 + 16 * 10 + 10
    assert [b["name"] for b in own["boundaries"]] == ["stem", "body"]
    assert "mlp" in rows
