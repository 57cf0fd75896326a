"""JSON readings decoded in runs (``JsonDecoder.decode_run``) and with numpy's type inference:
the same batches and the same rejections as one message at a time through every check."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgestream.streams import codec, formats
from edgestream.streams.errors import OutOfRange, RecordDecodeError
from edgestream.streams.formats.json_records import RUN_PART, JsonDecoder
from edgestream.streams.records import RecordBatch

T0 = 1_700_000_000.0
RUNNABLE = {"features": "px", "label": "y", "event_time": "t", "record_id": "n"}


def decoder(value_range=None, expected_shape=None, limits=codec.DEFAULT_LIMITS, **mapping) -> JsonDecoder:
    fmt = formats.format_named("json")
    return fmt.decoder(fmt.parse_params(mapping or RUNNABLE), limits, expected_device="dev01",
                       expected_shape=expected_shape, value_range=value_range)


def message(first: int, count: int = 3, **change) -> bytes:
    readings = [{"px": [[0.25 * (first + i), 0.5], [0.125, 1.0]], "y": (first + i) % 10, "t": T0 + first + i,
                 "n": first + i, **change} for i in range(count)]
    return json.dumps(readings).encode()


def same(a: RecordBatch, b: RecordBatch) -> bool:
    return (a.device == b.device and np.array_equal(a.seq, b.seq) and np.array_equal(a.event_time, b.event_time)
            and a.features.dtype == b.features.dtype and np.array_equal(a.features, b.features)
            and (a.labels is None) == (b.labels is None)
            and (a.labels is None or np.array_equal(a.labels, b.labels)))


def concatenated(batches: list[RecordBatch]) -> RecordBatch:
    return RecordBatch(device=batches[0].device, seq=np.concatenate([b.seq for b in batches]),
                       event_time=np.concatenate([b.event_time for b in batches]),
                       features=np.concatenate([b.features for b in batches]),
                       labels=None if batches[0].labels is None else np.concatenate([b.labels for b in batches]))


def test_a_run_is_the_concatenation_of_its_messages_past_several_parts():
    values = [message(3 * i) for i in range(2 * RUN_PART + 3)]
    dec = decoder()
    assert dec.last_layout is None and dec.decode_run(values) is None  # no good message yet
    dec.decode(values[0])
    assert (dec.last_layout.count, dec.last_layout.labelled) == (3, True)

    run = dec.decode_run(values)

    assert run is not None and same(run, concatenated([decoder().decode(v) for v in values]))


def test_one_reading_a_message_runs_too():
    dec = decoder()
    one = [json.dumps(json.loads(message(i, 1))[0]).encode() for i in range(5)]
    dec.decode(one[0])
    assert same(dec.decode_run(one), concatenated([decoder().decode(v) for v in one]))


@pytest.mark.parametrize("bad", [
    pytest.param(b"[{\"px\": [[0.5,", id="bad_json"),
    pytest.param(message(90, y=True), id="bool_label"),
    pytest.param(message(90, px=[[0.5, True], [0.125, 1.0]]), id="bool_feature"),
    pytest.param(message(90, px=[[0.5, "1"], [0.125, 1.0]]), id="string_feature"),
    pytest.param(message(90, px=[[0.5, None], [0.125, 1.0]]), id="null_feature"),
    pytest.param(message(90, px=[[0.5], [0.125, 1.0]]), id="ragged"),
    pytest.param(message(90, px=[[0.5, 1e39], [0.125, 1.0]]), id="beyond_float32"),
    pytest.param(message(90, px=[0.5, 0.5, 0.125, 1.0]), id="another_shape"),
    pytest.param(message(90, n=-1), id="bad_record_id"),
    pytest.param(message(90, 4), id="another_count"),
    pytest.param(json.dumps([{k: v for k, v in r.items() if k != "y"} for r in json.loads(message(90))]).encode(),
                 id="unlabelled"),
    pytest.param(json.dumps(json.loads(message(90))[0]).encode(), id="an_object_not_an_array"),
])
def test_a_run_with_a_message_that_differs_or_fails_is_declined(bad):
    dec = decoder(expected_shape=(2, 2))
    dec.decode(message(0))
    assert dec.decode_run([message(3), message(6)]) is not None
    assert dec.decode_run([message(3), bad, message(6)]) is None


def test_a_run_outside_the_declared_range_is_declined():
    dec = decoder(value_range=(0.0, 1.0))
    dec.decode(message(0))
    assert dec.decode_run([message(3), message(9)]) is None  # 0.25 * 11 > 1
    with pytest.raises(OutOfRange):
        dec.decode(message(9))


def test_a_run_with_messages_of_two_devices_is_declined():
    fmt = formats.format_named("json")
    dec = fmt.decoder(fmt.parse_params({**RUNNABLE, "device": "d"}), expected_device=None)
    dec.decode(message(0, d="dev01"))
    assert dec.decode_run([message(3, d="dev01"), message(6, d="dev01")]) is not None
    parts = [message(3 * i, d="dev01") for i in range(RUN_PART)] + [message(99, d="dev02")]
    assert dec.decode_run(parts) is None


def test_without_event_time_or_record_id_a_message_needs_kafka_so_no_runs():
    for mapping in ({**RUNNABLE, "event_time": None}, {**RUNNABLE, "record_id": None}):
        dec = decoder(**{k: v for k, v in mapping.items() if v is not None})
        dec.decode(message(0), timestamp_s=T0, offset=4)
        assert dec.last_layout is None and dec.decode_run([message(3)]) is None


TRICKY = [
    [{"a": 1, "b": 2**63}], [{"a": 2**64 - 1, "b": -1}], [{"a": 16777217, "b": 2**53 + 1}],
    [{"a": "1.5", "b": 2}], [{"a": None, "b": 2}], [{"a": [1], "b": 2}], [{"a": {}, "b": 2}],
    [{"a": 3.4028235e38, "b": 1}], [{"a": -3.5e38, "b": 1}], [{"a": 1.5e-45, "b": 0}],
]
TRICKY_ARRAYS = [
    [{"px": []}], [{"px": [[]]}, {"px": [[]]}], [{"px": [1, [2]]}], [{"px": [[1, 2], [3]]}],
    [{"px": [[[[1.0]]]]}], [{"px": [[1.0, 2.0]]}, {"px": [1.0, 2.0]}], [{"px": 3}], [{"px": [1, "x"]}],
    [{"px": [[1, 2**64 - 1]]}], [{"px": [None, None]}], [{"px": [3.5e38, 1]}], [{"px": [[{}]]}],
]


def outcome(dec: JsonDecoder, data: bytes):
    try:
        batch = dec.decode(data, timestamp_s=T0, offset=3)
    except RecordDecodeError as err:
        return err.reason, err.detail
    return batch.feature_shape, batch.features.view(np.uint32).tolist()


@pytest.mark.parametrize("mapping, readings", [({"features": ["a", "b"]}, r) for r in TRICKY]
                         + [({"features": "px"}, r) for r in TRICKY_ARRAYS])
def test_type_inference_accepts_and_rejects_as_the_value_by_value_check(mapping, readings):
    data = json.dumps(readings).encode()
    fast = decoder(limits=codec.DecodeLimits(max_ndim=3), **mapping)
    checked = decoder(limits=codec.DecodeLimits(max_ndim=3), **mapping)
    checked._json_text = False  # never bool-free: every value's type checked one by one
    assert fast._bool_free(data)
    assert outcome(fast, data) == outcome(checked, data)


def test_a_bool_anywhere_in_the_text_keeps_the_value_by_value_check():
    dec = decoder(features=["a", "b"])
    assert not dec._bool_free(b'[{"a": 1, "b": true}]') and not dec._bool_free(b'[{"a": 1, "b": false}]')
    assert dec._bool_free(b'[{"a": 1, "b": 2, "unit": "fahrenheit"}]')  # letters, but neither word
    assert not dec._bool_free(memoryview(b'[{"a": 1, "b": 2}]'))
    with pytest.raises(RecordDecodeError, match="is a bool"):
        dec.decode(b'[{"a": 1, "b": true}]', timestamp_s=T0)
