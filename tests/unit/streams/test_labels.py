"""Delayed labels, the pure parts: the label message decoder, the join and the simulated plan."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from edgestream.streams.errors import RecordDecodeError
from edgestream.streams.labels import (
    Label,
    LabelDecoder,
    LabelFields,
    LabelJoin,
    LabelPlan,
    encode_labels,
    join_keys,
    time_key,
)


def decoder(**fields) -> LabelDecoder:
    return LabelDecoder(LabelFields(**fields), num_classes=4, max_bytes=4096, max_labels=8)


def test_one_object_or_an_array_of_them():
    d = decoder()
    assert d.decode(b'{"device": "d1", "record_id": 7, "label": 3}') == [Label("d1", 7, 3)]
    assert d.decode(b'[{"device": "d1", "record_id": 7, "label": 3}, {"device": "d2", "record_id": 0, '
                    b'"label": 0}]') == [Label("d1", 7, 3), Label("d2", 0, 0)]


def test_the_device_may_come_from_the_key_and_fields_may_be_renamed():
    d = decoder(device="dev", record_id="n", label="y")
    assert d.decode(b'{"n": 1, "y": 2}', key=b"pump-3") == [Label("pump-3", 1, 2)]
    assert d.decode(b'{"dev": "a", "n": 1, "y": 2}', key=b"b") == [Label("a", 1, 2)]  # the field wins


def test_matching_by_event_time_in_any_unit_agrees_with_the_readings_keys():
    d = decoder(match="event_time", time_unit="ms")
    (label,) = d.decode(b'{"device": "d", "event_time": 1795000000123, "label": 1}')
    readings = join_keys("event_time", np.array([5], np.uint64), np.array([1795000000.123]))
    assert label.key == readings[0] == time_key(1795000000.123)


@pytest.mark.parametrize(("value", "reason", "words"), [
    (b"{not json", "bad_json", "not JSON"),
    (b"[]", "bad_label", "empty"),
    (b"[1]", "bad_type", "not an object"),
    (b'{"record_id": 1, "label": 1}', "missing_field", "'device'"),
    (b'{"device": "d", "label": 1}', "missing_field", "'record_id'"),
    (b'{"device": "d", "record_id": 1}', "missing_field", "'label'"),
    (b'{"device": "a b", "record_id": 1, "label": 1}', "bad_device", "not a device id"),
    (b'{"device": "d", "record_id": "1", "label": 1}', "bad_type", "record id"),
    (b'{"device": "d", "record_id": -1, "label": 1}', "bad_type", "record id"),
    (b'{"device": "d", "record_id": 1.0, "label": 1}', "bad_type", "record id"),
    (b'{"device": "d", "record_id": 1, "label": "1"}', "bad_type", "not an integer"),
    (b'{"device": "d", "record_id": 1, "label": true}', "bad_type", "not an integer"),
    (b'{"device": "d", "record_id": 1, "label": 4}', "bad_label", "[0, 4)"),
    (b'{"device": "d", "record_id": 1, "label": -1}', "bad_label", "[0, 4)"),
    (b'[' + b",".join([b'{"device": "d", "record_id": 1, "label": 1}'] * 9) + b"]", "bad_count", "limit 8"),
    (b" " * 5000, "too_large", "limit 4096"),
])
def test_bad_label_messages_say_why(value, reason, words):
    with pytest.raises(RecordDecodeError) as info:
        decoder().decode(value)
    assert info.value.reason == reason and words in info.value.detail


@pytest.mark.parametrize("t", ['"NaN"', "1e300", '"2026-01-01"', "null"])
def test_a_label_time_that_is_no_time_is_refused(t):
    with pytest.raises(RecordDecodeError) as info:
        decoder(match="event_time").decode(b'{"device": "d", "event_time": %s, "label": 1}' % t.encode())
    assert info.value.reason in ("bad_time", "missing_field")


def test_a_reading_waits_for_its_label_and_joins_it():
    join = LabelJoin(max_delay_s=5.0, max_pending=10)
    held = join.hold("d", [1, 2], "batch", "t0", now=0.0)
    assert held.joined == [] and [w.key for w in held.waiting] == [1, 2] and join.waiting == 2
    match, late = join.give(Label("d", 2, 3), "L0", now=1.0)
    assert late == [] and match is not None
    assert (match.reading.key, match.reading.index, match.label, match.label_token) == (2, 1, 3, "L0")
    assert join.waiting == 1


def test_a_label_that_comes_first_waits_for_its_reading():
    join = LabelJoin(max_delay_s=5.0, max_pending=10)
    assert join.give(Label("d", 1, 0), "L0", now=0.0) == (None, [])
    held = join.hold("d", [0, 1], "batch", "t0", now=1.0)
    (joined,) = held.joined
    assert (joined.reading.index, joined.label, joined.label_token) == (1, 0, "L0")
    assert [w.key for w in held.waiting] == [0] and join.early == 0


def test_what_does_not_meet_in_time_leaves_counted():
    join = LabelJoin(max_delay_s=5.0, max_pending=10)
    join.hold("d", [1], "batch", "t0", now=0.0)
    join.give(Label("d", 9, 0), "L0", now=2.0)
    assert not join.expire(4.9)
    first = join.expire(5.0)
    assert [w.key for w in first.readings] == [1] and first.late_tokens == []
    second = join.expire(7.0)
    assert second.readings == [] and second.late_tokens == ["L0"]
    # a label for a reading that already left is late too, once its own wait is over
    assert join.give(Label("d", 1, 0), "L1", now=8.0) == (None, [])
    assert join.expire(13.0).late_tokens == ["L1"]


def test_both_waits_are_bounded_and_the_oldest_leave_first():
    join = LabelJoin(max_delay_s=60.0, max_pending=2)
    held = join.hold("d", [1, 2, 3], "batch", "t0", now=0.0)
    assert [w.key for w in held.evicted] == [1] and join.waiting == 2
    join.give(Label("e", 1, 0), "L1", now=0.0)
    join.give(Label("e", 2, 0), "L2", now=0.0)
    assert join.give(Label("e", 3, 0), "L3", now=0.0) == (None, ["L1"])


def test_a_reading_sent_twice_while_waiting_is_a_duplicate_and_a_second_label_replaces_the_first():
    join = LabelJoin(max_delay_s=60.0, max_pending=10)
    join.hold("d", [1], "batch", "t0", now=0.0)
    assert join.hold("d", [1], "batch", "t1", now=0.0).duplicates == [0]
    join.give(Label("d", 5, 0), "L0", now=0.0)
    assert join.give(Label("d", 5, 1), "L1", now=0.0) == (None, ["L0"])
    (joined,) = join.hold("d", [5], "batch", "t2", now=1.0).joined
    assert joined.label == 1


def test_the_plan_delays_each_label_within_bounds_and_withholds_the_missing_share():
    plan = LabelPlan((1.0, 3.0), missing=0.1, seed=7)
    plan.plan("d", list(range(2000)), np.zeros(2000, np.int32), sent_at=10.0)
    assert plan.planned + plan.withheld == 2000 and 150 < plan.withheld < 250
    assert plan.due(10.99) == {}
    due = plan.due(13.0)
    assert len(due["d"]) == plan.planned and plan.outstanding == 0
    again = LabelPlan((1.0, 3.0), missing=0.1, seed=7)
    again.plan("d", list(range(2000)), np.zeros(2000, np.int32), sent_at=10.0)
    assert again.withheld == plan.withheld  # deterministic from the seed


@pytest.mark.parametrize(("match", "unit"), [("record_id", "s"), ("event_time", "s"), ("event_time", "ms"),
                                             ("event_time", "us")])
def test_encoded_labels_decode_to_the_same_keys(match, unit):
    fields = LabelFields(match=match, time_unit=unit, label="y")
    times = np.array([1795000000.001, 1795000000.5, 1795000123.999])
    keys = join_keys(match, np.array([3, 4, 5], np.uint64), times)
    value = encode_labels(fields, "d", list(zip(keys, [0, 1, 2], strict=True)))
    assert isinstance(orjson.loads(value), list)
    decoded = LabelDecoder(fields, 3, max_bytes=4096, max_labels=8).decode(value)
    assert [(x.device, x.key, x.label) for x in decoded] == [("d", k, y) for k, y in zip(keys, [0, 1, 2],
                                                                                             strict=True)]
