"""`bench synthetic_gradients --tune-lr`: tuning jobs are scored on their validation split with
the test split out of the job, reporting jobs are tested on the fixed split at the chosen LR."""

from __future__ import annotations

import pytest

from edgestream.benchmarks import synthetic_gradients as sg
from edgestream.benchmarks import tuning
from edgestream.job.config import load_config
from edgestream.job.sources.base import job_fleet_data

SPEC = tuning.TuneSpec((0.5, 1.0, 2.0), (1000,))


def _cfg(tmp_path, variant):
    s = sg.Settings()
    path = tmp_path / "job.toml"
    path.write_text(sg.job_toml("dni", sg.SPLIT3, s, tmp_path, "t1", variant))
    return load_config(path, env={})


def test_a_tuning_job_is_scored_on_validation_at_its_own_seed_and_scaled_lr(tmp_path):
    cfg = _cfg(tmp_path, sg.Variant(2.0, 1000, "tuning"))
    assert cfg.job.seed == 1000 and cfg.train.lr == pytest.approx(2 * sg.Settings.lr)
    assert cfg.data.evaluate_on == "validation" and cfg.data.heldout_split_seed(cfg.job.seed) == tuning.TEST_SPLIT_SEED
    data = job_fleet_data(cfg)
    assert data.heldout is data.validation


def test_a_reporting_job_is_tested_on_the_fixed_split_and_an_untuned_one_on_its_own(tmp_path):
    fixed = _cfg(tmp_path, sg.chosen_variant({("dni", "3 stages"): {"chosen_mult": 0.5}}, "dni", "3 stages"))
    assert fixed.train.lr == pytest.approx(0.5 * sg.Settings.lr) and fixed.data.evaluate_on == "heldout"
    assert fixed.data.heldout_split_seed(fixed.job.seed) == tuning.TEST_SPLIT_SEED
    plain = _cfg(tmp_path, sg.chosen_variant(None, "dni", "3 stages"))
    assert plain.data.heldout_seed == "job" and plain.train.lr == pytest.approx(sg.Settings.lr)


def test_the_plan_covers_every_split_arm_and_multiplier_and_skips_the_deep_split_when_it_is_off():
    s = sg.Settings(arms=["backprop", "dni"], deep_arms=["cdni"])
    plan = sg.tuning_plan(s, SPEC)
    assert len(plan) == 3 * 3 and {v.split for *_, v in plan} == {"tuning"} and {v.seed for *_, v in plan} == {1000}
    assert {(g, a) for g, _, a, _ in plan} == {("3 stages", "backprop"), ("3 stages", "dni"), ("5 stages", "cdni")}
    off = sg.tuning_plan(sg.Settings(arms=["dni"], deep_repeats=0), SPEC)
    assert {g for g, *_ in off} == {"3 stages"}


def _run(arm, mult, acc, loss=0.1):
    return {"arm": arm, "group": "3 stages", "lr_mult": mult, "lr": 0.05 * mult,
            **({"error": "boom"} if acc is None else {"accuracy": acc, "loss": loss})}


def test_the_highest_validation_accuracy_at_n_wins_and_a_failed_run_ranks_last():
    runs = [_run("dni", 0.5, 0.90), _run("dni", 1.0, 0.93), _run("dni", 2.0, None),
            _run("backprop", 0.5, 0.95, 0.2), _run("backprop", 1.0, 0.95, 0.1), _run("backprop", 2.0, 0.94)]
    choices = sg.choose_arms(runs, SPEC)
    assert choices[("dni", "3 stages")]["chosen_mult"] == 1.0
    assert choices[("backprop", "3 stages")]["chosen_mult"] == 1.0  # equal accuracy: the lower loss
    assert choices[("dni", "3 stages")]["chosen_by"] == "accuracy"
    assert choices[("dni", "3 stages")]["lr"] == pytest.approx(0.05)


def test_quick_keeps_the_deep_split_off_when_asked():
    assert sg.quick(sg.Settings(deep_repeats=0)).deep_repeats == 0
    assert sg.quick(sg.Settings()).deep_repeats == 1 and sg.quick(sg.Settings()).repeats == 1


@pytest.mark.parametrize(("flags", "problem"), [
    (["--tune-lr", "--from-json", "x.json"], "--from-json summarises earlier runs: not with --tune-lr"),
    (["--tune-lr", "--tune-seed", "0"], "--tune-seed 0 is also a reporting seed"),
    (["--lr-grid", "1,2"], "only mean something with --tune-lr"),
])
def test_bad_tuning_flags_are_refused_before_any_run(monkeypatch, capsys, flags, problem):
    monkeypatch.setattr("sys.argv", ["synthetic_gradients", *flags])
    with pytest.raises(SystemExit) as exited:
        sg.main()
    assert exited.value.code == 2 and problem in capsys.readouterr().err
