"""Fuzz target: job files (``job.config.load_config``: TOML, or the JSON of ``dump_config``).

Input: one mode byte, then the file's bytes. Mode bit 1: the file is ``job.json``
(the effective configuration ``edgestream run`` hands to its workers) instead of
``job.toml``; bit 2: the lines after a line ``#--set`` are ``--set`` overrides instead
of part of the file. The environment is empty (``env={}``).

Allowed to escape: what the CLI reports as a configuration error, exit status 2
(``cli.errors.CONFIG_ERRORS``: ``ConfigError`` and its subclasses such as
``RecordingSourceError``, ``TopicNameError``, ...). Anything else (a ``KeyError``,
``UnicodeDecodeError``, ``OverflowError``, a hang) reaches the user as a crash with a
traceback, and is a bug. Also a bug: a configuration that loads but whose
``dump_config`` JSON does not load back to the same configuration (what a worker
process does with it).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from pathlib import Path

from edgestream.cli.errors import CONFIG_ERRORS
from edgestream.job import config
from edgestream.job.config import JobConfig, dump_config, load_config
from tests.fuzz.targets import REPO, FuzzFinding, scratch_dir

MAX_LEN = 4096
#: Exception classes the CLI maps to exit status 2, matched by name along the MRO.
ALLOWED_NAMES = CONFIG_ERRORS
JSON, OVERRIDES = 1, 2
SET_MARKER = b"\n#--set\n"

_scratch: Path | None = None


def fuzzing_setup() -> None:
    """Called by the runner in a fuzzing process only (not when inputs are replayed).

    ``_set`` evaluates the section's type hints for every key: ~90 % of a load. They are
    fixed per class, so the fuzzing process caches them (about 5x more executions per
    second); nothing else of the code under test changes.
    """
    config.get_type_hints = functools.lru_cache(maxsize=None)(typing.get_type_hints)


def _directory() -> Path:
    global _scratch
    if _scratch is None:
        _scratch = scratch_dir("edgestream-fuzz-job-")
    return _scratch


def is_config_error(exc: BaseException) -> bool:
    return bool({cls.__name__ for cls in type(exc).__mro__} & ALLOWED_NAMES)


def _load(path: Path, overrides: list[str]) -> JobConfig | None:
    try:
        return load_config(path, overrides, env={})
    except Exception as exc:
        if is_config_error(exc):
            return None
        raise


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, text = data[0], bytes(data[1:])
    overrides: list[str] = []
    if mode & OVERRIDES:
        text, _, tail = text.partition(SET_MARKER)
        overrides = [line.decode("utf-8", "replace") for line in tail.split(b"\n") if line]
    path = _directory() / ("job.json" if mode & JSON else "job.toml")
    path.write_bytes(text)
    cfg = _load(path, overrides)
    if cfg is None:
        return
    dumped = dump_config(cfg)
    again = _directory() / "effective.json"
    again.write_text(dumped)
    try:
        second = load_config(again, env={})
    except Exception as exc:
        raise FuzzFinding(f"the effective configuration of a valid job does not load: {exc!r}") from exc
    if second != cfg:
        raise FuzzFinding("the effective configuration loads back as another configuration")


def seeds() -> dict[str, bytes]:
    """Every example job file, a JSON effective configuration and overrides."""
    out: dict[str, bytes] = {}
    for path in sorted((REPO / "examples").glob("*.toml")):
        out[f"example_{path.stem}"] = b"\x00" + path.read_bytes()
    demo = load_config(REPO / "examples" / "demo.toml", env={})
    out["effective_demo_json"] = bytes([JSON]) + dump_config(demo).encode()
    out["overrides"] = bytes([OVERRIDES]) + (REPO / "examples" / "bsp.toml").read_bytes() + SET_MARKER + (
        b"buffer.policy=truncate\ntestbed.links.w0=10mbit 5ms\ndevices.rates_hz=5,6\ntrain.codec_params=ratio=0.1\n"
    )
    out["empty"] = b"\x00"
    return out


def dictionary() -> list[bytes]:
    """Tokens for libFuzzer: every section and key of the configuration, a few values."""
    tokens: list[bytes] = [b"\n#--set\n", b"[testbed.links]\n", b"true", b"false", b"nan", b"inf", b"1e308",
                           b"-0.0", b"9223372036854775807", b"[[", b"]]", b'"""', b"{", b"}", b"0-3", b"0+2",
                           b"mbit", b"ms", b"%", b"ratio=", b"=", b"\"auto\"", b"\"none\"", b"\"recording\"",
                           b"\"synthetic\"", b"\"faust\"", b"\"truncate\"", b"\"backpressure\"", b"\"fixed\"",
                           b"\"dirichlet\"", b"\"classes\"", b"\"poisson\"", b"bursty:on=", b"ramp:from=",
                           b"\"json\"", b"\"accordion\"", b"\"budget\"", b"w0 = ", b"b0 = "]
    cfg = JobConfig()
    for section in dataclasses.fields(cfg):
        tokens.append(f"[{section.name}]\n".encode())
        for key in dataclasses.fields(getattr(cfg, section.name)):
            tokens += [f"{key.name} = ".encode(), f"{section.name}.{key.name}=".encode(),
                       f'"{key.name}":'.encode()]
    return tokens
