"""`edgestream export` on state directories written the way workers write them (CheckpointStore),
without Kafka: which checkpoint it takes, what it refuses (one line, exit 2), `--verify`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from edgestream.cli.main import main
from edgestream.job.config import load_config
from edgestream.job.plan import training_plan
from edgestream.job.sources import job_fleet_data
from edgestream.pipeline.exits import worker_state_dir
from edgestream.trainers import assembly
from edgestream.trainers.checkpoint import CheckpointStore, checkpoint_name
from edgestream.trainers.local import limit_torch_threads
from edgestream.trainers.models import build_model


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> None:
    limit_torch_threads(1)


def job_sets(*extra: str) -> list[str]:
    return ["job.name=exp", "train.enabled=true", "workers.count=2", "devices.count=2", *extra]


def write_checkpoints(state: Path, sets: list[str], count: int = 2) -> None:
    """``count`` checkpoints of every process of the job, as its CheckpointStore writes them."""
    cfg = load_config(overrides=[*sets, f"run.state_dir={state}"], env={})
    plan, data = training_plan(cfg), job_fleet_data(cfg)
    for name in cfg.worker_names():
        driver = assembly.build_driver(plan, name, data)
        store = CheckpointStore(worker_state_dir(cfg, name) / "checkpoints", keep=3)
        for step in range(count):
            with_step = {"steps": step * 10, "trained_records": step * 100, "worker": name}
            store.save(driver.trainer, driver.strategy, {}, with_step)


def export(state: Path, *args: str, sets: list[str] | None = None) -> int:
    flags = [item for s in (sets or job_sets()) for item in ("--set", s)]
    return main(["export", *flags, "--state-dir", str(state), *args])


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_no_checkpoint_is_refused_with_exit_2(tmp_path, capsys):
    assert export(tmp_path / "state", "--out", str(tmp_path / "out")) == 2
    line = one_error_line(capsys)
    assert "no checkpoint of w0" in line and "edgestream run" in line


def test_an_unknown_worker_is_refused_naming_the_processes(tmp_path, capsys):
    assert export(tmp_path / "state", "--worker", "w9", "--out", str(tmp_path / "out")) == 2
    assert "unknown worker 'w9': the job's processes are w0, w1" in one_error_line(capsys)


def test_an_output_directory_that_cannot_be_written_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert export(tmp_path / "state", "--out", str(tmp_path / "file" / "out")) == 2
    assert "is not writable" in one_error_line(capsys)


def test_a_checkpoint_of_another_model_shape_is_refused(tmp_path, capsys):
    write_checkpoints(tmp_path / "state", job_sets("train.model_params=hidden=[32]"), count=1)
    assert export(tmp_path / "state", "--out", str(tmp_path / "out")) == 2
    line = one_error_line(capsys)
    assert "holds a model of another shape" in line and "train.model='mlp'" in line and "size mismatch" in line
    assert not (tmp_path / "out" / "model-card.json").exists()


def test_a_tampered_newest_checkpoint_falls_back_to_the_older_one_and_says_so(tmp_path, capsys):
    state = tmp_path / "state"
    write_checkpoints(state, job_sets(), count=2)
    newest = state / "workers" / "w1" / "checkpoints" / checkpoint_name(2)
    data = bytearray(newest.read_bytes())
    data[-5] ^= 0xFF
    newest.write_bytes(bytes(data))
    assert export(state, "--worker", "w1", "--formats", "safetensors", "--out", str(tmp_path / "out")) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {checkpoint_name(2)} of w1 refused: payload digest mismatch" in out
    assert f"using the older checkpoint {checkpoint_name(1)} of w1" in out
    card = json.loads((tmp_path / "out" / "model-card.json").read_text())
    assert card["worker"] == "w1"
    assert card["version"]["checkpoint"] == checkpoint_name(1) and card["version"]["checkpoint_sequence"] == 1
    assert card["version"]["processes"][0]["skipped_newer"] == [checkpoint_name(2)]
    assert card["version"]["steps"] == 0 and card["evaluation"]["heldout"]["samples"] > 0
    assert card["evaluation"]["prequential"]["accuracy"] is None and "training.json" in \
        card["evaluation"]["prequential"]["reason"]
    assert newest.exists() and not (newest.parent / "rejected").exists()  # the state dir is only read


def test_a_named_checkpoint_file_is_exported_as_the_process_that_wrote_it(tmp_path, capsys):
    state = tmp_path / "state"
    write_checkpoints(state, job_sets(), count=1)
    path = state / "workers" / "w1" / "checkpoints" / checkpoint_name(1)
    assert export(state, "--checkpoint", str(path), "--formats", "safetensors", "--out", str(tmp_path / "out")) == 0
    assert json.loads((tmp_path / "out" / "model-card.json").read_text())["worker"] == "w1"
    assert export(state, "--checkpoint", str(tmp_path / "none.bin"), "--out", str(tmp_path / "out2")) == 2
    assert "no such file" in one_error_line(capsys)


def test_a_stage_split_job_refuses_a_single_worker(tmp_path, capsys):
    sets = job_sets("workers.count=3", "devices.count=3", "train.model=conv8", "train.strategy=dni",
                    "train.stages=block1,block3")
    assert export(tmp_path / "state", "--worker", "w1", "--out", str(tmp_path / "out"), sets=sets) == 2
    line = one_error_line(capsys)
    assert "train.stages splits the model over w0, w1, w2" in line and "drop --worker" in line


def test_verify_names_a_tampered_file_in_one_line_exit_1(tmp_path, capsys):
    state = tmp_path / "state"
    write_checkpoints(state, job_sets(), count=1)
    out = tmp_path / "out"
    assert export(state, "--formats", "safetensors", "--out", str(out)) == 0
    capsys.readouterr()
    assert main(["export", "--verify", str(out)]) == 0
    assert "1 file(s) match the card" in capsys.readouterr().out
    with open(out / "model.safetensors", "ab") as handle:
        handle.write(b"\0")
    assert main(["export", "--verify", str(out)]) == 1
    line = one_error_line(capsys)
    assert "refused" in line and "model.safetensors" in line


def test_unknown_formats_and_a_missing_out_are_usage_errors(tmp_path, capsys):
    assert export(tmp_path / "state", "--formats", "pickle", "--out", str(tmp_path / "o")) == 2
    assert "unknown format(s) pickle" in one_error_line(capsys)
    assert export(tmp_path / "state") == 2
    assert "needs --out DIR" in one_error_line(capsys)


def test_a_stage_split_job_is_put_together_from_every_stage(tmp_path):
    sets = job_sets("workers.count=3", "devices.count=3", "train.model=conv8", "train.strategy=dni",
                    "train.stages=block1,block3")
    state = tmp_path / "state"
    write_checkpoints(state, sets, count=1)
    assert export(state, "--formats", "safetensors", "--out", str(tmp_path / "out"), sets=sets) == 0
    card = json.loads((tmp_path / "out" / "model-card.json").read_text())
    assert card["stages"] == ["block1", "block3"] and card["worker"] is None
    assert [p["process"] for p in card["version"]["processes"]] == ["w0", "w1", "w2"]
    whole = build_model("conv8", (64,), 10, seed=0)
    assert sorted(load_file(str(tmp_path / "out" / "model.safetensors"))) == sorted(whole.state_dict())


def test_the_prequential_accuracy_comes_from_the_process_summary(tmp_path):
    state = tmp_path / "state"
    write_checkpoints(state, job_sets(), count=1)
    summary = {"version": 0, "prequential": {"records": 120, "accuracy": 0.75, "window_accuracy": 0.8}}
    (state / "workers" / "w0" / "training.json").write_text(json.dumps(summary))
    assert export(state, "--formats", "safetensors", "--out", str(tmp_path / "out")) == 0
    preq = json.loads((tmp_path / "out" / "model-card.json").read_text())["evaluation"]["prequential"]
    assert preq == {"accuracy": 0.75, "records": 120, "window_accuracy": 0.8, "source": "workers/w0/training.json",
                    "summary_model_version": 0}
