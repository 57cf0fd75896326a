"""docs/training.md's strategy-surface table lists every hook and ClassVar of SyncStrategy and
which registered strategies do not keep its default, as the registry says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edgestream.trainers.strategies import SyncStrategy, names, roles, strategy_class

DOC = Path(__file__).resolve().parents[3] / "docs" / "training.md"
REQUIRED = "every strategy (required)"
# Registered by other test modules in this interpreter (not part of the documented surface).
DOCUMENTED = [name for name in names() if not name.startswith(("test-", "byzantine-"))]


def surface() -> list[str]:
    """SyncStrategy's public members: its methods and ClassVars (annotated or with a default)."""
    members = [n for n in vars(SyncStrategy) if not n.startswith("_")]
    return members + [n for n in SyncStrategy.__annotations__ if n not in members and not n.startswith("_")]


def required() -> set[str]:
    """Members without a default: abstract hooks and ClassVars only annotated."""
    return set(SyncStrategy.__abstractmethods__) | {n for n in SyncStrategy.__annotations__
                                                    if n not in vars(SyncStrategy)}


def differs(member: str) -> list[str]:
    """Registered strategies whose class (per role) does not keep SyncStrategy's ``member``;
    ``name role`` when only one of its roles does."""
    out = []
    for name in DOCUMENTED:
        played = roles(name)
        hit = [role for role in played if getattr(strategy_class(name, role), member) is not
               getattr(SyncStrategy, member, object())]
        if hit:
            out.append(name if len(hit) == len(played) else f"{name} {hit[0]}")
    return out


def table() -> dict[str, list[str]]:
    """The documented table: member -> its cells after the first."""
    text = DOC.read_text()
    start = text.index("### The strategy surface")
    end = text.index("\n### ", start + 1)
    rows: dict[str, list[str]] = {}
    for line in text[start:end].splitlines():
        m = re.match(r"\| `(\w+)", line)
        if m:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            assert m.group(1) not in rows, f"{m.group(1)} listed twice"
            rows[m.group(1)] = cells[1:]
    return rows


def test_the_surface_is_what_the_issue_counted():
    classvars = [n for n in surface() if not callable(getattr(SyncStrategy, n, None))]
    # 8 ClassVars when the issue counted them, and ``uses_validation`` since (issue 32).
    assert len(classvars) == 9 and len(surface()) - len(classvars) == 25
    assert {"probe_step", "local_step_discarded"} <= set(surface())


def test_every_member_has_one_row_and_nothing_else_does():
    assert sorted(table()) == sorted(surface())


@pytest.mark.parametrize("member", surface())
def test_the_row_says_which_strategies_do_not_keep_the_default(member):
    default, overridden, why = table()[member]

    assert default and why
    if member in required():
        assert overridden == REQUIRED and default == "none"
        assert differs(member) == DOCUMENTED  # every registered class defines it
    else:
        assert overridden == (", ".join(differs(member)) or "none")
