"""RunContext supervision with fake processes and a fake clock: deaths, backoff, crash loops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import edgestream.pipeline.run as run_module
from edgestream.job.config import load_config
from edgestream.pipeline.run import ProcessFailed, RunContext


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeProc:
    """A child process that runs until ``exit`` is called."""

    pids = iter(range(40_000, 50_000))

    def __init__(self) -> None:
        self.pid = next(self.pids)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def exit(self, code: int) -> None:
        self.returncode = code


class FakeScrape:
    def __init__(self, ready: float) -> None:
        self.ready = ready

    def get(self, name: str, default: float = 0.0, **labels: str) -> float:
        return self.ready if name == "edgestream_worker_ready" else default


@pytest.fixture
def harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A RunContext of two workers whose processes, endpoints and metrics are fakes."""
    started: list[tuple[str, FakeProc]] = []

    def start_worker_process(cfg_path, name, bootstrap, port, log_path):
        proc = FakeProc()
        started.append((name, proc))
        endpoint = tmp_path / "workers" / name / "endpoint.json"
        endpoint.parent.mkdir(parents=True, exist_ok=True)
        endpoint.write_text(json.dumps({"metrics": f"http://fake/{name}/{proc.pid}"}))
        return proc

    monkeypatch.setattr(run_module, "start_worker_process", start_worker_process)
    monkeypatch.setattr(run_module, "scrape", lambda url: FakeScrape(1.0))
    monkeypatch.setattr(RunContext, "publish_targets", lambda self: None)
    clock = FakeClock()
    cfg = load_config(overrides=["devices.count=2", "workers.count=2", "run.max_restarts=2",
                                 "run.restart_backoff_s=1.5", f"run.state_dir={tmp_path}"], env={})
    ctx = RunContext(cfg, "127.0.0.1:9", tmp_path, tmp_path / "job.json", [], clock=clock,
                     started_at=clock.now)
    for name in cfg.worker_names():
        ctx.start(name)
    return ctx, clock, started


def proc_of(ctx: RunContext, name: str) -> FakeProc:
    return ctx.worker(name).proc  # type: ignore[return-value]


def test_processes_become_ready_from_their_endpoint_and_gauge(harness):
    ctx, clock, _ = harness

    ctx.supervise()

    assert ctx.all_ready()
    assert ctx.worker("w0").metrics_url.startswith("http://fake/w0/")
    assert ctx.last_ready_at() == clock.now


def test_a_dead_worker_is_restarted_after_its_backoff_and_counted(harness):
    ctx, clock, started = harness
    ctx.supervise()
    proc_of(ctx, "w1").exit(-9)

    ctx.supervise()  # notices the death; the restart waits for the backoff
    assert ctx.deaths == [{"process": "w1", "code": -9, "reason": "was killed by SIGKILL",
                           "at_s": 0.0, "restart_in_s": 1.5}]
    assert ctx.restarts == [] and not ctx.all_ready()
    clock.now += 1.4
    ctx.supervise()
    assert ctx.restarts == []
    clock.now += 0.1
    ctx.supervise()  # due: started again
    assert ctx.restarts == ["w1"] and [n for n, _ in started] == ["w0", "w1", "w1"]
    ctx.supervise()  # and ready
    assert ctx.all_ready()
    assert "w1: 1/2 restarts, running" in ctx.restarts_line()


def test_the_backoff_doubles_per_restart_and_a_crash_loop_ends_the_run_with_the_reason(harness, tmp_path):
    ctx, clock, _ = harness
    backoffs = []
    with pytest.raises(ProcessFailed) as failed:
        for _ in range(5):
            ctx.supervise()
            w1 = ctx.worker("w1")
            verdict = {"code": 1, "reason": "CheckpointError: disk gone", "pid": w1.proc.pid}
            (tmp_path / "workers" / "w1" / "exit.json").write_text(json.dumps(verdict))
            w1.proc.exit(1)
            ctx.supervise()
            backoffs.append(ctx.deaths[-1]["restart_in_s"])
            clock.now += backoffs[-1]

    assert backoffs == [1.5, 3.0]  # run.restart_backoff_s, doubled for the second restart
    assert ctx.restarts == ["w1", "w1"]  # run.max_restarts=2
    message = str(failed.value)
    assert message.startswith("worker w1 crashed (exit 1): CheckpointError: disk gone; it died 3 time(s) "
                              "and run.max_restarts=2 allows 2 restart(s)")
    assert "\n" not in message and failed.value.name == "w1" and len(failed.value.deaths) == 3


def test_a_stale_exit_file_of_another_incarnation_is_not_the_reason(harness, tmp_path):
    ctx, _, _ = harness
    ctx.supervise()
    stale = {"code": 1, "reason": "CheckpointError: old news", "pid": 1}
    (tmp_path / "workers" / "w0" / "exit.json").write_text(json.dumps(stale))
    proc_of(ctx, "w0").exit(4)

    ctx.supervise()

    assert ctx.deaths[0]["reason"] == "exited with code 4"


def test_a_worker_without_a_usable_checkpoint_is_not_restarted(harness, tmp_path):
    ctx, _, started = harness
    ctx.supervise()
    w0 = ctx.worker("w0")
    reason = "NoUsableCheckpoint: checkpoint /s/w0/checkpoints: none of the 2 checkpoint file(s) is usable (...)"
    (tmp_path / "workers" / "w0" / "exit.json").write_text(json.dumps({"code": 3, "reason": reason,
                                                                       "pid": w0.proc.pid}))
    w0.proc.exit(3)

    with pytest.raises(ProcessFailed) as failed:
        ctx.supervise()

    message = str(failed.value)
    assert message.startswith(f"worker w0 crashed (exit 3): {reason}; not restarted (exit 3: a restart cannot help)")
    assert ctx.cfg.run.max_restarts == 2  # restarts were allowed, yet none is scheduled
    assert ctx.restarts == [] and [n for n, _ in started] == ["w0", "w1"]
    assert ctx.deaths[0]["restart_in_s"] is None


def test_max_restarts_zero_stops_at_the_first_death(harness):
    ctx, _, _ = harness
    ctx.cfg.run.max_restarts = 0
    ctx.supervise()
    proc_of(ctx, "w0").exit(0)

    with pytest.raises(ProcessFailed, match=r"^worker w0 exited \(code 0\) before the run was over; it died 1"):
        ctx.supervise()


def test_a_process_that_never_gets_ready_fails_after_the_ready_timeout(harness, monkeypatch):
    ctx, clock, _ = harness
    monkeypatch.setattr(run_module, "scrape", lambda url: FakeScrape(0.0))
    ctx.supervise()
    clock.now += run_module.READY_TIMEOUT_S + 1

    with pytest.raises(ProcessFailed, match="did not join its topics within 90s"):
        ctx.supervise()


def test_a_worker_restarted_by_a_hook_during_a_supervision_pass_is_not_taken_for_a_death(harness, monkeypatch):
    """A hook's thread stops w1 on purpose and starts it again while the orchestrating thread
    supervises. The pass must not see the stopped process as one that is running again (w1
    no longer in ``left``) before its new process is in ``workers``: it would count the old
    process's exit as a death and start a second w1 beside the hook's."""
    import threading

    ctx, clock, started = harness
    in_start, release = threading.Event(), threading.Event()
    starts = list(started)
    fake_start = run_module.start_worker_process

    def slow_start(*args, **kwargs):
        in_start.set()
        release.wait(timeout=30)  # held until the pass had its chance
        return fake_start(*args, **kwargs)

    monkeypatch.setattr(run_module, "stop_process", lambda proc, timeout_s=20.0: proc.exit(0) or 0)
    assert ctx.stop_worker("w1") == 0
    monkeypatch.setattr(run_module, "start_worker_process", slow_start)
    hook = threading.Thread(target=ctx.start_worker, args=("w1",), kwargs={"join": False})
    hook.start()
    assert in_start.wait(timeout=30)
    clock.now += 10.0
    supervisor = threading.Thread(target=ctx.supervise)
    supervisor.start()
    supervisor.join(timeout=1.0)  # a pass that does not wait for the membership change ends here
    release.set()
    hook.join(timeout=30)
    supervisor.join(timeout=30)
    clock.now += 10.0  # past any restart backoff
    ctx.supervise()

    assert ctx.deaths == [] and ctx.restarts == []
    assert [name for name, _ in started[len(starts):]] == ["w1"]  # the hook's start, and no other
    assert ctx.joined == ["w1"] and ctx.left == []
