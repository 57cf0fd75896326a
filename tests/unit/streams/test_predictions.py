"""The prediction messages (streams/predictions.py): encode/decode, every field's checks, and
the publishing side's pure parts (top-k, per-batch columns, arrival-time predictions, digests)."""

from __future__ import annotations

import dataclasses

import numpy as np
import orjson
import pytest

from edgestream.streams.batching import Batch
from edgestream.streams.buffering import concat, slice_records
from edgestream.streams.errors import PredictionRejected
from edgestream.streams.predictions import (
    FIELDS,
    ArrivalPredictions,
    DigestCache,
    Made,
    Prediction,
    Scored,
    decode,
    encode,
    encode_scored,
    scored_parts,
    top_k,
)
from edgestream.streams.records import ORIGIN_DTYPE, RecordBatch, with_origin

DIGEST = "ab" * 32


def prediction(**changes) -> Prediction:
    base = Prediction(job="j", worker="w0", device="dev00", topic="sensors.dev00", partition=0, offset=12,
                      record_id=40, event_time=1000.0, kafka_timestamp=1000.5, model_version=7, model_digest=DIGEST,
                      predicted=3, top_k=((3, 0.7), (1, 0.2), (0, 0.05)), at="step", predicted_at=1001.0,
                      published_at=1001.25)
    return dataclasses.replace(base, **changes)


def message(**changes) -> bytes:
    """A valid message with fields of its JSON document replaced (``None`` values kept)."""
    doc = prediction().to_dict()
    doc.update(changes)
    return orjson.dumps(doc)


def records(n: int, start: int = 0, device: str = "dev00") -> RecordBatch:
    return RecordBatch(device=device, seq=np.arange(start, start + n, dtype=np.uint64),
                       event_time=np.linspace(100.0, 101.0, n), features=np.zeros((n, 2), np.float32),
                       labels=np.zeros(n, np.int32))


# --- the message ------------------------------------------------------------------------------
def test_a_prediction_round_trips_and_its_latencies_follow_from_its_times():
    p = prediction()
    doc = orjson.loads(encode(p))
    assert set(doc) == set(FIELDS) and doc["v"] == 1
    assert doc["latency_event_s"] == pytest.approx(1.25) and doc["latency_append_s"] == pytest.approx(0.75)
    assert doc["top_k"][0] == {"class": 3, "p": 0.7}
    assert decode(encode(p)) == p


def test_unknown_times_and_positions_are_null_and_their_latencies_too():
    p = prediction(event_time=None, kafka_timestamp=None, partition=None, offset=None, at="arrival")
    doc = orjson.loads(encode(p))
    assert doc["latency_event_s"] is None and doc["latency_append_s"] is None
    assert decode(encode(p)) == p


def test_a_reader_ignores_fields_it_does_not_know():
    assert decode(message(later_field={"x": 1})) == prediction()


@pytest.mark.parametrize(("value", "reason"), [
    (b"not json", "bad_json"),
    (b"[1, 2]", "bad_json"),
    (b"", "bad_json"),
    (b'{"v": 1}', "missing_field"),
])
def test_what_is_not_a_prediction_object_is_refused(value, reason):
    with pytest.raises(PredictionRejected) as err:
        decode(value)
    assert err.value.reason == reason


@pytest.mark.parametrize("field", FIELDS)
def test_a_message_without_any_one_field_is_refused_naming_it(field):
    doc = prediction().to_dict()
    del doc[field]
    with pytest.raises(PredictionRejected) as err:
        decode(orjson.dumps(doc))
    assert err.value.reason == "missing_field" and field in err.value.detail


BAD_FIELDS = [
    ("v", 2, "bad_version"), ("v", "1", "bad_type"), ("v", True, "bad_type"),
    ("job", "", "bad_type"), ("job", 5, "bad_type"), ("worker", None, "bad_type"),
    ("device", "x" * 256, "bad_type"), ("topic", ["t"], "bad_type"),
    ("partition", -1, "bad_value"), ("partition", 1.5, "bad_type"), ("partition", True, "bad_type"),
    ("offset", -3, "bad_value"), ("offset", "12", "bad_type"),
    ("record_id", None, "bad_type"), ("record_id", -1, "bad_value"), ("record_id", 2**64, "bad_type"),
    ("event_time", "yesterday", "bad_type"), ("kafka_timestamp", False, "bad_type"),
    ("model_version", -1, "bad_value"), ("model_version", 2.0, "bad_type"),
    ("model_digest", "AB" * 32, "bad_value"), ("model_digest", "ab" * 31, "bad_value"), ("model_digest", 1, "bad_value"),
    ("predicted", -2, "bad_value"), ("predicted", 1, "bad_value"),  # 1 is not top_k's first class
    ("top_k", [], "bad_type"), ("top_k", {"class": 3}, "bad_type"), ("top_k", [[3, 0.7]], "bad_type"),
    ("top_k", [{"class": 3, "p": 1.5}], "bad_value"), ("top_k", [{"class": -3, "p": 0.5}], "bad_value"),
    ("top_k", [{"class": 3, "p": 0.4}, {"class": 1, "p": 0.5}], "bad_value"),  # not most probable first
    ("top_k", [{"class": 3, "p": 0.6}, {"class": 3, "p": 0.3}], "bad_value"),  # a class twice
    ("top_k", [{"class": 3, "p": 0.7}, {"class": 1, "p": 0.6}], "bad_value"),  # sums above 1
    ("at", "later", "bad_value"),
    ("predicted_at", None, "bad_type"), ("predicted_at", 1002.0, "bad_value"),  # after published_at
    ("published_at", float("nan"), "bad_json"),
    ("latency_event_s", 9.0, "bad_value"), ("latency_event_s", None, "bad_type"),
    ("latency_append_s", "0.75", "bad_type"),
]


#: Values JSON encoders refuse to write, put in the message's text: (field, value) -> (old, new).
RAW = {("record_id", 2**64): (b'"record_id":40', b'"record_id":18446744073709551616'),  # read as a float
       ("published_at", "nan"): (b'"published_at":1001.25', b'"published_at":NaN')}  # JSON has no NaN


@pytest.mark.parametrize(("field", "value", "reason"), BAD_FIELDS, ids=[f"{f}={v!r}"[:40] for f, v, _ in BAD_FIELDS])
def test_each_field_is_checked(field, value, reason):
    raw = RAW.get((field, value if isinstance(value, int) else "nan" if value != value else None))
    value_bytes = message(**{field: value}) if raw is None else message().replace(*raw)
    assert raw is None or value_bytes != message()
    with pytest.raises(PredictionRejected) as err:
        decode(value_bytes)
    assert err.value.reason == reason
    if reason not in ("bad_json", "bad_version"):
        named = "predicted" if field == "predicted" else field
        assert named in err.value.detail or (field == "predicted" and "top_k" in err.value.detail)


def test_a_latency_given_for_an_unknown_time_is_refused():
    with pytest.raises(PredictionRejected, match="latency_event_s must be null"):
        decode(message(event_time=None))


# --- the publishing side ----------------------------------------------------------------------
def test_top_k_lists_the_most_probable_first_lower_class_on_ties_capped_at_the_classes():
    probabilities = np.array([[0.1, 0.6, 0.3], [0.4, 0.2, 0.4]], dtype=np.float32)
    classes, probs = top_k(probabilities, 2)
    assert classes.tolist() == [[1, 2], [0, 2]]
    assert probs.ravel().tolist() == pytest.approx([0.6, 0.3, 0.4, 0.4])
    assert (classes[:, 0] == probabilities.argmax(axis=1)).all()
    assert top_k(probabilities, 10)[0].shape == (2, 3)


def scored_of(batch: RecordBatch, version: int = 5, topic: str = "sensors.dev00") -> Scored:
    probabilities = np.tile(np.array([0.1, 0.2, 0.7], np.float32), (batch.count, 1))
    classes, probs = top_k(probabilities, 2)
    return Scored.of(batch, topic, version=version, digest=DIGEST, classes=classes, probabilities=probs,
                     predicted_at=200.0)


def test_every_record_of_a_batch_becomes_one_message_keyed_by_its_device():
    batch = with_origin(records(3, start=10), 2, np.array([40, 40, 41]), np.array([150.0, 150.0, 150.5]))
    out = encode_scored(scored_of(batch), job="j", worker="w1", published_at=201.0)
    assert [key for key, _ in out] == [b"dev00"] * 3
    decoded = [decode(value) for _, value in out]
    assert [(p.partition, p.offset, p.record_id) for p in decoded] == [(2, 40, 10), (2, 40, 11), (2, 41, 12)]
    assert [p.kafka_timestamp for p in decoded] == [150.0, 150.0, 150.5]
    assert decoded[0].event_time == 100.0 and decoded[0].latency_event_s == pytest.approx(101.0)
    assert decoded[2].latency_append_s == pytest.approx(50.5)
    assert {(p.worker, p.job, p.model_version, p.model_digest, p.predicted, p.at) for p in decoded} == {
        ("w1", "j", 5, DIGEST, 2, "step")}
    assert decoded[0].top_k == ((2, pytest.approx(0.7)), (1, pytest.approx(0.2)))


def test_records_without_an_origin_publish_null_positions_and_append_times():
    (p,) = [decode(v) for _, v in encode_scored(scored_of(records(1)), job="j", worker="w0", published_at=300.0)]
    assert (p.partition, p.offset, p.kafka_timestamp, p.latency_append_s) == (None, None, None, None)


def test_selecting_rows_keeps_each_row_whole():
    batch = with_origin(records(4), 0, np.arange(4), None)
    picked = scored_of(batch).select(np.array([1, 3]))
    assert picked.record_id.tolist() == [1, 3] and picked.offset.tolist() == [1, 3] and picked.size == 2


def test_a_step_publishes_its_trained_records_per_device_batch_and_leaves_out_the_dead_ones():
    a = with_origin(records(3, device="a"), 0, np.array([7, 7, 8]), None)
    b = with_origin(records(2, start=5, device="b"), 1, 3, None)
    probabilities = np.eye(4, dtype=np.float32)[[0, 1, 2, 3, 0]]  # one sure class per record
    classes, probs = top_k(probabilities, 2)
    kwargs = dict(version=9, digest=DIGEST, classes=classes, probabilities=probs, predicted_at=1.0)
    every = scored_parts([(a, "sensors.a"), (b, "sensors.b")], **kwargs)
    assert [(s.device, s.topic, s.size) for s in every] == [("a", "sensors.a", 3), ("b", "sensors.b", 2)]
    assert every[1].classes[:, 0].tolist() == [3, 0] and every[1].partition.tolist() == [1, 1]
    # The culprit search dead-lettered positions 1 and 3: the others were trained.
    kept = scored_parts([(a, "sensors.a"), (b, "sensors.b")], trained=np.array([0, 2, 4]), **kwargs)
    assert [s.record_id.tolist() for s in kept] == [[0, 2], [6]]
    assert [s.classes[:, 0].tolist() for s in kept] == [[0, 2], [0]]
    assert kept[0].offset.tolist() == [7, 8]


def test_an_origin_follows_its_records_through_slices_joins_and_selections():
    a = with_origin(records(3), 1, np.array([5, 5, 6]), np.array([1.0, 1.0, 2.0]))
    b = with_origin(records(2, start=3), 1, 9, 3.0)
    assert a.origin.dtype == ORIGIN_DTYPE
    joined = concat([slice_records(a, 1, 3), b])
    assert joined.origin["offset"].tolist() == [5, 6, 9, 9]
    assert joined.origin["timestamp"].tolist() == [1.0, 2.0, 3.0, 3.0]
    chosen = Batch("dev00", joined, 0.0, [("t1", 2), ("t2", 2)]).select([0, 3])
    assert chosen.records.origin["offset"].tolist() == [5, 9] and chosen.records.seq.tolist() == [1, 4]
    assert concat([a, records(1)]).origin is None  # not all known: none
    assert np.isnan(with_origin(records(1), 0, 0, None).origin["timestamp"]).all()
    with pytest.raises(ValueError, match="origin"):
        RecordBatch(device="d", seq=np.arange(2, dtype=np.uint64), event_time=np.zeros(2),
                    features=np.zeros((2, 1), np.float32), origin=np.zeros(3, ORIGIN_DTYPE))


def made(version: int, cls: int) -> Made:
    return Made(version, "cd" * 32, np.array([cls, 0]), np.array([0.9, 0.05], np.float32), 50.0)


def test_an_arrival_time_prediction_replaces_the_step_time_one_once():
    kept = ArrivalPredictions(limit=10)
    kept.put([("dev00", 1), ("dev01", 2)], [made(2, 4), made(2, 6)])
    step = scored_of(records(3))  # record ids 0, 1, 2 of dev00
    applied = kept.apply(step)
    assert applied.arrival.tolist() == [False, True, False]
    assert applied.model_version.tolist() == [5, 2, 5] and applied.model_digest[1] == "cd" * 32
    assert applied.classes[:, 0].tolist() == [2, 4, 2] and applied.predicted_at.tolist() == [200.0, 50.0, 200.0]
    assert step.arrival.tolist() == [False, False, False]  # the step's own columns are untouched
    assert kept.apply(step).arrival.tolist() == [False, False, False]  # given once
    assert len(kept) == 1  # dev01's is still kept
    (p,) = [decode(v) for _, v in encode_scored(applied.select(np.array([1])), job="j", worker="w0",
                                                published_at=300.0)]
    assert (p.at, p.predicted, p.model_version, p.predicted_at) == ("arrival", 4, 2, 50.0)


def test_the_oldest_arrival_predictions_are_forgotten_past_the_limit():
    kept = ArrivalPredictions(limit=2)
    kept.put([("d", 1), ("d", 2), ("d", 3)], [made(1, 1), made(1, 2), made(1, 3)])
    assert len(kept) == 2 and kept.forgotten == 1
    assert kept.take("d", [1, 2, 3])[0] is None


def test_the_digest_is_computed_once_per_version():
    calls = []
    cache = DigestCache(lambda: calls.append(1) or f"{len(calls):064x}")
    assert cache.of(3) == cache.of(3) == f"{1:064x}"
    assert cache.of(4) == f"{2:064x}" and cache.computed == len(calls) == 2


def _reference_encode(scored: Scored, *, job: str, worker: str, published_at: float) -> list[tuple[bytes, bytes]]:
    """The schema one prediction at a time: one dict per record, ``orjson.dumps`` each."""
    import orjson

    out = []
    for i in range(scored.size):
        event_time, stamp = float(scored.event_time[i]), float(scored.kafka_timestamp[i])
        known_time, known_stamp = event_time == event_time, stamp == stamp
        partition, offset = int(scored.partition[i]), int(scored.offset[i])
        classes, probs = scored.classes[i].tolist(), scored.probabilities[i].tolist()
        out.append((scored.device.encode(), orjson.dumps({
            "v": 1, "job": job, "worker": worker, "device": scored.device, "topic": scored.topic,
            "partition": partition if partition >= 0 else None, "offset": offset if offset >= 0 else None,
            "record_id": int(scored.record_id[i]), "event_time": event_time if known_time else None,
            "kafka_timestamp": stamp if known_stamp else None, "model_version": int(scored.model_version[i]),
            "model_digest": scored.model_digest[i], "predicted": classes[0],
            "top_k": [{"class": c, "p": p} for c, p in zip(classes, probs, strict=True)],
            "at": scored.at or ("arrival" if scored.arrival[i] else "step"),
            "predicted_at": float(scored.predicted_at[i]), "published_at": published_at,
            "latency_event_s": published_at - event_time if known_time else None,
            "latency_append_s": published_at - stamp if known_stamp else None})))
    return out


@pytest.mark.parametrize("k", [1, 3])
def test_a_batch_encodes_to_exactly_the_bytes_of_one_object_per_record(k):
    rng = np.random.default_rng(k)
    n = 40
    probabilities = rng.random((n, 5)).astype(np.float32)
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    classes, probs = top_k(probabilities, k)
    event_time = 1.7e9 + rng.random(n) * 100
    event_time[[3, 17]] = np.nan  # unknown event times
    stamp = event_time + rng.random(n)
    stamp[[5, 17, 30]] = np.nan  # no Kafka timestamp
    batch = with_origin(records(n, start=2**63 + 5), 3, np.arange(n) * 7, stamp)
    batch = RecordBatch(device="dev%00", seq=batch.seq, event_time=event_time, features=batch.features,
                        origin=batch.origin)
    scored = Scored.of(batch, "sensors.dev%00", version=12, digest=DIGEST, classes=classes, probabilities=probs,
                       predicted_at=1.7e9 + 101.25)
    partition, offset = scored.partition.copy(), scored.offset.copy()
    partition[[2, 9]], offset[[2, 11]] = -1, -1  # unknown positions
    arrival = np.zeros(n, dtype=bool)
    arrival[[4, 8]] = True
    digests = list(scored.model_digest)
    digests[8] = "cd" * 32
    mixed = dataclasses.replace(scored, partition=partition, offset=offset, arrival=arrival, model_digest=digests)
    for one in (mixed, dataclasses.replace(mixed, at="serve"), mixed.select(np.array([0])), mixed.select(np.array([], int))):
        kwargs = dict(job='j"%s', worker="serve-0", published_at=1.7e9 + 102.123456789)
        assert encode_scored(one, **kwargs) == _reference_encode(one, **kwargs)
