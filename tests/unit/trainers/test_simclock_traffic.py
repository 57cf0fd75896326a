"""Simulated-clock runner: point-to-point routing of the ``inbox`` channel, bytes produced
and consumed per process and channel, busy / blocked / starved time and iteration times
per worker, the consensus distance over time, and evaluating every worker's model."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, ClassVar

import pytest

from edgestream.trainers.consensus import consensus_distance
from edgestream.trainers.messages import Outgoing, UpdateMessage
from edgestream.trainers.simclock import (
    POINT_TO_POINT_CHANNELS,
    CostModel,
    Mode,
    ProcessReport,
    RunConfig,
    StreamSet,
    run,
)
from edgestream.trainers.strategies import base
from edgestream.trainers.strategies.base import StrategyContext, SyncStrategy

FAST = RunConfig(model="mlp", lr=0.5, target_accuracy=None, time_budget_s=8.0)
CHEAP = CostModel(compute_base_s=0.01, compute_per_record_s=0.001, latency_s=0.001)
PROBE = "test-simclock-p2p-probe"


class _Probe(SyncStrategy):
    """Trains alone and sends one ``delta`` per step to one peer: the next worker in a ring
    (``target=None``) or always ``target``, on ``channel`` (inbox: point-to-point)."""

    name = PROBE
    role = "worker"
    subscribes: ClassVar[tuple[str, ...]] = ("inbox", "models")

    def __init__(self, ctx: StrategyContext, *, channel: str = "inbox", target: str | None = None) -> None:
        super().__init__(ctx)
        members = sorted(set(ctx.members) | {ctx.worker_id})
        self.to = target or members[(members.index(ctx.worker_id) + 1) % len(members)]
        self.channel = channel
        self.step = 0

    def can_train(self) -> bool:
        return True

    def on_local_step(self, result) -> list[Outgoing]:
        self.trainer.apply_gradient(result.gradients)
        self.step += 1
        if self.to == self.worker_id:
            return []
        msg = UpdateMessage(kind="delta", sender=self.worker_id, step=self.step, base_version=self.step - 1,
                            batch_size=result.batch_size, tensors=result.gradients)
        return [Outgoing(self.channel, msg, to=self.to)]

    def on_message(self, msg: UpdateMessage) -> list[Outgoing]:
        self.counters[f"from:{msg.sender}"] += 1
        return []


@pytest.fixture
def probe(monkeypatch):
    """The probe strategy, registered for one test only (the conformance suite never sees it)."""
    monkeypatch.setitem(base._REGISTRY, PROBE, base._Entry(factory=_Probe, classes={"worker": _Probe}))
    return PROBE


@pytest.fixture(scope="module")
def three_streams() -> StreamSet:
    return StreamSet.from_fleet("digits", [60.0, 40.0, 50.0], seed=4)


def _probe_mode(strategy: str, **params: Any) -> Mode:
    return Mode("probe", strategy, params, batcher="fixed", batch_size=10)


def _by_name(processes: list[ProcessReport]) -> dict[str, ProcessReport]:
    return {p.name: p for p in processes}


def test_inbox_is_a_point_to_point_channel():
    assert "inbox" in POINT_TO_POINT_CHANNELS and "gradients" not in POINT_TO_POINT_CHANNELS


def test_an_inbox_record_is_fetched_by_its_recipient_alone(probe, three_streams):
    report = run(_probe_mode(probe), three_streams, CHEAP, FAST)

    procs = _by_name(report.processes)
    ring = {"w0": "w2", "w1": "w0", "w2": "w1"}  # worker -> the worker that sends to it
    for name, sender in ring.items():
        sent = procs[sender].produced_messages["inbox"]
        got = procs[name].consumed_messages.get("inbox", 0)
        # Everything its predecessor sent, nothing else (at most one still in flight at the end).
        assert sent - 1 <= got <= sent and got > 10
        assert procs[name].consumed_bytes["inbox"] <= procs[sender].produced_bytes["inbox"]
    assert sum(p.produced_bytes.get("inbox", 0) for p in report.processes) == report.bytes_sent
    assert report.rejected_messages == 0


def test_a_broadcast_channel_record_is_fetched_by_every_subscriber_even_if_addressed_to_one(probe, three_streams):
    report = run(_probe_mode(probe, channel="models"), three_streams, CHEAP, FAST)

    produced = sum(p.produced_messages["models"] for p in report.processes)
    for process in report.processes:
        # Every record of the topic, its own and those addressed to the others too.
        assert produced - 3 <= process.consumed_messages["models"] <= produced


def test_a_hosts_downlink_carries_only_its_inbox(probe, three_streams):
    # Every worker sends to w0; w2's host link is slow (its own messages leave slowly too).
    costs = dataclasses.replace(CHEAP, link_bandwidths_bytes_per_s=(12.5e6, 12.5e6, 2e4))
    inbox = run(_probe_mode(probe, target="w0"), three_streams, costs, FAST)
    broadcast = run(_probe_mode(probe, channel="models", target="w0"), three_streams, costs, FAST)

    inbox_procs, broadcast_procs = _by_name(inbox.processes), _by_name(broadcast.processes)
    # On the inbox channel w1 and w2 download nothing; w0 everything sent to it that left.
    assert inbox_procs["w2"].consumed_messages == {} and inbox_procs["w1"].consumed_messages == {}
    w1_sent, w2_sent = (inbox_procs[w].produced_messages["inbox"] for w in ("w1", "w2"))
    assert w1_sent - 1 < inbox_procs["w0"].consumed_messages["inbox"] <= w1_sent + w2_sent
    # Over the models topic w2 fetches every record of it, over its slow link.
    appended = broadcast_procs["w0"].consumed_messages["models"]
    assert broadcast_procs["w2"].consumed_messages["models"] == broadcast_procs["w1"].consumed_messages["models"] == (
        appended)
    assert broadcast_procs["w2"].consumed_bytes["models"] == broadcast_procs["w0"].consumed_bytes["models"] > 0


def test_bsp_workers_each_consume_every_gradient(three_streams):
    mode = Mode("bsp", "bsp", batcher="fixed", batch_size=10)
    report = run(mode, three_streams, CHEAP, FAST)

    produced = sum(p.produced_messages["gradients"] for p in report.processes)
    assert produced == report.gradient_messages
    for process in report.processes:
        assert produced - 3 <= process.consumed_messages["gradients"] <= produced
        assert process.consumed_bytes["gradients"] >= 2 * process.produced_bytes["gradients"]


def test_gossip_traffic_per_node_scales_with_its_degree_not_with_the_job():
    per_step = {}
    for n in (4, 8):
        streams = StreamSet.from_fleet("digits", [40.0] * n, seed=1)
        mode = Mode("gossip", "gossip", {"topology": "ring"}, batcher="fixed", batch_size=16)
        report = run(mode, streams, CHEAP, dataclasses.replace(FAST, time_budget_s=4.0))
        steps = sum(p.local_steps for p in report.processes)
        consumed = sum(p.consumed_bytes.get("inbox", 0) for p in report.processes)
        per_step[n] = consumed / steps  # bytes one node downloads per step of the job's nodes
        assert report.rejected_messages == 0
        assert all(set(p.consumed_bytes) <= {"inbox"} for p in report.processes)
    # Two ring neighbours each: the same bytes per node and step at 4 and at 8 nodes.
    assert per_step[8] == pytest.approx(per_step[4], rel=0.15)


def test_busy_blocked_and_starved_time_add_up_to_the_run(three_streams):
    # BSP waits for the slowest stream's fixed batch: the faster workers sit blocked with a
    # batch ready, the slowest one starves for data.
    mode = Mode("bsp", "bsp", batcher="fixed", batch_size=20)
    report = run(mode, three_streams, CHEAP, FAST)

    procs = _by_name(report.processes)
    for p in report.processes:
        assert p.busy_s + p.blocked_s + p.starved_s == pytest.approx(report.sim_time_s)
        assert 0 < p.idle_fraction < 1
        # Each step computes (10 ms + 1 ms x 20) = 30 ms (the last one may be cut by the budget).
        assert p.busy_s == pytest.approx(0.03 * len(p.step_starts), abs=0.031)
        assert len(p.step_starts) == p.local_steps or len(p.step_starts) == p.local_steps + 1
    assert procs["w0"].blocked_s > procs["w1"].blocked_s  # 60/s waits for 40/s
    assert procs["w1"].starved_s > procs["w0"].starved_s


def test_iteration_times_of_window_steps_are_the_window(three_streams):
    mode = Mode("window", "bsp", batcher="window", window_s=0.5)
    report = run(mode, three_streams, CostModel.zero(), FAST)

    for p in report.processes:
        assert p.iteration_time_mean_s == pytest.approx(0.5)
        assert p.iteration_time_cv == pytest.approx(0.0, abs=1e-9)
        assert p.busy_s == 0 and p.blocked_s == 0


def test_identical_bsp_replicas_have_zero_consensus_distance(three_streams):
    report = run(Mode("bsp", "bsp", batcher="fixed", batch_size=10), three_streams, CHEAP, FAST)

    assert len(report.consensus_timeline) == len(report.timeline) > 0
    assert all(d == 0.0 for _, d in report.consensus_timeline)
    assert [t for t, _ in report.consensus_timeline] == [t for t, _, _ in report.timeline]


def test_workers_training_apart_drift_apart(probe, three_streams):
    report = run(_probe_mode(probe), three_streams, CHEAP, FAST)  # nobody applies what it hears

    distances = [d for _, d in report.consensus_timeline]
    assert all(math.isfinite(d) for d in distances)
    assert distances[0] > 0 and distances[-1] > distances[0]


def test_the_consensus_distance_is_the_rms_distance_to_the_average():
    import torch

    models = [{"a": torch.tensor([0.0, 0.0])}, {"a": torch.tensor([2.0, 0.0])}]
    assert consensus_distance(models) == pytest.approx(1.0)


def test_evaluating_every_worker_gives_the_mean_of_their_accuracies(three_streams):
    mode = Mode("gossip", "gossip", {"topology": "ring"}, batcher="fixed", batch_size=10)
    config = dataclasses.replace(FAST, evaluate_workers=True)
    report = run(mode, three_streams, CHEAP, config)

    assert report.evaluated == "workers"
    assert set(report.worker_timelines) == {"w0", "w1", "w2"}
    for i, (t, accuracy, _) in enumerate(report.timeline):
        own = [report.worker_timelines[w][i] for w in ("w0", "w1", "w2")]
        assert all(at == t for at, _ in own)
        assert accuracy == pytest.approx(sum(a for _, a in own) / 3)
    json.dumps(dataclasses.asdict(report))


def test_evaluating_every_worker_leaves_a_servers_job_model_and_bsp_unchanged(three_streams):
    asp = Mode("asp", "asp", {"max_staleness": 4}, batcher="fixed", batch_size=10, lr=0.05)
    bsp = Mode("bsp", "bsp", batcher="fixed", batch_size=10)
    for mode, evaluated in ((asp, "server"), (bsp, "workers")):
        alone = run(mode, three_streams, CHEAP, FAST)
        every = run(mode, three_streams, CHEAP, dataclasses.replace(FAST, evaluate_workers=True))

        assert every.evaluated == evaluated
        assert [(t, v) for t, _, v in every.timeline] == [(t, v) for t, _, v in alone.timeline]
        assert [a for _, a, _ in every.timeline] == pytest.approx([a for _, a, _ in alone.timeline])
        assert every.local_steps == alone.local_steps and every.bytes_sent == alone.bytes_sent


def test_the_report_with_traffic_and_time_is_deterministic(three_streams):
    mode = Mode("gossip", "gossip", {"topology": "ring"}, batcher="fixed", batch_size=10)
    config = dataclasses.replace(FAST, time_budget_s=4.0, evaluate_workers=True)

    first, second = (run(mode, three_streams, CHEAP, config) for _ in range(2))

    assert dataclasses.asdict(first) == dataclasses.asdict(second)
