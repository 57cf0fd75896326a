"""Fixed input standardisation of built models: invisible to state, deterministic, zero-mean."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from edgestream.trainers import LocalTrainer
from edgestream.trainers.errors import BatchError, ModelConfigError
from edgestream.trainers.models import build_model


def scaled_data(n: int = 256, seed: int = 0) -> np.ndarray:
    """Columns on very different scales, like an imported table (one up to ~1,700)."""
    rng = np.random.default_rng(seed)
    return np.column_stack([
        rng.normal(13, 0.8, n), rng.normal(750, 300, n), rng.normal(0.4, 0.1, n), rng.normal(-3, 2, n),
    ]).astype(np.float32)


def stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x.mean(axis=0), x.std(axis=0)


@pytest.mark.parametrize("name, shape", [("mlp", (4,)), ("cnn1d", (2, 8))])
def test_standardisation_is_not_state(name, shape):
    width = int(np.prod(shape))
    mean, std = np.arange(width, dtype=np.float32), np.full(width, 3.0, dtype=np.float32)

    plain = build_model(name, shape, 3, seed=1)
    standardized = build_model(name, shape, 3, seed=1, standardize=(mean, std))

    assert [n for n, _ in standardized.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(standardized.named_buffers()) == list(plain.named_buffers()) == []
    assert standardized.state_dict().keys() == plain.state_dict().keys()
    for key, value in plain.state_dict().items():
        assert torch.equal(standardized.state_dict()[key], value)  # same init, nothing added
    assert not hasattr(plain, "input_standardizer")


def test_model_sees_zero_mean_unit_std_inputs():
    x = scaled_data()
    model = build_model("mlp", (4,), 3, seed=0, standardize=stats(x))
    seen = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(args[0].detach().clone()))

    model(torch.from_numpy(x))

    (inputs,) = seen
    np.testing.assert_allclose(inputs.mean(dim=0).numpy(), 0.0, atol=1e-5)
    np.testing.assert_allclose(inputs.std(dim=0, unbiased=False).numpy(), 1.0, atol=1e-5)
    # Same as standardising by hand and running the plain model.
    plain = build_model("mlp", (4,), 3, seed=0)
    mean, std = stats(x)
    expected = plain(torch.from_numpy((x - mean) / std))
    torch.testing.assert_close(model(torch.from_numpy(x)), expected, rtol=1e-5, atol=1e-5)


def test_standardisation_is_deterministic_and_survives_copies():
    x = torch.from_numpy(scaled_data())
    a = build_model("mlp", (4,), 3, seed=0, standardize=stats(scaled_data()))
    b = build_model("mlp", (4,), 3, seed=0, standardize=stats(scaled_data()))
    assert torch.equal(a(x), b(x))
    assert torch.equal(copy.deepcopy(a)(x), a(x))
    a.eval()
    assert torch.equal(a(x), b(x))  # training and evaluation both standardise


def test_standardised_model_trains_where_the_plain_one_cannot():
    rng = np.random.default_rng(0)
    x = scaled_data(600)
    y = (x[:, 1] > 750).astype(np.int64) + (x[:, 0] > 13)  # 3 classes from two columns
    results = {}
    for std in (True, False):
        torch.manual_seed(0)
        trainer = LocalTrainer(build_model("mlp", (4,), 3, seed=0, standardize=stats(x) if std else None),
                               lr=0.1, momentum=0.9)
        try:
            for _ in range(200):
                idx = rng.integers(0, len(y), 64)
                step = trainer.compute_gradient(x[idx], y[idx])
                trainer.apply_gradient(step.gradients)
        except BatchError as exc:  # the unscaled model diverges to a non-finite loss
            assert exc.reason == "non_finite_loss" and not std
            results[std] = 0.0
            continue
        with torch.no_grad():
            results[std] = float((trainer.model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())
    assert results[True] >= 0.9 > results[False]


def test_constant_feature_is_only_centred():
    model = build_model("mlp", (2,), 2, seed=0, standardize=(np.array([5.0, 1.0]), np.array([0.0, 2.0])))
    out = model.input_standardizer.apply(torch.tensor([[5.0, 3.0], [6.0, -1.0]]))
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0], [1.0, -1.0]]))


@pytest.mark.parametrize("mean, std, match", [
    (np.zeros(3), np.ones(4), "mean has 3 values"),
    (np.zeros(4), np.ones(2), "std has 2 values"),
    (np.zeros(4), -np.ones(4), "std must be >= 0"),
    (np.full(4, np.nan), np.ones(4), "mean must be finite"),
])
def test_bad_statistics_are_refused(mean, std, match):
    with pytest.raises(ModelConfigError, match=match):
        build_model("mlp", (4,), 3, seed=0, standardize=(mean, std))
