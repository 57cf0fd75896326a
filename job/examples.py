"""The example job files shipped with edgestream: where they are, which there are, what each is.

In a checkout they are the repository's ``examples/*.toml``; an installed wheel holds the
same files as ``edgestream/examples/``. Each file opens with comment lines saying what
the job does; ``describe`` returns them as one line.
"""

from __future__ import annotations

from pathlib import Path

from edgestream.job.errors import ConfigError

#: The folder of the example job files: the checkout's ``examples/`` (beside ``job/``) or,
#: installed, ``edgestream/examples/`` (beside ``edgestream/job/``).
EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


class UnknownExample(ConfigError):
    """No example job has the name asked for."""


def example_names() -> list[str]:
    """The example jobs' names (file names without ``.toml``), sorted."""
    return sorted(p.stem for p in EXAMPLES_DIR.glob("*.toml"))


def example_path(name: str) -> Path:
    """The file of example ``name`` (``bsp`` or ``bsp.toml``); ``UnknownExample`` listing the
    names if there is none."""
    stem = name.removesuffix(".toml")
    path = EXAMPLES_DIR / f"{stem}.toml"
    if "/" in stem or not path.is_file():
        raise UnknownExample(f"no example job named {name!r}; there are: {', '.join(example_names())}")
    return path


def describe(path: Path, width: int = 100) -> str:
    """The first sentence of a job file's opening comment, at most ``width`` characters
    ("" without a comment)."""
    words: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#") or not line.lstrip("#").strip():
            break  # the code, or the end of the comment's first paragraph
        words.append(line.lstrip("#").strip())
    text = " ".join(words)
    end = text.find(". ")
    sentence = text if end < 0 else text[: end + 1]
    return sentence if len(sentence) <= width else sentence[: width - 3].rstrip() + "..."


def missing_job_hint(path: Path) -> str:
    """What to say when job file ``path`` does not exist: if an example has its name, how to
    get that example here ("" otherwise)."""
    stem = path.stem if path.suffix == ".toml" else ""
    if stem and stem in example_names():
        return (f"; `edgestream examples {stem} -o {path.name}` writes the example job of that name "
                f"(`edgestream examples` lists them)")
    return ""
