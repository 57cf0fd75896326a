"""A real secure 3-node KRaft cluster (docs/security.md): every node speaks only SASL_SSL,
a job's ACLs applied with `edgestream acl apply` hold on every node, and a SIGKILLed
node comes back into the secure cluster with the admin still writing and reading
replicated records. `edgestream broker status` is asked about the same cluster."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from edgestream.cli.broker import _write_client_settings
from edgestream.cli.main import main
from edgestream.deploy.kafka.broker import ADMIN_USER, BrokerSecurity, LocalCluster, broker_count
from edgestream.deploy.kafka.tls import make_pki
from edgestream.pipeline.kafka_io import ensure_topics, producer, read_range
from edgestream.streams import topics
from tests.integration import test_security
from tests.integration.jobs import wait_until
from tests.integration.test_cluster import partition_state
from tests.integration.test_security import cli, device_writes_only_its_own, job, settings

pytestmark = pytest.mark.integration

#: The fixture that switches this process's Kafka principal, shared with test_security.py.
as_user = test_security.as_user


@pytest.fixture(scope="module")
def secure_cluster(tmp_path_factory):
    """Three secure nodes (broker + controller each) for the module, one CA and broker
    certificate for all; a test that kills a node restarts it."""
    work = tmp_path_factory.mktemp("secure-cluster")
    pki = make_pki(work / "tls", ["127.0.0.1"])
    (pki.directory / "admin.password").write_text(secrets.token_urlsafe(16))
    security = BrokerSecurity(pki.directory, (pki.directory / "admin.password").read_text())
    with LocalCluster(work / "cluster", brokers=3, security=security) as cluster:
        # What `broker start --secure --brokers 3` leaves, for `broker status` on this cluster.
        cluster.info().save(work / "state" / "broker.json")
        _write_client_settings(work / "state", cluster.bootstrap, security)
        yield cluster, work


def admin_sets(cluster, work: Path, **extra: str) -> list[str]:
    return settings(cluster, work, ADMIN_USER, work / "tls" / "admin.password", **extra)


def status(work: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["broker", "status", "--state-dir", str(work / "state")])
    return code, capsys.readouterr().out


def test_every_node_answers_only_over_sasl_ssl(secure_cluster, tmp_path, capsys):
    cluster, work = secure_cluster

    for node in cluster.nodes:
        count, problem = broker_count(node.bootstrap)  # a plaintext metadata request
        assert count == 0 and "speaks TLS, not plaintext" in problem
        assert node.live_brokers(timeout_s=10) == (3, None)  # TLS + the admin's login

    sets = [f"--set={s}" for s in admin_sets(cluster, work, **{"kafka.security_protocol": "PLAINTEXT"})]
    done = cli("simulate", *sets, "--set", f"run.state_dir={tmp_path}", "--duration", "1")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("edgestream simulate: ") and "speaks TLS, not plaintext" in last, done.stderr[-2000:]

    code, out = status(work, capsys)
    assert code == 0, out
    assert "up (3/3 nodes answer; SASL_SSL, the admin's login checked at each node)" in out
    assert out.count("up, sees 3 of 3 brokers") == 3


def test_acl_apply_lets_a_device_write_its_own_topic_and_refuses_the_others(
        secure_cluster, tmp_path, unique, as_user):
    cluster, work = secure_cluster
    state, creds = tmp_path / "state", tmp_path / "creds"
    admin_cfg = job(unique, state, *admin_sets(cluster, work))
    (tmp_path / "job.json").write_text(json.dumps(admin_cfg.to_dict()))

    done = cli("acl", "apply", "--job", str(tmp_path / "job.json"), "--password-dir", str(creds))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "4 SCRAM-SHA-512 users" in done.stdout

    first, second = admin_cfg.devices.device_ids()
    as_user(admin_cfg)
    for topic in (topics.sensor_topic(first), f"gradients.{admin_cfg.job.name}"):
        state_of = wait_until(lambda t=topic: partition_state(cluster.bootstrap, t), 30, f"the partitions of {topic}")
        assert sorted(state_of["replica_nodes"]) == [1, 2, 3], (topic, state_of)  # the cluster's RF 3

    device_cfg = job(unique, state, *settings(cluster, work, first, creds / f"{first}.password"))
    as_user(device_cfg)
    device_writes_only_its_own(device_cfg, cluster.bootstrap, first, second, 2.0)


def test_a_killed_node_comes_back_and_the_admin_still_writes_and_reads_replicated_records(
        secure_cluster, unique, as_user, tmp_path, capsys):
    cluster, work = secure_cluster
    as_user(job(unique, tmp_path, *admin_sets(cluster, work)))
    topic = f"sensors.k{unique}"
    ensure_topics(cluster.bootstrap, {topic: "sensors"})
    written = 0

    def write(n: int) -> None:
        nonlocal written
        prod = producer(cluster.bootstrap, client_id="secure-cluster-test")
        try:
            for _ in range(n):
                prod.send(topic, str(written).encode()).get(timeout=60)  # acks=all: 2 of 3 in sync at least
                written += 1
        finally:
            prod.close(timeout=5)

    write(10)
    leader = wait_until(lambda: partition_state(cluster.bootstrap, topic).get("leader_id"), 30, "a leader")
    victim = cluster.index_of(leader)
    cluster.kill(victim)

    code, out = status(work, capsys)
    assert code == 1 and "degraded (2/3 nodes answer" in out, out
    assert f"node {leader}: {cluster.node(victim).bootstrap} pid" in out and "down (process gone)" in out

    write(10)  # a new leader over the two nodes left
    wait_until(lambda: partition_state(cluster.bootstrap, topic).get("leader_id") not in (None, leader), 30,
               f"a leader other than node {leader}")

    cluster.restart(victim)  # waits until every node lists all three brokers, over TLS as the admin
    cluster.info().save(work / "state" / "broker.json")  # the node's new pid, for `broker status`
    wait_until(lambda: sorted(partition_state(cluster.bootstrap, topic).get("isr_nodes", [])) == [1, 2, 3],
               60, f"node {leader} back in the ISR of {topic}")
    write(10)

    from kafka.structs import TopicPartition

    values = [r.value.decode() for r in read_range(cluster.bootstrap, TopicPartition(topic, 0), 0, written,
                                                    timeout_s=30)]
    assert values == [str(i) for i in range(written)]  # nothing lost, nothing written twice
    code, out = status(work, capsys)
    assert code == 0 and "up (3/3 nodes answer" in out, out
