"""Simulated-clock runner: exact record accounting, determinism, waiting vs window batching,
buffer policies, transfer time (uplinks, per-host downlinks), a server role (ASP), the oracle bound, the training driver's rules (wanted batch
size, step guard, prequential scores), and a 10-device ScaDLES comparison."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from edgestream.streams.records import RecordBatch
from edgestream.trainers import strategies
from edgestream.trainers.simclock import (
    HETEROGENEOUS_SLOWDOWNS,
    CostModel,
    DeviceBacklog,
    Mode,
    RunConfig,
    RunReport,
    StreamInjection,
    StreamSet,
    benchmark_comparison,
    compare,
    default_modes,
    markdown_table,
    oracle,
    run,
    scadles_rates,
)
from edgestream.trainers.strategies.asp import ASPServer, ASPWorker
from edgestream.trainers.strategies.bsp import BSPStrategy

FAST = RunConfig(model="mlp", lr=0.5, target_accuracy=None, time_budget_s=20.0)
"""No target: runs last the whole budget (20 simulated seconds)."""
CHEAP = CostModel(compute_base_s=0.01, compute_per_record_s=0.001, latency_s=0.001)


@pytest.fixture(scope="module")
def two_streams() -> StreamSet:
    """A fast (100/s) and a slow (10/s) device over digits shards."""
    return StreamSet.from_fleet("digits", [100.0, 10.0], seed=3)


def _fixed(name: str = "fixed", **kw) -> Mode:
    return Mode(name, "bsp", batcher="fixed", **kw)


def _window(name: str = "window", **kw) -> Mode:
    return Mode(name, "bsp", batcher="window", **kw)


def _assert_accounting(report: RunReport) -> None:
    for device in report.devices:
        assert device.arrived == device.trained + device.dropped + device.dead_lettered + device.waiting, device
        assert device.arrived > 0 and device.max_depth >= device.p99_depth


# -- the pure backlog ------------------------------------------------------------------------


def _chunk(start: int, n: int) -> RecordBatch:
    return RecordBatch(
        device="d",
        seq=np.arange(start, start + n, dtype=np.uint64),
        event_time=np.zeros(n),
        features=np.zeros((n, 4), dtype=np.float32),
        labels=np.zeros(n, dtype=np.int32),
    )


def _seqs(batches) -> list[int]:
    return [int(s) for batch in batches for s in batch.records.seq]


def test_fixed_backlog_hands_out_exactly_one_batch_per_take():
    backlog = DeviceBacklog("d", _fixed(batch_size=8))
    backlog.arrive([_chunk(0, 20)], now=0.1)

    # BatchQueue's fixed rule: exactly the oldest batch, whatever the limit.
    (first,), (second,) = backlog.take(1), backlog.take(256)
    assert backlog.in_step == 16 and backlog.waiting == 20
    backlog.settle([first, second])

    assert (first.size, second.size) == (8, 8)
    assert _seqs([second]) == list(range(8, 16))
    assert not backlog.has_batch() and backlog.waiting == 4 and backlog.trained == 16


def test_window_backlog_takes_every_ready_record_up_to_max_batch_and_keeps_the_rest():
    backlog = DeviceBacklog("d", _window(window_s=1.0, max_batch=16))
    backlog.arrive([_chunk(0, 12)], now=0.5)
    backlog.close_windows(1.0)
    backlog.arrive([_chunk(12, 12)], now=1.5)
    backlog.close_windows(2.0)

    batches = backlog.take(16)
    backlog.settle(batches)

    assert _seqs(batches) == list(range(16))
    assert backlog.waiting == 8 and backlog.has_batch()
    assert backlog.arrived == backlog.trained + backlog.dropped + backlog.waiting


def test_a_rejected_steps_records_are_dead_lettered_not_trained():
    backlog = DeviceBacklog("d", _window(window_s=1.0, max_batch=16))
    backlog.arrive([_chunk(0, 12)], now=0.5)
    backlog.close_windows(1.0)

    backlog.settle(backlog.take(5), dead_lettered=True)

    assert (backlog.dead_lettered, backlog.trained, backlog.waiting) == (5, 0, 7)
    assert backlog.arrived == backlog.trained + backlog.dropped + backlog.dead_lettered + backlog.waiting


def test_truncating_backlog_never_lets_more_than_capacity_wait():
    backlog = DeviceBacklog(
        "d", _fixed(batch_size=10, buffer_policy="truncate", buffer_capacity=25)
    )
    for tick in range(10):
        backlog.arrive([_chunk(tick * 7, 7)], now=tick * 0.1)
        assert backlog.waiting <= 25

    assert backlog.dropped == 70 - backlog.waiting and backlog.trained == 0
    assert backlog.max_depth <= 25


def test_a_fixed_batch_larger_than_the_capacity_is_refused():
    with pytest.raises(ValueError, match="never fill"):
        _fixed(batch_size=64, buffer_policy="truncate", buffer_capacity=32)


# -- runs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode",
    [
        _fixed(batch_size=20),
        _fixed(batch_size=20, buffer_policy="truncate", buffer_capacity=60),
        _window(max_batch=16, buffer_policy="truncate"),
        _window(max_batch=16, codec="topk", codec_params={"ratio": 0.1}),
    ],
    ids=["fixed-persist", "fixed-truncate", "window-truncate", "window-topk"],
)
def test_every_arrived_record_is_trained_dropped_or_still_waiting(two_streams, mode):
    report = run(mode, two_streams, CHEAP, FAST)

    _assert_accounting(report)
    assert report.steps > 0 and report.sim_time_s == FAST.time_budget_s
    json.dumps(dataclasses.asdict(report))  # JSON-able as promised


def test_the_same_inputs_give_an_identical_report():
    # Non-IID shares, a stateful codec and a stateful injection hook: all must replay.
    streams = StreamSet.from_fleet(
        "digits", [40.0, 20.0, 30.0], partition="classes", classes_per_device=4, seed=5
    )
    mode = _window(
        codec="topk",
        codec_params={"ratio": 0.1},
        inject=StreamInjection.from_streams(streams, alpha=0.3, beta=0.25),
    )
    config = dataclasses.replace(FAST, time_budget_s=8.0)

    first = run(mode, streams, CHEAP, config)
    second = run(mode, streams, CHEAP, config)

    assert dataclasses.asdict(first) == dataclasses.asdict(second)
    assert sum(d.injected for d in first.devices) > 0


def test_bsp_waits_for_the_slowest_stream_to_fill_its_fixed_batch(two_streams):
    report = run(_fixed(batch_size=20), two_streams, CostModel.zero(), FAST)

    slow = report.devices[1]
    # Zero compute: a step happens exactly when every device has 20 more records.
    assert report.steps == min(d.arrived // 20 for d in report.devices) == slow.arrived // 20
    assert report.steps / FAST.time_budget_s == pytest.approx(10.0 / 20, abs=0.1)  # ~0.5 steps/s
    assert report.devices[0].waiting > 1000  # the fast stream's excess persists meanwhile


def test_window_batching_steps_every_window_whatever_the_slow_stream(two_streams):
    report = run(_window(window_s=1.0), two_streams, CostModel.zero(), FAST)

    assert report.steps == int(FAST.time_budget_s / 1.0)
    assert all(d.waiting == 0 for d in report.devices)  # max_batch 256 > 100 per window


def test_truncation_bounds_the_backlog_that_persistence_lets_grow_under_bsp(two_streams):
    persist = run(_fixed(batch_size=20), two_streams, CHEAP, FAST)
    truncate = run(
        _fixed(batch_size=20, buffer_policy="truncate", buffer_capacity=100),
        two_streams,
        CHEAP,
        FAST,
    )

    assert persist.devices[0].max_depth > 1000 and persist.devices[0].dropped == 0
    assert all(d.max_depth <= 100 and d.p99_depth <= 100 for d in truncate.devices)
    assert truncate.devices[0].dropped > 1000
    assert truncate.steps == persist.steps  # the slow stream paces both; nothing it sent is lost


def test_lower_bandwidth_makes_the_same_run_slower(two_streams):
    mode = _window(window_s=0.5)
    fast_link = run(mode, two_streams, CHEAP, FAST)
    slow_link = run(
        mode, two_streams, dataclasses.replace(CHEAP, bandwidth_bytes_per_s=20_000.0), FAST
    )

    # One MLP gradient is ~19 kB: about one second per message on a 20 kB/s uplink.
    per_message = fast_link.bytes_sent / fast_link.gradient_messages
    assert 15_000 < per_message < 25_000
    assert slow_link.steps < fast_link.steps / 1.5
    assert slow_link.timeline[-1][2] < fast_link.timeline[-1][2]


def test_per_host_links_make_a_slow_hosts_downloads_cost_time(two_streams):
    mode = _window(window_s=0.5)
    config = dataclasses.replace(FAST, time_budget_s=10.0)
    free = run(mode, two_streams, CHEAP, config)
    equal = run(mode, two_streams, dataclasses.replace(CHEAP, link_bandwidths_bytes_per_s=(12.5e6, 12.5e6)), config)
    # Host 1 uploads its ~19 kB gradient fast enough, but every step it must download both
    # gradients (its own too) over 40 kB/s: about one second per step.
    slow = run(mode, two_streams, dataclasses.replace(CHEAP, link_bandwidths_bytes_per_s=(12.5e6, 40e3)), config)

    assert free.steps - 1 <= equal.steps <= free.steps  # 100 Mbit/s downloads: ~3 ms a step
    assert slow.steps < equal.steps / 1.5
    _assert_accounting(slow)
    with pytest.raises(ValueError, match="bandwidth"):
        CostModel(link_bandwidths_bytes_per_s=(1e6, 0.0))


def test_a_link_change_applies_from_its_time_on(two_streams):
    costs = CostModel(link_bandwidths_bytes_per_s=(1e6, 2e5), link_changes=((5.0, 1, 1e4), (8.0, 1, 4e5)))
    assert costs.link_bandwidth(1) == 2e5  # no time: the static link
    assert [costs.link_bandwidth(1, t) for t in (0.0, 4.99, 5.0, 7.0, 8.0, 100.0)] == [2e5, 2e5, 1e4, 1e4, 4e5, 4e5]
    assert costs.link_bandwidth(0, 6.0) == 1e6 and costs.link_bandwidth(None, 6.0) == costs.bandwidth_bytes_per_s
    assert costs.transfer_s(1000, 1, 6.0) == pytest.approx(0.1)
    # Host 1's link drops to 10 kB/s at t = 3 s: its ~19 kB gradients and downloads then
    # take seconds, so the BSP job takes fewer steps than with the link kept.
    mode = _window(window_s=0.5)
    config = dataclasses.replace(FAST, time_budget_s=8.0)
    kept = run(mode, two_streams, dataclasses.replace(CHEAP, link_bandwidths_bytes_per_s=(12.5e6, 12.5e6)), config)
    dropped = run(mode, two_streams, dataclasses.replace(CHEAP, link_bandwidths_bytes_per_s=(12.5e6, 12.5e6),
                                                         link_changes=((3.0, 1, 1e4),)), config)
    assert [e for e in dropped.timeline if e[0] < 3.0] == [e for e in kept.timeline if e[0] < 3.0]  # same before
    assert dropped.steps < kept.steps / 1.5
    _assert_accounting(dropped)
    with pytest.raises(ValueError, match="bandwidth"):
        CostModel(link_changes=((1.0, 0, 0.0),))
    with pytest.raises(ValueError, match="link_changes"):
        CostModel(link_changes=((-1.0, 0, 1e6),))


# -- a strategy with a server role (ASP) -------------------------------------------------------

ASP = Mode("asp", "asp", {"max_staleness": 4}, batcher="fixed", batch_size=20, lr=0.05)
"""ASP with a staleness bound; the server applies every 20-record gradient at lr 0.05."""


def test_asp_runs_a_server_whose_model_is_evaluated_and_reaches_a_modest_accuracy(two_streams):
    report = run(ASP, two_streams, CHEAP, FAST)

    assert report.evaluated == "server" and report.server is not None
    applied = report.server["counters"]["applied"]
    # The timeline and ``steps`` follow the server's model: one version per applied gradient.
    assert report.steps == applied == report.timeline[-1][2] > 20
    assert report.final_accuracy > 0.7
    # Workers never wait for each other: every full batch of each device becomes a gradient.
    assert report.gradient_messages == report.local_steps
    assert report.local_steps >= sum(d.arrived // 20 for d in report.devices) - 2
    assert report.bytes_sent > report.gradient_messages * 15_000  # gradients + model snapshots
    assert report.rejected_messages == 0
    _assert_accounting(report)


def test_asp_records_the_staleness_of_every_applied_gradient(two_streams):
    report = run(ASP, two_streams, CHEAP, FAST)

    staleness = report.server["staleness"]
    counters = report.server["counters"]
    assert staleness["count"] == counters["applied"]
    assert staleness["count"] + counters.get("rejected_stale", 0) == report.gradient_messages
    # The fast device's gradients overtake the slow one's: some arrive on an older version.
    assert 0 < report.mean_staleness == pytest.approx(staleness["mean"])
    assert report.max_staleness == staleness["max"] <= 4


def test_asp_staleness_bound_rejects_stale_gradients_of_a_slow_worker(two_streams):
    # Worker 1 computes 20x slower: many updates land on the server while it computes.
    costs = dataclasses.replace(CHEAP, slowdowns=(1, 20))
    unbounded = run(dataclasses.replace(ASP, strategy_params={}), two_streams, costs, FAST)
    bounded = run(dataclasses.replace(ASP, strategy_params={"max_staleness": 1}), two_streams, costs, FAST)

    assert unbounded.max_staleness > 1 and "rejected_stale" not in unbounded.server["counters"]
    assert bounded.max_staleness <= 1 and bounded.server["counters"]["rejected_stale"] > 0
    assert bounded.server["counters"]["applied"] + bounded.server["counters"]["rejected_stale"] == (
        bounded.gradient_messages
    )


def test_the_servers_messages_take_the_modelled_transfer_time(two_streams):
    config = dataclasses.replace(FAST, time_budget_s=10.0)
    near = run(ASP, two_streams, CHEAP, config)
    far = run(ASP, two_streams, dataclasses.replace(CHEAP, latency_s=0.3), config)

    # Gradients and snapshots each take 0.3 s more: a worker's model is older when its
    # gradient lands, so the same updates are staler.
    assert far.mean_staleness > near.mean_staleness + 0.5
    assert far.timeline[0][2] < near.timeline[0][2]  # fewer updates by the first evaluation


def test_a_run_with_a_server_is_deterministic(two_streams):
    config = dataclasses.replace(FAST, time_budget_s=6.0)
    costs = dataclasses.replace(CHEAP, slowdowns=(1, 3), link_bandwidths_bytes_per_s=(1e6, 2e5))

    first, second = (run(ASP, two_streams, costs, config) for _ in range(2))

    assert dataclasses.asdict(first) == dataclasses.asdict(second)
    json.dumps(dataclasses.asdict(first))


class _BlindServer(ASPServer):
    """An ASP server that says it holds no model worth evaluating."""

    evaluates_model = False


_BLIND = "test-simclock-asp-blind"
if _BLIND not in strategies.names():
    strategies.register(_BLIND, builds=(ASPWorker, _BlindServer))(
        lambda ctx, **kw: _BlindServer(ctx, **kw) if ctx.role == "server" else ASPWorker(ctx)
    )


def test_a_server_without_a_model_worth_evaluating_leaves_evaluation_to_worker_0(two_streams):
    report = run(dataclasses.replace(ASP, strategy=_BLIND), two_streams, CHEAP, dataclasses.replace(FAST, time_budget_s=5.0))

    assert report.evaluated == "w0" and report.server is not None
    assert report.steps == report.timeline[-1][2] > 0  # w0 adopted the server's snapshots


def test_min_time_keeps_a_run_going_after_its_target(two_streams):
    config = RunConfig(model="mlp", lr=0.5, target_accuracy=0.5, time_budget_s=30.0, min_time_s=12.0)

    early = run(_window(), two_streams, CHEAP, dataclasses.replace(config, min_time_s=0.0))
    late = run(_window(), two_streams, CHEAP, config)

    assert early.stopped == late.stopped == "target" and early.tta_s == late.tta_s
    assert early.sim_time_s < 12.0 <= late.sim_time_s < 13.0
    assert late.timeline[: len(early.timeline)] == early.timeline
    with pytest.raises(ValueError, match="min_time_s"):
        RunConfig(time_budget_s=10.0, min_time_s=11.0)


# -- the training driver's rules ------------------------------------------------------------------


class _Bsp16(BSPStrategy):
    """BSP that asks for at most 16 records per local step (dynamic batching's hook)."""

    name = "test-simclock-bsp16"

    def batch_size_wanted(self) -> int | None:
        return 16


if _Bsp16.name not in strategies.names():
    strategies.register(_Bsp16.name)(_Bsp16)


def test_a_strategys_wanted_batch_size_caps_every_step(two_streams):
    config = dataclasses.replace(FAST, time_budget_s=10.0)
    plain = run(_window(window_s=1.0), two_streams, CostModel.zero(), config)
    capped = run(Mode("bsp16", _Bsp16.name, batcher="window", window_s=1.0), two_streams, CostModel.zero(), config)

    # One step per window either way (the slow stream paces BSP); the plain one takes each
    # window's ~100 fast records, the capped one 16 of them (max_batch is 256).
    assert capped.steps == plain.steps == 10
    fast_plain, fast_capped = plain.devices[0], capped.devices[0]
    assert fast_capped.trained <= 16 * (capped.steps + 1) < fast_plain.trained
    assert fast_capped.waiting > 500 and fast_plain.waiting == 0
    _assert_accounting(capped)


class _Poison:
    """Inject hook: one feature set to ``value`` in the batches number ``calls`` (0-based;
    None: all) of one worker."""

    def __init__(self, worker: int, calls: set[int] | None = None, value: float = np.nan) -> None:
        self.worker = worker
        self.calls = calls
        self.value = value
        self.seen = 0

    def __call__(self, worker_index: int, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if worker_index != self.worker:
            return x, y
        call, self.seen = self.seen, self.seen + 1
        if self.calls is None or call in self.calls:
            x = x.copy()
            x[0, 0] = self.value
        return x, y


def test_a_rejected_step_is_counted_dead_lettered_and_never_moves_a_model(two_streams):
    config = dataclasses.replace(FAST, time_budget_s=5.0)

    report = run(_window(window_s=0.5, inject=_Poison(0)), two_streams, CHEAP, config)

    w0, w1 = report.devices
    # NaN features: the trainer refuses the batch, the driver rejects the step.
    assert report.rejected_steps > 1 and set(report.rejected_by_reason) == {"bad_batch"}
    assert w0.trained == 0 and w0.dead_lettered > 0 and w0.prequential_accuracy == 0.0
    # w0 published nothing, so BSP never completed a step: only w1's first gradient went out.
    assert report.local_steps == report.gradient_messages == 1
    assert report.steps == 0 and {v for _, _, v in report.timeline} == {0}
    assert len({a for _, a, _ in report.timeline}) == 1  # the initial model throughout
    assert w1.trained > 0 and w1.dead_lettered == 0
    _assert_accounting(report)


def test_after_a_rejected_step_the_worker_trains_on_its_next_batch(two_streams):
    config = dataclasses.replace(FAST, time_budget_s=5.0)
    clean = run(_window(window_s=0.5), two_streams, CHEAP, config)

    # A finite but huge feature: a gradient far above the step guard's norm bound.
    report = run(_window(window_s=0.5, inject=_Poison(0, {2}, 1.0e6)), two_streams, CHEAP, config)

    assert report.rejected_steps == 1 and report.rejected_by_reason == {"gradient_norm": 1}
    assert report.devices[0].dead_lettered > 0 and report.devices[1].dead_lettered == 0
    assert report.steps >= clean.steps - 1 > 0
    assert [d.arrived for d in report.devices] == [d.arrived for d in clean.devices]
    _assert_accounting(report)


def test_prequential_scores_are_reported_per_worker_and_device(two_streams):
    report = run(_window(max_batch=16), two_streams, CHEAP, dataclasses.replace(FAST, time_budget_s=8.0))

    assert 0.0 < report.prequential_accuracy <= 1.0
    assert 0.0 < report.prequential_recent_accuracy <= 1.0
    assert all(0.0 < d.prequential_accuracy <= 1.0 for d in report.devices)
    # One device per worker: worker 0's score is device 0's.
    assert report.prequential_accuracy == pytest.approx(report.devices[0].prequential_accuracy)


def test_oracle_is_a_lower_bound_on_time_to_accuracy():
    streams = StreamSet.from_fleet("digits", [60.0, 30.0, 15.0], seed=1)
    config = RunConfig(model="mlp", lr=0.5, target_accuracy=0.85, time_budget_s=120.0)
    costs = CostModel(slowdowns=(1, 2, 4))
    same_rule = {"reference_batch": 64 * 3}  # the oracle's LR scaling (oracle_mode)
    modes = [
        _fixed(batch_size=32, strategy_params=same_rule),
        _window(window_s=1.0, strategy_params=same_rule),
        _window("window-2s", window_s=2.0, strategy_params=same_rule),
    ]

    bound, *reports = compare(modes, streams, costs, config)

    assert bound.mode == "oracle" and bound.tta_s is not None
    for report in reports:
        assert report.tta_s is not None, report.mode
        assert bound.tta_s <= report.tta_s, report.mode


def test_oracle_is_the_zero_cost_run_of_its_mode(two_streams):
    mode = _fixed(batch_size=20)
    config = dataclasses.replace(FAST, time_budget_s=5.0)

    report = oracle(two_streams, config, mode=mode)

    assert report.mode == "oracle"
    zero_cost = run(dataclasses.replace(mode, name="oracle"), two_streams, CostModel.zero(), config)
    assert dataclasses.asdict(report) == dataclasses.asdict(zero_cost)


def test_explicit_per_device_arrays_stream_only_their_own_shard(digits):
    shards = digits.shards(2)
    streams = StreamSet.from_arrays(shards, (digits.x_test, digits.y_test), [50.0, 50.0])

    first, second = streams.simulators()
    (batch,) = first.step(0.0, 1.0, 0.0)

    own = {row.tobytes() for row in shards[0][0]}
    assert all(row.tobytes() in own for row in batch.features)
    assert streams.data.num_classes == 10 and len(streams.data.heldout) == len(digits.y_test)
    assert second.device == "dev01"


def test_benchmark_comparison_returns_json_rows_and_skips_modes_it_cannot_simulate():
    rows = benchmark_comparison(modes=["bsp", "ddp"], budget_s=3.0, eval_every_s=1.0, lr=0.5)

    assert [row["mode"] for row in rows] == ["oracle", "bsp"]
    assert all(len(row["max_backlog"]) == 10 == len(row["p99_backlog"]) for row in rows)
    json.dumps(rows)


def test_benchmark_comparison_streams_at_the_given_rates_times_scale():
    rates = [10.0, 20.0, 30.0, 40.0]
    rows = benchmark_comparison(modes=["bsp"], budget_s=2.0, eval_every_s=1.0, rates=rates, scale=2.0)

    for row in rows:
        assert [d["rate_hz"] for d in row["devices"]] == [20.0, 40.0, 60.0, 80.0]
    with pytest.raises(ValueError, match="rates must be positive"):
        benchmark_comparison(modes=["bsp"], rates=[10.0, 0.0])


# -- the 10-device ScaDLES comparison (needs trainers/strategies/scadles.py) ---------------------


@pytest.fixture(scope="module")
def scadles_comparison() -> list[RunReport]:
    """Digits, IID, the ten ScaDLES rates (scale 1), slowdowns 1 1 1 2 2 2 4 4 8 8, 90 % target.

    The injection mode is left out here: with IID shares every device owns every class,
    so it would repeat scadles+compress (it is exercised on non-IID shares below).
    """
    streams = StreamSet.from_fleet("digits", scadles_rates(1.0), seed=0, message_interval_s=0.2)
    costs = CostModel(slowdowns=HETEROGENEOUS_SLOWDOWNS)
    config = RunConfig(model="mlp", lr=0.5, target_accuracy=0.9, time_budget_s=240.0)
    return compare(default_modes(streams)[:3], streams, costs, config)


def test_ten_device_comparison_bsp_is_slower_to_target_than_window_batching(scadles_comparison):
    by_mode = {r.mode: r for r in scadles_comparison}
    assert list(by_mode) == ["oracle", "bsp", "scadles", "scadles+compress"]
    for report in scadles_comparison:
        assert report.tta_s is not None, report.mode
        _assert_accounting(report)
        assert report.tta_s >= by_mode["oracle"].tta_s
    assert by_mode["bsp"].tta_s > 1.5 * by_mode["scadles"].tta_s
    # The waiting streamer's fast devices pile up records; window batching keeps up.
    assert max(d.max_depth for d in by_mode["bsp"].devices) > 5 * max(
        d.max_depth for d in by_mode["scadles"].devices
    )


def test_ten_device_comparison_table_has_one_row_per_mode(scadles_comparison):
    table = markdown_table(scadles_comparison)

    lines = table.splitlines()
    assert len(lines) == 2 + len(scadles_comparison)
    assert lines[2].startswith("| oracle | ") and "| 1.00 |" in lines[2]
    assert all(f"| {r.mode} |" in table for r in scadles_comparison)


def test_adaptive_compression_sends_fewer_bytes_and_reports_its_fraction(scadles_comparison):
    by_mode = {r.mode: r for r in scadles_comparison}
    dense, adaptive = by_mode["scadles"], by_mode["scadles+compress"]

    assert dense.compressed_fraction == 0.0 and dense.compressed_messages == 0
    assert 0.0 < adaptive.compressed_fraction < 1.0
    assert (
        adaptive.bytes_sent / adaptive.gradient_messages
        < dense.bytes_sent / dense.gradient_messages
    )


@pytest.mark.parametrize(("delta", "compresses"), [(0.0, False), (10.0, True)])
def test_the_vote_threshold_decides_whether_scadles_compresses(two_streams, delta, compresses):
    mode = Mode(
        "scadles+compress",
        "scadles",
        {
            "reference_batch": 128,
            "adaptive_compression": True,
            "delta": delta,
            "epoch_steps": 2,
            "ratio": 0.1,
        },
        batcher="window",
        codec="topk",
        codec_params={"ratio": 0.1},
    )

    report = run(mode, two_streams, CHEAP, dataclasses.replace(FAST, time_budget_s=10.0))

    assert (report.compressed_fraction > 0.5) is compresses
    assert (report.compressed_messages > 0) is compresses
    _assert_accounting(report)


def test_injection_tops_up_non_iid_batches_without_touching_the_accounting():
    streams = StreamSet.from_fleet(
        "digits", [30.0, 30.0, 30.0], partition="classes", classes_per_device=4, seed=2
    )
    modes = default_modes(streams, alpha=0.5, beta=0.25)
    config = dataclasses.replace(FAST, time_budget_s=6.0)

    plain, injected = (run(m, streams, CHEAP, config) for m in modes[2:4])

    assert all(d.injected == 0 for d in plain.devices)
    assert all(d.injected > 0 for d in injected.devices)
    # Injected samples are extra training data, never counted as arrived or trained records.
    assert [d.arrived for d in plain.devices] == [d.arrived for d in injected.devices]
    _assert_accounting(injected)
    assert not math.isnan(injected.final_accuracy)


def test_the_loss_timeline_has_one_held_out_loss_per_evaluation(two_streams):
    report = run(_fixed(batch_size=20), two_streams, CHEAP, FAST)

    assert [t for t, _ in report.loss_timeline] == [t for t, _, _ in report.timeline]
    losses = [loss for _, loss in report.loss_timeline]
    assert all(math.isfinite(loss) and loss > 0 for loss in losses)
    assert losses[-1] < losses[0]  # it learns


def test_adsp_workers_commit_on_their_timer_while_busy_and_the_server_applies_every_commit(two_streams):
    # The slow device's worker computes 5x longer; both commit every 1 s (period 4 s, C = 4),
    # polled between steps, so both commit about equally often whatever their step counts.
    mode = Mode("adsp", "adsp", {"period_s": 4.0, "commit_rate": 4, "search": False}, batcher="fixed", batch_size=10,
                lr=0.05)
    costs = dataclasses.replace(CHEAP, slowdowns=(1.0, 5.0))
    report = run(mode, two_streams, costs, FAST)

    counters = report.server["counters"]
    commits = [counters.get("commits:w0", 0), counters.get("commits:w1", 0)]
    assert report.evaluated == "server" and report.steps == counters["applied"] == sum(commits)
    assert min(commits) >= 10 and max(commits) - min(commits) <= 0.3 * max(commits)
    assert report.local_steps > report.steps  # several local steps per commit
    assert report.final_accuracy > 0.5
    _assert_accounting(report)


# -- membership: a worker that leaves ------------------------------------------------------


@pytest.mark.parametrize("strategy", ["bsp", "asp", "gossip"])
def test_a_worker_that_leaves_stops_and_the_others_go_on_without_it(strategy):
    streams = StreamSet.from_fleet("digits", (40.0, 40.0, 40.0), seed=0)
    config = RunConfig(time_budget_s=10.0, target_accuracy=None, leaves=((3.0, "w2"),))

    report = run(Mode(strategy, strategy, batch_size=16), streams, None, config)

    starts = {p.name: p.step_starts for p in report.processes if p.name != "server"}
    assert any(t <= 3.0 for t in starts["w2"])
    assert max(starts["w2"]) <= 3.0  # no step after its leave (the one in progress finished)
    for worker in ("w0", "w1"):  # BSP's rounds no longer wait for w2: the live set was updated
        assert sum(t > 5.0 for t in starts[worker]) >= 5, (worker, starts[worker])
    left = next(d for d in report.devices if d.worker == "w2")
    assert left.waiting > 0  # its device's records wait for it, as in Kafka


def test_a_leave_must_name_a_worker_of_the_run():
    streams = StreamSet.from_fleet("digits", (40.0, 40.0), seed=0)
    with pytest.raises(ValueError, match="not a worker of this run"):
        run(Mode("bsp", "bsp"), streams, None, RunConfig(time_budget_s=1.0, leaves=((0.5, "w9"),)))
    with pytest.raises(ValueError, match="time_s >= 0"):
        RunConfig(leaves=((-1.0, "w0"),))
