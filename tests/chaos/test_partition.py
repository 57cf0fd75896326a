"""A worker host partitioned from the network for 20 s and healed, in the edge testbed (root).

A BSP training run of three workers, each on its own testbed host (network namespace), the
devices on theirs, one Kafka node on its own (``pipeline.testbed_run``). While the devices
stream, ``w2``'s host is cut off (``Testbed.fault("w2", "partition")``): its process keeps
running but reaches nothing. The others must drop it from the job (their live-worker count
falls to 2: heartbeats, docs/training.md "Membership in live runs") and keep training; the
cut lasts 20 s; after the heal ``w2`` must be taken back (every worker sees 3 live workers
again, ``w2`` trains again). The supervisor must not restart ``w2``: its process never
died, only its network did. Nothing may be lost or counted twice: every produced record is
read exactly once and trained, dropped or dead-lettered.

Evidence: the accounting table (per device) and the per-worker table are printed, and
written with the membership timeline to ``$EDGESTREAM_EVIDENCE_DIR/partition.json`` if set.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from edgestream.monitoring.scrape import scrape
from edgestream.pipeline.run import RunContext, run_job
from edgestream.pipeline.testbed_run import open_testbed
from tests.chaos.evidence import accounting_table, device_accounting
from tests.integration.jobs import quiet, show, train_job, wait_until, workers_of

pytestmark = pytest.mark.integration

CUT = "w2"
OTHERS = ("w0", "w1")
WORKERS = ("w0", "w1", "w2")
#: How long the partition lasts (the issue's 20 s).
CUT_S = 20.0

PARTITION_JOB = (
    "train.strategy=bsp",
    "train.heartbeat_s=0.5",
    "train.member_timeout_s=3",
    "run.duration_s=150",  # a cap: the hook ends streaming once every event happened
    "run.drain_timeout_s=90",
    # After the heal w2 catches up on ~20 s of its device's records: windows of up to 256
    # records (a step's most) instead of 64 let it do so at 1,024 records/s.
    "batcher.max_batch=256",
    "testbed.enabled=true",
    "testbed.brokers=1",
)


class Watch:
    """Scrapes of every worker (from the root namespace, over the testbed's bridge): steps,
    live workers, and whether w2 is a member in each one's view; one timeline entry per poll."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.t0 = time.monotonic()
        self.timeline: list[dict] = []
        #: What the hook is doing: before the cut, cut, healed.
        self.phase = "before"

    def sample(self) -> dict:
        row: dict = {"t": round(time.monotonic() - self.t0, 1), "phase": self.phase}
        for name in WORKERS:
            w = self.ctx.worker(name)
            s = scrape(w.metrics_url, timeout_s=1.0) if w.metrics_url else None
            if s is None:
                row[name] = None  # unreachable (cut off) or not serving yet
                continue
            row[name] = {"steps": int(s.get("edgestream_steps_total", worker=name)),
                         "live": int(s.get("edgestream_live_workers", -1, worker=name)),
                         "w2_member": int(s.get("edgestream_member_up", -1, worker=name, member=CUT)),
                         "version": int(s.get("edgestream_model_version", worker=name))}
        self.timeline.append(row)
        return row

    def value(self, name: str, key: str) -> int:
        row = self.sample()[name]
        return -1 if row is None else row[key]


def partition_and_heal(ctx: RunContext, seen: dict) -> None:
    watch = Watch(ctx)
    seen["watch"] = watch

    def all_see(count: int, who=WORKERS) -> bool:
        row = watch.sample()
        return all(row[n] is not None and row[n]["live"] == count for n in who)

    wait_until(lambda: all_see(3) and all(watch.timeline[-1][n]["steps"] >= 5 for n in WORKERS), 120,
               "three live workers that each took 5 steps")
    before = {n: watch.timeline[-1][n]["steps"] for n in WORKERS}
    seen["before"] = before

    ctx.testbed.fault(CUT, "partition", None)
    watch.phase = "cut"
    cut_at = time.monotonic()
    seen["cut_at_s"] = watch.timeline[-1]["t"]
    # The others time w2 out (3 s of silence) and go on without it.
    wait_until(lambda: all_see(2, OTHERS), 30, f"w0 and w1 to drop {CUT}")
    seen["dropped_after_s"] = round(time.monotonic() - cut_at, 1)
    dropped_steps = {n: watch.timeline[-1][n]["steps"] for n in OTHERS}
    wait_until(lambda: all(watch.value(n, "steps") >= dropped_steps[n] + 5 for n in OTHERS), 30,
               "w0 and w1 to take 5 steps without w2")
    # Keep the cut for CUT_S in all, sampling the timeline (a fault's duration, not a wait for a state).
    while (left := CUT_S - (time.monotonic() - cut_at)) > 0:
        watch.sample()
        ctx.stop.wait(min(0.5, left))
    during = watch.sample()
    seen["during"] = {n: during[n] and during[n]["steps"] for n in WORKERS}
    seen["steps_during_cut"] = {n: during[n]["steps"] - before[n] for n in OTHERS}

    ctx.testbed.fault(CUT, "heal", None)
    watch.phase = "healed"
    healed_at = time.monotonic()
    seen["healed_at_s"] = during["t"]
    # w2 is taken back: everyone sees three live workers, and w2 trains again.
    wait_until(lambda: all_see(3), 90, f"every worker to see {CUT} back")
    seen["readmitted_after_s"] = round(time.monotonic() - healed_at, 1)
    back = watch.timeline[-1][CUT]["steps"]
    wait_until(lambda: watch.value(CUT, "steps") >= back + 5 and watch.value("w0", "w2_member") == 1, 60,
               f"{CUT} to train 5 steps with the others")
    seen["after"] = {n: watch.timeline[-1][n] for n in WORKERS}
    # Its device's records of the cut waited in Kafka: w2 reads and trains them (BSP steps
    # take up to train.max_step_batch records). Streaming ends once it caught up, so the
    # others still have records to step with while it trains the rest.
    device = ctx.cfg.devices_of(CUT)[0]
    wait_until(lambda: backlog(ctx, CUT, device) <= ctx.cfg.batcher.max_batch, 90,
               f"{CUT} to catch up on the records of the cut")
    seen["caught_up_after_s"] = round(time.monotonic() - healed_at, 1)
    ctx.stop_streaming()


def backlog(ctx: RunContext, worker: str, device: str) -> float:
    """Records of ``device`` not trained yet by ``worker``: read and pending, plus not read (lag)."""
    w = ctx.worker(worker)
    s = scrape(w.metrics_url, timeout_s=1.0) if w.metrics_url else None
    if s is None:
        return float("inf")
    pending = s.get("edgestream_ledger_records", device=device, state="pending")
    lag = s.get("edgestream_consumer_lag_records", -1.0, device=device)
    return pending + lag if lag >= 0 else float("inf")


def evidence(cfg, result, seen: dict) -> dict:
    devices = device_accounting(cfg, result)
    workers = {name: {"steps": t["steps"], "version": t["version"], "restarts": result.restarted.count(name),
                      "live_at_end": t.get("live"), "digest": t["digest"][:12],
                      "membership_log": t.get("membership_log")}
               for name, t in sorted(workers_of(result).items())}
    watch = seen.get("watch")
    return {"devices": devices, "workers": workers, "balanced": result.balanced, "deaths": result.deaths,
            "events": {k: v for k, v in seen.items() if k != "watch"},
            "timeline": watch.timeline if watch else []}


def print_evidence(ev: dict) -> None:
    console = Console(width=200)
    console.print(accounting_table("partition of w2 for 20 s: accounting per device", ev["devices"]))
    table = Table(title="workers")
    for col in ("worker", "steps", "version", "restarts", "live at end", "digest"):
        table.add_column(col, justify="right")
    for name, w in ev["workers"].items():
        table.add_row(name, str(w["steps"]), str(w["version"]), str(w["restarts"]), ",".join(w["live_at_end"] or []),
                      w["digest"])
    console.print(table)
    console.print("events: " + json.dumps(ev["events"]))
    changes = []
    last = None
    for row in ev["timeline"]:
        key = tuple((n, None if row[n] is None else row[n]["live"]) for n in WORKERS)
        if key != last:
            changes.append(f"t={row['t']:.1f}s {row['phase']}: " + ", ".join(
                f"{n} {'unreachable' if v is None else 'not reporting yet' if v < 0 else f'sees {v} live'}"
                for n, v in key))
            last = key
    console.print("membership timeline (changes):\n  " + "\n  ".join(changes))


def test_a_partitioned_worker_host_is_dropped_then_taken_back_and_nothing_is_lost(unique, state_dir):
    # Its own address block (even third octet: the next /24 holds the brokers' aliases), so it
    # runs beside other testbeds on the machine.
    subnet = f"10.78.{2 * random.randrange(10, 120)}.0/24"
    cfg = train_job(unique, state_dir, *PARTITION_JOB, f"testbed.subnet={subnet}")
    seen: dict = {}
    with open_testbed(cfg, console=quiet()) as session:
        result = run_job(cfg, session.bootstrap, console=quiet(), live=False, testbed=session.testbed,
                         on_streaming=lambda ctx: partition_and_heal(ctx, seen))
    show(result)
    ev = evidence(cfg, result, seen)
    print_evidence(ev)
    if os.environ.get("EDGESTREAM_EVIDENCE_DIR"):
        out = Path(os.environ["EDGESTREAM_EVIDENCE_DIR"]) / "partition.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(ev, indent=2))

    # The others went on without w2 while it was cut off.
    assert all(n >= 5 for n in seen["steps_during_cut"].values()), seen["steps_during_cut"]
    assert seen["during"][CUT] is None  # w2's /metrics was unreachable: it really was cut off
    # w2 was never restarted: its process lived through the partition.
    assert result.deaths == [] and result.restarted == []
    # It is a member again at the end, in every worker's view, and trained after the heal.
    trained = workers_of(result)
    for name, t in trained.items():
        assert sorted(t["live"]) == list(WORKERS), (name, t["live"])
    assert seen["after"][CUT]["steps"] > seen["before"][CUT]
    # Nothing lost, nothing counted twice.
    assert result.balanced
    for device, d in ev["devices"].items():
        assert d["read"] == d["produced"], device
        assert d["produced"] == d["trained"] + d["dropped"] + d["dead_lettered"] + d["pending"], device
        # BSP's tail: records that reached a worker after the others' streams ended wait for
        # a step nobody can take (read, not acknowledged: re-read on a restart, not lost);
        # at most what one window delivers, never the backlog of the cut.
        assert d["pending"] < cfg.batcher.max_batch, device
    # BSP: the replicas that went through the same views end identical, at one version.
    assert len({t["digest"] for t in trained.values()}) == 1
    assert len({t["version"] for t in trained.values()}) == 1
