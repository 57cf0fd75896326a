"""The simulated clock hands every delivered record's produce-to-consume transit to the
driver (``handle(..., transit_s=)`` -> ``strategy.on_arrival``)."""

from __future__ import annotations

import dataclasses
import statistics
from typing import ClassVar

import pytest

from edgestream.trainers import strategies
from edgestream.trainers.simclock import CostModel, Mode, RunConfig, StreamSet, run
from edgestream.trainers.strategies.bsp import BSPStrategy

CONFIG = RunConfig(model="mlp", lr=0.5, target_accuracy=None, time_budget_s=6.0)
CHEAP = CostModel(compute_base_s=0.01, compute_per_record_s=0.001, latency_s=0.001)


class _ArrivalBsp(BSPStrategy):
    """BSP that records every ``on_arrival`` (class-level: the runner builds the instances)."""

    name = "test-simclock-arrival-bsp"
    seen: ClassVar[list[tuple[str, str, int, float]]] = []

    def on_arrival(self, peer: str, nbytes: int, seconds: float) -> None:
        type(self).seen.append((self.worker_id, peer, nbytes, seconds))


if _ArrivalBsp.name not in strategies.names():
    strategies.register(_ArrivalBsp.name)(_ArrivalBsp)


@pytest.fixture(scope="module")
def streams() -> StreamSet:
    return StreamSet.from_fleet("digits", [100.0, 50.0], seed=3)


def _arrivals(streams: StreamSet, costs: CostModel) -> list[tuple[str, str, int, float]]:
    _ArrivalBsp.seen = []
    run(Mode("arrival", _ArrivalBsp.name, batcher="window", window_s=0.5), streams, costs, CONFIG)
    return list(_ArrivalBsp.seen)


def test_delivered_records_carry_a_positive_transit_that_grows_on_a_slower_link(streams):
    fast = _arrivals(streams, CHEAP)
    slow_costs = dataclasses.replace(CHEAP, bandwidth_bytes_per_s=50_000.0)
    slow = _arrivals(streams, slow_costs)

    for seen in (fast, slow):
        assert seen and all(seconds > 0 for *_, seconds in seen)
        # Every worker hears both workers (its own gradient comes back too).
        assert {(w, p) for w, p, *_ in seen} == {("w0", "w0"), ("w0", "w1"), ("w1", "w0"), ("w1", "w1")}
    # At least the uplink transfer plus the latency.
    for _, _, nbytes, seconds in slow:
        assert seconds >= nbytes / 50_000.0 + CHEAP.latency_s - 1e-9
    assert statistics.median(s for *_, s in slow) > 10 * statistics.median(s for *_, s in fast)


def test_transits_are_deterministic(streams):
    assert _arrivals(streams, CHEAP) == _arrivals(streams, CHEAP)
