"""Synthetic gradient modules: zero start, learning a gradient map, label conditioning, state."""

from __future__ import annotations

import io

import pytest
import torch

from edgestream.trainers.synthesizer import Synthesizer

N = 32
CLASSES = 4


def _relative_error(synth: Synthesizer, h, y, target) -> float:
    predicted = synth.predict(h, y)
    return float(((predicted - target) ** 2).mean() / (target**2).mean())


@pytest.mark.parametrize("conditioned", [False, True])
@pytest.mark.parametrize("hidden", [0, 16])
def test_first_predictions_are_exactly_zero(conditioned, hidden):
    synth = Synthesizer((3, 4), CLASSES, conditioned=conditioned, hidden=hidden)
    h = torch.randn(5, 3, 4)
    y = torch.tensor([0, 1, 2, 3, 0])

    predicted = synth.predict(h, y if conditioned else None)

    assert predicted.shape == h.shape and predicted.dtype == torch.float32
    assert torch.count_nonzero(predicted) == 0


def test_init_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    first = Synthesizer((6,), CLASSES, conditioned=True, hidden=8, seed=3)
    assert torch.equal(torch.rand(3), expected)
    second = Synthesizer((6,), CLASSES, conditioned=True, hidden=8, seed=3)
    third = Synthesizer((6,), CLASSES, conditioned=True, hidden=8, seed=4)
    w = [s.module[0].weight for s in (first, second, third)]
    assert torch.equal(w[0], w[1]) and not torch.equal(w[0], w[2])
    assert first.num_parameters == (6 + CLASSES) * 8 + 8 + 8 * 6 + 6
    assert Synthesizer((2, 3), CLASSES, conditioned=False).num_parameters == 6 * 6 + 6


@pytest.mark.parametrize("hidden", [0, 32])
def test_learns_a_linear_gradient_map(hidden):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(8, 8, generator=gen) / 8**0.5
    synth = Synthesizer((8,), CLASSES, conditioned=False, hidden=hidden, lr=1e-2, seed=1)

    def batch(n=N):
        h = torch.randn(n, 8, generator=gen)
        return h, h @ a / n  # dL/dh of a batch-mean loss

    h, target = batch()
    first = synth.update(h, None, target)
    for _ in range(400):
        h, target = batch()
        synth.update(h, None, target)
    h, target = batch(100)  # fresh samples, another batch size

    assert first > 0.5
    assert _relative_error(synth, h, None, target) < 0.05


def test_conditioned_synthesizer_learns_a_label_map_the_plain_one_cannot():
    gen = torch.Generator().manual_seed(0)
    b = torch.randn(CLASSES, 6, generator=gen)
    cdni = Synthesizer((6,), CLASSES, conditioned=True, lr=1e-2, seed=1)
    dni = Synthesizer((6,), CLASSES, conditioned=False, lr=1e-2, seed=1)

    def batch(n=N):
        h = torch.randn(n, 6, generator=gen)
        y = torch.randint(0, CLASSES, (n,), generator=gen)
        return h, y, b[y] / n  # depends on the label only

    for _ in range(400):
        h, y, target = batch()
        cdni.update(h, y, target)
        dni.update(h, y, target)  # y ignored
    h, y, target = batch()

    assert _relative_error(cdni, h, y, target) < 0.05
    assert _relative_error(dni, h, None, target) > 0.5


def test_state_dict_round_trip_through_torch_save():
    gen = torch.Generator().manual_seed(0)
    synth = Synthesizer((2, 3), CLASSES, conditioned=True, hidden=8, lr=1e-2)
    for _ in range(5):
        h = torch.randn(N, 2, 3, generator=gen)
        y = torch.randint(0, CLASSES, (N,), generator=gen)
        synth.update(h, y, torch.randn(N, 2, 3, generator=gen) / N)
    buffer = io.BytesIO()
    torch.save(synth.state_dict(), buffer)
    buffer.seek(0)
    restored = Synthesizer((2, 3), CLASSES, conditioned=True, hidden=8, lr=1e-2, seed=9)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    h = torch.randn(7, 2, 3, generator=gen)
    y = torch.randint(0, CLASSES, (7,), generator=gen)

    assert torch.equal(restored.predict(h, y), synth.predict(h, y))
    assert restored.updates == 5
    target = torch.randn(7, 2, 3, generator=gen) / 7
    assert restored.update(h, y, target) == synth.update(h, y, target)
    assert torch.equal(restored.predict(h, y), synth.predict(h, y))
    with pytest.raises(ValueError, match="saved for"):
        Synthesizer((2, 3), CLASSES, conditioned=False, hidden=8).load_state_dict(
            synth.state_dict()
        )


def test_bad_inputs_raise_value_error():
    synth = Synthesizer((4,), CLASSES, conditioned=True)
    h = torch.randn(3, 4)
    y = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="labels"):
        synth.predict(h, None)
    with pytest.raises(ValueError, match="h must be"):
        synth.predict(torch.randn(3, 5), y)
    with pytest.raises(ValueError, match="target shape"):
        synth.update(h, y, torch.zeros(3, 5))
    with pytest.raises(ValueError, match="NaN"):
        synth.update(h, y, torch.full((3, 4), float("nan")))
    with pytest.raises(ValueError, match="NaN"):
        synth.update(torch.full((3, 4), float("inf")), y, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="labels must be in"):
        synth.update(h, torch.tensor([0, 1, 4]), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="optimizer"):
        Synthesizer((4,), CLASSES, conditioned=False, optimizer="rmsprop")
    sgd = Synthesizer((4,), CLASSES, conditioned=False, optimizer="sgd", lr=0.1)
    sgd.update(h, None, h / 3)
    assert torch.count_nonzero(sgd.predict(h)) > 0


# -- trust and normalisation ----------------------------------------------------------------------


def _linear_map(seed: int = 0, width: int = 8):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(width, width, generator=gen) / width**0.5

    def batch(scale_h: float = 1.0, scale_g: float = 1.0, n: int = N):
        h = torch.randn(n, width, generator=gen)
        return h * scale_h, (h @ a) * scale_g / n

    return batch


def test_trust_is_zero_before_any_target_and_for_a_useless_synthesizer():
    gen = torch.Generator().manual_seed(0)
    synth = Synthesizer((8,), CLASSES, conditioned=False, lr=1e-2)
    assert synth.trust == 0.0
    h = torch.randn(N, 8, generator=gen)
    synth.predict(h)
    assert synth.trust == 0.0  # predicting is no evidence

    for _ in range(200):  # targets independent of h: nothing to learn, at best zero is predicted
        synth.update(torch.randn(N, 8, generator=gen), None, torch.randn(N, 8, generator=gen) / N)

    assert synth.updates == 200
    assert 0.0 <= synth.trust < 0.1, synth.trust


@pytest.mark.parametrize("hidden", [0, 32])
def test_trust_rises_towards_one_on_a_learnable_map(hidden):
    batch = _linear_map()
    synth = Synthesizer((8,), CLASSES, conditioned=False, hidden=hidden, lr=1e-2, seed=1)
    trusts = []
    for _ in range(400):
        synth.update(*_no_labels(batch()))
        trusts.append(synth.trust)

    assert trusts[0] < 0.1  # the first target is measured against the zero prediction
    assert trusts[50] < trusts[-1]
    assert trusts[-1] > 0.9, trusts[-1]
    assert trusts[-1] <= 1.0


def _no_labels(pair):
    h, target = pair
    return h, None, target


@pytest.mark.parametrize("hidden", [0, 32])
def test_the_same_map_is_learned_as_well_at_any_activation_and_gradient_scale(hidden):
    errors = {}
    for scale in (1e-3, 1.0, 1e3):
        batch = _linear_map(seed=2)
        synth = Synthesizer((8,), CLASSES, conditioned=False, hidden=hidden, lr=1e-2, seed=1)
        h, target = batch(scale, 1 / scale)
        synth.update(h, None, target)
        h, target = batch(scale, 1 / scale)
        first = synth.predict(h)
        # After one update the prediction is of the targets' order, not many times it.
        assert float(first.pow(2).mean().sqrt()) < 3 * float(target.pow(2).mean().sqrt()), scale
        for _ in range(300):
            synth.update(h, None, target)
            h, target = batch(scale, 1 / scale)
        errors[scale] = _relative_error(synth, h, None, target)

    assert max(errors.values()) < 0.05, errors
    assert max(errors.values()) < 3 * min(errors.values()) + 1e-3, errors


def test_state_dict_round_trips_the_running_statistics():
    batch = _linear_map(seed=3)
    synth = Synthesizer((8,), CLASSES, conditioned=False, lr=1e-2, seed=1)
    for _ in range(20):
        synth.update(*_no_labels(batch(5.0, 0.1)))
    buffer = io.BytesIO()
    torch.save(synth.state_dict(), buffer)
    buffer.seek(0)
    restored = Synthesizer((8,), CLASSES, conditioned=False, lr=1e-2, seed=7)

    restored.load_state_dict(torch.load(buffer, weights_only=True))

    for name in ("h_rms", "target_rms", "error_ms", "target_ms"):
        assert getattr(restored, name) == getattr(synth, name) and getattr(synth, name) > 0, name
    assert restored.trust == synth.trust > 0
    h, target = batch(5.0, 0.1)
    assert torch.equal(restored.predict(h), synth.predict(h))  # the same normalisation
    assert restored.update(h, None, target) == synth.update(h, None, target)
    assert (restored.h_rms, restored.target_rms) == (synth.h_rms, synth.target_rms)
