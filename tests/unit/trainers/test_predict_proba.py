"""Class probabilities of a model (trainers/evaluation.py ``predict_proba``) and the driver's
``probabilities``: what a worker publishes for each record before training on it."""

from __future__ import annotations

import numpy as np
import torch

from edgestream.trainers import build_model
from edgestream.trainers.evaluation import predict, predict_proba


def test_probabilities_are_a_distribution_whose_argmax_is_the_prediction():
    torch.manual_seed(0)
    model = build_model("mlp", (64,), 10, seed=0)
    features = np.random.default_rng(0).random((32, 64), dtype=np.float32)
    probabilities = predict_proba(model, features)
    assert probabilities.shape == (32, 10) and probabilities.dtype == np.float32
    assert np.allclose(probabilities.sum(axis=1), 1.0, atol=1e-5) and (probabilities >= 0).all()
    assert (probabilities.argmax(axis=1) == predict(model, features)).all()


def test_scoring_leaves_a_training_model_in_training_mode_and_its_batchnorm_statistics_unchanged():
    model = build_model("digits_cnn", (1, 8, 8), 10, seed=0)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    predict_proba(model, np.random.default_rng(1).random((16, 1, 8, 8), dtype=np.float32))
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
