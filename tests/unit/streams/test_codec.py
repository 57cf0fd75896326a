"""Sensor message codec: round trips and every rejection path."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from streams import codec
from streams.errors import RecordDecodeError
from streams.garbage import EXPECTED_REASON, KINDS, make_garbage
from streams.records import RecordBatch, SensorRecord


def make_batch(count=5, shape=(3, 4), labels=True, device="dev01", seed=0) -> RecordBatch:
    rng = np.random.default_rng(seed)
    return RecordBatch(
        device=device,
        seq=np.arange(10, 10 + count, dtype=np.uint64),
        event_time=1.7e9 + np.arange(count, dtype=np.float64) / 10,
        features=rng.standard_normal((count, *shape)).astype(np.float32),
        labels=rng.integers(0, 10, count).astype(np.int32) if labels else None,
    )


@pytest.mark.parametrize("shape", [(), (64,), (3, 32), (2, 2, 2, 2)])
@pytest.mark.parametrize("labels", [True, False])
def test_round_trip_preserves_every_field(shape, labels):
    batch = make_batch(shape=shape, labels=labels)
    out = codec.decode(codec.encode(batch))
    assert out.device == batch.device
    np.testing.assert_array_equal(out.seq, batch.seq)
    np.testing.assert_array_equal(out.event_time, batch.event_time)
    np.testing.assert_array_equal(out.features, batch.features)
    assert out.features.dtype == np.float32 and out.feature_shape == shape
    if labels:
        np.testing.assert_array_equal(out.labels, batch.labels)
    else:
        assert out.labels is None


def test_records_and_batches_convert_both_ways():
    batch = make_batch(count=3)
    again = RecordBatch.from_records(batch.records())
    assert isinstance(batch.records()[0], SensorRecord)
    np.testing.assert_array_equal(again.features, batch.features)
    np.testing.assert_array_equal(again.labels, batch.labels)


def test_size_is_exactly_header_plus_payload():
    batch = make_batch(count=32, shape=(64,))
    data = codec.encode(batch)
    assert len(data) == 16 + len("dev01") + 4 + 32 * (8 + 8 + 4 + 64 * 4)


@pytest.mark.parametrize("kind", KINDS)
def test_every_garbage_kind_is_rejected_with_its_reason(kind):
    data = make_garbage(kind, "dev01", (3, 4))
    with pytest.raises(RecordDecodeError) as err:
        codec.decode(data, expected_shape=(3, 4))
    assert err.value.reason == EXPECTED_REASON[kind]
    assert err.value.detail  # says what exactly was wrong


def corrupt(data: bytes, offset: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda d: d[:10], "truncated"),
        (lambda d: d + b"\x00", "length_mismatch"),
        (lambda d: d[:-1], "truncated"),
        (lambda d: corrupt(d, 0, "<4s", b"XXXX"), "bad_magic"),
        (lambda d: corrupt(d, 4, "<B", 2), "bad_version"),
        (lambda d: corrupt(d, 5, "<B", 0x80), "bad_version"),
        (lambda d: corrupt(d, 6, "<B", 7), "bad_dtype"),
        (lambda d: corrupt(d, 7, "<B", 9), "bad_shape"),
        (lambda d: corrupt(d, 8, "<I", 0), "bad_count"),
        (lambda d: corrupt(d, 8, "<I", 2**31), "too_large"),
        (lambda d: corrupt(d, 8, "<I", 6), "truncated"),
        (lambda d: corrupt(d, 16, "<5s", b"d v01"), "bad_device"),
        (lambda d: corrupt(d, 16, "<2s", b"\xff\xfe"), "bad_device"),
        (lambda d: corrupt(d, 21, "<I", 0), "bad_shape"),
        (lambda d: corrupt(d, 21, "<I", 1 << 30), "too_large"),
    ],
)
def test_corruptions_are_rejected(mutate, reason):
    data = mutate(codec.encode(make_batch()))
    with pytest.raises(RecordDecodeError) as err:
        codec.decode(data)
    assert err.value.reason == reason


def test_non_finite_event_time_and_features_are_rejected():
    batch = make_batch()
    batch.event_time[1] = np.inf
    with pytest.raises(RecordDecodeError, match="event_time"):
        codec.decode(codec.encode(batch))
    batch = make_batch()
    batch.features[0, 0, 0] = -np.inf
    with pytest.raises(RecordDecodeError) as err:
        codec.decode(codec.encode(batch))
    assert err.value.reason == "non_finite" and "1 of 5" in err.value.detail


def test_limits_and_expectations_are_enforced():
    data = codec.encode(make_batch(count=10))
    with pytest.raises(RecordDecodeError, match="limit is 100"):
        codec.decode(data, codec.DecodeLimits(max_message_bytes=100))
    with pytest.raises(RecordDecodeError) as err:
        codec.decode(data, codec.DecodeLimits(max_records=5))
    assert err.value.reason == "too_large"
    with pytest.raises(RecordDecodeError) as err:
        codec.decode(data, codec.DecodeLimits(num_classes=2))
    assert err.value.reason == "bad_label"
    with pytest.raises(RecordDecodeError) as err:
        codec.decode(data, expected_device="dev02")
    assert err.value.reason == "bad_device"
    with pytest.raises(RecordDecodeError) as err:
        codec.decode(data, expected_shape=(4, 3))
    assert err.value.reason == "bad_shape"


def test_negative_label_rejected():
    batch = make_batch()
    batch.labels[0] = -1
    with pytest.raises(RecordDecodeError) as err:
        codec.decode(codec.encode(batch))
    assert err.value.reason == "bad_label"


def test_error_names_its_location():
    err = RecordDecodeError("truncated", "short").located("sensors.dev01", 0, 42)
    assert "sensors.dev01[0]@42" in str(err)


@pytest.mark.parametrize("device", ["", "a b", "x" * 65, "dev/1"])
def test_encoder_refuses_invalid_device_ids(device):
    with pytest.raises(ValueError):
        codec.encode(make_batch(device=device))


@pytest.mark.parametrize("shape", [(), (64,), (3, 32)])
@pytest.mark.parametrize("labels", [True, False])
def test_decode_run_equals_the_messages_decoded_one_by_one(shape, labels):
    messages = [codec.encode(make_batch(shape=shape, labels=labels, seed=s)) for s in range(6)]
    decoder = codec.Decoder(expected_device="dev01")
    assert decoder.decode_run(messages) is None  # no header validated yet
    singles = [decoder.decode(m) for m in messages[:1]] + [codec.decode(m) for m in messages[1:]]

    run = decoder.decode_run(messages)

    assert run is not None and run.count == 6 * singles[0].count and run.feature_shape == shape
    for column in ("seq", "event_time", "features"):
        np.testing.assert_array_equal(getattr(run, column), np.concatenate([getattr(b, column) for b in singles]))
    if labels:
        np.testing.assert_array_equal(run.labels, np.concatenate([b.labels for b in singles]))
    else:
        assert run.labels is None


def _with_value(message: bytes, offset_from_end: int, raw: bytes) -> bytes:
    out = bytearray(message)
    out[len(out) - offset_from_end : len(out) - offset_from_end + len(raw)] = raw
    return bytes(out)


@pytest.mark.parametrize("bad", [
    pytest.param(lambda m: _with_value(m, 4, struct.pack("<f", float("nan"))), id="nan_feature"),
    pytest.param(lambda m: _with_value(m, 4 * 5 * 12 + 4, struct.pack("<i", 10)), id="label_out_of_range"),
    pytest.param(lambda m: _with_value(m, 4 * 5 * 12 + 4, struct.pack("<i", -1)), id="negative_label"),
    pytest.param(lambda m: _with_value(m, 4 * 5 * 12 + 4 * 5 + 8, struct.pack("<d", float("inf"))),
                 id="infinite_event_time"),
    pytest.param(lambda m: m + b"\0", id="longer"),
    pytest.param(lambda m: m[:-4], id="shorter"),
    pytest.param(lambda m: codec.encode(make_batch(count=5, shape=(12,))), id="other_shape_same_size"),
    pytest.param(lambda m: codec.encode(make_batch(count=5, shape=(3, 4), device="dev02")), id="other_device"),
    pytest.param(bytearray, id="not_bytes"),
])
def test_decode_run_declines_a_run_with_any_message_one_by_one_would_reject_or_read_differently(bad):
    good = codec.encode(make_batch(count=5, shape=(3, 4)))
    decoder = codec.Decoder(codec.DecodeLimits(num_classes=10), expected_device="dev01", expected_shape=(3, 4))
    decoder.decode(good)
    assert decoder.decode_run([good, good]) is not None

    assert decoder.decode_run([good, bad(good), good]) is None
    assert decoder.last_layout is not None and decoder.last_layout.size == len(good)  # unchanged
    if bad is not bytearray:  # a bytearray decodes fine one by one; the run only wants bytes
        with pytest.raises(RecordDecodeError):
            codec.Decoder(decoder.limits, expected_device="dev01", expected_shape=(3, 4)).decode(bad(good))
