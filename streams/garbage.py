"""Malformed sensor messages of every kind the decoder must reject (for tests and demos).

Owns the garbage kinds and the dead-letter reason each must produce. Every message is
built from a real ``codec.encode`` (format version 2) and damaged just enough to hit its
own check: kinds aimed at a check after the CRC (``nan``, ``wrong_shape``, ...) carry a
valid CRC, so they reach it.

Invariant: every kind in ``KINDS`` is rejected by ``codec.decode`` with
``EXPECTED_REASON[kind]`` whatever the stream's value range (none included): callers
cycle through ``KINDS`` and check "garbage sent == dead-lettered" (``edgestream simulate
--garbage``, the demo's accounting, the integration tests). ``RANGE_KINDS`` are rejected
only when the stream declares a value range (``huge_value`` is a valid message with one
feature at 1e38, finite in float32: without a range it decodes fine), so they are not in
the default cycle; ``ALL_KINDS`` lists both.
"""

from __future__ import annotations

import numpy as np

from edgestream.streams import codec
from edgestream.streams.records import RecordBatch

KINDS = ("random_bytes", "wrong_version", "wrong_shape", "nan", "oversized", "truncated", "bitflip")
#: Kinds rejected only by a stream with a declared value range (``[0, 1]`` suffices).
RANGE_KINDS = ("huge_value",)
ALL_KINDS = KINDS + RANGE_KINDS

#: The dead-letter reason each kind must produce.
EXPECTED_REASON = {
    "random_bytes": "bad_magic",
    "wrong_version": "bad_version",
    "wrong_shape": "bad_shape",
    "nan": "non_finite",
    "oversized": "too_large",
    "truncated": "truncated",
    "bitflip": "bad_checksum",
    "huge_value": "out_of_range",
}
#: Bits ``bitflip`` flips: few, like a real transmission error, and odd: the CRC32C
#: polynomial has an even number of terms (divisible by x + 1), so it detects every
#: odd number of flipped bits at any message length: this kind is always caught.
BITFLIPS = 3


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
    if kind == "bitflip":
        data = bytearray(codec.encode(_valid(device, shape, 4, rng)))
        # Only payload bits (after the header, device id and dims; before the trailer):
        # the header checks pass unchanged and the CRC is what catches it.
        payload_start = 16 + len(device.encode()) + 4 * len(shape)
        payload_bits = 8 * (len(data) - codec.TRAILER_SIZE - payload_start)
        for bit in rng.choice(payload_bits, BITFLIPS, replace=False):
            data[payload_start + int(bit) // 8] ^= 1 << (int(bit) % 8)
        return bytes(data)
    if kind == "huge_value":
        batch = _valid(device, shape, 4, rng)
        # Every other value in [0, 1), so under a [0, 1] range only record 1 is bad.
        batch.features[...] = rng.random(batch.features.shape, dtype=np.float32)
        batch.features[1].flat[0] = 1e38  # finite in float32 (max ~3.4e38)
        return codec.encode(batch)
    raise ValueError(f"unknown garbage kind {kind!r}; kinds: {', '.join(ALL_KINDS)}")


__all__ = ["ALL_KINDS", "BITFLIPS", "EXPECTED_REASON", "KINDS", "RANGE_KINDS", "make_garbage"]
