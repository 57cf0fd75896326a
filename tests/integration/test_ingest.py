"""Ingest on the real broker: simulators -> workers -> exact per-device accounting.

Run with both ingest sources (``kafka.ingest_source``): the direct aiokafka consumer
(the default) and the Faust agent.
"""

from __future__ import annotations

import io

import pytest
from kafka import KafkaAdminClient, KafkaConsumer
from rich.console import Console

from edgestream.job.config import load_config
from edgestream.pipeline.app import sensor_group
from edgestream.pipeline.kafka_io import end_offsets
from edgestream.pipeline.run import run_job
from edgestream.streams.garbage import EXPECTED_REASON, KINDS
from edgestream.streams.topics import (
    DLQ_HEADER_OFFSET,
    DLQ_HEADER_REASON,
    DLQ_HEADER_TOPIC,
    SENSOR_DLQ,
)

pytestmark = pytest.mark.integration


def job(unique: str, state_dir, *overrides: str):
    return load_config(
        overrides=[
            f"job.name=it-{unique}",
            f"run.state_dir={state_dir}",
            # unique device ids keep this test's topics apart from every other test's
            f"devices.ids=a{unique},b{unique},c{unique}",
            "devices.count=3",
            "devices.rates_hz=90,30,10",
            "devices.time_scale=2",
            "run.duration_s=2",  # at these rates each policy truncates or pauses within its first second
            "run.drain_timeout_s=40",
            *overrides,
        ],
        env={},
    )


def quiet() -> Console:
    return Console(file=io.StringIO(), width=160)


def dead_letters(bootstrap: str, topic_names: set[str], expected: int) -> list:
    consumer = KafkaConsumer(SENSOR_DLQ, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             enable_auto_commit=False, consumer_timeout_ms=5000)
    found = []
    try:
        for record in consumer:
            headers = {k: v.decode() for k, v in record.headers}
            if headers[DLQ_HEADER_TOPIC] in topic_names:
                found.append(headers)
            if len(found) >= expected:
                break
    finally:
        consumer.close()
    return found


def committed(bootstrap: str, group: str) -> dict[str, int]:
    """``{"topic:partition": offset}`` committed by ``group``."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        listed = admin.list_group_offsets({group: None}).get(group) or {}
    finally:
        admin.close()
    return {f"{tp.topic}:{tp.partition}": meta.offset for tp, meta in listed.items() if meta.offset >= 0}


@pytest.mark.parametrize("source", ["direct", "faust"])
def test_every_record_accounted_for_with_garbage_of_every_kind(kafka_bootstrap, unique, state_dir, source):
    cfg = job(unique, state_dir, "workers.count=2", f"kafka.ingest_source={source}")
    garbage = len(KINDS)

    result = run_job(cfg, kafka_bootstrap, garbage_per_device=garbage, console=quiet(), live=False)

    assert result.balanced
    for device in cfg.devices.device_ids():
        acc = result.accounting[device]
        assert result.produced[device] > 0
        assert result.produced[device] == acc["batched"] + acc["dropped"] + acc["buffered"]
        assert acc["buffered"] == 0 and acc["dropped"] == 0  # window + persist drains fully
        assert acc["dead_letter_messages"] == garbage == result.garbage[device]
    topic_names = {f"sensors.{d}" for d in cfg.devices.device_ids()}
    letters = dead_letters(kafka_bootstrap, topic_names, garbage * 3)
    assert len(letters) == garbage * 3
    reasons = sorted(h[DLQ_HEADER_REASON] for h in letters)
    assert reasons == sorted([EXPECTED_REASON[k] for k in KINDS] * 3)
    assert all(int(h[DLQ_HEADER_OFFSET]) >= 0 for h in letters)
    # Everything was handled, so each worker's sensor group has committed its topics' ends.
    for worker in cfg.worker_names():
        own = [f"sensors.{d}" for d in cfg.devices_of(worker)]
        ends = {f"{tp.topic}:{tp.partition}": end for tp, end in end_offsets(kafka_bootstrap, own).items()}
        assert {k: v for k, v in committed(kafka_bootstrap, sensor_group(cfg, worker)).items()
                if k.startswith("sensors.")} == ends


POLICIES = {
    "fixed-persist": (["batcher.mode=fixed", "batcher.batch_size=16", "buffer.policy=persist"], False),
    "window-truncate": (["batcher.mode=window", "batcher.max_batch=8", "batcher.window_overflow=truncate"],
                        True),
    "buffer-truncate": (["batcher.mode=fixed", "batcher.batch_size=400", "buffer.policy=truncate",
                         "buffer.capacity=20"], True),
    "backpressure": (["batcher.mode=window", "batcher.window_s=0.25", "batcher.max_batch=32",
                      "buffer.policy=backpressure", "buffer.capacity=30"], False),
}
# Every policy with the default (direct) source; backpressure, the one that drives the
# consumer (pause / resume), with the Faust source too.
CASES = [(name, "direct") for name in POLICIES] + [("backpressure", "faust")]


@pytest.mark.parametrize("policy, source", CASES, ids=[f"{p}-{s}" for p, s in CASES])
def test_accounting_is_exact_under_each_policy(kafka_bootstrap, unique, state_dir, policy, source):
    overrides, expect_drops = POLICIES[policy]
    cfg = job(unique, state_dir, "workers.count=1", f"kafka.ingest_source={source}", *overrides)

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False)

    assert result.balanced
    total_dropped = 0
    for device in cfg.devices.device_ids():
        acc = result.accounting[device]
        assert result.produced[device] == acc["batched"] + acc["dropped"] + acc["buffered"]
        total_dropped += acc["dropped"]
        if cfg.batcher.mode == "fixed":
            assert acc["buffered"] < cfg.batcher.batch_size
        else:
            assert acc["buffered"] == 0
    assert (total_dropped > 0) == expect_drops
    if cfg.buffer.policy == "backpressure":
        # paused at least once, and (balanced above) resumed without losing a record
        assert sum(a["pauses"] for a in result.accounting.values()) > 0
