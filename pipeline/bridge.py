"""The MQTT edge bridge (`edgestream bridge mqtt`): MQTT topics into the job's Kafka device topics.

Devices behind an edge gateway publish readings to an MQTT broker; the bridge subscribes
to the job's MQTT topic patterns (``mqtt.topics``, the device read from one level) and
writes each message, bytes unchanged, to that device's Kafka topic (``input.topic``, keyed
by device) with the idempotent producer. Delivery is at least once end to end:

- a QoS 1 message is acknowledged to MQTT only once Kafka has acknowledged it (or its dead
  letter), in the order the messages came (``streams.mqtt.AckOrder``);
- the MQTT session is persistent (a fixed client id, ``clean_start`` off, a session expiry),
  so the MQTT broker keeps what the bridge has not acknowledged while the bridge, or the
  connection, is away, and sends it again: a message may reach Kafka twice (a record id in
  the readings lets the workers drop the copy: ``input.record_id``, ``data.duplicate_window``);
- backpressure: at most ``mqtt.max_in_flight`` messages are unacknowledged (MQTT 5 Receive
  Maximum, which the MQTT broker honours; the bridge also waits itself past it);
- a Kafka write that fails is tried again until it succeeds or the bridge stops; a message
  never written is never acknowledged.

Messages that cannot go to a device topic are written to ``sensors.dlq`` with the reason
(``bad_device``: no device in the topic, or an id Kafka cannot name; ``unknown_device``:
a device the job does not list, with one topic per device; ``too_large``: above
``limits.max_record_message_bytes``; its first KiB only) and the MQTT topic in headers.
Per device, ``received = forwarded + dead-lettered + in flight`` (metrics and the report).
"""

from __future__ import annotations

import functools
import logging
import queue
import socket
import ssl
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgestream.job.config import JobConfig
from edgestream.monitoring.metrics import BRIDGE_DEAD_REASONS, Metrics
from edgestream.pipeline.ingest import UNKNOWN_DEVICE
from edgestream.streams import topics
from edgestream.streams.errors import TopicNameError
from edgestream.streams.mqtt import AckOrder, MqttTopics

log = logging.getLogger(__name__)

#: Header of a forwarded message naming the MQTT topic it came from.
HEADER_MQTT_TOPIC = "edgestream.mqtt.topic"
#: Bytes of a too-large message kept in its dead letter.
DEAD_LETTER_HEAD_BYTES = 1024
#: Seconds a send may block on a full producer buffer or missing metadata before the
#: message goes to the retry queue (the MQTT network thread must keep turning).
SEND_BLOCK_MS = 2000
#: Seconds between the tries of the Kafka writes that failed (all those failed meanwhile go together).
RETRY_PAUSE_S = 1.0
#: MQTT topics (and devices) whose route and metric children are kept at once.
ROUTE_CACHE = 65_536
#: How long the producer itself keeps trying a write (Kafka's default: two minutes).
DELIVERY_TIMEOUT_MS = 120_000
#: First and longest wait between MQTT reconnects.
RECONNECT_MIN_S, RECONNECT_MAX_S = 1, 10


class BridgeError(RuntimeError):
    """The bridge cannot start (MQTT broker unreachable, bad credentials file): one line."""


@dataclass
class BridgeReport:
    received: Tally = field(default_factory=Tally)
    forwarded: Tally = field(default_factory=Tally)
    dead: dict[str, Tally] = field(default_factory=dict)  # device -> reason -> messages
    connects: int = 0
    retries: int = 0

    def in_flight(self) -> int:
        return sum(self.received.values()) - sum(self.forwarded.values()) - sum(
            sum(r.values()) for r in self.dead.values())

    def unbalanced(self) -> dict[str, int]:
        """Devices whose received != forwarded + dead-lettered, and by how much (in flight)."""
        out = {}
        for device, got in self.received.items():
            gap = got - self.forwarded[device] - sum(self.dead.get(device, Tally()).values())
            if gap:
                out[device] = gap
        return out


@dataclass
class _Pending:
    """A message on its way to Kafka."""

    token: tuple[int, int] | None  # AckOrder ticket (QoS 1), None for QoS 0
    qos: int
    device: str
    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]
    reason: str | None = None  # a dead letter's reason


class MqttBridge:
    """One bridge process: an MQTT client (its own network thread), a Kafka producer (its own
    I/O thread) and ``run`` on the caller's thread (retries, progress, stop)."""

    def __init__(self, cfg: JobConfig, bootstrap: str, metrics: Metrics) -> None:
        self.cfg = cfg
        self.mq = cfg.mqtt
        self.bootstrap = bootstrap
        self.metrics = metrics
        self.topics = MqttTopics(list(self.mq.topics))
        self.layout = cfg.input.layout()
        self.known = None if self.layout.keyed else frozenset(cfg.devices.device_ids())
        self.max_bytes = cfg.limits.max_record_message_bytes
        self.client_id = self.mq.client_id or f"edgestream-bridge-{cfg.job.name}"
        self.report = BridgeReport()
        self.acks = AckOrder()
        # Held from taking the packet ids to acknowledge until they are queued on the
        # connection, and by the MQTT thread when a connection ends: an id of an old
        # connection must never go out on a new one (where it may name another message).
        self._ack_lock = threading.Lock()
        self.retry: queue.Queue[_Pending] = queue.Queue()
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._in_flight = 0  # sent to Kafka, not yet acknowledged by it
        self._closing = threading.Event()
        self.producer: Any = None
        self.client: Any = None
        self.connected = threading.Event()
        self._subscribed = threading.Event()
        self._refused: str | None = None  # why the MQTT broker refused the connection or subscription
        for reason in BRIDGE_DEAD_REASONS:
            self.metrics.bridge_dead_letters.labels(UNKNOWN_DEVICE, reason)
        # Per message, the same topics come again and again: route and count from caches
        # (bounded: a topic's answer never changes, and the least used go first).
        self._destination = functools.lru_cache(maxsize=ROUTE_CACHE)(self._destination)  # type: ignore[method-assign]
        self._received_of = functools.lru_cache(maxsize=ROUTE_CACHE)(self.metrics.bridge_received.labels)
        self._forwarded_of = functools.lru_cache(maxsize=ROUTE_CACHE)(self.metrics.bridge_forwarded.labels)
        self.metrics.bridge_in_flight.set_function(lambda: self._in_flight)

    # --- start / stop ----------------------------------------------------------------------
    def start(self, connect_timeout_s: float = 10.0) -> None:
        """Probe the MQTT broker (one line if it does not answer), create the Kafka topics and
        producer, connect, subscribe; return once subscribed."""
        host, port = self.mq.address()
        try:
            socket.create_connection((host, port), timeout=connect_timeout_s).close()
        except OSError as exc:
            raise BridgeError(f"cannot reach the MQTT broker at {host}:{port}: {exc}. Start it (e.g. "
                              "`mosquitto -p 1883`) or set mqtt.broker / --mqtt") from None
        password = None
        if self.mq.password_file:
            try:
                password = Path(self.mq.password_file).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise BridgeError(f"mqtt.password_file: cannot read {self.mq.password_file}: {exc}") from None
        self._ensure_topics()
        self.producer = self._default_producer()
        self.client = self._mqtt_client(password)
        self.client.connect_async(host, port, keepalive=self.mq.keepalive_s, clean_start=False,
                                  properties=self._connect_properties())
        self.client.loop_start()
        deadline = time.monotonic() + connect_timeout_s
        while not self._subscribed.wait(0.1):
            if self._refused is not None:
                raise BridgeError(f"the MQTT broker at {host}:{port} refused the bridge: {self._refused}")
            if time.monotonic() > deadline:
                raise BridgeError(f"the MQTT broker at {host}:{port} did not accept the bridge's session within "
                                  f"{connect_timeout_s:.0f}s")

    def _ensure_topics(self) -> None:
        from edgestream.job.topics import sensor_partitions, sensor_topics_for
        from edgestream.pipeline.kafka_io import ensure_topics

        ensure_topics(self.bootstrap, sensor_topics_for(self.cfg.devices.device_ids(), self.layout),
                      sized=sensor_partitions(self.cfg))

    def _default_producer(self) -> Any:
        from edgestream.pipeline.kafka_io import producer

        # The producer retries a write for DELIVERY_TIMEOUT_MS (a broker restart fits in it);
        # past that the bridge sends it again itself (``run``).
        return producer(self.bootstrap, max_message_bytes=max(self.max_bytes, DEAD_LETTER_HEAD_BYTES) + 4096,
                        client_id=f"edgestream-bridge-{self.cfg.job.name}", max_block_ms=SEND_BLOCK_MS,
                        request_timeout_ms=15_000, delivery_timeout_ms=DELIVERY_TIMEOUT_MS, linger_ms=5)

    def _connect_properties(self) -> Any:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = int(self.mq.session_expiry_s)
        props.ReceiveMaximum = int(self.mq.max_in_flight)
        return props

    def _mqtt_client(self, password: str | None) -> Any:
        import paho.mqtt.client as mqtt

        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id,
                             protocol=mqtt.MQTTv5, manual_ack=True)
        if self.mq.username:
            client.username_pw_set(self.mq.username, password)
        if self.mq.cafile:
            client.tls_set(ca_certs=self.mq.cafile, cert_reqs=ssl.CERT_REQUIRED)
        client.reconnect_delay_set(RECONNECT_MIN_S, RECONNECT_MAX_S)
        client.max_inflight_messages_set(self.mq.max_in_flight)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_subscribe = self._on_subscribe
        return client

    def close(self, grace_s: float) -> None:
        """Stop taking messages, wait up to ``grace_s`` for Kafka to acknowledge what is in
        flight (acknowledging it to MQTT), then disconnect. What is left unacknowledged the
        MQTT broker sends again to the next session."""
        self._closing.set()
        with self._room:
            self._room.notify_all()
        deadline = time.monotonic() + grace_s
        if self.producer is not None:
            try:
                self.producer.flush(timeout=max(0.1, grace_s))
            except Exception as exc:  # noqa: BLE001 - a stop: say it, go on
                log.warning("bridge: Kafka flush at stop: %s", exc)
        with self._room:
            while self._in_flight and time.monotonic() < deadline:
                self._room.wait(0.1)
        if self.client is not None:
            self.client.disconnect()
            self.client.loop_stop()
        if self.producer is not None:
            self.producer.close(timeout=1)

    # --- MQTT callbacks (the MQTT network thread) ---------------------------------------------
    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            self._refused = str(reason_code)
            log.warning("bridge: MQTT broker refused the connection: %s", reason_code)
            return
        with self._ack_lock:
            self.acks.reconnected()
        self.report.connects += 1
        self.metrics.bridge_mqtt_connects.inc()
        self.metrics.bridge_mqtt_connected.set(1)
        self.connected.set()
        log.info("bridge: connected to MQTT (session present: %s)", flags.session_present)
        from paho.mqtt.subscribeoptions import SubscribeOptions

        client.subscribe([(f, SubscribeOptions(qos=self.mq.qos)) for f in self.topics.filters])

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        bad = [str(rc) for rc in reason_codes if rc.is_failure]
        if bad:
            self._refused = f"subscription refused: {', '.join(bad)}"
            return
        self._subscribed.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        with self._ack_lock:
            voided = self.acks.reconnected()
        self.connected.clear()
        self.metrics.bridge_mqtt_connected.set(0)
        if not self._closing.is_set():
            log.warning("bridge: MQTT connection lost (%s); %d messages unacknowledged will come again; "
                        "reconnecting", reason_code, voided)

    def _on_message(self, client, userdata, message) -> None:
        if self._closing.is_set():
            return  # not acknowledged: the next session gets it
        token = self.acks.received(message.mid) if message.qos == 1 else None
        pending = self._route(token, message.qos, message.topic, message.payload)
        self._received_of(pending.device).inc()
        with self._room:  # backpressure: wait for room, but never past a stop
            self.report.received[pending.device] += 1
            while self._in_flight >= self.mq.max_in_flight and not self._closing.is_set():
                self._room.wait(0.5)
            self._in_flight += 1
        self._send(pending)

    def _destination(self, mqtt_topic: str) -> tuple[str | None, str, str | None, str | None]:
        """Where a message of ``mqtt_topic`` goes: (device or None, its Kafka topic, and the
        reason and detail of a dead letter, or None). Cached per topic (``__init__``)."""
        device = self.topics.device_of(mqtt_topic)
        if device is None:
            return None, "", "bad_device", f"MQTT topic {mqtt_topic!r} names no device by mqtt.topics"
        try:
            kafka_topic = self.layout.topic(device)
        except TopicNameError as exc:  # counted under "(none)": metric labels stay valid ids
            return None, "", "bad_device", str(exc)
        if self.known is not None and device not in self.known:
            return device, "", "unknown_device", (f"device {device!r} is not one of the job's devices "
                                                  "(devices.ids): its topic is read by no worker")
        return device, kafka_topic, None, None

    def _route(self, token, qos: int, mqtt_topic: str, payload: bytes) -> _Pending:
        device, kafka_topic, reason, detail = self._destination(mqtt_topic)
        headers = [(HEADER_MQTT_TOPIC, mqtt_topic.encode())]
        if reason is None and len(payload) > self.max_bytes:
            reason, detail = "too_large", (f"{len(payload)} bytes, above limits.max_record_message_bytes="
                                           f"{self.max_bytes}; the first {DEAD_LETTER_HEAD_BYTES} kept")
        key = device.encode() if device else None
        if reason is None:
            return _Pending(token, qos, device, kafka_topic, key, payload, headers)
        headers += [(topics.DLQ_HEADER_REASON, reason.encode()), (topics.DLQ_HEADER_DETAIL, detail.encode()[:1024]),
                    (topics.DLQ_HEADER_TOPIC, f"mqtt:{mqtt_topic}".encode()[:1024]),
                    (topics.DLQ_HEADER_PARTITION, b"-1"), (topics.DLQ_HEADER_OFFSET, b"-1"),
                    (topics.DLQ_HEADER_WORKER, self.client_id.encode())]
        value = payload[:DEAD_LETTER_HEAD_BYTES] if reason == "too_large" else payload
        return _Pending(token, qos, device or UNKNOWN_DEVICE, topics.SENSOR_DLQ, key, value, headers, reason)

    # --- Kafka ---------------------------------------------------------------------------------
    def _send(self, pending: _Pending) -> None:
        try:
            future = self.producer.send(pending.topic, key=pending.key, value=pending.value,
                                        headers=pending.headers)
        except Exception as exc:  # noqa: BLE001 - buffer full, no metadata: try again later
            self._failed(pending, exc)
            return
        future.add_callback(self._written_now, pending)
        future.add_errback(self._failed_now, pending)

    def _written_now(self, pending: _Pending, _metadata: Any) -> None:
        self._written(pending)

    def _failed_now(self, pending: _Pending, exc: BaseException) -> None:
        self._failed(pending, exc)

    def _written(self, pending: _Pending) -> None:
        if pending.reason is None:
            self._forwarded_of(pending.device).inc()
        else:
            self.metrics.bridge_dead_letters.labels(pending.device, pending.reason).inc()
            log.info("bridge: dead-lettered a message of %s: %s", pending.device, pending.reason)
        with self._room:
            if pending.reason is None:
                self.report.forwarded[pending.device] += 1
            else:
                self.report.dead.setdefault(pending.device, Tally())[pending.reason] += 1
            self._in_flight -= 1
            if self._in_flight == self.mq.max_in_flight - 1:
                self._room.notify_all()  # the MQTT thread may be waiting for room
        if pending.token is not None:
            with self._ack_lock:
                for mid in self.acks.done(pending.token):
                    self.client.ack(mid, 1)

    def _failed(self, pending: _Pending, exc: BaseException) -> None:
        self.metrics.bridge_kafka_retries.inc()
        with self._lock:
            self.report.retries += 1
        log.warning("bridge: Kafka write to %s failed (%s); trying again", pending.topic, exc)
        self.retry.put(pending)

    # --- the caller's thread -----------------------------------------------------------------
    def run(self, stop: threading.Event, *, until: float | None = None,
            tick: Callable[[BridgeReport], None] | None = None) -> BridgeReport:
        """Forward until ``stop`` is set (or the monotonic time ``until``); retries failed Kafka
        writes and calls ``tick`` about twice a second."""
        while not stop.is_set() and (until is None or time.monotonic() < until):
            try:
                failed = [self.retry.get(timeout=0.5)]
            except queue.Empty:
                failed = []
            if failed and not self._closing.is_set():
                stop.wait(RETRY_PAUSE_S)  # one pause for every write that failed meanwhile
                while True:
                    try:
                        failed.append(self.retry.get_nowait())
                    except queue.Empty:
                        break
                for pending in failed:
                    self._send(pending)
            if tick is not None:
                tick(self.report)
        return self.report
