"""Plugins: installed distributions that add models, strategies, codecs and data sources.

A plugin distribution declares entry points in one of four groups (``GROUPS``). The value of
each entry point names a **module** (``name = "package.module"``); loading it imports that
module, whose ``@register...`` decorators register what it adds under the names they give
(the entry point's own name is a label shown in errors, conventionally the name it registers).
An entry point naming an object (``package.module:attr``) is refused: registration is always
by the module's decorators, so a plugin registers exactly as a built-in module does.

Each registry calls :func:`load_group` when a name is looked up that it does not hold, and
when it lists its names: a group's entry points are loaded once per process. A plugin that
fails to load is remembered with its one-line reason (:func:`failures`), never retried; the
registry names it in its own error when the missing name may be that plugin's.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from importlib import metadata

log = logging.getLogger(__name__)

#: The entry-point groups, by the kind of thing their plugins register.
MODELS = "edgestream.models"
STRATEGIES = "edgestream.strategies"
CODECS = "edgestream.codecs"
SOURCES = "edgestream.sources"
GROUPS = (MODELS, STRATEGIES, CODECS, SOURCES)


@dataclass(frozen=True)
class PluginFailure:
    """An entry point that did not load: its distribution, its entry point and why."""

    distribution: str
    entry_point: str
    group: str
    reason: str

    def line(self) -> str:
        """One line: which plugin, which entry point, why, and what to do."""
        return (f"plugin distribution {self.distribution} failed to load its entry point "
                f"{self.entry_point!r} ({self.group}): {self.reason}; fix or uninstall it")


#: Group -> the failures of its entry points; a group in here was loaded.
_LOADED: dict[str, tuple[PluginFailure, ...]] = {}


def load_group(group: str) -> tuple[PluginFailure, ...]:
    """Import every module that an entry point of ``group`` names, once per process; what
    failed, each with its distribution (a failure is logged as a warning, once)."""
    if group not in GROUPS:
        raise ValueError(f"unknown entry-point group {group!r}; the groups are {', '.join(GROUPS)}")
    if group in _LOADED:
        return _LOADED[group]
    _LOADED[group] = ()  # a plugin module that looks a name up while it loads must not load the group again
    failed = []
    for entry in sorted(metadata.entry_points(group=group), key=lambda e: (e.value, e.name)):
        failure = _load(entry, group)
        if failure is not None:
            log.warning("%s", failure.line())
            failed.append(failure)
    _LOADED[group] = tuple(failed)
    return _LOADED[group]


def failures(group: str) -> tuple[PluginFailure, ...]:
    """The entry points of ``group`` that failed to load (empty: none, or not loaded yet)."""
    return _LOADED.get(group, ())


def failure_note(group: str) -> str:
    """``"; <failure line>"`` for each entry point of ``group`` that failed to load ("" if none):
    what a registry appends to its unknown-name error."""
    return "".join(f"; {failure.line()}" for failure in failures(group))


def forget() -> None:
    """Forget which groups were loaded (tests that install a plugin mid-process)."""
    _LOADED.clear()


def _distribution_of(entry: metadata.EntryPoint) -> str:
    dist = entry.dist
    if dist is None:
        return "(unknown distribution)"
    name = dist.metadata["Name"] if dist.metadata is not None else None
    return f"{name or dist.name} {dist.version}"


def _load(entry: metadata.EntryPoint, group: str) -> PluginFailure | None:
    """Import the module ``entry`` names; its failure, or None."""

    def failed(reason: str) -> PluginFailure:
        return PluginFailure(_distribution_of(entry), f"{entry.name} = {entry.value}", group, reason)

    module, _, attr = entry.value.partition(":")
    if attr.strip() or not module.strip():
        return failed("an edgestream entry point names a module (\"package.module\"), whose @register "
                      "decorators register what it adds; not an object")
    try:
        importlib.import_module(module.strip())
    except Exception as exc:  # a plugin's own bug or a missing dependency: reported, never a crash
        return failed(f"importing {module.strip()} raised {type(exc).__name__}: {_first_line(exc)}")
    return None


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"
