"""Error-feedback memories, alone and inside a GradientCodec."""

from __future__ import annotations

import pytest
import torch

from edgestream.compression import registry
from edgestream.compression.errors import CompressionError
from edgestream.compression.memory import ErrorFeedback, NoMemory
from edgestream.compression.pipeline import GradientCodec, decode_tensors


def test_error_feedback_owes_exactly_what_was_not_sent():
    memory = ErrorFeedback()
    grad = torch.tensor([1.0, -2.0, 3.0])
    compensated = memory.compensate("w", grad)
    memory.update("w", compensated, torch.tensor([0.0, 0.0, 3.0]))

    assert torch.equal(memory.residual("w"), torch.tensor([1.0, -2.0, 0.0]))
    assert torch.equal(memory.compensate("w", torch.ones(3)), torch.tensor([2.0, -1.0, 1.0]))


def test_error_feedback_keys_residuals_by_layer():
    memory = ErrorFeedback()
    memory.update("a", torch.ones(2), torch.zeros(2))
    assert memory.residual("b") is None
    assert torch.equal(memory.compensate("b", torch.ones(2)), torch.ones(2))


def test_compensate_does_not_modify_the_gradient_or_the_residual():
    memory = ErrorFeedback()
    memory.update("w", torch.ones(3), torch.zeros(3))
    grad = torch.full((3,), 5.0)
    memory.compensate("w", grad)
    assert torch.equal(grad, torch.full((3,), 5.0))
    assert torch.equal(memory.residual("w"), torch.ones(3))


def test_residual_is_fp32_for_low_precision_gradients():
    memory = ErrorFeedback()
    compensated = memory.compensate("w", torch.ones(4, dtype=torch.bfloat16))
    memory.update("w", compensated, torch.zeros(4))
    assert memory.residual("w").dtype == torch.float32


def test_shape_change_is_an_error_not_a_broadcast():
    memory = ErrorFeedback()
    memory.update("w", torch.ones(4), torch.zeros(4))
    with pytest.raises(CompressionError) as err:
        memory.compensate("w", torch.ones(2, 2))
    assert err.value.reason == "shape_mismatch" and err.value.layer == "w"


def test_state_round_trips_and_reset_forgets():
    memory = ErrorFeedback()
    memory.update("w", torch.tensor([3.0, 4.0]), torch.tensor([1.0, 1.0]))
    restored = ErrorFeedback()
    restored.load_state_dict(memory.state_dict())
    assert torch.equal(restored.residual("w"), torch.tensor([2.0, 3.0]))
    memory.reset()
    assert memory.residual("w") is None and memory.state_dict() == {}


def test_no_memory_passes_gradients_through_and_owes_nothing():
    memory = NoMemory()
    grad = torch.ones(3)
    assert memory.compensate("w", grad) is grad
    memory.update("w", grad, torch.zeros(3))
    assert memory.residual("w") is None


def test_without_error_feedback_dropped_mass_is_lost(gradient):
    shapes = {"w": (50, 20)}
    codec = GradientCodec(registry.create("topk", ratio=0.01), NoMemory())
    grads = [{"w": gradient(shapes["w"], seed=s)} for s in range(5)]
    sent = sum(decode_tensors(codec.encode(g), shapes)["w"] for g in grads)
    total = sum(g["w"] for g in grads)
    assert float((sent - total).norm()) > 0.5 * float(total.norm())


def test_failed_encode_leaves_every_residual_untouched(gradient):
    codec = GradientCodec(registry.create("topk", ratio=0.1), ErrorFeedback())
    codec.encode({"a": gradient((20,), seed=1), "b": gradient((20,), seed=2)})
    before = codec.memory.state_dict()

    poisoned = {"a": gradient((20,), seed=3), "b": torch.full((20,), float("nan"))}
    with pytest.raises(CompressionError) as err:
        codec.encode(poisoned)

    assert err.value.reason == "non_finite" and err.value.layer == "b"
    after = codec.memory.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_dense_step_flushes_the_residual(gradient):
    codec = GradientCodec(registry.create("topk", ratio=0.05), ErrorFeedback())
    codec.encode({"w": gradient((100,), seed=1)})
    owed = codec.memory.residual("w").clone()
    assert float(owed.norm()) > 0

    grad = gradient((100,), seed=2)
    received = decode_tensors(codec.encode({"w": grad}, compress=False), {"w": (100,)})
    torch.testing.assert_close(received["w"], grad + owed)
    assert torch.count_nonzero(codec.memory.residual("w")) == 0
