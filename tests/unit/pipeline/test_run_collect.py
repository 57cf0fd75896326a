"""The end of a run: what its processes wrote becomes the result; one that wrote nothing is
named, its devices shown as nothing read, and the run does not crash on it."""

from __future__ import annotations

import json
from pathlib import Path

from edgestream.job.config import load_config
from edgestream.pipeline.run import NOTHING_READ, RunContext, WorkerProc, _collect, prepare_state
from edgestream.pipeline.simulate import SimulationReport


class ExitedProc:
    pid = 4242
    returncode = 1

    def poll(self) -> int:
        return self.returncode


def job(tmp_path: Path):
    return load_config(overrides=[f"run.state_dir={tmp_path / 'state'}", "devices.ids=d0,d1", "devices.count=2",
                                  "workers.count=2", "train.enabled=false"], env={})


def context(cfg, state: Path) -> RunContext:
    ctx = RunContext(cfg, "127.0.0.1:1", state, state / "job.json", [])
    ctx.workers = [WorkerProc(name, ExitedProc(), cfg.devices_of(name), log_path=state / "logs" / f"{name}.log")
                   for name in cfg.worker_names()]
    return ctx


def accounting_row(records: int) -> dict:
    return dict(NOTHING_READ, messages_in=records // 10, records_in=records, consumed=records, batched=records)


def test_a_worker_without_accounting_is_named_and_its_devices_show_nothing_read(tmp_path):
    cfg = job(tmp_path)
    state, _ = prepare_state(cfg)
    w0, w1 = cfg.worker_names()
    (d0,), (d1,) = cfg.devices_of(w0), cfg.devices_of(w1)
    (state / "workers" / w0).mkdir(parents=True)
    (state / "workers" / w0 / "accounting.json").write_text(json.dumps({"worker": w0, "devices": {d0: accounting_row(50)}}))
    report = SimulationReport(records={d0: 50, d1: 30}, garbage={d0: {}, d1: {}})

    result = _collect(cfg, context(cfg, state), state, report, {w0: 0, w1: 1}, 3.0, query_kafka=False)

    assert set(result.missing) == {w1}
    assert result.missing[w1].startswith(f"worker {w1} exited (1) without writing ")
    assert "its figures are not in the tables" in result.missing[w1] and "(log: " in result.missing[w1]
    assert result.accounting[d0]["consumed"] == 50
    assert result.accounting[d1]["records_in"] == 0 and result.accounting[d1]["consumed"] == 0
    assert not result.balanced  # a worker's figures are missing: never called balanced


def test_every_worker_wrote_its_accounting_and_the_run_balances(tmp_path):
    cfg = job(tmp_path)
    state, _ = prepare_state(cfg)
    report = SimulationReport(records={}, garbage={})
    for worker in cfg.worker_names():
        (device,) = cfg.devices_of(worker)
        report.records[device], report.garbage[device] = 40, {}
        (state / "workers" / worker).mkdir(parents=True)
        (state / "workers" / worker / "accounting.json").write_text(
            json.dumps({"worker": worker, "devices": {device: accounting_row(40)}}))

    result = _collect(cfg, context(cfg, state), state, report, {}, 3.0, query_kafka=False)

    assert result.missing == {} and result.balanced


def test_a_new_run_removes_the_previous_summary(tmp_path):
    cfg = job(tmp_path)
    state = cfg.state_path()
    state.mkdir(parents=True)
    (state / "summary.json").write_text('{"outcome": "balanced"}')
    prepare_state(cfg)
    assert not (state / "summary.json").exists()
