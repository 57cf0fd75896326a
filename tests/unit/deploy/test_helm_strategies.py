"""The chart's server and inbox strategy lists are generated from the registry, never kept by hand."""

from __future__ import annotations

import re
import subprocess
import sys

from edgestream.cli.main import main
from edgestream.deploy import helm_strategies
from edgestream.deploy.helm_strategies import CHART, GENERATED, REPO


def test_the_generated_file_equals_a_fresh_generation_from_the_registry():
    """Regenerated in a fresh interpreter: other tests register strategies of their own in this one."""
    done = subprocess.run([sys.executable, "-m", "edgestream", "generate", "--check"], capture_output=True,
                          text=True, cwd=REPO, timeout=120, check=False)

    assert done.returncode == 0, done.stdout + done.stderr


def test_the_lists_name_the_servers_and_inbox_readers_classes_and_functions_alike():
    def listed(name: str) -> list[str]:
        m = re.search(r'define "edgestream\.' + name + r'" -\}\}([^{]*)\{\{', GENERATED.read_text())
        assert m, f"{GENERATED.name} defines no {name}"
        return m.group(1).split()

    # This interpreter's registry may hold strategies other tests registered: a superset.
    assert set(listed("serverStrategies")) <= set(helm_strategies.server_strategies())
    assert set(listed("inboxStrategies")) <= set(helm_strategies.inbox_strategies())
    # asp, adsp and ssp are registered as functions (the registry reads the classes they build);
    # gossip, dlion and the stage strategies as classes.
    assert listed("serverStrategies") == ["adsp", "asp", "ssp"]
    assert listed("inboxStrategies") == ["cdni", "dlion", "dni", "edgegossip", "gossip", "pipeline_bp"]


def test_no_template_lists_a_strategy_by_hand():
    names = {"asp", "adsp", "ssp", "gossip", "edgegossip", "dlion", "pipeline_bp", "dni", "cdni"}
    for path in sorted((CHART / "templates").iterdir()):
        if path == GENERATED:
            continue
        text = path.read_text()
        assert 'define "edgestream.serverStrategies"' not in text and 'define "edgestream.inboxStrategies"' not in text
        for line in text.splitlines():
            words = set(re.findall(r"[a-z_]+", line))
            assert len(words & names) < 2, f"{path.name}: a hand list of strategies: {line.strip()}"


def test_a_stale_file_is_reported_with_the_command_that_fixes_it(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "templates" / "_strategies.tpl"
    stale.parent.mkdir()
    stale.write_text(helm_strategies.render().replace("ssp", ""))
    monkeypatch.setattr(helm_strategies, "GENERATED", stale)

    assert main(["generate", "--check"]) == 1
    out = capsys.readouterr().out
    assert f"stale {stale}" in out and "run `edgestream generate`" in out
    assert stale.read_text() != helm_strategies.render()  # --check writes nothing

    assert main(["generate"]) == 0
    assert f"wrote {stale}" in capsys.readouterr().out
    assert stale.read_text() == helm_strategies.render()
    assert main(["generate", "--check"]) == 0
