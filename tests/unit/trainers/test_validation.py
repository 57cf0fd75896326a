"""validate_update: every rejection path, and well-formed updates pass untouched."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from edgestream.trainers.errors import UpdateRejected
from edgestream.trainers.messages import UpdateMessage
from edgestream.trainers.strategies.base import snapshot_message
from edgestream.trainers.validation import TensorSpec, validate_update


@pytest.fixture
def trainer(make_trainer):
    return make_trainer(model="digits_cnn")


@pytest.fixture
def spec(trainer):
    return TensorSpec.from_trainer(trainer)


@pytest.fixture
def gradient(trainer, digits):
    result = trainer.compute_gradient(digits.x_train[:16], digits.y_train[:16])
    return UpdateMessage(
        kind="gradient",
        sender="w0",
        step=0,
        base_version=0,
        batch_size=16,
        tensors=result.gradients,
        buffers=result.buffer_deltas,
        meta={"loss": result.loss},
    )


def _first(tensors: dict[str, torch.Tensor]) -> str:
    return next(iter(tensors))


def test_well_formed_gradient_snapshot_and_control_pass(trainer, spec, gradient):
    snapshot = snapshot_message(trainer, "w0", include_momentum=True)
    control = UpdateMessage(kind="control", sender="w0", step=0, base_version=0, meta={"op": "view"})

    for msg in (gradient, snapshot, control):
        validate_update(msg, spec)


def test_a_plain_shape_mapping_is_accepted_as_the_parameter_spec(trainer, gradient):
    without_buffers = dataclasses.replace(gradient, buffers={})

    validate_update(without_buffers, trainer.parameter_shapes())


def _replace_tensor(msg: UpdateMessage, value_fn) -> UpdateMessage:
    name = _first(msg.tensors)
    return dataclasses.replace(msg, tensors={**msg.tensors, name: value_fn(msg.tensors[name])})


def _with_nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


CASES = [
    ("unknown_kind", lambda m: dataclasses.replace(m, kind="weights")),
    ("bad_header", lambda m: dataclasses.replace(m, sender="")),
    ("bad_header", lambda m: dataclasses.replace(m, step=-1)),
    ("bad_header", lambda m: dataclasses.replace(m, base_version=True)),
    ("bad_header", lambda m: dataclasses.replace(m, batch_size=0)),
    ("bad_meta", lambda m: dataclasses.replace(m, meta={"loss": float("nan")})),
    ("bad_meta", lambda m: dataclasses.replace(m, meta={"blob": object()})),
    ("bad_meta", lambda m: dataclasses.replace(m, meta={"blob": "x" * 20_000})),
    ("missing_tensor", lambda m: dataclasses.replace(m, tensors=dict(list(m.tensors.items())[1:]))),
    ("unexpected_tensor", lambda m: dataclasses.replace(m, tensors={**m.tensors, "extra.weight": torch.zeros(1)})),
    ("shape_mismatch", lambda m: _replace_tensor(m, lambda t: torch.zeros(t.numel() + 1))),
    ("bad_dtype", lambda m: _replace_tensor(m, lambda t: torch.zeros(t.shape, dtype=torch.int32))),
    ("bad_dtype", lambda m: _replace_tensor(m, lambda t: t.numpy())),
    ("non_finite", lambda m: _replace_tensor(m, _with_nan)),
    ("non_finite", lambda m: _replace_tensor(m, lambda t: torch.full(t.shape, float("inf")))),
    ("unexpected_tensor", lambda m: dataclasses.replace(m, buffers={"nope": torch.zeros(1)})),
    (
        "shape_mismatch",
        lambda m: dataclasses.replace(m, buffers={_first(m.buffers): torch.zeros(99)}),
    ),
    (
        "non_finite",
        lambda m: dataclasses.replace(m, buffers={_first(m.buffers): _with_nan(m.buffers[_first(m.buffers)])}),
    ),
    (
        "unexpected_tensor",
        lambda m: dataclasses.replace(m, optimizer={_first(m.tensors): m.tensors[_first(m.tensors)]}),
    ),
    (
        "unexpected_tensor",
        lambda m: dataclasses.replace(m, kind="control", meta={}),
    ),
]


@pytest.mark.parametrize(("reason", "corrupt"), CASES)
def test_malformed_updates_are_rejected_with_a_reason_code(spec, gradient, reason, corrupt):
    bad = corrupt(gradient)

    with pytest.raises(UpdateRejected) as caught:
        validate_update(bad, spec)

    assert caught.value.reason == reason
    assert caught.value.detail
    assert caught.value.sender == bad.sender


def test_integer_buffer_values_are_only_accepted_on_snapshots(trainer, spec, gradient):
    counter = next(n for n, (_, dtype) in spec.buffers.items() if not dtype.is_floating_point)
    snapshot = snapshot_message(trainer, "w0")
    gradient_with_counter = dataclasses.replace(
        gradient, buffers={**gradient.buffers, counter: torch.tensor(3)}
    )

    validate_update(snapshot, spec)
    with pytest.raises(UpdateRejected) as caught:
        validate_update(gradient_with_counter, spec)
    assert caught.value.reason == "bad_dtype"


def test_wildcard_dimensions_accept_any_size_for_activations():
    spec = TensorSpec(parameters={"h1": (None, 16)})
    msg = UpdateMessage(kind="activation", sender="stage0", step=3, base_version=3, batch_size=5,
                        tensors={"h1": torch.zeros(5, 16)})
    wrong = dataclasses.replace(msg, tensors={"h1": torch.zeros(5, 15)})

    validate_update(msg, spec)
    with pytest.raises(UpdateRejected, match="shape"):
        validate_update(wrong, spec)


def test_unknown_reason_codes_are_a_programming_error():
    with pytest.raises(ValueError):
        UpdateRejected("because", "no")
