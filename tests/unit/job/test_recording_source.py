"""A recording as a job's data source: devices, data, value ranges, input statistics, errors."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from edgestream.job.config import ConfigError, load_config
from edgestream.job.importer import HELDOUT_FILE, IMPORT_INFO, TRAIN_FILE, ImportSpec, import_table
from edgestream.job.sources import job_fleet_data
from edgestream.job.sources.recording import RecordingSourceError, read_recording_info
from edgestream.pipeline.simulate import _send_order, stream_devices
from edgestream.streams.recording import RecordedMessage, RecordingWriter


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """An import of a 4-feature, 3-class table with columns on very different scales."""
    root = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(1)
    lines = ["a,b,c,d,kind"]
    for i in range(150):
        k = i % 3
        lines.append(f"{rng.normal(k):.4f},{1000 + 300 * k + 50 * rng.normal():.2f},"
                     f"{0.001 * rng.random():.6f},{-5 + k:.1f},{'xyz'[k]}")
    (root / "t.csv").write_text("\n".join(lines) + "\n")
    spec = ImportSpec(devices=3, rates_hz=[50, 30, 20], duration_s=2.0, device_prefix="s", seed=2,
                      heldout_fraction=0.2)
    report = import_table(root / "t.csv", "kind", root / "rec", spec)
    return root / "rec", report


def job(rec, *overrides: str):
    return load_config(overrides=["data.source=recording", f"data.recording={rec}", *overrides], env={})


def test_job_takes_devices_shape_and_classes_from_the_recording(recording):
    rec, report = recording

    cfg = job(rec, "workers.count=2")
    data = job_fleet_data(cfg)

    assert cfg.devices.device_ids() == ["s00", "s01", "s02"] and cfg.devices.count == 3
    assert cfg.devices.rates_hz == [50.0, 30.0, 20.0]
    assert data.feature_shape == (4,) and data.num_classes == 3
    assert len(data.heldout) == report.data["heldout"]["rows"] == 30
    assert len(data.train) == report.data["train"]["rows"] == 120
    assert {d: len(s) for d, s in data.shares.items()} == {
        d: v["share_rows"] for d, v in report.devices.items()}
    assert cfg.devices_of("w0") == ["s00", "s02"]


def test_effective_config_loads_again_unchanged(recording, tmp_path):
    """Workers reload the config `run` wrote: what apply_recording_source set must pass again."""
    rec, _ = recording
    cfg = job(rec, "data.replay_speed=2")
    path = tmp_path / "job.json"
    path.write_text(json.dumps(cfg.to_dict()))

    again = load_config(path, env={})

    assert again.to_dict() == cfg.to_dict()
    assert again.devices.rates_hz == [100.0, 60.0, 40.0]  # recorded rates x replay speed


def test_replay_speed_max_keeps_recorded_rates_and_bad_speed_is_refused(recording):
    rec, _ = recording
    assert job(rec, "data.replay_speed=max").devices.rates_hz == [50.0, 30.0, 20.0]
    with pytest.raises(ConfigError, match="data.replay_speed"):
        job(rec, "data.replay_speed=fast")


@pytest.mark.parametrize("override, key", [
    ("devices.count=5", "devices.count"),
    ("devices.ids=a,b,c", "devices.ids"),
    ("devices.rates_hz=1,2,3", "devices.rates_hz"),
    ("devices.profile=poisson", "devices.profile"),
    ("data.heldout_fraction=0.3", "data.heldout_fraction"),
    ("data.partition=dirichlet", "data.partition"),
    ("devices.time_scale=2", "devices.time_scale"),
])
def test_settings_contradicting_the_recording_are_refused(recording, override, key):
    rec, _ = recording
    with pytest.raises(ConfigError) as exc:
        job(rec, override)
    message = str(exc.value)
    assert message.startswith(key) and "\n" not in message


def test_settings_matching_the_recording_are_accepted(recording):
    rec, _ = recording
    cfg = job(rec, "devices.count=3", "devices.ids=s00,s01,s02", "devices.rates_hz=50,30,20")
    assert cfg.devices.device_ids() == ["s00", "s01", "s02"]


def test_more_workers_than_recorded_devices_is_refused(recording):
    rec, _ = recording
    with pytest.raises(ConfigError, match="workers.count=4 exceeds devices.count=3"):
        job(rec, "workers.count=4")


def test_value_range_of_a_recording_is_its_min_max_widened(recording):
    rec, _ = recording
    info = read_recording_info(rec)

    lo, hi = job_fleet_data(job(rec)).value_range  # auto, margin 1
    span = info.stats.max.astype(np.float64) - info.stats.min
    assert lo.dtype == hi.dtype == np.float32 and lo.shape == hi.shape == (4,)
    np.testing.assert_allclose(lo, info.stats.min - span, rtol=1e-6)
    np.testing.assert_allclose(hi, info.stats.max + span, rtol=1e-6)

    lo0, hi0 = job_fleet_data(job(rec, "data.value_margin=0")).value_range
    train = job_fleet_data(job(rec)).train.features
    assert (lo0 <= train.min(axis=0)).all() and (hi0 >= train.max(axis=0)).all()
    assert (hi0 - lo0 < 1.01 * span + 1e-5).all()


def test_value_range_of_each_source_kind(recording):
    rec, _ = recording
    digits = job_fleet_data(load_config(env={}))
    lo, hi = digits.value_range
    assert lo.shape == hi.shape == () and (float(lo), float(hi)) == (0.0, 1.0)

    synth = job_fleet_data(load_config(overrides=["data.source=synthetic", "data.synthetic_samples=240",
                                                  "data.value_margin=0.5"], env={}))
    lo, hi = synth.value_range
    every = np.concatenate([synth.train.features, synth.heldout.features, synth.validation.features]).reshape(240, -1)
    assert lo.shape == (every.shape[1],) and lo.dtype == np.float32
    span = every.max(axis=0).astype(np.float64) - every.min(axis=0)
    np.testing.assert_allclose(lo, every.min(axis=0) - 0.5 * span, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(hi, every.max(axis=0) + 0.5 * span, rtol=1e-6, atol=1e-6)

    for cfg in (load_config(overrides=["data.value_range=-2.5,40"], env={}),
                job(rec, "data.value_range=-2.5, 40")):
        lo, hi = job_fleet_data(cfg).value_range
        assert lo.shape == hi.shape == () and (float(lo), float(hi)) == (-2.5, 40.0)
    assert job_fleet_data(job(rec, "data.value_range=none")).value_range is None
    assert job_fleet_data(load_config(overrides=["data.value_range=none"], env={})).value_range is None


def test_input_stats_only_for_a_recording(recording):
    rec, _ = recording
    data = job_fleet_data(job(rec))
    mean, std = data.input_stats
    np.testing.assert_allclose(mean, data.train.features.astype(np.float64).mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(std, data.train.features.astype(np.float64).std(axis=0), rtol=1e-5)
    assert job_fleet_data(load_config(env={})).input_stats is None


def copy_recording(rec, dest):
    import shutil

    shutil.copytree(rec, dest)
    return dest


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("missing", [HELDOUT_FILE, TRAIN_FILE])
def test_missing_data_file_is_one_line_naming_it_and_the_fix(recording, tmp_path, missing):
    rec = copy_recording(recording[0], tmp_path / "r")
    (rec / missing).unlink()

    with pytest.raises(RecordingSourceError) as exc:
        job(rec)
    message = one_line(exc)
    assert f"{missing} is missing" in message and "re-run `edgestream import --file" in message
    assert "--label-column kind" in message


def test_the_printed_fix_for_a_damaged_recording_runs_as_written_and_makes_it_again(recording, tmp_path, capsys):
    import shlex

    from edgestream.cli.main import main

    rec = copy_recording(recording[0], tmp_path / "r")
    (rec / HELDOUT_FILE).unlink()
    with pytest.raises(RecordingSourceError) as exc:
        job(rec)
    command = one_line(exc).split("re-run `", 1)[1].split("`", 1)[0]
    assert command.startswith("edgestream import ") and "--duration 2 " in command  # the length it needs

    argv = [str(tmp_path / "again") if word == "NEW_DIR" else word for word in shlex.split(command)[1:]]
    assert main(argv) == 0, capsys.readouterr()

    again, original = (json.loads((d / IMPORT_INFO).read_text())["data"] for d in (tmp_path / "again", rec))
    for key in ("device_ids", "rates_hz", "partition", "seed", "heldout_fraction", "duration_s", "heldout"):
        assert again[key] == original[key], key


def test_the_fix_for_a_missing_recording_names_the_length_option(tmp_path):
    with pytest.raises(RecordingSourceError) as exc:
        job(tmp_path / "nowhere")
    assert "--duration SECONDS" in one_line(exc)


def test_older_import_without_heldout_is_refused(recording, tmp_path):
    rec = copy_recording(recording[0], tmp_path / "r")
    info = json.loads((rec / IMPORT_INFO).read_text())
    for key in ("data", "version", "format"):
        info.pop(key)
    (rec / IMPORT_INFO).write_text(json.dumps(info))

    with pytest.raises(RecordingSourceError) as exc:
        job(rec)
    assert "older `edgestream import`" in one_line(exc) and "re-run" in str(exc.value)


@pytest.mark.parametrize("version", ["x", 2.5, True, None])
def test_a_version_that_is_not_an_integer_is_one_line(recording, tmp_path, version):
    rec = copy_recording(recording[0], tmp_path / "r")
    info = json.loads((rec / IMPORT_INFO).read_text())
    info["version"] = version
    (rec / IMPORT_INFO).write_text(json.dumps(info))

    with pytest.raises(RecordingSourceError) as exc:
        job(rec)
    assert f"has version {version!r}, not an integer" in one_line(exc)


def test_topic_recording_without_import_json_is_refused(tmp_path):
    with RecordingWriter(tmp_path / "rec") as writer:
        writer.write(RecordedMessage("sensors.dev00", 0, 0, 1000, None, b"x"))

    with pytest.raises(RecordingSourceError) as exc:
        job(tmp_path / "rec")
    message = one_line(exc)
    assert "no import.json" in message and "edgestream record" in message and "edgestream import" in message


def test_missing_directory_and_corrupt_npz(recording, tmp_path):
    with pytest.raises(RecordingSourceError, match="no such directory"):
        job(tmp_path / "nowhere")
    rec = copy_recording(recording[0], tmp_path / "r")
    (rec / HELDOUT_FILE).write_bytes(b"not a zip")
    cfg = job(rec)  # the config only checks presence; the arrays are read by workers
    with pytest.raises(RecordingSourceError) as exc:
        job_fleet_data(cfg)
    assert f"{HELDOUT_FILE} cannot be read" in one_line(exc)


def test_stream_devices_refuses_garbage_for_a_recording(recording):
    with pytest.raises(ConfigError, match="garbage injection"):
        stream_devices(job(recording[0]), "127.0.0.1:1", 1.0, garbage_per_device=2, stop=threading.Event())


def test_send_order_gives_exact_per_device_counts_for_any_prefix(recording):
    rec, report = recording
    order = _send_order(rec, ["s00", "s01", "s02"])

    records, messages, bad = order.counts(len(order.device))
    assert records == {d: v["records"] for d, v in report.devices.items()}
    assert messages == {d: v["messages"] for d, v in report.devices.items()}
    assert bad == {"s00": 0, "s01": 0, "s02": 0}
    records, messages, _ = order.counts(4)
    assert sum(messages.values()) == 4 and sum(records.values()) == int(order.records[:4].sum())
    assert order.counts(0)[0] == {"s00": 0, "s01": 0, "s02": 0}


def test_stream_devices_stops_a_recording_at_the_deadline_with_exact_counts(recording, monkeypatch, tmp_path):
    """The replayer (faked here: one message every 10 ms) is stopped by the deadline; the
    report counts exactly the prefix it sent, per device."""
    import edgestream.pipeline.replay  # noqa: F401
    from edgestream import pipeline
    from edgestream.pipeline.replay import ReplayProgress, ReplayReport

    rec, report = recording
    order = _send_order(rec, ["s00", "s01", "s02"])
    topics_of = [f"sensors.{d}" for d in ("s00", "s01", "s02")]
    seen: list[dict[str, int]] = []

    def fake_replay(directory, bootstrap, *, stop, progress, topics_filter, **kwargs):
        per_topic = {t: 0 for t in topics_filter}
        sent = 0
        while sent < len(order.device) and not stop.wait(0.01):
            per_topic[topics_of[order.device[sent]]] += 1
            sent += 1
            progress(ReplayProgress(messages=sent, bytes=sent))
        return ReplayReport(1.0, sent, sent, 1, per_topic, {}, 0.0, None, [])

    monkeypatch.setattr(pipeline.replay, "replay", fake_replay)
    cfg = job(rec)

    result = stream_devices(cfg, "127.0.0.1:1", 0.3, progress=lambda r: seen.append(dict(r.records)),
                            report_path=tmp_path / "sim.json")

    sent = sum(result.messages.values())
    assert 0 < sent < len(order.device)  # cut by the 0.3 s deadline, well before the end
    records, messages, _ = order.counts(sent)
    assert result.records == records and result.messages == messages
    assert seen and seen[-1] == records
    assert json.loads((tmp_path / "sim.json").read_text())["records"] == records
