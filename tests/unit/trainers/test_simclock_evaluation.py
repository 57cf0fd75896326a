"""When an evaluation happens on the simulated clock, and what it costs.

A local step's result is visible to evaluations only when its modelled compute ends; an
evaluation in the middle of a step sees the model as it was at the step's start, and
leaves the model exactly as it found it. Scoring a model on the validation split (a
strategy with ``uses_validation``) costs its node ``CostModel.eval_s`` of busy time, taken
by the node between steps, never during one, and a node whose scoring outlasts the
evaluation interval still steps between two scorings.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from edgestream.trainers import simclock
from edgestream.trainers.simclock import CostModel, Mode, RunConfig, StreamSet

STEP_S = 2.0


@pytest.fixture(scope="module")
def streams() -> StreamSet:
    return StreamSet.from_fleet("digits", (40.0, 40.0), seed=0, message_interval_s=0.1)


def _config(**kw) -> RunConfig:
    return RunConfig(**{"time_budget_s": 8.0, "target_accuracy": None, "eval_every_s": 0.5, "seed": 0, **kw})


def _w0(report: simclock.RunReport) -> simclock.ProcessReport:
    return next(p for p in report.processes if p.name == "w0")


def test_a_local_step_shows_in_evaluations_only_when_its_compute_ends(streams):
    # Local SGD applies a worker's own gradient as the step is taken: the model changes at
    # the step's start, but the result exists only STEP_S later.
    costs = CostModel(compute_base_s=STEP_S, compute_per_record_s=0.0)
    report = simclock.run(Mode("localsgd", "localsgd", batch_size=16), streams, costs, _config())

    first_end = _w0(report).step_starts[0] + STEP_S
    during = [(acc, version) for t, acc, version in report.timeline if t < first_end]
    after = [(acc, version) for t, acc, version in report.timeline if t >= first_end]
    assert len(during) >= 3 and after
    assert {version for _, version in during} == {0}
    assert len({acc for acc, _ in during}) == 1  # the initial model, however often it is asked
    assert after[0][1] >= 1


def _final_parameters(mode: Mode, streams: StreamSet, costs: CostModel, config: RunConfig,
                      monkeypatch: pytest.MonkeyPatch) -> list[dict[str, torch.Tensor]]:
    final: list[dict[str, torch.Tensor]] = []
    report = simclock._Simulation._report

    def keep(self, stopped):
        final.extend({k: v.clone() for k, v in p.driver.trainer.model.state_dict().items()} for p in self.processes)
        return report(self, stopped)

    with monkeypatch.context() as patch:
        patch.setattr(simclock._Simulation, "_report", keep)
        simclock.run(mode, streams, costs, config)
    return final


@pytest.mark.parametrize("strategy", ["localsgd", "gossip", "bsp"])
def test_evaluating_during_steps_leaves_training_exactly_as_it_was(strategy, streams, monkeypatch):
    costs = CostModel(compute_base_s=0.7, compute_per_record_s=0.0)
    mode = Mode(strategy, strategy, batch_size=16)
    often = _final_parameters(mode, streams, costs, _config(eval_every_s=0.25, evaluate_workers=True), monkeypatch)
    never = _final_parameters(mode, streams, costs, _config(eval_every_s=100.0), monkeypatch)

    assert len(often) == len(never) > 0
    for a, b in zip(often, never, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def _scoring_run(streams: StreamSet, eval_fraction: float, monkeypatch: pytest.MonkeyPatch):
    """A run of EdgeGossip (it decides from validation scores); every scoring's
    ``(worker, time, busy before, busy after)``."""
    costs = CostModel(compute_base_s=0.05, compute_per_record_s=0.002, slowdowns=(1.0, 4.0),
                      eval_fraction=eval_fraction)
    calls: list[tuple[str, float, bool, bool]] = []
    score = simclock._Simulation._score

    def watched(self, process):
        before = process.busy
        kept = score(self, process)
        calls.append((process.name, self.now, before, kept))
        return kept

    with monkeypatch.context() as patch:
        patch.setattr(simclock._Simulation, "_score", watched)
        report = simclock.run(Mode("edgegossip", "edgegossip", batch_size=16), streams, costs, _config())
    return costs, report, calls


def test_scoring_on_the_validation_split_keeps_the_node_busy_for_eval_s(streams, monkeypatch):
    costs, report, calls = _scoring_run(streams, 0.5, monkeypatch)
    validation = len(streams.data.validation)

    for index, name in enumerate(("w0", "w1")):
        process = next(p for p in report.processes if p.name == name)
        eval_s = costs.eval_s(index, validation)
        assert eval_s == pytest.approx((0.05 + 0.002 * validation) * (1.0, 4.0)[index] * 0.5)
        scorings = [(t, kept) for who, t, _, kept in calls if who == name]
        assert len(scorings) == process.scorings >= 3 and all(kept for _, kept in scorings)
        assert process.scoring_s == pytest.approx(process.scorings * eval_s)
        # no step starts while the node scores: each scoring holds it for eval_s
        for t, _ in scorings:
            assert not any(t < start < t + eval_s - 1e-9 for start in process.step_starts), (name, t)
        whole = sum(min(eval_s, report.sim_time_s - t) for t, _ in scorings)
        assert process.busy_s >= whole - 1e-9
        total = process.busy_s + process.blocked_s + process.starved_s + process.absent_s
        assert total == pytest.approx(report.sim_time_s)
    assert not any(busy for _, _, busy, _ in calls)  # never in the middle of a step


def test_free_scoring_costs_nothing_and_the_counts_stay(streams, monkeypatch):
    _, report, calls = _scoring_run(streams, 0.0, monkeypatch)

    for process in report.processes:
        assert process.scoring_s == 0.0 and process.scorings > 0
    assert not any(busy or kept for _, _, busy, kept in calls)


def test_without_a_validation_split_nothing_is_scored(streams):
    bare = dataclasses.replace(streams, data=dataclasses.replace(streams.data, validation=None))
    report = simclock.run(Mode("edgegossip", "edgegossip", batch_size=16), bare, CostModel(), _config())

    assert all(p.scorings == 0 and p.scoring_s == 0.0 for p in report.processes)


def test_eval_fraction_must_be_a_finite_share():
    with pytest.raises(ValueError, match="cost model values"):
        CostModel(eval_fraction=-0.1)


def test_a_node_whose_scoring_outlasts_the_evaluation_interval_still_steps_between_scorings(streams, monkeypatch):
    # w1 (slowdown 4) scores for about 1.3 s, every 0.5 s a scoring falls due: like the live
    # loop (a step, then an evaluation if due), it alternates instead of scoring on and on.
    costs, report, calls = _scoring_run(streams, 1.0, monkeypatch)
    w1 = next(p for p in report.processes if p.name == "w1")
    eval_s = costs.eval_s(1, len(streams.data.validation))
    assert eval_s > 2 * 0.5
    scorings = sorted(t for who, t, _, kept in calls if who == "w1" and kept)
    assert len(scorings) >= 3
    for earlier, later in itertools.pairwise(scorings):
        assert any(earlier < start < later for start in w1.step_starts), (earlier, later, w1.step_starts)
    assert w1.local_steps >= len(scorings) - 1
