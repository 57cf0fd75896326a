"""Simulated clock, membership beyond planned leaves: joins, crashes the others detect by the
heartbeat timeout, restarts from the last checkpoint (``RunConfig.joins`` / ``crashes`` /
``restarts``, ``member_timeout_s``, ``checkpoint_every_steps``), their report, determinism and
the validation of the schedules.

Three devices at 40 records/s and 16-record batches: about one step per worker every 0.4
simulated seconds, a few tenths of a CPU second per 10-second run."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from edgestream.job.config import TrainSection
from edgestream.streams.records import RecordBatch
from edgestream.trainers import simclock
from edgestream.trainers.simclock import (
    CostModel,
    DeviceBacklog,
    Mode,
    RunConfig,
    RunReport,
    StreamSet,
    processes,
    run,
)

BUDGET_S = 10.0
OTHERS = ("w0", "w1")
ALL = ["w0", "w1", "w2"]


@pytest.fixture(scope="module")
def streams() -> StreamSet:
    return StreamSet.from_fleet("digits", (40.0, 40.0, 40.0), seed=0)


def _config(**kw) -> RunConfig:
    return RunConfig(time_budget_s=BUDGET_S, target_accuracy=None, **kw)


def _mode(strategy: str) -> Mode:
    return Mode(strategy, strategy, batch_size=16)


def _process(report: RunReport, name: str) -> simclock.ProcessReport:
    return next(p for p in report.processes if p.name == name)


def _device(report: RunReport, worker: str) -> simclock.DeviceReport:
    return next(d for d in report.devices if d.worker == worker)


def _starts_in(report: RunReport, name: str, after: float, until: float = math.inf) -> int:
    return sum(after < t <= until for t in _process(report, name).step_starts)


def _assert_invariants(report: RunReport) -> None:
    for device in report.devices:
        assert device.arrived == device.trained + device.dropped + device.dead_lettered + device.waiting, device
    for process in report.processes:
        if process.name != simclock.SERVER_NAME:
            total = process.busy_s + process.blocked_s + process.starved_s + process.absent_s
            assert total == pytest.approx(report.sim_time_s), process.name


# -- joins -------------------------------------------------------------------------------------


def test_a_joiner_is_built_as_one_and_nobody_counts_it_before_its_join(streams):
    drivers = processes(_mode("asp"), streams, _config(joins=((3.0, "w2"),)))

    assert drivers["w2"].strategy.ctx.joining and not drivers["w0"].strategy.ctx.joining
    assert drivers["w2"].strategy.ctx.members == OTHERS  # the initial workers, as assembly builds a joiner
    assert drivers["w0"].strategy.ctx.members == OTHERS
    assert drivers[simclock.SERVER_NAME].strategy.ctx.members == OTHERS
    assert not drivers["w2"].can_train()  # it waits for the model


@pytest.mark.parametrize("strategy", ["bsp", "asp", "gossip"])
def test_a_joiner_enters_at_its_time_gets_the_model_through_the_log_and_trains(streams, strategy):
    report = run(_mode(strategy), streams, None, _config(joins=((3.0, "w2"),)))

    joiner = _process(report, "w2")
    assert report.membership == [(3.0, "join", "w2")]
    assert joiner.step_starts and min(joiner.step_starts) >= 3.0
    assert joiner.local_steps >= 5
    assert joiner.absent_s == pytest.approx(3.0)
    assert sum(joiner.consumed_messages.values()) > 0  # what it trains from came over the log
    for process in report.processes:  # every process, the joiner and the server included, counts it from 3 s
        assert process.membership_log == [(3.0, ALL)], process.name
    for worker in OTHERS:
        assert _starts_in(report, worker, 0.0, 3.0) >= 5  # the job ran without it
    # Its device's records waited for it (in Kafka, live): about 3 s of them when it joined.
    assert _device(report, "w2").max_depth >= 100
    _assert_invariants(report)


def test_a_bsp_joiner_adopts_the_replicas_model_and_steps_with_them(streams):
    report = run(_mode("bsp"), streams, None, _config(joins=((3.0, "w2"),)))

    # The replicas are bitwise identical at every evaluation after the join, the joiner's too:
    # its snapshot came from the coordinator, on the models channel, addressed to it.
    assert [d for t, d in report.consensus_timeline if t > 3.0] == [0.0] * 7
    assert _process(report, "w2").consumed_messages.get("models", 0) >= 1
    # It takes part in every global step after its first: as many steps as the others since then.
    first = min(_process(report, "w2").step_starts)
    assert abs(_starts_in(report, "w0", first) - _starts_in(report, "w2", first)) <= 1


# -- crashes and their detection --------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["bsp", "asp"])
def test_a_crash_stops_the_worker_at_once_and_the_others_go_on_after_its_detection(streams, strategy):
    report = run(_mode(strategy), streams, None, _config(crashes=((3.0, "w2"),), member_timeout_s=2.0))

    assert report.membership == [(3.0, "crash", "w2"), (5.0, "detected", "w2")]
    crashed = _process(report, "w2")
    assert crashed.step_starts and max(crashed.step_starts) < 3.0
    assert crashed.absent_s == pytest.approx(BUDGET_S - 3.0)
    assert crashed.membership_log == []  # it heard nothing more
    for name in [p.name for p in report.processes if p.name != "w2"]:
        # Nobody knew until the heartbeat table's timeout; then the live set lost it.
        assert _process(report, name).membership_log == [(5.0, list(OTHERS))], name
    for worker in OTHERS:
        assert _starts_in(report, worker, 5.0) >= 8, worker  # they keep training
    _assert_invariants(report)


def test_bsp_waits_for_a_crashed_worker_until_its_detection_not_forever(streams):
    report = run(_mode("bsp"), streams, None, _config(crashes=((3.0, "w2"),), member_timeout_s=2.0))

    for worker in OTHERS:
        # At most the round w2 had already contributed to, then nothing until the timeout.
        assert _starts_in(report, worker, 3.0, 5.0) <= 1
        assert _starts_in(report, worker, 5.0) >= 8
    versions = {t: version for t, _, version in report.timeline}
    assert versions[5.0] - versions[3.0] <= 1
    assert versions[BUDGET_S] - versions[5.0] >= 8  # the global steps go on without it


def test_an_asynchronous_job_does_not_wait_for_the_detection(streams):
    report = run(_mode("asp"), streams, None, _config(crashes=((3.0, "w2"),), member_timeout_s=2.0))

    for worker in OTHERS:
        assert _starts_in(report, worker, 3.0, 5.0) >= 4


@pytest.mark.parametrize(("timeout", "crash"), [(1.5, 2.0), (4.0, 2.5), (None, 2.0)])
def test_the_others_learn_a_crash_exactly_member_timeout_s_after_it(streams, timeout, crash):
    kw = {} if timeout is None else {"member_timeout_s": timeout}
    config = _config(crashes=((crash, "w1"),), **kw)
    report = run(_mode("bsp"), streams, None, config)

    detected = crash + config.member_timeout_s
    assert config.member_timeout_s == (6.0 if timeout is None else timeout)
    assert report.membership == [(crash, "crash", "w1"), (detected, "detected", "w1")]
    assert _process(report, "w0").membership_log == [(detected, ["w0", "w2"])]
    assert _starts_in(report, "w0", crash + 0.5, detected) == 0  # BSP waited for it until then


def test_a_crash_loses_the_step_in_progress_and_what_was_still_on_its_uplink(streams):
    # Slow steps and a slow uplink: at 5 s w2 is computing and has gradients queued to send.
    costs = CostModel(compute_base_s=0.3, bandwidth_bytes_per_s=2e4)
    report = run(_mode("asp"), streams, costs, _config(crashes=((5.0, "w2"),), member_timeout_s=2.0))

    crashed = _process(report, "w2")
    assert max(crashed.step_starts) > 5.0 - costs.compute_s(2, 16)  # a step was in progress
    assert crashed.local_steps == len(crashed.step_starts) - 1  # and does not count
    assert crashed.lost_messages > 0
    assert crashed.produced_messages["gradients"] == crashed.local_steps  # its lost step sent nothing
    # The lost step's records were not committed: they wait again (as in Kafka), counted.
    assert _device(report, "w2").replayed == 16
    assert _device(report, "w0").replayed == 0
    # Nothing reaches a crashed process: the server's snapshots after 5 s went to the others only.
    assert crashed.consumed_messages["models"] < _process(report, "w0").consumed_messages["models"]
    _assert_invariants(report)


# -- restarts from a checkpoint ---------------------------------------------------------------------


def _watch_w2(monkeypatch) -> dict[str, list]:
    """Record w2's trainer at every checkpoint it saves, at its crash and when it restarts
    (after its checkpoint is loaded, before it re-reads the log)."""
    seen: dict[str, list] = {"saved": [], "crashed": [], "restored": []}

    def snapshot(sim, worker) -> dict:
        trainer = worker.driver.trainer
        return {"at": sim.now, "version": trainer.version, "local_steps": worker.local_steps,
                "params": trainer.get_parameters()}

    checkpoint, crash, replay = (simclock._Simulation._checkpoint, simclock._Simulation._on_crash,
                                 simclock._Simulation._replay)

    def on_checkpoint(sim, worker):
        before = worker.checkpoints
        checkpoint(sim, worker)
        if worker.name == "w2" and worker.checkpoints > before:
            seen["saved"].append(snapshot(sim, worker))

    def on_crash(sim, worker):
        if worker.name == "w2":
            seen["crashed"].append(snapshot(sim, worker))
        crash(sim, worker)

    def on_replay(sim, worker, position):
        if worker.name == "w2":
            seen["restored"].append(snapshot(sim, worker))
        return replay(sim, worker, position)

    monkeypatch.setattr(simclock._Simulation, "_checkpoint", on_checkpoint)
    monkeypatch.setattr(simclock._Simulation, "_on_crash", on_crash)
    monkeypatch.setattr(simclock._Simulation, "_replay", on_replay)
    return seen


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("strategy", ["bsp", "asp", "gossip"])
def test_a_restarted_worker_resumes_from_its_last_checkpoint(streams, strategy, monkeypatch):
    seen = _watch_w2(monkeypatch)
    config = _config(crashes=((3.0, "w2"),), restarts=((6.0, "w2"),), member_timeout_s=2.0, checkpoint_every_steps=3)
    report = run(_mode(strategy), streams, None, config)

    saved = [s for s in seen["saved"] if s["at"] <= 3.0]
    (crashed,), (restored,) = seen["crashed"], seen["restored"]
    last = saved[-1]
    assert [s["local_steps"] for s in saved] == [3 * i for i in range(len(saved))]  # checkpoint 0, then every 3 steps
    assert crashed["local_steps"] > last["local_steps"]  # it trained after its last checkpoint...
    assert not _same(crashed["params"], last["params"])  # ...and its model moved since
    # The restart loaded the checkpoint: the model (a deep copy, untouched since) and the version.
    assert _same(restored["params"], last["params"])
    assert restored["version"] == last["version"]
    assert restored["local_steps"] == last["local_steps"]

    worker = _process(report, "w2")
    (restore,) = worker.restores
    assert (restore.at_s, restore.checkpoint_at_s) == (6.0, last["at"])
    assert (restore.model_version, restore.local_steps) == (last["version"], last["local_steps"])
    assert restore.lost_steps == crashed["local_steps"] - last["local_steps"]
    assert restore.replayed_records == 16 * restore.lost_steps  # trained after the checkpoint: again
    assert restore.replayed_messages > 0  # the log since the checkpoint, read again
    assert worker.checkpoints == len(seen["saved"])
    assert report.membership == [(3.0, "crash", "w2"), (5.0, "detected", "w2"), (6.0, "restart", "w2")]
    assert worker.membership_log[0] == (6.0, ALL)
    assert _process(report, "w0").membership_log == [(5.0, list(OTHERS)), (6.0, ALL)]
    assert _starts_in(report, "w2", 6.0) >= 5 and worker.local_steps > restore.local_steps  # it trains again
    assert _device(report, "w2").replayed >= restore.replayed_records
    _assert_invariants(report)


def test_a_bsp_worker_restarted_after_its_detection_is_readmitted_with_the_replicas_model(streams):
    config = _config(crashes=((3.0, "w2"),), restarts=((6.0, "w2"),), member_timeout_s=2.0, checkpoint_every_steps=3)
    report = run(_mode("bsp"), streams, None, config)

    # Its checkpoint is behind the job: it re-read the log up to its removal, was readmitted
    # as a joiner and took the coordinator's snapshot, so the replicas agree again.
    assert report.consensus_timeline[-1][1] == 0.0
    assert _process(report, "w2").consumed_messages.get("models", 0) >= 1
    assert _starts_in(report, "w0", 7.0) - _starts_in(report, "w2", 7.0) in (-1, 0, 1)


def test_a_restart_before_the_detection_changes_nobodys_live_set(streams):
    config = _config(crashes=((3.0, "w2"),), restarts=((4.0, "w2"),), member_timeout_s=2.0)
    report = run(_mode("bsp"), streams, None, config)

    assert report.membership == [(3.0, "crash", "w2"), (4.0, "restart", "w2")]  # never detected
    assert _process(report, "w0").membership_log == []
    assert _process(report, "w2").membership_log == [(4.0, ALL)]  # a new process is told its live set
    assert _process(report, "w2").restores[0].checkpoint_at_s == 0.0  # checkpoint 0: its start
    for worker in ALL:
        assert _starts_in(report, worker, 5.0) >= 8, worker


def test_the_records_trained_after_the_checkpoint_are_trained_again_first_in_offset_order(streams, monkeypatch):
    """As a live restart re-reads from the checkpoint's offsets: the records of the steps
    after the checkpoint and of the step the crash lost come back, oldest first, before
    anything newer."""
    trail: list[tuple[str, list[int]]] = []
    requeue, take = DeviceBacklog.requeue, DeviceBacklog.take

    def on_requeue(backlog, steps):
        if backlog.buffer.device == "dev02":
            trail.append(("requeue", [int(s) for batches, _ in steps for b in batches for s in b.records.seq]))
        return requeue(backlog, steps)

    def on_take(backlog, limit):
        batches = take(backlog, limit)
        if backlog.buffer.device == "dev02":
            trail.append(("take", [int(s) for b in batches for s in b.records.seq]))
        return batches

    # The crash comes in the middle of one of w2's steps (runs are equal up to the crash).
    plain = run(_mode("bsp"), streams, None, _config())
    crash_at = next(t for t in _process(plain, "w2").step_starts if t > 3.0) + CostModel().compute_s(2, 16) / 2
    monkeypatch.setattr(DeviceBacklog, "requeue", on_requeue)
    monkeypatch.setattr(DeviceBacklog, "take", on_take)
    config = _config(crashes=((crash_at, "w2"),), restarts=((6.0, "w2"),), member_timeout_s=2.0,
                     checkpoint_every_steps=3)
    report = run(_mode("bsp"), streams, None, config)

    requeues = [i for i, (kind, _) in enumerate(trail) if kind == "requeue"]
    assert len(requeues) == 2  # the lost step's records at the crash, the others' at the restart
    lost, since_checkpoint = trail[requeues[0]][1], trail[requeues[1]][1]
    again = since_checkpoint + lost
    assert again == sorted(again) and len(again) == _device(report, "w2").replayed
    taken_after = [s for kind, seqs in trail[requeues[1] + 1:] if kind == "take" for s in seqs]
    assert taken_after[: len(again)] == again
    taken_before = [s for kind, seqs in trail[: requeues[0]] if kind == "take" for s in seqs]
    assert set(again) <= set(taken_before)  # they had been trained (or were in the lost step) before


# -- the backlog's requeue ----------------------------------------------------------------------------


def _chunk(start: int, n: int) -> RecordBatch:
    return RecordBatch(device="d", seq=np.arange(start, start + n, dtype=np.uint64), event_time=np.zeros(n),
                       features=np.zeros((n, 4), dtype=np.float32), labels=np.zeros(n, dtype=np.int32))


def test_requeue_hands_settled_batches_back_to_the_head_in_order_and_undoes_their_settlement():
    backlog = DeviceBacklog("d", Mode("m", batcher="fixed", batch_size=4))
    backlog.arrive([_chunk(0, 20)], now=0.1)
    first, second, third = backlog.take(1), backlog.take(1), backlog.take(1)
    backlog.settle(first)
    backlog.settle(second, dead_lettered=True)
    backlog.settle(third)

    assert backlog.requeue([(first, False), (second, True)]) == 8

    assert (backlog.trained, backlog.dead_lettered, backlog.replayed, backlog.waiting) == (4, 0, 8, 16)
    assert backlog.arrived == backlog.trained + backlog.dropped + backlog.dead_lettered + backlog.waiting
    order = [int(s) for _ in range(4) for b in backlog.take(1) for s in b.records.seq]
    assert order == [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15, 16, 17, 18, 19]


def test_requeue_under_truncate_keeps_the_capacity_dropping_the_oldest():
    backlog = DeviceBacklog("d", Mode("m", batcher="fixed", batch_size=4, buffer_policy="truncate",
                                      buffer_capacity=8))
    backlog.arrive([_chunk(0, 8)], now=0.1)
    taken = backlog.take(1)
    backlog.settle(taken)
    backlog.arrive([_chunk(8, 4)], now=0.2)

    backlog.requeue([(taken, False)])

    assert backlog.waiting == 8 and backlog.dropped == 4 and backlog.replayed == 4
    assert backlog.arrived == backlog.trained + backlog.dropped + backlog.dead_lettered + backlog.waiting


# -- the report: deterministic and JSON-able ---------------------------------------------------------------


def test_runs_with_joins_crashes_and_restarts_are_deterministic_and_json_able(streams):
    config = _config(joins=((1.0, "w1"),), crashes=((3.0, "w2"), (6.5, "w2")), restarts=((4.0, "w2"), (9.0, "w2")),
                     member_timeout_s=2.0, checkpoint_every_steps=4, evaluate_workers=True)
    costs = CostModel(link_bandwidths_bytes_per_s=(2e5, 2e5, 1e5))  # downlinks: deliveries in flight at a crash

    first, second = (run(_mode("gossip"), streams, costs, config) for _ in range(2))

    assert dataclasses.asdict(first) == dataclasses.asdict(second)
    assert first.to_json() == second.to_json()
    decoded = json.loads(first.to_json())
    assert decoded["membership"] == [[1.0, "join", "w1"], [3.0, "crash", "w2"], [4.0, "restart", "w2"],
                                     [6.5, "crash", "w2"], [8.5, "detected", "w2"], [9.0, "restart", "w2"]]
    assert [r["at_s"] for r in decoded["processes"][2]["restores"]] == [4.0, 9.0]
    assert first.rejected_messages == 0
    _assert_invariants(first)


def test_a_run_without_membership_events_reports_none(streams):
    report = run(_mode("bsp"), streams, None, _config())

    assert report.membership == []
    for process in report.processes:
        assert (process.membership_log, process.checkpoints, process.restores, process.absent_s) == ([], 0, [], 0.0)


# -- validation ---------------------------------------------------------------------------------------


def test_the_defaults_are_the_job_configs():
    train = TrainSection()
    config = RunConfig()

    assert config.member_timeout_s == train.member_timeout_s == simclock.DEFAULT_MEMBER_TIMEOUT_S
    assert config.checkpoint_every_steps == train.checkpoint_every_steps == simclock.DEFAULT_CHECKPOINT_EVERY_STEPS


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"joins": ((-1.0, "w1"),)}, r"RunConfig\.joins: entries are \(time_s >= 0"),
        ({"crashes": ((math.nan, "w1"),)}, r"RunConfig\.crashes: entries are"),
        ({"restarts": ((math.inf, "w1"),)}, r"RunConfig\.restarts: entries are"),
        ({"crashes": ((1.0, ""),)}, r"RunConfig\.crashes: entries are"),
        ({"leaves": ((-0.5, "w1"),)}, r"RunConfig\.leaves: entries are"),
        ({"restarts": ((2.0, "w1"),)}, r"RunConfig\.restarts: 'w1' restarts at 2\.0 s without an earlier crash"),
        ({"crashes": ((2.0, "w1"),), "restarts": ((1.0, "w1"),)}, r"RunConfig\.restarts: 'w1' restarts at 1\.0 s"),
        ({"crashes": ((2.0, "w1"),), "restarts": ((2.0, "w1"),)}, r"RunConfig\.restarts: 'w1' restarts at 2\.0 s"),
        ({"crashes": ((1.0, "w1"), (3.0, "w1")), "restarts": ((4.0, "w1"),)},
         r"RunConfig\.crashes: 'w1' crashes at 3\.0 s while down since its crash at 1\.0 s"),
        ({"crashes": ((1.0, "w1"),), "restarts": ((2.0, "w1"), (3.0, "w1"))},
         r"RunConfig\.restarts: 'w1' restarts at 3\.0 s without an earlier crash"),
        ({"joins": ((1.0, "w1"), (2.0, "w1"))}, r"RunConfig\.joins names 'w1' twice"),
        ({"joins": ((2.0, "w1"),), "crashes": ((1.0, "w1"),)}, r"RunConfig\.crashes: 'w1' at 1\.0 s, not after it joins"),
        ({"joins": ((2.0, "w1"),), "leaves": ((2.0, "w1"),)}, r"RunConfig\.leaves: 'w1' at 2\.0 s, not after it joins"),
        ({"member_timeout_s": 0.0}, r"RunConfig\.member_timeout_s must be a finite number > 0"),
        ({"member_timeout_s": math.inf}, r"RunConfig\.member_timeout_s"),
        ({"checkpoint_every_steps": 0}, r"RunConfig\.checkpoint_every_steps must be an integer >= 1"),
        ({"checkpoint_every_steps": 2.5}, r"RunConfig\.checkpoint_every_steps"),
    ],
)
def test_a_schedule_no_process_can_live_is_refused_naming_its_field(fields, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(**fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"joins": ((1.0, "w9"),)}, r"RunConfig\.joins names 'w9', not a worker of this run \(w0, w1, w2\)"),
        ({"crashes": ((1.0, "server"),)}, r"RunConfig\.crashes names 'server', not a worker of this run"),
        ({"crashes": ((1.0, "w9"),), "restarts": ((2.0, "w9"),)}, r"RunConfig\.crashes names 'w9'"),
        ({"joins": ((1.0, "w0"), (1.0, "w1"), (2.0, "w2"))}, r"RunConfig\.joins names every worker"),
    ],
)
def test_a_schedule_must_name_workers_of_the_run(streams, fields, message):
    with pytest.raises(ValueError, match=message):
        processes(_mode("asp"), streams, _config(**fields))
