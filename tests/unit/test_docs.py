"""The user docs against the tree: every relative link and backticked repository path in
README.md and docs/*.md exists, every table has its header row, and every job key of the
config schema (``job.config.JobConfig``) has a row in docs/configuration.md.

The checks are plain functions over a directory, so the tests below also run them on a
small planted tree, where each must find the fault it is for."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from edgestream.job.config import JobConfig

ROOT = Path(__file__).resolve().parents[2]

#: ``[text](target)`` and ``![alt](target)``; the target up to the first space or ``)``.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
#: A backticked span without backticks inside.
CODE_SPAN = re.compile(r"`([^`\n]+)`")
#: A fenced code block (its content is commands and output, not prose references).
FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.MULTILINE | re.DOTALL)
#: What a file or folder reference looks like: segments of name characters and slashes,
#: optionally a ``:line`` or ``:start-end`` suffix (``pipeline/training.py:165-237``).
PATH_LIKE = re.compile(r"^(?:\./)?[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*/?(?::\d+(?:-\d+)?)?$")
#: Files at the top of the repository that docs name bare (``README.md``): a bare ``*.md``
#: must exist at the top or beside the page that names it.
BARE_DOC = re.compile(r"^[A-Za-z0-9_-]+\.md$")
#: A path segment that stands for a name (``NAME.json``, ``STATE``, ``DIR``), not a file.
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(\.(?!md$)[a-z]+)?$")


def doc_pages(root: Path) -> list[Path]:
    """The pages a user reads: README.md and docs/*.md."""
    pages = [root / "README.md"] if (root / "README.md").exists() else []
    return pages + sorted((root / "docs").glob("*.md"))


def _prose(text: str) -> str:
    """The page without its fenced code blocks, line count kept (findings name lines)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def _top_dirs(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}


def broken_links(root: Path, page: Path) -> list[str]:
    """Relative links of ``page`` whose file or folder does not exist, as ``page:line: target``."""
    text = _prose(page.read_text(encoding="utf-8"))
    found = []
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, https:, mailto: ... and anchors within the page
        path = target.split("#", 1)[0]
        resolved = (page.parent / path).resolve()
        if not resolved.exists() or not resolved.is_relative_to(root.resolve()):
            found.append(f"{page.relative_to(root)}:{_line_of(text, match.start())}: link {target}")
    return found


def missing_paths(root: Path, page: Path) -> list[str]:
    """Backticked repository paths of ``page`` (``docs/foo.md``, ``pipeline/x.py``,
    ``examples/y.toml``, ``../outside``, a bare ``NOTES.md``) that do not exist in ``root``,
    as ``page:line: path``. A span with a placeholder (``<job>``, ``*``, ``NAME``) or one
    outside the repository's folders (``/etc/...``, ``~/.cache/...``) is not a reference."""
    text = _prose(page.read_text(encoding="utf-8"))
    tops = _top_dirs(root)
    found = []
    for match in CODE_SPAN.finditer(text):
        span = match.group(1).strip()
        where = f"{page.relative_to(root)}:{_line_of(text, match.start())}"
        if span.startswith("../"):
            found.append(f"{where}: {span} (outside the repository)")
            continue
        if not PATH_LIKE.match(span):
            continue
        path = span.removeprefix("./").split(":", 1)[0]
        first = path.split("/", 1)[0]
        if any(PLACEHOLDER.match(segment) for segment in path.split("/")):
            continue  # benchmarks/results/NAME.json: a pattern, not a file
        if "/" in path and first in tops:
            if not (root / path).exists():
                found.append(f"{where}: {span}")
        elif BARE_DOC.match(path) and not ((root / path).exists() or (page.parent / path).exists()):
            found.append(f"{where}: {span}")
    return found


def headless_tables(root: Path, page: Path) -> list[str]:
    """Table rows that do not belong to a table with a header separator: a blank line inside
    a table turns everything after it into plain text."""
    lines = _prose(page.read_text(encoding="utf-8")).splitlines()
    found = []
    i = 0
    while i < len(lines):
        if not lines[i].lstrip().startswith("|"):
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].lstrip().startswith("|"):
            i += 1
        block = lines[start:i]
        if len(block) < 2 or not re.match(r"^\s*\|(\s*:?-+:?\s*\|)+\s*$", block[1]):
            found.append(f"{page.relative_to(root)}:{start + 1}: {len(block)} table row(s) without a header "
                         "(a blank line inside a table?)")
    return found


def job_keys(config: type = JobConfig) -> list[str]:
    """Every ``section.key`` of the job schema, read from its dataclasses."""
    keys = []
    for section in dataclasses.fields(config):
        section_type = type(getattr(config(), section.name))
        keys += [f"{section.name}.{f.name}" for f in dataclasses.fields(section_type)]
    return keys


def documented_keys(page: Path) -> set[str]:
    """The keys a configuration page documents: backticked in the first cell of a table row."""
    keys: set[str] = set()
    for line in _prose(page.read_text(encoding="utf-8")).splitlines():
        cells = line.strip().split("|")
        if line.lstrip().startswith("|") and len(cells) > 2:
            keys.update(CODE_SPAN.findall(cells[1]))
    return keys


def undocumented_keys(page: Path, keys: list[str]) -> list[str]:
    documented = documented_keys(page)
    return [key for key in keys if key not in documented]


# --- the repository -----------------------------------------------------------------------
def test_every_relative_link_in_the_docs_exists():
    found = [f for page in doc_pages(ROOT) for f in broken_links(ROOT, page)]
    assert found == [], "links to nothing (fix or drop them):\n" + "\n".join(found)


def test_every_backticked_repository_path_in_the_docs_exists():
    found = [f for page in doc_pages(ROOT) for f in missing_paths(ROOT, page)]
    assert found == [], "paths that do not exist in the repository:\n" + "\n".join(found)


def test_every_table_in_the_docs_has_its_header():
    found = [f for page in doc_pages(ROOT) for f in headless_tables(ROOT, page)]
    assert found == [], "\n".join(found)


def test_every_job_key_has_a_row_in_the_configuration_page():
    keys = job_keys()
    assert "train.injection_alpha" in keys and "testbed.links" in keys  # read from the schema
    missing = undocumented_keys(ROOT / "docs" / "configuration.md", keys)
    assert missing == [], ("job keys without a row in docs/configuration.md (add each with its default and "
                           "what it does): " + ", ".join(missing))


# --- the checks themselves, on a planted tree -----------------------------------------------
@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "run.py").write_text("")
    (tmp_path / "README.md").write_text(
        "See [the guide](docs/guide.md#start), [the site](https://example.org/x.md), [here](#top),\n"
        "`pipeline/run.py`, `pipeline/run.py:10-20`, `pipeline/`, `STATE/broker-*`, `~/.cache/x/y`,\n"
        "`sensors.<device>`, `README.md`, `summary.json`, `pipeline/NAME.json` and `docs/guide.md`.\n"
        "```\nedgestream run --job `missing/in/a/fence.toml` [x](nowhere.md)\n```\n"
        "| key | meaning |\n|---|---|\n| `job.name` | the name |\n")
    (tmp_path / "docs" / "guide.md").write_text("Back to [the readme](../README.md).\n")
    return tmp_path


def test_a_clean_tree_has_no_findings(tree):
    for page in doc_pages(tree):
        assert broken_links(tree, page) == []
        assert missing_paths(tree, page) == []
        assert headless_tables(tree, page) == []


def test_a_planted_bad_link_is_found(tree):
    guide = tree / "docs" / "guide.md"
    guide.write_text(guide.read_text() + "\nMore in [ingest](ingest.md#backlog) and [up](../../outside.md).\n")

    assert broken_links(tree, guide) == ["docs/guide.md:3: link ingest.md#backlog",
                                         "docs/guide.md:3: link ../../outside.md"]


@pytest.mark.parametrize("span", ["pipeline/nosuch.py", "pipeline/nosuch.py:3", "examples/y.toml",
                                  "docs/foo.md", "BENCHMARKS.md", "../shared/SEEDS.md"])
def test_a_planted_missing_path_is_found(tree, span):
    (tree / "examples").mkdir()
    readme = tree / "README.md"
    readme.write_text(readme.read_text() + f"\nsee `{span}`\n")

    findings = missing_paths(tree, readme)

    assert len(findings) == 1 and findings[0].startswith(f"README.md:11: {span}")


def test_a_blank_line_inside_a_table_is_found(tree):
    readme = tree / "README.md"
    readme.write_text(readme.read_text() + "\n| `job.seed` | the seed |\n")

    assert headless_tables(tree, readme) == ["README.md:11: 1 table row(s) without a header "
                                             "(a blank line inside a table?)"]


def test_a_key_missing_from_the_configuration_page_is_named(tree):
    @dataclasses.dataclass
    class Job:
        name: str = "demo"
        seed: int = 0

    @dataclasses.dataclass
    class Config:
        job: Job = dataclasses.field(default_factory=Job)

    keys = job_keys(Config)
    readme = tree / "README.md"

    assert keys == ["job.name", "job.seed"]
    assert undocumented_keys(readme, keys) == ["job.seed"]  # `job.seed` in prose is not a row
    readme.write_text(readme.read_text() + "| `job.seed`, `job.other` | the seed |\n")
    assert undocumented_keys(readme, keys) == []
