"""RecentValues: a bounded ring of the last values, with exact percentiles of what it keeps."""

from __future__ import annotations

import numpy as np
import pytest

from edgestream.monitoring.recent import RecentValues


def test_percentiles_of_every_value_while_it_has_room():
    r = RecentValues(capacity=1000)
    r.add(np.arange(1, 101))
    s = r.summary()
    assert (s["count"], s["kept"], s["max"]) == (100, 100, 100)
    assert s["p50"] == pytest.approx(50.5) and s["p99"] == pytest.approx(99.01)


@pytest.mark.parametrize("chunk", [1, 7, 10, 25])
def test_only_the_last_capacity_values_are_kept_in_order(chunk):
    r = RecentValues(capacity=10)
    values = np.arange(53, dtype=np.float64)
    for start in range(0, len(values), chunk):
        r.add(values[start : start + chunk])
    assert r.count == 53 and r.values().tolist() == list(range(43, 53))


def test_nothing_yet_says_so_and_capacity_must_be_positive():
    assert RecentValues(4).summary() == {"count": 0}
    with pytest.raises(ValueError):
        RecentValues(0)
