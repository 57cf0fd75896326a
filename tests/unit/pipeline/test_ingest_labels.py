"""IngestCore with delayed labels (labels.topic): readings wait for their label, join it,
or leave counted; a label is acknowledged only with its reading; the ledger balances."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from edgestream.job.config import ConfigError, load_config
from edgestream.monitoring.metrics import Metrics
from edgestream.pipeline.ingest import LABELS_DEVICE, IngestCore
from edgestream.streams import codec
from edgestream.streams.records import RecordBatch

LABELS = "labels.job"


def reading(device: str, start: int, n: int, labelled: bool = False) -> bytes:
    return codec.encode(RecordBatch(
        device=device, seq=np.arange(start, start + n, dtype=np.uint64),
        event_time=np.full(n, 1_795_000_000.0), features=np.arange(n * 4, dtype=np.float32).reshape(n, 4) / 100,
        labels=np.full(n, 1, np.int32) if labelled else None,
    ))


def labels(*items: tuple[str, int, int]) -> bytes:
    return orjson.dumps([{"device": d, "record_id": r, "label": y} for d, r, y in items])


def make_core(*overrides: str, devices=("dev00", "dev01")) -> IngestCore:
    cfg = load_config(overrides=["devices.count=3", "batcher.mode=fixed", "batcher.batch_size=2",
                                 f"labels.topic={LABELS}", "labels.max_delay_s=5", *overrides], env={})
    return IngestCore(cfg, list(devices), Metrics(), expected_shape=(4,), num_classes=4, require_labels=True)


def feed(core: IngestCore, value: bytes, offset: int, now: float = 0.0, device: str = "dev00"):
    return core.on_message(f"sensors.{device}", 0, offset, None, value, f"{device}@{offset}", now, now)


def give(core: IngestCore, value: bytes, offset: int, now: float = 0.0, key: bytes | None = None):
    return core.on_message(LABELS, 0, offset, key, value, f"labels@{offset}", now, now)


def balances(acc: dict[str, Any]) -> bool:
    return acc["records_in"] == acc["consumed"] + acc["dropped"] + acc["dead_records"] + acc["pending"]


def test_readings_wait_for_their_labels_and_both_are_acknowledged_once_trained():
    core = make_core()
    waited = feed(core, reading("dev00", 0, 2), 0)
    assert waited.batches == [] and waited.dead_letters == []  # no labels: waiting, not dead-lettered
    acc = core.accounting()["dev00"]
    assert acc["awaiting_label"] == 2 and acc["pending"] == 2 and balances(acc)

    joined = give(core, labels(("dev00", 1, 3), ("dev00", 0, 2)), 0, now=1.0)
    (batch,) = joined.batches
    assert sorted(zip(batch.records.seq.tolist(), batch.records.labels.tolist(), strict=True)) == [(0, 2), (1, 3)]
    assert joined.ack == []  # the label is committed with its readings, not before
    assert core.settle_batch(batch) == ["dev00@0", "labels@0"]
    acc = core.accounting()["dev00"]
    assert (acc["consumed"], acc["awaiting_label"], acc["pending"]) == (2, 0, 0) and balances(acc)
    assert core.label_counts["joined"] == 2 and core.label_counts["read"] == 2


def test_a_label_before_its_reading_joins_it_on_arrival():
    core = make_core()
    assert give(core, labels(("dev00", 0, 1), ("dev00", 1, 0)), 0).batches == []
    (batch,) = feed(core, reading("dev00", 0, 2), 0, now=2.0).batches
    assert batch.records.labels.tolist() == [1, 0]
    assert core.accounting()["dev00"]["awaiting_label"] == 0
    assert core.settle_batch(batch) == ["dev00@0", "labels@0"]


def test_a_reading_whose_label_never_comes_is_dropped_unlabeled_and_a_late_label_is_counted():
    core = make_core()
    feed(core, reading("dev00", 0, 2), 0)
    give(core, labels(("dev00", 0, 1)), 0, now=1.0)  # record 1's label never comes
    assert core.on_tick(4.9).ack == []
    expired = core.on_tick(5.0)
    acc = core.accounting()["dev00"]
    assert acc["dropped_by_reason"] == {"unlabeled": 1} and acc["awaiting_label"] == 0 and balances(acc)
    (batch,) = core.flush(5.0).batches  # record 0, labelled, as the fixed remainder
    assert expired.ack == [] and core.settle_batch(batch) == ["dev00@0", "labels@0"]
    # record 1's label comes now: too late
    assert give(core, labels(("dev00", 1, 1)), 1, now=6.0).ack == []
    assert core.on_tick(11.0).ack == ["labels@1"]
    assert core.label_counts["late"] == 1


def test_labels_of_another_workers_devices_are_passed_over_at_once():
    core = make_core()
    actions = give(core, labels(("dev02", 0, 1), ("dev02", 1, 1)), 0)
    assert actions.ack == ["labels@0"] and core.label_counts["foreign"] == 2


def test_a_bad_label_message_is_dead_lettered_with_its_reason():
    core = make_core()
    (letter,) = give(core, b'{"device": "dev00", "record_id": 0, "label": 9}', 3).dead_letters
    assert (letter.device, letter.reason, letter.offset) == (LABELS_DEVICE, "bad_label", 3)
    assert "allowed [0, 4)" in letter.detail
    assert core.letter_sent(letter) == ["labels@3"]
    assert core.label_counts["dead_lettered"] == 1


def test_readings_with_their_labels_inside_go_straight_on():
    core = make_core()
    (batch,) = feed(core, reading("dev00", 0, 2, labelled=True), 0).batches
    assert batch.records.labels.tolist() == [1, 1] and core.accounting()["dev00"]["awaiting_label"] == 0


def test_the_arrival_time_prediction_is_scored_when_the_label_comes():
    core = make_core()
    core.predict_on_arrival = True
    waiting = feed(core, reading("dev00", 0, 2), 0).predict
    assert [w.key for w in waiting] == [0, 1]
    waiting[0].prediction, waiting[1].prediction = 2, 0
    give(core, labels(("dev00", 0, 2), ("dev00", 1, 1)), 0, now=1.0)
    assert (core.label_counts["scored"], core.label_counts["correct"]) == (2, 1)


def test_a_full_label_wait_drops_the_oldest_reading_counted():
    core = make_core("labels.max_pending=2")
    feed(core, reading("dev00", 0, 2), 0)
    actions = feed(core, reading("dev00", 2, 1), 1)
    acc = core.accounting()["dev00"]
    assert acc["dropped_by_reason"] == {"label_wait_full": 1} and acc["awaiting_label"] == 2 and balances(acc)
    assert actions.ack == []  # dev00@0 still has a reading waiting


def test_a_shared_topic_keeps_labels_of_devices_it_has_not_met_yet():
    core = make_core("input.topic=readings", "input.partitions=2", devices=())
    assert give(core, labels(("pump", 0, 1), ("pump", 1, 3)), 0, key=b"pump").ack == []
    (batch,) = core.on_message("readings", 0, 0, b"pump", reading("pump", 0, 2), "r@0", 1.0, 1.0).batches
    assert batch.records.labels.tolist() == [1, 3]


@pytest.mark.parametrize(("overrides", "words"), [
    (["labels.topic=sensors.dlq"], "sensors.dlq"),
    (["labels.topic=sensors.{device}"], "not a topic of its own"),
    (["labels.topic=sensors.dev00"], "not a topic of its own"),
    ([f"labels.topic={LABELS}", "labels.match=seq"], "labels.match"),
    ([f"labels.topic={LABELS}", "labels.simulate_delay_s=5,1"], "low <= high"),
    ([f"labels.topic={LABELS}", "labels.simulate_missing=1"], "[0, 1)"),
    ([f"labels.topic={LABELS}", "kafka.ingest_source=faust"], "ingest_source=direct"),
    ([f"labels.topic={LABELS}", "input.format=json", "input.features=a"], "needs input.record_id"),
    ([f"labels.topic={LABELS}", "labels.match=event_time", "input.format=json", "input.features=a"],
     "needs input.event_time"),
])
def test_a_label_setting_that_cannot_work_is_refused_with_the_fix(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides, env={})
    assert words in str(info.value)
