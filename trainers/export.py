"""Exported models: ONNX, TorchScript and safetensors files with a model card, their checks and loader.

An export directory holds (``FORMATS``; any subset but the card)::

    model.onnx          ONNX graph, standardisation included, dynamic batch: input ``features``
                        [batch, *input_shape] float32, output ``logits`` [batch, classes]
    model.ts            TorchScript of the same module (``torch.jit.load``, no edgestream needed)
    model.safetensors   the model's own state dict (the names ``build_model`` gives), without
                        the standardisation: the card holds it
    model-card.json     what the model is, where it came from, how it scored, the checks run at
                        export and the sha256 of every file above

Invariants: every file the card lists was checked before the card was written (ONNX Runtime
in a fresh process against torch, the TorchScript file reloaded, the safetensors file read
back; a runtime must agree with torch within 1e-5 times the logits' scale, ``tolerance_for``),
and the card is written last, atomically, so a directory with a card is a whole export.
:func:`verify_export` recomputes each listed file's digest and refuses a directory where one
differs; :func:`load_exported` verifies before it loads anything.

The standardisation :func:`~edgestream.trainers.models.build_model` installs as a forward
pre-hook is not in ``state_dict``; :class:`StandardizedModel` makes it two explicit
operations, ``(x - mean) * inv_std``, so the ONNX and TorchScript files carry it.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import logging
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from edgestream.trainers.errors import TrainerError
from edgestream.trainers.models import InputStandardizer

#: Format name -> the file it is written to.
FORMATS: dict[str, str] = {"onnx": "model.onnx", "torchscript": "model.ts", "safetensors": "model.safetensors"}
CARD_FILE = "model-card.json"
#: The card's layout version (``card_format``); a loader refuses a card of another.
CARD_FORMAT = 1
INPUT_NAME = "features"
OUTPUT_NAME = "logits"
#: Largest |ONNX Runtime - torch| accepted on float32 logits, per unit of the logits' scale
#: (:func:`tolerance_for`).
FLOAT32_TOLERANCE = 1e-5
#: Seconds the fresh ONNX Runtime process may take (start-up included).
ORT_TIMEOUT_S = 300.0

Progress = Callable[[str], None]


class ExportError(TrainerError):
    """An export could not be written, checked or read; the message says what to do."""


class ExportCheckFailed(ExportError):
    """A format computes something else than the torch model (beyond :func:`tolerance_for`)."""


class ExportTampered(ExportError):
    """A file of an export directory is missing, truncated or altered (its digest differs from the card's)."""


# -- the exported module -----------------------------------------------------------------------


class StandardizedModel(nn.Module):
    """A model with its input standardisation as explicit operations: ``model((x - mean) * inv_std)``.

    ``mean`` and ``inv_std`` are float32 buffers over the flattened features, exactly the
    ``InputStandardizer``'s ``shift`` and ``scale`` (a feature with ~zero std is only
    centred: ``inv_std`` 1), so it computes what the training model computes, bit for bit.
    Without statistics it is the model alone. The wrapped model has no standardisation hook.
    """

    def __init__(self, model: nn.Module, standardizer: InputStandardizer | None) -> None:
        super().__init__()
        self.model = model
        self.standardize = standardizer is not None
        width = standardizer.width if standardizer is not None else 1
        self.register_buffer("mean", standardizer.shift.clone() if standardizer is not None else torch.zeros(width))
        self.register_buffer("inv_std", standardizer.scale.clone() if standardizer is not None else torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.standardize:
            flat = x.reshape(x.shape[0], -1).to(torch.float32)
            x = ((flat - self.mean) * self.inv_std).reshape(x.shape)
        return self.model(x)


def standardizer_of(model: nn.Module) -> InputStandardizer | None:
    """The standardisation ``build_model`` (or ``stages.compose``) installed on ``model``, if any."""
    found = getattr(model, "input_standardizer", None)
    return found if isinstance(found, InputStandardizer) else None


def exportable(model: nn.Module) -> StandardizedModel:
    """A copy of ``model`` in eval mode, its standardisation hook made explicit (the original is untouched)."""
    standardizer = standardizer_of(model)
    inner = copy.deepcopy(model)
    for module in inner.modules():
        for key, hook in list(module._forward_pre_hooks.items()):
            if isinstance(hook, InputStandardizer):
                del module._forward_pre_hooks[key]
        if "input_standardizer" in module.__dict__:
            del module.__dict__["input_standardizer"]
    wrapper = StandardizedModel(inner, standardizer)
    wrapper.eval()
    for p in wrapper.parameters():
        p.requires_grad_(False)
    return wrapper


# -- writing -----------------------------------------------------------------------------------


@dataclass
class ExportReport:
    """What :func:`export_model` wrote: the card (as written) and the seconds each part took."""

    directory: Path
    card: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)


def parse_formats(text: str) -> tuple[str, ...]:
    """``"onnx,safetensors"`` -> the formats in ``FORMATS`` order; ``ValueError`` naming the choices."""
    wanted = [part.strip().lower() for part in text.split(",") if part.strip()]
    unknown = [w for w in wanted if w not in FORMATS]
    if unknown or not wanted:
        raise ValueError(f"unknown format(s) {', '.join(unknown) or '(none given)'}: choose from {', '.join(FORMATS)}")
    return tuple(f for f in FORMATS if f in wanted)


def check_writable(directory: str | Path) -> Path:
    """Create ``directory`` if needed and prove a file can be written there; ``ExportError`` otherwise."""
    target = Path(directory)
    try:
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target, prefix=".write-probe-"):
            pass
    except OSError as exc:
        raise ExportError(f"output directory {target} is not writable ({exc.strerror or exc}): "
                          "choose another --out") from None
    return target


def export_model(
    model: nn.Module,
    directory: str | Path,
    *,
    input_shape: Sequence[int],
    num_classes: int,
    check_features: np.ndarray,
    formats: Sequence[str] = tuple(FORMATS),
    card: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> ExportReport:
    """Write ``model`` (as ``build_model`` made it, standardisation hook and all) to ``directory``.

    ``check_features`` ([N, *input_shape] float32, N >= 1; the job's held-out features) are
    what every format is checked on: ONNX Runtime in a fresh process (``ExportCheckFailed``
    beyond :func:`tolerance_for`), the TorchScript file reloaded, the safetensors file read
    back. ``card``: the provenance fields (job, strategy, worker, version, evaluation ...)
    the card carries besides what this function fills in. Raises ``ExportError`` if a file
    cannot be written; the card is then not written (nor updated).
    """
    say = progress or (lambda _line: None)
    shape = tuple(int(d) for d in input_shape)
    chosen = tuple(f for f in FORMATS if f in formats)
    if not chosen:
        raise ExportError(f"no format to write: choose from {', '.join(FORMATS)}")
    features = np.ascontiguousarray(check_features, dtype=np.float32)
    if features.ndim != len(shape) + 1 or tuple(features.shape[1:]) != shape or features.shape[0] == 0:
        raise ExportError(f"check features of shape {features.shape} do not match input shape {shape}")
    out = check_writable(directory).resolve()
    # Step 1. The module every format is made of, and its outputs: the reference.
    wrapper = exportable(model)
    with torch.no_grad():
        reference = wrapper(torch.from_numpy(features)).numpy()
        hooked = _eval_outputs(model, features)
    if not np.array_equal(reference, hooked):  # the explicit standardisation is the hook's, bit for bit
        raise ExportCheckFailed(f"the exported module differs from the training model by "
                                f"{float(np.abs(reference - hooked).max()):.3g}: a hook it does not know of?")
    # float32's own rounding on these inputs (torch float32 against the model in float64): the
    # floor no runtime's difference can be judged below (the card shows it beside each check).
    with torch.no_grad():
        exact = copy.deepcopy(wrapper).double()(torch.from_numpy(features).double()).numpy()
    float32_noise = float(np.abs(reference.astype(np.float64) - exact).max())
    # A card of an earlier export describes files about to be replaced: remove it first.
    (out / CARD_FILE).unlink(missing_ok=True)
    for name, filename in FORMATS.items():
        if name not in chosen:
            (out / filename).unlink(missing_ok=True)
    seconds: dict[str, float] = {}
    checks: dict[str, Any] = {}
    example = torch.from_numpy(np.repeat(features[:1], 2, axis=0) if len(features) < 2 else features[:2])

    def runtime_check(runtime: str, logits: np.ndarray, *, fresh_process: bool) -> dict[str, Any]:
        """``compare_logits`` of one runtime's logits, with float32's own rounding beside it."""
        return {**compare_logits(runtime, logits, reference, fresh_process=fresh_process),
                "torch_float32_vs_float64": float32_noise}

    # Step 2. Each format written to a temporary name, renamed into place, then checked (a failed
    # check raises before Step 3: no card, so no whole export).
    if "onnx" in chosen:
        say("exporting ONNX (torch.onnx dynamo exporter; takes a few seconds)")
        start = time.perf_counter()
        path = _write_atomic(out, FORMATS["onnx"], lambda tmp: _write_onnx(wrapper, example, tmp))
        seconds["onnx"] = time.perf_counter() - start
        say(f"checking ONNX Runtime in a fresh process on {len(features)} samples")
        start = time.perf_counter()
        logits = onnxruntime_logits(path, features)
        seconds["onnxruntime_check"] = time.perf_counter() - start
        checks["onnxruntime"] = runtime_check("onnxruntime", logits, fresh_process=True)
    if "torchscript" in chosen:
        say("exporting TorchScript")
        start = time.perf_counter()
        path = _write_atomic(out, FORMATS["torchscript"], lambda tmp: _write_torchscript(wrapper, example, tmp))
        loaded = _load_torchscript(path)
        with torch.no_grad():
            logits = loaded(torch.from_numpy(features)).numpy()
        seconds["torchscript"] = time.perf_counter() - start
        checks["torchscript"] = runtime_check("torchscript", logits, fresh_process=False)
    if "safetensors" in chosen:
        say("exporting safetensors")
        start = time.perf_counter()
        state = _plain_state(wrapper.model)
        path = _write_atomic(out, FORMATS["safetensors"], lambda tmp: _write_safetensors(state, tmp))
        checks["safetensors"] = _safetensors_round_trip(path, state)
        seconds["safetensors"] = time.perf_counter() - start
    # Step 3. The card, last: digests of what is on disk now.
    files = {FORMATS[f]: {"format": f, **file_digest(out / FORMATS[f])} for f in chosen}
    standardizer = standardizer_of(model)
    written = {
        "card_format": CARD_FORMAT,
        **dict(card or {}),
        "input": {"name": INPUT_NAME, "shape": [None, *shape], "dtype": "float32",
                  **dict((card or {}).get("input", {}))},
        "output": {"name": OUTPUT_NAME, "shape": [None, int(num_classes)], "dtype": "float32",
                   "meaning": "unnormalised class scores: argmax is the predicted class, softmax the probabilities"},
        "standardization": None if standardizer is None else {
            "formula": "(x.reshape(N, -1) - mean) * inv_std, reshaped back",
            "in": "model.onnx and model.ts apply it; model.safetensors holds the model without it",
            "mean": _floats(standardizer.shift), "std": _floats(_std_of(standardizer)),
            "inv_std": _floats(standardizer.scale)},
        "checks": checks,
        "versions": versions(),
        "files": files,
    }
    _write_atomic(out, CARD_FILE, lambda tmp: tmp.write_text(json.dumps(written, indent=2, allow_nan=False) + "\n"))
    return ExportReport(out, written, seconds)


def _eval_outputs(model: nn.Module, features: np.ndarray) -> np.ndarray:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(torch.from_numpy(features)).numpy()
    finally:
        model.train(was_training)


def _std_of(standardizer: InputStandardizer) -> torch.Tensor:
    """The std the scale came from (1 where a ~constant feature is only centred)."""
    return 1.0 / standardizer.scale.to(torch.float64)


def _floats(tensor: torch.Tensor) -> list[float]:
    return [float(v) for v in tensor.reshape(-1).tolist()]


def tolerance_for(reference: np.ndarray) -> float:
    """The largest |difference| accepted against torch's float32 ``reference`` logits:
    ``FLOAT32_TOLERANCE`` times the logits' scale (their largest magnitude, at least 1).

    Absolute for logits within +-1; beyond, float32 itself rounds coarser than 1e-5: on a
    trained 8-layer conv8 with logits up to 17, torch float32 differs from the same model in
    float64 by 1.1e-5, so an absolute 1e-5 would refuse a runtime exactly as accurate as torch.
    """
    scale = float(np.abs(reference).max()) if reference.size else 1.0
    return FLOAT32_TOLERANCE * max(1.0, scale)


def compare_logits(what: str, logits: np.ndarray, reference: np.ndarray, *, fresh_process: bool) -> dict[str, Any]:
    """How far ``logits`` (another runtime's) are from torch's ``reference``; ``ExportCheckFailed``
    beyond :func:`tolerance_for` (or on another shape, or a NaN)."""
    if logits.shape != reference.shape:
        raise ExportCheckFailed(f"{what} returned logits of shape {logits.shape}, torch {reference.shape}")
    diff = float(np.abs(logits.astype(np.float64) - reference.astype(np.float64)).max())
    tolerance = tolerance_for(reference)
    if not math.isfinite(diff) or diff > tolerance:
        raise ExportCheckFailed(f"{what} differs from torch by up to {diff:.3g} on {len(reference)} samples "
                                f"(tolerance {tolerance:.3g}: {FLOAT32_TOLERANCE:g} x the logits' scale, for "
                                "float32): the export is not used")
    agree = float((logits.argmax(axis=1) == reference.argmax(axis=1)).mean())
    return {"max_abs_diff": diff, "tolerance": tolerance, "samples": int(len(reference)),
            "same_predictions": agree, "fresh_process": fresh_process, "passed": True}


def _write_atomic(directory: Path, name: str, write: Callable[[Path], Any]) -> Path:
    """``write(tmp)`` then rename ``tmp`` to ``directory / name``; ``ExportError`` naming the file on an OSError."""
    target = directory / name
    tmp = directory / f".{name}.tmp"
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # as any file this process creates (safetensors writes 0600)
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ExportError(f"could not write {target}: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def _quiet_exporter():
    """torch's exporters talk (progress on stdout, a warning per missing torchvision op, the
    deprecation of ``torch.jit``): keep this command's output to its own lines."""
    names = ("torch.onnx", "torch.export", "torch._export", "onnxscript")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _write_onnx(wrapper: StandardizedModel, example: torch.Tensor, path: Path) -> None:
    batch = torch.export.Dim("batch")
    try:
        with _quiet_exporter():
            program = torch.onnx.export(wrapper, (example,), dynamo=True, input_names=[INPUT_NAME],
                                        output_names=[OUTPUT_NAME], dynamic_shapes=({0: batch},),
                                        external_data=False, verbose=False)
            program.save(str(path), external_data=False)
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - the exporter raises many kinds; one line says which
        raise ExportError(f"torch.onnx.export failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from exc


def _write_torchscript(wrapper: StandardizedModel, example: torch.Tensor, path: Path) -> None:
    with _quiet_exporter():
        traced = torch.jit.trace(wrapper, example, check_trace=False)
        torch.jit.save(traced, str(path))


def _load_torchscript(path: Path) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated in favour of torch.export
        module = torch.jit.load(str(path), map_location="cpu")
    module.eval()
    return module


def _plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as safetensors takes it: contiguous CPU tensors that share no memory."""
    return {name: t.detach().to("cpu").contiguous().clone() for name, t in model.state_dict().items()}


def _write_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(state, str(path), metadata={"format": "pt"})


def _safetensors_round_trip(path: Path, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    from safetensors.torch import load_file

    back = load_file(str(path))
    same = back.keys() == state.keys() and all(
        back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in state.items())
    if not same:
        raise ExportCheckFailed(f"{path.name} does not read back as the state it was written from")
    return {"tensors": len(state), "round_trip": True, "passed": True}


def file_digest(path: Path) -> dict[str, Any]:
    """``{"sha256": hex, "bytes": n}`` of the file at ``path``."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return {"sha256": digest.hexdigest(), "bytes": size}


def versions() -> dict[str, str | None]:
    """Versions of what made the files (and what reads them back)."""

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"torch": torch.__version__, "onnx": version("onnx"), "onnxscript": version("onnxscript"),
            "onnxruntime": version("onnxruntime"), "safetensors": version("safetensors"),
            "numpy": np.__version__, "python": platform.python_version()}


# -- ONNX Runtime in a fresh process -------------------------------------------------------------

#: Run by ``python -I``: edgestream and torch are made unimportable first, so what it shows
#: is what a plain onnxruntime + numpy install computes.
_ORT_SCRIPT = """
import sys
sys.modules["edgestream"] = None
sys.modules["torch"] = None
import numpy as np
import onnxruntime as ort
model, inputs, outputs = sys.argv[1:4]
options = ort.SessionOptions()
options.intra_op_num_threads = 1
options.inter_op_num_threads = 1
session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
features = np.load(inputs, allow_pickle=False)
(name,) = [i.name for i in session.get_inputs()]
np.save(outputs, session.run(None, {name: features})[0], allow_pickle=False)
"""


def onnxruntime_logits(model_path: str | Path, features: np.ndarray) -> np.ndarray:
    """Logits ONNX Runtime computes for ``features`` with the file at ``model_path``, in a fresh
    ``python -I`` process that cannot import torch or edgestream. ``ExportCheckFailed`` if it fails."""
    with tempfile.TemporaryDirectory(prefix="edgestream-ort-") as scratch:
        inputs, outputs = Path(scratch) / "features.npy", Path(scratch) / "logits.npy"
        np.save(inputs, np.ascontiguousarray(features, dtype=np.float32), allow_pickle=False)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        try:
            done = subprocess.run([sys.executable, "-I", "-c", _ORT_SCRIPT, str(Path(model_path).resolve()), str(inputs),
                                   str(outputs)],
                                  cwd=scratch, env=env, capture_output=True, text=True, timeout=ORT_TIMEOUT_S,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ExportCheckFailed(f"ONNX Runtime did not answer within {ORT_TIMEOUT_S:g} s") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise ExportCheckFailed(f"ONNX Runtime could not run {Path(model_path).name}: {last}")
        return np.load(outputs, allow_pickle=False)


# -- reading an export back ------------------------------------------------------------------------


def read_card(directory: str | Path) -> dict[str, Any]:
    """The card of the export in ``directory``; ``ExportTampered`` if it is missing or not a card."""
    path = Path(directory) / CARD_FILE
    try:
        card = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExportTampered(f"{path}: no model card: not an export directory (write one with edgestream export)") \
            from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportTampered(f"{path}: unreadable model card ({exc}): export again") from None
    if not isinstance(card, dict) or card.get("card_format") != CARD_FORMAT or not isinstance(card.get("files"), dict):
        raise ExportTampered(f"{path}: not a model card of format {CARD_FORMAT}: export again")
    return card


def verify_export(directory: str | Path) -> dict[str, Any]:
    """Recompute the digest of every file the card lists; return the card, or raise
    ``ExportTampered`` naming the first file that is missing, truncated or altered."""
    root = Path(directory)
    card = read_card(root)
    for name, expected in sorted(card["files"].items()):
        path = root / name
        if Path(name).name != name or name not in FORMATS.values():
            raise ExportTampered(f"{root / CARD_FILE}: lists {name!r}, not a file an export writes: export again")
        try:
            actual = file_digest(path)
        except FileNotFoundError:
            raise ExportTampered(f"{path}: missing (the card lists it): export again") from None
        except OSError as exc:
            raise ExportTampered(f"{path}: unreadable ({exc.strerror or exc}): export again") from None
        if actual["bytes"] != expected.get("bytes"):
            raise ExportTampered(f"{path}: {actual['bytes']} bytes, the card says {expected.get('bytes')} "
                                 "(truncated or replaced): export again")
        if actual["sha256"] != expected.get("sha256"):
            raise ExportTampered(f"{path}: sha256 differs from the card's (altered): export again")
    return card


def load_exported(directory: str | Path, runtime: str = "onnx") -> tuple[dict[str, Any], Any]:
    """``(card, model)`` of the export in ``directory``, digests verified first.

    ``runtime="onnx"``: an ``onnxruntime.InferenceSession`` (CPU; input ``features``);
    ``"torchscript"``: the TorchScript module in eval mode (standardisation included).
    ``ExportTampered`` if a file does not match the card, ``ExportError`` if the export
    has no file of that runtime.
    """
    files = {"onnx": FORMATS["onnx"], "torchscript": FORMATS["torchscript"]}
    if runtime not in files:
        raise ExportError(f"runtime {runtime!r}: choose onnx or torchscript")
    card = verify_export(directory)
    name = files[runtime]
    if name not in card["files"]:
        raise ExportError(f"{directory} holds no {runtime} file ({', '.join(card['files'])}): export it with "
                          f"--formats {runtime}")
    path = Path(directory) / name
    if runtime == "onnx":
        import onnxruntime

        return card, onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return card, _load_torchscript(path)
