"""``data.source = "series"``: the three parts are disjoint by series (the file's test series are
the held-out split, whole train series the validation split), every streamed series goes whole
to one device, statistics and ranges come from the streamed rows only, and what cannot be used
is one line naming the fix. Also the two things around it that need no broker: the readings the
watches publish and how the run counts what external devices wrote."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgestream.job.config import ConfigError, load_config
from edgestream.job.examples import example_path
from edgestream.job.sources import job_fleet_data
from edgestream.pipeline.external import UNDECODABLE, ArrivalCounter
from edgestream.pipeline.watches import reading, watch_topic
from edgestream.streams.series_file import SeriesFile

CHANNELS, LENGTH, WINDOW, HOP = 3, 12, 4, 2
PER = (LENGTH - WINDOW) // HOP + 1  # windows per series


@pytest.fixture(scope="module")
def series_file(tmp_path_factory) -> Path:
    """20 train and 8 test series of 2 classes; every value of series i is i (test: 1000 + i),
    so a window tells which series it came from."""
    def part(n: int, base: float) -> tuple[np.ndarray, np.ndarray]:
        series = np.stack([np.full((CHANNELS, LENGTH), base + i, dtype=np.float32) for i in range(n)])
        series[:, 1, :] *= -1  # a channel on another scale
        return series, np.arange(n, dtype=np.int64) % 2

    train, test = part(20, 0.0), part(8, 1000.0)
    data = SeriesFile(*train, *test, ("a", "b"), tuple(f"c{i}" for i in range(CHANNELS)), 10.0, {"dataset": "T"})
    return data.save(tmp_path_factory.mktemp("series") / "t.npz")


def job(path, *overrides: str):
    return load_config(overrides=["data.source=series", f"data.series_file={path}", f"data.series_window={WINDOW}",
                                  f"data.series_hop={HOP}", "devices.count=4", "workers.count=2", *overrides], env={})


def series_of(features: np.ndarray) -> set[int]:
    """The series (by their value) the windows come from; test series are >= 1000."""
    return {int(abs(v)) for v in features[:, 0, 0]}


def test_the_parts_are_disjoint_by_series_and_the_test_series_are_held_out(series_file):
    data = job_fleet_data(job(series_file))
    assert data.feature_shape == (CHANNELS, WINDOW) and data.num_classes == 2
    assert series_of(data.heldout.features) == set(range(1000, 1008)) and len(data.heldout) == 8 * PER
    streamed, validation = series_of(data.train.features), series_of(data.validation.features)
    assert streamed.isdisjoint(validation) and streamed | validation == set(range(20))
    assert len(validation) == 2  # validation_fraction 0.1 of each class's 10 series: one each
    assert sorted(data.validation.labels[::PER]) == [0, 1]
    # Each window's label is its series' label; every window of a series stays together.
    for ds in (data.train, data.validation, data.heldout):
        np.testing.assert_array_equal(ds.labels, np.array([int(abs(v)) % 2 for v in ds.features[:, 0, 0]]))
        assert all(np.all(ds.features[i, 0] == ds.features[i, 0, 0]) for i in range(len(ds)))


def test_every_streamed_series_goes_whole_to_one_device_in_time_order(series_file):
    cfg = job(series_file)
    data = job_fleet_data(cfg)
    owners: dict[int, str] = {}
    covered = np.concatenate(list(data.shares.values()))
    np.testing.assert_array_equal(np.sort(covered), np.arange(len(data.train)))
    for device, rows in data.shares.items():
        for s in series_of(data.train.features[rows]):
            assert owners.setdefault(s, device) == device
        mine = data.train.features[rows]
        # Consecutive windows of one series overlap by WINDOW - HOP steps: a watch plays them in order.
        for k in range(0, len(rows), PER):
            assert len(series_of(mine[k:k + PER])) == 1
    sizes = sorted(len(series_of(data.train.features[r])) for r in data.shares.values())
    assert sizes == [4, 4, 5, 5]  # 18 series dealt round robin
    again = job_fleet_data(cfg)
    assert all(np.array_equal(again.shares[d], data.shares[d]) for d in data.shares)
    other = job_fleet_data(job(series_file, "job.seed=5"))
    assert any(not np.array_equal(other.train.features[other.shares[d]], data.train.features[data.shares[d]])
               for d in data.shares)


def test_statistics_and_value_range_come_from_the_streamed_rows(series_file):
    data = job_fleet_data(job(series_file, "data.value_margin=0"))
    lo, hi = data.value_range
    flat = data.train.features.reshape(len(data.train), -1)
    np.testing.assert_array_equal(lo, flat.min(axis=0))
    np.testing.assert_array_equal(hi, flat.max(axis=0))
    assert hi.max() < 1000  # nothing of the test series
    mean, std = data.input_stats
    assert mean.shape == std.shape == (CHANNELS * WINDOW,)
    np.testing.assert_allclose(mean[:WINDOW], data.train.features[:, 0].mean(), rtol=1e-5)
    np.testing.assert_allclose(mean[WINDOW:2 * WINDOW], -data.train.features[:, 0].mean(), rtol=1e-5)
    assert np.all(std > 0)


def test_without_validation_every_train_series_is_streamed(series_file):
    data = job_fleet_data(job(series_file, "data.validation_fraction=0"))
    assert data.validation is None and series_of(data.train.features) == set(range(20))


def test_what_cannot_be_used_is_one_line_naming_the_fix(series_file, tmp_path):
    with pytest.raises(ConfigError, match=r"needs data.series_file = a converted file \(`scripts/with-venv.sh "
                                          r"python scripts/fetch_basicmotions.py`"):
        load_config(overrides=["data.source=series"], env={})
    with pytest.raises(ConfigError, match="data.series_window and data.series_hop must be >= 1"):
        job(series_file, "data.series_hop=0")
    missing = tmp_path / "none.npz"
    with pytest.raises(ConfigError, match=rf"no such file; write it with `.*fetch_basicmotions.py --out {missing}`"):
        job_fleet_data(job(missing))
    (tmp_path / "bad.npz").write_text("x")
    with pytest.raises(ConfigError, match="cannot be read as a converted series file"):
        job_fleet_data(job(tmp_path / "bad.npz"))
    with pytest.raises(ConfigError, match=r"data.series_window=13 is longer than the file's series \(12 steps\)"):
        job_fleet_data(job(series_file, "data.series_window=13"))
    with pytest.raises(ConfigError, match="19 devices but only 18 streamed series"):
        job_fleet_data(job(series_file, "devices.count=19"))


def test_the_example_job_loads_without_its_data_file():
    cfg = load_config(example_path("basicmotions-mqtt"), env={})  # a fresh clone: nothing downloaded yet
    assert cfg.data.source == "series" and cfg.devices.external and cfg.input.format == "json"
    assert watch_topic(cfg, "watch3") == "watches/watch3/motion"


def test_a_watch_reading_is_what_the_example_job_decodes(series_file):
    cfg = job(series_file, "input.format=json", "input.features_array=window", "input.label=activity",
              "input.event_time=ts", "input.time_unit=ms", "input.record_id=n", "input.extra=reject",
              "devices.external=true")
    data = job_fleet_data(cfg)
    payload = reading(data.train.features[5], int(data.train.labels[5]), 1_764_590_000_123, 17)
    assert set(json.loads(payload)) == {"window", "activity", "ts", "n"}
    counter = ArrivalCounter(cfg)
    topic = cfg.input.layout().topic("dev01")
    counter.add(topic, b"dev01", payload, 1_764_590_000_200, 0)
    counter.add(topic, b"dev01", b"[" + payload + b"," + payload + b"]", 1_764_590_000_200, 1)  # two readings
    counter.add(topic, b"dev01", b'{"window": [1, 2]}', 1_764_590_000_200, 2)  # wrong shape: dead-lettered whole
    counter.add(topic, b"dev01", b"not json", 1_764_590_000_200, 3)
    counter.add("sensors.stranger", b"stranger", payload, 1_764_590_000_200, 0)  # not a device of the job
    report = counter.report
    assert report.records["dev01"] == 3 and report.messages["dev01"] == 2
    assert report.garbage["dev01"] == {UNDECODABLE: 2} and counter.others == 1
    assert report.records["dev00"] == 0
    with pytest.raises(ConfigError, match="wildcard level"):
        watch_topic(load_config(overrides=["mqtt.topics=plant/+/{device}"], env={}), "w")
