"""`edgestream bridge mqtt`: forward MQTT topics into the job's Kafka device topics."""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from edgestream.cli.errors import CommandError
from edgestream.cli.options import (
    add_service_args,
    job_config,
    need_bootstrap,
    port,
    positive_float,
    use_log_format,
)
from edgestream.pipeline.exits import EXIT_CONFIG


def cmd_bridge_mqtt(args: argparse.Namespace) -> int:
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    from edgestream.job.errors import ConfigError
    from edgestream.monitoring.metrics import serve_process
    from edgestream.pipeline.bridge import BridgeError, MqttBridge
    from edgestream.pipeline.service import ProcessService

    cfg = job_config(args)
    try:
        if args.mqtt:
            cfg.mqtt.broker = args.mqtt
        if args.topic:
            cfg.mqtt.topics = list(args.topic)
        cfg.mqtt.validate()
    except ConfigError as exc:
        raise CommandError(f"bridge mqtt: {exc}", EXIT_CONFIG) from None
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    use_log_format(args, cfg)
    bootstrap = need_bootstrap(args, cfg)
    metrics, metrics_url = serve_process(args.metrics_port, cfg.workers.metrics_host,
                                         liveness_timeout_s=cfg.service.liveness_timeout_s)
    metrics.health.require("forwarding")
    stop = threading.Event()
    service = ProcessService("bridge", cfg.job.name, metrics.health, cfg.service.shutdown_grace_s)
    service.signals.on_stop = lambda _signum: stop.set()
    bridge = MqttBridge(cfg, bootstrap, metrics)
    console = Console(stderr=False)
    try:
        try:
            bridge.start()
        except BridgeError as exc:
            raise CommandError(f"bridge mqtt: {exc}") from None
        metrics.health.set("forwarding", True, "subscribed to MQTT")
        console.print(f"bridge /metrics: {metrics_url}")
        console.print(f"bridging MQTT {cfg.mqtt.broker} {', '.join(bridge.topics.filters)} -> Kafka "
                      f"{cfg.input.topic} (client id {bridge.client_id})")
        until = time.monotonic() + args.duration if args.duration else None
        with Progress(TextColumn("{task.fields[line]}"), TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task("bridge", line="connecting")

            def tick(report) -> None:
                metrics.health.beat()
                dead = sum(sum(r.values()) for r in report.dead.values())
                state = "" if bridge.connected.is_set() else " [yellow](MQTT reconnecting)[/yellow]"
                progress.update(task, line=f"{len(report.received)} devices: received {sum(report.received.values())}"
                                           f", forwarded {sum(report.forwarded.values())}, dead-lettered {dead}, "
                                           f"in flight {report.in_flight()}{state}")

            report = bridge.run(stop, until=until, tick=tick)
    finally:
        bridge.close(max(cfg.service.shutdown_grace_s * 0.75, 0.5))
        service.close()
    dead = sum(sum(r.values()) for r in report.dead.values())
    console.print(f"bridged {sum(report.received.values())} MQTT messages of {len(report.received)} devices: "
                  f"{sum(report.forwarded.values())} forwarded to Kafka, {dead} dead-lettered to sensors.dlq, "
                  f"{report.in_flight()} not acknowledged at the stop (the MQTT broker sends them again); "
                  f"{report.connects} MQTT connection(s), {report.retries} Kafka retries")
    for device, reasons in sorted(report.dead.items()):
        console.print(f"[yellow]dead-lettered[/yellow] {device}: "
                      + ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items())))
    if args.report:
        args.report.write_text(json.dumps({
            "received": dict(report.received), "forwarded": dict(report.forwarded),
            "dead_lettered": {d: dict(r) for d, r in report.dead.items()},
            "in_flight": report.in_flight(), "connects": report.connects, "retries": report.retries,
        }, indent=2, sort_keys=True) + "\n")
    return 0


def register(sub: argparse._SubParsersAction, add_job_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `bridge` command group (`bridge mqtt`)."""
    p = sub.add_parser("bridge", help="forward device readings from another transport into Kafka (MQTT)")
    kinds = p.add_subparsers(dest="bridge_kind", metavar="KIND", required=True)
    m = kinds.add_parser(
        "mqtt", help="forward MQTT topics (mqtt.topics, the device from one level) into the job's device topics",
        description="Subscribe to the job's MQTT topic patterns and write each message, unchanged, to its "
                    "device's Kafka topic (input.topic). A QoS 1 message is acknowledged to MQTT only once "
                    "Kafka has it; the session is persistent, so nothing is lost while the bridge or Kafka is "
                    "away (docs/devices.md).")
    add_job_args(m)
    m.add_argument("--mqtt", metavar="HOST:PORT", help="the MQTT broker (default: mqtt.broker, localhost:1883)")
    m.add_argument("--topic", action="append", metavar="PATTERN",
                   help="an MQTT topic pattern with {device} as one level, e.g. 'sensors/{device}/readings' "
                        "(repeatable; default: mqtt.topics)")
    m.add_argument("--duration", type=positive_float, help="stop after this many seconds (default: until stopped)")
    m.add_argument("--report", type=Path, help="write the per-device counts as JSON here at the end")
    m.add_argument("--metrics-port", type=port, default=0,
                   help="serve /metrics, /healthz and /readyz on this port (0: a free one)")
    add_service_args(m)
    m.set_defaults(func=cmd_bridge_mqtt)
