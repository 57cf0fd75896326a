"""Exported models (trainers/export.py): every built-in model written as ONNX, TorchScript and
safetensors, each read back where no edgestream exists and checked against torch; the card; the
digest check that refuses a tampered or truncated file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from edgestream.trainers import export as export_mod
from edgestream.trainers.export import (
    CARD_FILE,
    FLOAT32_TOLERANCE,
    FORMATS,
    ExportCheckFailed,
    ExportError,
    ExportTampered,
    check_writable,
    compare_logits,
    export_model,
    exportable,
    file_digest,
    load_exported,
    parse_formats,
    tolerance_for,
    verify_export,
)
from edgestream.trainers.models import build_model, model_names

#: Per built-in model: the input shape of a job it is made for (digits' 64 pixels; a sensor
#: window of 6 channels, as BasicMotions'), and the options it is built with.
CASES: dict[str, tuple[str, tuple[int, ...], dict]] = {
    "mlp": ("mlp", (64,), {}),
    "digits_cnn": ("digits_cnn", (64,), {}),
    "conv8": ("conv8", (64,), {}),
    "conv8_bn": ("conv8", (64,), {"norm": "batch"}),  # examples/dni.toml's model
    "cnn1d": ("cnn1d", (6, 40), {}),
    "conv8_1d": ("conv8_1d", (6, 40), {}),
}
CLASSES = 4


def _model(case: str) -> torch.nn.Module:
    name, shape, options = CASES[case]
    width = int(np.prod(shape))
    rng = np.random.default_rng(len(case))
    model = build_model(name, shape, CLASSES, seed=3, standardize=(rng.normal(size=width), rng.uniform(0.2, 3, width)),
                        **options)
    with torch.no_grad():  # BatchNorm statistics as training leaves them, not the identity they start as
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    return model


def _features(case: str, rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, *CASES[case][1])).astype(np.float32)


def _reference(model: torch.nn.Module, features: np.ndarray) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(features)).numpy()


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path, dict]]:
    """Every case exported once (the dynamo exporter takes seconds a model): model, directory, card."""
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for case in CASES:
        model = _model(case)
        report = export_model(model, root / case, input_shape=CASES[case][1], num_classes=CLASSES,
                              check_features=_features(case, 17, seed=1),
                              card={"model": {"name": CASES[case][0], "params": CASES[case][2]}})
        out[case] = (model, report.directory, report.card)
    return out


#: Run by ``python -I`` with edgestream made unimportable: every export read by plain onnxruntime,
#: torch and safetensors, outputs saved for the test to compare.
READ_BACK = """
import json, sys
sys.modules["edgestream"] = None
try:
    import edgestream  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("edgestream is importable here")
import numpy as np
import onnxruntime as ort
import torch
from safetensors.torch import load_file
torch.set_num_threads(1)
jobs = json.loads(sys.argv[1])
for job in jobs:
    x = np.load(job["features"], allow_pickle=False)
    session = ort.InferenceSession(job["dir"] + "/model.onnx", providers=["CPUExecutionProvider"])
    onnx_out = session.run(None, {session.get_inputs()[0].name: x})[0]
    ts = torch.jit.load(job["dir"] + "/model.ts")
    ts.eval()
    with torch.no_grad():
        ts_out = ts(torch.from_numpy(x)).numpy()
    state = load_file(job["dir"] + "/model.safetensors")
    np.savez(job["out"], onnx=onnx_out, torchscript=ts_out, tensors=np.array(sorted(state)))
print("read", len(jobs))
"""


@pytest.fixture(scope="module")
def read_back(exports, tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    """Every export read in one fresh ``python -I`` process (no edgestream, no PYTHONPATH), on a
    batch size the export never saw (dynamic batch)."""
    scratch = tmp_path_factory.mktemp("read-back")
    jobs = []
    for case, (_, directory, _) in exports.items():
        np.save(scratch / f"{case}.npy", _features(case, 5, seed=2), allow_pickle=False)
        jobs.append({"dir": str(directory), "features": str(scratch / f"{case}.npy"),
                     "out": str(scratch / f"{case}.npz")})
    done = subprocess.run([sys.executable, "-I", "-c", READ_BACK, json.dumps(jobs)], cwd=scratch,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"read {len(jobs)}"
    return {case: dict(np.load(scratch / f"{case}.npz")) for case in exports}


def test_every_builtin_model_has_a_case():
    missing = set(model_names()) - {name for name, _, _ in CASES.values()}
    assert not missing, f"add a job-like input shape for {sorted(missing)} to CASES"


@pytest.mark.parametrize("case", list(CASES))
def test_onnx_runtime_in_a_fresh_process_matches_torch(exports, read_back, case):
    model, _, card = exports[case]
    check = card["checks"]["onnxruntime"]
    assert check["fresh_process"] and check["passed"] and check["samples"] == 17
    assert check["tolerance"] == tolerance_for(_reference(model, _features(case, 17, seed=1)))
    assert check["max_abs_diff"] <= check["tolerance"]
    expected = _reference(model, _features(case, 5, seed=2))
    got = read_back[case]["onnx"]
    assert got.shape == (5, CLASSES)
    assert np.abs(got - expected).max() <= tolerance_for(expected)


@pytest.mark.parametrize("case", list(CASES))
def test_torchscript_loads_without_edgestream_and_matches(exports, read_back, case):
    model, _, card = exports[case]
    expected = _reference(model, _features(case, 5, seed=2))
    assert np.abs(read_back[case]["torchscript"] - expected).max() <= tolerance_for(expected)
    assert card["checks"]["torchscript"]["max_abs_diff"] <= card["checks"]["torchscript"]["tolerance"]


@pytest.mark.parametrize("case", list(CASES))
def test_safetensors_and_the_cards_statistics_rebuild_the_model(exports, read_back, case):
    model, directory, card = exports[case]
    name, shape, options = CASES[case]
    state = load_file(str(directory / FORMATS["safetensors"]))
    assert sorted(state) == sorted(model.state_dict()) == list(read_back[case]["tensors"])
    # A fresh, differently seeded model without standardisation: the file's weights and the
    # card's statistics are all it needs to compute what the trained model computes.
    rebuilt = build_model(name, shape, CLASSES, seed=99, **options)
    rebuilt.load_state_dict(state, strict=True)
    rebuilt.eval()
    std = card["standardization"]
    x = _features(case, 5, seed=2)
    flat = (x.reshape(5, -1) - np.array(std["mean"], dtype=np.float32)) * np.array(std["inv_std"], dtype=np.float32)
    with torch.no_grad():
        got = rebuilt(torch.from_numpy(flat.reshape(x.shape))).numpy()
    assert np.abs(got - _reference(model, x)).max() <= tolerance_for(got)
    assert card["checks"]["safetensors"] == {"tensors": len(state), "round_trip": True, "passed": True}


@pytest.mark.parametrize("case", ["mlp", "conv8_1d"])
def test_the_card_describes_the_files_and_the_model(exports, case):
    model, directory, card = exports[case]
    _, shape, _ = CASES[case]
    assert card["card_format"] == 1
    assert card["input"]["shape"] == [None, *shape] and card["input"]["name"] == "features"
    assert card["output"]["shape"] == [None, CLASSES]
    assert card["model"] == {"name": CASES[case][0], "params": CASES[case][2]}
    width = int(np.prod(shape))
    std = card["standardization"]
    assert len(std["mean"]) == len(std["std"]) == len(std["inv_std"]) == width
    assert np.allclose(std["mean"], model.input_standardizer.shift.numpy())
    assert set(card["files"]) == set(FORMATS.values())
    for name, entry in card["files"].items():
        assert entry == {"format": entry["format"], **file_digest(directory / name)}
    assert card["versions"]["torch"] == torch.__version__ and card["versions"]["onnxruntime"]
    assert json.loads((directory / CARD_FILE).read_text()) == card


def test_exportable_makes_the_standardisation_explicit_and_leaves_the_model_alone():
    model = _model("mlp")
    x = _features("mlp", 6, seed=4)
    before = _reference(model, x)
    wrapper = exportable(model)
    assert not any(wrapper.model._forward_pre_hooks.values())
    assert hasattr(model, "input_standardizer") and model._forward_pre_hooks  # the original keeps its hook
    with torch.no_grad():
        assert np.array_equal(wrapper(torch.from_numpy(x)).numpy(), before)
    # Without the explicit step the hook-less copy computes something else: the step is needed.
    with torch.no_grad():
        assert not np.allclose(wrapper.model(torch.from_numpy(x)).numpy(), before)


def test_a_model_without_statistics_has_no_standardisation_in_its_card(tmp_path):
    model = build_model("mlp", (8,), 3, seed=0)
    card = export_model(model, tmp_path / "plain", input_shape=(8,), num_classes=3,
                        check_features=_features_of((8,)), formats=("safetensors",)).card
    assert card["standardization"] is None
    assert set(card["files"]) == {"model.safetensors"} and "onnxruntime" not in card["checks"]


def _features_of(shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(0).normal(size=(4, *shape)).astype(np.float32)


def _copy(exports, case: str, tmp_path: Path) -> Path:
    target = tmp_path / case
    shutil.copytree(exports[case][1], target)
    return target


def test_verify_accepts_an_intact_export_and_load_exported_runs_it(exports, tmp_path):
    directory = _copy(exports, "digits_cnn", tmp_path)
    assert verify_export(directory) == exports["digits_cnn"][2]
    x = _features("digits_cnn", 3, seed=5)
    card, session = load_exported(directory, "onnx")
    onnx_out = session.run(None, {"features": x})[0]
    _, module = load_exported(directory, "torchscript")
    with torch.no_grad():
        ts_out = module(torch.from_numpy(x)).numpy()
    expected = _reference(exports["digits_cnn"][0], x)
    assert np.abs(onnx_out - expected).max() <= tolerance_for(expected)
    assert np.abs(ts_out - expected).max() <= tolerance_for(expected)


@pytest.mark.parametrize(("file", "damage", "says"), [
    ("model.onnx", "flip", "sha256 differs"),
    ("model.safetensors", "truncate", "bytes, the card says"),
    ("model.ts", "delete", "missing"),
])
def test_a_tampered_truncated_or_missing_file_is_refused_by_name(exports, tmp_path, file, damage, says):
    directory = _copy(exports, "mlp", tmp_path)
    path = directory / file
    data = path.read_bytes()
    if damage == "flip":
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1:])
    elif damage == "truncate":
        path.write_bytes(data[:-10])
    else:
        path.unlink()
    with pytest.raises(ExportTampered, match=rf"{file}: .*{says}") as refused:
        verify_export(directory)
    assert "\n" not in str(refused.value)
    for runtime in ("onnx", "torchscript"):  # the loader verifies every file first, whichever it loads
        with pytest.raises(ExportTampered, match=file):
            load_exported(directory, runtime)


def test_a_card_that_is_missing_or_not_a_card_is_refused(exports, tmp_path):
    directory = _copy(exports, "mlp", tmp_path)
    (directory / CARD_FILE).write_text("{\"card_format\": 1}")
    with pytest.raises(ExportTampered, match="not a model card"):
        verify_export(directory)
    (directory / CARD_FILE).unlink()
    with pytest.raises(ExportTampered, match="no model card"):
        verify_export(directory)


def test_an_onnx_result_beyond_the_tolerance_fails_and_writes_no_card(tmp_path, monkeypatch):
    real = export_mod.onnxruntime_logits
    monkeypatch.setattr(export_mod, "onnxruntime_logits", lambda path, x: real(path, x) + 1.0)
    model = build_model("mlp", (8,), 3, seed=0)
    with pytest.raises(ExportCheckFailed, match=r"onnxruntime differs from torch by up to 1 on 4 samples"):
        export_model(model, tmp_path / "bad", input_shape=(8,), num_classes=3, check_features=_features_of((8,)),
                     formats=("onnx",))
    assert not (tmp_path / "bad" / CARD_FILE).exists()


def test_compare_logits_measures_the_largest_difference_against_a_scaled_tolerance():
    reference = np.array([[1.0, 2.0], [3.0, 0.5]], dtype=np.float32)
    assert tolerance_for(reference) == pytest.approx(3 * FLOAT32_TOLERANCE)
    assert tolerance_for(reference / 10) == FLOAT32_TOLERANCE  # logits within +-1: absolute 1e-5
    check = compare_logits("x", reference + np.float32(2e-5), reference, fresh_process=True)
    assert check["max_abs_diff"] == pytest.approx(2e-5, rel=1e-2) and check["same_predictions"] == 1.0
    with pytest.raises(ExportCheckFailed, match="differs from torch by up to 4"):
        compare_logits("x", reference + np.float32(4e-5), reference, fresh_process=True)
    with pytest.raises(ExportCheckFailed, match="differs"):
        compare_logits("x", reference / 10 + np.float32(2e-5), reference / 10, fresh_process=True)
    with pytest.raises(ExportCheckFailed, match="shape"):
        compare_logits("x", reference[:1], reference, fresh_process=True)


def test_an_output_directory_that_cannot_be_written_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ExportError, match="not writable"):
        check_writable(blocker / "out")


def test_formats_parse_in_a_fixed_order_and_unknown_ones_are_named():
    assert parse_formats("safetensors, onnx") == ("onnx", "safetensors")
    with pytest.raises(ValueError, match="unknown format.*pickle"):
        parse_formats("onnx,pickle")
