"""docs/devices.md: the bytes it shows for the binary and Avro formats are what the decoders read."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from edgestream.streams import codec
from edgestream.streams.records import RecordBatch

DOC = Path(__file__).resolve().parents[2] / "docs" / "devices.md"


def test_the_documented_binary_message_is_what_the_encoder_writes_and_decodes_back():
    text = DOC.read_text()
    block = re.findall(r"```\n((?:[0-9a-f]{2} )+[0-9a-f]{2})\n```", text)[0]
    documented = bytes.fromhex(block.replace(" ", ""))
    batch = RecordBatch(device="dev07", seq=np.array([41], dtype=np.uint64),
                        event_time=np.array([1764403200.25]),
                        features=np.array([[0.5, 1.0, -2.0]], dtype=np.float32), labels=np.array([3], dtype=np.int32))

    assert documented == codec.encode(batch) and f"these {len(documented)} bytes" in text
    back = codec.decode(documented, expected_device="dev07")
    assert back.seq.tolist() == [41] and back.labels.tolist() == [3]
    assert back.features.tolist() == [[0.5, 1.0, -2.0]] and back.event_time.tolist() == [1764403200.25]


def test_the_documented_avro_message_decodes_to_the_reading(tmp_path):
    import json

    from edgestream.streams.formats import format_named
    from edgestream.streams.formats.avro_records import AvroDecoder, parse_schema

    text = DOC.read_text()
    block = re.findall(r"```\n((?:[0-9a-f]{2} )+[0-9a-f]{2})\n```", text)[1]
    documented = bytes.fromhex(block.replace(" ", ""))
    assert f"these {len(documented)} bytes" in text
    schema_text = re.search(r"schema `(\{.*?\]\})` registered as id 1", " ".join(text.split())).group(1)
    (tmp_path / "imu.avsc").write_text(schema_text)
    fmt = format_named("avro")
    params = fmt.parse_params({"features": ["x", "y", "z"], "label": "label", "schema_file": str(tmp_path / "imu.avsc"),
                               "schema_registry": "http://registry.invalid"})

    class Registry:
        def schema(self, schema_id):
            assert schema_id == 1
            return parse_schema(json.dumps(json.loads(schema_text)), "imu")

    wire = AvroDecoder(params, Registry(), codec.DEFAULT_LIMITS, expected_device="dev07").decode(documented, timestamp_s=1.7e9)
    plain = fmt.decoder(fmt.parse_params({"features": ["x", "y", "z"], "label": "label",
                                          "schema_file": str(tmp_path / "imu.avsc")}),
                        expected_device="dev07").decode(documented[5:], timestamp_s=1.7e9)
    for batch in (wire, plain):
        assert batch.features.tolist() == [[0.5, 1.0, -2.0]] and batch.labels.tolist() == [3]
    assert "the last 13 bytes" in text and len(documented[5:]) == 13
