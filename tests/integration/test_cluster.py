"""A real 3-node KRaft cluster: replicated topics, a SIGKILLed partition leader under an
acks=all idempotent producer (nothing lost, nothing written twice), the node restarted
and back in sync, and `edgestream broker status | stop` on the cluster."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from kafka import KafkaConsumer
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.errors import KafkaError
from kafka.structs import TopicPartition

from edgestream.deploy.kafka.broker import LocalCluster, is_broker_pid
from edgestream.pipeline.kafka_io import admin_client, ensure_topics, producer
from tests.integration.jobs import wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One 3-node cluster for the module; a test that kills a node restarts it."""
    with LocalCluster(tmp_path_factory.mktemp("cluster"), brokers=3) as running:
        yield running


def partition_state(bootstrap: str, topic: str) -> dict:
    """Partition 0 of ``topic`` as the cluster describes it (``leader_id``,
    ``replica_nodes``, ``isr_nodes``); ``{}`` while the cluster cannot say (right after
    a kill a client may still try the dead node; right after a topic is created the
    broker that answers may not know its partitions yet)."""
    try:
        admin = admin_client(bootstrap)
    except KafkaError:
        return {}
    try:
        (entry,) = admin.describe_topics([topic])
        return entry["partitions"][0] if entry.get("partitions") else {}
    except KafkaError:
        return {}
    finally:
        admin.close()


def test_ensure_topics_replicates_three_times_with_two_in_sync(cluster, unique):
    topic = f"sensors.r{unique}"

    assert ensure_topics(cluster.bootstrap, {topic: "sensors"}) == [topic]

    state = wait_until(lambda: partition_state(cluster.bootstrap, topic), 30, f"the partitions of {topic}")
    assert sorted(state["replica_nodes"]) == [1, 2, 3] and sorted(state["isr_nodes"]) == [1, 2, 3]
    admin = admin_client(cluster.bootstrap)
    try:
        described = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    finally:
        admin.close()
    assert described["topic"][topic]["min.insync.replicas"]["value"] == "2"


class NumberedWriter:
    """Writes 0, 1, 2, ... to one topic with the edgestream producer (acks=all,
    idempotent) in flushed batches until stopped; ``acked`` is how many the cluster
    acknowledged so far, ``errors`` every failed send."""

    def __init__(self, bootstrap: str, topic: str, batch: int = 20) -> None:
        self.prod = producer(bootstrap, client_id="cluster-test-writer")
        self.topic = topic
        self.batch = batch
        self.acked = 0
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        sent = 0
        while not self.stop.is_set():
            futures = [self.prod.send(self.topic, value=str(sent + i).encode()) for i in range(self.batch)]
            self.prod.flush()  # blocks through a leader failover: the retries go to the new leader
            for future in futures:
                try:
                    future.get(timeout=0)
                except Exception as exc:  # a send that failed for good: lost, reported below
                    self.errors.append(exc)
            sent += self.batch
            self.acked = sent

    def finish(self) -> int:
        self.stop.set()
        self.thread.join(timeout=120)
        self.prod.close()
        return self.acked


class Reader:
    """Reads ``topic`` partition 0 from the beginning while the test runs, keeping every value."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.cons = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                  client_id="cluster-test-reader")
        self.tp = TopicPartition(topic, 0)
        self.cons.assign([self.tp])
        self.cons.seek_to_beginning(self.tp)
        self.values: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            for record in self.cons.poll(timeout_ms=200).get(self.tp, []):
                self.values.append(int(record.value))

    def finish(self) -> list[int]:
        self.stop.set()
        self.thread.join(timeout=30)
        self.cons.close()
        return self.values


def test_a_killed_leader_loses_no_acknowledged_write_and_duplicates_none(cluster, unique):
    topic = f"sensors.k{unique}"
    ensure_topics(cluster.bootstrap, {topic: "sensors"})
    writer, reader = NumberedWriter(cluster.bootstrap, topic), Reader(cluster.bootstrap, topic)
    writer.thread.start()
    reader.thread.start()
    try:
        wait_until(lambda: writer.acked >= 200, 30, "200 acknowledged writes")
        leader = partition_state(cluster.bootstrap, topic)["leader_id"]
        victim = cluster.index_of(leader)
        survivor = cluster.node((victim + 1) % 3).bootstrap
        cluster.kill(victim)  # SIGKILL the partition's leader: no controlled shutdown
        at_kill = writer.acked

        # A new leader is elected among the two other in-sync replicas and writes go on.
        def new_leader_elected() -> int | None:
            now = partition_state(survivor, topic).get("leader_id", -1)
            return now if now not in (leader, -1) else None

        new_leader = wait_until(new_leader_elected, 60, "a new leader")
        wait_until(lambda: writer.acked >= at_kill + 200, 60, "200 more writes acknowledged after the kill")

        cluster.restart(victim)
        wait_until(lambda: sorted(partition_state(cluster.bootstrap, topic).get("isr_nodes", [])) == [1, 2, 3], 60,
                   f"node {leader} back in the in-sync replicas")
        at_restart = writer.acked
        wait_until(lambda: writer.acked >= at_restart + 100, 30, "100 more writes after the restart")
    finally:
        acked = writer.finish()
    try:
        wait_until(lambda: len(reader.values) >= acked, 60, f"the reader to read all {acked} writes")
    finally:
        values = reader.finish()

    assert new_leader != leader and writer.errors == []
    assert len(values) == acked  # nothing written twice (idempotent retries) ...
    assert sorted(values) == list(range(acked))  # ... and nothing acknowledged is lost
    assert values == sorted(values)  # one partition: the log keeps the send order across the failover


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgestream", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_broker_cli_lists_every_node_and_stops_them_all(cluster, tmp_path):
    # Runs last: it stops the module's cluster. `broker start --brokers 3` itself is the
    # fixture's LocalCluster.start plus saving broker.json; starting a second cluster
    # here would double this module's time.
    state = tmp_path / "broker"
    state.mkdir()
    cluster.info().save(state / "broker.json")
    nodes = cluster.info().nodes

    status = cli("broker", "status", "--state-dir", str(state))
    assert status.returncode == 0, status.stdout + status.stderr
    for n in nodes:
        assert f"node {n.node_id}: {n.bootstrap} pid {n.pid}: up, sees 3 of 3 brokers" in status.stdout
    assert "up (3/3 nodes answer)" in status.stdout

    cluster.kill(1)
    degraded = cli("broker", "status", "--state-dir", str(state))
    assert degraded.returncode == 1
    assert f"node 2: {nodes[1].bootstrap} pid {nodes[1].pid}: down (process gone)" in degraded.stdout
    assert "degraded (2/3 nodes answer)" in degraded.stdout

    stopped = cli("broker", "stop", "--state-dir", str(state))
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert f"local cluster of 3 nodes at {cluster.bootstrap} stopped" in stopped.stdout
    assert not any(is_broker_pid(n.pid) for n in nodes)
    assert not (state / "broker.json").exists()
