"""docs/devices.md: the bytes it shows for the binary format are what the encoder writes."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from edgestream.streams import codec
from edgestream.streams.records import RecordBatch

DOC = Path(__file__).resolve().parents[2] / "docs" / "devices.md"


def test_the_documented_binary_message_is_what_the_encoder_writes_and_decodes_back():
    text = DOC.read_text()
    (block,) = re.findall(r"```\n((?:[0-9a-f]{2} )+[0-9a-f]{2})\n```", text)
    documented = bytes.fromhex(block.replace(" ", ""))
    batch = RecordBatch(device="dev07", seq=np.array([41], dtype=np.uint64),
                        event_time=np.array([1764403200.25]),
                        features=np.array([[0.5, 1.0, -2.0]], dtype=np.float32), labels=np.array([3], dtype=np.int32))

    assert documented == codec.encode(batch) and f"these {len(documented)} bytes" in text
    back = codec.decode(documented, expected_device="dev07")
    assert back.seq.tolist() == [41] and back.labels.tolist() == [3]
    assert back.features.tolist() == [[0.5, 1.0, -2.0]] and back.event_time.tolist() == [1764403200.25]
