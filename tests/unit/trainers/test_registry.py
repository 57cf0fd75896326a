"""Strategy registry, plus the conformance checks every registered strategy and role must pass."""

from __future__ import annotations

import json

import pytest

from edgestream.trainers.checkpoint import restore_training_checkpoint, save_training_checkpoint
from edgestream.trainers.errors import StrategyError, UnknownStrategyError
from edgestream.trainers.messages import CHANNELS
from edgestream.trainers.stages import stage_trainer
from edgestream.trainers.strategies import (
    StrategyContext,
    SyncStrategy,
    base,
    create,
    names,
    register,
    roles,
    stage_split_names,
    strategy_class,
    subscribing,
)
from edgestream.trainers.strategies.asp import ASPServer, ASPWorker
from edgestream.trainers.strategies.bsp import BSPStrategy
from edgestream.trainers.strategies.staged import DNIStrategy
from tests.unit.trainers.test_checkpoint import _assert_same_tree

ALL_ROLES = [(name, role) for name in names() for role in roles(name)]


def _trainer_for(name, make_trainer, seed=0):
    """The trainer strategy ``name`` runs on alone: the whole model, as a one-stage split
    for the strategies whose workers hold one stage each."""
    trainer = make_trainer(seed=seed)
    if name in stage_split_names():
        return stage_trainer(trainer.model, [], 0, (64,), 10, lr=0.1, momentum=0.9)
    return trainer


def test_the_issue_strategies_are_registered_with_their_roles():
    assert {"bsp", "asp"} <= set(names())
    assert roles("bsp") == ("worker",)
    assert roles("asp") == ("worker", "server")


def test_unknown_strategy_names_list_what_is_available(make_trainer):
    ctx = StrategyContext(worker_id="w0", trainer=make_trainer())

    with pytest.raises(UnknownStrategyError) as caught:
        create("nope", ctx)

    assert caught.value.available == names()
    assert "bsp" in str(caught.value)


def test_a_role_the_strategy_does_not_play_is_refused(make_trainer):
    ctx = StrategyContext(worker_id="server", trainer=make_trainer(), role="server")

    with pytest.raises(UnknownStrategyError, match="role 'server'"):
        create("bsp", ctx)


def test_registering_a_name_twice_is_refused():
    with pytest.raises(StrategyError, match="already registered"):
        register("bsp")(lambda ctx: None)


def test_unknown_strategy_parameters_are_refused(make_trainer):
    ctx = StrategyContext(worker_id="w0", trainer=make_trainer())

    with pytest.raises((StrategyError, TypeError)):
        create("asp", ctx, max_stalenes=3)


@pytest.mark.parametrize(("name", "role"), ALL_ROLES)
def test_conformance_fresh_instance_subscribes_and_reports_json_stats(make_trainer, name, role):
    strategy = create(name, StrategyContext(worker_id="n0", trainer=_trainer_for(name, make_trainer), role=role,
                                            members=("n0",)))

    assert isinstance(strategy, SyncStrategy)
    assert strategy.role == role and strategy.name == name
    assert set(strategy.subscribes) <= CHANNELS
    assert strategy.poll(0.0) == []  # a fresh, synced instance has no timer due
    stats = json.loads(json.dumps(strategy.stats()))
    assert {"strategy", "role", "worker", "version", "staleness", "counters"} <= stats.keys()
    restore = strategy.on_restore()  # a restart with no peers: nothing to re-send, or Outgoing items
    assert isinstance(restore, list) and all(o.channel in CHANNELS for o in restore)
    assert {"count", "mean", "max", "p99"} <= stats["staleness"].keys()


@pytest.mark.parametrize(("name", "role"), ALL_ROLES)
def test_conformance_state_round_trips_through_a_checkpoint(tmp_path, make_trainer, digits, name, role):
    trainer = _trainer_for(name, make_trainer)
    strategy = create(name, StrategyContext(worker_id="n0", trainer=trainer, role=role, members=("n0",)))
    if strategy.can_train():
        for outgoing in strategy.on_local_step(trainer.compute_gradient(digits.x_train[:8], digits.y_train[:8])):
            strategy.on_message(outgoing.message)
    save_training_checkpoint(tmp_path / "s.ckpt", trainer, strategy, offsets={"t:0": 1})
    fresh_trainer = _trainer_for(name, make_trainer, seed=3)
    fresh = create(name, StrategyContext(worker_id="n0", trainer=fresh_trainer, role=role, members=("n0",)))

    restore_training_checkpoint(tmp_path / "s.ckpt", fresh_trainer, fresh)

    _assert_same_tree(fresh.state_dict(), strategy.state_dict())
    assert fresh.stats() == strategy.stats()
    assert fresh_trainer.parameter_digest() == trainer.parameter_digest()


# -- one registration, classes and functions alike: the registry reads the built classes' ClassVars --

CLASSVARS = ("name", "role", "subscribes", "evaluates_model", "preferred_batcher", "background_sends",
             "replicas_identical", "stage_split")


@pytest.mark.parametrize(("name", "role"), ALL_ROLES)
def test_the_registry_knows_the_class_each_strategy_builds_and_its_classvars(make_trainer, name, role):
    built = create(name, StrategyContext(worker_id="n0", trainer=_trainer_for(name, make_trainer), role=role,
                                         members=("n0",)))

    declared = strategy_class(name, role)
    assert type(built) is declared
    assert {v: getattr(built, v) for v in CLASSVARS} == {v: getattr(declared, v) for v in CLASSVARS}
    if role == "worker":  # what the runtime and the Helm chart read of a strategy's workers
        assert (name in stage_split_names()) == built.stage_split
        assert {channel for channel in CHANNELS if name in subscribing(channel)} == set(built.subscribes)


def test_strategies_registered_as_functions_are_seen_like_classes(monkeypatch):
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))

    register("test-fn-staged", builds=(DNIStrategy,))(lambda ctx, **params: DNIStrategy(ctx, **params))
    register("test-fn-asp", builds=(ASPWorker, ASPServer))(lambda ctx: ASPWorker(ctx))

    assert "test-fn-staged" in stage_split_names() and "test-fn-staged" in subscribing("inbox")
    assert roles("test-fn-asp") == ("worker", "server") and "test-fn-asp" in subscribing("models")
    assert strategy_class("test-fn-asp", "server") is ASPServer


def test_a_function_registered_without_the_classes_it_builds_is_refused(monkeypatch):
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))

    with pytest.raises(StrategyError, match="declare the classes it builds"):
        register("test-fn-blind")(lambda ctx: ASPWorker(ctx))
    with pytest.raises(StrategyError, match="two classes for role 'worker'"):
        register("test-fn-twice", builds=(ASPWorker, BSPStrategy))(lambda ctx: ASPWorker(ctx))
    assert "test-fn-blind" not in names() and "test-fn-twice" not in names()
