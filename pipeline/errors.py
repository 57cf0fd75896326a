"""The error every orchestrating part of a run raises when it cannot proceed."""

from __future__ import annotations


class RunError(RuntimeError):
    """The run could not proceed; the message says what to do (the CLI prints it as one
    line, exit status 1)."""
