"""Stage splitting: shared modules and names, exact gradients when chained, StageTrainer contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgestream.trainers.errors import BatchError, ModelConfigError, StrategyError
from edgestream.trainers.local import LocalTrainer
from edgestream.trainers.models import build_model
from edgestream.trainers.stages import (
    StageTrainer,
    boundary_names,
    boundary_shapes,
    build_stage,
    compose,
    split_model,
)

CASES = [
    # name, input_shape, options, boundaries
    ("mlp", (64,), {"hidden": (32, 16)}, ["1", "3"]),
    ("mlp", (64,), {"hidden": (32, 16)}, ["2", "4"]),
    ("conv8", (64,), {}, ["block1", "block3"]),
    ("conv8", (64,), {}, ["block2", "fc1"]),
    ("conv8", (1, 8, 8), {"width": 4}, ["block1", "block2", "block3", "fc1"]),
    ("conv8_1d", (3, 16), {}, ["block2"]),
]


def _batch(input_shape, n=12, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *input_shape)).astype(np.float32)
    y = rng.integers(0, classes, size=n)
    return x, y


def _chain(trainers, x, y):
    """Forward through all stages, then backprop from the top: per-stage results and activations."""
    fwds, h = [], x
    for trainer in trainers:
        fwd = trainer.forward(h)
        fwds.append(fwd)
        h = fwd.activation()
    results = [None] * len(trainers)
    results[-1], grad = trainers[-1].loss_backward(fwds[-1], y)
    for k in range(len(trainers) - 2, -1, -1):
        results[k], grad = trainers[k].backward(fwds[k], grad)
    assert grad is None  # stage 0 has no input gradient
    return fwds, results


def _intermediates(model, x, boundaries):
    outputs, h = {}, torch.from_numpy(x)
    with torch.no_grad():
        for name, child in model.named_children():
            h = child(h)
            outputs[name] = h.clone()
    return [outputs[b] for b in boundaries]


@pytest.mark.parametrize(("name", "input_shape", "options", "boundaries"), CASES)
def test_chained_stages_give_the_unsplit_models_gradients_and_activations(
    name, input_shape, options, boundaries
):
    x, y = _batch(input_shape)
    full = build_model(name, input_shape, 10, seed=3, **options)
    reference = LocalTrainer(
        build_model(name, input_shape, 10, seed=3, **options)
    ).compute_gradient(x, y)
    stages = split_model(full, boundaries)
    trainers = [StageTrainer(s, stage=k, stages=len(stages)) for k, s in enumerate(stages)]

    fwds, results = _chain(trainers, x, y)

    merged = {}
    for result in results:
        assert not (merged.keys() & result.gradients.keys())
        merged.update(result.gradients)
    assert merged.keys() == reference.gradients.keys()
    for param, grad in reference.gradients.items():
        assert grad.shape == merged[param].shape
        assert float((grad - merged[param]).abs().max()) <= 1e-6, param
    assert results[-1].loss == pytest.approx(reference.loss, abs=1e-6)
    np.testing.assert_array_equal(results[-1].correct, reference.correct)
    for fwd, expected in zip(fwds[:-1], _intermediates(full, x, boundaries), strict=True):
        assert float((fwd.activation() - expected).abs().max()) <= 1e-6
    for result in results[:-1]:
        assert result.loss == 0.0 and result.correct is None and result.batch_size == len(y)


def test_split_shares_parameter_objects_and_keeps_full_names():
    full = build_model("conv8", (64,), 10, seed=0)
    stages = split_model(full, ["block1", "block3"])
    full_params = dict(full.named_parameters())

    names = [[n for n, _ in s.named_parameters()] for s in stages]

    assert names[0] == ["block1.1.weight", "block1.1.bias", "block1.3.weight", "block1.3.bias"]
    assert names[1][0] == "block2.1.weight" and names[1][-1] == "block3.3.bias"
    assert names[2] == ["fc1.1.weight", "fc1.1.bias", "fc2.weight", "fc2.bias"]
    assert sum(names, []) == list(full_params)
    for stage in stages:
        for n, p in stage.named_parameters():
            assert p is full_params[n]
    mlp_stages = split_model(build_model("mlp", (64,), 10, seed=0), ["1"])
    assert [n for n, _ in mlp_stages[0].named_parameters()] == ["1.weight", "1.bias"]
    assert [n for n, _ in mlp_stages[1].named_parameters()] == ["3.weight", "3.bias"]


def test_boundary_names_are_all_children_but_the_last():
    assert boundary_names(build_model("conv8", (64,), 10, seed=0)) == [
        "block1",
        "block2",
        "block3",
        "fc1",
    ]
    assert boundary_names(build_model("conv8_1d", (3, 8), 10, seed=0)) == [
        "block1",
        "block2",
        "block3",
        "fc1",
    ]
    assert boundary_names(build_model("mlp", (64,), 10, seed=0)) == ["0", "1", "2"]
    with pytest.raises(ModelConfigError, match="nn.Sequential"):
        boundary_names(build_model("digits_cnn", (64,), 10, seed=0))


@pytest.mark.parametrize(
    "boundaries", [["block9"], ["fc2"], ["block2", "block2"], ["block3", "block1"]]
)
def test_bad_boundaries_raise_naming_the_valid_ones(boundaries):
    model = build_model("conv8", (64,), 10, seed=0)
    with pytest.raises(ModelConfigError, match="valid boundaries: block1, block2, block3, fc1"):
        split_model(model, boundaries)


def test_no_boundaries_is_one_stage_holding_the_whole_model():
    model = build_model("conv8", (64,), 10, seed=0)

    (whole,) = split_model(model, [])

    assert dict(whole.named_parameters()) == dict(model.named_parameters())


def test_build_stage_equals_the_full_models_slice_and_checks_the_stage_index():
    full = dict(build_model("conv8", (64,), 10, seed=5).named_parameters())
    for k in range(3):
        stage = build_stage("conv8", (64,), 10, 5, ["block1", "fc1"], k)
        params = dict(stage.named_parameters())
        assert params
        for n, p in params.items():
            assert torch.equal(p, full[n])
    other = dict(build_stage("conv8", (64,), 10, 6, ["block1", "fc1"], 0).named_parameters())
    assert not torch.equal(other["block1.1.weight"], full["block1.1.weight"])
    with pytest.raises(ModelConfigError, match="out of range"):
        build_stage("conv8", (64,), 10, 5, ["block1", "fc1"], 3)


def test_stage_zero_carries_the_input_standardizer():
    rng = np.random.default_rng(1)
    data = rng.normal(3.0, 2.0, size=(40, 64)).astype(np.float32)
    stats = (data.mean(axis=0), data.std(axis=0))
    full = build_model("conv8", (64,), 10, seed=0, standardize=stats)
    stages = split_model(full, ["block2"])
    x = torch.from_numpy(data[:5])

    with torch.no_grad():
        assert torch.allclose(stages[1](stages[0](x)), full(x), atol=1e-6)
        assert torch.allclose(compose(stages)(x), full(x), atol=1e-6)
    assert stages[0].input_standardizer is full.input_standardizer
    assert not hasattr(stages[1], "input_standardizer")
    stage0 = build_stage("conv8", (64,), 10, 0, ["block2"], 0, standardize=stats)
    with torch.no_grad():
        assert torch.equal(stage0(x), stages[0](x))


def test_compose_rebuilds_the_model_with_its_names():
    full = build_model("mlp", (64,), 10, seed=0, hidden=(32, 16))
    stages = split_model(full, ["1", "3"])
    composed = compose(stages)
    x = torch.randn(4, 64)

    assert list(composed.state_dict()) == list(full.state_dict())
    with torch.no_grad():
        assert torch.equal(composed(x), full(x))


@pytest.mark.parametrize(
    ("name", "input_shape", "options", "boundaries", "expected"),
    [
        (
            "conv8",
            (64,),
            {},
            ["block1", "block2", "block3", "fc1"],
            [(8, 8, 8), (16, 4, 4), (32, 2, 2), (64,)],
        ),
        ("conv8", (8, 8), {"width": 4, "hidden": 20}, ["block3", "fc1"], [(16, 2, 2), (20,)]),
        (
            "conv8_1d",
            (3, 18),
            {},
            ["block1", "block2", "block3", "fc1"],
            [(8, 18), (16, 9), (32, 4), (64,)],
        ),
        ("mlp", (3, 5), {"hidden": (7,)}, ["0", "1"], [(15,), (7,)]),
    ],
)
def test_boundary_shapes(name, input_shape, options, boundaries, expected):
    model = build_model(name, input_shape, 10, seed=0, **options)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    model.train()

    assert boundary_shapes(model, boundaries, input_shape) == expected
    assert model.training
    for n, p in model.state_dict().items():
        assert torch.equal(p, before[n])


def test_conv8_models_reject_bad_input_shapes():
    with pytest.raises(ModelConfigError, match="conv8 expects"):
        build_model("conv8", (3, 20), 10, seed=0)
    with pytest.raises(ModelConfigError, match="time >= 4"):
        build_model("conv8_1d", (3, 3), 10, seed=0)
    with pytest.raises(ModelConfigError, match="channels, time"):
        build_model("conv8_1d", (64,), 10, seed=0)


def _two_stage(seed=0):
    stages = split_model(build_model("conv8", (64,), 10, seed=seed), ["block2"])
    return [StageTrainer(s, stage=k, stages=2, lr=0.1, momentum=0.0) for k, s in enumerate(stages)]


def test_stage_trainer_rejects_bad_batches_and_gradients():
    bottom, top = _two_stage()
    x, y = _batch((64,), n=6)
    bad = x.copy()
    bad[2, 5] = np.nan
    with pytest.raises(BatchError, match="NaN"):
        bottom.forward(bad)
    with pytest.raises(BatchError):
        bottom.forward(x[:0])
    with pytest.raises(BatchError):
        bottom.forward(x[0])  # no batch dimension
    fwd = bottom.forward(x)
    with pytest.raises(BatchError, match="does not match"):
        bottom.backward(fwd, torch.zeros(6, 16, 4, 5))
    with pytest.raises(BatchError, match="NaN"):
        bottom.backward(fwd, torch.full(tuple(fwd.output.shape), float("inf")))
    act = fwd.activation()
    with pytest.raises(BatchError):
        top.forward(act[:0])
    with pytest.raises(BatchError, match="NaN"):
        top.forward(torch.full_like(act, float("nan")))
    tf = top.forward(act)
    with pytest.raises(BatchError, match="out of range"):
        top.loss_backward(tf, np.array([0, 1, 2, 3, 4, 10]))
    with pytest.raises(BatchError, match="negative"):
        top.loss_backward(tf, np.array([0, 1, 2, 3, 4, -1]))
    with pytest.raises(BatchError, match="labels shape"):
        top.loss_backward(tf, y[:3])
    with pytest.raises(BatchError, match="integers"):
        top.loss_backward(tf, y.astype(np.float32))
    with pytest.raises(StrategyError):
        top.backward(tf, torch.zeros(tf.output.shape))
    with pytest.raises(StrategyError):
        bottom.loss_backward(fwd, y)
    result, grad = top.loss_backward(tf, torch.from_numpy(y))
    assert grad.shape == act.shape and grad.dtype == torch.float32
    assert not grad.requires_grad and result.correct.dtype == np.bool_
    with pytest.raises(StrategyError, match="already"):
        top.loss_backward(tf, y)
    with pytest.raises(ValueError):
        StageTrainer(build_stage("conv8", (64,), 10, 0, ["block2"], 0), stage=2, stages=2)
    with pytest.raises(ModelConfigError, match="no trainable parameters"):
        StageTrainer(build_stage("mlp", (64,), 10, 0, ["0"], 0), stage=0, stages=2)


def test_forward_does_not_keep_the_callers_tensor_and_activation_is_a_copy():
    bottom, top = _two_stage()
    x, _ = _batch((64,), n=4)
    fwd = bottom.forward(x)
    act = fwd.activation()
    assert act.dtype == torch.float32 and act.is_contiguous() and not act.requires_grad
    assert fwd.inputs is not None and not fwd.inputs.requires_grad
    tf = top.forward(act)
    assert tf.inputs.requires_grad and tf.inputs is not act and not act.requires_grad
    assert tf.output.grad_fn is not None and tf.batch_size == 4


def test_apply_gradient_moves_only_the_stage_and_bumps_its_version():
    bottom, top = _two_stage()
    x, y = _batch((64,), n=8)
    fwd = bottom.forward(x)
    tf = top.forward(fwd.activation())
    top_result, grad = top.loss_backward(tf, y)
    bottom_result, _ = bottom.backward(fwd, grad)
    bottom_before, top_before = bottom.get_parameters(), top.get_parameters()

    assert top.apply_gradient(top_result.gradients) == 1
    assert bottom.version == 0
    assert all(torch.equal(p, bottom_before[n]) for n, p in bottom.get_parameters().items())
    moved = top.get_parameters()
    for n, p in moved.items():
        expected = top_before[n] - 0.1 * top_result.gradients[n]
        assert torch.allclose(p, expected, atol=1e-7)
    assert any(not torch.equal(moved[n], top_before[n]) for n in moved)
    assert set(moved).isdisjoint(bottom_before)
    assert bottom.apply_gradient(bottom_result.gradients) == 1


def test_backward_after_the_parameters_changed_is_a_strategy_error():
    bottom, top = _two_stage()
    x, y = _batch((64,), n=4)
    fwd = bottom.forward(x)
    result, _ = bottom.backward(fwd, torch.ones(fwd.output.shape))
    bottom.apply_gradient(result.gradients)
    stale = bottom.forward(x)
    bottom.apply_gradient(result.gradients)
    with pytest.raises(StrategyError):
        bottom.backward(stale, torch.ones(stale.output.shape))


def test_one_stage_split_matches_compute_gradient():
    model = build_model("conv8", (64,), 10, seed=2)
    trainer = StageTrainer(model, stage=0, stages=1)
    x, y = _batch((64,), n=5)
    reference = trainer.compute_gradient(x, y)

    result, grad = trainer.loss_backward(trainer.forward(x), y)

    assert grad is None
    assert result.loss == pytest.approx(reference.loss, abs=1e-7)
    for n, g in reference.gradients.items():
        assert torch.allclose(result.gradients[n], g, atol=1e-7)


# -- BatchNorm (conv8 norm="batch") ------------------------------------------------------------------

NORMED = [
    ((64,), {"norm": "batch"}, ["block1", "block3"]),
    ((64,), {"norm": "batch"}, ["block2", "fc1"]),
    ((1, 8, 8), {"width": 4, "norm": "batch"}, ["block1", "block2", "block3", "fc1"]),
]


@pytest.mark.parametrize(("input_shape", "options", "boundaries"), NORMED)
def test_batch_norm_stages_give_the_unsplit_models_gradients_and_buffer_changes(
    input_shape, options, boundaries
):
    x, y = _batch(input_shape, n=16)
    reference = LocalTrainer(build_model("conv8", input_shape, 10, seed=3, **options)).compute_gradient(x, y)
    probe = build_model("conv8", input_shape, 10, seed=3, **options)
    probe.train()
    before = {n: b.clone() for n, b in probe.named_buffers() if b.is_floating_point()}
    with torch.no_grad():
        probe(torch.from_numpy(x))  # what one forward does to the running statistics
    moved = {n: b - before[n] for n, b in probe.named_buffers() if b.is_floating_point()}
    assert moved and any(float(d.abs().max()) > 0 for d in moved.values())
    full = build_model("conv8", input_shape, 10, seed=3, **options)
    stages = split_model(full, boundaries)
    trainers = [StageTrainer(s, stage=k, stages=len(stages)) for k, s in enumerate(stages)]
    own = {n: b.clone() for n, b in full.named_buffers() if b.is_floating_point()}

    _, results = _chain(trainers, x, y)

    # The forward ran on copies: the running statistics are as they were (the integer
    # num_batches_tracked counts forwards, as in LocalTrainer, and is left out of digests).
    for n, b in full.named_buffers():
        if b.is_floating_point():
            assert torch.equal(b, own[n]), n
    merged, deltas = {}, {}
    for result in results:
        merged.update(result.gradients)
        assert not (deltas.keys() & result.buffer_deltas.keys())
        deltas.update(result.buffer_deltas)
    assert merged.keys() == reference.gradients.keys()
    for param, grad in reference.gradients.items():
        assert float((grad - merged[param]).abs().max()) <= 1e-6, param
    assert deltas.keys() == moved.keys() == reference.buffer_deltas.keys()
    for name, delta in moved.items():
        assert float((deltas[name] - delta).abs().max()) <= 1e-6, name
        assert float((reference.buffer_deltas[name] - delta).abs().max()) <= 1e-6, name


def test_backward_after_a_batch_norm_forward_works_and_applying_moves_the_buffers():
    stages = split_model(build_model("conv8", (64,), 10, seed=0, norm="batch"), ["block2"])
    bottom, top = (StageTrainer(s, stage=k, stages=2, lr=0.1, momentum=0.0) for k, s in enumerate(stages))
    x, y = _batch((64,), n=8)
    fwd = bottom.forward(x)
    tf = top.forward(fwd.activation())
    top_result, grad = top.loss_backward(tf, y)
    bottom_result, none = bottom.backward(fwd, grad)

    assert none is None and grad.shape == fwd.output.shape
    assert any(float(g.abs().max()) > 0 for g in bottom_result.gradients.values())
    assert bottom_result.buffer_deltas and bottom_result.buffer_deltas == fwd.buffer_deltas
    before = {n: b.clone() for n, b in bottom.model.named_buffers() if b.is_floating_point()}
    bottom.apply_gradient(bottom_result.gradients, buffer_deltas=bottom_result.buffer_deltas)
    for name, delta in bottom_result.buffer_deltas.items():
        assert torch.allclose(dict(bottom.model.named_buffers())[name], before[name] + delta, atol=1e-6)
    # Two forwards in a row, then their backwards in order: each has its own buffer copies.
    first, second = bottom.forward(x), bottom.forward(x[::-1].copy())
    bottom.backward(first, torch.ones(first.output.shape))
    bottom.backward(second, torch.ones(second.output.shape))
