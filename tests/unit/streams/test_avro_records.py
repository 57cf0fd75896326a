"""The avro input format (streams/formats/avro_records.py) without a registry server: plain
Avro with a schema file, the registry's wire format against a registry stand-in (the real
registry is in tests/integration/test_avro_input.py), schema evolution, hostile schemas
and bytes."""

from __future__ import annotations

import io
import json

import fastavro
import numpy as np
import pytest

from edgestream.streams.codec import DEFAULT_LIMITS
from edgestream.streams.errors import RecordDecodeError
from edgestream.streams.formats import format_named
from edgestream.streams.formats.avro_records import AvroDecoder, parse_schema
from edgestream.streams.records import RecordBatch

READING = {"type": "record", "name": "Reading", "fields": [
    {"name": "pixels", "type": {"type": "array", "items": "float"}},
    {"name": "digit", "type": "int"},
    {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "n", "type": "long"}]}
MAPPING = {"features": "pixels", "label": "digit", "event_time": "ts", "time_unit": "ms", "record_id": "n"}


def schema_file(tmp_path, schema, name="reading.avsc"):
    path = tmp_path / name
    path.write_text(json.dumps(schema))
    return str(path)


def batch(n=3):
    rng = np.random.default_rng(0)
    return RecordBatch(device="d1", seq=np.arange(n, dtype=np.uint64), event_time=np.full(n, 1_700_000_000.0),
                       features=rng.random((n, 64)).astype(np.float32), labels=np.arange(n, dtype=np.int32))


def test_plain_avro_with_an_array_schema_round_trips_a_batch(tmp_path):
    fmt = format_named("avro")
    params = fmt.parse_params({**MAPPING, "schema_file": schema_file(tmp_path, {"type": "array", "items": READING})})
    sent = batch()
    got = fmt.decoder(params, expected_device="d1", expected_shape=(64,)).decode(fmt.encode(params, sent))
    assert np.array_equal(got.features, sent.features) and np.array_equal(got.labels, sent.labels)
    assert got.seq.tolist() == [0, 1, 2] and got.event_time.tolist() == [1_700_000_000.0] * 3  # ms, as a number


def test_one_reading_a_message_and_what_a_record_schema_cannot_send(tmp_path):
    fmt = format_named("avro")
    params = fmt.parse_params({**MAPPING, "schema_file": schema_file(tmp_path, READING)})
    assert fmt.decoder(params, expected_device="d1").decode(fmt.encode(params, batch(1))).count == 1
    with pytest.raises(ValueError, match="give an array schema"):
        fmt.encode(params, batch(2))


class Registry:
    """A stand-in for SchemaRegistry's lookups (ids -> parsed schemas)."""

    def __init__(self, schemas):
        self.schemas = schemas

    def schema(self, schema_id):
        if schema_id not in self.schemas:
            raise RecordDecodeError("unknown_schema", f"no schema {schema_id}")
        return self.schemas[schema_id]


def framed(schema_id, schema, datum):
    out = io.BytesIO()
    out.write(b"\x00" + schema_id.to_bytes(4, "big"))
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), datum)
    return out.getvalue()


def test_the_wire_format_resolves_old_and_new_writer_schemas_to_the_reader_schema(tmp_path):
    v1 = {**READING, "fields": READING["fields"][:3]}  # no record number yet
    v2 = {**READING, "fields": [*READING["fields"], {"name": "battery", "type": ["null", "float"], "default": None}]}
    reader = {**READING, "fields": [*READING["fields"][:3],
                                     {"name": "n", "type": "long", "default": 7}]}  # n added with a default
    fmt = format_named("avro")
    params = fmt.parse_params({**MAPPING, "schema_file": schema_file(tmp_path, reader),
                               "schema_registry": "http://registry.invalid/apis/ccompat/v7"})
    decoder = AvroDecoder(params, Registry({1: parse_schema(json.dumps(v1), "v1"),
                                            2: parse_schema(json.dumps(v2), "v2")}), DEFAULT_LIMITS,
                          expected_device="d1")
    reading = {"pixels": [0.5] * 64, "digit": 4, "ts": 1_700_000_000_000}
    old = decoder.decode(framed(1, v1, reading))
    new = decoder.decode(framed(2, v2, {**reading, "n": 99, "battery": 0.9}))
    assert old.seq.tolist() == [7] and new.seq.tolist() == [99]  # the default; the writer's own
    assert old.labels.tolist() == new.labels.tolist() == [4]
    with pytest.raises(RecordDecodeError) as unknown:
        decoder.decode(framed(3, v1, reading))
    assert unknown.value.reason == "unknown_schema"
    with pytest.raises(RecordDecodeError) as magic:
        decoder.decode(b"\x01" + framed(1, v1, reading)[1:])
    assert magic.value.reason == "bad_magic"
    with pytest.raises(RecordDecodeError) as short:
        decoder.decode(b"\x00\x00")
    assert short.value.reason == "bad_magic"


@pytest.mark.parametrize("data, reason", [
    (b"", "bad_avro"),
    (b"\x02", "bad_avro"),  # an array block of one reading, then nothing
    (b"\x00\x00", "bad_avro"),  # an empty array, then a byte too many
    (b"\x02" + b"\xff" * 20, "bad_avro"),  # a varint that does not end
])
def test_bytes_that_are_not_a_datum_of_the_schema_are_bad_avro(tmp_path, data, reason):
    fmt = format_named("avro")
    params = fmt.parse_params({**MAPPING, "schema_file": schema_file(tmp_path, {"type": "array", "items": READING})})
    with pytest.raises(RecordDecodeError) as err:
        fmt.decoder(params, expected_device="d1").decode(data)
    assert err.value.reason == reason


def test_an_empty_array_message_is_bad_count(tmp_path):
    fmt = format_named("avro")
    params = fmt.parse_params({**MAPPING, "schema_file": schema_file(tmp_path, {"type": "array", "items": READING})})
    with pytest.raises(RecordDecodeError) as err:
        fmt.decoder(params, expected_device="d1").decode(b"\x00")
    assert err.value.reason == "bad_count"


@pytest.mark.parametrize("schema, says", [
    ({"type": "array", "items": "null"}, "items take no bytes"),
    ({"type": "array", "items": {"type": "record", "name": "E", "fields": []}}, "items take no bytes"),
    ({"type": "recrd"}, "is not an Avro schema"),
])
def test_hostile_or_broken_schemas_are_refused(schema, says):
    with pytest.raises(ValueError, match=says):
        parse_schema(json.dumps(schema), "the schema")


def test_a_recursive_schema_is_accepted():
    parse_schema(json.dumps({"type": "record", "name": "L", "fields": [{"name": "next", "type": ["null", "L"]}]}),
                 "a list")


@pytest.mark.parametrize("params, says", [
    (MAPPING, "give schema_file"),
    ({**MAPPING, "schema_file": "/nonexistent.avsc"}, "cannot read it"),
    ({**MAPPING, "schema_registry": "registry:8080"}, "base URL"),
    ({**MAPPING, "schema_registry": "http://r", "colour": "red"}, "unknown key"),
])
def test_bad_parameters_say_what_to_write(params, says):
    with pytest.raises(ValueError, match=says):
        format_named("avro").parse_params(params)


def test_json_refuses_the_avro_keys():
    with pytest.raises(ValueError, match="unknown key"):
        format_named("json").parse_params({**MAPPING, "schema_file": "x.avsc"})


@pytest.mark.parametrize("ts", [float("nan"), float("inf"), float("-inf")])
def test_an_event_time_that_is_not_finite_is_bad_time(tmp_path, ts):
    # An Avro double can hold what JSON cannot (found by the avro_records fuzz target).
    reading = {**READING, "fields": [*READING["fields"][:2], {"name": "ts", "type": "double"}, READING["fields"][3]]}
    fmt = format_named("avro")
    params = fmt.parse_params({**MAPPING, "schema_file": schema_file(tmp_path, {"type": "array", "items": reading})})
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema({"type": "array", "items": reading}),
                               [{"pixels": [0.5] * 64, "digit": 1, "ts": 1.7e12, "n": 1},
                                {"pixels": [0.5] * 64, "digit": 1, "ts": ts, "n": 2}])
    with pytest.raises(RecordDecodeError, match="at reading 1 is") as err:
        fmt.decoder(params, expected_device="d1").decode(out.getvalue())
    assert err.value.reason == "bad_time"
