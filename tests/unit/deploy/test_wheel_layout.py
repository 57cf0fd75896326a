"""pyproject.toml puts every package of the checkout inside the one import package, `edgestream`."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _own_distribution(path: Path, root: Path) -> bool:
    """``path`` lies in a folder under ``root`` with a pyproject.toml of its own: another
    distribution (``examples/plugin/``, built and installed on its own), not in the wheel."""
    return any((d / "pyproject.toml").is_file() for d in path.parents if d != root and d.is_relative_to(root))


def test_every_package_of_the_checkout_is_in_the_wheel_under_edgestream():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    dirs: dict[str, str] = setuptools["package-dir"]
    assert all(name == "edgestream" or name.startswith("edgestream.") for name in dirs)
    expected = set()
    for name, folder in dirs.items():
        for init in (REPO / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts or _own_distribution(init, REPO / folder):
                continue
            relative = init.parent.relative_to(REPO / folder).parts
            expected.add(".".join([name, *relative]))
    assert set(setuptools["packages"]) == expected
    # Everything but tests and benchmarks (the repository's own tools) is shipped.
    shipped = set(dirs.values())
    folders = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}
    assert folders - shipped == {"tests", "benchmarks"}


def test_the_command_and_the_version_come_from_the_namespace():
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["scripts"] == {"edgestream": "edgestream.cli.main:main"}
    import edgestream

    assert edgestream.__version__ == project["version"]
