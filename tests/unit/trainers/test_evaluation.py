"""evaluate: accuracy and loss on held-out arrays, batch-size independent, mode restored."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from edgestream.trainers.errors import BatchError
from edgestream.trainers.evaluation import evaluate


class _FixedClass(nn.Module):
    """Always predicts class 1 with probability ~1."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.full((x.shape[0], 3), -20.0)
        logits[:, 1] = 20.0
        return logits + self.anchor


def test_accuracy_is_the_fraction_of_correct_predictions():
    features = np.zeros((8, 4), np.float32)
    labels = np.array([1, 1, 1, 0, 2, 1, 0, 1])

    result = evaluate(_FixedClass(), features, labels, batch_size=3)

    assert result.accuracy == pytest.approx(5 / 8)
    assert result.count == 8
    assert result.loss == pytest.approx(3 / 8 * 40, rel=1e-3)


@pytest.mark.parametrize("model_name", ["mlp", "digits_cnn"])
def test_result_does_not_depend_on_batching_and_training_mode_is_restored(make_trainer, digits, model_name):
    model = make_trainer(model=model_name).model
    model.train()

    small = evaluate(model, digits.x_test, digits.y_test, batch_size=7)
    large = evaluate(model, digits.x_test, digits.y_test, batch_size=1024)

    assert small.accuracy == large.accuracy
    assert small.loss == pytest.approx(large.loss, rel=1e-5)
    assert model.training


def test_mismatched_arrays_raise_batch_error(make_trainer):
    with pytest.raises(BatchError):
        evaluate(make_trainer().model, np.zeros((4, 64), np.float32), np.zeros(3, np.int64))


def test_time_to_target_is_the_first_of_three_consecutive_hits():
    from edgestream.trainers.evaluation import time_to_target

    timeline = [(1, 0.5), (2, 0.91), (3, 0.89), (4, 0.9), (5, 0.95), (6, 0.92), (7, 0.8)]
    assert time_to_target(timeline, 0.9) == 4
    assert time_to_target(timeline, 0.9, hold=1) == 2
    assert time_to_target(timeline, 0.96) is None
    assert time_to_target([(1, 0.95), (2, 0.95)], 0.9) is None  # held only twice
