"""Metric values are exact: known records, drops and dead letters read back from a served /metrics."""

from __future__ import annotations

import numpy as np
import pytest

from edgestream.job.config import load_config
from edgestream.monitoring.scrape import scrape
from edgestream.pipeline.ingest import IngestCore
from edgestream.streams import codec
from edgestream.streams.garbage import EXPECTED_REASON, KINDS, make_garbage
from edgestream.streams.records import RecordBatch

SHAPE = (4,)


def message(device: str, start: int, n: int, event_time: float = 100.0) -> bytes:
    return codec.encode(RecordBatch(
        device=device, seq=np.arange(start, start + n, dtype=np.uint64), event_time=np.full(n, event_time),
        features=np.ones((n, *SHAPE), dtype=np.float32), labels=np.zeros(n, dtype=np.int32),
    ))


def test_ingest_counts_drops_and_dead_letters_are_exact_on_metrics(served):
    metrics, url = served
    cfg = load_config(overrides=["devices.count=2", "buffer.policy=truncate", "buffer.capacity=10",
                                 "batcher.mode=fixed", "batcher.batch_size=1000"], env={})
    core = IngestCore(cfg, ["dev00", "dev01"], metrics, start=0.0, expected_shape=SHAPE, num_classes=10)
    sent_bytes = {"dev00": 0, "dev01": 0}
    offset = 0

    def feed(device: str, value: bytes, wall_now: float = 101.5) -> None:
        nonlocal offset
        core.on_message(f"sensors.{device}", 0, offset, None, value, offset, now=0.0, wall_now=wall_now)
        sent_bytes[device] += len(value)
        offset += 1

    # dev00: 7 messages x 3 records = 21 records into a buffer of 10 -> 11 dropped (overflow)
    for i in range(7):
        feed("dev00", message("dev00", i * 3, 3))
    # dev01: 4 records kept, then one garbage message of every kind
    feed("dev01", message("dev01", 0, 4, event_time=99.0), wall_now=102.0)
    for kind in KINDS:
        feed("dev01", make_garbage(kind, "dev01", SHAPE, oversize_bytes=cfg.limits.max_record_message_bytes + 1))

    s = scrape(url)

    assert s is not None
    assert s.get("edgestream_records_in_total", device="dev00") == 21
    assert s.get("edgestream_records_in_total", device="dev01") == 4
    assert s.get("edgestream_messages_in_total", device="dev00") == 7
    assert s.get("edgestream_messages_in_total", device="dev01") == 1 + len(KINDS)
    assert s.get("edgestream_bytes_in_total", device="dev00") == sent_bytes["dev00"]
    assert s.get("edgestream_bytes_in_total", device="dev01") == sent_bytes["dev01"]
    assert s.get("edgestream_buffer_dropped_records_total", device="dev00", reason="overflow") == 11
    drops = s.by_label("edgestream_buffer_dropped_records_total", "device")
    assert drops == {"dev00": 11, "dev01": 0}  # dev01's series exists (init_device) at zero
    assert s.get("edgestream_buffer_depth_records", device="dev00") == 10
    assert s.get("edgestream_buffer_depth_records", device="dev01") == 4
    assert s.get("edgestream_buffer_capacity_records", device="dev00") == 10
    assert s.get("edgestream_event_time_lag_seconds", device="dev00") == pytest.approx(1.5)
    assert s.get("edgestream_event_time_lag_seconds", device="dev01") == pytest.approx(3.0)
    for kind in KINDS:
        assert s.get("edgestream_dead_letter_messages_total", device="dev01", reason=EXPECTED_REASON[kind]) == 1
    assert s.by_label("edgestream_dead_letter_messages_total", "device") == {"dev00": 0, "dev01": len(KINDS)}
    # the invariant, read from metrics alone
    for device, acc in core.accounting().items():
        assert s.get("edgestream_records_in_total", device=device) == (
            s.get("edgestream_batched_records_total", device=device)
            + s.get("edgestream_buffer_dropped_records_total", device=device)
            + s.get("edgestream_buffer_depth_records", device=device)
        ) == acc["records_in"]


def test_window_truncation_drops_and_batch_histogram_are_exact(served):
    metrics, url = served
    cfg = load_config(overrides=["devices.count=1", "batcher.mode=window", "batcher.window_s=1",
                                 "batcher.max_batch=8", "batcher.window_overflow=truncate"], env={})
    core = IngestCore(cfg, ["dev00"], metrics, start=0.0, expected_shape=SHAPE, num_classes=10)
    for i in range(5):  # 5 x 5 = 25 records in the first window
        core.on_message("sensors.dev00", 0, i, None, message("dev00", i * 5, 5), i, now=0.1 * i, wall_now=100.0)
    core.on_tick(1.0)  # window closes: one batch of 8, the other 17 truncated

    s = scrape(url)

    assert s is not None
    assert s.get("edgestream_batches_total", device="dev00") == 1
    assert s.get("edgestream_batched_records_total", device="dev00") == 8
    assert s.get("edgestream_batch_size_records_count", device="dev00") == 1
    assert s.get("edgestream_batch_size_records_sum", device="dev00") == 8
    assert s.get("edgestream_batch_size_records_bucket", device="dev00", le="4.0") == 0
    assert s.get("edgestream_batch_size_records_bucket", device="dev00", le="8.0") == 1
    assert s.get("edgestream_buffer_dropped_records_total", device="dev00", reason="window_truncate") == 17
    assert s.get("edgestream_buffer_depth_records", device="dev00") == 0


def test_training_helpers_record_exact_values(served):
    metrics, url = served
    for i in range(3):
        metrics.record_step("w0", step_s=0.02, wait_s=0.5, records=32, loss=2.0 - i, accuracy=0.25 * i,
                            compressed=i > 0)
    metrics.record_applied("w0", staleness_versions=3, staleness_s=0.2)
    metrics.record_sent("w0", "topk", wire_bytes=1000, dense_bytes=40_000)
    metrics.gradient_bytes_received.labels("w0", "topk").inc(2500)
    metrics.record_evaluation("w0", loss=0.7, accuracy=0.8)
    metrics.record_consumer_lag({"dev00": 12, "dev01": 0})

    s = scrape(url)

    assert s is not None
    assert s.get("edgestream_steps_total", worker="w0") == 3
    assert s.get("edgestream_compressed_steps_total", worker="w0") == 2
    assert s.get("edgestream_trained_records_total", worker="w0") == 96
    assert s.get("edgestream_step_seconds_count", worker="w0") == 3
    assert s.get("edgestream_wait_for_data_seconds_sum", worker="w0") == pytest.approx(1.5)
    assert s.get("edgestream_loss", worker="w0", split="train") == 0.0
    assert s.get("edgestream_accuracy_ratio", worker="w0", split="train") == 0.5
    assert s.get("edgestream_loss", worker="w0", split="heldout") == 0.7
    assert s.get("edgestream_accuracy_ratio", worker="w0", split="heldout") == 0.8
    assert s.get("edgestream_staleness_versions_bucket", worker="w0", le="2.0") == 0
    assert s.get("edgestream_staleness_versions_bucket", worker="w0", le="3.0") == 1
    assert s.get("edgestream_staleness_seconds_sum", worker="w0") == pytest.approx(0.2)
    assert s.get("edgestream_gradient_bytes_sent_total", worker="w0", codec="topk") == 1000
    assert s.get("edgestream_gradient_bytes_received_total", worker="w0", codec="topk") == 2500
    assert s.get("edgestream_compression_ratio", worker="w0") == 40.0
    assert s.by_label("edgestream_consumer_lag_records", "device") == {"dev00": 12, "dev01": 0}


def test_init_device_exposes_every_drop_and_dead_letter_reason_at_zero(served):
    from edgestream.streams.errors import RecordDecodeError

    metrics, url = served
    metrics.init_device("dev00")
    metrics.init_worker("w0")

    s = scrape(url)

    assert s is not None
    dead = [x for x in s.samples if x.name == "edgestream_dead_letter_messages_total"]
    assert sorted(dict(x.labels)["reason"] for x in dead) == sorted(RecordDecodeError.REASONS)
    assert all(x.value == 0 for x in dead)
    assert s.by_label("edgestream_buffer_dropped_records_total", "reason") == {"overflow": 0, "window_truncate": 0}
    assert s.get("edgestream_steps_total", -1.0, worker="w0") == 0
