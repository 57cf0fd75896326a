"""Fixtures shared by the monitoring unit tests."""

from __future__ import annotations

import pytest

from edgestream.monitoring.metrics import Metrics, serve


@pytest.fixture
def served():
    """A fresh ``Metrics`` served on a free port; returns (metrics, url)."""
    metrics = Metrics()
    port = serve(metrics, 0)
    return metrics, f"http://127.0.0.1:{port}/metrics"
