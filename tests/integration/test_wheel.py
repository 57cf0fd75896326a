"""The wheel as a user installs it: one import package, ``edgestream``, and a working command.

The wheel is built from a copy of the checkout and installed into a fresh virtual
environment (its dependencies come from the project's cached one through a ``.pth`` file:
the same torch, not a second download). Everything then runs from outside the repository,
with a decoy top-level ``compression`` package first on ``sys.path`` (Python 3.14's standard
library has one of that name): ``edgestream --version``, ``--help``, ``models`` and a
10-second ``run`` (simulator + worker) against the real broker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
#: What the wheel is built from (pyproject.toml maps each folder into edgestream/).
#: The folders the wheel is built from: pyproject.toml's package-dir.
SOURCES = tuple(sorted(set(tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
                           ["tool"]["setuptools"]["package-dir"].values())))


def _copy_checkout(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        shutil.copytree(REPO / name, dest / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)


def _run(args: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """The wheel built and installed into a fresh environment: its paths and a clean env."""
    root = tmp_path_factory.mktemp("wheel")
    source, dist, env_dir = root / "source", root / "dist", root / "env"
    _copy_checkout(source)
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                  "-w", str(dist), str(source)], cwd=root, env=dict(os.environ))
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = dist.glob("edgestream-*.whl")

    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=root, env={"PATH": os.environ["PATH"]}).stdout.strip())
    # The dependencies: the cached environment's site-packages, after the fresh one's own.
    (site / "zz_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    done = _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                cwd=root, env={"PATH": os.environ["PATH"]})
    assert done.returncode == 0, done.stderr[-3000:]

    decoy = root / "decoy"
    (decoy / "compression").mkdir(parents=True)
    (decoy / "compression" / "__init__.py").write_text(
        "raise ImportError('the decoy compression package was imported')\n")
    outside = root / "elsewhere"
    outside.mkdir()
    env = {"PATH": f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}", "HOME": str(root),
           "PYTHONPATH": str(decoy)}
    return {"wheel": wheel, "site": site, "python": python, "bin": env_dir / "bin" / "edgestream",
            "env": env, "cwd": outside}


def test_the_wheel_holds_one_import_package_with_the_data_the_commands_read(installed):
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"edgestream"}
    for data in ("edgestream/deploy/kafka/pom.xml", "edgestream/deploy/prometheus/prometheus.yml",
                 "edgestream/deploy/helm/edgestream/Chart.yaml", "edgestream/deploy/systemd/edgestream-worker@.service"):
        assert data in names, f"{data} is not in the wheel"
    assert any(n.startswith("edgestream/deploy/prometheus/rules/") for n in names)
    assert any(n.startswith("edgestream/deploy/grafana/dashboards/") for n in names)
    assert "edgestream/examples/bsp.toml" in names and "edgestream/examples/demo.toml" in names
    assert not any(n.startswith(("edgestream/benchmarks/", "tests/")) for n in names)
    # Installed: nothing of ours outside edgestream/ in site-packages.
    ours = {"pipeline", "streams", "trainers", "compression", "monitoring", "deploy", "job", "cli", "benchmarks"}
    assert not ours & {p.name for p in installed["site"].iterdir()}


def test_the_installed_command_answers_outside_the_repository_beside_a_decoy_compression(installed):
    env, cwd = installed["env"], installed["cwd"]
    version = _run([str(installed["bin"]), "--version"], cwd=cwd, env=env)
    assert version.returncode == 0 and version.stdout.startswith("edgestream "), version.stderr
    helped = _run([str(installed["bin"]), "--help"], cwd=cwd, env=env)
    assert helped.returncode == 0 and "simulate" in helped.stdout and "worker" in helped.stdout, helped.stderr
    models = _run([str(installed["bin"]), "models"], cwd=cwd, env=env)
    assert models.returncode == 0 and "mlp" in models.stdout, models.stderr
    where = _run([str(installed["python"]), "-c",
                  "import edgestream.compression as c, edgestream, sys; print(c.__file__); print(edgestream.CHECKOUT); "
                  "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                  "('pipeline','streams','trainers','compression','monitoring','deploy','job','cli')))"],
                 cwd=cwd, env=env)
    assert where.returncode == 0, where.stderr
    file, checkout, bare = where.stdout.splitlines()
    assert file.startswith(str(installed["site"])) and checkout == "None" and bare == "[]"
    listed = _run([str(installed["bin"]), "examples"], cwd=cwd, env=env)
    assert listed.returncode == 0 and "bsp " in listed.stdout and "demo " in listed.stdout, listed.stderr
    missing = _run([str(installed["bin"]), "run", "--job", "examples/bsp.toml"], cwd=cwd, env=env)
    assert missing.returncode == 2 and "`edgestream examples bsp -o bsp.toml`" in missing.stderr, missing.stderr
    written = _run([str(installed["bin"]), "examples", "bsp", "-o", "bsp.toml"], cwd=cwd, env=env)
    assert written.returncode == 0 and (cwd / "bsp.toml").read_text() == (REPO / "examples" / "bsp.toml").read_text()
    refused = _run([str(installed["bin"]), "bench", "ingest"], cwd=cwd, env=env)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr


def test_the_installed_command_runs_a_ten_second_job_against_the_real_broker(installed, kafka_bootstrap, unique):
    env, cwd = installed["env"], installed["cwd"]
    job = cwd / "job.toml"
    job.write_text("\n".join([
        "[job]", f'name = "w{unique}"',
        "[devices]", "count = 1", f'ids = ["d{unique}"]', "rates_hz = [100]",
        "[workers]", "count = 1",
        "[train]", "enabled = true", 'model = "mlp"', 'strategy = "bsp"', "eval_every_s = 1",
        "[run]", f'state_dir = "{cwd / "state"}"', "duration_s = 10", "drain_timeout_s = 60",
    ]) + "\n")
    done = _run([str(installed["bin"]), "run", "--job", str(job), "--bootstrap", kafka_bootstrap], cwd=cwd,
                env=env, timeout_s=400)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    summary = json.loads((cwd / "state" / "summary.json").read_text())
    assert summary["outcome"] == "balanced" and summary["balanced"], summary["reason"]
    produced = summary["produced"][f"d{unique}"]
    row = summary["accounting"][f"d{unique}"]
    assert produced > 0 and row["records_in"] == produced
    assert summary["training"]["w0"]["steps"] > 0
