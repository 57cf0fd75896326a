"""Fuzz target: the MQTT bridge (``pipeline.bridge.MqttBridge``) routing MQTT messages to Kafka,
and the MQTT topic patterns it reads devices from (``streams.mqtt.MqttTopics``).

Input: a mode byte, then frames. Mode bits 0-1 pick the job (one topic per device or a
shared topic; one pattern or two with ``+``/``#``); bit 2 makes the first frame's topic a
pattern to parse instead of a message. Each frame: an op byte (bit 0: QoS 1, else 0;
bits 1-7: where Kafka's confirmation of this message goes in the confirmation order),
a topic length byte, the topic (UTF-8, undecodable bytes replaced, as an MQTT client would
refuse them), a u16 little-endian payload length and the payload. The messages go through
``_on_message`` against a stand-in producer and MQTT client; then Kafka confirms them in
the order the op bytes say.

Allowed to escape: nothing (``TopicNameError`` only from parsing a pattern). Broken if a
message is written anywhere but its device's topic (bytes unchanged, keyed by device) or
``sensors.dlq`` with a known reason; if a dead letter's device is not ``(none)`` or a valid
id; if the QoS 1 packet ids are not acknowledged exactly once each, in arrival order; or
if per device ``received != forwarded + dead-lettered`` once everything is confirmed.
"""

from __future__ import annotations

from types import SimpleNamespace

from edgestream.job.config import load_config
from edgestream.monitoring.metrics import BRIDGE_DEAD_REASONS, Metrics
from edgestream.pipeline.bridge import DEAD_LETTER_HEAD_BYTES, MqttBridge
from edgestream.streams import topics
from edgestream.streams.errors import TopicNameError
from edgestream.streams.mqtt import MqttTopics
from tests.fuzz.targets import FuzzFinding

MAX_LEN = 4096
ALLOWED: tuple[type[BaseException], ...] = ()
MAX_BYTES = 256  # limits.max_record_message_bytes of the fuzzed jobs

JOBS = (
    ["input.topic=plant.{device}.imu", "mqtt.topics=gw/{device}/imu"],
    ["input.topic=plant.{device}.imu", "mqtt.topics=gw/+/{device}/#,hall/{device}"],
    ["input.topic=fleet", "kafka.ingest_source=direct", "mqtt.topics=gw/{device}/imu"],
    ["input.topic=fleet", "kafka.ingest_source=direct", "mqtt.topics=gw/+/{device}/#,hall/{device}"],
)


class _Future:
    def __init__(self) -> None:
        self.callbacks: list = []

    def add_callback(self, fn, *args) -> None:  # as kafka-python's: fn(*args, value)
        self.callbacks.append(lambda value: fn(*args, value))

    def add_errback(self, fn, *args) -> None:
        pass


class _Producer:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, topic, key=None, value=None, headers=None):
        future = _Future()
        self.sent.append((topic, key, value, dict(headers or []), future))
        return future


class _Client:
    def __init__(self) -> None:
        self.acked: list[int] = []

    def ack(self, mid: int, qos: int) -> None:
        self.acked.append(mid)


def _bridge(mode: int) -> MqttBridge:
    cfg = load_config(overrides=["job.name=f", "devices.ids=a,b-1,c_2", "devices.count=3", "workers.count=1",
                                 "mqtt.max_in_flight=65535", f"limits.max_record_message_bytes={MAX_BYTES}",
                                 *JOBS[mode & 3]], env={})
    bridge = MqttBridge(cfg, "unused:9092", Metrics())
    bridge.producer, bridge.client = _Producer(), _Client()
    return bridge


def _frames(data: bytes):
    i = 0
    while i + 2 <= len(data):
        op, n = data[i], data[i + 1]
        topic = data[i + 2 : i + 2 + n].decode("utf-8", errors="replace")
        i += 2 + n
        size = int.from_bytes(data[i : i + 2], "little")
        payload = data[i + 2 : i + 2 + size]
        i += 2 + size
        yield op, topic, payload


def _check_pattern(pattern: str) -> None:
    try:
        parsed = MqttTopics([pattern])
    except TopicNameError:
        return
    level = pattern.split("/").index("{device}")
    topic = "/".join("dev" if i == level else ("x" if p in ("+", "#") else p)
                     for i, p in enumerate(pattern.split("/")))
    if parsed.device_of(topic) != "dev":
        raise FuzzFinding(f"pattern {pattern!r} reads {parsed.device_of(topic)!r} from {topic!r}, not 'dev'")


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, frames = data[0], list(_frames(data[1:]))
    if mode & 4 and frames:
        _check_pattern(frames[0][1])
        frames = frames[1:]
    bridge = _bridge(mode)
    layout = bridge.layout
    qos1: list[int] = []
    for n, (op, topic, payload) in enumerate(frames):
        qos = op & 1
        mid = n % 65535 + 1
        if qos:
            qos1.append(mid)
        bridge._on_message(None, None, SimpleNamespace(topic=topic, payload=payload, mid=mid, qos=qos))
    sent = bridge.producer.sent
    if len(sent) != len(frames):
        raise FuzzFinding(f"{len(frames)} messages, {len(sent)} writes")
    for (_op, topic, payload), (kafka_topic, key, value, headers, _f) in zip(frames, sent, strict=True):
        if kafka_topic == topics.SENSOR_DLQ:
            reason = headers.get(topics.DLQ_HEADER_REASON, b"").decode()
            if reason not in BRIDGE_DEAD_REASONS:
                raise FuzzFinding(f"dead letter of {topic!r} with reason {reason!r}")
            if value != (payload[:DEAD_LETTER_HEAD_BYTES] if reason == "too_large" else payload):
                raise FuzzFinding(f"dead letter of {topic!r} does not hold the message")
            continue
        device = bridge.topics.device_of(topic)
        if device is None or key != device.encode() or value != payload or len(payload) > MAX_BYTES:
            raise FuzzFinding(f"{topic!r} ({len(payload)} bytes) forwarded to {kafka_topic!r} keyed {key!r}")
        if kafka_topic != layout.topic(device):
            raise FuzzFinding(f"{topic!r} forwarded to {kafka_topic!r}, not {layout.topic(device)!r}")
    order = sorted(range(len(sent)), key=lambda k: (frames[k][0] >> 1, k))
    for k in order:
        for fn in sent[k][4].callbacks:
            fn(None)
    if bridge.client.acked != qos1:
        raise FuzzFinding(f"acknowledged {bridge.client.acked[:8]}..., received QoS 1 {qos1[:8]}...")
    report = bridge.report
    if report.unbalanced() or report.in_flight():
        raise FuzzFinding(f"unbalanced: {report.unbalanced()}")
    for device in report.dead:
        if device != "(none)":
            try:
                layout.topic(device)
            except TopicNameError:
                raise FuzzFinding(f"dead letters counted under an invalid device id {device!r}") from None


def _frame(op: int, topic: str, payload: bytes) -> bytes:
    raw = topic.encode()
    return bytes([op, len(raw)]) + raw + len(payload).to_bytes(2, "little") + payload


def seeds() -> dict[str, bytes]:
    """Good messages of the job's devices, each kind of dead letter, both QoS, confirmations
    out of order, and a few patterns to parse."""
    good = b"".join(_frame(1 | (k % 3) << 1, f"gw/{d}/imu", b'{"x": 1}') for k, d in enumerate(["a", "b-1", "c_2"]))
    bad = (_frame(1, "gw//imu", b"{}") + _frame(0, "gw/a.b/imu", b"{}") + _frame(1, "gw/zz/imu", b"{}")
           + _frame(3, "gw/a/imu", b"x" * 300) + _frame(1, "other/a", b"{}"))
    deep = _frame(1, "gw/line/a/t/raw", b"1") + _frame(5, "hall/b-1", b"2") + _frame(1, "gw/line/new/x", b"3")
    return {
        "per_device": bytes([0]) + good + bad,
        "shared": bytes([2]) + good + bad,
        "patterns_deep": bytes([1]) + deep,
        "shared_deep": bytes([3]) + deep + good,
        "pattern_ok": bytes([4]) + _frame(0, "a/+/{device}/#", b"") + good,
        "pattern_bad": bytes([6]) + _frame(0, "a/#/{device}", b"") + bad,
    }


def dictionary() -> list[bytes]:
    return [b"{device}", b"/", b"+", b"#", b"gw/", b"/imu", b"hall/", b"$SYS", b"a", b"b-1", b"c_2"]
