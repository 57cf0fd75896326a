"""Fixtures shared by the unit tests: running a benchmark's ``main`` in-process."""

from __future__ import annotations

import signal
import sys

import pytest


@pytest.fixture
def bench_process(monkeypatch):
    """A benchmark's ``main`` sets ``sys.argv`` and a SIGTERM handler: both put back after."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)
