"""Sensor message codec: round trips and every rejection path."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from edgestream.streams import codec
from edgestream.streams.errors import RecordDecodeError
from edgestream.streams.garbage import ALL_KINDS, EXPECTED_REASON, KINDS, RANGE_KINDS, make_garbage
from edgestream.streams.records import RecordBatch, SensorRecord


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


def test_size_is_exactly_header_plus_payload_plus_trailer():
    batch = make_batch(count=32, shape=(64,))
    data = codec.encode(batch)
    assert len(data) == 16 + len("dev01") + 4 + 32 * (8 + 8 + 4 + 64 * 4) + 4
    assert len(codec.encode(batch, version=1)) == len(data) - 4


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
        (lambda d: corrupt(d, 4, "<B", 3), "bad_version"),
        (lambda d: corrupt(d, 4, "<B", 0), "bad_version"),
        (lambda d: corrupt(d, 4, "<B", 1), "length_mismatch"),  # v1 has no trailer: 4 bytes too many
        (lambda d: corrupt(d, 5, "<B", 0x80), "bad_version"),
        (lambda d: corrupt(d, 6, "<B", 7), "bad_dtype"),
        (lambda d: corrupt(d, 7, "<B", 9), "bad_shape"),
        (lambda d: corrupt(d, 8, "<I", 0), "bad_count"),
        (lambda d: corrupt(d, 8, "<I", 2**31), "too_large"),
        (lambda d: corrupt(d, 8, "<I", 6), "truncated"),
        (lambda d: corrupt(d, 16, "<5s", b"d v01"), "bad_device"),
        (lambda d: corrupt(d, 16, "<2s", b"\xff\xfe"), "bad_device"),
        (lambda d: corrupt(d, 16, "<5s", b"dev0\n"), "bad_device"),  # "$" once let a final newline in
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


def reseal(message: bytes | bytearray) -> bytes:
    """``message`` with its version-2 trailer recomputed (a deliberate edit, not corruption)."""
    return bytes(message[:-4]) + struct.pack("<I", codec.checksum(message[:-4]))


def _with_value(message: bytes, offset_from_end: int, raw: bytes) -> bytes:
    """``raw`` written ``offset_from_end`` bytes before the trailer, CRC recomputed."""
    out = bytearray(message[:-4])
    out[len(out) - offset_from_end : len(out) - offset_from_end + len(raw)] = raw
    return reseal(bytes(out) + b"\0" * 4)


def _flip(message: bytes, bit: int) -> bytes:
    out = bytearray(message)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


@pytest.mark.parametrize("bad", [
    pytest.param(lambda m: _with_value(m, 4, struct.pack("<f", float("nan"))), id="nan_feature"),
    pytest.param(lambda m: _with_value(m, 4 * 5 * 12 + 4, struct.pack("<i", 10)), id="label_out_of_range"),
    pytest.param(lambda m: _with_value(m, 4 * 5 * 12 + 4, struct.pack("<i", -1)), id="negative_label"),
    pytest.param(lambda m: _with_value(m, 4 * 5 * 12 + 4 * 5 + 8, struct.pack("<d", float("inf"))),
                 id="infinite_event_time"),
    pytest.param(lambda m: _flip(m, 8 * (len(m) - 40) + 3), id="flipped_payload_bit"),
    pytest.param(lambda m: _flip(m, 8 * len(m) - 1), id="flipped_trailer_bit"),
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


# ------------------------------------------------------------ format versions, CRC


def v1_by_hand(batch: RecordBatch) -> bytes:
    """The version-1 layout, written field by field from the format description (no codec)."""
    dims = batch.features.shape[1:]
    device = batch.device.encode()
    flags = 1 if batch.labels is not None else 0
    out = struct.pack("<4sBBBBIHH", b"EDGS", 1, flags, 1, len(dims), batch.count, len(device), 0)
    out += device + struct.pack(f"<{len(dims)}I", *dims)
    out += batch.seq.astype("<u8").tobytes() + batch.event_time.astype("<f8").tobytes()
    if batch.labels is not None:
        out += batch.labels.astype("<i4").tobytes()
    return out + batch.features.astype("<f4").tobytes()


def assert_same_batch(out: RecordBatch, batch: RecordBatch) -> None:
    assert out.device == batch.device
    for column in ("seq", "event_time", "features", "labels"):
        np.testing.assert_array_equal(getattr(out, column), getattr(batch, column))


def test_encode_writes_version_2_with_a_crc32c_trailer_over_every_preceding_byte():
    batch = make_batch()
    data = codec.encode(batch)

    assert data[4] == 2 == codec.VERSION
    assert data[:-4] == v1_by_hand(batch)[:4] + b"\x02" + v1_by_hand(batch)[5:]  # v1 layout + trailer
    assert struct.unpack("<I", data[-4:])[0] == codec.checksum(data[:-4])
    assert_same_batch(codec.decode(data), batch)


@pytest.mark.parametrize("labels", [True, False])
@pytest.mark.parametrize("shape", [(), (3, 4)])
def test_version_1_messages_still_decode(labels, shape):
    batch = make_batch(shape=shape, labels=labels)
    v1 = v1_by_hand(batch)
    assert codec.encode(batch, version=1) == v1

    assert_same_batch(codec.decode(v1), batch)
    decoder = codec.Decoder(expected_device="dev01")
    assert_same_batch(decoder.decode(v1), batch)
    assert_same_batch(decoder.decode(v1), batch)  # header-reuse fast path
    run = decoder.decode_run([v1, v1])
    assert run is not None and run.count == 2 * batch.count
    # A v2 message after v1 ones has other header bytes: full checks, both decode.
    assert_same_batch(decoder.decode(codec.encode(batch)), batch)
    with pytest.raises(ValueError, match="version 7"):
        codec.encode(batch, version=7)


def test_version_1_is_rejected_when_its_length_says_otherwise():
    v1 = codec.encode(make_batch(), version=1)
    with pytest.raises(RecordDecodeError) as err:
        codec.decode(v1 + b"\0\0\0\0")
    assert err.value.reason == "length_mismatch"


def test_every_single_bit_flip_of_a_v2_message_is_rejected():
    batch = make_batch(count=2, shape=(3,))
    good = codec.encode(batch)
    payload_start = 16 + len("dev01") + 4
    primed = codec.Decoder(codec.DecodeLimits(num_classes=10), expected_device="dev01", expected_shape=(3,))
    primed.decode(good)
    reasons = {}

    for bit in range(8 * len(good)):
        bad = _flip(good, bit)
        with pytest.raises(RecordDecodeError) as err:
            codec.decode(bad)
        reasons[bit] = err.value.reason
        # The same through a Decoder whose last header is the good one (fast path when the
        # flip spares the header), and in a run.
        with pytest.raises(RecordDecodeError) as again:
            primed.decode(bad)
        assert primed.decode_run([good, bad]) is None
        if bit >= 8 * payload_start:
            assert reasons[bit] == again.value.reason == "bad_checksum", bit
        primed.decode(good)  # back to the good layout
    assert set(reasons.values()) > {"bad_checksum", "bad_magic", "bad_version", "bad_device"}


def test_checksum_failure_names_both_crcs():
    good = codec.encode(make_batch())
    with pytest.raises(RecordDecodeError) as err:
        codec.decode(_flip(good, 8 * 30))
    assert err.value.reason == "bad_checksum"
    assert f"0x{codec.checksum(good[:-4]):08x}" in err.value.detail


def test_a_checksummed_message_has_the_crc_residue_and_any_flipped_bit_loses_it():
    """``decode_run`` checks each trailer through the CRC32C residue of the whole message."""
    good = codec.encode(make_batch(count=4, shape=(8,)))
    assert codec.checksum(good) == codec.CRC_RESIDUE
    for bit in range(0, 8 * len(good), 7):
        assert codec.checksum(_flip(good, bit)) != codec.CRC_RESIDUE


def test_decode_run_declines_a_run_with_a_missing_value():
    good = codec.encode(make_batch(count=4, shape=(8,)))
    decoder = codec.Decoder(expected_device="dev01", expected_shape=(8,))
    decoder.decode(good)
    assert decoder.decode_run([good, None, good]) is None  # type: ignore[list-item]
    assert decoder.decode_run([good, good]) is not None


def test_decode_run_with_one_corrupted_message_declines_and_all_good_equals_one_by_one():
    messages = [codec.encode(make_batch(count=4, shape=(8,), seed=s)) for s in range(8)]
    decoder = codec.Decoder(expected_device="dev01", expected_shape=(8,))
    singles = [decoder.decode(m) for m in messages]

    run = decoder.decode_run(messages)
    assert run is not None
    np.testing.assert_array_equal(run.features, np.concatenate([b.features for b in singles]))
    np.testing.assert_array_equal(run.seq, np.concatenate([b.seq for b in singles]))

    for i in range(len(messages)):
        corrupted = list(messages)
        corrupted[i] = _flip(messages[i], 8 * (len(messages[i]) - 20))
        assert decoder.decode_run(corrupted) is None


# ------------------------------------------------------------------- value ranges


def range_batch(count=6, shape=(4,), seed=0) -> RecordBatch:
    """Features uniform in [0, 1)."""
    batch = make_batch(count=count, shape=shape, seed=seed)
    batch.features[...] = np.random.default_rng(seed).random(batch.features.shape, dtype=np.float32)
    return batch


def out_of_range(data: bytes, value_range, **kwargs) -> codec.OutOfRange:
    with pytest.raises(codec.OutOfRange) as err:
        codec.decode(data, value_range=value_range, **kwargs)
    with pytest.raises(codec.OutOfRange) as again:
        codec.Decoder(value_range=value_range, **kwargs).decode(data)
    assert again.value.detail == err.value.detail
    np.testing.assert_array_equal(again.value.bad, err.value.bad)
    return err.value


def test_scalar_range_marks_exactly_the_bad_records_and_keeps_the_whole_batch():
    batch = range_batch(count=6)
    batch.features[1, 2] = 1.5
    batch.features[4, 0] = -0.25
    batch.features[4, 3] = 7.0  # the most extreme: 6 above hi
    data = codec.encode(batch)

    err = out_of_range(data, (0.0, 1.0))

    assert err.reason == "out_of_range" and isinstance(err, RecordDecodeError)
    assert err.bad.dtype == bool and err.bad.tolist() == [False, True, False, False, True, False]
    assert_same_batch(err.batch, batch)  # every record, the bad ones included
    assert err.detail == "2 of 6 records out of range; most extreme: record 4 feature 3 = 7 > hi 1"
    assert "\n" not in err.detail


def test_per_feature_range_and_the_bound_it_broke():
    batch = range_batch(count=5, shape=(2, 2))
    batch.features[:, 1, 1] += 10.0  # feature 3 lives in [10, 11]
    lo = np.array([0.0, 0.0, 0.0, 10.0])
    hi = np.array([1.0, 1.0, 1.0, 11.0])
    assert codec.decode(codec.encode(batch), value_range=(lo, hi)).count == 5

    batch.features[2, 1, 1] = 9.0  # fine for a scalar [0, 11], below its own lo of 10
    err = out_of_range(codec.encode(batch), (lo, hi))

    assert err.bad.tolist() == [False, False, True, False, False]
    assert err.detail == "1 of 5 records out of range; most extreme: record 2 feature (1, 1) = 9 < lo 10"
    assert codec.decode(codec.encode(batch), value_range=(0.0, 11.0)).count == 5


def test_mixed_scalar_and_per_feature_bounds_broadcast():
    batch = range_batch(count=3, shape=(4,))
    batch.features[:, 1] = 0.25
    batch.features[0, 1] = 0.75
    err = out_of_range(codec.encode(batch), (0.0, np.array([1.0, 0.5, 1.0, 1.0])))
    assert err.bad.tolist() == [True, False, False]
    assert "feature 1 = 0.75 > hi 0.5" in err.detail


def test_values_on_the_bounds_are_in_range_even_when_the_bound_is_not_a_float32():
    batch = range_batch(count=2, shape=(2,))
    batch.features[0] = [0.1, 0.3]  # float32(0.1) > 0.1 and float32(0.3) > 0.3
    batch.features[1] = [0.0, 0.2]
    assert codec.decode(codec.encode(batch), value_range=(0.0, np.array([0.1, 0.3]))).count == 2


def test_huge_finite_value_is_out_of_range_and_decodes_without_a_range():
    batch = range_batch(count=4)
    batch.features[3, 1] = 1e38
    data = codec.encode(batch)

    assert codec.decode(data).count == 4  # finite: nothing else would catch it
    err = out_of_range(data, (np.float64(0), np.float64(1)))
    assert err.bad.tolist() == [False, False, False, True]
    assert "record 3 feature 1 = 1e+38 > hi 1" in err.detail


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_non_finite_wins_over_out_of_range(poison):
    batch = range_batch(count=4)
    batch.features[0, 0] = 5.0  # out of range
    batch.features[2, 1] = poison
    data = codec.encode(batch)
    for value_range in [(0.0, 1.0), (np.zeros(4), np.ones(4)), (-np.inf, np.inf), (-1e300, 1e300)]:
        with pytest.raises(RecordDecodeError) as err:
            codec.decode(data, value_range=value_range)
        assert err.value.reason == "non_finite" and not isinstance(err.value, codec.OutOfRange)
        assert "1 of 4" in err.value.detail


def test_whole_message_rejections_win_over_out_of_range():
    batch = range_batch(count=4)
    batch.features[0, 0] = 5.0
    batch.labels[1] = 99
    with pytest.raises(RecordDecodeError) as err:
        codec.decode(codec.encode(batch), codec.DecodeLimits(num_classes=10), value_range=(0.0, 1.0))
    assert err.value.reason == "bad_label"


def test_a_per_feature_range_of_another_width_is_a_shape_error():
    data = codec.encode(range_batch(count=2, shape=(4,)))
    with pytest.raises(RecordDecodeError) as err:
        codec.decode(data, value_range=(np.zeros(3), np.ones(3)))
    assert err.value.reason == "bad_shape" and "declares 3" in err.value.detail


@pytest.mark.parametrize("value_range", [
    (1.0, 0.0), (np.nan, 1.0), (np.zeros((2, 2)), np.ones((2, 2))), (np.zeros(3), np.ones(4)),
])
def test_invalid_value_ranges_are_refused_up_front(value_range):
    with pytest.raises(ValueError):
        codec.Decoder(value_range=value_range)
    with pytest.raises(ValueError):
        codec.decode(codec.encode(range_batch()), value_range=value_range)


@pytest.mark.parametrize("value_range", [
    pytest.param((0.0, 1.0), id="scalar"),
    pytest.param((np.zeros(16), np.ones(16)), id="per_feature"),
])
def test_decode_run_with_a_range(value_range):
    # 64 messages of 32 records: the per-feature reduction takes its blocked path.
    messages = [codec.encode(range_batch(count=32, shape=(16,), seed=s)) for s in range(64)]
    decoder = codec.Decoder(value_range=value_range, expected_shape=(16,))
    singles = [decoder.decode(m) for m in messages]

    run = decoder.decode_run(messages)
    assert run is not None
    np.testing.assert_array_equal(run.features, np.concatenate([b.features for b in singles]))

    for i, value in [(0, 1.0001), (63, -1e-6), (30, 1e38), (5, np.nan)]:
        batch = range_batch(count=32, shape=(16,), seed=i)
        batch.features[31, 15] = value
        bad_run = list(messages)
        bad_run[i] = codec.encode(batch)
        assert decoder.decode_run(bad_run) is None


def test_out_of_range_keeps_batch_and_mask_when_located():
    batch = range_batch(count=3)
    batch.features[1, 0] = 2.0
    err = out_of_range(codec.encode(batch), (0.0, 1.0))

    located = err.located("sensors.dev01", 0, 42)

    assert isinstance(located, codec.OutOfRange) and located.reason == "out_of_range"
    assert located.batch is err.batch and located.bad is err.bad and located.detail == err.detail
    assert "sensors.dev01[0]@42" in str(located)


def test_reasons_include_the_new_ones():
    assert {"bad_checksum", "out_of_range"} <= set(RecordDecodeError.REASONS)


def test_widen():
    lo, hi = codec.widen(np.array([0.0, -2.0, 5.0]), np.array([1.0, 2.0, 5.0]), 0.5)
    np.testing.assert_allclose(lo, [-0.5, -4.0, 5.0 - 2.5e-6])
    np.testing.assert_allclose(hi, [1.5, 4.0, 5.0 + 2.5e-6])
    assert codec.widen(0.0, 0.0, 1.0) == (-1e-6, 1e-6)  # zero span near 0: width from the floor of 1
    assert codec.widen(2.0, 3.0, 0.0) == (2.0, 3.0)
    with pytest.raises(ValueError):
        codec.widen(1.0, 0.0, 1.0)
    with pytest.raises(ValueError):
        codec.widen(0.0, 1.0, -1.0)
    with pytest.raises(ValueError):
        codec.widen(0.0, np.inf, 1.0)


# --------------------------------------------------------------- garbage kinds


@pytest.mark.parametrize("kind", KINDS)
def test_every_default_garbage_kind_is_rejected_with_its_reason_under_a_value_range_too(kind):
    data = make_garbage(kind, "dev01", (3, 4))
    for value_range in [(0.0, 1.0), (-1e6, 1e6)]:
        with pytest.raises(RecordDecodeError) as err:
            codec.decode(data, expected_shape=(3, 4), value_range=value_range)
        assert err.value.reason == EXPECTED_REASON[kind]


@pytest.mark.parametrize("kind", RANGE_KINDS)
def test_range_kinds_need_a_value_range(kind):
    data = make_garbage(kind, "dev01", (3, 4))
    assert codec.decode(data, expected_shape=(3, 4)).count == 4

    err = out_of_range(data, (0.0, 1.0), expected_shape=(3, 4))
    assert err.reason == EXPECTED_REASON[kind] and err.bad.tolist() == [False, True, False, False]


def test_range_kinds_are_not_in_the_default_cycle():
    assert set(ALL_KINDS) == set(KINDS) | set(RANGE_KINDS) == set(EXPECTED_REASON)
    assert not set(KINDS) & set(RANGE_KINDS)


@pytest.mark.parametrize("seed", range(20))
def test_bitflip_garbage_is_always_a_checksum_failure_even_after_good_messages(seed):
    decoder = codec.Decoder(expected_device="dev01", expected_shape=(4,))
    decoder.decode(codec.encode(RecordBatch(
        "dev01", np.arange(4, dtype=np.uint64), np.zeros(4), np.zeros((4, 4), np.float32), np.zeros(4, np.int32))))
    bad = make_garbage("bitflip", "dev01", (4,), seed=seed)
    assert decoder.last_layout is not None and bad.startswith(decoder.last_layout.header)  # fast path
    with pytest.raises(RecordDecodeError) as err:
        decoder.decode(bad)
    assert err.value.reason == "bad_checksum"


# ------------------------------------------------------ replay's device rewrite


def test_rewrite_device_reseals_v2_keeps_v1_and_keeps_damage():
    from edgestream.pipeline.replay import rewrite_device

    batch = make_batch()
    v2 = codec.encode(batch)
    renamed = rewrite_device(v2, "dev01", "lab-007")
    assert renamed[4] == 2 and codec.decode(renamed, expected_device="lab-007").count == batch.count

    v1 = codec.encode(batch, version=1)
    renamed_v1 = rewrite_device(v1, "dev01", "lab-007")
    assert renamed_v1[4] == 1 and len(renamed_v1) == len(v1) + 2  # still v1, no trailer added
    assert_same_batch(codec.decode(renamed_v1), RecordBatch("lab-007", batch.seq, batch.event_time,
                                                           batch.features, batch.labels))

    flipped = _flip(v2, 8 * (len(v2) - 30))
    with pytest.raises(RecordDecodeError) as err:
        codec.decode(rewrite_device(flipped, "dev01", "lab-007"), expected_device="lab-007")
    assert err.value.reason == "bad_checksum"
