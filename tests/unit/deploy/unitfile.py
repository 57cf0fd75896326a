"""Reading the systemd units of deploy/systemd/ as systemd does, for the unit-file tests and
the integration test that runs their ``ExecStart`` lines: sections and assignments (a key
may repeat; an empty value resets it), specifiers (``%i``, ``%S`` ...), ``Environment=``,
``EnvironmentFile=`` files, and the ``$VAR`` / ``${VAR}`` expansion of command lines.

Only what these units use; systemd.unit(5), systemd.exec(5) and systemd.service(5) describe
the full rules."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

UNIT_DIR = Path(__file__).resolve().parents[3] / "deploy" / "systemd"

#: Unit file name -> the instance the tests verify and run (templates need an instance).
UNITS = {
    "edgestream-worker@.service": "edgestream-worker@w0.service",
    "edgestream-simulate@.service": "edgestream-simulate@lab.service",
    "edgestream-bridge@.service": "edgestream-bridge@hall1.service",
    "edgestream-server.service": "edgestream-server.service",
    "edgestream-serve@.service": "edgestream-serve@serve-0.service",
}

#: Where the units expect the installed console script.
INSTALLED_EDGESTREAM = "/opt/edgestream/bin/edgestream"


@dataclass
class Unit:
    path: Path
    #: section -> key -> values in file order (after resets by empty assignments).
    sections: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    def values(self, section: str, key: str) -> list[str]:
        return self.sections.get(section, {}).get(key, [])

    def get(self, section: str, key: str) -> str | None:
        """The effective value of a single-valued key: its last assignment."""
        values = self.values(section, key)
        return values[-1] if values else None

    def words(self, section: str, key: str) -> list[str]:
        """A list-valued key (``After=``, ``RestrictAddressFamilies=`` ...): every word of
        every assignment."""
        return [w for v in self.values(section, key) for w in v.split()]


def parse_unit(path: Path) -> Unit:
    """Parse a unit file; raises ``ValueError`` on a line systemd would not understand
    (an assignment outside a section, a line without ``=``)."""
    unit = Unit(Path(path))
    section: dict[str, list[str]] | None = None
    lines = Path(path).read_text().splitlines()
    i = 0
    while i < len(lines):
        number, line = i + 1, lines[i].strip()
        i += 1
        while line.endswith("\\") and i < len(lines):  # continuation
            line = line[:-1] + " " + lines[i].strip()
            i += 1
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = unit.sections.setdefault(line[1:-1], {})
            continue
        if section is None or "=" not in line:
            raise ValueError(f"{path}:{number}: not an assignment inside a section: {line!r}")
        key, value = (part.strip() for part in line.split("=", 1))
        if value == "":
            section[key] = []  # an empty assignment resets a list
        else:
            section.setdefault(key, []).append(value)
    return unit


def seconds(text: str) -> float:
    """A systemd time span (``30s``, ``10min``, ``1min 30s``, ``90``, ``infinity``) in seconds."""
    if text.strip() == "infinity":
        return float("inf")
    scale = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "ms": 1e-3, "us": 1e-6}
    total, matched = 0.0, False
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text):
        total += float(number) * scale[unit]
        matched = True
    if not matched:
        raise ValueError(f"not a time span: {text!r}")
    return total


def size_bytes(text: str) -> int:
    """A systemd byte size (``2G``, ``1536M``, ``512K``, ``1024``)."""
    m = re.fullmatch(r"(\d+)([KMGT]?)", text.strip())
    if not m:
        raise ValueError(f"not a size: {text!r}")
    return int(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " ")


def expand_specifiers(text: str, specifiers: dict[str, str]) -> str:
    """Replace ``%x`` specifiers (``%%`` is a percent sign); an unknown one is an error."""
    def one(m: re.Match) -> str:
        letter = m.group(1)
        if letter == "%":
            return "%"
        if letter not in specifiers:
            raise KeyError(f"specifier %{letter} in {text!r} has no value in this test")
        return specifiers[letter]

    return re.sub(r"%(.)", one, text)


def unit_specifiers(unit_name: str, state_root: str, cache_root: str) -> dict[str, str]:
    """The specifiers of a system unit named ``unit_name`` (``foo@bar.service``), with the
    state and cache roots (``%S``, ``%C``: /var/lib and /var/cache on a host) moved."""
    prefix, _, rest = unit_name.partition("@")
    instance = rest.rsplit(".", 1)[0] if rest else ""
    return {"i": instance, "I": instance, "n": unit_name, "N": unit_name.rsplit(".", 1)[0],
            "p": prefix.rsplit(".", 1)[0], "S": state_root, "C": cache_root}


def parse_assignments(text: str) -> dict[str, str]:
    """``Environment=`` value: space-separated ``KEY=VALUE`` words, quoted as in a shell."""
    out = {}
    for word in shlex.split(text):
        key, _, value = word.partition("=")
        out[key] = value
    return out


def read_environment_file(path: Path) -> dict[str, str]:
    """An ``EnvironmentFile=``: ``KEY=VALUE`` lines, ``#``/``;`` comments, quotes stripped."""
    out = {}
    for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"{path}:{number}: not a KEY=VALUE line: {raw!r}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key] = value
    return out


def exec_argv(command: str, env: dict[str, str]) -> list[str]:
    """An ``ExecStart=`` line (specifiers already expanded) as the argv systemd runs: a word
    that is exactly ``${VAR}`` becomes one argument, ``$VAR`` is split at whitespace, and
    ``${VAR}`` inside a word is replaced in place. Unset variables expand to nothing."""
    words = shlex.split(command)
    words[0] = words[0].lstrip("-@:+!")  # exit-status / argv0 / privilege prefixes
    argv: list[str] = []
    for word in words:
        if m := re.fullmatch(r"\$\{(\w+)\}", word):
            argv.append(env.get(m.group(1), ""))
        elif m := re.fullmatch(r"\$(\w+)", word):
            argv.extend(env.get(m.group(1), "").split())
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
    return argv
