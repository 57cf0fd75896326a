"""``bench ingest --format avro``: the messages it writes are the records it says, read
alike by the worker's mapping and by the plain fastavro consumer it is measured against."""

from __future__ import annotations

import io
import json

import fastavro
import numpy as np

from edgestream.benchmarks.ingest import (
    AVRO_SCHEMA,
    JSON_MAPPING,
    RECORDS_PER_MESSAGE,
    avro_mapping,
    avro_message,
)
from edgestream.job.config import load_config
from edgestream.streams import codec


def _message() -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    features = rng.random((RECORDS_PER_MESSAGE, 64), dtype=np.float32)
    labels = rng.integers(0, 10, RECORDS_PER_MESSAGE).astype(np.int32)
    seq = np.arange(64, 64 + RECORDS_PER_MESSAGE, dtype=np.uint64)
    return avro_message(features, labels, seq, 1_764_403_200_250), features, labels, seq


def test_an_avro_message_decodes_to_its_records_through_the_benchmarks_mapping(tmp_path):
    schema_file = tmp_path / "readings.avsc"
    schema_file.write_text(json.dumps(AVRO_SCHEMA))
    data, features, labels, seq = _message()
    cfg = load_config(overrides=["devices.count=1", "devices.ids=bench1", *avro_mapping(schema_file)], env={})
    fmt, params = cfg.input.resolved()
    assert fmt.name == "avro"

    batch = fmt.decoder(params, codec.DecodeLimits(num_classes=10), expected_device="bench1").decode(data)

    assert batch.count == RECORDS_PER_MESSAGE and batch.device == "bench1"
    assert np.array_equal(batch.features, features) and np.array_equal(batch.labels, labels)
    assert np.array_equal(batch.seq, seq) and np.all(batch.event_time == 1_764_403_200.25)


def test_the_avro_mapping_is_the_json_one_read_as_avro(tmp_path):
    mapping = avro_mapping(tmp_path / "readings.avsc")
    assert mapping[0] == "input.format=avro" and mapping[1:-1] == JSON_MAPPING[1:]
    assert mapping[-1] == f"input.schema_file={tmp_path / 'readings.avsc'}"


def test_the_plain_consumers_schemaless_read_gives_the_same_readings():
    data, features, labels, seq = _message()
    readings = fastavro.schemaless_reader(io.BytesIO(data), fastavro.parse_schema(AVRO_SCHEMA))
    assert np.array_equal(np.asarray([r["pixels"] for r in readings], dtype=np.float32), features)
    assert [r["digit"] for r in readings] == labels.tolist() and [r["n"] for r in readings] == seq.tolist()
