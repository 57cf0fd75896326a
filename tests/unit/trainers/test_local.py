"""LocalTrainer: gradients without side effects, versioned updates, state round trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgestream.trainers.errors import AggregationError, BatchError
from edgestream.trainers.local import limit_torch_threads


@pytest.fixture
def batch(digits):
    return digits.x_train[:32], digits.y_train[:32]


@pytest.mark.parametrize("model", ["mlp", "digits_cnn"])
def test_compute_gradient_returns_named_float32_gradients_and_changes_nothing(make_trainer, batch, model):
    trainer = make_trainer(model=model)
    before = trainer.parameter_digest()

    result = trainer.compute_gradient(*batch)

    assert result.gradients.keys() == trainer.parameter_shapes().keys()
    for name, grad in result.gradients.items():
        assert grad.dtype == torch.float32
        assert tuple(grad.shape) == trainer.parameter_shapes()[name]
    assert np.isfinite(result.loss) and result.loss > 0
    assert (result.batch_size, result.base_version) == (32, 0)
    assert trainer.parameter_digest() == before
    assert trainer.version == 0


def test_batchnorm_statistics_travel_as_buffer_deltas(make_trainer, batch):
    trainer = make_trainer(model="digits_cnn")

    result = trainer.compute_gradient(*batch)

    float_buffers = {n for n, (_, dtype) in trainer.buffer_specs().items() if dtype.is_floating_point}
    assert result.buffer_deltas.keys() == float_buffers
    assert any(float(delta.abs().sum()) > 0 for delta in result.buffer_deltas.values())


def test_apply_gradient_steps_the_optimizer_and_counts_the_version(make_trainer, batch):
    trainer = make_trainer()
    before = trainer.parameter_digest()
    result = trainer.compute_gradient(*batch)

    new_version = trainer.apply_gradient(result.gradients)

    assert new_version == trainer.version == 1
    assert trainer.parameter_digest() != before


@pytest.mark.parametrize("lr_scale", [0.5, 1.0, 3.0])
def test_lr_scale_scales_one_plain_sgd_step_and_is_not_kept(make_trainer, batch, lr_scale):
    trainer = make_trainer(lr=0.1, momentum=0.0)
    start = trainer.get_parameters()
    grads = trainer.compute_gradient(*batch).gradients

    trainer.apply_gradient(grads, lr_scale=lr_scale)

    for name, param in trainer.get_parameters().items():
        torch.testing.assert_close(param, start[name] - 0.1 * lr_scale * grads[name])
    assert [group["lr"] for group in trainer.optimizer.param_groups] == [0.1]


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda g: g.pop(next(iter(g))), id="missing"),
        pytest.param(lambda g: g.update(extra=torch.zeros(1)), id="unexpected"),
        pytest.param(lambda g: g.update({k: torch.zeros(2, 2) for k in list(g)[:1]}), id="shape"),
    ],
)
def test_apply_gradient_refuses_gradients_that_do_not_fit(make_trainer, batch, mutate):
    trainer = make_trainer()
    grads = dict(trainer.compute_gradient(*batch).gradients)
    mutate(grads)
    before = trainer.parameter_digest()

    with pytest.raises(AggregationError):
        trainer.apply_gradient(grads)

    assert trainer.parameter_digest() == before
    assert trainer.version == 0


@pytest.mark.parametrize(
    ("features", "labels", "message"),
    [
        (np.zeros((4, 64), np.float32), np.zeros(3, np.int64), "labels shape"),
        (np.zeros((4, 64), np.float32), np.zeros(4, np.float32), "integers"),
        (np.full((4, 64), np.nan, np.float32), np.zeros(4, np.int64), "NaN"),
        (np.zeros((4, 64), np.float32), np.full(4, 10, np.int64), "out of range"),
        (np.zeros((4, 64), np.float32), np.full(4, -1, np.int64), "negative"),
        (np.zeros((0, 64), np.float32), np.zeros(0, np.int64), "N > 0"),
    ],
)
def test_malformed_batches_raise_batch_error(make_trainer, features, labels, message):
    trainer = make_trainer()

    with pytest.raises(BatchError, match=message):
        trainer.compute_gradient(features, labels)


def test_state_dict_round_trip_restores_parameters_momentum_and_version(make_trainer, batch):
    trainer = make_trainer(model="digits_cnn", seed=1)
    for _ in range(3):
        trainer.apply_gradient(trainer.compute_gradient(*batch).gradients)
    fresh = make_trainer(model="digits_cnn", seed=2)

    fresh.load_state_dict(trainer.state_dict())

    assert fresh.parameter_digest() == trainer.parameter_digest()
    assert fresh.version == 3
    momentum, restored = trainer.get_momentum(), fresh.get_momentum()
    assert momentum.keys() == restored.keys() and momentum
    assert all(torch.equal(momentum[name], restored[name]) for name in momentum)


def test_load_snapshot_adopts_parameters_buffers_momentum_and_version(make_trainer, batch):
    source = make_trainer(model="digits_cnn", seed=1)
    result = source.compute_gradient(*batch)
    source.apply_gradient(result.gradients, buffer_deltas=result.buffer_deltas)
    target = make_trainer(model="digits_cnn", seed=2)

    target.load_snapshot(source.get_parameters(), source.get_buffers(), 1, momentum=source.get_momentum())

    assert target.parameter_digest() == source.parameter_digest()
    assert target.version == 1
    target_next, source_next = target.compute_gradient(*batch), source.compute_gradient(*batch)
    target.apply_gradient(target_next.gradients)
    source.apply_gradient(source_next.gradients)
    assert target.parameter_digest() == source.parameter_digest()


def test_a_few_local_steps_reduce_the_training_loss(make_trainer, batch):
    trainer = make_trainer(lr=0.1)
    first = trainer.compute_gradient(*batch).loss

    for _ in range(20):
        trainer.apply_gradient(trainer.compute_gradient(*batch).gradients)

    assert trainer.compute_gradient(*batch).loss < first / 2


def test_limit_torch_threads_sets_intra_op_threads_and_rejects_zero():
    limit_torch_threads(1)

    assert torch.get_num_threads() == 1
    with pytest.raises(ValueError):
        limit_torch_threads(0)
