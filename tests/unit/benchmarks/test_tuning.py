"""The learning-rate chooser of ``--tune-lr`` (benchmarks/tuning.py): the smallest time to the
target wins, rows that miss at every LR are ranked by accuracy (then loss), ties go towards the
base LR then the smaller one, the choice does not depend on the order of the runs, and a tuning
seed that is also a reporting seed is refused."""

from __future__ import annotations

import argparse
import itertools
import math

import pytest

from edgestream.benchmarks import tuning
from edgestream.benchmarks.tuning import Point, choose


def test_the_smallest_time_to_the_target_wins():
    chosen = choose([Point(0.5, 30.0, 0.91), Point(1.0, 20.0, 0.92), Point(2.0, 12.5, 0.90)])

    assert chosen.lr_mult == 2.0 and chosen.by == "tta" and chosen.at_edge


def test_a_multiplier_that_reached_the_target_beats_any_that_missed_it_whatever_their_accuracy():
    chosen = choose([Point(0.5, None, 0.89), Point(1.0, 59.5, 0.90), Point(2.0, None, 0.895)])

    assert chosen.lr_mult == 1.0 and chosen.by == "tta" and not chosen.at_edge


def test_when_every_multiplier_misses_the_highest_accuracy_wins_then_the_lowest_loss():
    assert choose([Point(0.5, None, 0.70, 0.9), Point(1.0, None, 0.80, 0.8),
                   Point(2.0, None, 0.85, 1.5)]).lr_mult == 2.0
    tied = choose([Point(0.5, None, 0.80, 0.6), Point(1.0, None, 0.80, 0.7), Point(2.0, None, 0.80, 0.9)])
    assert tied.lr_mult == 0.5 and tied.by == "accuracy"


def test_a_diverged_run_nan_loss_or_no_accuracy_ranks_last():
    chosen = choose([Point(0.5, None, 0.30, 2.0), Point(1.0, None, None, None), Point(4.0, None, 0.30, math.nan)])

    assert chosen.lr_mult == 0.5


@pytest.mark.parametrize(("points", "expected"), [
    ([Point(0.5, 10.0, 0.9), Point(1.0, 10.0, 0.9), Point(2.0, 10.0, 0.9)], 1.0),  # towards the base LR
    ([Point(0.5, 10.0, 0.9), Point(1.0, 11.0, 0.9), Point(2.0, 10.0, 0.9)], 0.5),  # then the smaller LR
    ([Point(0.25, 10.0, 0.9), Point(1.0, 11.0, 0.9), Point(2.0, 10.0, 0.9)], 2.0),  # closer to x1 (log) first
    ([Point(0.5, None, 0.8, 1.0), Point(1.0, None, 0.8, 1.0), Point(2.0, None, 0.8, 1.0)], 1.0),
    ([Point(0.5, None, 0.8, 1.0), Point(2.0, None, 0.8, 1.0)], 0.5),
])
def test_ties_go_towards_the_base_lr_then_the_smaller_lr(points, expected):
    assert choose(points).lr_mult == expected


def test_the_choice_does_not_depend_on_the_order_of_the_runs():
    runs = [{"lr_mult": m, "seed": seed, "tta_s": tta, "acc_at_budget": acc, "loss_at_budget": loss}
            for m, seed, tta, acc, loss in [(0.5, 1000, None, 0.8, 0.7), (0.5, 1001, 30.0, 0.91, 0.3),
                                            (1.0, 1000, 25.0, 0.92, 0.3), (1.0, 1001, 25.0, 0.9, 0.3),
                                            (2.0, 1000, 20.0, 0.93, 0.2), (2.0, 1001, None, 0.7, 1.2)]]

    choices = {tuning.choose_runs(list(order)) for order in itertools.permutations(runs)}

    assert len(choices) == 1
    (chosen,) = choices
    # 0.5 and 2 each missed on one of two seeds: their median is a miss; 1 reached on both.
    assert chosen.lr_mult == 1.0 and chosen.by == "tta"
    assert [p.tta_s for p in chosen.points] == [None, 25.0, None]


def test_a_median_over_tuning_seeds_counts_a_miss_as_infinitely_late():
    three = [{"lr_mult": 2.0, "tta_s": t, "acc_at_budget": 0.9} for t in (10.0, None, 12.0)]

    assert tuning.point(2.0, three).tta_s == 12.0
    assert tuning.point(2.0, three[:2]).tta_s is None


def test_the_record_has_every_grid_point_and_the_resulting_lr():
    spec = tuning.TuneSpec((0.5, 1.0, 2.0), (1000,))
    chosen = choose([Point(0.5, None, 0.5), Point(1.0, 30.0, 0.9), Point(2.0, 20.0, 0.9)])

    rec = tuning.record(chosen, spec, base_lr=0.03)

    assert rec["grid"] == [0.5, 1.0, 2.0] and rec["tune_seeds"] == [1000]
    assert [p["lr_mult"] for p in rec["points"]] == [0.5, 1.0, 2.0]
    assert rec["points"][0]["tta_s"] is None and rec["points"][2]["tta_s"] == 20.0
    assert rec["chosen_mult"] == 2.0 and rec["lr"] == pytest.approx(0.06) and rec["chosen_by"] == "tta"
    assert tuning.mult_text(rec) == "x2 (0.06)*"


def test_the_default_tuning_seed_is_well_above_the_reporting_seeds():
    assert tuning.tune_seeds([0, 1, 2]) == (1000,)
    assert tuning.tune_seeds([5, 6], [77, 78]) == (77, 78)


def test_a_tuning_seed_that_is_also_a_reporting_seed_is_refused():
    with pytest.raises(ValueError, match=r"--tune-seed 1 is also a reporting seed \(reporting seeds: 0, 1, 2\)"):
        tuning.tune_seeds([0, 1, 2], [1])


@pytest.mark.parametrize(("text", "problem"), [
    ("0.5,x", "comma list of multipliers"), ("", "at least one"), ("0,1", "finite and > 0"),
    ("1,nan", "finite and > 0"), ("1,1", "twice"),
])
def test_a_bad_grid_is_refused(text, problem):
    with pytest.raises(ValueError, match=problem):
        tuning.parse_grid(text)


def test_the_grid_is_sorted():
    assert tuning.parse_grid("2, 0.5,1") == (0.5, 1.0, 2.0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench")
    tuning.add_arguments(parser)
    return parser


def test_the_flags_give_a_spec_and_refuse_an_overlap_or_a_grid_without_tune_lr(capsys):
    parser = _parser()
    assert tuning.from_args(parser, parser.parse_args([]), [0, 1]) is None
    spec = tuning.from_args(parser, parser.parse_args(["--tune-lr", "--lr-grid", "1,2"]), [0, 1])
    assert spec == tuning.TuneSpec((1.0, 2.0), (1000,))
    assert tuning.from_args(parser, parser.parse_args(["--tune-lr"]), [3]).grid == tuning.DEFAULT_GRID

    for argv, problem in ((["--tune-lr", "--tune-seed", "1"], "is also a reporting seed"),
                          (["--lr-grid", "1,2"], "only mean something with --tune-lr")):
        with pytest.raises(SystemExit) as exited:
            tuning.from_args(parser, parser.parse_args(argv), [0, 1])
        assert exited.value.code == 2 and problem in capsys.readouterr().err


def test_a_multiplier_scales_a_mode_s_own_lr_only_when_it_sets_one():
    from edgestream.trainers import simclock

    asp = simclock.Mode("asp", "asp", batch_size=64, lr=0.03)
    bsp = simclock.Mode("bsp", "bsp", batch_size=64)

    assert tuning.scaled_mode(asp, 2.0).lr == pytest.approx(0.06)
    assert tuning.scaled_mode(bsp, 2.0) is bsp and tuning.scaled_mode(asp, 1.0) is asp
