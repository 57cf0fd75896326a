"""RunContext.hold_restart / release_restart (fault tests): a dead process's restart waits
past its backoff while held, and happens at the first supervision pass once released.
Fake processes and a fake clock, no broker."""

from __future__ import annotations

import json
from pathlib import Path

import edgestream.pipeline.run as run_module
from edgestream.job.config import load_config
from edgestream.pipeline.run import RunContext


class _Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


class _Proc:
    pids = iter(range(60_000, 70_000))

    def __init__(self) -> None:
        self.pid = next(self.pids)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class _Ready:
    def get(self, name: str, default: float = 0.0, **labels: str) -> float:
        return 1.0 if name == "edgestream_worker_ready" else default


def test_a_held_restart_waits_past_its_backoff_until_released(tmp_path: Path, monkeypatch):
    started: list[str] = []

    def start_worker_process(cfg_path, name, bootstrap, port, log_path):
        started.append(name)
        endpoint = tmp_path / "workers" / name / "endpoint.json"
        endpoint.parent.mkdir(parents=True, exist_ok=True)
        endpoint.write_text(json.dumps({"metrics": f"http://fake/{name}"}))
        return _Proc()

    monkeypatch.setattr(run_module, "start_worker_process", start_worker_process)
    monkeypatch.setattr(run_module, "scrape", lambda url: _Ready())
    monkeypatch.setattr(RunContext, "publish_targets", lambda self: None)
    clock = _Clock()
    cfg = load_config(overrides=["devices.count=2", "workers.count=2", "run.restart_backoff_s=1",
                                 f"run.state_dir={tmp_path}"], env={})
    ctx = RunContext(cfg, "127.0.0.1:9", tmp_path, tmp_path / "job.json", [], clock=clock, started_at=clock.now)
    for name in cfg.worker_names():
        ctx.start(name)
    ctx.supervise()
    assert ctx.all_ready()

    ctx.hold_restart("w1")
    ctx.worker("w1").proc.returncode = -9  # killed
    ctx.supervise()
    assert [d["process"] for d in ctx.deaths] == ["w1"] and not ctx.all_ready()
    clock.now += 60  # far past the backoff: still held
    ctx.supervise()
    assert ctx.restarts == [] and started == ["w0", "w1"]

    ctx.release_restart("w1")
    ctx.supervise()
    assert ctx.restarts == ["w1"] and started == ["w0", "w1", "w1"]
    ctx.supervise()
    assert ctx.all_ready()
