"""`edgestream bench`: the registry is the list of benchmarks (every module in it imports, every
file in benchmarks/ is in it), a name runs its module as ``__main__`` with its arguments, and
an unknown name or a missing benchmarks package is refused with one line, exit 2."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from edgestream.benchmarks import BENCHMARKS, HELPERS, Benchmark
from edgestream.cli.main import main
from edgestream.pipeline.exits import EXIT_CONFIG

BENCHMARKS_DIR = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_registered_benchmark_module_imports_and_has_a_main(name):
    module = importlib.import_module(BENCHMARKS[name].module)

    assert callable(module.main)
    assert module.__name__ == BENCHMARKS[name].module
    assert Path(module.__file__).parent == BENCHMARKS_DIR


def test_every_benchmark_file_is_registered_and_no_module_shadows_a_package():
    files = {f"edgestream.benchmarks.{p.stem}" for p in BENCHMARKS_DIR.glob("*.py") if p.stem != "__init__"}

    assert HELPERS <= files  # shared modules (e.g. tuning), not benchmarks
    files -= HELPERS
    assert files == {b.module for b in BENCHMARKS.values()}
    top_level = {p.name for p in BENCHMARKS_DIR.parent.iterdir() if (p / "__init__.py").exists()}
    assert not {m.rsplit(".", 1)[1] for m in files} & top_level, "a benchmark named like a package"
    assert all(b.description and "\n" not in b.description for b in BENCHMARKS.values())


def test_an_unknown_benchmark_exits_2_with_one_line(capsys):
    code = main(["bench", "nosuch"])

    out, err = capsys.readouterr()
    assert code == EXIT_CONFIG == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("edgestream bench: no benchmark 'nosuch'; available: ")
    assert all(name in err for name in BENCHMARKS)


def test_without_the_benchmarks_package_bench_refuses_with_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "edgestream.benchmarks", None)  # as an installed copy without the repository

    code = main(["bench", "ingest"])

    err = capsys.readouterr().err
    assert code == EXIT_CONFIG
    assert err.count("\n") == 1 and "benchmarks are not part of this installation" in err


def test_list_names_every_registered_benchmark_with_its_description(capsys):
    assert main(["bench", "--list"]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == sorted(BENCHMARKS)
    assert all(BENCHMARKS[line.split()[0]].description in line for line in lines)


def test_bench_calls_the_registered_module_main_with_its_arguments_and_its_name(tmp_path, monkeypatch, capsys):
    seen = tmp_path / "seen.json"
    (tmp_path / "fake_bench.py").write_text(
        "import argparse, json, sys\n"
        "def main():\n"
        f"    open({str(seen)!r}, 'w').write(json.dumps(sys.argv))\n"
        "    parser = argparse.ArgumentParser()\n"
        "    parser.add_argument('--repeats', type=int)\n"
        "    return parser.parse_known_args()[0].repeats\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BENCHMARKS, "fake", Benchmark("fake", "fake_bench", "a test's benchmark"))
    monkeypatch.setattr(sys, "argv", list(sys.argv))

    assert main(["bench", "fake", "--repeats", "0", "--debug"]) == 0

    assert json.loads(seen.read_text()) == ["edgestream bench fake", "--repeats", "0", "--debug"]
    # its usage names the command, not the module's file
    with pytest.raises(SystemExit) as exited:
        main(["bench", "fake", "--repeats", "x"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("usage: edgestream bench fake [-h]")


def test_the_readme_names_every_registered_benchmark():
    readme = (BENCHMARKS_DIR.parent / "README.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if line.startswith("| `edgestream bench NAME`"))

    assert not [name for name in BENCHMARKS if f"`{name}`" not in row], "add them to README's bench row"
