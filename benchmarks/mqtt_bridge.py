"""The MQTT bridge's throughput against a plain subscribe-and-produce loop, and its latency.

A local Mosquitto (``deploy/mqtt.py``) and a local Kafka broker. For each round, a fresh
persistent MQTT session is created and left offline, N JSON readings (about 1 KiB: 64
features, a label, a time, a number) are published to it with QoS 1 (Mosquitto queues
them), then a consumer process connects and drains the queue into Kafka. Interleaved,
A B A B ...:

  A = the bridge (``pipeline.bridge.MqttBridge``, what `edgestream bridge mqtt` runs):
      device from the topic, dead-letter checks, ordered acknowledgements, metrics;
  B = a plain loop with the same clients and settings (paho-mqtt, MQTT 5, manual QoS 1
      acknowledgements, the same Receive Maximum; kafka-python's idempotent producer with
      ``acks=all``): each message is sent to Kafka and acknowledged to MQTT in Kafka's
      callback, nothing else.

Each is timed inside its process from the first message it receives to the last Kafka
acknowledgement, and reports messages/s. Then, with the bridge running, M readings are
published at a steady rate and the latency of each is taken from its publish time (in the
payload) to its Kafka append time (the topic keeps ``LogAppendTime``): p50, p90, p99.
Prints a markdown table and writes benchmarks/results/mqtt_bridge.{json,md}. Never asserts.

    python -m edgestream bench mqtt_bridge [--messages 30000] [--repeats 3] [--latency-messages 3000] [--rate 500]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEVICES = 4
RECEIVE_MAXIMUM = 1000

#: Consumer process: argv = kind, mqtt host, port, client id, bootstrap, topic prefix, expected,
#: devices, receive maximum.
CONSUMER = r"""
import json, sys, threading, time
kind, host, port, client_id, bootstrap, prefix, expected, n_devices, receive_max = sys.argv[1:10]
port, expected, n_devices, receive_max = int(port), int(expected), int(n_devices), int(receive_max)
done = threading.Event()
state = {"first": None, "n": 0}
if kind == "bridge":
    from edgestream.job.config import load_config
    from edgestream.monitoring.metrics import Metrics
    from edgestream.pipeline.bridge import MqttBridge
    devices = ",".join(f"d{i}" for i in range(n_devices))
    cfg = load_config(overrides=["job.name=bench", f"devices.ids={devices}", f"devices.count={n_devices}",
                                 f"input.topic={prefix}.{{device}}", f"mqtt.broker={host}:{port}",
                                 f"mqtt.topics={prefix}/{{device}}/imu", f"mqtt.client_id={client_id}",
                                 f"mqtt.max_in_flight={receive_max}"], env={})
    bridge = MqttBridge(cfg, bootstrap, Metrics())
    forward = bridge._on_message
    def on_message(*a):
        if state["first"] is None:
            state["first"] = time.perf_counter()
        forward(*a)
    bridge._on_message = on_message  # the client takes it at start()
    stop = threading.Event()
    written = bridge._written
    def counted(pending):
        written(pending)
        state["n"] += 1  # Kafka's I/O thread: one at a time
        if state["n"] == expected:
            state["end"] = time.perf_counter()
            stop.set()
    bridge._written = counted
    bridge.start(connect_timeout_s=60)
    bridge.run(stop)
    bridge.close(5)
else:
    import paho.mqtt.client as mqtt
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    from kafka import KafkaProducer
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=5,
                             request_timeout_ms=15000, delivery_timeout_ms=30000)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5,
                         manual_ack=True)
    lock = threading.Lock()
    def acked(mid, _meta):
        client.ack(mid, 1)
        with lock:
            state["n"] += 1
            if state["n"] == expected:
                state["end"] = time.perf_counter()
                done.set()
    def on_message(c, u, m):
        if state["first"] is None:
            state["first"] = time.perf_counter()
        device = m.topic.split("/")[1]
        producer.send(f"{prefix}.{device}", key=device.encode(), value=m.payload).add_callback(
            lambda meta, mid=m.mid: acked(mid, meta))
    def on_connect(c, u, f, rc, p):
        c.subscribe(f"{prefix}/+/imu", qos=1)
    client.on_message, client.on_connect = on_message, on_connect
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 3600
    props.ReceiveMaximum = receive_max
    client.connect(host, port, 30, clean_start=False, properties=props)
    client.loop_start()
    done.wait(600)
    client.disconnect(); client.loop_stop(); producer.close(5)
seconds = state["end"] - state["first"]
print(json.dumps({"messages": expected, "seconds": seconds, "messages_per_s": expected / seconds}))
"""


def payload(device: str, n: int, rng) -> bytes:
    return json.dumps({"pixels": rng.random(64).round(4).tolist(), "digit": int(rng.integers(10)),
                       "ts": time.time() * 1000, "n": n, "device": device}).encode()


def subscribe_offline(host: str, port: int, client_id: str, prefix: str) -> None:
    """Create ``client_id``'s persistent session, subscribed to the prefix, and leave it offline."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 3600
    client.connect(host, port, 30, clean_start=True, properties=props)
    client.loop_start()
    client.subscribe(f"{prefix}/+/imu", qos=1)[1]
    info = client.publish(f"{prefix}/none/ping", b"", qos=1)
    info.wait_for_publish(10)  # the broker has handled the SUBSCRIBE before this PUBLISH
    client.disconnect()
    client.loop_stop()


def publish(host: str, port: int, prefix: str, messages: int, rate_hz: float | None = None) -> None:
    """Publish ``messages`` readings with QoS 1 over DEVICES devices, as fast as acknowledged
    or at ``rate_hz``; return once Mosquitto acknowledged every one."""
    import numpy as np
    import paho.mqtt.client as mqtt

    rng = np.random.default_rng(0)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"pub-{uuid.uuid4().hex[:6]}")
    client.max_inflight_messages_set(200)
    client.max_queued_messages_set(0)
    acked = [0]
    client.on_publish = lambda *a: acked.__setitem__(0, acked[0] + 1)
    client.connect(host, port, 30)
    client.loop_start()
    began = time.perf_counter()
    for n in range(messages):
        device = f"d{n % DEVICES}"
        client.publish(f"{prefix}/{device}/imu", payload(device, n, rng), qos=1)
        if rate_hz:
            pause = began + (n + 1) / rate_hz - time.perf_counter()
            if pause > 0:
                time.sleep(pause)  # the devices' pace
    deadline = time.monotonic() + 300
    while acked[0] < messages and time.monotonic() < deadline:
        time.sleep(0.01)  # poll interval of a deadline wait
    client.disconnect()
    client.loop_stop()
    if acked[0] < messages:
        raise RuntimeError(f"Mosquitto acknowledged {acked[0]} of {messages} publishes")


def drain(kind: str, mosq, bootstrap: str, messages: int) -> dict:
    from edgestream.job.topics import sensor_topics_for
    from edgestream.pipeline.kafka_io import ensure_topics
    from edgestream.streams.topics import TopicLayout

    prefix, client_id = f"b{uuid.uuid4().hex[:6]}", f"{kind}-{uuid.uuid4().hex[:6]}"
    ensure_topics(bootstrap, {t: k for t, k in sensor_topics_for([f"d{i}" for i in range(DEVICES)],
                                                                 TopicLayout(f"{prefix}.{{device}}")).items()
                              if k != "dlq"})
    subscribe_offline(mosq.host, mosq.port, client_id, prefix)
    publish(mosq.host, mosq.port, prefix, messages)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", CONSUMER, kind, mosq.host, str(mosq.port), client_id, bootstrap,
                           prefix, str(messages), str(DEVICES), str(RECEIVE_MAXIMUM)], capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} consumer failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def latency(mosq, bootstrap: str, messages: int, rate_hz: float, work: Path) -> dict:
    """p50/p90/p99 (ms) from publish to Kafka append, through a running `edgestream bridge mqtt`."""
    from kafka.admin import NewTopic
    from kafka.structs import TopicPartition

    from edgestream.pipeline.kafka_io import admin_client, read_range

    prefix = f"l{uuid.uuid4().hex[:6]}"
    devices = [f"d{i}" for i in range(DEVICES)]
    admin = admin_client(bootstrap)
    admin.create_topics([NewTopic(f"{prefix}.{d}", 1, 1, topic_configs={"message.timestamp.type": "LogAppendTime"})
                         for d in devices])
    admin.close()
    log = work / "bridge.log"
    sets = ["job.name=bench", f"devices.ids={','.join(devices)}", f"devices.count={DEVICES}",
            f"input.topic={prefix}.{{device}}", f"mqtt.topics={prefix}/{{device}}/imu", f"mqtt.client_id={prefix}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edgestream", "bridge", "mqtt", "--bootstrap", bootstrap,
                                 "--mqtt", mosq.address, *[a for s in sets for a in ("--set", s)]],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "bridging MQTT" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bridge did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)  # poll interval of a deadline wait
        publish(mosq.host, mosq.port, prefix, messages, rate_hz)
        delays = []
        for d in devices:
            tp = TopicPartition(f"{prefix}.{d}", 0)
            for record in read_range(bootstrap, tp, 0, messages // DEVICES, timeout_s=60):
                delays.append(record.timestamp - json.loads(record.value)["ts"])
    finally:
        proc.terminate()
        proc.wait(60)
    delays.sort()

    def q(p: float) -> float:
        return delays[min(len(delays) - 1, int(p * len(delays)))]

    return {"messages": len(delays), "rate_hz": rate_hz, "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99),
            "max_ms": delays[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=30_000, help="readings drained per round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of A B, interleaved")
    parser.add_argument("--latency-messages", type=int, default=3000, help="readings of the latency run")
    parser.add_argument("--rate", type=float, default=500.0, help="readings/s of the latency run")
    parser.add_argument("--bootstrap", help="existing cluster (default: start a local broker)")
    args = parser.parse_args()
    if args.messages < DEVICES or args.repeats < 1 or args.latency_messages < DEVICES or args.rate <= 0:
        parser.error(f"--messages and --latency-messages must be at least {DEVICES}, --repeats 1, --rate > 0")

    from edgestream.deploy.kafka.broker import LocalBroker, kafka_version
    from edgestream.deploy.mqtt import LocalMosquitto

    work = Path(tempfile.mkdtemp(prefix="bench-mqtt-"))
    broker = None
    bootstrap = args.bootstrap
    mosq = LocalMosquitto(work / "mosquitto").start()
    runs: dict[str, list[dict]] = {"bridge": [], "plain": []}
    try:
        if not bootstrap:
            broker = LocalBroker(work / "kafka").start()
            bootstrap = broker.bootstrap
        for r in range(args.repeats):
            for kind in ("bridge", "plain"):
                res = drain(kind, mosq, bootstrap, args.messages)
                runs[kind].append(res)
                print(f"repeat {r + 1}/{args.repeats} {kind}: {res['messages_per_s']:,.0f} messages/s", flush=True)
        lat = latency(mosq, bootstrap, args.latency_messages, args.rate, work)
        print(f"latency at {args.rate:.0f}/s: p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms", flush=True)
    finally:
        mosq.stop()
        if broker is not None:
            broker.stop()
    shutil.rmtree(work, ignore_errors=True)

    ratios = [a["messages_per_s"] / b["messages_per_s"] for a, b in zip(runs["bridge"], runs["plain"], strict=True)]
    spread = {k: {"median": statistics.median(x["messages_per_s"] for x in v),
                  "min": min(x["messages_per_s"] for x in v), "max": max(x["messages_per_s"] for x in v)}
              for k, v in runs.items()}
    import paho.mqtt

    mosquitto_version = subprocess.run([shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-h"],
                                       capture_output=True, text=True).stdout.splitlines()[0]
    result = {
        "benchmark": "mqtt_bridge",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "versions": {"kafka": kafka_version(), "paho_mqtt": paho.mqtt.__version__, "mosquitto": mosquitto_version},
        "config": {"messages": args.messages, "repeats": args.repeats, "devices": DEVICES,
                   "receive_maximum": RECEIVE_MAXIMUM, "qos": 1, "latency_messages": args.latency_messages,
                   "latency_rate_hz": args.rate},
        "runs": runs, "spread": spread, "ratios_per_repeat": ratios, "ratio_median": statistics.median(ratios),
        "latency_ms": lat, "targets": {"ratio_vs_plain_loop": 0.8},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "mqtt_bridge.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"{args.messages} QoS 1 JSON readings (~1 KiB) queued in Mosquitto, drained into Kafka; {args.repeats} "
        "repeats (bridge, plain interleaved); messages/s",
        "",
        "| consumer | median | min | max |",
        "|---|---:|---:|---:|",
        *(f"| {name} | {s['median']:,.0f} | {s['min']:,.0f} | {s['max']:,.0f} |" for name, s in
          (("edgestream bridge (MqttBridge)", spread["bridge"]), ("plain paho + kafka-python loop", spread["plain"]))),
        "",
        "| ratio (same repeat) | median | min | max |",
        "|---|---:|---:|---:|",
        f"| bridge / plain | {statistics.median(ratios):.2f}x | {min(ratios):.2f}x | {max(ratios):.2f}x |",
        "",
        f"Latency, MQTT publish to Kafka append (`LogAppendTime`), {lat['messages']} readings at "
        f"{args.rate:.0f}/s through `edgestream bridge mqtt`: p50 {lat['p50_ms']:.1f} ms, "
        f"p90 {lat['p90_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms, max {lat['max_ms']:.1f} ms.",
    ]
    table = "\n".join(lines)
    (RESULTS / "mqtt_bridge.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
