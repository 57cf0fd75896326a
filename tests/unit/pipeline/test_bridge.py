"""The MQTT bridge's routing, acknowledgements, retries and backpressure (pipeline/bridge.py),
with a stand-in producer and MQTT client: no broker. tests/integration/test_mqtt_bridge.py
runs it against a real Mosquitto and Kafka."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from edgestream.job.config import load_config
from edgestream.monitoring.metrics import Metrics
from edgestream.pipeline.bridge import HEADER_MQTT_TOPIC, MqttBridge
from edgestream.streams import topics


class Future:
    def __init__(self) -> None:
        self.ok: list = []
        self.err: list = []

    def add_callback(self, fn, *args):  # as kafka-python's: fn(*args, value)
        self.ok.append(lambda value: fn(*args, value))

    def add_errback(self, fn, *args):
        self.err.append(lambda exc: fn(*args, exc))

    def succeed(self):
        for fn in self.ok:
            fn(None)

    def fail(self, exc):
        for fn in self.err:
            fn(exc)


class Producer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes | None, bytes, dict, Future]] = []
        self.refuse = 0  # sends that raise (buffer full, no metadata)

    def send(self, topic, key=None, value=None, headers=None):
        if self.refuse:
            self.refuse -= 1
            raise TimeoutError("no metadata")
        future = Future()
        self.sent.append((topic, key, value, dict(headers), future))
        return future


class Client:
    def __init__(self) -> None:
        self.acked: list[int] = []

    def ack(self, mid, qos):
        assert qos == 1
        self.acked.append(mid)


def bridge(*overrides: str) -> MqttBridge:
    cfg = load_config(overrides=["job.name=j", "devices.ids=a,b", "devices.count=2", "input.topic=plant.{device}.imu",
                                 "mqtt.topics=gw/{device}/imu", "mqtt.max_in_flight=4",
                                 "limits.max_record_message_bytes=2048", *overrides], env={})
    b = MqttBridge(cfg, "unused:9092", Metrics())
    b.producer, b.client = Producer(), Client()
    return b


def message(topic: str, payload: bytes, mid: int, qos: int = 1):
    return SimpleNamespace(topic=topic, payload=payload, mid=mid, qos=qos)


def test_a_message_goes_unchanged_to_its_devices_topic_keyed_by_device_and_is_acked_after_kafka():
    b = bridge()
    b._on_message(None, None, message("gw/a/imu", b'{"x": 1}', mid=5))
    topic, key, value, headers, future = b.producer.sent[0]
    assert (topic, key, value) == ("plant.a.imu", b"a", b'{"x": 1}')
    assert headers[HEADER_MQTT_TOPIC] == b"gw/a/imu"
    assert b.client.acked == []  # not before Kafka has it
    future.succeed()
    assert b.client.acked == [5]
    assert b.report.received == {"a": 1} and b.report.forwarded == {"a": 1} and b.report.in_flight() == 0


def test_acks_follow_arrival_order_when_kafka_confirms_out_of_order():
    b = bridge()
    for mid, device in ((1, "a"), (2, "b"), (3, "a")):
        b._on_message(None, None, message(f"gw/{device}/imu", b"{}", mid))
    futures = [s[4] for s in b.producer.sent]
    futures[1].succeed()  # b's partition answers first
    futures[2].succeed()
    assert b.client.acked == []
    futures[0].succeed()
    assert b.client.acked == [1, 2, 3]


@pytest.mark.parametrize("topic, payload, device, reason", [
    ("gw//imu", b"{}", "(none)", "bad_device"),  # empty device level
    ("gw/a.b/imu", b"{}", "(none)", "bad_device"),  # '.' cannot be in a device id
    ("gw/stranger/imu", b"{}", "stranger", "unknown_device"),  # one topic per device: not the job's
    ("gw/a/imu", b"x" * 3000, "a", "too_large"),
])
def test_what_has_no_device_topic_is_dead_lettered_with_its_reason_then_acked(topic, payload, device, reason):
    b = bridge()
    b._on_message(None, None, message(topic, payload, mid=9))
    kafka_topic, _key, value, headers, future = b.producer.sent[0]
    assert kafka_topic == topics.SENSOR_DLQ
    assert headers[topics.DLQ_HEADER_REASON] == reason.encode()
    assert headers[topics.DLQ_HEADER_TOPIC] == f"mqtt:{topic}".encode()
    assert value == payload[:1024]
    future.succeed()
    assert b.client.acked == [9]
    assert b.report.dead == {device: {reason: 1}} and b.report.unbalanced() == {}
    assert b.metrics.bridge_dead_letters.labels(device, reason)._value.get() == 1


def test_a_shared_topic_takes_any_device_keyed_by_its_id():
    b = bridge("input.topic=readings", "kafka.ingest_source=direct", "workers.count=1")
    b._on_message(None, None, message("gw/stranger/imu", b"{}", mid=1))
    assert b.producer.sent[0][:2] == ("readings", b"stranger")


def test_qos0_messages_are_forwarded_and_never_acked():
    b = bridge()
    b._on_message(None, None, message("gw/a/imu", b"{}", mid=0, qos=0))
    b.producer.sent[0][4].succeed()
    assert b.client.acked == [] and b.report.forwarded == {"a": 1}


def test_a_failed_write_is_tried_again_and_acked_only_once_written():
    b = bridge()
    b.producer.refuse = 1
    b._on_message(None, None, message("gw/a/imu", b"{}", mid=3))  # send raises: to the retry queue
    assert b.producer.sent == [] and b.retry.qsize() == 1
    stop = threading.Event()
    b.run(stop, until=0.0)  # returns at once: nothing resent yet
    threading.Thread(target=lambda: b.run(stop), daemon=True).start()
    deadline = threading.Event()
    for _ in range(100):  # the retry waits RETRY_PAUSE_S, then sends
        if b.producer.sent:
            break
        deadline.wait(0.05)
    stop.set()
    assert len(b.producer.sent) == 1
    b.producer.sent[0][4].fail(RuntimeError("leader moved"))  # its future fails: again to the queue
    assert b.retry.qsize() == 1 and b.client.acked == []
    assert b.report.retries == 2


def test_past_max_in_flight_the_mqtt_thread_waits_for_kafka():
    b = bridge()
    for mid in range(1, 5):
        b._on_message(None, None, message("gw/a/imu", b"{}", mid))
    fifth = threading.Thread(target=b._on_message, args=(None, None, message("gw/a/imu", b"{}", 5)))
    fifth.start()
    fifth.join(0.3)
    assert fifth.is_alive() and len(b.producer.sent) == 4  # waits: 4 in flight
    b.producer.sent[0][4].succeed()
    fifth.join(5)
    assert not fifth.is_alive() and len(b.producer.sent) == 5


def test_after_close_begins_messages_are_neither_forwarded_nor_acked():
    b = bridge()
    b._closing.set()
    b._on_message(None, None, message("gw/a/imu", b"{}", mid=1))
    assert b.producer.sent == [] and b.report.received == {}
