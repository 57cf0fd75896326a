"""Layering: the pure packages never import the Kafka side, and deploy/ never imports pipeline/.

``trainers/``, ``compression/`` and ``streams/`` are testable without Kafka; ``job/`` (the
floor that turns a job file into parts) sits on them, Kafka-free too, and they never import
it; ``pipeline/`` is the only place that joins Kafka to torch (DESIGN.md, "Layout"). Every import
statement counts, wherever it sits (module level, inside a function, under
``TYPE_CHECKING``), and so does ``importlib.import_module`` / ``__import__`` with a
literal module name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PURE_PACKAGES = ("trainers", "compression", "streams", "job")
#: The libraries under ``job/``.
LIBRARIES = ("trainers", "compression", "streams")
FORBIDDEN_IN_PURE = ("pipeline", "monitoring", "kafka", "aiokafka", "faust")


def python_files(package: str) -> list[Path]:
    return sorted(p for p in (REPO / package).rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` names (relative ones against ``module``)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
    return ".".join([*base, node.module] if node.module else base)


def _literal_prefix(arg: ast.expr) -> str | None:
    """A literal module name, or the literal start of an f-string one."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values:
        first = arg.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
    return None


def imported_modules(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every import in ``source``: statements anywhere, and
    ``importlib.import_module`` / ``__import__`` calls with a literal name."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            if base == "__future__":
                continue
            for alias in node.names:
                # ``from pkg import name``: ``name`` may be a submodule (``from pipeline import config``).
                yield node.lineno, f"{base}.{alias.name}" if base and alias.name != "*" else base
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = (
                func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            )
            if called in ("import_module", "__import__"):
                name = _literal_prefix(node.args[0])
                if name:
                    yield node.lineno, name


def is_under(module: str, roots: tuple[str, ...]) -> bool:
    return module.split(".")[0] in roots


def violations(packages: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for package in packages:
        for path in python_files(package):
            name = module_name(path)
            for line, imported in imported_modules(
                path.read_text(encoding="utf-8"), name, path.name == "__init__.py"
            ):
                if is_under(imported, forbidden):
                    found.append(f"{path.relative_to(REPO)}:{line}: imports {imported}")
    return found


def test_the_pure_packages_import_no_pipeline_monitoring_or_kafka():
    assert all(python_files(p) for p in PURE_PACKAGES), "a pure package has no python files"
    bad = violations(PURE_PACKAGES, FORBIDDEN_IN_PURE)
    assert not bad, (
        "trainers/, compression/, streams/ and job/ must not import "
        f"{', '.join(FORBIDDEN_IN_PURE)}:\n" + "\n".join(bad)
    )


def test_the_libraries_do_not_import_the_job_floor():
    bad = violations(LIBRARIES, ("job",))
    assert not bad, "trainers/, compression/ and streams/ sit under job/ and must not import it:\n" + "\n".join(bad)


def test_deploy_does_not_import_pipeline():
    # deploy/ holds launch scripts; pipeline/ may import deploy.kafka.broker, never the
    # other way round (running the CLI in a subprocess is not an import and stays allowed).
    assert python_files("deploy")
    bad = violations(("deploy",), ("pipeline",))
    assert not bad, "deploy/ must not import pipeline/:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "module", "is_package", "expected"),
    [
        ("import kafka\n", "streams.x", False, "kafka"),
        ("import aiokafka.structs as s\n", "streams.x", False, "aiokafka.structs"),
        ("from pipeline import config\n", "trainers.x", False, "pipeline.config"),
        ("from pipeline.buffering import StreamBuffer\n", "trainers.x", False, "pipeline.buffering.StreamBuffer"),
        ("def f():\n    from monitoring.metrics import Metrics\n", "compression.x", False, "monitoring.metrics.Metrics"),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import faust\n", "streams.x", False, "faust"),
        ("import importlib\nimportlib.import_module('pipeline.simulate')\n", "trainers.x", False, "pipeline.simulate"),
        ("import importlib\nimportlib.import_module(f'pipeline.{name}')\n", "trainers.x", False, "pipeline."),
        ("__import__('kafka')\n", "streams.x", False, "kafka"),
    ],
)
def test_the_check_sees_every_kind_of_import(source, module, is_package, expected):
    found = [m for _, m in imported_modules(source, module, is_package)]
    assert expected in found
    assert is_under(expected, FORBIDDEN_IN_PURE)


def test_relative_imports_resolve_inside_their_package_and_look_alike_names_pass():
    source = "from . import pipeline\nfrom .pipeline import GradientCodec\nfrom ..errors import E\nimport kafkaesque\n"
    found = [m for _, m in imported_modules(source, "compression.controllers.scadles")]
    assert found == [
        "compression.controllers.pipeline",
        "compression.controllers.pipeline.GradientCodec",
        "compression.errors.E",
        "kafkaesque",
    ]
    assert not any(is_under(m, FORBIDDEN_IN_PURE) for m in found)
    init = [m for _, m in imported_modules("from .base import X\n", "compression", is_package=True)]
    assert init == ["compression.base.X"]


# --- the CLI on the top floor ----------------------------------------------------------------
#: The one module below the top floor that may import ``cli``: ``python -m pipeline`` runs it.
CLI_ENTRY = "pipeline/__main__.py"


def top_level_packages() -> tuple[str, ...]:
    """Every package at the repository root (derived, so a new one is checked too)."""
    return tuple(sorted(p.name for p in REPO.iterdir() if (p / "__init__.py").exists() and p.name != "tests"))


def test_cli_is_the_top_floor_imported_only_by_python_m_pipeline():
    below = tuple(p for p in top_level_packages() if p != "cli")
    assert {"pipeline", "monitoring", "benchmarks"} <= set(below)
    bad = [v for v in violations(below, ("cli",)) if not v.startswith(CLI_ENTRY + ":")]
    assert not bad, "only the top floor (cli/) and pipeline/__main__.py may import cli:\n" + "\n".join(bad)
    assert violations(("pipeline",), ("cli",)), f"{CLI_ENTRY} should delegate to cli.main"


def test_monitoring_imports_neither_pipeline_nor_cli():
    assert python_files("monitoring")
    bad = violations(("monitoring",), ("pipeline", "cli"))
    assert not bad, "monitoring/ must not import pipeline/ or cli/:\n" + "\n".join(bad)

