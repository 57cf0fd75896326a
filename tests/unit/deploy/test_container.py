"""The container image definition, checked statically (building it takes many minutes and
a builder: `make image`). deploy/container/Containerfile must stay multi-stage, run as a
non-root user, start the edgestream console script, leave no pip cache behind, and copy
only the project's packages (no tests) from a build context that .dockerignore keeps small."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CONTAINERFILE = REPO / "deploy" / "container" / "Containerfile"
BUILD_SH = REPO / "deploy" / "container" / "build.sh"
IGNORE_FILE = REPO / ".dockerignore"
VENV = "/opt/edgestream"
UID = "10001"


# --- a small Containerfile reader -------------------------------------------------------
@dataclass
class Instruction:
    keyword: str
    args: str

    def exec_form(self) -> list[str] | None:
        """The JSON (exec) form's argument list, None for the shell form."""
        try:
            value = json.loads(self.args)
        except ValueError:
            return None
        return value if isinstance(value, list) else None


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for ins in self.all("ENV"):
            for token in shlex.split(ins.args):
                key, sep, value = token.partition("=")
                assert sep, f"ENV {ins.args!r}: use the KEY=VALUE form"
                env[key] = value
        return env


def parse(text: str) -> tuple[list[Instruction], list[Stage]]:
    """(instructions before the first FROM, stages), continuation lines joined."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Containerfile ends inside a continued line"
    preamble: list[Instruction] = []
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        ins = Instruction(keyword.upper(), args.strip())
        if ins.keyword == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif stages:
            stages[-1].instructions.append(ins)
        else:
            preamble.append(ins)
    return preamble, stages


@pytest.fixture(scope="module")
def parsed() -> tuple[list[Instruction], list[Stage]]:
    return parse(CONTAINERFILE.read_text())


@pytest.fixture(scope="module")
def stages(parsed) -> list[Stage]:
    return parsed[1]


@pytest.fixture(scope="module")
def final(stages) -> Stage:
    return stages[-1]


def copy_sources(ins: Instruction) -> tuple[list[str], str | None]:
    """(sources, --from stage) of a COPY/ADD instruction."""
    words = shlex.split(ins.args)
    options = [w for w in words if w.startswith("--")]
    paths = [w for w in words if not w.startswith("--")]
    source_stage = next((o.split("=", 1)[1] for o in options if o.startswith("--from=")), None)
    return paths[:-1], source_stage


# --- .dockerignore semantics (the subset used: globs, '**', '!' exceptions, last match wins)
def ignore_patterns() -> list[tuple[bool, str]]:
    patterns = []
    for raw in IGNORE_FILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        patterns.append((negate, line.lstrip("!").strip("/")))
    return patterns


def _glob_match(pattern: str, path: str) -> bool:
    regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
    regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
    return re.fullmatch(regex, path) is not None


def excluded(path: str, patterns: list[tuple[bool, str]]) -> bool:
    """Whether the build context leaves out ``path`` (a pattern matching a parent directory
    matches everything under it)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for negate, pattern in patterns:
        if any(_glob_match(pattern, p) for p in prefixes):
            result = not negate
    return result


def test_ignore_matcher_follows_docker_semantics():
    pats = [(False, "*"), (True, "pipeline"), (False, "**/__pycache__")]
    assert excluded("tests/unit/x.py", pats)
    assert not excluded("pipeline/cli.py", pats)
    assert excluded("pipeline/__pycache__/cli.cpython-311.pyc", pats)
    assert excluded("a/b/c", [(False, "a")]) and not excluded("b/a", [(False, "a")])


# --- the image ---------------------------------------------------------------------------
def test_multi_stage_with_a_separate_runtime_stage(stages):
    assert len(stages) >= 2, "build and runtime must be separate stages"
    names = {s.name for s in stages[:-1]}
    assert stages[-1].base not in names, "the runtime stage must not be FROM the build stage"
    # The runtime stage takes the build stage's result by COPY --from, nothing else of it.
    froms = [copy_sources(i)[1] for i in stages[-1].all("COPY")]
    assert any(f in names for f in froms), "the runtime stage must COPY --from the build stage"


def test_runtime_stage_runs_as_uid_10001(final):
    users = final.all("USER")
    assert users, "the runtime stage sets no USER: it would run as root"
    user = users[-1].args.split(":")[0]
    assert user == UID, f"USER {users[-1].args}: expected uid {UID}"
    # Nothing after USER switches back to root.
    last_user = max(i for i, ins in enumerate(final.instructions) if ins.keyword == "USER")
    assert all(ins.keyword != "RUN" for ins in final.instructions[last_user:])
    run = " ".join(i.args for i in final.all("RUN"))
    assert re.search(rf"useradd\b.*--uid {UID}\b", run), "the user must exist in /etc/passwd"


def test_entrypoint_is_the_console_script_of_the_venv(stages, final):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "edgestream" in scripts
    entrypoints = final.all("ENTRYPOINT")
    assert entrypoints, "no ENTRYPOINT"
    argv = entrypoints[-1].exec_form()
    assert argv == [f"{VENV}/bin/edgestream"], f"ENTRYPOINT {entrypoints[-1].args}"
    cmd = final.all("CMD")
    assert cmd and cmd[-1].exec_form() == ["--help"]
    build_runs = " ".join(i.args for s in stages[:-1] for i in s.all("RUN"))
    assert f"-m venv {VENV}" in build_runs, f"the build stage must create the venv at {VENV}"
    build_names = {s.name for s in stages[:-1]}
    copies = [copy_sources(i) for i in final.all("COPY")]
    assert any(src == [VENV] and frm in build_names for src, frm in copies), \
        f"the runtime stage must COPY --from=<build stage> {VENV}"


def test_no_pip_cache_is_left(stages):
    for stage in stages:
        no_cache_env = stage.env().get("PIP_NO_CACHE_DIR", "").lower() in {"1", "true", "yes", "on"}
        for ins in stage.all("RUN"):
            if re.search(r"\bpip3? (install|download)\b", ins.args):
                assert no_cache_env or "--no-cache-dir" in ins.args, f"pip caches: RUN {ins.args[:80]}"
    final = stages[-1]
    assert not any(re.search(r"(\bpip3?|-m pip)\s+(install|download|wheel)\b", i.args) for i in final.all("RUN")), \
        "the runtime stage must not run pip: it only copies the build stage's venv"
    for ins in final.all("COPY"):
        sources, _ = copy_sources(ins)
        assert not any(".cache" in s for s in sources), f"COPY of a cache: {ins.args}"


def test_project_copy_excludes_tests_and_exists(stages):
    patterns = ignore_patterns()
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    copied: set[str] = set()
    for stage in stages:
        for ins in stage.all("COPY") + stage.all("ADD"):
            sources, source_stage = copy_sources(ins)
            if source_stage is not None:
                continue
            for src in sources:
                src = src.rstrip("/")
                assert src not in {".", "*", "./"}, f"COPY {ins.args}: copies the whole context"
                assert "tests" not in src.split("/"), f"COPY {ins.args}: copies tests"
                assert (REPO / src).exists(), f"COPY {src}: no such path in the repository"
                assert not excluded(src, patterns), f"COPY {src}: left out of the context by .dockerignore"
                copied.add(src)
    for package, top in package_dirs.items():
        assert top in copied, f"package {package} ({top}/) of pyproject.toml is not copied: the install would miss it"
    assert "pyproject.toml" in copied and "requirements/runtime.txt" in copied


def test_build_context_is_small():
    patterns = ignore_patterns()
    for path in (".git/HEAD", ".edgestream/runs/x", "tests/unit/deploy/test_container.py",
                 "benchmarks/results/x.json", "docs/img/a.png",
                 "pipeline/__pycache__/cli.cpython-311.pyc"):
        assert excluded(path, patterns), f"{path} is in the build context"
    for path in ("cli/main.py", "pipeline/run.py", "pyproject.toml", "deploy/kafka/pom.xml"):
        assert not excluded(path, patterns), f"{path} is missing from the build context"


def test_runtime_environment(final):
    env = final.env()
    for key, value in {"HOME": "/tmp", "MPLCONFIGDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1",
                       "OMP_NUM_THREADS": "1"}.items():
        assert env.get(key) == value, f"ENV {key}={env.get(key)!r}, expected {value!r}"
    assert env.get("PATH", "").startswith(f"{VENV}/bin:")
    volumes = " ".join(i.args for i in final.all("VOLUME"))
    assert "/var/lib/edgestream" in volumes
    assert final.all("WORKDIR")[-1].args == "/var/lib/edgestream"
    assert any("9100" in i.args.split() for i in final.all("EXPOSE"))
    assert not final.all("HEALTHCHECK"), "HEALTHCHECK is not in the OCI format: probe /healthz"
    labels = " ".join(i.args for i in final.all("LABEL"))
    for key in ("title", "description", "version", "revision", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels


def test_base_is_a_build_argument(parsed, stages):
    preamble, _ = parsed
    assert any(i.keyword == "ARG" and i.args.startswith("BASE=") for i in preamble)
    assert all(s.base == "${BASE}" for s in stages), "both stages use the same base (same python3 path)"


def test_build_script_parses():
    assert BUILD_SH.stat().st_mode & 0o111, "build.sh must be executable"
    subprocess.run(["bash", "-n", str(BUILD_SH)], check=True)
    text = BUILD_SH.read_text()
    assert "deploy/container/Containerfile" in text or '"$here/Containerfile"' in text
    assert "edgestream --help" in text
