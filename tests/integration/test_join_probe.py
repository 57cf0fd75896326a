"""What a worker reads from the broker to decide how it enters a job, and what the run
summary counts as unread, on the real broker (no training processes)."""

from __future__ import annotations

import numpy as np
import pytest

from edgestream.job.topics import channel_topic, sensor_topics_for, training_topics
from edgestream.pipeline.app import sensor_group
from edgestream.pipeline.kafka_io import ensure_topics, producer, set_group_offsets
from edgestream.pipeline.run import records_in_kafka
from edgestream.pipeline.worker import join_decision
from edgestream.streams import codec, topics
from edgestream.streams.codec import RecordBatch
from tests.integration.jobs import train_job

pytestmark = pytest.mark.integration


def send(bootstrap: str, topic: str, values: list[tuple[bytes, bytes]]) -> None:
    prod = producer(bootstrap)
    try:
        for key, value in values:
            prod.send(topic, key=key, value=value)
        prod.flush(timeout=30)
    finally:
        prod.close()


def batch(device: str, n: int, first: int) -> bytes:
    return codec.encode(RecordBatch(device=device, seq=np.arange(first, first + n, dtype=np.uint64),
                                    event_time=np.full(n, 1.7e9), features=np.zeros((n, 64), dtype=np.float32),
                                    labels=np.zeros(n, dtype=np.int32)))


def test_a_worker_without_checkpoint_joins_when_the_log_holds_other_workers_records(kafka_bootstrap, unique,
                                                                                     state_dir):
    cfg = train_job(unique, state_dir, "train.strategy=bsp")
    ensure_topics(kafka_bootstrap, training_topics(cfg.job.name))
    w2_state = cfg.state_path() / "workers" / "w2"

    # An empty log: the job has not started; w2 is a founding member (unless told to join).
    assert join_decision(cfg, "w2", kafka_bootstrap, w2_state, join=False)[0] is False
    assert join_decision(cfg, "w2", kafka_bootstrap, w2_state, join=True) == (True, "--join")

    # Only its own records (a previous incarnation without a checkpoint): still founding.
    gradients = channel_topic(cfg.job.name, "gradients")
    send(kafka_bootstrap, gradients, [(b"w2", b"x")] * 3)
    assert join_decision(cfg, "w2", kafka_bootstrap, w2_state, join=False)[0] is False

    # Records of the others: the job runs, so it joins, and says why.
    send(kafka_bootstrap, gradients, [(b"w0", b"x"), (b"w1", b"x")])
    joins, why = join_decision(cfg, "w2", kafka_bootstrap, w2_state, join=False)
    assert joins is True and "2 record(s) of other workers" in why


def test_unread_records_are_counted_from_the_committed_offset_of_the_workers_group(kafka_bootstrap, unique,
                                                                                   state_dir):
    cfg = train_job(unique, state_dir)
    device = cfg.devices_of("w1")[0]
    ensure_topics(kafka_bootstrap, sensor_topics_for([device]))
    topic = topics.sensor_topic(device)
    # Four messages of 10, 20, 30, 40 records and one malformed message.
    send(kafka_bootstrap, topic, [(device.encode(), batch(device, n, 100 * i))
                                  for i, n in enumerate((10, 20, 30, 40))] + [(device.encode(), b"garbage")])

    assert records_in_kafka(kafka_bootstrap, device, sensor_group(cfg, "w1"), cfg) == 100
    set_group_offsets(kafka_bootstrap, sensor_group(cfg, "w1"), {f"{topic}:0": 2})  # the first two acknowledged
    assert records_in_kafka(kafka_bootstrap, device, sensor_group(cfg, "w1"), cfg) == 70
