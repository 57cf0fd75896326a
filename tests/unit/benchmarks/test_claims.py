"""benchmarks/claims.py: a claim holds under a cost model where the median same-seed ratio
of the row's time to target over the baseline's is below 1, misses counted as bounds."""

from __future__ import annotations

from edgestream.benchmarks.censored import censored_ratio, median_bound
from edgestream.benchmarks.claims import Claim, holds, judge, markdown

BUDGET = 100.0
CLAIM = Claim("A before B", "a", "b", (("rates", "iid"),), "test")


def _runs(cost: str, pairs: list[tuple[float | None, float | None]]) -> list[dict]:
    out = []
    for seed, (a, b) in enumerate(pairs):
        out.append({"cost": cost, "regime": "rates", "partition": "iid", "seed": seed, "row": "a", "tta_s": a})
        out.append({"cost": cost, "regime": "rates", "partition": "iid", "seed": seed, "row": "b", "tta_s": b})
    return out


def test_the_count_is_over_cost_models_and_the_median_is_over_seeds():
    raw = (_runs("default", [(5, 10), (6, 10), (20, 10)])  # 0.5, 0.6, 2.0: median 0.6 holds
           + _runs("edge", [(15, 10), (16, 10), (5, 10)])  # 1.5, 1.6, 0.5: median 1.5 fails
           + _runs("slow", [(None, 10), (None, 10), (5, 10)]))  # >10, >10, 0.5: median >10 fails
    [entry] = judge(raw, ["default", "edge", "slow"], BUDGET, [CLAIM])

    assert (entry["holds"], entry["of"]) == (1, 3)
    assert entry["per_cost"]["default"]["ratio"]["value"] == 0.6
    assert entry["per_cost"]["slow"]["ratio"]["bound"] == ">"
    assert "| A before B | rates iid | **0.60** | 1.50 | >10.00 | 1 of 3 |" in markdown([entry], ["default", "edge", "slow"])


def test_a_baseline_that_misses_makes_an_upper_bound_that_holds_and_two_misses_hold_nothing():
    raw = _runs("default", [(50, None)]) + _runs("other", [(None, None)])
    [entry] = judge(raw, ["default", "other"], BUDGET, [CLAIM])

    assert entry["per_cost"]["default"] == {"ratio": {"value": 0.5, "bound": "<", "min": 0.5, "max": 0.5},
                                           "holds": True}
    assert entry["per_cost"]["other"] == {"ratio": None, "holds": False}
    assert "both missed" in markdown([entry], ["default", "other"])


def test_a_ratio_of_exactly_one_or_a_lower_bound_below_one_does_not_hold():
    assert not holds({"value": 1.0, "bound": "=", "min": 1.0, "max": 1.0})
    assert not holds({"value": 0.9, "bound": ">", "min": 0.9, "max": 0.9})
    assert not holds(None)


def test_columns_or_rows_the_run_lacks_are_left_out():
    raw = _runs("default", [(5, 10)])
    other = Claim("C before B", "c", "b", (("rates", "iid"),), "test")
    elsewhere = Claim("A before B elsewhere", "a", "b", (("network", "iid"),), "test")

    assert judge(raw, ["default"], BUDGET, [other, elsewhere]) == []
    assert markdown([], ["default"]) == ""


def test_censoring_helpers():
    assert censored_ratio(None, 20, BUDGET) == {"value": 5.0, "bound": ">"}
    assert censored_ratio(10, None, BUDGET) == {"value": 0.1, "bound": "<"}
    assert censored_ratio(None, None, BUDGET) is None
    even = median_bound([{"value": 1.0, "bound": "="}, {"value": 3.0, "bound": ">"}])
    assert even == {"value": 2.0, "bound": ">", "min": 1.0, "max": 3.0}
