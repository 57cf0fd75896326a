"""The data-source registry: a source registered in one place is a job's data everywhere."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
import pytest

from edgestream.job import sources
from edgestream.job.config import ConfigError, DataSection, JobConfig, load_config
from edgestream.job.sources import (
    DataSource,
    declared_value_range,
    job_fleet_data,
    register,
    unregister,
)
from edgestream.pipeline.simulate import check_stream_options
from edgestream.streams.datasets import Dataset
from edgestream.streams.simulator import FleetData


@pytest.fixture
def toy_source():
    """A source of 40 rows, 4 features counting up, 2 classes, registered as ``toy``."""

    @register("toy")
    class ToySource(DataSource):
        parameters: ClassVar[tuple[str, ...]] = ("synthetic_samples",)
        auto_timestamp_skew_s: ClassVar[float | None] = 60.0
        garbage_refused: ClassVar[str] = "toys are never garbage"

        def configure(self, cfg: JobConfig) -> None:
            cfg.devices.rates_hz = [7.0]

        def validate(self, cfg: JobConfig) -> None:
            if cfg.data.synthetic_samples < 10:
                raise ConfigError("data.synthetic_samples must be >= 10 with the toy source")

        def fleet_data(self, cfg: JobConfig) -> FleetData:
            rows = cfg.data.synthetic_samples
            features = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) / (rows * 4)
            ds = Dataset(features, (np.arange(rows) % 2).astype(np.int64), 2, "toy")
            train, heldout = ds.subset(np.arange(rows - 4)), ds.subset(np.arange(rows - 4, rows))
            devices = cfg.devices.device_ids()
            shares = {d: np.arange(i, len(train), len(devices)) for i, d in enumerate(devices)}
            value_range = declared_value_range(cfg, (np.float32(0.0), np.float32(1.0)), from_data=False)
            return FleetData(train, heldout, shares, value_range=value_range)

    yield ToySource
    unregister("toy")


def test_a_registered_source_is_configured_validated_and_yields_the_fleet_data(toy_source):
    cfg = load_config(overrides=["data.source=toy", "data.synthetic_samples=40", "devices.count=2"], env={})

    data = job_fleet_data(cfg)

    assert cfg.devices.rates_hz == [7.0]  # the configure hook ran at load
    assert cfg.data.timestamp_skew_s() == 60.0  # its "auto" skew
    assert data.feature_shape == (4,) and data.num_classes == 2
    assert (len(data.train), len(data.heldout)) == (36, 4)
    assert {d: len(s) for d, s in data.shares.items()} == {"dev00": 18, "dev01": 18}
    lo, hi = data.value_range
    assert (float(lo), float(hi)) == (0.0, 1.0)


def test_a_registered_source_validates_its_own_parameters(toy_source):
    with pytest.raises(ConfigError, match="data.synthetic_samples must be >= 10 with the toy source"):
        load_config(overrides=["data.source=toy", "data.synthetic_samples=5", "devices.count=2"], env={})
    cfg = load_config(overrides=["data.source=toy", "data.synthetic_samples=12", "devices.count=2"], env={})
    with pytest.raises(ConfigError, match="not supported with data.source = 'toy': toys are never garbage"):
        check_stream_options(cfg, garbage_per_device=1)
    check_stream_options(cfg, garbage_per_device=0)


def test_an_unknown_source_names_the_registered_ones(toy_source):
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=["data.source=mnist"], env={})
    assert str(exc.value) == "data.source='mnist' is not one of " + ", ".join(sources.names())
    assert {"digits", "synthetic", "recording", "toy"} <= set(sources.names())


def test_an_unregistered_source_is_refused():
    assert "toy" not in sources.names()
    with pytest.raises(ConfigError, match="data.source='toy' is not one of"):
        load_config(overrides=["data.source=toy"], env={})


def test_a_name_registered_twice_is_a_programming_error(toy_source):
    with pytest.raises(ValueError, match="data source 'toy' registered twice"):

        @register("toy")
        class Other(toy_source):
            pass

    assert type(sources.source_named("toy")) is toy_source


@pytest.mark.parametrize("name", ["digits", "synthetic", "recording"])
def test_every_built_in_source_declares_existing_data_keys(name):
    source = sources.source_named(name)
    keys = {f.name for f in dataclasses.fields(DataSection)}
    assert source.name == name
    assert source.parameters and set(source.parameters) <= keys


def test_the_generated_sources_declare_their_value_range():
    digits = job_fleet_data(load_config(overrides=["devices.count=2"], env={}))
    synth = job_fleet_data(load_config(overrides=["data.source=synthetic", "data.synthetic_samples=120",
                                                  "devices.count=2", "data.value_margin=0"], env={}))

    assert (float(digits.value_range[0]), float(digits.value_range[1])) == (0.0, 1.0)
    every = np.concatenate([synth.train.features, synth.heldout.features, synth.validation.features]).reshape(120, -1)
    assert np.array_equal(synth.value_range[0], every.min(axis=0))
    assert np.array_equal(synth.value_range[1], every.max(axis=0))
