"""The fuzz targets of tests/fuzz/ in ``make test``.

1. Every committed input (the seed and coverage corpus, and each crasher found and
   fixed) goes through its target's ``test_one_input``: fast and deterministic, so a
   fixed decoder bug cannot come back unnoticed.
2. Each target runs under atheris for a few seconds (``EDGESTREAM_FUZZ_SECONDS``,
   default 4) in a subprocess, from the committed corpus: a crash fails the test with
   libFuzzer's report and the saved crasher's path. ``make fuzz`` runs them longer.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.fuzz.targets import REPO, TARGETS, inputs, load

SECONDS = int(os.environ.get("EDGESTREAM_FUZZ_SECONDS", "4"))
#: Start-up (interpreter, torch import, the corpus replay) allowed on a loaded machine
#: beyond the fuzzing time; libFuzzer itself stops after -max_total_time.
STARTUP_GRACE_S = 90


@pytest.mark.parametrize("name", list(TARGETS))
def test_committed_inputs_pass_their_target(name):
    module = load(name)
    files = inputs(name)
    assert len(files) >= 4, f"tests/fuzz/corpus/{name} lost its seeds: python -m tests.fuzz.run --write-seeds"
    for path in files:
        try:
            module.test_one_input(path.read_bytes())
        except Exception as exc:
            pytest.fail(
                f"{path.relative_to(REPO)}: {type(exc).__name__}: {exc} "
                f"(python -m tests.fuzz.run {name} --reproduce {path.relative_to(REPO)})"
            )


@pytest.mark.parametrize("name", list(TARGETS))
def test_the_seed_generator_still_makes_inputs_the_target_accepts(name):
    module = load(name)
    seeds = module.seeds()
    assert seeds
    for seed, data in seeds.items():
        assert len(data) <= 1 << 20, seed
        module.test_one_input(data)


@pytest.mark.skipif(
    importlib.util.find_spec("atheris") is None,
    reason="atheris is not installed: bash scripts/fuzz-deps.sh (make test runs it)",
)
@pytest.mark.parametrize("name", list(TARGETS))
def test_a_short_fuzz_run_finds_nothing(name):
    cmd = [sys.executable, "-m", "tests.fuzz.run", name, "--seconds", str(SECONDS), "--fresh",
           "--startup-grace", str(STARTUP_GRACE_S)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=SECONDS + STARTUP_GRACE_S + 30)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    summary = re.search(rf"^fuzz {name}: ok, (\d+) executions.*, cov (\d+),", proc.stdout, re.M)
    assert summary, output[-3000:]
    # At least every committed input ran (libFuzzer replays the corpus first), and then some.
    assert int(summary.group(1)) > len(inputs(name)), proc.stdout
    # The decoders are instrumented: with none (a module list that names no imported
    # module), libFuzzer mutates blind and reports no coverage at all.
    assert int(summary.group(2)) > 0, proc.stdout
