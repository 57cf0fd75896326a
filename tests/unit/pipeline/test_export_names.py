"""The model card's class and feature names (``edgestream export``): taken from the job's data
source where it names them (digits, a series file, an imported table), ``null`` with a reason
where it does not (the synthetic windows), never a list of the wrong length."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgestream.job.config import load_config
from edgestream.job.importer import ImportSpec, import_table
from edgestream.job.plan import training_plan
from edgestream.job.sources import DataNames, job_fleet_data, source_named
from edgestream.pipeline.exits import worker_state_dir
from edgestream.pipeline.export import export_job
from edgestream.streams.series_file import SeriesFile
from edgestream.trainers import assembly
from edgestream.trainers.checkpoint import CheckpointStore
from edgestream.trainers.local import limit_torch_threads


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> None:
    limit_torch_threads(1)


def names_of(*overrides: str) -> DataNames:
    cfg = load_config(overrides=list(overrides), env={})
    return source_named(cfg.data.source).data_names(cfg)


def test_digits_name_each_digit_and_each_pixel_as_scikit_learn_does():
    from sklearn.datasets import load_digits

    names = names_of("data.source=digits")

    assert names.class_names == tuple("0123456789")
    assert list(names.feature_names) == list(load_digits().feature_names)  # pixel_<row>_<column>, row by row
    assert len(names.feature_names) == int(np.prod(job_fleet_data(load_config(env={})).feature_shape))


def test_a_series_file_names_its_classes_and_each_channel_at_each_step(tmp_path):
    series = np.zeros((4, 2, 6), dtype=np.float32)
    data = SeriesFile(series, np.array([0, 1, 0, 1]), series[:2], np.array([0, 1]), ("walk", "run"), ("ax", "ay"),
                      10.0, {"dataset": "T"})
    path = data.save(tmp_path / "t.npz")

    names = names_of("data.source=series", f"data.series_file={path}", "data.series_window=3", "data.series_hop=3",
                     "devices.count=2", "workers.count=1")

    assert names.class_names == ("walk", "run")
    # A record is [channels, steps], flattened channel by channel (numpy's C order), as the model reads it.
    assert names.feature_names == ("ax[0]", "ax[1]", "ax[2]", "ay[0]", "ay[1]", "ay[2]")


def test_an_imported_table_names_its_label_values_and_its_columns(tmp_path):
    rng = np.random.default_rng(0)
    rows = ["speed,temp,state"] + [f"{rng.normal():.4f},{rng.normal():.4f},{s}" for s in ["ok", "hot", "cold"] * 40]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    import_table(tmp_path / "t.csv", "state", tmp_path / "rec", ImportSpec(devices=2, rates_hz=[10],
                                                                           records_per_device=40))

    names = names_of("data.source=recording", f"data.recording={tmp_path / 'rec'}")

    assert names.class_names == ("cold", "hot", "ok")  # label i is the i-th value in sorted order
    assert names.feature_names == ("speed", "temp")


def test_the_synthetic_windows_name_nothing():
    assert names_of("data.source=synthetic") == DataNames(None, None)


def card_of(tmp_path: Path, *sets: str) -> dict:
    """The card of an export (safetensors only: no ONNX trace) of a job's freshly built model."""
    cfg = load_config(overrides=["job.name=names", "train.enabled=true", "workers.count=1", "devices.count=1",
                                 f"run.state_dir={tmp_path / 'state'}", *sets], env={})
    plan, data = training_plan(cfg), job_fleet_data(cfg)
    driver = assembly.build_driver(plan, "w0", data)
    CheckpointStore(worker_state_dir(cfg, "w0") / "checkpoints", keep=1).save(
        driver.trainer, driver.strategy, {}, {"steps": 0, "trained_records": 0, "worker": "w0"})
    return export_job(cfg, tmp_path / "out", formats=("safetensors",), say=lambda _line: None).card


def test_the_card_carries_the_names_of_a_job_whose_data_has_them(tmp_path):
    card = card_of(tmp_path, "data.source=digits")

    assert card["classes"] == {"count": 10, "names": list("0123456789")}
    assert card["input"]["feature_names"][:2] == ["pixel_0_0", "pixel_0_1"] and len(card["input"]["feature_names"]) == 64
    assert "feature_names_reason" not in card["input"]


def test_the_card_says_why_a_job_without_names_has_none(tmp_path):
    card = card_of(tmp_path, "data.source=synthetic")

    assert card["classes"]["names"] is None and "does not name its classes" in card["classes"]["names_reason"]
    assert card["input"]["feature_names"] is None
    assert card["input"]["feature_names_reason"] == "the job's data source does not name its features"
