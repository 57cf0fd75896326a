"""`edgestream export` after a real run, for every built-in model: each trained for a few seconds
over the broker through the CLI (on a data source its input fits), exported through the CLI, its
ONNX Runtime check passed, and ONNX Runtime's predictions on the held-out split give the accuracy
the card states.

The models come from the registry at test time (``trainers.models``: those it defines itself,
not installed plugins'), so a new built-in model is covered without editing this file; those
``test_export.py`` already trains and exports (``EXPORTED_THERE``) are left to it. A model no
data source fits fails its test, naming what each source said."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgestream.job.config import load_config
from edgestream.job.sources import job_fleet_data
from edgestream.trainers.errors import ModelConfigError
from edgestream.trainers.models import build_model, model_names, resolve_model
from tests.integration import test_export as exported
from tests.integration.jobs import newest_checkpoint

pytestmark = pytest.mark.integration

#: ``edgestream export`` through ``cli.main.main`` in this process (test_export.py's fixture).
in_process = exported.in_process

#: Trained and exported by test_export.py already: mlp by a BSP job, conv8 by the stage-split job.
EXPORTED_THERE = ("mlp", "conv8")
#: The data sources a job can use without files of its own (``series`` and ``recording`` need
#: one), in the order they are tried: digits' 64 pixels, synthetic's (channels, time) windows.
SOURCES = ("digits", "synthetic")
#: Streaming time of each run: the shortest that still trains (the run checkpoints on shutdown too).
DURATION_S = 4


def builtin_models() -> list[str]:
    """The models ``trainers.models`` registers itself (``edgestream models`` lists these and
    installed plugins')."""
    return [name for name in model_names() if resolve_model(name).__module__ == "edgestream.trainers.models"]


def source_for(model: str) -> str:
    """The first of ``SOURCES`` whose data ``model`` is built for (as a worker builds it); the
    test fails, with each source's refusal, if there is none."""
    refusals = []
    for source in SOURCES:
        data = job_fleet_data(load_config(overrides=[f"data.source={source}"], env={}))
        try:
            build_model(model, data.feature_shape, data.num_classes, seed=0)
        except ModelConfigError as exc:
            refusals.append(f"{source} {tuple(data.feature_shape)}: {exc}")
            continue
        return source
    pytest.fail(f"built-in model {model!r} fits none of the data sources {SOURCES} "
                f"({'; '.join(refusals)}): add a source its input fits to SOURCES in {Path(__file__).name}")


@pytest.mark.parametrize("model", [name for name in builtin_models() if name not in EXPORTED_THERE])
def test_every_builtin_model_trains_over_the_broker_and_exports(model, kafka_bootstrap, unique, tmp_path,
                                                                in_process):
    source = source_for(model)
    state = tmp_path / "state"
    job = exported.bsp_job(tmp_path / "job.toml", unique, state)
    sets = [f"train.model={model}", f"data.source={source}", f"run.duration_s={DURATION_S}"]
    flags = [arg for s in sets for arg in ("--set", s)]
    run = exported.cli("run", "--job", str(job), *flags, "--bootstrap", kafka_bootstrap, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((state / "summary.json").read_text())
    assert summary["outcome"] == "balanced" and summary["balanced"], summary["reason"]
    checkpoint = newest_checkpoint(state, "w0")
    assert checkpoint is not None, f"no checkpoint of w0 under {state}"

    out = tmp_path / "export"
    done = in_process("export", "--job", str(job), *flags, "--out", str(out))
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "max abs diff" in done.stdout
    card = json.loads((out / "model-card.json").read_text())
    training = json.loads((state / "workers" / "w0" / "training.json").read_text())
    data = job_fleet_data(load_config(job, overrides=sets, env={}))

    assert card["worker"] == "w0" and card["model"]["name"] == model
    assert card["input"]["shape"] == [None, *data.feature_shape]
    assert card["output"]["shape"] == [None, data.num_classes]
    assert card["version"]["model_version"] == training["version"] > 0
    assert card["version"]["trained_records"] > 0
    check = card["checks"]["onnxruntime"]
    assert check["fresh_process"] and check["max_abs_diff"] <= check["tolerance"]
    # ONNX Runtime on the held-out split (channels x time windows for a 1-D model): the card's accuracy.
    held = card["evaluation"]["heldout"]
    assert held["samples"] == len(data.heldout) and held["split"] == "heldout"
    accuracy = exported.onnx_accuracy(out, data.heldout.features, data.heldout.labels)
    assert accuracy == pytest.approx(held["accuracy"], abs=1 / len(data.heldout))
