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
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PURE_PACKAGES = ("trainers", "compression", "streams", "job")
#: The libraries under ``job/``.
LIBRARIES = ("trainers", "compression", "streams")
FORBIDDEN_IN_PURE = ("pipeline", "monitoring", "kafka", "aiokafka", "faust")


def python_files(package: str) -> list[Path]:
    """The package's modules; a folder inside it with a pyproject.toml of its own is another
    distribution (``examples/plugin/``, a plugin that imports ``edgestream``), not the house."""
    root = REPO / package
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts
                  and not any((d / "pyproject.toml").is_file() for d in p.parents if d != root and d.is_relative_to(root)))


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


#: The one import package: ``edgestream.pipeline`` is the repository's ``pipeline/``.
NAMESPACE = "edgestream."


def imported_modules(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every import in ``source``: statements anywhere, and
    ``importlib.import_module`` / ``__import__`` calls with a literal name; a name under the
    ``edgestream`` namespace is given as the repository's (``edgestream.pipeline.x`` ->
    ``pipeline.x``)."""
    for line, name in _imported_names(source, module, is_package):
        yield line, name.removeprefix(NAMESPACE)


def _imported_names(source: str, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
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
        ("from edgestream.pipeline import config\n", "trainers.x", False, "pipeline.config"),
        ("import edgestream.monitoring.metrics as m\n", "trainers.x", False, "monitoring.metrics"),
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
#: The one module outside ``cli`` that may import it: ``python -m edgestream`` runs it.
CLI_ENTRY = "edgestream/__main__.py"


def top_level_packages() -> tuple[str, ...]:
    """Every package at the repository root (derived, so a new one is checked too)."""
    return tuple(sorted(p.name for p in REPO.iterdir() if (p / "__init__.py").exists() and p.name != "tests"))


def test_cli_is_the_top_floor_imported_only_by_python_m_edgestream():
    below = tuple(p for p in top_level_packages() if p != "cli")
    assert {"pipeline", "monitoring", "benchmarks", "edgestream"} <= set(below)
    bad = [v for v in violations(below, ("cli",)) if not v.startswith(CLI_ENTRY + ":")]
    assert not bad, "only the top floor (cli/) and edgestream/__main__.py may import cli:\n" + "\n".join(bad)
    assert violations(("edgestream",), ("cli",)), f"{CLI_ENTRY} should delegate to cli.main"


def test_no_module_below_the_cli_names_a_cli_module_in_a_string():
    """An import by name (``importlib.import_module("edgestream.cli.x")``, a ``module:function``
    entry, a preload list) points up as surely as an ``import`` does, but the import checks
    above cannot see it. Below the top floor, the command is named by the package's entry
    point (``edgestream.__main__``), as ``python -m edgestream`` names it."""
    pattern = re.compile(r"^edgestream\.cli(\.|:|$)")
    bad = []
    for package in (p for p in top_level_packages() if p != "cli"):
        for path in python_files(package):
            if path.relative_to(REPO).as_posix() == CLI_ENTRY:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.match(node.value):
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not bad, "CLI modules named in strings below the top floor:\n" + "\n".join(bad)


def test_every_import_of_the_house_is_spelled_under_the_edgestream_namespace():
    """``from edgestream.pipeline import x``, never ``from pipeline import x``: installed, only
    ``edgestream`` exists (and a bare ``compression`` would be Python 3.14's own package)."""
    ours = set(top_level_packages()) - {"edgestream"}
    bare = []
    for package in [*top_level_packages(), "tests"]:
        for path in python_files(package):
            for line, name in _imported_names(path.read_text(encoding="utf-8"), module_name(path),
                                              path.name == "__init__.py"):
                if name.split(".")[0] in ours and not _spelled_relative(path, line):
                    bare.append(f"{path.relative_to(REPO)}:{line}: {name}")
    assert not bare, "imports outside the edgestream namespace:\n" + "\n".join(bare)


def _spelled_relative(path: Path, line: int) -> bool:
    """The import on ``line`` is written relative (``from .base import X``)."""
    text = path.read_text(encoding="utf-8").splitlines()[line - 1].strip()
    return text.startswith("from .")


def test_monitoring_imports_neither_pipeline_nor_cli():
    assert python_files("monitoring")
    bad = violations(("monitoring",), ("pipeline", "cli"))
    assert not bad, "monitoring/ must not import pipeline/ or cli/:\n" + "\n".join(bad)



# --- the floors and no circle ----------------------------------------------------------------
#: The house from the ground up: a package may import its own floor's package or any package on
#: a lower floor, never one above (``pipeline/__main__.py`` -> ``cli`` is the one exception).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("edgestream", "examples"),  # the namespace's __init__ (its version; its __main__ is CLI_ENTRY); job files
    ("streams", "compression"),
    ("trainers",),
    ("deploy",),
    ("job", "monitoring"),
    ("pipeline",),
    ("benchmarks",),
    ("cli",),
)


def floor_of(package: str) -> int:
    for level, packages in enumerate(FLOORS):
        if package in packages:
            return level
    raise AssertionError(f"package {package} has no floor in FLOORS: place it there")


def runtime_imports(path: Path, known: set[str]) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for each import of a repository module in ``path`` that runs (imports
    under ``if TYPE_CHECKING:`` are annotations only and are skipped); ``from pkg import sub``
    names the submodule alone when ``pkg.sub`` is a module."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                hidden.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    for line, imported in imported_modules(source, module_name(path), path.name == "__init__.py"):
        if line in hidden:
            continue
        name = imported
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            yield line, name


def module_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for package in top_level_packages() for p in python_files(package)}
    known = set(files)
    return {m: {i for _, i in runtime_imports(p, known) if i != m} for m, p in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle_and_passes_a_chain():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle_anywhere_in_the_house():
    found = circles(module_graph())
    assert not found, "import circles (each a set of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_every_package_has_a_floor_and_no_import_points_up():
    assert {p for floor in FLOORS for p in floor} == set(top_level_packages())
    files = {module_name(p): p for package in top_level_packages() for p in python_files(package)}
    known = set(files)
    up = []
    for module, path in files.items():
        own = floor_of(module.split(".")[0])
        for line, imported in runtime_imports(path, known):
            target = imported.split(".")[0]
            if floor_of(target) > own and path.relative_to(REPO).as_posix() != CLI_ENTRY:
                up.append(f"{path.relative_to(REPO)}:{line}: {module} imports {imported} (floor "
                          f"{floor_of(target)} above {own})")
            elif target != module.split(".")[0] and floor_of(target) == own:
                up.append(f"{path.relative_to(REPO)}:{line}: {module} imports {imported}, a package of "
                          "its own floor")
    assert not up, "imports pointing up:\n" + "\n".join(up)
