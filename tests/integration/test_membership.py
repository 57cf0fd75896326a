"""Membership in live runs over the real broker: a worker joins a running job, one leaves
(SIGTERM), one is killed (SIGKILL) and restarted later; training goes on after each event.

One BSP run and one ASP run, each with all three events (the run's hooks start, stop and
kill workers while the simulators stream). Heartbeats every 0.5 s, a worker is dropped
after 3 s of silence, and the killed worker's restart waits 5 s: the others drop it first,
so it comes back through the strategy's rejoin path (from its checkpoint).
"""

from __future__ import annotations

import pytest

from edgestream.pipeline.run import RunContext, run_job
from tests.integration.jobs import quiet, show, steps_of, train_job, wait_until, workers_of

pytestmark = pytest.mark.integration

#: Three devices (one per worker), w0 and w1 start, w2 joins later.
MEMBERSHIP = (
    "train.initial_workers=w0,w1",
    "train.heartbeat_s=0.5",
    "train.member_timeout_s=3",
    "run.restart_backoff_s=5",
    "run.duration_s=150",  # a cap: the hook ends streaming once every event happened
    # Windows of up to 256 records (a step's most, train.max_step_batch) instead of 64: a
    # window holds 60 of w0's 240 records/s either way; the restarted w0 catches up on its
    # backlog at 1,024 records/s instead of 256, so draining does not wait ~20 s for it.
    "batcher.max_batch=256",
)


def gauge(ctx: RunContext, worker: str, name: str, **labels: str) -> float:
    """A gauge of ``worker``'s /metrics now (-1 if it cannot be scraped)."""
    from edgestream.monitoring.scrape import scrape

    w = ctx.worker(worker)
    s = scrape(w.metrics_url) if w.metrics_url else None
    return s.get(name, -1.0, worker=worker, **labels) if s is not None else -1.0


def advances(ctx: RunContext, who: list[str], by: int, what: str, timeout_s: float = 60.0,
             metric: str = "steps") -> None:
    """Wait until each of ``who`` took ``by`` more steps (or, for the server, ``by`` more
    model versions) than now."""
    def value(name: str) -> float:
        if metric == "version":
            return gauge(ctx, name, "edgestream_model_version")
        return steps_of(ctx, name)

    start = {name: value(name) for name in who}
    wait_until(lambda: all(value(n) >= start[n] + by for n in who), timeout_s, f"{what}: {who} to move by {by}")


def run_events(ctx: RunContext, seen: dict, trainers: list[str], metric: str = "steps") -> None:
    """w2 joins; w1 leaves (SIGTERM); w0 is killed and restarted by the supervisor."""
    wait_until(lambda: steps_of(ctx, "w0") >= 5 and steps_of(ctx, "w1") >= 5, 90, "w0 and w1 to train")
    # 1. w2 joins the running job: it waits for the model, then trains with the others.
    ctx.start_worker("w2")
    wait_until(lambda: ctx.worker("w2").ready and steps_of(ctx, "w2") >= 3, 90, "w2 to join and train")
    wait_until(lambda: all(gauge(ctx, w, "edgestream_live_workers") == 3 for w in ("w0", "w1", "w2")), 30,
               "every worker to see three live workers")
    advances(ctx, ["w0", "w1", "w2"] if metric == "steps" else trainers, 3, "after the join", metric=metric)
    seen["joined"] = True
    # 2. w1 leaves on purpose: its peers drop it at once (op: leave), it is not restarted.
    ctx.stop_worker("w1")
    wait_until(lambda: all(gauge(ctx, w, "edgestream_live_workers") == 2 for w in ("w0", "w2")), 30,
               "w0 and w2 to see w1 gone")
    assert gauge(ctx, "w0", "edgestream_member_up", member="w1") == 0
    advances(ctx, ["w0", "w2"] if metric == "steps" else trainers, 3, "after w1 left", metric=metric)
    seen["left"] = True
    # 3. w0 dies (SIGKILL: no leave): w2 drops it after the timeout and goes on alone; the
    # supervisor restarts w0 after its backoff, from its checkpoint, and it rejoins.
    ctx.kill("w0")
    wait_until(lambda: gauge(ctx, "w2", "edgestream_live_workers") == 1, 30, "w2 to time w0 out")
    advances(ctx, ["w2"] if metric == "steps" else trainers, 3, "after w0 died", metric=metric)
    seen["killed_alone"] = True
    wait_until(lambda: ctx.restarts == ["w0"] and ctx.worker("w0").ready, 90, "the supervisor to restart w0")
    wait_until(lambda: gauge(ctx, "w2", "edgestream_live_workers") == 2, 30, "w2 to see w0 back")
    advances(ctx, ["w0", "w2"] if metric == "steps" else trainers, 3, "after w0 came back", metric=metric)
    seen["rejoined"] = True
    ctx.stop_streaming()


def check_accounting(cfg, result) -> None:
    assert result.left == ["w1"] and result.joined == ["w2"]
    assert [(d["process"], d["code"]) for d in result.deaths] == [("w0", -9)]
    assert result.restarted == ["w0"]
    assert result.balanced
    left_device = cfg.devices_of("w1")[0]
    left = result.accounting[left_device]
    assert left["running"] is False and left["unread"] > 0  # records produced after w1 left stay in Kafka
    assert left["unread"] + left["buffered"] + left["in_sink"] <= left["in_kafka"]
    for worker in ("w0", "w2"):  # a device whose worker runs is read to the end
        a = result.accounting[cfg.devices_of(worker)[0]]
        assert a["running"] is True and a["unread"] == 0 and a["records_in"] == result.produced[cfg.devices_of(worker)[0]]


def test_bsp_worker_joins_leaves_and_dies_while_the_others_train_in_lockstep(kafka_bootstrap, unique, state_dir):
    cfg = train_job(unique, state_dir, "train.strategy=bsp", *MEMBERSHIP)
    seen: dict = {}

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False,
                     on_streaming=lambda ctx: run_events(ctx, seen, ["w0", "w2"]))
    show(result)

    assert seen == {"joined": True, "left": True, "killed_alone": True, "rejoined": True}
    check_accounting(cfg, result)
    trained = workers_of(result)
    survivors = {name: trained[name] for name in ("w0", "w2")}
    # BSP replicas that went through the same views are bitwise identical, at one version.
    assert len({t["digest"] for t in survivors.values()}) == 1
    assert len({t["version"] for t in survivors.values()}) == 1
    assert survivors["w0"]["version"] > trained["w1"]["version"] > 0
    views = {name: t["strategy_stats"]["view_id"] for name, t in survivors.items()}
    assert len(set(views.values())) == 1 and views["w0"] >= 4  # +w2, -w1, -w0, +w0
    assert survivors["w0"]["strategy_stats"]["members"] == ["w0", "w2"]
    assert trained["w2"]["joining"] and trained["w2"]["counters"]["snapshots_adopted"] == 1
    assert survivors["w0"]["counters"].get("readmitted", 0) == 1  # removed while dead, then readmitted
    assert survivors["w0"]["restored_from"] is not None  # the restart resumed from its checkpoint
    assert all(t["staleness"].get("max", 0) == 0 for t in trained.values())


def test_asp_worker_joins_leaves_and_dies_while_the_server_trains_on(kafka_bootstrap, unique, state_dir):
    cfg = train_job(unique, state_dir, "train.strategy=asp", "train.lr=0.03", "train.momentum=0.5", *MEMBERSHIP)
    seen: dict = {}

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False,
                     on_streaming=lambda ctx: run_events(ctx, seen, ["server"], metric="version"))
    show(result)

    assert seen == {"joined": True, "left": True, "killed_alone": True, "rejoined": True}
    check_accounting(cfg, result)
    trained = workers_of(result)
    server = result.training["server"]
    assert server["live"] == ["w0", "w2"]
    # The server sent the model to each worker it saw arrive: w2 (join) and w0 (rejoin).
    assert server["counters"]["snapshots_sent"] >= 2
    assert trained["w2"]["joining"] and trained["w2"]["counters"]["snapshots_adopted"] >= 1
    # The rejoining w0 went on after the last step the server had of it (from its checkpoint
    # or from the step the server's snapshot named). A restart quicker than the server's
    # membership timeout gets no snapshot: the steps it redoes after its checkpoint (at most
    # checkpoint_every_steps) reach the server again and its duplicate filter drops them,
    # so none is applied twice.
    assert server["counters"].get("duplicates", 0) <= cfg.train.checkpoint_every_steps
    assert server["version"] > 0 and server["staleness"]["count"] > 0
