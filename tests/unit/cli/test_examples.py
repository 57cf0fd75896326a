"""`edgestream examples`: every example job file is listed, printed and written out as it is,
and each one loads as a valid job; unknown names, existing files and a missing job file
that an example would provide get one line saying what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgestream.cli.main import main
from edgestream.job.config import load_config
from edgestream.job.errors import ConfigError
from edgestream.job.examples import EXAMPLES_DIR, describe, example_names, example_path
from edgestream.pipeline.exits import EXIT_CONFIG

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def test_the_examples_are_the_repository_files_and_each_loads_as_a_job():
    assert EXAMPLES_DIR == EXAMPLES
    assert example_names() == sorted(p.stem for p in EXAMPLES.glob("*.toml"))
    for name in example_names():
        cfg = load_config(example_path(name), env={})
        assert cfg.job.name, name
        assert describe(example_path(name)), f"{name}.toml opens with no comment saying what it runs"


def test_the_list_names_every_example_with_its_first_sentence(capsys):
    assert main(["examples"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith("`")}
    assert set(rows) == set(example_names())
    assert "Online BSP training: 3 workers, one device each" in rows["bsp"]
    assert all(len(line) <= 120 for line in rows.values())


def test_a_name_prints_the_file_and_output_writes_it_but_never_over_a_file(capsys, tmp_path):
    assert main(["examples", "bsp"]) == 0
    assert capsys.readouterr().out == (EXAMPLES / "bsp.toml").read_text()

    target = tmp_path / "jobs" / "mine.toml"
    assert main(["examples", "bsp.toml", "-o", str(target)]) == 0
    assert target.read_text() == (EXAMPLES / "bsp.toml").read_text()
    target.write_text("# edited\n")
    capsys.readouterr()
    assert main(["examples", "gossip", "-o", str(target)]) == EXIT_CONFIG
    assert "exists; pass --force" in capsys.readouterr().err and target.read_text() == "# edited\n"
    assert main(["examples", "gossip", "-o", str(target), "--force"]) == 0
    assert target.read_text() == (EXAMPLES / "gossip.toml").read_text()


@pytest.mark.parametrize("name", ["nosuch", "../pyproject", "bsp/x"])
def test_an_unknown_name_exits_2_listing_the_names(capsys, name):
    assert main(["examples", name]) == EXIT_CONFIG
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no example job named" in err[0] and "bsp" in err[0]


def test_a_missing_job_file_named_like_an_example_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"examples/bsp.toml does not exist; `edgestream examples bsp -o bsp.toml`"):
        load_config("examples/bsp.toml", env={})
    with pytest.raises(ConfigError) as err:
        load_config("mine.toml", env={})
    assert str(err.value) == "job file mine.toml does not exist"
