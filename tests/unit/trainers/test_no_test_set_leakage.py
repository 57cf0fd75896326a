"""The held-out test split, on which accuracy is reported, cannot steer training.

Every registered strategy runs twice on the simulated clock, once with the real held-out
split and once with a held-out split of noise (random features, random labels): the
models every process ends with must be bit-identical, while the reported accuracy
differs (the split is read, for reporting). Whatever a strategy, controller or driver
hook decides, it cannot have read the test split. Strategies that decide from a score
(``uses_validation``) are then shown to read the validation split: poisoning it changes
their training, so the first assertion is not vacuous for them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from edgestream.streams.datasets import Dataset
from edgestream.trainers import simclock, strategies
from edgestream.trainers.plan import TrainingPlan
from edgestream.trainers.simclock import Mode, RunConfig, StreamSet

# Registered by other test modules in this interpreter (not shipped strategies).
SHIPPED = [name for name in strategies.names() if not name.startswith(("test-", "byzantine-"))]
STAGES = ("2",)  # the mlp cut after its first layer: two stage workers
BUDGET_S = 8.0
REPORT = simclock._Simulation._report


@pytest.fixture(scope="module")
def streams() -> StreamSet:
    return StreamSet.from_fleet("digits", (40.0, 30.0, 20.0), seed=0, message_interval_s=0.1)


@pytest.fixture(scope="module")
def stage_streams() -> StreamSet:
    """One device per stage worker (the simulated clock runs one worker per device)."""
    return StreamSet.from_fleet("digits", (40.0, 30.0), seed=0, message_interval_s=0.1)


def _streams_for(name: str, streams: StreamSet, stage_streams: StreamSet) -> StreamSet:
    return stage_streams if name in strategies.stage_split_names() else streams


def _noise(ds: Dataset, seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    return Dataset(rng.random(ds.features.shape, dtype=np.float32),
                   rng.integers(0, ds.num_classes, len(ds)).astype(np.int64), ds.num_classes, ds.name + "-noise")


def _poisoned(streams: StreamSet, split: str) -> StreamSet:
    data = streams.data
    return dataclasses.replace(streams, data=dataclasses.replace(data, **{split: _noise(getattr(data, split), 7)}))


def _run(name: str, streams: StreamSet, monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict[str, torch.Tensor]], list]:
    """(every process's final parameters, the reported accuracy timeline) of one short run."""
    stage_split = name in strategies.stage_split_names()
    config = RunConfig(time_budget_s=BUDGET_S, target_accuracy=None, eval_every_s=0.5, seed=0,
                       plan=TrainingPlan(stages=STAGES) if stage_split else TrainingPlan())
    final: list[dict[str, torch.Tensor]] = []

    def keep_parameters(self, stopped):
        final.extend({k: t.detach().clone() for k, t in p.driver.trainer.model.state_dict().items()}
                     for p in self.processes)
        return REPORT(self, stopped)

    monkeypatch.setattr(simclock._Simulation, "_report", keep_parameters)
    result = simclock.run(Mode(name, name, batch_size=16), streams, simclock.CostModel(), config)
    return final, [accuracy for _, accuracy, _ in result.timeline]


def _same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("validation", [True, False], ids=["with-validation", "without"])
@pytest.mark.parametrize("name", SHIPPED)
def test_a_test_split_of_noise_changes_the_report_and_nothing_else(name, validation, streams, stage_streams,
                                                                    monkeypatch):
    streams = _streams_for(name, streams, stage_streams)
    if not validation:  # no other score to mask a leak: a strategy would decide from the test split alone
        streams = dataclasses.replace(streams, data=dataclasses.replace(streams.data, validation=None))
    trained, timeline = _run(name, streams, monkeypatch)
    trained_on_noise, timeline_on_noise = _run(name, _poisoned(streams, "heldout"), monkeypatch)

    assert trained and _same(trained, trained_on_noise), f"{name}: the held-out split changed training"
    assert timeline != timeline_on_noise  # it was read, for the report


@pytest.mark.parametrize("name", [n for n in SHIPPED if n not in strategies.stage_split_names()
                                  and strategies.strategy_class(n, strategies.roles(n)[0]).uses_validation])
def test_a_strategy_that_decides_from_a_score_reads_the_validation_split(name, streams, monkeypatch):
    trained, _ = _run(name, streams, monkeypatch)
    trained_on_noise, _ = _run(name, _poisoned(streams, "validation"), monkeypatch)

    assert not _same(trained, trained_on_noise)


def test_the_score_strategies_are_the_ones_documented():
    # docs/training.md: EdgeGossip's mixing and plateau decay, DLion's knowledge transfer.
    uses = {n for n in SHIPPED for role in strategies.roles(n) if strategies.strategy_class(n, role).uses_validation}
    assert {"edgegossip", "dlion"} <= uses


@pytest.mark.parametrize("name", SHIPPED)
def test_evaluate_hands_nothing_to_the_strategy_and_validate_does(name, streams, stage_streams):
    streams = _streams_for(name, streams, stage_streams)
    stage_split = name in strategies.stage_split_names()
    config = RunConfig(plan=TrainingPlan(stages=STAGES) if stage_split else TrainingPlan())
    drivers = simclock.processes(Mode(name, name, batch_size=16), streams, config)
    heldout, validation = streams.data.heldout, streams.data.validation
    assert validation is not None
    for driver in drivers.values():
        if not driver.strategy.evaluates_model:
            continue
        heard: list[tuple[float, float]] = []
        driver.strategy.on_evaluation = lambda accuracy, loss, heard=heard: heard.append((accuracy, loss)) or []
        driver.evaluate(heldout.features, heldout.labels)
        assert heard == []
        scored, _ = driver.validate(validation.features, validation.labels)
        assert heard == [(scored.accuracy, scored.loss)]


def test_the_three_splits_are_disjoint_and_validation_is_never_streamed(streams):
    data = streams.data
    assert data.validation is not None and len(data.validation) > 0

    def rows(ds: Dataset) -> set[bytes]:
        return {row.tobytes() for row in ds.features.reshape(len(ds), -1)}

    streamed = set().union(*(rows(data.train.subset(idx)) for idx in data.shares.values()))
    assert not rows(data.validation) & streamed
    assert not rows(data.validation) & rows(data.heldout)
    assert not rows(data.heldout) & streamed
