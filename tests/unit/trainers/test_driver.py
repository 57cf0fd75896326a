"""The training driver's plumbing for strategies that pick their own entries (DLion):
``meta["sparse"]`` messages on the lossless ``nonzero`` codec, and ``on_arrival``."""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import pytest
import torch

from edgestream.trainers.driver import DriverConfig, TrainingDriver
from edgestream.trainers.local import LocalTrainer, StepResult
from edgestream.trainers.messages import Outgoing, UpdateMessage
from edgestream.trainers.models import build_model
from edgestream.trainers.strategies import StrategyContext, SyncStrategy

JOB = "test"


class Recorder(SyncStrategy):
    """Takes partial gradients, applies nothing, records what the driver hands it."""

    name: ClassVar[str] = "recorder"
    role: ClassVar[str] = "worker"
    subscribes: ClassVar[tuple[str, ...]] = ("gradients", "inbox")

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.messages: list[UpdateMessage] = []
        self.arrivals: list[tuple[str, int, float]] = []
        self.events: list[str] = []

    def can_train(self) -> bool:
        return False

    def on_local_step(self, result: StepResult) -> list[Outgoing]:
        return []

    def on_message(self, msg: UpdateMessage) -> list[Outgoing]:
        self.messages.append(msg)
        self.events.append("message")
        return []

    def on_arrival(self, peer: str, nbytes: int, seconds: float) -> None:
        self.arrivals.append((peer, nbytes, seconds))
        self.events.append("arrival")

    def accepts_partial(self, kind: str) -> bool:
        return kind == "gradient"


def _driver(name: str, codec: str = "dense", **params: float) -> TrainingDriver:
    trainer = LocalTrainer(build_model("mlp", (64,), 10, seed=0, hidden=(256,)), lr=0.1)
    strategy = Recorder(StrategyContext(worker_id=name, trainer=trainer, members=("a", "b")))
    return TrainingDriver(name, trainer, strategy, DriverConfig(job=JOB, codec=codec, codec_params=dict(params)))


def _sparse_like(tensor: torch.Tensor, density: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(tensor.shape, generator=gen) * 1e-2
    return torch.where(torch.rand(tensor.shape, generator=gen) < density, values, torch.zeros(()))


def _gradient(sender: str, tensors: dict[str, torch.Tensor], **meta: object) -> UpdateMessage:
    return UpdateMessage(kind="gradient", sender=sender, step=1, base_version=0, batch_size=8,
                         tensors=tensors, meta=dict(meta))


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().reshape(-1).contiguous().view(torch.int32).numpy()


def test_sparse_partial_gradient_round_trips_exactly_and_small():
    sender, receiver = _driver("a"), _driver("b")
    params = sender.trainer.get_parameters()
    partial = {n: _sparse_like(params[n], 0.01, i) for i, n in enumerate(("1.weight", "3.weight"))}
    partial["1.weight"][0, :3] = torch.tensor([-0.0, 0.0, 2.5])

    (out,) = sender.encode([Outgoing("inbox", _gradient("a", partial, sparse=True), to="b")])
    assert out.codec == "nonzero" and out.compressed
    assert out.headers["edgestream.codec"] == b"nonzero"
    assert out.dense_bytes == 4 * sum(t.numel() for t in partial.values())
    assert len(out.value) * 10 < out.dense_bytes

    handled = receiver.handle(out.value, out.to)
    assert handled.rejection is None
    (got,) = receiver.strategy.messages
    assert set(got.tensors) == set(partial) and got.meta["sparse"] is True
    for name, tensor in partial.items():
        assert np.array_equal(_bits(got.tensors[name]), _bits(tensor))


def test_sparse_message_ignores_the_job_codec_and_leaves_link_residuals_alone():
    driver = _driver("a", "topk", ratio=0.01)
    params = driver.trainer.get_parameters()
    dense = {n: torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) for n, t in params.items()}
    (first,) = driver.encode([Outgoing("inbox", _gradient("a", dense), to="b")])
    assert first.codec == "topk"
    links = dict(driver._codecs)
    residual = {n: links[("b", "gradient")].memory.residual(n).clone() for n in dense}

    partial = {"1.weight": _sparse_like(params["1.weight"], 0.05, 2)}
    outs = driver.encode([Outgoing("inbox", _gradient("a", partial, sparse=True), to="b"),
                          Outgoing("gradients", _gradient("a", partial, sparse=True, compress=False))])
    assert [o.codec for o in outs] == ["nonzero", "nonzero"]
    assert all(o.setting is None for o in outs)
    assert driver._codecs == links  # no new link codec (not even for the broadcast)
    for n in dense:
        assert torch.equal(links[("b", "gradient")].memory.residual(n), residual[n])

    receiver = _driver("b", "topk", ratio=0.01)
    assert receiver.handle(outs[0].value, "b").rejection is None
    assert torch.equal(receiver.strategy.messages[0].tensors["1.weight"], partial["1.weight"])


def test_unmarked_gradient_still_takes_its_link_codec():
    driver = _driver("a", "topk", ratio=0.1)
    params = driver.trainer.get_parameters()
    (out,) = driver.encode([Outgoing("inbox", _gradient("a", dict(params), sparse=False), to="b")])
    assert out.codec == "topk"


def test_on_arrival_gets_sender_size_and_transit_before_on_message():
    sender, receiver = _driver("a"), _driver("b")
    partial = {"3.bias": torch.ones(10)}
    (out,) = sender.encode([Outgoing("gradients", _gradient("a", partial, sparse=True))])

    receiver.handle(out.value, transit_s=0.25)
    assert receiver.strategy.arrivals == [("a", len(out.value), 0.25)]
    assert receiver.strategy.events == ["arrival", "message"]


@pytest.mark.parametrize("transit", [None, 0.0, -1.0, math.nan, math.inf])
def test_on_arrival_needs_a_positive_finite_transit(transit):
    sender, receiver = _driver("a"), _driver("b")
    (out,) = sender.encode([Outgoing("gradients", _gradient("a", {"3.bias": torch.ones(10)}))])
    assert receiver.handle(out.value, transit_s=transit).rejection is None
    assert receiver.strategy.arrivals == [] and len(receiver.strategy.messages) == 1


def test_on_arrival_not_called_for_rejected_or_skipped_records():
    sender, receiver = _driver("a"), _driver("b")
    (out,) = sender.encode([Outgoing("inbox", _gradient("a", {"3.bias": torch.ones(10)}), to="c")])
    assert receiver.handle(out.value, out.to, transit_s=1.0).skipped
    assert receiver.handle(b"garbage", transit_s=1.0).rejection is not None
    bad = _gradient("a", {"3.bias": torch.ones(11)})  # wrong shape
    (wrong,) = sender.encode([Outgoing("gradients", bad)])
    assert receiver.handle(wrong.value, transit_s=1.0).rejection is not None
    assert receiver.strategy.arrivals == [] and receiver.strategy.messages == []


def test_next_step_says_queued_before_stream_and_none_when_neither_is_allowed():
    class Gate:
        queued, allowed = 0, False

    gate = Gate()

    class Probe:
        def queued_steps(self) -> int:
            return gate.queued

        def can_train(self) -> bool:
            return gate.allowed

    driver = TrainingDriver.__new__(TrainingDriver)
    driver.queued_steps = Probe().queued_steps  # type: ignore[method-assign]
    driver.can_train = Probe().can_train  # type: ignore[method-assign]

    assert driver.next_step() is None
    gate.allowed = True
    assert driver.next_step() == "stream"
    gate.queued = 2
    assert driver.next_step() == "queued"
