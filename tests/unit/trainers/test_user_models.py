"""The user's own model, ``train.model = "package.module:factory"``: resolution, the checks a
job makes on it (each failure one line naming what failed), and that it is built like a
registered model (seeded init, input standardisation, stage boundaries)."""

from __future__ import annotations

import itertools
import sys

import numpy as np
import pytest
import torch

from edgestream.trainers.errors import ModelConfigError
from edgestream.trainers.local import LocalTrainer
from edgestream.trainers.models import build_model, check_model, is_module_path, resolve_model
from edgestream.trainers.stages import boundary_names, split_model

#: The user's module: factories good and bad, written to a folder put on sys.path.
USER_MODULE = '''
from collections import OrderedDict

import torch
from torch import nn

IMPORTED_RANDOM = torch.rand(1)  # a draw at import time must not change the seeded init


def build(input_shape, num_classes, hidden=16):
    """Stage boundaries: stem, body (named blocks of an nn.Sequential)."""
    features = 1
    for d in input_shape:
        features *= d
    return nn.Sequential(OrderedDict(
        stem=nn.Sequential(nn.Flatten(), nn.Linear(features, hidden), nn.ReLU()),
        body=nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
        head=nn.Linear(hidden, num_classes),
    ))


class Nets:
    @staticmethod
    def tiny(input_shape, num_classes):
        return nn.Linear(input_shape[-1], num_classes)


def four_scores(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 4))


def raises(input_shape, num_classes):
    raise ValueError("width must be even\\nsecond line")


def not_a_module(input_shape, num_classes):
    return {"weights": 1}


class _NaN(nn.Module):
    def __init__(self, features, num_classes):
        super().__init__()
        self.linear = nn.Linear(features, num_classes)

    def forward(self, x):
        return self.linear(x.flatten(1)) * float("nan")


def nan_scores(input_shape, num_classes):
    return _NaN(input_shape[0], num_classes)


def channels_time(input_shape, num_classes):
    """Takes [C, T] windows: a 1-D conv over time (any input shape builds)."""
    return nn.Sequential(nn.Conv1d(input_shape[0], 4, 3), nn.AdaptiveAvgPool1d(1), nn.Flatten(),
                         nn.Linear(4, num_classes))


class _Pair(nn.Module):
    def __init__(self, features, num_classes):
        super().__init__()
        self.linear = nn.Linear(features, num_classes)

    def forward(self, x):
        return self.linear(x), x


def pair(input_shape, num_classes):
    return _Pair(input_shape[0], num_classes)


def frozen(input_shape, num_classes):
    model = nn.Linear(input_shape[0], num_classes)
    model.requires_grad_(False)
    return model


WIDTH = 3
'''

_counter = itertools.count()


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """The name of a fresh module holding ``USER_MODULE`` (unique per test: no import cache)."""
    name = f"user_nets_{next(_counter)}_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def digits_like(rows: int = 8, features: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.0, 16.0, size=(rows, features)).astype(np.float32)


def test_a_module_path_names_the_factory_and_builds_a_model_like_a_registered_one(user_module):
    assert is_module_path(f"{user_module}:build") and not is_module_path("mlp")
    assert callable(resolve_model(f"{user_module}:Nets.tiny"))

    model = build_model(f"{user_module}:build", (64,), 10, seed=3, hidden=8)

    assert model(torch.zeros(5, 64)).shape == (5, 10)
    assert model.stem[1].out_features == 8  # train.model_params reach the factory


def test_the_init_is_seeded_like_a_registered_models_and_leaves_the_global_rng_alone(user_module):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)

    first = LocalTrainer(build_model(f"{user_module}:build", (64,), 10, seed=7))
    second = LocalTrainer(build_model(f"{user_module}:build", (64,), 10, seed=7))
    other = LocalTrainer(build_model(f"{user_module}:build", (64,), 10, seed=8))

    assert torch.equal(torch.rand(3), expected)
    assert first.parameter_digest() == second.parameter_digest() != other.parameter_digest()


def test_a_user_model_gets_the_jobs_input_standardisation(user_module):
    x = digits_like()
    mean, std = x.mean(axis=0), x.std(axis=0) + 1.0
    plain = build_model(f"{user_module}:build", (64,), 10, seed=1)
    standardized = build_model(f"{user_module}:build", (64,), 10, seed=1, standardize=(mean, std))

    assert standardized.input_standardizer is not None
    assert set(plain.state_dict()) == set(standardized.state_dict())
    expected = plain(torch.as_tensor((x - mean) / std))
    assert torch.allclose(standardized(torch.as_tensor(x)), expected, atol=1e-5)


def test_a_user_model_that_names_its_blocks_can_be_cut_there(user_module):
    model = build_model(f"{user_module}:build", (64,), 10, seed=0)

    assert boundary_names(model) == ["stem", "body"]
    stages = split_model(model, ["stem"])
    x = torch.as_tensor(digits_like())
    assert torch.equal(stages[1](stages[0](x)), model(x))


@pytest.mark.parametrize(("attribute", "shape", "message"), [
    ("four_scores", (64,), "the forward pass on a batch of the job's data of shape (8, 64) returns shape (8, 4); "
                           "the job has 10 classes: one score per class, shape (8, 10)"),
    ("nan_scores", (64,), "the forward pass on a batch of the job's data of shape (8, 64) returns non-finite "
                          "scores (NaN or infinity)"),
    # the wrong input rank: a model for [C, T] windows given the job's flat features
    ("channels_time", (64,), "the forward pass on a batch of the job's data of shape (8, 64) raised RuntimeError: "),
    ("pair", (64,), "the forward pass on a batch of the job's data of shape (8, 64) returns a tuple, not a tensor "
                    "of class scores [N, 10]"),
    ("frozen", (64,), "the model (Linear) has no trainable parameters"),
])
def test_check_model_names_what_is_wrong_with_the_output_in_one_line(user_module, attribute, shape, message):
    model = build_model(f"{user_module}:{attribute}", shape, 10, seed=0)

    with pytest.raises(ModelConfigError) as caught:
        check_model(model, digits_like(), 10)

    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("target", "message"), [
    ("no_such_package_xyz.nets:build", "module 'no_such_package_xyz.nets' is not found (No module named "
                                       "'no_such_package_xyz'): install the package that holds it, or put its "
                                       "folder on PYTHONPATH"),
    ("{module}:nosuch", "module '{module}' has no attribute 'nosuch' (it defines: "),
    ("{module}:Nets.nosuch", "<class '{module}.Nets'> has no attribute 'nosuch'"),
    ("{module}:WIDTH", "'WIDTH' in module '{module}' is an object of type int, not callable: name a function or "
                       "class, factory(input_shape, num_classes, **options) -> torch.nn.Module"),
    ("{module}:raises", "the factory raised ValueError: width must be even"),
    ("{module}:not_a_module", "the factory returned a dict, not a torch.nn.Module"),
    ("{module}:", "'{module}:' is not \"package.module:factory\""),
    ("not a module:build", "'not a module:build' is not \"package.module:factory\""),
])
def test_each_way_the_factory_cannot_be_had_is_one_line(user_module, target, message):
    with pytest.raises(ModelConfigError) as caught:
        build_model(target.format(module=user_module), (64,), 10, seed=0)

    assert str(caught.value).startswith(message.format(module=user_module)), str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_module_that_fails_while_it_imports_is_named_with_its_error(tmp_path, monkeypatch):
    (tmp_path / "broken_user_nets.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "crashing_user_nets.py").write_text("raise RuntimeError('bad config file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    with pytest.raises(ModelConfigError, match=r"^importing module 'broken_user_nets' raised ModuleNotFoundError: "
                                                r"No module named 'no_such_dependency_xyz'$"):
        build_model("broken_user_nets:build", (64,), 10, seed=0)
    with pytest.raises(ModelConfigError, match=r"^importing module 'crashing_user_nets' raised RuntimeError: "
                                                r"bad config file$"):
        build_model("crashing_user_nets:build", (64,), 10, seed=0)


def test_an_unknown_registered_name_says_how_to_name_your_own():
    with pytest.raises(ModelConfigError, match=r"unknown model 'resnet9000'; registered: .*mlp.*; or your own as "
                                                r"\"package.module:factory\""):
        build_model("resnet9000", (64,), 10, seed=0)


def test_the_check_changes_nothing_in_the_model(user_module):
    model = build_model("digits_cnn", (64,), 10, seed=0)  # BatchNorm: running statistics
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)

    check_model(model, digits_like(), 10)

    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.rand(2), expected)


def test_every_registered_model_passes_the_check_on_data_it_takes():
    for name, shape in (("mlp", (64,)), ("cnn1d", (3, 20)), ("digits_cnn", (64,)), ("conv8", (64,)),
                        ("conv8_1d", (3, 16))):
        model = build_model(name, shape, 5, seed=0)
        check_model(model, np.zeros((4, *shape), dtype=np.float32), 5)

