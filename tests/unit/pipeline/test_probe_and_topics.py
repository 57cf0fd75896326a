"""The raw metadata probe against fake servers, and topic creation / layout checks against
a fake admin client (no broker)."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable

import pytest
from kafka.errors import TopicAlreadyExistsError, TopicAuthorizationFailedError

from edgestream.deploy.kafka.broker import free_port, host_port, is_broker_pid, metadata_ok, probe
from edgestream.pipeline import kafka_io
from edgestream.pipeline.kafka_io import TopicLayoutError, TopicSetupError


def metadata_reply(correlation_id: int, brokers: int) -> bytes:
    body = struct.pack(">iii", correlation_id, 0, brokers)
    for node in range(brokers):
        host = b"127.0.0.1"
        body += struct.pack(">ih", node, len(host)) + host + struct.pack(">ih", 9092, -1)
    return struct.pack(">i", len(body)) + body


class FakeServer:
    """A TCP server on 127.0.0.1 that answers one request with ``respond(request)``."""

    def __init__(self, respond: Callable[[bytes], bytes | None]) -> None:
        self.respond = respond
        self.requests: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            (size,) = struct.unpack(">i", conn.recv(4))
            request = conn.recv(size)
            self.requests.append(request)
            reply = self.respond(request)
            if reply is None:
                time.sleep(1.0)  # a server that never answers (within the probe's timeout)
            else:
                conn.sendall(reply)

    def close(self) -> None:
        self.sock.close()


def echo_brokers(brokers: int) -> Callable[[bytes], bytes]:
    return lambda request: metadata_reply(struct.unpack(">i", request[4:8])[0], brokers)


def test_probe_sends_a_metadata_v4_request_and_accepts_a_broker_list():
    server = FakeServer(echo_brokers(1))
    try:
        assert probe(server.address, timeout_s=2.0) is None
    finally:
        server.close()
    api_key, version = struct.unpack(">hh", server.requests[0][:4])
    assert (api_key, version) == (3, 4)


@pytest.mark.parametrize(("respond", "words"), [
    (echo_brokers(0), "lists no brokers"),
    (lambda request: b"HTTP/1.1 400 Bad Request\r\n\r\n", "is not a Kafka broker"),
    (lambda request: metadata_reply(12345, 1), "is not a Kafka broker"),
    (lambda request: b"", "connection closed"),
])
def test_probe_explains_what_is_wrong(respond, words):
    server = FakeServer(respond)
    try:
        problem = probe(server.address, timeout_s=2.0)
    finally:
        server.close()
    assert problem is not None and words in problem


def test_probe_of_a_silent_server_ends_at_its_timeout():
    server = FakeServer(lambda request: None)
    try:
        started = time.monotonic()
        problem = probe(server.address, timeout_s=0.3)
        took = time.monotonic() - started
    finally:
        server.close()
    assert problem is not None and "did not answer" in problem
    # A hang guard, not a timing: the server never answers, so only the probe's own
    # timeout ends the wait (generous beside 0.3 s for a loaded machine).
    assert took < 10.0


def test_probe_of_a_closed_port_is_refused_at_once_and_tries_every_server():
    dead = f"127.0.0.1:{free_port()}"
    assert "refused" in probe(dead, timeout_s=1.0)
    assert not metadata_ok(dead)
    server = FakeServer(echo_brokers(1))
    try:
        assert probe(f"{dead},{server.address}", timeout_s=2.0) is None
    finally:
        server.close()


def test_host_port_parsing():
    assert host_port("[::1]:9092") == ("::1", 9092)
    for bad in ("host", "host:", ":9092", "h:0", "h:70000", "h:x"):
        with pytest.raises(ValueError):
            host_port(bad)


def test_a_pid_that_is_not_a_kafka_jvm_is_not_the_broker():
    import os

    assert not is_broker_pid(os.getpid())


# --- topics --------------------------------------------------------------------------
class FakeAdmin:
    """The part of KafkaAdminClient that ensure_topics uses."""

    def __init__(self, topics: dict[str, tuple[int, str]], create_errors: dict[str, type] | None = None,
                 brokers: int = 1) -> None:
        self.topics = dict(topics)  # name -> (partitions, cleanup.policy)
        self.create_errors = create_errors or {}
        self.created: list[str] = []
        self.specs: dict[str, dict] = {}  # what create_topics was asked for, by name
        self.brokers = brokers

    def describe_cluster(self) -> dict:
        return {"brokers": [{"broker_id": i + 1, "is_fenced": False} for i in range(self.brokers)]}

    def list_topics(self) -> list[str]:
        return list(self.topics)

    def create_topics(self, new_topics: dict, raise_errors: bool = True) -> dict:
        out = []
        for name, spec in new_topics.items():
            error = self.create_errors.get(name)
            if error is None:
                self.topics[name] = (spec["num_partitions"], spec["configs"].get("cleanup.policy", "delete"))
                self.created.append(name)
                self.specs[name] = spec
            out.append({"name": name, "error_code": error.errno if error else 0,
                        "error_message": "denied" if error else None})
        return {"topics": out}

    def wait_for_topics(self, names: list[str]) -> None:
        assert set(names) <= set(self.topics)

    def describe_topics(self, names: list[str]) -> list[dict]:
        return [{"name": n, "error_code": 0, "partitions": [{"replica_nodes": [1]}] * self.topics[n][0]} for n in names]

    def describe_configs(self, resources, config_filter: str) -> dict:
        return {"topic": {r.name: {"cleanup.policy": {"value": self.topics[r.name][1]}} for r in resources}}

    def close(self) -> None:
        pass


WANTED = {"gradients.j": "gradients", "control.j": "gradients", "models.j": "models",
          "gradients.j.dlq": "dlq", "sensors.d0": "sensors"}


def ensure(monkeypatch, admin: FakeAdmin) -> list[str]:
    monkeypatch.setattr(kafka_io, "admin_client", lambda bootstrap: admin)
    return kafka_io.ensure_topics("fake:9092", WANTED)


def test_missing_topics_are_created_with_their_layout_and_existing_ones_kept(monkeypatch):
    admin = FakeAdmin({"sensors.d0": (3, "delete")})  # a replayed multi-partition device topic is fine

    assert sorted(ensure(monkeypatch, admin)) == sorted(set(WANTED) - {"sensors.d0"})
    assert admin.topics["models.j"] == (1, "compact") and admin.topics["gradients.j"][0] == 1
    assert ensure(monkeypatch, admin) == []  # idempotent


def test_a_concurrently_created_topic_is_not_an_error(monkeypatch):
    admin = FakeAdmin({"models.j": (1, "compact")}, create_errors={"control.j": TopicAlreadyExistsError})
    admin.topics["control.j"] = (1, "delete")  # the other process's

    ensure(monkeypatch, admin)


@pytest.mark.parametrize(("existing", "words"), [
    ({"gradients.j": (4, "delete")}, "topic gradients.j has 4 partitions but edgestream needs exactly 1"),
    ({"control.j": (2, "delete")}, "topic control.j has 2 partitions"),
    ({"models.j": (1, "delete")}, "topic models.j has cleanup.policy=delete but edgestream needs cleanup.policy=compact"),
])
def test_a_topic_with_the_wrong_layout_fails_at_once_naming_the_fix(monkeypatch, existing, words):
    with pytest.raises(TopicLayoutError) as failed:
        ensure(monkeypatch, FakeAdmin(existing))

    message = str(failed.value)
    assert words in message and "delete it" in message and "another job name" in message


def test_a_refused_creation_is_one_clear_error(monkeypatch):
    admin = FakeAdmin({}, create_errors={"gradients.j": TopicAuthorizationFailedError})

    with pytest.raises(TopicSetupError, match=r"cannot create topic\(s\) gradients.j: "
                                              r"TopicAuthorizationFailedError: denied; grant this client CREATE"):
        ensure(monkeypatch, admin)


class SlowMetadataAdmin(FakeAdmin):
    """A cluster whose broker describes a new topic's configuration only on the third ask
    (before that the topic is missing from its answer, as a broker without its metadata yet)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asks = 0

    def describe_configs(self, resources, config_filter: str) -> dict:
        self.asks += 1
        return super().describe_configs(resources, config_filter) if self.asks >= 3 else {"topic": {}}


def test_a_compacted_topic_the_broker_cannot_describe_yet_is_asked_again_not_refused(monkeypatch):
    admin = SlowMetadataAdmin({})
    ensure(monkeypatch, admin)
    assert admin.asks == 3 and admin.topics["models.j"][1] == "compact"
