"""The local Kafka cluster's layout (node ids, quorum, listeners, replication settings),
the replication decision for topics, broker.json, and `broker` argument errors. No JVM:
the clusters here are built, never started."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from edgestream.cli.main import main
from edgestream.deploy.kafka.broker import (
    BrokerInfo,
    LocalBroker,
    LocalCluster,
    NodeInfo,
    replication_for,
)
from edgestream.pipeline import kafka_io
from tests.unit.pipeline.test_probe_and_topics import FakeAdmin


@pytest.mark.parametrize(("brokers", "expected"), [(1, (1, 1)), (2, (2, 1)), (3, (3, 2)), (5, (3, 2))])
def test_replication_follows_the_cluster_size(brokers, expected):
    assert replication_for(brokers) == expected


def test_replication_for_no_broker_is_an_error():
    with pytest.raises(ValueError, match="at least one broker"):
        replication_for(0)


def test_three_nodes_are_three_voters_and_brokers_with_one_cluster_id(tmp_path):
    cluster = LocalCluster(tmp_path, brokers=3)

    props = [node.properties() for node in cluster.nodes]
    assert [p["node.id"] for p in props] == ["1", "2", "3"]
    assert all(p["process.roles"] == "broker,controller" for p in props)
    voters = {p["controller.quorum.voters"] for p in props}
    assert len(voters) == 1  # every node names the same quorum
    (quorum,) = voters
    assert quorum == ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in cluster.nodes)
    assert len({n.port for n in cluster.nodes} | {n.controller_port for n in cluster.nodes}) == 6
    for node, p in zip(cluster.nodes, props, strict=True):
        assert p["listeners"] == f"PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}"
        assert p["advertised.listeners"] == f"PLAINTEXT://127.0.0.1:{node.port}"
        assert p["log.dirs"] == str(tmp_path.resolve() / f"node{node.node_id}" / "data")
        assert p["default.replication.factor"] == "3" and p["min.insync.replicas"] == "2"
        assert p["offsets.topic.replication.factor"] == "3"
        assert p["transaction.state.log.replication.factor"] == "3"
        assert p["transaction.state.log.min.isr"] == "2"
    assert {n.given_cluster_id for n in cluster.nodes} == {cluster.cluster_id}
    assert cluster.bootstrap == ",".join(f"127.0.0.1:{n.port}" for n in cluster.nodes)
    assert cluster.index_of(2) == 1


def test_a_two_node_cluster_replicates_twice_and_needs_one_in_sync(tmp_path):
    props = LocalCluster(tmp_path, brokers=2).node(1).properties()

    assert props["default.replication.factor"] == "2" and props["min.insync.replicas"] == "1"
    assert props["offsets.topic.replication.factor"] == "2"


def test_testbed_hosts_use_fixed_ports_on_their_own_address_inside_their_namespace(tmp_path):
    hosts = ["10.77.0.2", "10.77.0.3", "10.77.0.4"]
    cluster = LocalCluster(tmp_path, hosts=hosts, netns=["b1", "b2", None], bind_host="0.0.0.0")

    assert cluster.bootstrap == "10.77.0.2:9092,10.77.0.3:9092,10.77.0.4:9092"
    props = cluster.node(0).properties()
    assert props["controller.quorum.voters"] == "1@10.77.0.2:9093,2@10.77.0.3:9093,3@10.77.0.4:9093"
    assert props["listeners"] == "PLAINTEXT://0.0.0.0:9092,CONTROLLER://10.77.0.2:9093"
    assert props["advertised.listeners"] == "PLAINTEXT://10.77.0.2:9092"
    for node in cluster.nodes:
        node.jar_dir = Path("/jars")
    assert cluster.node(0)._java("kafka.Kafka", "x")[:5] == ["ip", "netns", "exec", "b1", "java"]
    assert cluster.node(2)._java("kafka.Kafka", "x")[0] == "java"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"brokers": 0}, "at least 1 broker"),
    ({"hosts": ["10.0.0.1", "10.0.0.2"]}, "hosts lists 2 entries for 3 brokers"),
    ({"hosts": ["10.0.0.1"] * 3}, "share an address"),
    ({"ports": [9092, 9092, 9092]}, "share an address"),
])
def test_an_impossible_cluster_layout_is_refused_with_the_fix(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LocalCluster(tmp_path, **kwargs)


def test_a_single_broker_keeps_its_layout(tmp_path):
    broker = LocalBroker(tmp_path)
    props = broker.properties()

    assert props["node.id"] == "1"
    assert props["controller.quorum.voters"] == f"1@127.0.0.1:{broker.controller_port}"
    assert props["listeners"] == f"PLAINTEXT://127.0.0.1:{broker.port},CONTROLLER://127.0.0.1:{broker.controller_port}"
    assert props["offsets.topic.replication.factor"] == "1" and "min.insync.replicas" not in props
    assert broker.bootstrap == f"127.0.0.1:{broker.port}"


def test_a_bind_host_moves_only_the_client_listener(tmp_path):
    props = LocalBroker(tmp_path, host="10.1.0.5", bind_host="0.0.0.0", port=9092, controller_port=9093,
                        node_id=7).properties()

    assert props["listeners"] == "PLAINTEXT://0.0.0.0:9092,CONTROLLER://10.1.0.5:9093"
    assert props["advertised.listeners"] == "PLAINTEXT://10.1.0.5:9092"
    assert props["controller.quorum.voters"] == "7@10.1.0.5:9093"


def test_broker_json_of_a_single_broker_still_loads_and_a_cluster_round_trips(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"pid": 5, "bootstrap": "127.0.0.1:1", "controller_port": 2, "work_dir": "w",
                               "log_file": "l", "version": "4.1.1"}))
    assert BrokerInfo.load(old).nodes == [] and BrokerInfo.load(old).pids == [5]

    nodes = [NodeInfo(node_id=i, pid=100 + i, bootstrap=f"127.0.0.1:{i}", controller_port=i, work_dir="w",
                      log_file="l") for i in (1, 2, 3)]
    info = BrokerInfo(pid=101, bootstrap="a,b,c", controller_port=1, work_dir="w", log_file="l",
                      version="4.1.1", nodes=nodes)
    info.save(tmp_path / "cluster.json")
    loaded = BrokerInfo.load(tmp_path / "cluster.json")
    assert loaded == info and loaded.pids == [101, 102, 103]


def test_new_topics_on_three_brokers_get_three_replicas_and_two_in_sync(monkeypatch):
    admin = FakeAdmin({}, brokers=3)
    monkeypatch.setattr(kafka_io, "admin_client", lambda bootstrap: admin)

    kafka_io.ensure_topics("x:1", {"sensors.d0": "sensors", "gradients.j": "gradients", "models.j": "models"})

    assert {name: spec["replication_factor"] for name, spec in admin.specs.items()} == {
        "sensors.d0": 3, "gradients.j": 3, "models.j": 3}
    assert all(spec["configs"]["min.insync.replicas"] == "2" for spec in admin.specs.values())
    assert admin.specs["models.j"]["configs"]["cleanup.policy"] == "compact"  # kind configs kept


def test_new_topics_on_one_broker_are_created_as_before(monkeypatch):
    admin = FakeAdmin({}, brokers=1)
    monkeypatch.setattr(kafka_io, "admin_client", lambda bootstrap: admin)

    kafka_io.ensure_topics("x:1", {"sensors.d0": "sensors"})

    assert admin.specs["sensors.d0"]["replication_factor"] == 1
    assert "min.insync.replicas" not in admin.specs["sensors.d0"]["configs"]


def test_an_old_unreplicated_topic_is_kept_with_a_warning(monkeypatch, caplog):
    admin = FakeAdmin({"sensors.d0": (1, "delete")}, brokers=3)
    monkeypatch.setattr(kafka_io, "admin_client", lambda bootstrap: admin)

    with caplog.at_level(logging.WARNING, logger="edgestream.pipeline.kafka_io"):
        created = kafka_io.ensure_topics("x:1", {"sensors.d0": "sensors"})

    assert created == [] and admin.specs == {}
    assert "topic sensors.d0 has replication factor 1, below the cluster's 3" in caplog.text


def test_zero_brokers_is_an_argument_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["broker", "start", "--brokers", "0", "--state-dir", str(tmp_path)])

    assert exited.value.code == 2
    assert "--brokers: must be 1 (a single broker) or more" in capsys.readouterr().err


def test_a_port_for_a_cluster_is_refused_saying_to_drop_it(tmp_path, capsys):
    code = main(["broker", "start", "--brokers", "3", "--port", "9092", "--state-dir", str(tmp_path)])

    assert code == 2
    err = capsys.readouterr().err
    assert "--port sets the port of a single broker" in err and "drop --port" in err
    assert not (tmp_path / "broker.json").exists()
