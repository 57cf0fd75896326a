"""Malformed sensor messages of every kind the decoder must reject (for tests and demos)."""

from __future__ import annotations

import numpy as np

from streams import codec
from streams.records import RecordBatch

KINDS = ("random_bytes", "wrong_version", "wrong_shape", "nan", "oversized", "truncated")

#: The dead-letter reason each kind must produce.
EXPECTED_REASON = {
    "random_bytes": "bad_magic",
    "wrong_version": "bad_version",
    "wrong_shape": "bad_shape",
    "nan": "non_finite",
    "oversized": "too_large",
    "truncated": "truncated",
}


def _valid(device: str, shape: tuple[int, ...], count: int, rng: np.random.Generator) -> RecordBatch:
    return RecordBatch(
        device=device,
        seq=np.arange(count, dtype=np.uint64),
        event_time=np.full(count, 1.7e9),
        features=rng.standard_normal((count, *shape)).astype(np.float32),
        labels=np.zeros(count, dtype=np.int32),
    )


def make_garbage(
    kind: str, device: str, shape: tuple[int, ...], seed: int = 0, oversize_bytes: int = 2 << 20
) -> bytes:
    """A message of ``kind`` for ``device`` whose stream carries features of ``shape``."""
    rng = np.random.default_rng(seed)
    if kind == "random_bytes":
        return b"JUNK" + rng.integers(0, 256, 200, dtype=np.uint8).tobytes()
    if kind == "wrong_version":
        data = bytearray(codec.encode(_valid(device, shape, 4, rng)))
        data[4] = 99
        return bytes(data)
    if kind == "wrong_shape":
        other = tuple(d + 1 for d in shape) or (2,)
        return codec.encode(_valid(device, other, 4, rng))
    if kind == "nan":
        batch = _valid(device, shape, 4, rng)
        batch.features[2].flat[0] = np.nan
        return codec.encode(batch)
    if kind == "oversized":
        per_record = 4 * int(np.prod(shape)) + 20
        return codec.encode(_valid(device, shape, oversize_bytes // per_record + 1, rng))
    if kind == "truncated":
        return codec.encode(_valid(device, shape, 4, rng))[:-7]
    raise ValueError(f"unknown garbage kind {kind!r}; kinds: {', '.join(KINDS)}")


__all__ = ["KINDS", "EXPECTED_REASON", "make_garbage"]
