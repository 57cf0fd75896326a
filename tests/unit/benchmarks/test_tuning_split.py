"""Issue #32: no tuning run sees a row any reported run is tested on.

With ``--tune-lr`` every run draws its held-out test split with one fixed seed, so the test
rows are the same whatever the run's seed and no seed streams or validates on them; a
tuning run is measured on its own validation split and the test split is not in it at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from edgestream.benchmarks import tuning
from edgestream.job.config import ConfigError, load_config
from edgestream.job.sources.base import job_fleet_data
from edgestream.streams.simulator import fleet_data

DEVICES = [f"dev{i:02d}" for i in range(4)]


def _disjoint_as_samples(a, b) -> bool:
    """No sample of ``a`` is a sample of ``b``: where rows repeat in the source, the parts
    together hold no more copies of a row than the source does."""
    whole = fleet_data("digits", DEVICES, seed=0, heldout_seed=0)
    every = [whole.train, whole.heldout, whole.validation]
    count = {}
    for part in every:
        for key in _keys(part):
            count[key] = count.get(key, 0) + 1
    together = {}
    for part in (*a, *b):
        for key in _keys(part):
            together[key] = together.get(key, 0) + 1
    return all(n <= count[k] for k, n in together.items())


def _keys(part):
    return [np.asarray(x, dtype=np.float32).tobytes() + int(y).to_bytes(2, "little")
            for x, y in zip(part.features.reshape(len(part), -1), part.labels, strict=True)]


def test_a_fixed_heldout_seed_tests_every_seed_on_the_same_rows_and_trains_none_on_them():
    reported = fleet_data("digits", DEVICES, seed=0, heldout_seed=0)
    for seed in (1, 2, 1000):
        other = fleet_data("digits", DEVICES, seed=seed, heldout_seed=0)
        assert np.array_equal(other.heldout.features, reported.heldout.features)
        assert np.array_equal(other.heldout.labels, reported.heldout.labels)
        # what the other seed streams and validates on is what seed 0 streams and validates on
        assert sorted(_keys(other.train) + _keys(other.validation)) == sorted(
            _keys(reported.train) + _keys(reported.validation))
        assert _disjoint_as_samples([other.train, other.validation], [reported.heldout])
        # the shares and the validation split still follow the seed
        assert not np.array_equal(other.validation.labels, reported.validation.labels) or not np.array_equal(
            other.validation.features, reported.validation.features)


def test_without_a_heldout_seed_each_seed_draws_its_own_split_as_before():
    mine = fleet_data("digits", DEVICES, seed=1)
    assert np.array_equal(mine.heldout.features, fleet_data("digits", DEVICES, seed=1, heldout_seed=1).heldout.features)
    assert not np.array_equal(mine.heldout.features, fleet_data("digits", DEVICES, seed=1, heldout_seed=0).heldout.features)


def test_a_tuning_run_is_measured_on_its_validation_split_and_holds_no_test_row():
    streams = tuning.fleet_streams("tuning", (5.0,) * len(DEVICES), partition="iid", seed=1000)
    test = fleet_data("digits", DEVICES, seed=0, heldout_seed=tuning.TEST_SPLIT_SEED).heldout

    data = streams.data
    assert data.heldout is data.validation  # every evaluation of the run reads validation rows
    assert _disjoint_as_samples([data.train, data.validation], [test])
    # and the reporting runs are tested on exactly that split, whatever their seed
    for seed in (0, 1, 2):
        fixed = tuning.fleet_streams("fixed", (5.0,) * len(DEVICES), partition="iid", seed=seed)
        assert np.array_equal(fixed.data.heldout.features, test.features)
        assert fixed.data.heldout is not fixed.data.validation


def test_the_split_of_a_run_follows_tuning():
    assert tuning.run_split(None) == "seed" and tuning.split_params("seed") == {}
    spec = tuning.TuneSpec((1.0, 2.0), (1000,))
    assert tuning.run_split(spec) == "fixed" and tuning.run_split(spec, tuning_run=True) == "tuning"
    assert tuning.split_params("fixed") == tuning.split_params("tuning") == {"heldout_seed": tuning.TEST_SPLIT_SEED}
    with pytest.raises(ValueError, match="unknown split 'test'"):
        tuning.split_params("test")


@dataclass(frozen=True)
class _Task:
    row: str
    seed: int
    lr_mult: float = 1.0
    split: str = "seed"


def test_grid_tasks_are_tuning_runs_and_chosen_tasks_are_tested_on_the_fixed_split():
    spec = tuning.TuneSpec((1.0, 2.0), (1000,))
    tasks = [_Task("bsp", 0), _Task("bsp", 1), _Task("asp", 0)]
    grid = tuning.grid_tasks(tasks, spec, lambda t: t["row"])
    assert {t.split for t in grid} == {"tuning"} and {t.seed for t in grid} == {1000} and len(grid) == 4
    chosen = tuning.at_chosen(tasks, {"bsp": {"chosen_mult": 2.0}}, lambda t: t["row"])
    assert [(t.row, t.lr_mult, t.split) for t in chosen] == [
        ("bsp", 2.0, "fixed"), ("bsp", 2.0, "fixed"), ("asp", 1.0, "fixed")]


def test_data_heldout_seed_reaches_a_job_s_data_and_a_bad_value_says_what_to_use():
    base = ["data.source=digits", "devices.count=4", "job.seed=7"]
    own = job_fleet_data(load_config(overrides=base))
    fixed = job_fleet_data(load_config(overrides=[*base, "data.heldout_seed=0"]))
    assert np.array_equal(fixed.heldout.features, fleet_data("digits", DEVICES, seed=7, heldout_seed=0).heldout.features)
    assert not np.array_equal(own.heldout.features, fixed.heldout.features)
    for bad in ("-1", "first", "1.5"):
        with pytest.raises(ConfigError, match="data.heldout_seed=.*use job"):
            load_config(overrides=[*base, f"data.heldout_seed={bad}"])


def test_data_evaluate_on_validation_puts_the_validation_split_in_place_of_the_test_split():
    base = ["data.source=digits", "devices.count=4", "job.seed=1000", "data.heldout_seed=0"]
    normal = job_fleet_data(load_config(overrides=base))
    tuning_job = job_fleet_data(load_config(overrides=[*base, "data.evaluate_on=validation"]))
    assert tuning_job.heldout is tuning_job.validation
    assert np.array_equal(tuning_job.validation.features, normal.validation.features)
    assert _disjoint_as_samples([tuning_job.train, tuning_job.heldout], [normal.heldout])
    with pytest.raises(ConfigError, match="data.evaluate_on=validation needs a validation split"):
        load_config(overrides=[*base, "data.evaluate_on=validation", "data.validation_fraction=0"])
    with pytest.raises(ConfigError, match="data.evaluate_on"):
        load_config(overrides=[*base, "data.evaluate_on=test"])
