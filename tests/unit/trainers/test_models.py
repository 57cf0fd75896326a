"""Model registry: shapes per model, deterministic seeded init, clear errors."""

from __future__ import annotations

import pytest
import torch

from edgestream.trainers.errors import ModelConfigError
from edgestream.trainers.local import LocalTrainer
from edgestream.trainers.models import build_model, model_names


@pytest.mark.parametrize(
    ("name", "input_shape", "batch_shape"),
    [
        ("mlp", (64,), (4, 64)),
        ("mlp", (3, 20), (4, 3, 20)),
        ("cnn1d", (3, 20), (4, 3, 20)),
        ("cnn1d", (3, 20), (4, 3, 35)),
        ("digits_cnn", (64,), (4, 64)),
        ("digits_cnn", (1, 8, 8), (4, 1, 8, 8)),
    ],
)
def test_model_maps_a_batch_to_class_logits(name, input_shape, batch_shape):
    model = build_model(name, input_shape, num_classes=5, seed=0)

    logits = model(torch.zeros(batch_shape))

    assert logits.shape == (4, 5)


@pytest.mark.parametrize("name", ["mlp", "digits_cnn"])
def test_same_seed_builds_identical_replicas_and_other_seeds_differ(name):
    first = LocalTrainer(build_model(name, (64,), 10, seed=7))
    second = LocalTrainer(build_model(name, (64,), 10, seed=7))
    other = LocalTrainer(build_model(name, (64,), 10, seed=8))

    assert first.parameter_digest() == second.parameter_digest()
    assert first.parameter_digest() != other.parameter_digest()


def test_building_a_model_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)

    build_model("mlp", (64,), 10, seed=0)

    assert torch.equal(torch.rand(3), expected)


def test_registry_lists_the_issue_models():
    assert {"mlp", "cnn1d", "digits_cnn"} <= set(model_names())


@pytest.mark.parametrize(
    ("name", "input_shape", "num_classes", "message"),
    [
        ("resnet9000", (64,), 10, "unknown model"),
        ("cnn1d", (64,), 10, "channels, time"),
        ("digits_cnn", (3, 20), 10, "digits_cnn expects"),
        ("mlp", (0,), 10, "positive"),
        ("mlp", (64,), 1, "num_classes"),
    ],
)
def test_bad_model_requests_raise_model_config_error(name, input_shape, num_classes, message):
    with pytest.raises(ModelConfigError, match=message):
        build_model(name, input_shape, num_classes, seed=0)
