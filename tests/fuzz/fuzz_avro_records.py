"""Fuzz target: Avro sensor messages (``streams.formats.avro_records.AvroDecoder.decode``).

Input: one mode byte, then the message bytes. Mode bits:

* 0-1 pick the job (``JOBS``): 0 plain Avro, an array of flat readings (four ``float``
  fields, an ``int`` label, a ``double`` time in ms, a ``long`` record id); 1 plain Avro, one
  reading a message with a nested 2x2 ``float`` array and an optional (``["null", "int"]``)
  label; 2 the registry's wire format, writer schemas 1 (the flat array) and 2 (the same
  with an added optional field) resolved to the reader schema of job 0, against a
  stand-in for the registry's lookups (ids 1 and 2; any other id is ``unknown_schema``);
  3 as 2 without a reader schema (each message read with its writer schema);
* 4: ``num_classes=10``; 8: expect the job's feature shape; 16: small limits (4096 bytes, 8 readings).

Allowed to escape ``decode``: ``RecordDecodeError`` (with ``OutOfRange``). Anything else is
a bug, and so is a decoded batch with no records or more than ``max_records``, features
that are not finite float32 of the job's shape, labels that are not int32 in
``[0, num_classes)``, or a batch that
written again by ``AvroFormat.encode`` (jobs 0 and 2, whose schema is an array) does not
decode to the same batch.
"""

from __future__ import annotations

import io
import json

import fastavro
import numpy as np

from edgestream.streams.codec import DecodeLimits
from edgestream.streams.errors import RecordDecodeError
from edgestream.streams.formats import format_named
from edgestream.streams.formats.avro_records import AvroDecoder, AvroParams, parse_schema
from tests.fuzz.targets import FuzzFinding, scratch_dir

MAX_LEN = 8192
ALLOWED = (RecordDecodeError,)
CLASSES, EXPECT, SMALL = 4, 8, 16

FLAT = {"type": "record", "name": "Flat", "fields": [
    *({"name": n, "type": "float"} for n in ("a", "b", "c", "d")),
    {"name": "y", "type": "int"}, {"name": "t", "type": "double"}, {"name": "id", "type": "long"}]}
FLAT_ARRAY = {"type": "array", "items": FLAT}
FLAT_V2 = {"type": "array", "items": {**FLAT, "fields": [*FLAT["fields"],
                                                          {"name": "battery", "type": ["null", "float"],
                                                           "default": None}]}}
IMAGE = {"type": "record", "name": "Image", "fields": [
    {"name": "px", "type": {"type": "array", "items": {"type": "array", "items": "float"}}},
    {"name": "label", "type": ["null", "int"], "default": None}]}
FLAT_MAPPING = {"features": ["a", "b", "c", "d"], "label": "y", "event_time": "t", "time_unit": "ms",
                "record_id": "id"}
IMAGE_MAPPING = {"features": "px", "label": "label"}
SHAPES = ((4,), (2, 2), (4,), (4,))
_AVRO = format_named("avro")
_JOBS: dict[int, AvroParams] = {}


class _Registry:
    """The registry's lookups, answered from memory (ids 1 and 2)."""

    schemas = {1: parse_schema(json.dumps(FLAT_ARRAY), "1"), 2: parse_schema(json.dumps(FLAT_V2), "2")}

    def schema(self, schema_id: int):
        if schema_id not in self.schemas:
            raise RecordDecodeError("unknown_schema", f"no schema {schema_id}")
        return self.schemas[schema_id]


def _params(job: int) -> AvroParams:
    if job not in _JOBS:
        where = scratch_dir("fuzz-avro-")
        flat, image = where / "flat.avsc", where / "image.avsc"
        flat.write_text(json.dumps(FLAT_ARRAY))
        image.write_text(json.dumps(IMAGE))
        params = ({**FLAT_MAPPING, "schema_file": str(flat)}, {**IMAGE_MAPPING, "schema_file": str(image)},
                  {**FLAT_MAPPING, "schema_file": str(flat), "schema_registry": "http://registry.invalid"},
                  {**FLAT_MAPPING, "schema_registry": "http://registry.invalid"})[job]
        _JOBS[job] = _AVRO.parse_params(params)
    return _JOBS[job]


def _decoder(mode: int) -> AvroDecoder:
    job = mode & 3
    params = _params(job)
    classes = 10 if mode & CLASSES else None
    limits = (DecodeLimits(max_message_bytes=4096, max_records=8, num_classes=classes) if mode & SMALL
              else DecodeLimits(num_classes=classes))
    return AvroDecoder(params, _Registry() if job >= 2 else None, limits, expected_device="dev01",
                       expected_shape=SHAPES[job] if mode & EXPECT else None)


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, message = data[0], data[1:]
    decoder = _decoder(mode)
    try:
        batch = decoder.decode(message, timestamp_s=1_700_000_000.0, offset=7)
    except RecordDecodeError:
        return
    limits = decoder.limits
    if not 1 <= batch.count <= limits.max_records:
        raise FuzzFinding(f"{batch.count} records (limit {limits.max_records})")
    if batch.features.dtype != np.float32 or not np.isfinite(batch.features).all():
        raise FuzzFinding("features are not finite float32")
    if batch.features.shape[1:] != SHAPES[mode & 3] and mode & EXPECT:
        raise FuzzFinding(f"shape {batch.features.shape[1:]} is not the expected {SHAPES[mode & 3]}")
    if batch.labels is not None and (batch.labels.dtype != np.int32 or (batch.labels < 0).any()
                                     or limits.num_classes is not None and (batch.labels >= limits.num_classes).any()):
        raise FuzzFinding(f"labels {batch.labels[:4]} are not int32 in [0, num_classes)")
    if mode & 3 in (0, 2):
        again = decoder.decode(_reencode(mode & 3, batch), timestamp_s=1_700_000_000.0, offset=7)
        if not (np.array_equal(again.features, batch.features) and np.array_equal(again.seq, batch.seq)
                and (again.labels is None) == (batch.labels is None)
                and (batch.labels is None or np.array_equal(again.labels, batch.labels))
                and np.allclose(again.event_time, batch.event_time, rtol=0, atol=1e-6)):
            raise FuzzFinding("written again by AvroFormat.encode, the batch decodes differently")


def _reencode(job: int, batch) -> bytes:
    params = _params(0)  # the flat array schema, plain
    body = _AVRO.encode(params, batch)
    return body if job == 0 else b"\x00" + (1).to_bytes(4, "big") + body


def _avro(schema, datum) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), datum)
    return out.getvalue()


def seeds() -> dict[str, bytes]:
    """Valid messages of each job and a few near misses, a mode byte each."""
    flat = [{"a": 0.5, "b": 0.25, "c": float(i), "d": 1.0, "y": i, "t": 1.7e12 + i, "id": 100 + i} for i in range(3)]
    v2 = [{**r, "battery": 0.9 if i else None} for i, r in enumerate(flat)]
    image = {"px": [[0.1, 0.2], [0.3, 0.4]], "label": 3}
    return {
        "flat": bytes([EXPECT | CLASSES]) + _avro(FLAT_ARRAY, flat),
        "flat_truncated": bytes([0]) + _avro(FLAT_ARRAY, flat)[:-2],
        "image": bytes([1 | EXPECT]) + _avro(IMAGE, image),
        "image_unlabelled": bytes([1]) + _avro(IMAGE, {**image, "label": None}),
        "image_ragged": bytes([1]) + _avro(IMAGE, {**image, "px": [[0.1], [0.2, 0.3]]}),
        "wire_v1": bytes([2 | EXPECT]) + b"\x00\x00\x00\x00\x01" + _avro(FLAT_ARRAY, flat),
        "wire_v2_resolved": bytes([2]) + b"\x00\x00\x00\x00\x02" + _avro(FLAT_V2, v2),
        "wire_v2_as_written": bytes([3 | SMALL]) + b"\x00\x00\x00\x00\x02" + _avro(FLAT_V2, v2),
        "wire_unknown_id": bytes([2]) + b"\x00\x00\x00\x00\x09" + _avro(FLAT_ARRAY, flat),
        "wire_bad_magic": bytes([3]) + b"\x01\x00\x00\x00\x01" + _avro(FLAT_ARRAY, flat),
    }


def dictionary() -> list[bytes]:
    return [b"\x00\x00\x00\x00\x01", b"\x00\x00\x00\x00\x02", b"\x02", b"\x06", b"\x00", b"\x7f", b"\x80\x01"]
