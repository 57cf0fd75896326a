"""With ``serve.predictions`` the ingest stamps each record with the message it came in
(``RecordBatch.origin``: partition, offset, Kafka timestamp), whichever way it was read, and the
stamp reaches the batch the trainer gets; without it nothing is stamped."""

from __future__ import annotations

import numpy as np
import orjson

from edgestream.job.config import load_config
from edgestream.monitoring.metrics import Metrics
from edgestream.pipeline.ingest import IngestCore
from edgestream.streams import codec
from edgestream.streams.records import RecordBatch

PREDICTING = ("train.enabled=true", "serve.predictions=true")


def message(device: str, start: int, n: int, *, labelled: bool = True, low: float = 1.0) -> bytes:
    features = np.full((n, 4), low, dtype=np.float32)
    return codec.encode(RecordBatch(
        device=device, seq=np.arange(start, start + n, dtype=np.uint64), event_time=np.full(n, 100.0),
        features=features, labels=np.zeros(n, dtype=np.int32) if labelled else None,
    ))


def make_core(*overrides: str) -> IngestCore:
    cfg = load_config(overrides=["devices.count=2", "batcher.mode=window", "batcher.max_batch=100",
                                 "data.max_timestamp_skew_s=none", *overrides], env={})
    return IngestCore(cfg, ["dev00", "dev01"], Metrics(), expected_shape=(4,), num_classes=10,
                      value_range=(np.zeros(4, np.float32), np.full(4, 2.0, np.float32)))


def one_batch(core: IngestCore) -> RecordBatch:
    (batch,) = core.on_tick(10.0).batches
    return batch.records


def test_messages_read_one_by_one_carry_their_partition_offset_and_timestamp():
    core = make_core(*PREDICTING)
    core.on_message("sensors.dev00", 3, 40, None, message("dev00", 0, 2), "t40", 0.0, 0.0, timestamp_s=500.0)
    core.on_message("sensors.dev00", 3, 41, None, message("dev00", 2, 1), "t41", 0.0, 0.0)
    origin = one_batch(core).origin
    assert origin["partition"].tolist() == [3, 3, 3]
    assert origin["offset"].tolist() == [40, 40, 41]
    assert origin["timestamp"][:2].tolist() == [500.0, 500.0] and np.isnan(origin["timestamp"][2])


def test_a_run_of_messages_stamps_each_record_with_its_own_message():
    core = make_core(*PREDICTING)
    core.on_message("sensors.dev00", 0, 9, None, message("dev00", 0, 2), "t9", 0.0, 0.0)  # fixes the layout
    values = [message("dev00", 2 + 2 * i, 2) for i in range(3)]
    actions = core.on_run("sensors.dev00", values, "run", 0.0, 0.0, [501.0, 502.0, 503.0], partition=0,
                          offsets=[10, 12, 13])  # a gap: offsets are not always consecutive
    assert actions is not None
    origin = one_batch(core).origin
    assert origin["offset"].tolist() == [9, 9, 10, 10, 12, 12, 13, 13]
    assert origin["timestamp"][2:].tolist() == [501.0, 501.0, 502.0, 502.0, 503.0, 503.0]


def test_records_split_out_of_a_message_keep_their_stamp():
    core = make_core(*PREDICTING)
    value = codec.encode(RecordBatch(
        device="dev00", seq=np.arange(3, dtype=np.uint64), event_time=np.full(3, 100.0),
        features=np.array([[1.0] * 4, [9.0] * 4, [1.5] * 4], np.float32), labels=np.zeros(3, np.int32)))
    actions = core.on_message("sensors.dev00", 1, 77, None, value, "t77", 0.0, 0.0, timestamp_s=600.0)
    assert [d.reason for d in actions.dead_letters] == ["out_of_range"]
    records = one_batch(core)
    assert records.seq.tolist() == [0, 2] and records.origin["offset"].tolist() == [77, 77]


def test_delayed_labels_keep_the_stamp_of_the_reading():
    core = make_core(*PREDICTING, "labels.topic=labels.j")
    core.on_message("sensors.dev01", 0, 5, None, message("dev01", 0, 2, labelled=False), "t5", 0.0, 0.0,
                    timestamp_s=700.0)
    label = orjson.dumps([{"device": "dev01", "record_id": 1, "label": 3}])
    core.on_message("labels.j", 0, 0, None, label, "l0", 0.5, 0.5)
    records = one_batch(core)
    assert records.seq.tolist() == [1] and records.labels.tolist() == [3]
    assert records.origin["offset"].tolist() == [5] and records.origin["timestamp"].tolist() == [700.0]


def test_without_predictions_nothing_is_stamped():
    core = make_core()
    core.on_message("sensors.dev00", 0, 1, None, message("dev00", 0, 2), "t1", 0.0, 0.0, timestamp_s=1.0)
    assert one_batch(core).origin is None
