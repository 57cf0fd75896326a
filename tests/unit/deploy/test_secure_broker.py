"""The secure local broker and cluster (docs/security.md) without a JVM: every node's
properties and storage format command, the certificate's names against the nodes'
addresses, and `broker start --secure --brokers 3` writing the admin's client settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgestream.cli.main import main
from edgestream.deploy.kafka import broker as kafka_broker
from edgestream.deploy.kafka.broker import (
    ADMIN_USER,
    CLUSTER_FAILURE_DETECTION,
    BrokerError,
    BrokerInfo,
    BrokerSecurity,
    LocalBroker,
    LocalCluster,
    NodeInfo,
)
from edgestream.deploy.kafka.tls import certificate_hosts, make_pki, uncovered
from edgestream.job.config import load_config

AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"


def security(tmp_path: Path) -> BrokerSecurity:
    """Settings only: no certificate is read to build properties."""
    return BrokerSecurity(tmp_path / "tls", "s3cret")


def test_every_node_of_a_secure_cluster_speaks_sasl_ssl_to_clients_and_brokers_and_mtls_to_controllers(tmp_path):
    sec = security(tmp_path)
    cluster = LocalCluster(tmp_path / "c", brokers=3, security=sec)

    props = [node.properties() for node in cluster.nodes]
    assert len({p["controller.quorum.voters"] for p in props}) == 1
    for node, p in zip(cluster.nodes, props, strict=True):
        assert node.security is sec
        assert p["listeners"] == f"SASL_SSL://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}"
        assert p["advertised.listeners"] == f"SASL_SSL://127.0.0.1:{node.port}"  # no PLAINTEXT listener left
        assert "PLAINTEXT" not in p["listeners"] + p["advertised.listeners"]
        assert p["listener.security.protocol.map"] == "SASL_SSL:SASL_SSL,CONTROLLER:SSL"
        # Brokers replicate over SASL_SSL as the admin; controllers want the brokers' certificate.
        assert p["inter.broker.listener.name"] == "SASL_SSL"
        assert p["sasl.mechanism.inter.broker.protocol"] == "SCRAM-SHA-512"
        assert p["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
        assert f'username="{ADMIN_USER}" password="s3cret"' in p["listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config"]
        assert p["controller.listener.names"] == "CONTROLLER"
        assert p["listener.name.controller.ssl.client.auth"] == "required"
        assert p["ssl.keystore.location"] == str(sec.pki_dir / "broker-keystore.pem")
        assert p["ssl.truststore.location"] == str(sec.pki_dir / "ca.pem")
        assert p["authorizer.class.name"] == AUTHORIZER
        assert p["allow.everyone.if.no.acl.found"] == "false"
        assert set(p["super.users"].split(";")) == {f"User:{ADMIN_USER}", "User:CN=edgestream broker"}
        # The cluster's replication and failure detection stay.
        assert p["default.replication.factor"] == "3" and p["min.insync.replicas"] == "2"
        assert p["offsets.topic.replication.factor"] == "3"
        assert all(p[key] == value for key, value in CLUSTER_FAILURE_DETECTION.items())


def test_every_node_is_formatted_with_the_admin_and_a_plain_one_without(tmp_path):
    cluster = LocalCluster(tmp_path / "c", brokers=3, security=security(tmp_path))
    plain = LocalBroker(tmp_path / "plain")
    for node in [*cluster.nodes, plain]:
        node.jar_dir = Path("/jars")

    for node in cluster.nodes:
        command = node.format_command(node.work_dir / "server.properties", cluster.cluster_id)
        at = command.index("--add-scram")
        assert command[at + 1] == f"SCRAM-SHA-512=[name={ADMIN_USER},password=s3cret]"
        assert command[command.index("-t") + 1] == cluster.cluster_id
    assert "--add-scram" not in plain.format_command(plain.work_dir / "server.properties", "x")


def test_a_secure_testbed_cluster_binds_everywhere_and_advertises_its_own_address(tmp_path):
    cluster = LocalCluster(tmp_path / "c", hosts=["10.77.0.2", "10.77.0.3", "10.77.0.4"], bind_host="0.0.0.0",
                           security=security(tmp_path))

    props = cluster.node(1).properties()
    assert props["listeners"] == "SASL_SSL://0.0.0.0:9092,CONTROLLER://10.77.0.3:9093"
    assert props["advertised.listeners"] == "SASL_SSL://10.77.0.3:9092"


def test_without_the_authorizer_nothing_is_denied_by_default(tmp_path):
    props = LocalBroker(tmp_path, security=BrokerSecurity(tmp_path / "tls", "p", authorizer=False)).properties()

    assert "authorizer.class.name" not in props and "allow.everyone.if.no.acl.found" not in props
    assert props["advertised.listeners"].startswith("SASL_SSL://")


def test_a_certificate_that_misses_a_node_address_is_refused_before_anything_starts(tmp_path, monkeypatch):
    pki = make_pki(tmp_path / "tls", ["127.0.0.1"])
    sec = BrokerSecurity(pki.directory, "p")
    cluster = LocalCluster(tmp_path / "c", hosts=["127.0.0.1", "10.77.0.3", "10.77.0.4"], security=sec)

    def no_jars(*_args, **_kwargs):
        raise AssertionError("the cluster went on to start")

    monkeypatch.setattr(kafka_broker, "resolve_jars", no_jars)
    with pytest.raises(BrokerError, match=r"does not name 10\.77\.0\.3, 10\.77\.0\.4.*make_pki"):
        cluster.start()
    sec.check_covers(["127.0.0.1"])  # the local cluster's one address is covered


def test_make_pki_issues_the_broker_certificate_again_for_new_hosts_with_the_same_ca(tmp_path):
    first = make_pki(tmp_path / "tls", ["127.0.0.1", "localhost"])
    ca, keystore = first.ca.read_bytes(), first.broker_keystore.read_text()
    assert certificate_hosts(first.broker_cert) == ["127.0.0.1", "localhost"]
    assert uncovered(first.broker_cert, ["127.0.0.1", "10.0.0.2", "10.0.0.2"]) == ["10.0.0.2"]

    again = make_pki(tmp_path / "tls", ["127.0.0.1"])  # covered: nothing is made again
    assert again.broker_keystore.read_text() == keystore

    wider = make_pki(tmp_path / "tls", ["10.0.0.2", "10.0.0.3"])
    assert certificate_hosts(wider.broker_cert) == ["127.0.0.1", "localhost", "10.0.0.2", "10.0.0.3"]
    assert wider.ca.read_bytes() == ca  # clients keep trusting the same CA
    assert wider.broker_keystore.read_text() != keystore
    assert wider.broker_keystore.read_text().endswith(wider.broker_cert.read_text())
    assert wider.broker_keystore.stat().st_mode & 0o077 == 0


class FakeCluster:
    """Stands in for LocalCluster in `broker start`: records what it was given, starts nothing."""

    made: list[FakeCluster] = []

    def __init__(self, work_dir: Path, brokers: int, heap: str, security: BrokerSecurity | None = None) -> None:
        self.work_dir, self.security = work_dir, security
        self.nodes = [LocalBroker(work_dir / f"node{i}", node_id=i, port=40000 + i) for i in (1, 2, 3)]
        self.bootstrap = ",".join(node.bootstrap for node in self.nodes)
        FakeCluster.made.append(self)

    def start(self) -> FakeCluster:
        return self

    def info(self) -> BrokerInfo:
        nodes = [NodeInfo(node_id=n.node_id, pid=1, bootstrap=n.bootstrap, controller_port=n.controller_port,
                          work_dir=str(n.work_dir), log_file=str(n.log_file)) for n in self.nodes]
        return BrokerInfo(pid=1, bootstrap=self.bootstrap, controller_port=1, work_dir=str(self.work_dir),
                          log_file="l", version="4.1.1", nodes=nodes)


def test_start_secure_brokers_3_gives_the_cluster_security_and_writes_the_admins_settings(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kafka_broker, "LocalCluster", FakeCluster)
    FakeCluster.made.clear()

    assert main(["broker", "start", "--secure", "--brokers", "3", "--state-dir", str(tmp_path)]) == 0

    (cluster,) = FakeCluster.made
    assert cluster.security is not None and cluster.security.pki_dir == tmp_path / "tls"
    assert cluster.security.admin_password == (tmp_path / "tls" / "admin.password").read_text().strip()
    kafka = load_config(tmp_path / "client.toml", env={}).kafka
    assert kafka.bootstrap == "127.0.0.1:40001,127.0.0.1:40002,127.0.0.1:40003"
    assert (kafka.security_protocol, kafka.sasl_username) == ("SASL_SSL", ADMIN_USER)
    assert Path(kafka.ssl_cafile) == (tmp_path / "tls" / "ca.pem").resolve()
    assert cluster.security.admin_password not in (tmp_path / "client.toml").read_text()
    out = capsys.readouterr().out
    assert "SASL_SSL only" in out and out.strip().splitlines()[-1] == kafka.bootstrap
    assert len(BrokerInfo.load(tmp_path / "broker.json").nodes) == 3


def test_a_plain_cluster_start_drops_a_stale_client_toml(tmp_path, monkeypatch):
    monkeypatch.setattr(kafka_broker, "LocalCluster", FakeCluster)
    FakeCluster.made.clear()
    (tmp_path / "client.toml").write_text("[kafka]\n")  # left by an earlier secure broker

    assert main(["broker", "start", "--brokers", "3", "--state-dir", str(tmp_path)]) == 0

    assert FakeCluster.made[0].security is None
    assert not (tmp_path / "client.toml").exists()  # `status` would otherwise log in over TLS
