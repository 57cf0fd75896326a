"""Input formats: the registry, the native format behind it, and JSON readings (every
accepted shape of message and every rejection path)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import numpy as np
import pytest

from edgestream.streams import codec, formats
from edgestream.streams.errors import OutOfRange, RecordDecodeError
from edgestream.streams.formats.json_records import JsonDecoder, JsonMapping
from edgestream.streams.records import RecordBatch

T0 = 1_700_000_000.0


def decoder(limits: codec.DecodeLimits = codec.DEFAULT_LIMITS, *, expected_device="dev01", expected_shape=None,
            value_range=None, **mapping) -> JsonDecoder:
    mapping.setdefault("features", ["a", "b"])
    fmt = formats.format_named("json")
    return fmt.decoder(fmt.parse_params(mapping), limits, expected_device=expected_device,
                       expected_shape=expected_shape, value_range=value_range)


def msg(value) -> bytes:
    return json.dumps(value).encode()


def rejected(dec: JsonDecoder, data: bytes, **kwargs) -> RecordDecodeError:
    with pytest.raises(RecordDecodeError) as err:
        dec.decode(data, **kwargs)
    assert err.value.reason in RecordDecodeError.REASONS
    return err.value


# --- accepted messages ------------------------------------------------------------------

def test_one_object_is_a_batch_of_one_record():
    batch = decoder(label="y", event_time="t").decode(msg({"a": 1.5, "b": -2, "y": 3, "t": T0}))

    assert batch.device == "dev01" and batch.count == 1
    assert batch.features.dtype == np.float32 and batch.features.tolist() == [[1.5, -2.0]]
    assert batch.labels.dtype == np.int32 and batch.labels.tolist() == [3]
    assert batch.event_time.dtype == np.float64 and batch.event_time.tolist() == [T0]
    assert batch.seq.dtype == np.uint64 and batch.seq.tolist() == [0]


def test_an_array_of_readings_is_one_batch_in_order():
    readings = [{"a": i, "b": 10 * i, "t": T0 + i} for i in range(5)]

    batch = decoder(event_time="t").decode(msg(readings))

    assert batch.count == 5
    assert batch.features.tolist() == [[i, 10 * i] for i in range(5)]
    assert batch.event_time.tolist() == [T0 + i for i in range(5)]
    assert batch.seq.tolist() == [0, 1, 2, 3, 4]
    assert batch.labels is None


def test_scalar_feature_fields_come_in_the_mapping_order_from_nested_paths():
    reading = {"imu": {"gz": 9.0, "ax": 1.0, "ay": 2.0}, "env": {"temp": 21.5}, "t": T0}
    dec = decoder(features=["imu.ay", "imu.ax", "env.temp", "imu.gz"], event_time="t")

    batch = dec.decode(msg([reading, reading]))

    assert batch.feature_shape == (4,)
    assert batch.features.tolist() == [[2.0, 1.0, 21.5, 9.0]] * 2


def test_fields_under_one_parent_and_a_single_field():
    dec = decoder(features=["imu.ax", "imu.ay"], event_time="t")
    assert dec.decode(msg({"imu": {"ax": 1, "ay": 2}, "t": T0})).features.tolist() == [[1.0, 2.0]]
    one = decoder(features=["deep.er.x"], event_time="t")
    assert one.decode(msg({"deep": {"er": {"x": 7}}, "t": T0})).features.tolist() == [[7.0]]


def test_a_nested_array_feature_with_the_expected_shape():
    rng = np.random.default_rng(0)
    images = rng.random((3, 8, 8))
    readings = [{"pixels": img.tolist(), "label": i, "ts": T0} for i, img in enumerate(images)]
    dec = decoder(features="pixels", label="label", event_time="ts", expected_shape=(8, 8))

    batch = dec.decode(msg(readings))

    assert batch.feature_shape == (8, 8)
    np.testing.assert_array_equal(batch.features, images.astype(np.float32))
    assert batch.labels.tolist() == [0, 1, 2]


def test_a_flat_array_feature_and_one_of_four_dims():
    dec = decoder(features="v", event_time="t")
    assert dec.decode(msg({"v": [1, 2, 3], "t": T0})).feature_shape == (3,)
    four = np.arange(16, dtype=np.float32).reshape(2, 2, 2, 2)
    assert dec.decode(msg({"v": four.tolist(), "t": T0})).feature_shape == (2, 2, 2, 2)


def test_a_label_mapped_but_absent_from_every_reading_makes_an_unlabelled_message():
    dec = decoder(label="meta.label", event_time="t")
    assert dec.decode(msg([{"a": 1, "b": 2, "t": T0}] * 2)).labels is None
    labelled = dec.decode(msg([{"a": 1, "b": 2, "t": T0, "meta": {"label": 4}}] * 2))
    assert labelled.labels.tolist() == [4, 4]


@pytest.mark.parametrize("unit, value, seconds", [
    ("s", 1_700_000_000, 1_700_000_000.0),
    ("s", 1_700_000_000.25, 1_700_000_000.25),
    ("ms", 1_700_000_000_250, 1_700_000_000.25),
    ("us", 1_700_000_000_250_000, 1_700_000_000.25),
    ("ns", 1_700_000_000_250_000_000, 1_700_000_000.25),
])
def test_numeric_event_times_in_each_unit(unit, value, seconds):
    batch = decoder(event_time="time", time_unit=unit).decode(msg({"a": 1, "b": 2, "time": value}))
    assert batch.event_time[0] == pytest.approx(seconds, abs=1e-6)


@pytest.mark.parametrize("text, expected", [
    ("2024-01-01T00:00:00Z", datetime(2024, 1, 1, tzinfo=UTC)),
    ("2024-01-01T02:00:00+02:00", datetime(2024, 1, 1, tzinfo=UTC)),
    ("2024-01-01T00:00:00.250-05:30", datetime(2024, 1, 1, 5, 30, 0, 250_000, tzinfo=UTC)),
    ("2024-01-01T00:00:00.123456789Z", datetime(2024, 1, 1, 0, 0, 0, 123_456, tzinfo=UTC)),
])
def test_iso8601_event_times_with_a_timezone(text, expected):
    batch = decoder(event_time="ts", time_unit="iso8601").decode(msg({"a": 1, "b": 2, "ts": text}))
    assert batch.event_time[0] == expected.timestamp()


def test_without_an_event_time_field_the_kafka_timestamp_is_every_records_time():
    batch = decoder().decode(msg([{"a": 1, "b": 2}] * 3), timestamp_s=T0 + 0.5)
    assert batch.event_time.tolist() == [T0 + 0.5] * 3


def test_record_id_is_the_sequence_number():
    readings = [{"a": 1, "b": 2, "id": i} for i in (7, 2**64 - 1, 0)]
    batch = decoder(record_id="id").decode(msg(readings), timestamp_s=T0, offset=5)
    assert batch.seq.dtype == np.uint64 and batch.seq.tolist() == [7, 2**64 - 1, 0]


def test_without_record_id_the_offset_and_index_make_the_sequence_number():
    dec = decoder(codec.DecodeLimits(max_records=100))
    data = msg([{"a": 1, "b": 2}] * 3)
    assert dec.decode(data, timestamp_s=T0, offset=3).seq.tolist() == [300, 301, 302]
    assert dec.decode(data, timestamp_s=T0, offset=4).seq.tolist() == [400, 401, 402]  # no overlap
    assert dec.decode(data, timestamp_s=T0).seq.tolist() == [0, 1, 2]


def test_the_device_comes_from_the_message():
    dec = decoder(device="meta.device", expected_device=None)
    batch = dec.decode(msg([{"a": 1, "b": 2, "meta": {"device": "pump-7.b_2"}}] * 2), timestamp_s=T0)
    assert batch.device == "pump-7.b_2"
    on_topic = decoder(device="dev", expected_device="dev01")
    assert on_topic.decode(msg({"a": 1, "b": 2, "dev": "dev01"}), timestamp_s=T0).device == "dev01"


def test_extra_fields_are_ignored_by_default_and_the_mapped_ones_pass_reject():
    reading = {"a": 1, "b": 2, "t": T0, "meta": {"label": 1, "firmware": "1.2"}, "note": "x"}
    assert decoder(event_time="t", label="meta.label").decode(msg(reading)).count == 1
    strict = decoder(event_time="t", label="meta.label", extra="reject")
    assert strict.decode(msg({"a": 1, "b": 2, "t": T0, "meta": {"label": 1}})).count == 1
    assert strict.decode(msg({"a": 1, "b": 2, "t": T0})).labels is None  # no meta at all
    # The contents of an array feature are values, not fields.
    assert decoder(features="px", extra="reject").decode(msg({"px": [[1, 2]]}), timestamp_s=T0).count == 1


def test_a_json_batch_survives_the_native_codec():
    readings = [{"a": 0.1 * i, "b": -i, "y": i % 3, "t": T0 + i, "id": 100 + i} for i in range(4)]
    batch = decoder(label="y", event_time="t", record_id="id").decode(msg(readings))

    again = codec.decode(codec.encode(batch))

    for column in ("seq", "event_time", "features", "labels"):
        np.testing.assert_array_equal(getattr(again, column), getattr(batch, column))


def test_the_json_decoder_takes_no_runs():
    dec = decoder()
    dec.decode(msg({"a": 1, "b": 2}), timestamp_s=T0)
    assert dec.last_layout is None
    assert dec.decode_run([msg({"a": 1, "b": 2})] * 3) is None


# --- value range --------------------------------------------------------------------------

def test_values_inside_the_range_pass_and_outside_raise_out_of_range_with_the_batch():
    dec = decoder(value_range=(0.0, 1.0), label="y")
    assert dec.decode(msg([{"a": 0, "b": 1, "y": 0}]), timestamp_s=T0).count == 1
    data = msg([{"a": 0.5, "b": 0.5, "y": 0}, {"a": 2.0, "b": 0.5, "y": 1}, {"a": 0.1, "b": -3, "y": 2}])

    with pytest.raises(OutOfRange) as err:
        dec.decode(data, timestamp_s=T0)

    assert err.value.reason == "out_of_range"
    assert err.value.bad.tolist() == [False, True, True]
    assert err.value.batch.count == 3 and err.value.batch.labels.tolist() == [0, 1, 2]
    assert "record 2 feature 1 = -3" in err.value.detail  # the farthest beyond its bound


def test_a_per_feature_range_checks_each_feature_against_its_own_bounds():
    dec = decoder(value_range=(np.array([0.0, 10.0]), np.array([1.0, 20.0])))
    assert dec.decode(msg({"a": 1, "b": 15}), timestamp_s=T0).count == 1
    with pytest.raises(OutOfRange) as err:
        dec.decode(msg([{"a": 1, "b": 15}, {"a": 15, "b": 1}]), timestamp_s=T0)
    assert err.value.bad.tolist() == [False, True]


# --- rejected messages ----------------------------------------------------------------------

def test_a_message_over_the_size_limit_is_too_large_before_parsing():
    dec = decoder(codec.DecodeLimits(max_message_bytes=40))
    err = rejected(dec, b"{" + b" " * 60, timestamp_s=T0)  # not JSON either
    assert err.reason == "too_large" and "limit is 40" in err.detail


def test_more_readings_than_the_limit_is_too_large():
    err = rejected(decoder(codec.DecodeLimits(max_records=2)), msg([{"a": 1, "b": 2}] * 3), timestamp_s=T0)
    assert err.reason == "too_large" and "3 readings" in err.detail


@pytest.mark.parametrize("data, detail", [
    pytest.param(b'{"a": 1, "b": 2', "unexpected end of data", id="unterminated"),
    pytest.param(b'{"a": NaN, "b": 2}', "expected a JSON value", id="nan_literal"),
    pytest.param(b'{"a": Infinity, "b": 2}', "expected a JSON value", id="infinity_literal"),
    pytest.param(b'{"a": 1e400, "b": 2}', "infinity", id="number_beyond_a_double"),
    pytest.param(b'{"a": 1, "b": 2, "n": "\xff"}', "UTF-8", id="invalid_utf8"),
    pytest.param(b"", "", id="empty"),
    pytest.param(b"3", "a number", id="a_number"),
    pytest.param(b'"text"', "a string", id="a_string"),
    pytest.param(b"null", "null", id="null"),
    pytest.param(b'[{"a": 1, "b": 2}, 5]', "reading 1 is a number", id="an_array_holding_a_number"),
    pytest.param(b'[[{"a": 1, "b": 2}]]', "reading 0 is an array", id="nested_arrays"),
])
def test_what_is_not_a_reading_or_an_array_of_readings_is_bad_json(data, detail):
    err = rejected(decoder(), data, timestamp_s=T0)
    assert err.reason == "bad_json" and detail in err.detail


def test_an_empty_array_is_bad_count():
    assert rejected(decoder(), b"[]", timestamp_s=T0).reason == "bad_count"


def test_a_missing_feature_names_the_field_and_the_reading():
    err = rejected(decoder(features=["imu.ax", "imu.ay"]),
                   msg([{"imu": {"ax": 1, "ay": 2}}, {"imu": {"ax": 1}}]), timestamp_s=T0)
    assert err.reason == "missing_field"
    assert err.detail == "feature 'imu.ay' is missing at reading 1"


@pytest.mark.parametrize("mapping, reading, field", [
    ({"event_time": "t"}, {"a": 1, "b": 2}, "event_time 't'"),
    ({"device": "dev"}, {"a": 1, "b": 2, "t": T0}, "device 'dev'"),
    ({"record_id": "id"}, {"a": 1, "b": 2}, "record_id 'id'"),
    ({"features": "px"}, {"pics": [1]}, "feature 'px'"),
])
def test_each_missing_mapped_field_is_missing_field(mapping, reading, field):
    err = rejected(decoder(**mapping), msg([reading]), timestamp_s=T0)
    assert err.reason == "missing_field" and field in err.detail and "reading 0" in err.detail


def test_labels_in_some_readings_only_are_missing_field():
    data = msg([{"a": 1, "b": 2, "y": 1}, {"a": 1, "b": 2, "y": 0}, {"a": 1, "b": 2}])
    err = rejected(decoder(label="y"), data, timestamp_s=T0)
    assert err.reason == "missing_field"
    assert "missing at reading 2 but present at reading 0" in err.detail


@pytest.mark.parametrize("mapping, readings, detail", [
    pytest.param({}, [{"a": "1.5", "b": 2}], "feature 'a' at reading 0 is a string ('1.5')", id="number_as_string"),
    pytest.param({}, [{"a": 1, "b": 2}, {"a": 1, "b": "NaN"}], "feature 'b' at reading 1 is a string ('NaN')",
                 id="nan_as_string"),
    pytest.param({}, [{"a": True, "b": 2}], "feature 'a' at reading 0 is a bool (true)", id="bool_feature"),
    pytest.param({}, [{"a": None, "b": 2}], "is null", id="null_feature"),
    pytest.param({}, [{"a": [1], "b": 2}], "is an array, not a number", id="array_for_a_scalar"),
    pytest.param({"features": ["imu.ax"]}, [{"imu": 5}], "'imu' is a number (5), not an object",
                 id="a_number_on_the_path"),
    pytest.param({"features": "px"}, [{"px": {"r": [1, 2]}}], "is an object, not an array", id="object_for_array"),
    pytest.param({"features": "px"}, [{"px": 3}], "is a number (3), not an array", id="number_for_array"),
    pytest.param({"features": "px"}, [{"px": [[1, 2], [3]]}], "ragged", id="ragged_lists"),
    pytest.param({"features": "px"}, [{"px": [[1, 2], 3]}], "ragged", id="lists_and_numbers"),
    pytest.param({"features": "px"}, [{"px": [1, 2]}, {"px": [1, False]}], "reading 1 holds a bool (false)",
                 id="bool_in_array"),
    pytest.param({"features": "px"}, [{"px": [[1, "2"]]}], "holds a string ('2')", id="string_in_array"),
    pytest.param({"label": "y"}, [{"a": 1, "b": 2, "y": 1.0}], "label 'y' at reading 0 is a number (1.0), not an integer",
                 id="float_label"),
    pytest.param({"label": "y"}, [{"a": 1, "b": 2, "y": True}], "is a bool (true), not an integer", id="bool_label"),
    pytest.param({"record_id": "id"}, [{"a": 1, "b": 2, "id": -1}], "record_id 'id' at reading 0 is a number (-1)",
                 id="negative_record_id"),
    pytest.param({"record_id": "id"}, [{"a": 1, "b": 2, "id": 2**64}], "not an integer in [0, 2**64)",
                 id="record_id_beyond_u64"),  # orjson reads it as a float
    pytest.param({"record_id": "id"}, [{"a": 1, "b": 2, "id": "7"}], "is a string ('7')", id="record_id_as_string"),
    pytest.param({"device": "dev", "expected_device": None}, [{"a": 1, "b": 2, "dev": 7}],
                 "device 'dev' at reading 0 is a number (7), not a string", id="device_as_number"),
])
def test_wrong_types_are_bad_type(mapping, readings, detail):
    err = rejected(decoder(**mapping), msg(readings), timestamp_s=T0)
    assert err.reason == "bad_type"
    assert detail in err.detail


def test_a_value_beyond_float32_is_non_finite():
    err = rejected(decoder(), msg([{"a": 1, "b": 2}, {"a": 1, "b": -1e39}]), timestamp_s=T0)
    assert err.reason == "non_finite"
    assert "feature 'b' at reading 1 is -1e+39, beyond the float32 range" in err.detail


def test_non_finite_wins_over_out_of_range():
    dec = decoder(features="px", value_range=(0.0, 1.0))
    err = rejected(dec, msg([{"px": [5.0, 0.5]}, {"px": [0.5, 1e39]}]), timestamp_s=T0)
    assert err.reason == "non_finite" and "feature 'px'[1] at reading 1" in err.detail


@pytest.mark.parametrize("kwargs, readings, detail", [
    pytest.param({"features": "px", "expected_shape": (8, 8)}, [{"px": [[1, 2], [3, 4]]}],
                 "feature shape (2, 2), the stream's is (8, 8)", id="other_than_expected"),
    pytest.param({"expected_shape": (3,)}, [{"a": 1, "b": 2}], "feature shape (2,), the stream's is (3,)",
                 id="scalar_fields_other_than_expected"),
    pytest.param({"features": "px"}, [{"px": [1, 2]}, {"px": [1, 2, 3]}],
                 "reading 1 has shape (3,), at reading 0 (2,)", id="differs_between_readings"),
    pytest.param({"features": "px"}, [{"px": [[1, 2]]}, {"px": [1, 2]}],
                 "reading 1 has shape (2,), at reading 0 (1, 2)", id="dims_differ_between_readings"),
    pytest.param({"features": "px"}, [{"px": []}], "an empty array", id="empty_array"),
    pytest.param({"features": "px"}, [{"px": [[[[[1]]]]]}], "nested deeper than 4 levels", id="five_dims"),
    pytest.param({"features": "px", "limits": codec.DecodeLimits(max_features_per_record=8)},
                 [{"px": [[1, 2, 3], [4, 5, 6], [7, 8, 9]]}], "hold 9 values; the limit is 8", id="too_many_values"),
    pytest.param({"value_range": (np.zeros(3), np.ones(3))}, [{"a": 1, "b": 2}],
                 "the value range declares 3", id="range_of_another_width"),
])
def test_shapes_are_checked(kwargs, readings, detail):
    err = rejected(decoder(**kwargs), msg(readings), timestamp_s=T0)
    assert err.reason == "bad_shape" and detail in err.detail


@pytest.mark.parametrize("limits, label, bound", [
    (codec.DecodeLimits(num_classes=10), 10, 10),
    (codec.DecodeLimits(num_classes=10), -1, 10),
    (codec.DEFAULT_LIMITS, 2**31, 2**31),
])
def test_labels_outside_the_classes_are_bad_label(limits, label, bound):
    data = msg([{"a": 1, "b": 2, "y": 0}, {"a": 1, "b": 2, "y": label}])
    err = rejected(decoder(limits, label="y"), data, timestamp_s=T0)
    assert err.reason == "bad_label"
    assert err.detail == f"label 'y' at reading 1 is {label}, allowed [0, {bound})"


@pytest.mark.parametrize("unit, value, detail", [
    pytest.param("iso8601", "2024-01-01T00:00:00", "without a timezone", id="naive_iso"),
    pytest.param("iso8601", "2024-01-01", "without a timezone", id="date_only"),
    pytest.param("iso8601", "yesterday", "not an ISO 8601 date and time", id="not_iso"),
    pytest.param("iso8601", "2024-02-30T00:00:00Z", "not an ISO 8601 date and time", id="no_such_day"),
    pytest.param("iso8601", 1_700_000_000, "not an ISO 8601 string", id="number_for_iso"),
    pytest.param("ms", "1700000000000", "is a string ('1700000000000'), not a number (ms since the epoch)",
                 id="string_for_ms"),
    pytest.param("s", True, "is a bool (true), not a number", id="bool_for_s"),
    pytest.param("s", None, "is null, not a number", id="null_time"),
])
def test_bad_event_times_are_bad_time(unit, value, detail):
    dec = decoder(event_time="t", time_unit=unit)
    err = rejected(dec, msg([{"a": 1, "b": 2, "t": value}]))
    assert err.reason == "bad_time"
    assert "event_time 't' at reading 0" in err.detail and detail in err.detail


def test_no_event_time_and_no_kafka_timestamp_is_bad_time():
    err = rejected(decoder(), msg({"a": 1, "b": 2}), timestamp_s=None)
    assert err.reason == "bad_time" and "no Kafka timestamp" in err.detail
    assert rejected(decoder(), msg({"a": 1, "b": 2}), timestamp_s=float("nan")).reason == "bad_time"


@pytest.mark.parametrize("expected, devices, detail", [
    (None, ["a b"], "device id 'a b' at reading 0 is not"),
    (None, ["dev01\n"], "device id 'dev01\\n' at reading 0 is not"),
    (None, ["x" * 65], "is not [A-Za-z0-9_.-]{1,64}"),
    ("dev01", ["dev02"], "device 'dev02' on the stream of 'dev01'"),
    (None, ["dev01", "dev01", "dev02"], "reading 2 is from device 'dev02', reading 0 from 'dev01'"),
])
def test_bad_or_foreign_device_ids_are_bad_device(expected, devices, detail):
    dec = decoder(device="dev", expected_device=expected)
    err = rejected(dec, msg([{"a": 1, "b": 2, "dev": d} for d in devices]), timestamp_s=T0)
    assert err.reason == "bad_device" and detail in err.detail


@pytest.mark.parametrize("reading, field", [
    ({"a": 1, "b": 2, "c": 3, "meta": {"label": 1}}, "'c'"),
    ({"a": 1, "b": 2, "meta": {"label": 1, "fw": "1.2"}}, "'meta.fw'"),
])
def test_unmapped_fields_are_extra_field_when_rejected(reading, field):
    dec = decoder(label="meta.label", extra="reject")
    err = rejected(dec, msg([{"a": 1, "b": 2, "meta": {"label": 0}}, reading]), timestamp_s=T0)
    assert err.reason == "extra_field"
    assert f"field {field} at reading 1 is not in the mapping" in err.detail


def test_the_new_reasons_are_known_slugs():
    assert {"bad_json", "missing_field", "bad_type", "extra_field", "bad_time"} <= set(RecordDecodeError.REASONS)
    assert len(set(RecordDecodeError.REASONS)) == len(RecordDecodeError.REASONS)


# --- the mapping --------------------------------------------------------------------------

def test_parse_params_builds_a_frozen_mapping():
    mapping = formats.format_named("json").parse_params(
        {"features": ["imu.ax", "imu.ay"], "label": "y", "event_time": "ts", "time_unit": "iso8601",
         "device": "dev", "record_id": "n", "extra": "reject"})
    assert mapping == JsonMapping(features=("imu.ax", "imu.ay"), label="y", event_time="ts", time_unit="iso8601",
                                  device="dev", record_id="n", extra="reject")
    assert formats.format_named("json").parse_params({"features": "px"}).features_array
    with pytest.raises(AttributeError):
        mapping.label = "z"  # type: ignore[misc]


@pytest.mark.parametrize("params, says", [
    ({"features": []}, "give at least one field path"),
    ({}, "features is required"),
    ({"features": 3}, "features = 3"),
    ({"features": ["a", 1]}, "features = ['a', 1]"),
    ({"features": ["a"], "event_time": "t", "time_unit": "h"}, "time_unit = 'h': use one of 's', 'ms', 'us', 'ns', 'iso8601'"),
    ({"features": ["a"], "time_unit": "ms"}, "without event_time"),
    ({"features": ["a"], "extra": "warn"}, "extra = 'warn': use \"ignore\" or \"reject\""),
    ({"features": ["a"], "lable": "y"}, "unknown key(s) 'lable'"),
    ({"features": ["imu..ax"]}, "'imu..ax' is not a field path"),
    ({"features": [""]}, "'' is not a field path"),
    ({"features": ["a"], "label": 5}, "label = 5"),
    ({"features": ["a", "a"]}, "name the same field"),
    ({"features": ["imu", "imu.ax"]}, "overlap"),
    ({"features": ["a"], "label": "a.b"}, "overlap"),
    ("features=a", "a mapping"),
])
def test_bad_mappings_say_what_to_write(params, says):
    with pytest.raises(ValueError) as err:
        formats.format_named("json").parse_params(params)
    assert says in str(err.value)


def test_a_json_stream_needs_its_device_from_somewhere():
    mapping = formats.format_named("json").parse_params({"features": ["a"]})
    with pytest.raises(ValueError, match="needs its device"):
        formats.format_named("json").decoder(mapping, codec.DEFAULT_LIMITS)
    with pytest.raises(ValueError, match="invalid expected device"):
        formats.format_named("json").decoder(mapping, codec.DEFAULT_LIMITS, expected_device="a b")


# --- the registry -----------------------------------------------------------------------------

def test_the_registry_names_both_formats_native_first():
    assert formats.names()[:2] == ("edgestream", "json")
    assert formats.format_named("json").name == "json"


def test_an_unknown_format_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        formats.format_named("xml")
    assert "'xml'" in str(err.value) and "edgestream" in str(err.value) and "json" in str(err.value)


def test_a_format_registers_once_and_can_be_removed():
    @formats.register("toy-test")
    class Toy(formats.InputFormat):
        def parse_params(self, params):
            return dict(params)

        def decoder(self, params, limits=codec.DEFAULT_LIMITS, **kwargs):
            raise NotImplementedError

        def encode(self, params, batch):
            raise NotImplementedError

    try:
        assert "toy-test" in formats.names() and formats.format_named("toy-test").name == "toy-test"
        with pytest.raises(ValueError, match="registered twice"):
            formats.register("toy-test")(type("Other", (Toy,), {}))
    finally:
        formats.unregister("toy-test")
    assert "toy-test" not in formats.names()


def make_batch(count=4, shape=(3, 4), labels=True, device="dev01") -> RecordBatch:
    rng = np.random.default_rng(1)
    return RecordBatch(
        device=device,
        seq=np.arange(5, 5 + count, dtype=np.uint64),
        event_time=T0 + np.arange(count, dtype=np.float64),
        features=rng.standard_normal((count, *shape)).astype(np.float32),
        labels=rng.integers(0, 10, count).astype(np.int32) if labels else None,
    )


def test_the_native_format_decodes_exactly_like_codec_decoder():
    native = formats.format_named("edgestream")
    kwargs = {"expected_device": "dev01", "expected_shape": (3, 4), "value_range": (-10.0, 10.0)}
    ours = native.decoder(native.parse_params({}), codec.DecodeLimits(num_classes=10), **kwargs)
    theirs = codec.Decoder(codec.DecodeLimits(num_classes=10), **kwargs)
    messages = [codec.encode(make_batch()), codec.encode(make_batch(labels=False), version=1)]

    for data in messages:
        got, want = ours.decode(data, timestamp_s=123.0, offset=9), theirs.decode(data)
        for column in ("seq", "event_time", "features", "labels"):
            np.testing.assert_array_equal(getattr(got, column), getattr(want, column))
        assert got.device == want.device and got.features.dtype == want.features.dtype

    assert ours.last_layout == theirs.last_layout
    run = [codec.encode(make_batch(labels=False), version=1)] * 3
    np.testing.assert_array_equal(ours.decode_run(run).features, theirs.decode_run(run).features)
    for bad in (messages[0][:-1], codec.encode(make_batch(device="dev02"))):
        with pytest.raises(RecordDecodeError) as mine:
            ours.decode(bad)
        with pytest.raises(RecordDecodeError) as codecs:
            theirs.decode(bad)
        assert (mine.value.reason, mine.value.detail) == (codecs.value.reason, codecs.value.detail)


def test_the_native_format_takes_no_parameters():
    native = formats.format_named("edgestream")
    assert native.parse_params({}) is None
    with pytest.raises(ValueError, match="takes no parameters; remove 'features'"):
        native.parse_params({"features": ["a"]})


@pytest.mark.parametrize("params", [
    {"features": "pixels", "label": "y", "event_time": "ts", "time_unit": "ms", "record_id": "n"},
    {"features": ["a.x", "a.y", "b"], "label": "meta.label", "event_time": "when", "time_unit": "iso8601",
     "device": "meta.dev"},
    {"features": ["a", "b", "c"]},
])
def test_what_the_format_encodes_its_decoder_reads_back(params):
    """A simulated device writes the job's format: encode then decode gives the batch back
    (event times to the microsecond; none mapped: the Kafka timestamp; no record id: the offset's numbers)."""
    fmt = formats.format_named("json")
    mapping = fmt.parse_params(params)
    batch = RecordBatch("dev01", np.arange(7, 12, dtype=np.uint64), np.full(5, 1.7e9) + np.arange(5) * 0.25,
                        np.random.default_rng(0).random((5, 3), dtype=np.float32), np.arange(5, dtype=np.int32))
    back = fmt.decoder(mapping, expected_device="dev01").decode(fmt.encode(mapping, batch), timestamp_s=1.8e9,
                                                               offset=2)
    assert back.device == "dev01" and np.array_equal(back.features, batch.features)
    assert np.array_equal(back.labels, batch.labels) if "label" in params else back.labels is None
    if "event_time" in params:
        assert np.allclose(back.event_time, batch.event_time, rtol=0, atol=1e-6)
    else:
        assert (back.event_time == 1.8e9).all()
    expected_seq = batch.seq if "record_id" in params else 2 * codec.DEFAULT_LIMITS.max_records + np.arange(5)
    assert np.array_equal(back.seq, expected_seq)


def test_the_native_format_encodes_the_binary_message():
    batch = RecordBatch("dev01", np.arange(3, dtype=np.uint64), np.full(3, 1.7e9), np.ones((3, 2), np.float32), None)
    fmt = formats.format_named("edgestream")
    assert fmt.encode(fmt.parse_params({}), batch) == codec.encode(batch)
