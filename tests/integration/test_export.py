"""`edgestream export` after a real run: a short BSP job trained over the broker through the CLI,
its model exported through the CLI, and ONNX Runtime's predictions on the held-out split give
the accuracy the card states; a stage-split (synthetic gradients) job exported as one whole model.

`edgestream run` runs as its own process (as a user starts it: it installs its own signal
handlers); `export` and `export --verify` run the same CLI entry (``cli.main.main``) in this
process, which saves an interpreter start each (ONNX Runtime still checks the export in a
fresh process of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from edgestream.cli.main import main
from edgestream.job.config import load_config
from edgestream.job.sources import job_fleet_data
from edgestream.pipeline import security
from tests.integration.jobs import REPO

pytestmark = pytest.mark.integration


def cli(*args: str, cwd: Path, timeout_s: float = 240.0) -> subprocess.CompletedProcess:
    """``edgestream ARGS`` to its end (this checkout, this interpreter)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("EDGESTREAM_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "edgestream", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


@pytest.fixture
def in_process(capsys, monkeypatch, tmp_path):
    """``edgestream ARGS`` through ``cli.main.main`` in this process, in ``tmp_path``: its
    exit code, stdout and stderr as a ``CompletedProcess``. What the command sets for its
    process (OMP_NUM_THREADS, the Kafka security settings, torch's thread count) is put back
    afterwards."""
    import torch

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EDGESTREAM_DEBUG", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # main's default
    monkeypatch.setattr(security, "_current", security.current())
    threads = torch.get_num_threads()

    def call(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        try:
            code = main(list(args))
        finally:
            torch.set_num_threads(threads)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["edgestream", *args], code, out, err)

    return call


def bsp_job(path: Path, unique: str, state: Path) -> Path:
    path.write_text(f"""
[job]
name = "x{unique}"

[data]
source = "digits"

[devices]
ids = ["a{unique}", "b{unique}"]
count = 2
rates_hz = [200, 150]
message_interval_s = 0.05

[batcher]
window_s = 0.25
max_batch = 64

[workers]
count = 2

[train]
enabled = true
model = "mlp"
lr = 0.1
eval_every_s = 1
checkpoint_every_steps = 10

[run]
state_dir = "{state}"
duration_s = 8
drain_timeout_s = 60
""")
    return path


def onnx_accuracy(directory: Path, features: np.ndarray, labels: np.ndarray) -> float:
    session = onnxruntime.InferenceSession(str(directory / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"features": features})[0]
    return float((logits.argmax(axis=1) == labels).mean())


def test_a_trained_job_exports_and_onnx_runtime_scores_what_the_card_says(kafka_bootstrap, unique, tmp_path,
                                                                          in_process):
    state = tmp_path / "state"
    job = bsp_job(tmp_path / "job.toml", unique, state)
    run = cli("run", "--job", str(job), "--bootstrap", kafka_bootstrap, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    out = tmp_path / "export"
    done = in_process("export", "--job", str(job), "--out", str(out))
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "max abs diff" in done.stdout and "done in" in done.stdout
    card = json.loads((out / "model-card.json").read_text())
    training = json.loads((state / "workers" / "w0" / "training.json").read_text())

    # The model of BSP's first worker, as its final checkpoint left it (the one the run's summary reports).
    assert card["worker"] == "w0" and card["strategy"] == "bsp" and card["model"]["name"] == "mlp"
    assert card["version"]["model_version"] == training["version"] > 0
    assert card["version"]["trained_records"] > 0
    assert card["evaluation"]["prequential"]["accuracy"] == training["prequential"]["accuracy"]
    check = card["checks"]["onnxruntime"]
    assert check["fresh_process"] and check["max_abs_diff"] <= check["tolerance"]
    # ONNX Runtime on the held-out split: the card's accuracy, and a model that learned.
    data = job_fleet_data(load_config(job, env={}))
    held = card["evaluation"]["heldout"]
    assert held["samples"] == len(data.heldout) and held["split"] == "heldout"
    accuracy = onnx_accuracy(out, data.heldout.features, data.heldout.labels)
    assert accuracy == pytest.approx(held["accuracy"], abs=1 / len(data.heldout))
    assert accuracy > 0.5  # chance: 0.1
    verified = in_process("export", "--verify", str(out))
    assert verified.returncode == 0 and "3 file(s) match the card" in verified.stdout


def test_a_stage_split_job_is_exported_as_one_whole_model(kafka_bootstrap, unique, tmp_path, in_process):
    state = tmp_path / "state"
    sets = [f"job.name=s{unique}", f"devices.ids=a{unique},b{unique},c{unique}", f"run.state_dir={state}",
            "run.duration_s=10", "train.checkpoint_every_steps=10"]
    flags = [arg for s in sets for arg in ("--set", s)]
    job = REPO / "examples" / "dni.toml"
    run = cli("run", "--job", str(job), *flags, "--bootstrap", kafka_bootstrap, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((state / "summary.json").read_text())

    out = tmp_path / "export"
    done = in_process("export", "--job", str(job), *flags, "--out", str(out))
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "assembling the 3 stages (w0, w1, w2)" in done.stdout
    card = json.loads((out / "model-card.json").read_text())
    assert card["stages"] == ["block1", "block3"] and card["worker"] is None
    assert [p["process"] for p in card["version"]["processes"]] == ["w0", "w1", "w2"]
    # The whole conv8: every stage's parameters in one file, under the model's own names.
    assert card["model"] == {"name": "conv8", "params": {"norm": "batch"},
                             "parameters": card["model"]["parameters"]}
    assert card["input"]["shape"] == [None, 64] and card["output"]["shape"] == [None, 10]
    # The same final checkpoints the run put together for its summary: the same accuracy.
    assembled = summary["assembled"]
    assert {p["process"]: p["model_version"] for p in card["version"]["processes"]} == assembled["versions"]
    assert card["evaluation"]["heldout"]["accuracy"] == pytest.approx(assembled["accuracy"], abs=1e-12)
    data = job_fleet_data(load_config(job, overrides=sets, env={}))
    accuracy = onnx_accuracy(out, data.heldout.features, data.heldout.labels)
    assert accuracy == pytest.approx(card["evaluation"]["heldout"]["accuracy"], abs=1 / len(data.heldout))
    # The top stage scored every batch before training on it: the whole model's prequential accuracy.
    assert card["evaluation"]["prequential"]["accuracy"] is not None
