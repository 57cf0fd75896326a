"""Synthetic gradients on the real broker: one model in three stages on three worker processes.

One ``cdni`` run of ``conv8`` (BatchNorm) cut after ``block1`` and ``block3``: w0 holds stage 0
and reads every device, w1 the middle stage, w2 the head and the loss. Activations go forward
with their labels and gradients come back over the stages' inbox topics. Mid-run the middle
stage is SIGKILLed; the supervisor restarts it from its checkpoint (a new incarnation), its
neighbours wait or go on, and the pipeline trains again. Then two malformed activations (a
NaN, a label out of range) are produced to its inbox: both are dead-lettered with their
reason and neither reaches a model. The run must learn (the assembled model, from the
stages' final checkpoints, on the held-out set) and account for every record.
"""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch

from edgestream.job.topics import channel_topic
from edgestream.monitoring.scrape import scrape
from edgestream.pipeline.kafka_io import producer
from edgestream.pipeline.run import RunContext, run_job
from edgestream.trainers.messages import UpdateMessage
from edgestream.trainers.wire import encode_update
from tests.integration.jobs import (
    dead_letter_reasons,
    quiet,
    show,
    steps_of,
    train_job,
    wait_until,
    workers_of,
)

pytestmark = pytest.mark.integration

WORKERS = ("w0", "w1", "w2")
CDNI_JOB = (
    "train.strategy=cdni",
    "train.model=conv8",
    "train.model_params=norm=batch",
    "train.stages=block1,block3",
    "batcher.mode=fixed",
    "batcher.batch_size=32",
    "train.max_step_batch=32",
    "train.lr=0.05",
    "train.momentum=0.9",
    "train.checkpoint_every_steps=10",
    "run.duration_s=120",  # a cap: the hook ends streaming once every event happened
    "run.drain_timeout_s=60",
    "run.restart_backoff_s=0.5",
)
#: conv8's activation after block1, per sample (edgestream models).
BLOCK1 = (8, 8, 8)


def bad_activations(job: str) -> list[tuple[str, bytes, list]]:
    """Forward activations in w0's name that w1 must refuse: (reason, value, headers)."""
    marker = struct.pack("<f", 1.2345)  # the encoder refuses a NaN: it is written over this after
    out = []
    for reason, y in (("non_finite", torch.zeros(4)), ("out_of_range", torch.full((4,), 99.0))):
        h = torch.zeros((4, *BLOCK1))
        h.view(-1)[0] = 1.2345
        msg = UpdateMessage(kind="activation", sender="w0", step=10**6, base_version=0, batch_size=4,
                            tensors={"h": h, "y": y}, meta={"dir": "fwd", "inc": 10**3})
        value, headers = encode_update(msg, job=job, to="w1")
        assert value.count(marker) == 1
        if reason == "non_finite":
            value = value.replace(marker, struct.pack("<f", math.nan))
        out.append((reason, value, list(headers.items())))
    return out


def rejected_by(ctx: RunContext, worker: str) -> float:
    w = ctx.worker(worker)
    s = scrape(w.metrics_url, timeout_s=1.0) if w.metrics_url else None
    return -1.0 if s is None else s.get("edgestream_updates_rejected_total", worker=worker)


def test_cdni_three_stages_learn_survive_a_killed_stage_and_dead_letter_bad_activations(
        kafka_bootstrap, unique, state_dir):
    cfg = train_job(unique, state_dir, *CDNI_JOB)
    poison = bad_activations(cfg.job.name)
    seen: dict = {}

    def events(ctx: RunContext) -> None:
        wait_until(lambda: steps_of(ctx, "w2") >= 20, 90, "the top stage to train 20 steps")
        seen["top_steps_at_kill"] = steps_of(ctx, "w2")
        ctx.kill("w1")
        wait_until(lambda: steps_of(ctx, "w1") >= 20, 90, "the middle stage to be restarted and to train again")
        wait_until(lambda: steps_of(ctx, "w2") >= seen["top_steps_at_kill"] + 20, 90,
                   "the top stage to train 20 more steps after the restart")
        prod = producer(kafka_bootstrap)
        try:
            for _reason, value, headers in poison:
                prod.send(channel_topic(cfg.job.name, "inbox", to="w1"), value=value, key=b"w0", headers=headers)
            prod.flush()
        finally:
            prod.close()
        wait_until(lambda: rejected_by(ctx, "w1") >= len(poison), 60, "w1 to refuse the bad activations")
        ctx.stop_streaming()

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=events)
    show(result)
    trained = workers_of(result)
    stats = {name: t["strategy_stats"] for name, t in trained.items()}
    print("cdni evidence:", json.dumps({"assembled": result.assembled, "seen": seen,
                                        "stages": {w: {k: stats[w][k] for k in ("samples", "incarnation",
                                                                                 "counters", "synth_loss")}
                                                   for w in WORKERS}}))

    assert result.balanced
    assert [d["process"] for d in result.deaths] == ["w1"] and result.restarted == ["w1"]
    # The middle stage came back from its checkpoint as a new incarnation.
    assert trained["w1"]["restored_from"] is not None and stats["w1"]["incarnation"] == 1
    # Both bad activations were refused with their reason and dead-lettered; nothing else was.
    assert sorted(dead_letter_reasons(kafka_bootstrap, cfg.job.name)) == sorted(r for r, _, _ in poison)
    assert trained["w1"]["updates_rejected"] == len(poison)
    assert all(trained[w]["updates_rejected"] == 0 for w in ("w0", "w2"))
    # Nothing lost between the stages: no activation was given up, and the head trained on
    # every sample the first stage did (after the restart w1 redoes the activations after its
    # checkpoint, so the head may see some twice).
    assert all(stats[w]["counters"].get("expired", 0) == 0 for w in WORKERS), stats
    assert all(trained[w]["rejected_steps"] == 0 for w in WORKERS), {w: trained[w]["rejected_by_reason"] for w in WORKERS}
    assert stats["w2"]["samples"] >= stats["w0"]["samples"] == trained["w0"]["trained_records"], stats
    # It learned: the stages put together (chance is 0.1), and the head's recent prequential score.
    assert result.assembled is not None and result.assembled["accuracy"] >= 0.6, result.assembled
    assert trained["w2"]["prequential"]["window_accuracy"] >= 0.6
