"""``bench ingest --format json``: the messages it writes are the records it says, read
alike by the worker's mapping and by the plain consumer it is measured against."""

from __future__ import annotations

import numpy as np

from edgestream.benchmarks.ingest import JSON_MAPPING, RECORDS_PER_MESSAGE, json_message
from edgestream.job.config import load_config
from edgestream.streams import codec


def test_a_json_message_decodes_to_its_records_through_the_benchmarks_mapping():
    rng = np.random.default_rng(0)
    features = rng.random((RECORDS_PER_MESSAGE, 64), dtype=np.float32)
    labels = rng.integers(0, 10, RECORDS_PER_MESSAGE).astype(np.int32)
    seq = np.arange(64, 64 + RECORDS_PER_MESSAGE, dtype=np.uint64)
    cfg = load_config(overrides=["devices.count=1", "devices.ids=bench1", *JSON_MAPPING], env={})
    fmt, params = cfg.input.resolved()

    batch = fmt.decoder(params, codec.DecodeLimits(num_classes=10), expected_device="bench1").decode(
        json_message(features, labels, seq, 1_764_403_200_250))

    assert batch.count == RECORDS_PER_MESSAGE and batch.device == "bench1"
    assert np.array_equal(batch.features, features) and np.array_equal(batch.labels, labels)
    assert np.array_equal(batch.seq, seq) and np.all(batch.event_time == 1_764_403_200.25)
