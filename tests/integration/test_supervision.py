"""Supervision in `edgestream run`: a worker that keeps crashing ends the run with its own
reason after ``run.max_restarts`` restarts (a killed worker restarted once and resuming
from its checkpoint: tests/integration/test_training.py)."""

from __future__ import annotations

import pytest

from edgestream.job.config import load_config
from edgestream.pipeline.run import ProcessFailed, RunContext, run_job
from tests.integration.jobs import quiet, steps_of, wait_until

pytestmark = pytest.mark.integration


def small_job(unique: str, state_dir, *overrides: str):
    """Two devices, two BSP workers, a short stream: the smallest job with a peer to wait for."""
    return load_config(
        overrides=[
            f"job.name=v{unique}",
            f"run.state_dir={state_dir}",
            f"devices.ids=a{unique},b{unique}",
            "devices.count=2",
            "devices.rates_hz=200,150",
            "devices.message_interval_s=0.05",
            "batcher.window_s=0.25",
            "workers.count=2",
            "train.enabled=true",
            "train.strategy=bsp",
            "train.eval_every_s=1",
            "train.checkpoint_every_steps=5",
            "run.duration_s=20",
            "run.drain_timeout_s=60",
            "run.restart_backoff_s=0.2",
            *overrides,
        ],
        env={},
    )


def test_a_crash_loop_ends_the_run_with_the_workers_reason_after_max_restarts(kafka_bootstrap, unique, state_dir):
    cfg = small_job(unique, state_dir, "run.max_restarts=2")
    seen: dict[str, RunContext] = {}

    def break_w1_disk(ctx: RunContext) -> None:
        seen["ctx"] = ctx
        checkpoints = state_dir / "workers" / "w1" / "checkpoints"
        wait_until(lambda: steps_of(ctx, "w1") >= 6 and checkpoints.is_dir(), 60, "w1's first checkpoint")
        # A realistic disk failure that stays: w1's checkpoint directory becomes a regular
        # file. Its next checkpoint write fails, and so does every restart's restore.
        checkpoints.rename(checkpoints.with_name("checkpoints.moved"))
        checkpoints.write_text("not a directory\n")

    with pytest.raises(ProcessFailed) as failed:
        run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=break_w1_disk)

    error = failed.value
    message = str(error)
    assert "\n" not in message
    assert error.name == "w1"
    assert message.startswith("worker w1 crashed (exit 1): CheckpointError: "), message
    assert "Not a directory" in message and "run.max_restarts=2" in message
    w1_deaths = [d for d in error.deaths if d["process"] == "w1"]
    assert len(w1_deaths) == 3  # the first crash and one after each of the 2 restarts
    assert [d["restart_in_s"] for d in w1_deaths] == [pytest.approx(0.2), pytest.approx(0.4), None]
    assert all(d["reason"].startswith("crashed (exit 1): CheckpointError") for d in w1_deaths)
    assert seen["ctx"].restarts == ["w1", "w1"]
    assert all(w.proc.poll() is not None for w in seen["ctx"].workers)  # the run stopped everything
