"""The fuzz targets by name, where their inputs live, and what they share.

Kept free of heavy imports: the runner imports this module before it turns on
atheris's instrumentation, and only then imports a target (and through it the
decoders), so the decoders are instrumented and torch / numpy are not.
"""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import tempfile
from pathlib import Path
from types import ModuleType

FUZZ_DIR = Path(__file__).resolve().parent
REPO = FUZZ_DIR.parent.parent
#: Committed seed and coverage corpus, one directory per target.
CORPUS_DIR = FUZZ_DIR / "corpus"
#: Committed crashers (each one fixed), replayed by ``make test``.
REGRESSIONS_DIR = FUZZ_DIR / "regressions"
#: Scratch space of the runner (git-ignored: ``.edgestream/``): work corpus, crashes.
WORK_DIR = REPO / ".edgestream" / "fuzz"

#: name -> module; the module defines ``test_one_input``, ``seeds``, ``MAX_LEN``.
TARGETS: dict[str, str] = {
    "sensor_codec": "tests.fuzz.fuzz_sensor_codec",
    "update_message": "tests.fuzz.fuzz_update_message",
    "compressed_tensors": "tests.fuzz.fuzz_compressed_tensors",
    "recording": "tests.fuzz.fuzz_recording",
    "job_file": "tests.fuzz.fuzz_job_file",
    "json_records": "tests.fuzz.fuzz_json_records",
    "shared_topic": "tests.fuzz.fuzz_shared_topic",
    "mqtt_bridge": "tests.fuzz.fuzz_mqtt_bridge",
    "avro_records": "tests.fuzz.fuzz_avro_records",
    "delayed_labels": "tests.fuzz.fuzz_delayed_labels",
}

#: Modules whose code atheris instruments for coverage: the decoders and their helpers,
#: and the pure-Python TOML parser (so mutations learn its syntax).
INSTRUMENTED = ("edgestream.streams", "edgestream.trainers", "edgestream.compression", "edgestream.pipeline",
                "edgestream.deploy", "edgestream.job", "tomllib")


class FuzzFinding(AssertionError):
    """A decoder broke a documented property (not an exception it may raise)."""


#: Set by the runner for its fuzzing processes: where targets make their scratch
#: directories. libFuzzer ends a process with exit(), which skips Python's atexit, so the
#: runner removes this directory itself.
SCRATCH_ENV = "EDGESTREAM_FUZZ_SCRATCH"


def memory_tmp() -> str | None:
    """/dev/shm when usable (a target writing files per input runs faster in memory)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def scratch_dir(prefix: str) -> Path:
    """A new directory for a target's files (removed at exit, or by the runner)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ.get(SCRATCH_ENV) or memory_tmp()))
    atexit.register(shutil.rmtree, path, True)
    return path


def load(name: str) -> ModuleType:
    """The target module ``name`` (``KeyError`` listing the targets if unknown)."""
    if name not in TARGETS:
        raise KeyError(f"unknown fuzz target {name!r}; targets: {', '.join(TARGETS)}")
    return importlib.import_module(TARGETS[name])


def inputs(name: str) -> list[Path]:
    """Every committed input of ``name``: its corpus, then its regressions, sorted."""
    found: list[Path] = []
    for root in (CORPUS_DIR / name, REGRESSIONS_DIR / name):
        if root.is_dir():
            found += sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
    return found
