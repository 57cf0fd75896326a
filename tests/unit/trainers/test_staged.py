"""Stage-split strategies ``pipeline_bp``, ``dni``, ``cdni`` (trainers/strategies/staged.py).

Three workers hold the three stages of a small MLP (8 -> 16 -> 16 -> 3, cut after "2" and
"4"); every process is behind a ``TrainingDriver`` and messages are real wire bytes on the
unit tests' bus (``fakes.FakeBus``) or handed to ``driver.handle`` directly.
"""

from __future__ import annotations

import copy
import io
import math
import struct
from typing import Any

import numpy as np
import pytest
import torch

from edgestream.trainers.driver import DriverConfig, Handled, TrainingDriver
from edgestream.trainers.errors import StrategyError
from edgestream.trainers.evaluation import evaluate
from edgestream.trainers.local import LocalTrainer
from edgestream.trainers.messages import UpdateMessage
from edgestream.trainers.models import build_model
from edgestream.trainers.stages import StageTrainer, compose, stage_trainer
from edgestream.trainers.strategies import StrategyContext, create
from edgestream.trainers.strategies.staged import StagedStrategy
from edgestream.trainers.wire import decode_update, encode_update
from tests.unit.trainers.fakes import JOB, BatchStream, FakeBus, Node, drive, pump, run_queued
from tests.unit.trainers.test_checkpoint import _assert_same_tree

FEATURES, CLASSES = 8, 3
WORKERS = ("w0", "w1", "w2")
HIDDEN, BOUNDARIES = (16, 16), ("2", "4")
WIDTH = 16  # activation width at both boundaries
LR, MOMENTUM = 0.1, 0.9


def _trainer(stage: int, seed: int = 0) -> StageTrainer:
    model = build_model("mlp", (FEATURES,), CLASSES, seed=seed, hidden=HIDDEN)
    return stage_trainer(model, BOUNDARIES, stage, (FEATURES,), CLASSES, lr=LR, momentum=MOMENTUM)


def _node(bus: FakeBus | None, name: str, strategy: str, *, config: DriverConfig | None = None,
          batches: BatchStream | None = None, seed: int = 0, **params: Any) -> Node:
    trainer = _trainer(WORKERS.index(name), seed)
    ctx = StrategyContext(worker_id=name, trainer=trainer, members=WORKERS)
    driver = TrainingDriver(name, trainer, create(strategy, ctx, **params), config or DriverConfig(job=JOB))
    if bus is not None:
        bus.subscribe(name, driver.strategy.subscribes, spec=driver.spec)
    return Node(name=name, driver=driver, batches=batches)


def _cluster(bus: FakeBus, strategy: str, **params: Any) -> list[Node]:
    return [_node(bus, name, strategy, **params) for name in WORKERS]


def _settle(bus: FakeBus, nodes: list[Node], now: float = 0.0) -> None:
    """Read and run queued steps until nothing moves."""
    for _ in range(100):
        moved = 0
        for node in nodes:
            moved += pump(bus, node, now=now)
            moved += run_queued(bus, node, now=now)
        if not moved:
            return
    raise AssertionError("the stages never settled")


def _toy(seed: int = 0, count: int = 600) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = 2.0 * np.random.default_rng(100).normal(size=(CLASSES, FEATURES))
    labels = rng.integers(0, CLASSES, count)
    features = centers[labels] + rng.normal(size=(count, FEATURES))
    return features.astype(np.float32), labels.astype(np.int64)


def _strategy(node: Node) -> StagedStrategy:
    assert isinstance(node.strategy, StagedStrategy)
    return node.strategy


def _forward(h: torch.Tensor, y: Any, *, sender: str = "w0", step: int = 1, meta: dict | None = None,
             tensors: dict | None = None) -> UpdateMessage:
    y = torch.as_tensor(y, dtype=torch.float32)
    return UpdateMessage(kind="activation", sender=sender, step=step, base_version=0, batch_size=int(h.shape[0]),
                         tensors={"h": h, "y": y} if tensors is None else tensors,
                         meta={"dir": "fwd", "inc": 0} if meta is None else meta)


def _backward(g: torch.Tensor, *, sender: str = "w2", step: int = 1, inc: int = 0) -> UpdateMessage:
    return UpdateMessage(kind="activation", sender=sender, step=step, base_version=0, batch_size=int(g.shape[0]),
                         tensors={"g": g}, meta={"dir": "bwd", "inc": inc})


def _wire(msg: UpdateMessage, to: str) -> bytes:
    return encode_update(msg, job=JOB, to=to)[0]


def _handle(node: Node, msg: UpdateMessage | bytes) -> Handled:
    return node.driver.handle(msg if isinstance(msg, bytes) else _wire(msg, node.name), node.name)


def _decoded(node: Node, value: bytes) -> UpdateMessage:
    return decode_update(value, expected_shapes=lambda kind: node.strategy.tensor_spec(kind, node.spec),
                         max_bytes=16 * 1024 * 1024, job=JOB, partial=lambda kind: True)


def _through_torch_save(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


H = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0))
Y = [0.0, 1.0, 2.0, 1.0]


# -- pipeline_bp is backprop ---------------------------------------------------------------------


def test_pipeline_bp_is_exactly_backprop_of_the_unsplit_model():
    bus = FakeBus()
    nodes = _cluster(bus, "pipeline_bp")
    reference = LocalTrainer(build_model("mlp", (FEATURES,), CLASSES, seed=0, hidden=HIDDEN), lr=LR,
                             momentum=MOMENTUM)
    x, y = _toy(1, 160)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 160, 16)]

    for features, labels in batches:
        assert nodes[0].driver.can_train()
        stepped = nodes[0].step(features, labels)
        assert stepped.rejection is None
        bus.publish("w0", stepped.outbound)
        assert not nodes[0].driver.can_train()  # one batch in flight in the pipeline
        _settle(bus, nodes)
        result = reference.compute_gradient(features, labels)
        reference.apply_gradient(result.gradients, buffer_deltas=result.buffer_deltas)

    assert [n.trainer.version for n in nodes] == [len(batches)] * 3
    assembled = dict(compose([n.trainer.model for n in nodes]).named_parameters())
    expected = dict(reference.model.named_parameters())
    assert assembled.keys() == expected.keys()
    for name, parameter in expected.items():
        assert torch.equal(assembled[name], parameter), name  # bitwise: the same arithmetic
    moved = [float((p - q).detach().abs().max()) for p, q in
             zip(expected.values(), build_model("mlp", (FEATURES,), CLASSES, seed=0, hidden=HIDDEN).parameters(),
                 strict=True)]
    assert min(moved) > 1e-4  # every layer trained


# -- dni / cdni learn ----------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["dni", "cdni"])
def test_synthetic_gradient_stages_learn_a_toy_problem(strategy):
    bus = FakeBus()
    x, y = _toy(0)
    nodes = _cluster(bus, strategy)
    nodes[0].batches = BatchStream(x, y, 32, seed=0)
    top = nodes[-1].driver.prequential

    scores: list[tuple[int, int]] = []  # (correct, records) of the top stage before each round

    drive(bus, nodes, steps=80, on_round=lambda _: scores.append((top.correct, top.records)))

    early = next(score for score in scores if score[1] >= 8 * 32)  # about the first 8 batches
    late = (top.correct - early[0]) / (top.records - early[1])

    x_test, y_test = _toy(5, 300)
    accuracy = evaluate(compose([n.trainer.model for n in nodes]), x_test, y_test).accuracy
    assert accuracy >= 0.8, accuracy  # chance is 1/3
    assert late > early[0] / early[1] + 0.1, (early, late)
    assert late >= 0.8
    for node in nodes[:-1]:
        strategy_ = _strategy(node)
        assert strategy_.synth is not None and strategy_.synth.trust > 0, node.name
        assert strategy_.counters["synth_updates"] > 0
    assert _strategy(nodes[-1]).synth is None


@pytest.mark.parametrize("strategy", ["dni", "cdni"])
def test_without_the_trust_gate_the_stages_still_run(strategy):
    bus = FakeBus()
    x, y = _toy(0)
    nodes = _cluster(bus, strategy, trust_gate=False)
    nodes[0].batches = BatchStream(x, y, 32, seed=0)

    drive(bus, nodes, steps=10)

    assert all(n.trainer.version > 0 for n in nodes)
    assert all(not n.step_rejections for n in nodes)
    assert _strategy(nodes[0]).counters["synth_updates"] == 10


# -- malformed activations -----------------------------------------------------------------------


def _waiting_middle(strategy: str = "dni", **params: Any) -> Node:
    """Stage 1 that has taken one forward ((0, 1) from w0) and awaits its activation's gradient."""
    node = _node(None, "w1", strategy, **params)
    assert _handle(node, _forward(H, Y)).rejection is None
    assert node.step_queued().rejection is None
    assert len(_strategy(node)._pending) == 1
    return node


MARKER = 1.2345  # appears once in a record, where a forgery overwrites it (the encoder refuses NaN)


def _marked(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[3] = MARKER
    return t


def _poisoned(msg: UpdateMessage, number: float) -> bytes:
    value = _wire(msg, "w1")
    packed = struct.pack("<f", MARKER)
    assert value.count(packed) == 1
    return value.replace(packed, struct.pack("<f", number))


MALFORMED: dict[str, tuple[Any, str]] = {
    "label_out_of_range": (lambda: _forward(H, [0, 1, 3, 1]), "out_of_range"),
    "negative_label": (lambda: _forward(H, [0, -1, 2, 1]), "out_of_range"),
    "label_not_integral": (lambda: _forward(H, [0, 1.5, 2, 1]), "out_of_range"),
    "batch_sizes_differ": (lambda: _forward(H, [0, 1, 2]), "shape_mismatch"),
    "nan_in_h": (lambda: _poisoned(_forward(_marked(H), Y), math.nan), "non_finite"),
    "inf_in_y": (lambda: _poisoned(_forward(H, [0, 1, MARKER, 1]), math.inf), "non_finite"),
    "nan_in_g": (lambda: _poisoned(_backward(_marked(torch.zeros(4, WIDTH))), math.nan), "non_finite"),
    "h_only": (lambda: _forward(H, Y, tensors={"h": H}), "unexpected_tensor"),
    "g_with_forward": (lambda: _forward(H, Y, tensors={"h": H, "y": torch.tensor(Y), "g": H}), "unexpected_tensor"),
    "unknown_name": (lambda: _forward(H, Y, tensors={"x": H, "y": torch.tensor(Y)}), None),
    "forward_from_the_next_stage": (lambda: _forward(H, Y, sender="w2"), "unexpected_tensor"),
    "forward_from_a_stranger": (lambda: _forward(H, Y, sender="w9"), "unexpected_tensor"),
    "no_dir": (lambda: _forward(H, Y, meta={"inc": 0}), "bad_meta"),
    "bad_dir": (lambda: _forward(H, Y, meta={"dir": "sideways", "inc": 0}), "bad_meta"),
    "no_inc": (lambda: _forward(H, Y, meta={"dir": "fwd"}), "bad_meta"),
    "negative_inc": (lambda: _forward(H, Y, meta={"dir": "fwd", "inc": -1}), "bad_meta"),
    "bool_inc": (lambda: _forward(H, Y, meta={"dir": "fwd", "inc": True}), "bad_meta"),
    "string_inc": (lambda: _forward(H, Y, meta={"dir": "fwd", "inc": "0"}), "bad_meta"),
    "gradient_batch_differs": (lambda: _backward(torch.zeros(3, WIDTH)), "shape_mismatch"),
    "gradient_from_the_previous_stage": (lambda: _backward(torch.zeros(4, WIDTH), sender="w0"), "unexpected_tensor"),
    "drop_from_the_previous_stage": (
        lambda: UpdateMessage(kind="activation", sender="w0", step=1, base_version=0,
                              meta={"dir": "drop", "inc": 0}), "unexpected_tensor"),
    "batch_above_max_batch": (
        lambda: _forward(torch.zeros(5, WIDTH), [0, 1, 2, 0, 1]), "shape_mismatch"),
}


@pytest.mark.parametrize("strategy", ["pipeline_bp", "dni", "cdni"])
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_activations_are_refused_before_any_state_changes(case, strategy):
    forge, reason = MALFORMED[case]
    node = _waiting_middle(strategy, max_batch=4)
    digest, version = node.trainer.parameter_digest(), node.trainer.version
    state = copy.deepcopy(_strategy(node).state_dict())
    refused = _strategy(node).counters["refused"]

    handled = _handle(node, forge())

    assert handled.rejection is not None, case
    if reason is not None:
        assert handled.rejection.reason == reason, handled.rejection
    assert handled.outbound == [] and handled.message is None
    assert (node.trainer.parameter_digest(), node.trainer.version) == (digest, version)
    after = _strategy(node).state_dict()
    # The only trace: the strategy counts what it refused itself (the driver's refusals it never sees).
    assert after["counters"].pop("refused", 0) - state["counters"].pop("refused", 0) in (0, 1)
    _assert_same_tree(after, state)
    assert _strategy(node).counters["refused"] - refused == (1 if reason not in ("non_finite", None) else 0)
    assert node.driver.queued_steps() == 0


def test_the_well_formed_messages_pass_the_same_checks():
    node = _waiting_middle("dni", max_batch=4)

    assert _handle(node, _forward(H, Y, step=2)).rejection is None
    assert _handle(node, _backward(torch.zeros(4, WIDTH))).rejection is None
    assert node.driver.queued_steps() == 1
    assert _strategy(node).counters["synth_updates"] == 1
    assert _strategy(node)._pending == {}


def test_the_top_and_bottom_stages_refuse_what_they_cannot_take():
    top, bottom = _node(None, "w2", "dni"), _node(None, "w0", "dni")

    assert _handle(top, _backward(torch.zeros(4, WIDTH), sender="w1")).rejection is not None  # no g spec
    assert _handle(bottom, _forward(H, Y, sender="w1")).rejection is not None  # no h spec
    assert _handle(top, _forward(H, Y, sender="w1")).rejection is None


# -- window and back-pressure --------------------------------------------------------------------


def test_dni_window_closes_after_max_in_flight_and_a_gradient_reopens_it():
    node = _node(None, "w0", "dni", max_in_flight=3)
    x, y = _toy(0, 64)
    sent = []
    for i in range(3):
        assert node.driver.can_train()
        stepped = node.step(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8])
        sent += [_decoded(_node(None, "w1", "dni"), o.value) for o in stepped.outbound]
    assert not node.driver.can_train()
    assert [(m.meta["dir"], m.meta["inc"], m.step) for m in sent] == [("fwd", 0, 1), ("fwd", 0, 2), ("fwd", 0, 3)]

    assert _handle(node, _backward(torch.zeros(8, WIDTH), sender="w1", step=2)).rejection is None

    assert node.driver.can_train()
    assert _strategy(node).stats()["in_flight"] == 2


def test_pipeline_bp_allows_one_activation_in_flight():
    node = _node(None, "w0", "pipeline_bp", max_in_flight=5)
    x, y = _toy(0, 16)

    node.step(x[:8], y[:8])

    assert not node.driver.can_train()
    assert _handle(node, _backward(torch.zeros(8, WIDTH), sender="w1")).rejection is None
    assert not node.driver.can_train()  # the gradient waits for its step
    assert node.driver.queued_steps() == 1
    assert node.step_queued().rejection is None
    assert node.driver.can_train() and node.trainer.version == 1


def test_a_middle_pipeline_bp_stage_takes_no_new_input_while_waiting():
    node = _waiting_middle("pipeline_bp")

    assert _handle(node, _forward(H, Y, step=2)).rejection is None

    assert node.driver.queued_steps() == 0 and not node.driver.can_train()
    assert _handle(node, _backward(torch.zeros(4, WIDTH))).rejection is None
    assert node.driver.queued_steps() == 1
    node.step_queued()
    assert node.driver.queued_steps() == 1  # now the second input


# -- expiry --------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["pipeline_bp", "dni"])
def test_an_unanswered_activation_expires_and_the_window_opens(strategy):
    node = _node(None, "w0", strategy, max_in_flight=1, ack_timeout_s=10.0)
    x, y = _toy(0, 8)
    node.poll(5.0)
    node.step(x, y)
    assert not node.driver.can_train()

    assert node.poll(15.0) == []  # 10 s: not yet
    assert not node.driver.can_train()
    assert node.poll(15.5) == []  # stage 0 has nobody to tell

    assert _strategy(node).counters["expired"] == 1
    assert node.driver.can_train()
    assert _handle(node, _backward(torch.zeros(8, WIDTH), sender="w1")).rejection is None
    assert _strategy(node).counters["unexpected_gradient"] == 1  # too late: ignored
    assert node.driver.queued_steps() == 0


def test_a_middle_pipeline_bp_stage_gives_up_upstream_when_its_activation_expires():
    node = _node(None, "w1", "pipeline_bp", ack_timeout_s=10.0)
    node.poll(0.0)
    _handle(node, _forward(H, Y, step=7, meta={"dir": "fwd", "inc": 2}))
    node.step_queued()

    out = node.poll(20.0)

    assert _strategy(node).counters["expired"] == 1
    assert [(o.to, o.kind) for o in out] == [("w0", "activation")]
    drop = _decoded(_node(None, "w0", "pipeline_bp"), out[0].value)
    assert (drop.sender, drop.step, drop.meta, drop.tensors) == ("w1", 7, {"dir": "drop", "inc": 2}, {})
    assert node.poll(30.0) == []  # once
    # The gradient that comes after all is ignored, and sends nothing on.
    assert _handle(node, _backward(torch.zeros(4, WIDTH))).rejection is None
    assert node.driver.queued_steps() == 0 and _strategy(node).counters["unexpected_gradient"] == 1


# -- drops and duplicates ------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["pipeline_bp", "dni"])
def test_a_refused_top_step_drops_its_input_upstream(strategy):
    bus = FakeBus()
    tiny = DriverConfig(job=JOB, max_grad_norm=1e-9)  # the top stage's every step is refused
    nodes = [_node(bus, "w0", strategy), _node(bus, "w1", strategy), _node(bus, "w2", strategy, config=tiny)]
    x, y = _toy(0, 8)
    bus.publish("w0", nodes[0].step(x, y).outbound)
    pump(bus, nodes[1])
    run_queued(bus, nodes[1])
    published = dict(bus.published)
    pump(bus, nodes[2])

    stepped = nodes[2].step_queued()

    assert stepped.rejection is not None and stepped.outbound == []
    assert nodes[2].trainer.version == 0
    assert bus.published == published
    out = nodes[2].poll(1.0)  # the drop leaves at the next poll (or step)
    assert [(o.to, _decoded(nodes[1], o.value).meta["dir"]) for o in out] == [("w1", "drop")]
    assert nodes[2].poll(2.0) == []
    bus.publish("w2", out)
    pump(bus, nodes[1])
    middle = _strategy(nodes[1])
    assert middle.counters["dropped_by_next"] == 1 and middle._pending == {}
    assert nodes[1].driver.queued_steps() == 0
    run_queued(bus, nodes[1])
    pump(bus, nodes[0])
    if strategy == "pipeline_bp":  # nor will its own input's gradient come: w0 is told
        assert _strategy(nodes[0]).counters["dropped_by_next"] == 1
        assert nodes[0].driver.can_train()
    else:  # dni: w1 answered w0 at its step (backprop of its synthetic gradient)
        assert _strategy(nodes[0]).counters["dropped_by_next"] == 0
        assert _strategy(nodes[0]).counters["synth_updates"] == 1
    assert _strategy(nodes[0])._pending == {}
    # A second copy of the drop changes nothing.
    bus.publish("w2", out)
    pump(bus, nodes[1])
    assert middle.counters["dropped_by_next"] == 1


def test_a_drop_leaves_with_the_next_step_if_that_comes_first():
    tiny = DriverConfig(job=JOB, max_grad_norm=1e-9)
    top = _node(None, "w2", "dni", config=tiny)
    _handle(top, _forward(H, Y, sender="w1", step=1))
    _handle(top, _forward(H, Y, sender="w1", step=2))
    assert top.step_queued().rejection is not None
    top.driver.guard.max_norm = 1e4  # the next one passes

    stepped = top.step_queued()

    assert stepped.rejection is None
    middle = _node(None, "w1", "dni")
    sent = [_decoded(middle, o.value) for o in stepped.outbound]
    assert [(m.meta["dir"], m.step) for m in sent] == [("drop", 1), ("bwd", 2)]
    assert top.poll(1.0) == []


def test_duplicate_forwards_and_gradients_are_ignored():
    node = _waiting_middle("dni")

    assert _handle(node, _forward(H, Y)).rejection is None  # (0, 1) again
    assert _strategy(node).counters["duplicate"] == 1 and node.driver.queued_steps() == 0
    assert _handle(node, _backward(torch.ones(4, WIDTH) * 1e-3)).rejection is None
    state = copy.deepcopy(_strategy(node).synth.state_dict())  # type: ignore[union-attr]
    assert _handle(node, _backward(torch.ones(4, WIDTH) * 1e-3)).rejection is None
    assert _strategy(node).counters["unexpected_gradient"] == 1
    assert _strategy(node).counters["synth_updates"] == 1
    _assert_same_tree(_strategy(node).synth.state_dict(), state)  # type: ignore[union-attr]


# -- restarts ------------------------------------------------------------------------------------


def _rebuilt(node: Node, state: dict, trainer_state: dict | None = None, **params: Any) -> Node:
    fresh = _node(None, node.name, node.strategy.name, seed=1, **params)
    if trainer_state is not None:
        fresh.trainer.load_state_dict(trainer_state)
    fresh.strategy.load_state_dict(_through_torch_save(state))
    return fresh


@pytest.mark.parametrize("strategy", ["pipeline_bp", "dni", "cdni"])
def test_state_dict_round_trips_queued_inputs_pending_activations_and_answers(strategy):
    middle = _waiting_middle(strategy)  # one pending activation
    assert _handle(middle, _forward(H * 2, Y, step=2)).rejection is None  # one queued input
    assert _handle(middle, _backward(torch.full((4, WIDTH), 1e-3))).rejection is None  # pipeline_bp: an answer
    state = _strategy(middle).state_dict()
    if strategy == "pipeline_bp":
        assert len(state["answers"]) == 1 and len(state["pending"]) == 1
        assert state["pending"][0]["source_sender"] == "w0" and "inputs" in state["pending"][0]
    else:
        assert state["pending"] == [] and state["synth"]["updates"] == 1
    assert len(state["inputs"]) == 1

    fresh = _rebuilt(middle, state)

    _assert_same_tree(_strategy(fresh).state_dict(), state)
    assert fresh.driver.queued_steps() == middle.driver.queued_steps() == 1


def test_a_restored_stage_takes_a_new_incarnation_and_is_not_taken_for_a_duplicate():
    bottom = _node(None, "w0", "dni")
    trainer_state = copy.deepcopy(bottom.trainer.state_dict())
    state = copy.deepcopy(_strategy(bottom).state_dict())
    x, y = _toy(0, 8)
    middle = _node(None, "w1", "dni")
    first = bottom.step(x, y).outbound
    assert middle.driver.handle(first[0].value, "w1").rejection is None

    replayed = _rebuilt(bottom, state, trainer_state)  # without on_restore: the same (inc, step)
    again = replayed.step(x, y).outbound
    assert again[0].value == first[0].value
    assert middle.driver.handle(again[0].value, "w1").rejection is None
    assert _strategy(middle).counters["duplicate"] == 1

    restored = _rebuilt(bottom, state, trainer_state)
    assert restored.driver.restored() == []
    new = restored.step(x, y).outbound
    message = _decoded(middle, new[0].value)
    assert (message.meta["inc"], message.step) == (1, 1)
    assert middle.driver.handle(new[0].value, "w1").rejection is None
    assert _strategy(middle).counters["duplicate"] == 1
    assert middle.driver.queued_steps() == 2


def test_a_pipeline_bp_stage_restored_while_waiting_redoes_its_forward_and_sends_the_same_gradient():
    bus = FakeBus()
    nodes = _cluster(bus, "pipeline_bp")
    x, y = _toy(2, 48)
    bus.publish("w0", nodes[0].step(x[:16], y[:16]).outbound)  # one full round first: nonzero momentum
    _settle(bus, nodes)
    bus.publish("w0", nodes[0].step(x[16:], y[16:]).outbound)
    pump(bus, nodes[1])
    run_queued(bus, nodes[1])  # w1 forwarded and waits
    middle = nodes[1]
    trainer_state = copy.deepcopy(middle.trainer.state_dict())
    state = copy.deepcopy(_strategy(middle).state_dict())
    pump(bus, nodes[2])
    run_queued(bus, nodes[2])
    gradient = [r for r in bus.fetch("w1") if r.to == "w1"]
    assert len(gradient) == 1

    middle.handle(gradient[0])
    original = middle.step_queued()
    restored = _rebuilt(middle, state, trainer_state)
    restored.driver.restored()
    restored.handle(gradient[0])
    again = restored.step_queued()

    assert original.rejection is None and again.rejection is None
    assert [o.value for o in again.outbound] == [o.value for o in original.outbound]
    assert len(original.outbound) == 1 and _decoded(nodes[0], original.outbound[0].value).meta["dir"] == "bwd"
    assert restored.trainer.parameter_digest() == middle.trainer.parameter_digest()
    assert restored.trainer.version == middle.trainer.version == 2


# -- construction --------------------------------------------------------------------------------


def test_a_whole_model_trainer_is_refused_naming_train_stages():
    trainer = LocalTrainer(build_model("mlp", (FEATURES,), CLASSES, seed=0, hidden=HIDDEN))
    for name in ("pipeline_bp", "dni", "cdni"):
        with pytest.raises(StrategyError, match="train.stages"):
            create(name, StrategyContext("w0", trainer, members=WORKERS))


def test_one_worker_per_stage_is_required():
    with pytest.raises(StrategyError, match="one worker per stage"):
        create("dni", StrategyContext("w1", _trainer(1), members=("w0", "w1")))
    with pytest.raises(StrategyError, match="one worker per stage"):
        create("dni", StrategyContext("w1", _trainer(2), members=WORKERS))  # stage 2's model on w1
    with pytest.raises(StrategyError, match="not one of the stages"):
        create("dni", StrategyContext("w5", _trainer(1), members=WORKERS))
    with pytest.raises(StrategyError, match="max_in_flight"):
        create("dni", StrategyContext("w1", _trainer(1), members=WORKERS), max_in_flight=0)
