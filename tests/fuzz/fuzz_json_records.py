"""Fuzz target: JSON sensor messages (``streams.formats.json_records.JsonDecoder.decode``).

Input: one mode byte, then the message bytes. Mode bits:

* 1 and 2 pick the mapping (``MAPPINGS``): 0 flat number fields with label, event time
  in seconds, record id and device id; 1 one nested-array feature (``px``, 2x2 in the
  seeds) with a nested label and ISO 8601 times; 2 number fields under two objects, times
  in milliseconds, the device id nested, ``extra = "reject"``; 3 one field, nothing else
  (the Kafka timestamp is the event time, the offset the sequence number);
* 4: ``num_classes=10``;
* 8: expect the mapping's feature shape (``EXPECTED_SHAPES``), and device ``dev01`` on
  the mappings that read the device from the message;
* 16: a value range ``[0, 1]`` for every feature;
* 32: no Kafka timestamp (``timestamp_s=None``); 64: the message's offset is 12345;
* 128: small limits (4096 bytes, 8 readings, 16 values per record, 2 dims).

Allowed to escape ``decode``: ``RecordDecodeError`` (with ``OutOfRange``), as the module's
docstring and docs/ingest.md say. Anything else is a bug, and so is breaking a documented
property:

* a decoded batch has 1 to ``max_records`` records, float32 finite features of at most
  ``max_ndim`` non-zero dims and ``max_features_per_record`` values (the expected shape
  when one is set), finite float64 event times (the Kafka timestamp without an event-time
  field), uint64 sequence numbers (from the offset without a record id), int32 labels in
  range, a valid device id (the expected one when set), values within the declared range;
* ``OutOfRange`` carries the whole decoded batch and a non-empty mask of its records, and
  the values of the records it condemns lie outside the range;
* the batch is a valid native message (``codec.encode`` then ``codec.decode`` give it
  back), and written back as JSON under the same mapping it decodes to the same batch
  (event times within a microsecond: unit conversions and ISO 8601 round);
* ``decode_run`` (after the message primed the decoder) of the message twice is either
  declined or exactly the batch twice, and a run holding a message that fails on its own
  is declined.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

import numpy as np
import orjson

from edgestream.streams import codec
from edgestream.streams.codec import DecodeLimits
from edgestream.streams.errors import OutOfRange, RecordDecodeError
from edgestream.streams.formats import format_named
from edgestream.streams.formats.json_records import JsonMapping
from edgestream.streams.records import RecordBatch
from tests.fuzz.targets import FuzzFinding

MAX_LEN = 8192
ALLOWED = (RecordDecodeError,)

CLASSES, EXPECT, RANGE, NO_TIMESTAMP, OFFSET, SMALL = 4, 8, 16, 32, 64, 128
KAFKA_TIME = 1_700_000_000.5
OFFSET_VALUE = 12345

_JSON = format_named("json")
MAPPINGS: tuple[JsonMapping, ...] = (
    _JSON.parse_params({"features": ["a", "b", "c", "d"], "label": "y", "event_time": "t",
                        "record_id": "id", "device": "dev"}),
    _JSON.parse_params({"features": "px", "label": "meta.label", "event_time": "ts",
                        "time_unit": "iso8601"}),
    _JSON.parse_params({"features": ["imu.ax", "imu.ay", "imu.az", "env.temp"], "event_time": "t",
                        "time_unit": "ms", "device": "src.id", "extra": "reject"}),
    _JSON.parse_params({"features": ["v"]}),
)
EXPECTED_SHAPES = ((4,), (2, 2), (4,), (1,))
SMALL_LIMITS = {"max_message_bytes": 4096, "max_records": 8, "max_features_per_record": 16, "max_ndim": 2}


def _options(mode: int) -> dict:
    mapping = MAPPINGS[mode & 3]
    limits = DecodeLimits(num_classes=10 if mode & CLASSES else None, **(SMALL_LIMITS if mode & SMALL else {}))
    expected_device = "dev01" if mapping.device is None or mode & EXPECT else None
    return {
        "mapping": mapping,
        "limits": limits,
        "expected_device": expected_device,
        "expected_shape": EXPECTED_SHAPES[mode & 3] if mode & EXPECT else None,
        "value_range": (0.0, 1.0) if mode & RANGE else None,
        "timestamp_s": None if mode & NO_TIMESTAMP else KAFKA_TIME,
        "offset": OFFSET_VALUE if mode & OFFSET else None,
    }


def _decode(opts: dict, msg: bytes) -> tuple[str, RecordBatch | None, np.ndarray | None]:
    """("ok" | reason, batch, out-of-range mask)."""
    decoder = _JSON.decoder(
        opts["mapping"], opts["limits"], expected_device=opts["expected_device"],
        expected_shape=opts["expected_shape"], value_range=opts["value_range"],
    )
    try:
        return "ok", decoder.decode(msg, timestamp_s=opts["timestamp_s"], offset=opts["offset"]), None
    except OutOfRange as err:
        if err.bad.dtype != bool or len(err.bad) != err.batch.count or not err.bad.any():
            raise FuzzFinding(f"OutOfRange mask {err.bad!r} for {err.batch.count} records") from err
        return "out_of_range", err.batch, err.bad
    except RecordDecodeError as err:
        if err.reason not in RecordDecodeError.REASONS:
            raise FuzzFinding(f"unknown reason {err.reason!r}") from err
        if not err.detail:
            raise FuzzFinding(f"{err.reason} without a detail") from err
        return err.reason, None, None


def _check_batch(batch: RecordBatch, opts: dict, bad: np.ndarray | None) -> None:
    limits: DecodeLimits = opts["limits"]
    mapping: JsonMapping = opts["mapping"]
    count = batch.count
    if not 1 <= count <= limits.max_records:
        raise FuzzFinding(f"decoded {count} records")
    dims = batch.feature_shape
    per_record = int(np.prod(dims)) if dims else 1
    if (batch.features.dtype != np.float32 or len(dims) > limits.max_ndim or 0 in dims
            or per_record > limits.max_features_per_record):
        raise FuzzFinding(f"features {batch.features.dtype} of shape {dims} accepted")
    if opts["expected_shape"] is not None and dims != opts["expected_shape"]:
        raise FuzzFinding(f"shape {dims} accepted, expected {opts['expected_shape']}")
    if not (np.isfinite(batch.features).all() and np.isfinite(batch.event_time).all()):
        raise FuzzFinding("decoded batch holds NaN or infinity")
    if batch.event_time.dtype != np.float64 or batch.seq.dtype != np.uint64:
        raise FuzzFinding(f"columns of dtype {batch.event_time.dtype}, {batch.seq.dtype}")
    if mapping.event_time is None and not (batch.event_time == opts["timestamp_s"]).all():
        raise FuzzFinding("without an event-time field the records do not carry the Kafka timestamp")
    if mapping.record_id is None:
        base = 0 if opts["offset"] is None else opts["offset"] * limits.max_records
        if batch.seq.tolist() != list(range(base, base + count)):
            raise FuzzFinding(f"sequence numbers {batch.seq[:4]}... without a record id")
    if batch.labels is not None:
        bound = limits.num_classes if limits.num_classes is not None else 1 << 31
        if batch.labels.dtype != np.int32 or int(batch.labels.min()) < 0 or int(batch.labels.max()) >= bound:
            raise FuzzFinding(f"labels {batch.labels} outside [0, {bound})")
    if not codec.DEVICE_RE.fullmatch(batch.device):
        raise FuzzFinding(f"device id {batch.device!r} accepted")
    if opts["expected_device"] is not None and batch.device != opts["expected_device"]:
        raise FuzzFinding(f"device {batch.device!r} accepted on the stream of {opts['expected_device']!r}")
    if opts["value_range"] is not None:
        lo, hi = opts["value_range"]
        outside = ((batch.features < lo) | (batch.features > hi)).reshape(count, -1).any(axis=1)
        if not np.array_equal(outside, np.zeros(count, bool) if bad is None else bad):
            raise FuzzFinding(f"records outside the range {outside}, condemned {bad}")
    again = codec.decode(codec.encode(batch))
    if not _same(again, batch, exact_times=True):
        raise FuzzFinding("the batch does not survive the native codec")


def _same(a: RecordBatch, b: RecordBatch, *, exact_times: bool) -> bool:
    """Equal batches; unless ``exact_times``, event times within a microsecond plus a few
    ulps (a time unit converted there and back, an ISO 8601 string's microseconds)."""
    if exact_times:
        times = np.array_equal(a.event_time, b.event_time)
    else:
        times = a.event_time.shape == b.event_time.shape and bool(
            np.all(np.abs(a.event_time - b.event_time) <= 1e-6 + 1e-15 * np.abs(b.event_time)))
    return (
        a.device == b.device
        and np.array_equal(a.seq, b.seq)
        and times
        and a.features.shape == b.features.shape
        and np.array_equal(a.features.view(np.uint32), b.features.view(np.uint32))
        and ((a.labels is None and b.labels is None) or (
            a.labels is not None and b.labels is not None and np.array_equal(a.labels, b.labels)))
    )


def _put(reading: dict, path: str, value) -> None:
    *holders, leaf = path.split(".")
    for key in holders:
        reading = reading.setdefault(key, {})
    reading[leaf] = value


def to_json(batch: RecordBatch, mapping: JsonMapping) -> bytes | None:
    """``batch`` as a message of ``mapping`` (None when an event time has no ISO 8601 form)."""
    readings = []
    for i in range(batch.count):
        reading: dict = {}
        if mapping.features_array:
            _put(reading, mapping.features[0], batch.features[i].tolist())
        else:
            for path, value in zip(mapping.features, batch.features[i].tolist(), strict=True):
                _put(reading, path, value)
        if mapping.label is not None and batch.labels is not None:
            _put(reading, mapping.label, int(batch.labels[i]))
        if mapping.event_time is not None:
            t = float(batch.event_time[i])
            if mapping.time_unit == "iso8601":
                try:
                    value = datetime.fromtimestamp(t, UTC).isoformat()
                except (ValueError, OverflowError, OSError):
                    return None
            else:
                value = t * {"s": 1, "ms": 1e3, "us": 1e6, "ns": 1e9}[mapping.time_unit]
                if not math.isfinite(value):  # orjson would write null
                    return None
            _put(reading, mapping.event_time, value)
        if mapping.device is not None:
            _put(reading, mapping.device, batch.device)
        if mapping.record_id is not None:
            _put(reading, mapping.record_id, int(batch.seq[i]))
        readings.append(reading)
    return orjson.dumps(readings)


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, msg = data[0], bytes(data[1:])
    opts = _options(mode)
    verdict, batch, bad = _decode(opts, msg)
    if batch is None:
        return
    _check_batch(batch, opts, bad)
    if verdict == "ok":
        _check_run(opts, msg, batch)
    written = to_json(batch, opts["mapping"])
    if written is None or len(written) > opts["limits"].max_message_bytes:
        return
    again, other, other_bad = _decode(opts, written)
    if again != verdict or other is None or not _same(other, batch, exact_times=False):
        raise FuzzFinding(f"the batch written back as JSON decodes to {again!r}, not the same batch ({verdict!r})")
    if bad is not None and not np.array_equal(bad, other_bad):
        raise FuzzFinding("the batch written back as JSON condemns other records")


def _check_run(opts: dict, msg: bytes, batch: RecordBatch) -> None:
    """``decode_run`` after a good message: the message twice is its batch twice, and a run
    holding a message that fails alone (the message cut short, if that fails) is declined."""
    decoder = _JSON.decoder(
        opts["mapping"], opts["limits"], expected_device=opts["expected_device"],
        expected_shape=opts["expected_shape"], value_range=opts["value_range"],
    )
    decoder.decode(msg, timestamp_s=opts["timestamp_s"], offset=opts["offset"])
    run = decoder.decode_run([msg, msg])
    if run is not None:
        twice = [batch.seq, batch.seq], [batch.event_time] * 2, [batch.features] * 2
        if (run.device != batch.device or not all(np.array_equal(np.concatenate(parts), got) for parts, got in
                                                  zip(twice, (run.seq, run.event_time, run.features), strict=True))
                or (run.labels is None) != (batch.labels is None)
                or (run.labels is not None and not np.array_equal(run.labels, np.concatenate([batch.labels] * 2)))):
            raise FuzzFinding("decode_run of a message twice differs from its batch twice")
    cut = msg[:-1]
    if _decode(opts, cut)[0] != "ok" and decoder.decode_run([msg, cut]) is not None:
        raise FuzzFinding("decode_run accepted a run holding a message that fails alone")


def seeds() -> dict[str, bytes]:
    """Valid messages of each mapping (and a few near misses) with a mode byte each."""
    rng = np.random.default_rng(0)

    def flat(i: int, **extra) -> dict:
        return {"a": float(rng.random()), "b": float(rng.random()), "c": i, "d": float(rng.random()),
                "y": i % 10, "t": KAFKA_TIME + i, "id": 1000 + i, "dev": "dev01", **extra}

    def image(i: int) -> dict:
        return {"px": rng.random((2, 2)).round(3).tolist(), "meta": {"label": i % 10},
                "ts": f"2024-05-0{1 + i % 9}T12:00:00.{i:06d}+02:00"}

    def imu(i: int) -> dict:
        return {"imu": {"ax": float(rng.random()), "ay": 0.5, "az": 1}, "env": {"temp": 0.25},
                "t": 1_700_000_000_000 + i, "src": {"id": "dev01"}}

    j = orjson.dumps
    return {
        "flat_array": bytes([CLASSES | EXPECT | RANGE]) + j([flat(i, c=0.5) for i in range(3)]),
        "flat_one_object": bytes([0]) + j(flat(1)),
        "flat_out_of_range": bytes([RANGE | OFFSET]) + j([flat(i) for i in range(4)]),
        "flat_bad_label": bytes([CLASSES]) + j([flat(1), {**flat(2), "y": 12}]),
        "image_iso": bytes([1 | EXPECT | CLASSES]) + j([image(i) for i in range(3)]),
        "image_naive_time": bytes([1]) + j([{**image(0), "ts": "2024-05-01T12:00:00"}]),
        "image_ragged": bytes([1 | SMALL]) + j([{**image(0), "px": [[1, 2], [3]]}]),
        "nested_ms_reject": bytes([2 | EXPECT | OFFSET]) + j([imu(i) for i in range(5)]),
        "nested_extra_field": bytes([2]) + j([{**imu(0), "note": "x"}]),
        "minimal_kafka_time": bytes([3 | OFFSET]) + j([{"v": i / 10} for i in range(6)]),
        "minimal_no_timestamp": bytes([3 | NO_TIMESTAMP]) + j({"v": 1}),
        "minimal_float32_overflow": bytes([3 | RANGE]) + b'[{"v": 0.5}, {"v": 1e39}]',
    }


def dictionary() -> list[bytes]:
    """Tokens for libFuzzer: the mappings' keys, JSON literals, numbers at the edges, times."""
    keys = [b'"a"', b'"b"', b'"c"', b'"d"', b'"y"', b'"t"', b'"id"', b'"dev"', b'"px"', b'"meta"',
            b'"label"', b'"ts"', b'"imu"', b'"ax"', b'"ay"', b'"az"', b'"env"', b'"temp"', b'"src"',
            b'"v"']
    return keys + [
        b"true", b"false", b"null", b"[[", b"]]", b'{"', b'":', b"1e39", b"-1", b"1.0", b"0.5",
        b"18446744073709551615", b"18446744073709551616", b"2147483648", b'"dev01"',
        b'"2024-01-01T00:00:00Z"', b"+02:00", b"1700000000000",
    ]
