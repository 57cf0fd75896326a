"""ADSP over the real broker: workers of different speeds commit their local progress to
the server on a timer, the server searches the commit rate; bad deltas are dead-lettered;
a killed worker and a killed server resume from their checkpoints; bad parameters are
refused from the CLI with one line.

Commits are counted three ways and must agree: what each worker says it sent, what the
gradients log holds, and what the server applied.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgestream.job.topics import channel_topic
from edgestream.pipeline.run import RunContext, run_job
from edgestream.trainers import LocalTrainer, build_model
from edgestream.trainers.messages import UpdateMessage
from edgestream.trainers.wire import encode_update
from tests.integration.jobs import (
    dead_letter_reasons,
    published_by_sender,
    quiet,
    send_gradients,
    show,
    steps_of,
    train_job,
    wait_until,
    workers_of,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WORKERS = ("w0", "w1", "w2")
#: Check periods of 4 s, C = 4 to start (one commit a second, at least 0.5 s apart);
#: workers 2x and 4x slower than w0 (workers.slowdown).
ADSP = ("train.strategy=adsp", "train.strategy_params=period_s=4,commit_rate=4,min_interval_s=0.5",
        "workers.slowdown=1,2,4")


def bad_deltas(job: str) -> list[tuple[str, bytes]]:
    """Deltas a faulty peer could send, in w0's name with a far-future commit number (had
    one been applied, every later commit of w0 would be dropped as out of order)."""
    def delta(model) -> bytes:
        tensors = {k: torch.zeros_like(v) for k, v in LocalTrainer(model, lr=0.1).get_parameters().items()}
        msg = UpdateMessage(kind="delta", sender="w0", step=10**6, base_version=0, batch_size=8, tensors=tensors)
        return encode_update(msg, job=job)[0]

    nan = bytearray(delta(build_model("mlp", (64,), 10, seed=0)))
    nan[-4:] = bytes.fromhex("0000c07f")  # the last float32 of the last layer becomes NaN
    return [("non_finite", bytes(nan)), ("shape_mismatch", delta(build_model("mlp", (64,), 10, seed=0, hidden=(32,))))]


def commits_check(bootstrap: str, cfg, result, restarted: tuple[str, ...] = ()) -> dict[str, int]:
    """Every delta in the gradients log was applied by the server once, or dropped as a
    duplicate: a commit number it already had, re-sent by a worker restored from a
    checkpoint older than its last commits (``restarted``; nobody else sends one). Returns
    the log's count per worker."""
    server = result.training["server"]
    counters = server["counters"]
    logged = published_by_sender(bootstrap, channel_topic(cfg.job.name, "gradients"), "delta")
    applied = server["strategy_stats"]["commits_per_worker"]
    duplicates = {w: counters.get(f"duplicates:{w}", 0) for w in WORKERS}
    assert {w: applied.get(w, 0) + duplicates[w] for w in WORKERS} == {w: logged.get(w, 0) for w in WORKERS}
    assert counters["applied"] == sum(applied.values()) == server["staleness"]["count"]
    assert all(duplicates[w] == 0 for w in WORKERS if w not in restarted), duplicates
    return logged


def test_adsp_learns_commits_balance_and_bad_deltas_are_dead_lettered(kafka_bootstrap, unique, state_dir):
    # Real CPU shares too: w0 on the first usable CPU, w1 and w2 sharing the last one.
    usable = sorted(os.sched_getaffinity(0))
    pinned = {"w0": {usable[0]}, "w1": {usable[-1]}, "w2": {usable[-1]}}
    # One 16-record batch per step: w0's 240 records/s make 15 steps/s, w2's 120 make 7.5.
    cfg = train_job(unique, state_dir, *ADSP, "train.target_accuracy=0.9",
                    "batcher.mode=fixed", "batcher.batch_size=16", "train.max_step_batch=16",
                    f"workers.cpus={usable[0]},{usable[-1]},{usable[-1]}")
    poison = bad_deltas(cfg.job.name)
    seen: dict = {}

    def inject(ctx: RunContext) -> None:
        wait_until(lambda: steps_of(ctx, "w0") >= 3, 60, "w0 to train")
        seen["cpus"] = {w: os.sched_getaffinity(ctx.worker(w).proc.pid) for w in WORKERS}
        send_gradients(kafka_bootstrap, cfg.job.name, [value for _reason, value in poison])

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=inject)
    show(result)

    server, trained = result.training["server"], workers_of(result)
    assert seen["cpus"] == pinned  # each worker process runs where workers.cpus put it
    # The run stops at the 0.9 target on the validation split; a worker's model carries its
    # uncommitted local steps and lands lower (0.838 seen once under load); chance is 0.1.
    assert server["accuracy"] >= 0.85 and min(t["accuracy"] for t in trained.values()) >= 0.8
    assert result.balanced
    # Each commit a worker sent is in the log once and was applied once; the bad ones never.
    logged = commits_check(kafka_bootstrap, cfg, result)
    assert {w: trained[w]["counters"]["commits"] for w in WORKERS} == {w: logged[w] for w in WORKERS}
    assert sorted(dead_letter_reasons(kafka_bootstrap, cfg.job.name)) == sorted(r for r, _ in poison)
    assert server["updates_rejected"] == len(poison)
    assert all(t["updates_rejected"] == 0 for t in trained.values())  # workers do not read gradients
    for t in trained.values():
        counters = t["counters"]
        assert counters["committed_local_steps"] == counters["local_steps"] == t["steps"]  # nothing left behind
        assert t["strategy_stats"]["commit_rate"] == server["strategy_stats"]["commit_rate"]  # C reached them
    # Commits are equalised across speeds (no worker commits more than 1.5x another); the
    # faster worker puts more local steps into each.
    assert max(logged.values()) <= 1.5 * min(logged.values())
    per_commit = {w: trained[w]["strategy_stats"]["local_steps_per_commit"] for w in WORKERS}
    assert per_commit["w0"] >= 1.3 * per_commit["w2"], per_commit
    assert server["counters"]["commit_rate_changes"] >= 1  # the search moved C
    assert 0 < server["staleness"]["max"]


def test_adsp_killed_worker_and_killed_server_resume_from_their_checkpoints(kafka_bootstrap, unique, state_dir):
    cfg = train_job(unique, state_dir, *ADSP, "run.restart_backoff_s=3", "run.duration_s=150")
    seen: dict = {}

    def server_version(ctx: RunContext) -> float:
        from edgestream.monitoring.scrape import scrape

        s = scrape(ctx.worker("server").metrics_url) if ctx.worker("server").metrics_url else None
        return s.get("edgestream_model_version", -1.0, worker="server") if s is not None else -1.0

    def events(ctx: RunContext) -> None:
        wait_until(lambda: all(steps_of(ctx, w) >= 12 for w in WORKERS) and server_version(ctx) >= 6, 90,
                   "every worker to train and commit")
        # 1. w1 dies mid-period (SIGKILL): the server goes on applying w0's and w2's commits.
        ctx.kill("w1")
        start = server_version(ctx)
        wait_until(lambda: server_version(ctx) >= start + 3, 30, "the server to apply commits without w1")
        seen["applied_without_w1"] = not ctx.restarts  # before w1's restart (3 s backoff)
        wait_until(lambda: ctx.restarts == ["w1"] and ctx.worker("w1").ready, 90, "the supervisor to restart w1")
        from edgestream.monitoring.scrape import scrape

        wait_until(lambda: (s := scrape(ctx.worker("w1").metrics_url)) is not None
                   and s.get("edgestream_commits_total", worker="w1") >= 2, 60, "the restarted w1 to commit")
        seen["w1_commits_again"] = True
        # 2. The server dies: workers keep training on their own, then commits resume.
        before = {w: steps_of(ctx, w) for w in WORKERS}
        dead = ctx.worker("server")
        ctx.kill("server")
        wait_until(lambda: all(steps_of(ctx, w) >= before[w] + 3 for w in WORKERS), 30,
                   "workers to train while the server is down")
        seen["trained_without_server"] = ctx.worker("server") is dead  # not restarted yet (3 s backoff)
        wait_until(lambda: ctx.restarts == ["w1", "server"] and ctx.worker("server").ready, 90,
                   "the supervisor to restart the server")
        start = server_version(ctx)
        # Enough commits after the restart for the model to learn past what the two deaths cost
        # (the accuracy check below; 0.75 was seen under load when streaming stopped after 6).
        wait_until(lambda: server_version(ctx) >= start + 15, 90, "commits to resume at the restarted server")
        seen["commits_resumed"] = True
        ctx.stop_streaming()

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=events)
    show(result)

    assert seen == {"applied_without_w1": True, "w1_commits_again": True, "trained_without_server": True,
                    "commits_resumed": True}
    assert [(d["process"], d["code"]) for d in result.deaths] == [("w1", -9), ("server", -9)]
    assert result.balanced
    server, trained = result.training["server"], workers_of(result)
    # Both resumed from a checkpoint taken during the run (the server checkpoints every
    # checkpoint_every_steps updates it handles), not from scratch.
    assert server["restored_from"] is not None and server["restored_from"] > 0
    assert trained["w1"]["restored_from"] is not None
    logged = commits_check(kafka_bootstrap, cfg, result, restarted=("w1",))
    assert all(logged[w] >= 5 for w in WORKERS)
    # What the restarted w1 re-sent under numbers the server had is at most the commits its
    # lost life made after its checkpoint.
    assert server["counters"].get("duplicates:w1", 0) <= 3
    assert server["accuracy"] >= 0.8


#: One bad parameter per strategy, as a user would mistype it, and the words the one line must hold.
BAD_PARAMETERS = [
    ("adsp", "commit_rate=-1", "commit_rate must be an int >= 1"),
    ("ssp", "staleness=-2", "staleness must be an int >= 0"),
    ("localsgd", "period_step=4", "unknown localsgd parameters ['period_step']"),
]


def test_examples_refuse_bad_strategy_parameters_with_one_line(kafka_bootstrap, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("EDGESTREAM_DEBUG", None)
    # The three runs at once (each spends its seconds starting up), each with its own state dir.
    procs = {strategy: subprocess.Popen(
        [sys.executable, "-m", "edgestream", "run", "--job", str(REPO / "examples" / f"{strategy}.toml"),
         "--bootstrap", kafka_bootstrap, "--set", f"train.strategy_params={params}",
         "--set", f"run.state_dir={tmp_path / strategy}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, env=env,
    ) for strategy, params, _words in BAD_PARAMETERS}
    try:
        outputs = {strategy: proc.communicate(timeout=120) for strategy, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for strategy, _params, words in BAD_PARAMETERS:
        proc = subprocess.CompletedProcess(procs[strategy].args, procs[strategy].returncode, *outputs[strategy])
        lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
        assert proc.returncode == 2, (strategy, proc.stdout, proc.stderr)
        assert len(lines) == 1 and words in lines[0] and f"train.strategy='{strategy}'" in lines[0], lines
        assert not (tmp_path / strategy / "workers").exists()  # refused before any process started
