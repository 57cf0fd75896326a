"""`edgestream bridge mqtt` against a real Mosquitto and the real Kafka broker (issue #33, point 5).

- From the command line: JSON readings published with QoS 1 to ``plant/<device>/imu`` land
  in each device's Kafka topic, bytes unchanged, keyed by device; a topic with no device,
  a device the job does not list and a message above the size limit go to sensors.dlq with
  their reason; the per-device counts balance (metrics and the report); SIGTERM exits 0.
- Faults mid-stream: Mosquitto stopped and restarted, the bridge SIGKILLed and started
  again, and the Kafka broker stopped for 10 s: every published reading reaches Kafka
  (copies only where QoS 1 allows them), and the bridge says how often it reconnected.
- Training through the bridge: readings of a device the job file does not name, published
  over MQTT to a shared topic, are trained on by the worker that owns the device's partition.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from edgestream.deploy.kafka.broker import LocalBroker, free_port
from edgestream.deploy.mqtt import LocalMosquitto
from edgestream.monitoring.scrape import scrape
from edgestream.pipeline.bridge import HEADER_MQTT_TOPIC
from edgestream.streams import topics
from tests.integration.jobs import read_topic, start_cli, stop_session, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def mosquitto(tmp_path):
    broker = LocalMosquitto(tmp_path / "mosquitto").start()
    try:
        yield broker
    finally:
        broker.kill()


class Publisher:
    """A device gateway: a persistent MQTT session publishing with QoS 1 (paho keeps and sends
    again what the MQTT broker has not acknowledged, across its restarts; a message published
    while disconnected waits in paho's queue)."""

    def __init__(self, broker: LocalMosquitto, name: str) -> None:
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name, clean_session=False,
                                  protocol=mqtt.MQTTv311)
        self.client.reconnect_delay_set(1, 2)
        self.client.max_queued_messages_set(0)
        self.client.max_inflight_messages_set(100)
        self.published = self.acknowledged = 0
        self.client.on_publish = self._acknowledged
        self.client.connect(broker.host, broker.port, keepalive=10)
        self.client.loop_start()

    def _acknowledged(self, client, userdata, mid, reason_code, properties) -> None:
        self.acknowledged += 1  # once per message, when the MQTT broker's PUBACK completes it

    def publish(self, topic: str, payload: bytes) -> None:
        info = self.client.publish(topic, payload, qos=1)
        assert info.rc in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN), info.rc  # NO_CONN: queued
        self.published += 1

    def all_acknowledged(self) -> bool:
        return self.acknowledged == self.published

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def reading(device: str, n: int, rng: np.random.Generator) -> bytes:
    return json.dumps({"pixels": rng.random(64).round(3).tolist(), "digit": int(rng.integers(10)),
                       "ts": int(time.time() * 1000), "n": n, "device": device}).encode()


def bridge_args(job: str, bootstrap: str, mosquitto: LocalMosquitto, devices: list[str], *extra: str) -> list[str]:
    sets = [f"job.name={job}", f"devices.ids={','.join(devices)}", f"devices.count={len(devices)}",
            f"input.topic={job}.{{device}}.imu", "input.format=json", "input.features_array=pixels",
            "input.label=digit", "input.record_id=n", f"mqtt.topics=plant{job}/{{device}}/imu",
            "mqtt.max_in_flight=50", "limits.max_record_message_bytes=8192", *extra]
    return ["bridge", "mqtt", "--bootstrap", bootstrap, "--mqtt", mosquitto.address,
            *[arg for s in sets for arg in ("--set", s)]]


def metrics_url(log: Path) -> str:
    found = wait_until(lambda: [line.split()[-1] for line in log.read_text().splitlines()
                                if line.startswith("bridge /metrics:")], 60, "the bridge to start",
                       lambda: log.read_text()[-2000:])
    return found[0]


def received(url: str) -> float:
    sample = scrape(url)
    return 0.0 if sample is None else sample.get("edgestream_bridge_received_messages_total")


def forwarded(url: str) -> float:
    sample = scrape(url)
    return 0.0 if sample is None else sample.get("edgestream_bridge_forwarded_messages_total")


def test_bridge_forwards_json_unchanged_and_dead_letters_what_has_no_device_topic(
        kafka_bootstrap, mosquitto, unique, tmp_path):
    job = f"b{unique}"
    devices = [f"d{unique}-{i}" for i in range(3)]
    log, report = tmp_path / "bridge.log", tmp_path / "report.json"
    proc = start_cli([*bridge_args(job, kafka_bootstrap, mosquitto, devices), "--report", str(report)], log)
    try:
        url = metrics_url(log)
        pub = Publisher(mosquitto, f"gw{unique}")
        rng = np.random.default_rng(1)
        sent: dict[str, list[bytes]] = {d: [] for d in devices}
        for n in range(200):
            for d in devices:
                payload = reading(d, n, rng)
                sent[d].append(payload)
                pub.publish(f"plant{job}/{d}/imu", payload)
        pub.publish(f"plant{job}/stranger{unique}/imu", b'{"pixels": []}')  # not one of the job's devices
        pub.publish(f"plant{job}//imu", b"{}")  # the device level is empty
        pub.publish(f"plant{job}/{devices[0]}/imu", b"[" + b"1," * 6000 + b"1]")  # above 8192 bytes
        wait_until(pub.all_acknowledged, 60, "Mosquitto to take every message")
        # Mosquitto acknowledging the publisher says nothing about the bridge having the last
        # three yet (they may trail the 600 forwarded ones): wait for both counts.
        wait_until(lambda: forwarded(url) >= 600 and received(url) >= 603, 60,
                   "the bridge to receive 603 messages and forward 600", lambda: (received(url), forwarded(url)))
        sample = scrape(url)
        assert sample.get("edgestream_bridge_received_messages_total") == 603
        assert sample.get("edgestream_bridge_dead_letter_messages_total") == 3
        assert sample.get("edgestream_bridge_in_flight_messages") == 0
        assert sample.get("edgestream_bridge_mqtt_up") == 1
        pub.close()
    finally:
        code = stop_session(proc)
    assert code == 0, log.read_text()[-3000:]
    counts = json.loads(report.read_text())
    assert counts["in_flight"] == 0 and counts["received"] == {
        **{d: 200 for d in devices}, devices[0]: 201, f"stranger{unique}": 1, "(none)": 1}
    assert counts["forwarded"] == {d: 200 for d in devices}
    assert counts["dead_lettered"] == {devices[0]: {"too_large": 1}, f"stranger{unique}": {"unknown_device": 1},
                                       "(none)": {"bad_device": 1}}
    for d in devices:
        records = read_topic(kafka_bootstrap, f"{job}.{d}.imu")
        assert [r.value for r in records] == sent[d]  # bytes unchanged, in order
        assert {r.key for r in records} == {d.encode()}
        assert dict(records[0].headers)[HEADER_MQTT_TOPIC] == f"plant{job}/{d}/imu".encode()
    letters = [r for r in read_topic(kafka_bootstrap, topics.SENSOR_DLQ)
               if dict(r.headers).get(topics.DLQ_HEADER_TOPIC, b"").startswith(f"mqtt:plant{job}/".encode())]
    reasons = Counter(dict(r.headers)[topics.DLQ_HEADER_REASON].decode() for r in letters)
    assert reasons == {"too_large": 1, "unknown_device": 1, "bad_device": 1}
    big = next(r for r in letters if dict(r.headers)[topics.DLQ_HEADER_REASON] == b"too_large")
    assert len(big.value) == 1024 and b"12003 bytes" in dict(big.headers)[topics.DLQ_HEADER_DETAIL]
    assert "bridged 603 MQTT messages of 5 devices: 600 forwarded" in " ".join(log.read_text().split())


def test_nothing_is_lost_across_mosquitto_and_bridge_restarts_and_a_kafka_outage(mosquitto, unique, tmp_path):
    kafka = LocalBroker(tmp_path / "kafka", port=free_port(), controller_port=free_port())
    kafka.start()
    job = f"f{unique}"
    devices = [f"d{unique}-{i}" for i in range(3)]
    per_device = 1500
    log, report = tmp_path / "bridge.log", tmp_path / "report.json"
    args = [*bridge_args(job, kafka.bootstrap, mosquitto, devices), "--report", str(report)]
    proc = start_cli(args, log)
    done = threading.Event()
    pub = Publisher(mosquitto, f"gw{unique}")
    try:
        url = metrics_url(log)

        def publish() -> None:  # about 300 messages/s for 15 s
            rng = np.random.default_rng(2)
            for n in range(per_device):
                for d in devices:
                    pub.publish(f"plant{job}/{d}/imu", reading(d, n, rng))
                if n % 20 == 19:
                    done.wait(0.2)  # the devices' pace, not a synchronisation
            done.set()

        threading.Thread(target=publish, daemon=True).start()
        wait_until(lambda: forwarded(url) >= 300, 60, "the bridge to forward")
        mosquitto.stop()  # SIGTERM: Mosquitto saves the sessions and their queues
        mosquitto.start()
        wait_until(lambda: forwarded(url) >= 1200, 90, "the bridge to reconnect and forward again",
                   lambda: forwarded(url))
        stop_session(proc, signal.SIGKILL)  # the bridge dies: its session waits in Mosquitto
        proc = start_cli(args, log)
        url = metrics_url_after(log, url)
        wait_until(lambda: forwarded(url) >= 300, 90, "the restarted bridge to forward")
        kafka.stop()
        threading.Event().wait(10.0)  # Kafka stays down for 10 s: the fault's length, not a synchronisation
        kafka.start()
        wait_until(done.is_set, 120, "the publisher to finish")
        wait_until(pub.all_acknowledged, 120, "Mosquitto to take every message")

        def all_in_kafka() -> bool:
            return all(len({json.loads(r.value)["n"] for r in read_topic(kafka.bootstrap, f"{job}.{d}.imu")})
                       == per_device for d in devices)

        def missing() -> str:
            gaps = {d: sorted(set(range(per_device)) - {json.loads(r.value)["n"] for r in read_topic(
                kafka.bootstrap, f"{job}.{d}.imu")}) for d in devices}
            return f"{ {d: (len(g), g[:1], g[-1:]) for d, g in gaps.items()} }; bridge log: {log.read_text()[-3000:]}"

        wait_until(all_in_kafka, 60, "every published reading to reach Kafka", missing)
        wait_until(lambda: (s := scrape(url)) is not None and s.get("edgestream_bridge_in_flight_messages") == 0,
                   60, "nothing in flight")
        code = stop_session(proc)
        assert code == 0, log.read_text()[-3000:]
        counts = json.loads(report.read_text())
        assert counts["in_flight"] == 0 and not counts["dead_lettered"]
        assert counts["received"] == counts["forwarded"]
        for d in devices:
            numbers = Counter(json.loads(r.value)["n"] for r in read_topic(kafka.bootstrap, f"{job}.{d}.imu"))
            assert set(numbers) == set(range(per_device))
            print(f"{d}: {sum(numbers.values())} messages in Kafka for {per_device} published "
                  f"({sum(numbers.values()) - per_device} copies)")
        text = " ".join(log.read_text().split())
        assert "MQTT connection lost" in text
    finally:
        done.set()
        pub.close()
        if proc.poll() is None:
            stop_session(proc, signal.SIGKILL)
        kafka.stop()


def metrics_url_after(log: Path, old: str) -> str:
    """The /metrics URL the newest bridge process of ``log`` printed (not ``old``)."""
    def newest() -> str | None:
        urls = [line.split()[-1] for line in log.read_text().splitlines() if line.startswith("bridge /metrics:")]
        return urls[-1] if urls and (len(urls) > 1 or urls[-1] != old) else None

    return wait_until(newest, 60, "the restarted bridge to start", lambda: log.read_text()[-2000:])


def test_a_device_publishing_over_mqtt_is_trained_on_through_the_bridge(kafka_bootstrap, mosquitto, unique,
                                                                        state_dir):
    """A device the job file does not name publishes JSON readings over MQTT; the bridge writes
    them to the shared topic keyed by its id, and the worker owning its partition trains on
    every one of them (its accounting balances, and nothing else met it)."""
    from edgestream.monitoring.metrics import Metrics
    from edgestream.pipeline.bridge import MqttBridge
    from edgestream.pipeline.run import RunContext, run_job
    from edgestream.streams.topics import TopicLayout
    from tests.integration.jobs import JSON_READINGS, quiet, show, steps_of, train_job, workers_of

    shared = f"plant{unique}.readings"
    ids = {}
    for i in range(100):  # one configured device in each partition: every worker trains
        ids.setdefault(TopicLayout.partition_of(f"d{unique}-{i}", 3), f"d{unique}-{i}")
    cfg = train_job(unique, state_dir, "train.strategy=scadles", f"input.topic={shared}", "input.partitions=3",
                    f"devices.ids={','.join(ids[p] for p in range(3))}", *JSON_READINGS,
                    f"mqtt.broker={mosquitto.address}", f"mqtt.topics=plant{unique}/{{device}}/imu")
    device = f"pump-{unique}"
    owner = cfg.worker_names()[TopicLayout.partition_of(device, 3) % 3]
    readings = 60
    bridged: dict = {}

    def publish(ctx: RunContext) -> None:
        wait_until(lambda: steps_of(ctx, owner) >= 3, 90, f"{owner} to train")
        bridge = MqttBridge(cfg, kafka_bootstrap, Metrics())
        bridge.start()
        stop = threading.Event()
        runner = threading.Thread(target=bridge.run, args=(stop,), daemon=True)
        runner.start()
        pub = Publisher(mosquitto, f"pump{unique}")
        rng = np.random.default_rng(3)
        try:
            for n in range(readings):
                pub.publish(f"plant{unique}/{device}/imu", reading(device, n, rng))
            wait_until(lambda: bridge.report.forwarded[device] == readings, 60, "the bridge to forward every reading")
        finally:
            pub.close()
            stop.set()
            runner.join(10)
            bridge.close(5)
        bridged.update(bridge.report.forwarded)

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=publish)
    show(result)
    assert bridged == {device: readings}
    assert result.balanced and workers_of(result)
    assert list(result.other_devices) == [device]
    mine = json.loads((state_dir / "workers" / owner / "accounting.json").read_text())["devices"][device]
    assert mine["messages_in"] == mine["records_in"] == readings
    assert mine["consumed"] + mine["pending"] == readings and mine["dead_letter_messages"] == 0
    assert mine["consumed"] > 0


def test_bridge_cli_errors_are_one_line(mosquitto, kafka_bootstrap, tmp_path):
    import subprocess
    import sys

    from tests.integration.jobs import REPO

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "edgestream", "bridge", "mqtt", "--bootstrap", kafka_bootstrap,
                               *args], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                              text=True, timeout=120)

    dead = run("--mqtt", f"127.0.0.1:{free_port()}", "--duration", "1")
    assert dead.returncode == 1 and "cannot reach the MQTT broker" in dead.stderr
    assert len(dead.stderr.strip().splitlines()) == 1, dead.stderr
    bad = run("--mqtt", mosquitto.address, "--topic", "plant/+/imu")
    assert bad.returncode == 2 and "must hold {device} once" in bad.stderr
    port = run("--mqtt", "localhost", "--duration", "1")
    assert port.returncode == 2 and "mqtt.broker must be host:port" in port.stderr
