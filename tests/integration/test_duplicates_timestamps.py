"""Duplicates and event times on the real broker (issue #30, defect 5).

A device's message sent three times must be trained once (two copies dropped as
``duplicate``); records whose event times lie in 1970, 1938, a year ahead or far back
from the device's newest must be dead-lettered as ``bad_timestamp`` with the reason in
the dead letter's headers; the run's accounting must balance with both reasons shown.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from kafka import KafkaConsumer

from edgestream.job.sources import job_fleet_data
from edgestream.pipeline.run import RunContext, run_job
from edgestream.streams import codec, topics
from edgestream.streams.records import RecordBatch
from tests.integration.jobs import newest_checkpoint, quiet, show, steps_of, train_job, wait_until

pytestmark = pytest.mark.integration

SKEW_S = 600
YEAR = 365 * 86400.0


def real_message(cfg, device: str, first_seq: int, event_times: list[float], seed: int = 7) -> bytes:
    """Records of the job's own data with these sequence numbers and event times."""
    n = len(event_times)
    data = job_fleet_data(cfg)
    rows = np.random.default_rng(seed).choice(len(data.train), n, replace=False)
    return codec.encode(RecordBatch(
        device=device, seq=np.arange(first_seq, first_seq + n, dtype=np.uint64),
        event_time=np.asarray(event_times, dtype=np.float64), features=data.train.features[rows].copy(),
        labels=data.train.labels[rows].astype(np.int32)))


def dead_letters(bootstrap: str, device: str, expected: int) -> list[tuple[dict[str, str], bytes]]:
    """The letters in sensors.dlq that came from ``device``'s topic (waits for ``expected``)."""
    consumer = KafkaConsumer(topics.SENSOR_DLQ, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             enable_auto_commit=False, consumer_timeout_ms=5000)
    found = []
    try:
        for record in consumer:
            headers = {k: v.decode() for k, v in record.headers}
            if headers.get(topics.DLQ_HEADER_TOPIC) == topics.sensor_topic(device):
                found.append((headers, record.value))
            if len(found) >= expected:
                break
    finally:
        consumer.close()
    return found


@pytest.mark.parametrize("source", ["direct", "faust"])
def test_a_message_sent_three_times_is_trained_once_and_bad_event_times_are_dead_lettered(
        kafka_bootstrap, unique, state_dir, source):
    cfg = train_job(unique, state_dir, "run.duration_s=60",  # a cap: the hook ends streaming
                    f"data.max_timestamp_skew_s={SKEW_S}",
                    f"kafka.ingest_source={source}")
    dup_device, time_device = cfg.devices_of("w0")[0], cfg.devices_of("w1")[0]
    n = 16

    def inject(ctx: RunContext) -> None:
        wait_until(lambda: steps_of(ctx, "w0") >= 3 and steps_of(ctx, "w1") >= 3, 60, "w0 and w1 to train")
        now = time.time()
        # The same message three times (a device retrying): one copy trained, two dropped.
        ctx.inject(dup_device, [real_message(cfg, dup_device, 10**9, [now] * n)] * 3, records=3 * n)
        # 1970 (a clock never set), 1938 (a sign error), a year ahead: off the broker's clock.
        ctx.inject(time_device, [real_message(cfg, time_device, 10**9, [0.0, -1e9, now + YEAR])], records=3)
        # 500 s ahead is within the skew (trained); then 500 s behind: 1000 s back, beyond it.
        ctx.inject(time_device, [real_message(cfg, time_device, 10**9 + 3, [now + 500])], records=1)
        ctx.inject(time_device, [real_message(cfg, time_device, 10**9 + 4, [time.time() - 500])], records=1)
        # Everything to check is in the topics now: the drain waits until it is all read.
        ctx.stop_streaming()

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=inject)
    show(result)

    assert result.balanced  # produced (with the injected records) = trained + dropped + dead + pending
    dup = result.accounting[dup_device]
    assert dup["dropped_by_reason"] == {"duplicate": 2 * n} and dup["dropped"] == 2 * n
    assert dup["dead_records"] == 0 and dup["dead_letter_messages"] == 0
    assert dup["consumed"] + dup["pending"] == result.produced[dup_device] - 2 * n  # the first copy trained
    bad = result.accounting[time_device]
    assert bad["dead_records_by_reason"] == {"bad_timestamp": 4} and bad["dropped"] == 0
    letters = dead_letters(kafka_bootstrap, time_device, 2)
    assert [h[topics.DLQ_HEADER_REASON] for h, _ in letters] == ["bad_timestamp", "bad_timestamp"]
    assert [int(h[topics.DLQ_HEADER_RECORDS]) for h, _ in letters] == [3, 1]
    off_clock, backwards = (h[topics.DLQ_HEADER_DETAIL] for h, _ in letters)
    assert "1970-01-01" in off_clock and "3 record(s) off their message's Kafka timestamp" in off_clock
    assert "going back in time" in backwards
    assert sorted(codec.decode(letters[0][1]).event_time.tolist())[:2] == [-1e9, 0.0]  # the records themselves
    assert dead_letters(kafka_bootstrap, dup_device, 1) == []  # duplicates are dropped, not dead-lettered


def test_a_restarted_worker_still_drops_a_resent_message_and_trains_what_it_reads_again(
        kafka_bootstrap, unique, state_dir):
    # The duplicate window travels with the checkpoint, holding only settled messages: after
    # a SIGKILL the worker drops a copy of a message trained before its checkpoint, while
    # every record it reads again (not acknowledged before the crash) is trained, not
    # dropped: exactly n duplicates in all, and the accounting balances.
    cfg = train_job(unique, state_dir, "run.duration_s=120",  # a cap: the hook ends streaming
                    "run.restart_backoff_s=1",
                    f"data.max_timestamp_skew_s={SKEW_S}")
    device = cfg.devices_of("w0")[0]
    n = 16
    first_seq = 10**9

    def checkpointed_high() -> int:
        checkpoint = newest_checkpoint(state_dir, "w0")
        if checkpoint is None:
            return -1
        return int(checkpoint.meta.get("ledger", {}).get(device, {}).get("seen", {}).get("high", -1))

    def crash_and_resend(ctx: RunContext) -> None:
        wait_until(lambda: steps_of(ctx, "w0") >= 3, 60, "w0 to train")
        message = real_message(cfg, device, first_seq, [time.time()] * n)
        ctx.inject(device, [message], records=n)
        wait_until(lambda: checkpointed_high() == first_seq + n - 1, 60, "a checkpoint of w0 holding the message")
        crashed = ctx.worker("w0").proc.pid
        ctx.kill("w0")
        wait_until(lambda: ctx.worker("w0").proc.pid != crashed and ctx.worker("w0").ready, 90, "w0 to be back")
        ctx.inject(device, [message], records=n)  # the device sends it again
        # The copy and what w0 reads again are in its topic: the drain waits until both are read.
        ctx.stop_streaming()

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=crash_and_resend)
    show(result)

    assert result.restarted == ["w0"]
    assert result.balanced
    acc = result.accounting[device]
    assert acc["dropped_by_reason"] == {"duplicate": n} and acc["dropped"] == n
    assert acc["dead_records"] == 0
