"""Service behaviour on the real broker: readiness, SIGTERM, restart (docs/deploy.md)."""

from __future__ import annotations

import json
import time

import pytest

from edgestream.pipeline.kafka_io import end_offsets
from edgestream.pipeline.run import RunContext, run_job
from edgestream.streams import topics
from edgestream.trainers.checkpoint import MODEL_VERSION_KEY
from tests.integration.jobs import (
    newest_checkpoint,
    probe,
    quiet,
    show,
    train_job,
    wait_until,
    worker_endpoint,
    workers_of,
)

pytestmark = pytest.mark.integration

GRACE_S = 15.0


def test_sigterm_checkpoints_leaves_and_the_restart_resumes_ready(kafka_bootstrap, unique, state_dir):
    cfg = train_job(unique, state_dir, "train.strategy=bsp", "train.target_accuracy=0.92",
                    f"service.shutdown_grace_s={GRACE_S}")
    seen: dict = {}

    def stop_and_restart(ctx: RunContext) -> None:
        from edgestream.monitoring.scrape import scrape

        w1 = ctx.worker("w1")
        info = wait_until(lambda: worker_endpoint(state_dir, "w1", w1.proc.pid), 60, "w1's endpoint file")
        ready = wait_until(lambda: (p := probe(info["ready"])) is not None and p[0] == 200 and p, 90, "w1 ready")
        assert all(check["ok"] for check in ready[1]["checks"].values()), ready
        assert set(ready[1]["checks"]) == {"kafka", "restored", "assigned"}
        assert probe(info["health"])[0] == 200
        # Past its first periodic checkpoint (every 10 steps): the one SIGTERM writes is later.
        wait_until(lambda: (s := scrape(w1.metrics_url or info["metrics"])) is not None
                   and s.get("edgestream_steps_total", worker="w1") >= 12, 90, "w1 to take 12 steps")
        started = time.monotonic()
        seen["code"] = ctx.stop_worker("w1", timeout_s=GRACE_S + 10)
        seen["stop_s"] = time.monotonic() - started
        seen["exit"] = json.loads((state_dir / "workers" / "w1" / "exit.json").read_text())
        checkpoint = newest_checkpoint(state_dir, "w1")
        seen["checkpoint"] = (checkpoint.meta[MODEL_VERSION_KEY], checkpoint.meta["steps"])
        # The restart: not ready until its checkpoint is restored and its partitions assigned.
        w = ctx.start_worker("w1", join=False)
        info = wait_until(lambda: worker_endpoint(state_dir, "w1", w.proc.pid), 60, "the restarted w1's endpoint file")
        answers = []

        def ready_again() -> bool:
            p = probe(info["ready"])
            if p is not None:
                answers.append(p)
            return p is not None and p[0] == 200

        wait_until(ready_again, 90, "the restarted w1 ready")
        seen["answers"] = answers

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=stop_and_restart)
    show(result)

    # SIGTERM: a clean exit within the grace period, with a final checkpoint past the periodic ones.
    assert seen["code"] == 0 and seen["exit"]["code"] == 0, seen
    assert seen["stop_s"] < GRACE_S, seen["stop_s"]
    version, steps = seen["checkpoint"]
    assert steps >= 12, seen["checkpoint"]
    # Not ready before the restore (503 with the reason), ready after it, naming the checkpoint.
    answers = seen["answers"]
    assert answers[-1][0] == 200
    assert answers[-1][1]["checks"]["restored"]["detail"] == f"restored checkpoint at model version {version}"
    assert answers[0][0] == 503, answers[0]  # its endpoint answers seconds before it is ready
    for status, body in answers[:-1]:
        assert status == 503 and not all(c["ok"] for c in body["checks"].values()), body
    trained = workers_of(result)
    assert trained["w1"]["restored_from"] == version
    assert result.joined == ["w1"] and result.deaths == []  # a stop on purpose, not a death
    assert len({t["digest"] for t in trained.values()}) == 1  # BSP replicas agree after the restart
    assert result.balanced  # nothing lost or counted twice across the stop
    # Nothing lost on w1's device topic: every message below the end is resolved or still held.
    device = cfg.devices_of("w1")[0]
    topic = topics.sensor_topic(device)
    (end,) = end_offsets(kafka_bootstrap, [topic]).values()
    offsets = trained["w1"]["sensor_offsets"][f"{topic}:0"]
    assert offsets["watermark"] + offsets["open"] == end
