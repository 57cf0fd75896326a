"""docs/devices.md's shell example on the real broker: a device the job file does not name
writes JSON readings with Kafka's own console producer (Java, no edgestream code) to a
shared topic, keyed by its id, and the worker that reads its partition trains on them."""

from __future__ import annotations

import json
import subprocess
import time

import numpy as np
import pytest

from edgestream.deploy.kafka.broker import resolve_jars
from edgestream.pipeline.run import RunContext, run_job
from edgestream.streams.topics import TopicLayout
from tests.integration.jobs import (
    JSON_READINGS,
    REPO,
    quiet,
    show,
    steps_of,
    train_job,
    wait_until,
    workers_of,
)

pytestmark = pytest.mark.integration

READINGS = 40


def test_a_device_not_in_the_job_joins_a_shared_topic_with_kafkas_console_producer(kafka_bootstrap, unique,
                                                                                    state_dir):
    shared = f"plant{unique}.readings"
    # one configured device in each partition, so every worker trains (a synchronous round
    # waits for every worker)
    ids = {}
    for i in range(100):
        ids.setdefault(TopicLayout.partition_of(f"d{unique}-{i}", 3), f"d{unique}-{i}")
    cfg = train_job(unique, state_dir, "train.strategy=scadles", f"input.topic={shared}", "input.partitions=3",
                    f"devices.ids={','.join(ids[p] for p in range(3))}", *JSON_READINGS)
    device = f"pump-{unique}"  # not in devices.ids
    owner = cfg.worker_names()[TopicLayout.partition_of(device, 3) % 3]
    rng = np.random.default_rng(0)
    lines = "".join(
        f"{device}|" + json.dumps({"pixels": rng.random(64).round(3).tolist(), "digit": int(rng.integers(10)),
                                   "ts": int(time.time() * 1000)}) + "\n"
        for _ in range(READINGS))
    sent: dict[str, subprocess.CompletedProcess] = {}

    def produce(ctx: RunContext) -> None:
        wait_until(lambda: steps_of(ctx, owner) >= 3, 90, f"{owner} to train")
        sent["run"] = subprocess.run(
            ["java", "-Xmx256m", f"-Dlog4j2.configurationFile={REPO / 'deploy/kafka/log4j2.yaml'}",
             "-cp", f"{resolve_jars()}/*", "org.apache.kafka.tools.ConsoleProducer",
             "--bootstrap-server", kafka_bootstrap, "--topic", shared,
             "--property", "parse.key=true", "--property", "key.separator=|"],
            input=lines, text=True, capture_output=True, timeout=120)

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=produce)
    show(result)

    assert sent["run"].returncode == 0, sent["run"].stderr[-2000:]
    assert result.balanced and workers_of(result)
    assert list(result.other_devices) == [device] and device not in result.accounting  # not the job's
    mine = json.loads((state_dir / "workers" / owner / "accounting.json").read_text())["devices"][device]
    assert result.other_devices[device]["records_in"] == READINGS
    assert mine["messages_in"] == mine["records_in"] == READINGS
    assert mine["consumed"] + mine["pending"] == READINGS and mine["dead_letter_messages"] == 0
    assert mine["consumed"] > 0
    for other in set(cfg.worker_names()) - {owner}:
        devices = json.loads((state_dir / "workers" / other / "accounting.json").read_text())["devices"]
        assert device not in devices  # only the worker of its key's partition met it
