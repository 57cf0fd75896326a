"""Fixed-period local SGD over the real broker: workers of different speeds take H local
steps each, then average through the gradients log; after every round the replicas are
bitwise identical (the digest of the last averaged round agrees everywhere)."""

from __future__ import annotations

import pytest

from edgestream.pipeline.run import run_job
from tests.integration.jobs import quiet, show, train_job, workers_of

pytestmark = pytest.mark.integration

H = 4
#: Doubled streams in windows of 1/16 s: about three times the steps per second of the
#: jobs' 0.25 s windows, so the run reaches its target in about half the streaming time.
FAST_STEPS = ("devices.rates_hz=480,320,240", "batcher.window_s=0.0625")


def test_localsgd_learns_with_identical_replicas_after_each_round(kafka_bootstrap, unique, state_dir):
    cfg = train_job(unique, state_dir, "train.strategy=localsgd", f"train.strategy_params=period_steps={H}",
                    "workers.slowdown=1,2,4", "train.target_accuracy=0.9", *FAST_STEPS)

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False)
    show(result)

    trained = workers_of(result)
    assert set(trained) == {"w0", "w1", "w2"} and "server" not in result.training
    assert min(t["accuracy"] for t in trained.values()) >= 0.85
    assert result.balanced
    stats = {w: t["strategy_stats"] for w, t in trained.items()}
    rounds = {s["rounds_averaged"] for s in stats.values()}
    assert len(rounds) == 1 and rounds.pop() >= 5  # every replica averaged the same rounds
    assert len({s["round_digest"] for s in stats.values()}) == 1 and stats["w0"]["round_digest"]
    for t in trained.values():
        # H local steps per delta; at most one round's steps since the last average
        assert t["counters"]["local_steps"] - H * t["counters"]["deltas_sent"] in range(H)
        assert t["staleness"]["max"] == 0 and t["staleness"]["count"] == 3 * stats["w0"]["rounds_averaged"]
