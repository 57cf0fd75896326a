"""Smartwatches publishing a job's streamed rows as JSON readings over MQTT.

The devices of ``examples/basicmotions-mqtt.toml``: each device of the job is one watch with
its own MQTT connection (client id ``watch-<device>``, QoS 1) that plays its share of the
job's streamed rows (``job_fleet_data``: for ``data.source = "series"``, whole recordings
of a real smartwatch, window after window) at its ``devices.rates_hz``, over and over until
the duration ends. It publishes to the job's first ``mqtt.topics`` pattern with its id as
the device level; ``edgestream bridge mqtt`` forwards that into Kafka. One reading is

    {"window": [[...acc_x...], [...acc_y...], ..., [...gyro_z...]], "activity": 2,
     "ts": 1764590000123, "n": 17}

the window (channels x steps, 6 decimals), the activity's class index, the watch's clock
in milliseconds when it sends, and the watch's reading number (the job maps these with
``input.features_array``, ``input.label``, ``input.event_time`` and ``input.record_id``).
The watches read nothing of the held-out or validation rows: the source never puts them in
a device's share.

    python -m edgestream.pipeline.watches --job JOB.toml --mqtt HOST:PORT --duration S [--report FILE]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt

from edgestream.job.config import JobConfig, load_config
from edgestream.job.errors import ConfigError
from edgestream.job.sources import job_fleet_data


def reading(window: np.ndarray, label: int, ts_ms: int, n: int) -> bytes:
    """One JSON reading (the layout in the module docstring)."""
    values = np.round(window.astype(np.float64), 6).tolist()
    return json.dumps({"window": values, "activity": int(label), "ts": int(ts_ms), "n": int(n)},
                      separators=(",", ":")).encode()


def watch_topic(cfg: JobConfig, device: str) -> str:
    """The MQTT topic device ``device`` publishes to: the first ``mqtt.topics`` pattern."""
    pattern = cfg.mqtt.topics[0]
    levels = pattern.split("/")
    if any(level in ("+", "#") for level in levels):
        raise ConfigError(f"mqtt.topics[0]={pattern!r} has a wildcard level: a watch needs one topic to publish to")
    return "/".join(device if level == "{device}" else level for level in levels)


@dataclass
class WatchReport:
    """Per watch: readings published and acknowledged by the MQTT broker (PUBACK)."""

    published: dict[str, int] = field(default_factory=dict)
    acknowledged: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2, sort_keys=True)


class Watch:
    """One watch: an MQTT connection and the rows it plays."""

    def __init__(self, device: str, topic: str, rows: np.ndarray, labels: np.ndarray, host: str, port: int,
                 report: WatchReport, lock: threading.Lock) -> None:
        self.device, self.topic, self.rows, self.labels = device, topic, rows, labels
        self.report, self.lock = report, lock
        self.n = 0
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"watch-{device}",
                                  protocol=mqtt.MQTTv311, clean_session=True)
        self.client.max_inflight_messages_set(100)
        self.client.max_queued_messages_set(0)
        self.client.on_publish = self._acknowledged
        self.client.connect(host, port, keepalive=30)
        self.client.loop_start()

    def _acknowledged(self, client, userdata, mid, reason_code, properties) -> None:
        with self.lock:
            self.report.acknowledged[self.device] = self.report.acknowledged.get(self.device, 0) + 1

    def publish_next(self) -> None:
        row = self.n % len(self.rows)
        payload = reading(self.rows[row], int(self.labels[row]), int(time.time() * 1000), self.n)
        self.client.publish(self.topic, payload, qos=1)
        self.n += 1
        with self.lock:
            self.report.published[self.device] = self.n

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def publish(cfg: JobConfig, mqtt_address: str, duration_s: float, *, stop: threading.Event | None = None,
            ack_timeout_s: float = 30.0) -> WatchReport:
    """Every device of ``cfg`` as a watch for ``duration_s`` seconds (or until ``stop``);
    then wait (at most ``ack_timeout_s``) until the MQTT broker acknowledged every reading."""
    stop = stop or threading.Event()
    host, _, port = mqtt_address.rpartition(":")
    data = job_fleet_data(cfg)
    report = WatchReport()
    lock = threading.Lock()
    devices = cfg.devices.device_ids()
    watches = [Watch(d, watch_topic(cfg, d), data.train.features[data.shares[d]], data.train.labels[data.shares[d]],
                     host.strip("[]"), int(port), report, lock) for d in devices]
    rates = [cfg.devices.rate_of(i) for i in range(len(devices))]
    started = time.monotonic()
    try:
        while not stop.is_set():
            elapsed = time.monotonic() - started
            if elapsed >= duration_s:
                break
            for watch, rate in zip(watches, rates, strict=True):
                while watch.n < int(elapsed * rate) + 1:  # the readings due by now (the first at once)
                    watch.publish_next()
            stop.wait(0.02)  # pacing tick: each watch keeps its own rate within 20 ms
        report.duration_s = time.monotonic() - started
        deadline = time.monotonic() + ack_timeout_s
        while time.monotonic() < deadline:
            with lock:
                if report.acknowledged == report.published:
                    break
            time.sleep(0.05)  # poll interval of the acknowledgements
    finally:
        for watch in watches:
            watch.close()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgestream.pipeline.watches",
                                     description="Publish a job's device rows as smartwatch JSON readings over MQTT.")
    parser.add_argument("--job", required=True, type=Path)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--mqtt", help="HOST:PORT of the MQTT broker (default: mqtt.broker of the job)")
    parser.add_argument("--duration", type=float, required=True, help="seconds to publish")
    parser.add_argument("--report", type=Path, help="write the per-watch counts as JSON here")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.job, args.set)
        address = args.mqtt or cfg.mqtt.broker
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        print(f"{len(cfg.devices.device_ids())} watches publishing to {cfg.mqtt.topics[0]} on {address} "
              f"for {args.duration:g} s", flush=True)
        report = publish(cfg, address, args.duration, stop=stop)
    except (ConfigError, OSError) as exc:
        print(f"watches: {exc}", file=sys.stderr)
        return 2
    if args.report:
        args.report.write_text(report.to_json())
    sent, acked = sum(report.published.values()), sum(report.acknowledged.values())
    print(f"watches: published {sent} readings in {report.duration_s:.1f} s, {acked} acknowledged by the MQTT broker",
          flush=True)
    return 0 if sent == acked else 1


if __name__ == "__main__":
    sys.exit(main())
