"""Input format ``"edgestream"``: edgestream's own binary sensor messages (``streams.codec``).

``codec.Decoder`` is its ``FormatDecoder`` as it is (no wrapper on the ingest hot path):
the same checks, the same errors, the same run fast path. A message carries its own
event times and sequence numbers, so ``decode`` ignores the Kafka timestamp and offset.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from edgestream.streams import codec
from edgestream.streams.formats.base import InputFormat, register
from edgestream.streams.records import RecordBatch


@register("edgestream")
class NativeFormat(InputFormat):
    """The binary format of ``streams/codec.py``; it takes no parameters."""

    reads_recordings = True

    def encode(self, params: object, batch: RecordBatch) -> bytes:
        return codec.encode(batch)

    def parse_params(self, params: Mapping[str, Any]) -> None:
        if not isinstance(params, Mapping):
            raise ValueError(f"the {self.name} format's parameters are a mapping, not {type(params).__name__}")
        if params:
            raise ValueError(
                f"the {self.name} format takes no parameters; remove {', '.join(map(repr, params))}"
            )
        return None

    def decoder(
        self,
        params: object,
        limits: codec.DecodeLimits = codec.DEFAULT_LIMITS,
        *,
        expected_device: str | None = None,
        expected_shape: tuple[int, ...] | None = None,
        value_range: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> codec.Decoder:
        if isinstance(params, Mapping):
            self.parse_params(params)
        elif params is not None:
            raise ValueError(f"the {self.name} format takes no parameters (got {params!r})")
        return codec.Decoder(
            limits, expected_device=expected_device, expected_shape=expected_shape, value_range=value_range
        )
