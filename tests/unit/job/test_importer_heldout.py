"""`edgestream import`: the held-out split, the stored data files, option checks, the job file."""

from __future__ import annotations

import json
import tomllib

import numpy as np
import pytest

from edgestream.job.importer import (
    HELDOUT_FILE,
    IMPORT_INFO,
    TRAIN_FILE,
    ImportSpec,
    TableImportError,
    import_table,
    job_file_text,
)
from edgestream.streams import codec
from edgestream.streams.recording import RecordingReader


def write_table(path, rows: int = 200, seed: int = 0):
    """Three classes of different sizes; every row is unique (its id is a feature)."""
    rng = np.random.default_rng(seed)
    labels = np.array(["a"] * 100 + ["b"] * 60 + ["c"] * 40)[:rows]
    lines = ["row_id,x,big,label"]
    for i, label in enumerate(labels):
        lines.append(f"{i},{rng.normal():.5f},{1000 + 700 * rng.random():.3f},{label}")
    path.write_text("\n".join(lines) + "\n")
    return path, labels


def streamed_rows(directory, device_ids) -> np.ndarray:
    reader = RecordingReader(directory)
    ids = [codec.decode(m.value, expected_device=d).features[:, 0]
           for d in device_ids for m in reader.messages(f"sensors.{d}")]
    return np.concatenate(ids).astype(np.int64)


def test_heldout_is_stratified_disjoint_from_streams_and_stored(tmp_path):
    src, labels = write_table(tmp_path / "t.csv")
    spec = ImportSpec(devices=3, rates_hz=[100, 50, 30], records_per_device=300, heldout_fraction=0.25)

    report = import_table(src, "label", tmp_path / "rec", spec)

    with np.load(tmp_path / "rec" / HELDOUT_FILE, allow_pickle=False) as z:
        held_x, held_y = z["features"], z["labels"]
    with np.load(tmp_path / "rec" / TRAIN_FILE, allow_pickle=False) as z:
        train_x, train_y = z["features"], z["labels"]
        bounds, indices = z["share_bounds"], z["share_indices"]
    assert held_x.dtype == np.float32 and held_y.dtype == np.int64
    assert train_x.dtype == np.float32 and train_y.dtype == np.int64
    # Stratified: a quarter of every class (100, 60, 40 rows).
    assert np.bincount(held_y).tolist() == [25, 15, 10]
    held_ids, train_ids = set(held_x[:, 0].astype(int)), set(train_x[:, 0].astype(int))
    assert held_ids.isdisjoint(train_ids) and held_ids | train_ids == set(range(200))
    # The stored labels are the table's, mapped to 0..C-1 in sorted order.
    names = np.array(["a", "b", "c"])
    assert all(names[y] == labels[int(i)] for i, y in zip(held_x[:, 0], held_y, strict=True))
    # Nothing held out is ever streamed; every streamed row comes from the training part.
    sent = set(streamed_rows(tmp_path / "rec", spec.device_ids()).tolist())
    assert sent.isdisjoint(held_ids) and sent <= train_ids
    # The shares cover the training part once, in device order.
    assert bounds.tolist()[0] == 0 and bounds.tolist()[-1] == len(train_y)
    assert sorted(indices.tolist()) == list(range(len(train_y)))
    info = json.loads((tmp_path / "rec" / IMPORT_INFO).read_text())
    assert info["version"] == 2 and info["data"] == report.data
    assert info["data"]["heldout"]["rows"] == 50 and info["data"]["train"]["rows"] == 150
    assert info["source"]["heldout_rows"] == 50
    assert [d["share_rows"] for d in info["devices"].values()] == np.diff(bounds).tolist()


def test_import_json_describes_what_a_job_needs(tmp_path):
    src, _ = write_table(tmp_path / "t.csv")
    spec = ImportSpec(devices=2, rates_hz=[40, 20], duration_s=1.5, device_prefix="lab")

    report = import_table(src, "label", tmp_path / "rec", spec)

    data = json.loads((tmp_path / "rec" / IMPORT_INFO).read_text())["data"]
    with np.load(tmp_path / "rec" / TRAIN_FILE, allow_pickle=False) as z:
        train_x = z["features"]
    assert data["feature_shape"] == [3] and data["num_classes"] == 3
    assert data["label_names"] == ["a", "b", "c"]
    assert data["feature_names"] == ["row_id", "x", "big"]
    assert data["device_ids"] == ["lab00", "lab01"] and data["rates_hz"] == [40.0, 20.0]
    assert data["duration_s"] == pytest.approx(1.5) == report.duration_s
    np.testing.assert_array_equal(np.float32(data["stats"]["min"]), train_x.min(axis=0))
    np.testing.assert_array_equal(np.float32(data["stats"]["max"]), train_x.max(axis=0))
    np.testing.assert_allclose(data["stats"]["mean"], train_x.astype(np.float64).mean(axis=0), rtol=1e-9)
    np.testing.assert_allclose(data["stats"]["std"], train_x.astype(np.float64).std(axis=0), rtol=1e-9)


def test_same_seed_same_split(tmp_path):
    src, _ = write_table(tmp_path / "t.csv")
    spec = ImportSpec(devices=2, rates_hz=[10], records_per_device=10, seed=3)

    import_table(src, "label", tmp_path / "r1", spec)
    import_table(src, "label", tmp_path / "r2", spec)

    for name in (HELDOUT_FILE, TRAIN_FILE):
        with np.load(tmp_path / "r1" / name) as a, np.load(tmp_path / "r2" / name) as b:
            for key in a.files:
                np.testing.assert_array_equal(a[key], b[key])


@pytest.mark.parametrize("change, match", [
    ({"devices": 0}, "--devices must be >= 1"),
    ({"devices": -2}, "--devices must be >= 1"),
    ({"rates_hz": [10, 0]}, "--rates must be positive"),
    ({"rates_hz": [-5]}, "--rates must be positive"),
    ({"rates_hz": [float("inf")]}, "--rates must be positive"),
    ({"duration_s": 0.0, "records_per_device": None}, "--duration must be a positive"),
    ({"duration_s": -1.0, "records_per_device": None}, "--duration must be a positive"),
    ({"records_per_device": 0}, "--records-per-device must be >= 1"),
    ({"message_interval_s": 0.0}, "--message-interval must be a positive"),
    ({"heldout_fraction": 0.0}, r"--heldout-fraction must lie in \(0, 1\)"),
    ({"heldout_fraction": 1.0}, r"--heldout-fraction must lie in \(0, 1\)"),
    ({"heldout_fraction": -0.1}, r"--heldout-fraction must lie in \(0, 1\)"),
    ({"device_prefix": "a.b"}, "--device-prefix 'a.b'"),
    ({"profile": "wobbly"}, "--profile"),
])
def test_bad_options_are_refused_before_anything_is_written(tmp_path, change, match):
    src, _ = write_table(tmp_path / "t.csv")
    spec = ImportSpec(**{"devices": 2, "rates_hz": [10], "records_per_device": 5, **change})

    with pytest.raises(TableImportError, match=match) as exc:
        import_table(src, "label", tmp_path / "rec", spec)
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "rec").exists()


def test_single_class_table_is_refused(tmp_path):
    path = tmp_path / "one.csv"
    path.write_text("x,label\n1,a\n2,a\n3,a\n")

    with pytest.raises(TableImportError, match="single class"):
        import_table(path, "label", tmp_path / "rec", ImportSpec(devices=1, rates_hz=[5], records_per_device=2))


def test_job_file_trains_on_the_recording(tmp_path):
    src, _ = write_table(tmp_path / "t.csv")
    report = import_table(src, "label", tmp_path / "my rec", ImportSpec(devices=3, rates_hz=[10], duration_s=7.5))

    job = tomllib.loads(job_file_text(report))

    assert job["data"] == {"source": "recording", "recording": str((tmp_path / "my rec").resolve()),
                           "replay_speed": "1"}
    assert job["train"]["enabled"] is True
    assert job["run"]["duration_s"] >= 7.5
    assert 1 <= job["workers"]["count"] <= 3
    assert job["job"]["name"] == "my-rec"


def test_cli_import_writes_a_job_file_that_loads_as_a_recording_job(tmp_path, capsys, monkeypatch):
    from edgestream.cli.main import main
    from edgestream.job.config import load_config
    from edgestream.job.sources import job_fleet_data

    src, _ = write_table(tmp_path / "t.csv")
    monkeypatch.chdir(tmp_path)

    code = main(["import", "--file", str(src), "--label-column", "label", "--out", "rec", "--devices", "3",
                 "--rates", "30,20,10", "--duration", "2", "--heldout-fraction", "0.3", "--job-out", "job.toml"])

    assert code == 0
    out = capsys.readouterr().out
    assert "job file written: job.toml" in out and "edgestream run --job job.toml" in out
    cfg = load_config(tmp_path / "job.toml", env={})
    assert cfg.data.source == "recording" and cfg.train.enabled
    assert cfg.devices.device_ids() == ["dev00", "dev01", "dev02"] and cfg.devices.rates_hz == [30.0, 20.0, 10.0]
    assert cfg.data.heldout_fraction == 0.3 and cfg.workers.count == 2
    assert len(job_fleet_data(cfg).heldout) == 60  # 0.3 of 100, 60 and 40 rows


@pytest.mark.parametrize("argv, message", [
    (["--devices", "0", "--duration", "5"], "--devices must be >= 1"),
    (["--duration", "-1"], "--duration must be a positive"),
    (["--records-per-device", "0"], "--records-per-device must be >= 1"),
    (["--duration", "5", "--message-interval", "0"], "--message-interval must be a positive"),
    (["--duration", "5", "--rates", "10,0"], "--rates must be positive"),
    (["--duration", "5", "--heldout-fraction", "1"], "--heldout-fraction must lie in (0, 1)"),
])
def test_cli_import_refuses_bad_numbers_with_one_line(tmp_path, capsys, argv, message):
    from edgestream.cli.main import main

    src, _ = write_table(tmp_path / "t.csv")

    code = main(["import", "--file", str(src), "--label-column", "label", "--out", str(tmp_path / "rec"), *argv])

    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "rec").exists()
