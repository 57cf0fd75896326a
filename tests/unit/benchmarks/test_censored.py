"""benchmarks/censored.py: a missed target stays a bound in ratios, medians and table text."""

from __future__ import annotations

import pytest

from edgestream.benchmarks.censored import censored_median, censored_ratio, median_bound, text


def test_a_ratio_with_a_miss_is_a_bound_and_two_misses_are_unknown():
    assert censored_ratio(30.0, 60.0, 120.0) == {"value": 0.5, "bound": "="}
    assert censored_ratio(None, 60.0, 120.0) == {"value": 2.0, "bound": ">"}
    assert censored_ratio(30.0, None, 120.0) == {"value": 0.25, "bound": "<"}
    assert censored_ratio(None, None, 120.0) is None


def test_a_median_keeps_the_mark_of_the_middle_run():
    m = censored_median([10.0, None, None], 60.0)
    assert m == {"value": 60.0, "bound": ">", "min": 10.0, "max": 60.0}
    assert median_bound([None]) is None


@pytest.mark.parametrize(("value", "kwargs", "expected"), [
    ({"value": 1.2, "bound": "=", "min": 0.9, "max": 1.4}, {"suffix": "x"}, "1.20x (0.90-1.40)"),
    ({"value": 60.0, "bound": ">", "min": 10.0, "max": 60.0}, {"digits": 1, "suffix": " s", "spread": False},
     ">60.0 s"),
    ({"value": 0.5, "bound": "<", "min": 0.5, "max": 0.5}, {}, "<0.50"),
    (None, {}, "-"),
    (None, {"missing": "missed"}, "missed"),
])
def test_table_text_shows_the_mark_the_value_and_the_spread_only_when_runs_differ(value, kwargs, expected):
    assert text(value, **kwargs) == expected
