"""A Kafka broker SIGKILLed and restarted during a BSP and an ASP training run on a
3-node cluster (``deploy.kafka.broker.LocalCluster``: 3 combined broker+controller
nodes, topics with replication factor 3 and ``min.insync.replicas`` 2, producers with
acks=all and idempotence).

The killed node is the **leader of the job's update log** (``gradients.<job>``, partition
0): every BSP exchange and every ASP gradient goes through it, so training stalls until
the cluster elects a new leader from the two other in-sync replicas and the clients find
it. Each run: wait until every worker trained a few steps; SIGKILL that leader; wait for a
new leader and for every worker to train on without it; restart the node on its storage;
wait until it is back in the log's in-sync replicas and training moved on again; end
streaming. Then the run must balance (every produced record read exactly once and
trained, dropped or dead-lettered), no process may have died, and BSP replicas must be
identical.

Evidence: the accounting per device (produced / read / trained / dropped / dead-lettered
/ pending / dlq messages) and steps and versions per process are printed, and written to
``$EDGESTREAM_EVIDENCE_DIR/broker_kill_<strategy>.json`` if set.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from kafka.errors import KafkaError
from rich.console import Console
from rich.table import Table

from edgestream.deploy.kafka.broker import LocalCluster
from edgestream.job.topics import channel_topic
from edgestream.monitoring.scrape import scrape
from edgestream.pipeline.kafka_io import admin_client
from edgestream.pipeline.run import RunContext, run_job
from tests.chaos.evidence import accounting_table, device_accounting
from tests.integration.jobs import quiet, show, train_job, wait_until, workers_of

pytestmark = pytest.mark.integration

#: Steps every worker must take before the kill, while the node is down, and after it is back.
STEPS_BEFORE, STEPS_DURING, STEPS_AFTER = 5, 5, 5

BROKER_KILL_JOB = (
    "run.duration_s=300",  # a cap: the hook ends streaming once every event happened
    "run.drain_timeout_s=120",
    # Until the new leader is found a BSP step's exchange waits, while the devices stream
    # on: windows of up to 256 records let the workers catch up afterwards.
    "batcher.max_batch=256",
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One 3-node cluster for both runs; each run restarts the node it killed."""
    with LocalCluster(tmp_path_factory.mktemp("cluster"), brokers=3) as running:
        yield running


def partitions(bootstrap: str, names: list[str]) -> dict[str, dict]:
    """Partition 0 of each topic as the cluster describes it (``leader_id``, ``isr_nodes``);
    ``{}`` while the cluster cannot answer (a client may still try a dead node)."""
    try:
        admin = admin_client(bootstrap)
    except KafkaError:
        return {}
    try:
        return {entry["name"]: entry["partitions"][0] for entry in admin.describe_topics(names)
                if entry.get("error_code", 0) == 0 and entry.get("partitions")}
    except KafkaError:
        return {}
    finally:
        admin.close()


def progress(ctx: RunContext) -> dict[str, dict]:
    """Steps and model version of every running process now (None if it cannot be scraped)."""
    out = {}
    for w in ctx.workers:
        s = scrape(w.metrics_url, timeout_s=1.0) if w.metrics_url else None
        out[w.name] = None if s is None else {"steps": int(s.get("edgestream_steps_total", worker=w.name)),
                                              "version": int(s.get("edgestream_model_version", worker=w.name))}
    return out


def kill_and_restart_the_update_log_leader(ctx: RunContext, cluster: LocalCluster, seen: dict) -> None:
    job = ctx.cfg.job.name
    log_topic = channel_topic(job, "gradients")
    job_topics = sorted([log_topic, channel_topic(job, "models"), channel_topic(job, "control"),
                         *(f"sensors.{d}" for d in ctx.cfg.devices.device_ids())])
    workers = [w.name for w in ctx.workers if w.name != "server"]
    t0 = time.monotonic()

    def stamp(event: str, **extra) -> None:
        seen.setdefault("events", []).append({"t": round(time.monotonic() - t0, 1), "event": event, **extra})

    def every_worker_past(base: dict, more: int) -> dict | None:
        """Progress now if every worker could be scraped and took ``more`` steps since
        ``base`` (an earlier such result, or {}: since the start); else None."""
        now = progress(ctx)
        ok = all(now.get(w) and now[w]["steps"] >= (base[w]["steps"] if base else 0) + more for w in workers)
        return now if ok else None

    wait_until(lambda: every_worker_past({}, STEPS_BEFORE), 180, f"every worker to take {STEPS_BEFORE} steps")
    before = partitions(cluster.bootstrap, job_topics)
    leader = before[log_topic]["leader_id"]
    victim = cluster.index_of(leader)
    seen["killed_node"] = leader
    seen["node_led"] = sorted(t for t, p in before.items() if p["leader_id"] == leader)
    seen["at_kill"] = wait_until(lambda: every_worker_past({}, 0), 30, "a scrape of every worker")
    cluster.kill(victim)  # SIGKILL the JVM: no controlled shutdown, no leadership handed over
    stamp("killed", node=leader, led=seen["node_led"])

    survivor = cluster.node((victim + 1) % cluster.size).bootstrap
    new = wait_until(lambda: (p := partitions(survivor, [log_topic]).get(log_topic))
                     and p["leader_id"] not in (leader, -1) and p, 60, f"a new leader of {log_topic}")
    stamp("new leader", topic=log_topic, node=new["leader_id"], isr=sorted(new["isr_nodes"]))
    seen["during"] = wait_until(lambda: every_worker_past(seen["at_kill"], STEPS_DURING), 120,
                                f"every worker to take {STEPS_DURING} steps with node {leader} down")
    stamp("trained on without the node", steps={w: seen["during"][w]["steps"] for w in workers})

    cluster.restart(victim)
    stamp("restarted", node=leader)
    wait_until(lambda: sorted((partitions(cluster.bootstrap, [log_topic]).get(log_topic) or {})
                              .get("isr_nodes", [])) == [1, 2, 3], 90, f"node {leader} back in sync on {log_topic}")
    back = wait_until(lambda: every_worker_past({}, 0), 30, "a scrape of every worker")
    stamp("back in sync", topic=log_topic, steps={w: back[w]["steps"] for w in workers})
    seen["after"] = wait_until(lambda: every_worker_past(back, STEPS_AFTER), 120,
                               f"every worker to take {STEPS_AFTER} steps after the restart")
    stamp("trained on after the restart", steps={w: seen["after"][w]["steps"] for w in workers})
    ctx.stop_streaming()


def evidence(cfg, result, seen: dict) -> dict:
    devices = device_accounting(cfg, result)
    processes = {}
    for name, t in sorted(result.training.items()):
        at_kill = (seen.get("at_kill") or {}).get(name) or {}
        processes[name] = {"steps_at_kill": at_kill.get("steps"), "version_at_kill": at_kill.get("version"),
                           "steps": t["steps"], "version": t["version"], "trained_records": t["trained_records"],
                           "digest": t["digest"][:12], "restarts": result.restarted.count(name)}
    return {"strategy": cfg.train.strategy, "killed_node": seen.get("killed_node"),
            "node_led": seen.get("node_led"), "events": seen.get("events", []), "devices": devices,
            "processes": processes, "balanced": result.balanced, "deaths": result.deaths,
            "duration_s": round(result.duration_s, 1)}


def print_evidence(ev: dict) -> None:
    console = Console(width=200)
    console.print(accounting_table(f"{ev['strategy']}: broker node {ev['killed_node']} SIGKILLed and restarted "
                                   f"(it led {', '.join(ev['node_led'] or [])}): accounting per device", ev["devices"]))
    table = Table(title="processes")
    for col in ("process", "steps at kill", "steps", "version at kill", "version", "trained records", "restarts",
                "digest"):
        table.add_column(col, justify="right")
    for name, p in ev["processes"].items():
        table.add_row(name, str(p["steps_at_kill"]), str(p["steps"]), str(p["version_at_kill"]), str(p["version"]),
                      str(p["trained_records"]), str(p["restarts"]), p["digest"])
    console.print(table)
    console.print("events: " + "; ".join(
        f"t={e['t']}s {e['event']}" + "".join(f" {k}={v}" for k, v in e.items() if k not in ("t", "event"))
        for e in ev["events"]))
    console.print(f"balanced: {ev['balanced']}, deaths: {ev['deaths']}, run {ev['duration_s']}s")


def run_with_broker_kill(cluster: LocalCluster, cfg) -> tuple[object, dict]:
    seen: dict = {}
    result = run_job(cfg, cluster.bootstrap, console=quiet(), live=False,
                     on_streaming=lambda ctx: kill_and_restart_the_update_log_leader(ctx, cluster, seen))
    show(result)
    ev = evidence(cfg, result, seen)
    print_evidence(ev)
    if os.environ.get("EDGESTREAM_EVIDENCE_DIR"):
        out = Path(os.environ["EDGESTREAM_EVIDENCE_DIR"]) / f"broker_kill_{cfg.train.strategy}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(ev, indent=2))
    return result, ev


def assert_nothing_lost_and_training_went_on(result, ev: dict) -> None:
    # No process died: a broker failure is the clients' to ride out.
    assert result.deaths == [] and result.restarted == [], result.deaths
    # Nothing lost, nothing counted twice: every produced record read once and settled.
    assert result.balanced
    for device, d in ev["devices"].items():
        assert d["read"] == d["produced"], device
        assert d["produced"] == d["trained"] + d["dropped"] + d["dead_lettered"] + d["pending"], device
        assert d["pending"] == 0, device
    # Training continued after the kill, in every worker (the hook waited for it; this is
    # the final count).
    for name, p in ev["processes"].items():
        if name != "server":
            assert p["steps"] > p["steps_at_kill"], name


def test_bsp_run_survives_a_killed_and_restarted_log_leader(cluster, unique, state_dir):
    cfg = train_job(unique, state_dir, "train.strategy=bsp", *BROKER_KILL_JOB)

    result, ev = run_with_broker_kill(cluster, cfg)

    assert_nothing_lost_and_training_went_on(result, ev)
    trained = workers_of(result)
    assert len({t["digest"] for t in trained.values()}) == 1  # bitwise identical replicas
    assert len({t["version"] for t in trained.values()}) == 1


def test_asp_run_survives_a_killed_and_restarted_log_leader(cluster, unique, state_dir):
    cfg = train_job(unique, state_dir, "train.strategy=asp", "train.lr=0.03", "train.momentum=0.5",
                    "train.strategy_params=max_staleness=4", *BROKER_KILL_JOB)

    result, ev = run_with_broker_kill(cluster, cfg)

    assert_nothing_lost_and_training_went_on(result, ev)
    server = ev["processes"]["server"]
    assert server["version"] > server["version_at_kill"]  # the server applied updates after the kill
    assert result.training["server"]["staleness"]["max"] <= 4  # the bound held through the failover
