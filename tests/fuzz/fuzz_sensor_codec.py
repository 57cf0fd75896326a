"""Fuzz target: sensor messages (``streams.codec``: ``decode``, ``Decoder``, ``decode_run``).

Input: one mode byte, then the message bytes. Mode bits:

* 1: give a version-2 message a correct CRC32C trailer before decoding, so mutations
  reach the payload checks instead of stopping at ``bad_checksum``;
* 2: ``DecodeLimits(num_classes=10)`` (labels checked against a class count);
* 4: expect device ``dev01`` and feature shape ``(4,)``;
* 8: a value range ``[0, 1]`` for every feature; 16: a per-feature range of width 4
  (8 wins when both are set);
* 32: set the header's record count to what the message's length implies (when it
  divides evenly), before the CRC, so inserting or erasing bytes makes other valid sizes.

Allowed to escape ``decode`` / ``Decoder.decode``: ``RecordDecodeError`` (with
``OutOfRange``), as docs/ingest.md and ``decode``'s docstring say. Anything else is a
bug, and so is breaking a documented property:

* a decoded batch is finite, has at least one record, labels within the limits, values
  within the declared range, and re-encodes to exactly the input bytes (the format is
  canonical);
* ``OutOfRange`` carries the whole decoded batch and a non-empty mask of its records;
* ``Decoder.decode`` agrees with ``decode`` (twice: the second time through its cached
  header), and ``Decoder.decode_run`` never raises: it returns None or the batch of
  all messages of the run.
"""

from __future__ import annotations

import crc32c
import numpy as np

from edgestream.streams import codec
from edgestream.streams.codec import DecodeLimits, Decoder, decode, encode
from edgestream.streams.errors import OutOfRange, RecordDecodeError
from edgestream.streams.records import RecordBatch
from tests.fuzz.targets import FuzzFinding

MAX_LEN = 16384
ALLOWED = (RecordDecodeError,)

FIX_CRC, CLASSES, EXPECT, RANGE, PER_FEATURE, FIX_COUNT = 1, 2, 4, 8, 16, 32
_WIDTH = 4


def _options(mode: int) -> dict:
    value_range = None
    if mode & RANGE:
        value_range = (0.0, 1.0)
    elif mode & PER_FEATURE:
        value_range = (np.zeros(_WIDTH), np.linspace(1.0, 4.0, _WIDTH))
    return {
        "limits": DecodeLimits(num_classes=10 if mode & CLASSES else None),
        "expected_device": "dev01" if mode & EXPECT else None,
        "expected_shape": (_WIDTH,) if mode & EXPECT else None,
        "value_range": value_range,
    }


def _fix_count(msg: bytes) -> bytes:
    if len(msg) < 16:
        return msg
    version, flags, ndim, device_len = msg[4], msg[5], msg[7], int.from_bytes(msg[12:14], "little")
    dims_at = 16 + device_len
    if ndim > 4 or len(msg) < dims_at + 4 * ndim:
        return msg
    per_record = 1
    for i in range(ndim):
        per_record *= int.from_bytes(msg[dims_at + 4 * i : dims_at + 4 * i + 4], "little")
    record = 16 + (4 if flags & 1 else 0) + 4 * per_record
    body = len(msg) - dims_at - 4 * ndim - (4 if version == 2 else 0)
    if body <= 0 or body % record or body // record >= 1 << 32:
        return msg
    return msg[:8] + (body // record).to_bytes(4, "little") + msg[12:]


def _fix_crc(msg: bytes) -> bytes:
    if len(msg) >= 16 and msg[:4] == codec.MAGIC and msg[4] == 2:
        return msg[:-4] + crc32c.crc32c(msg[:-4]).to_bytes(4, "little")
    return msg


def _outcome(fn, *args) -> tuple[str, RecordBatch | None]:
    """("ok" | reason, batch): the batch for ok and out_of_range, None otherwise."""
    try:
        return "ok", fn(*args)
    except OutOfRange as err:
        if len(err.bad) != err.batch.count or not err.bad.any() or err.bad.dtype != bool:
            raise FuzzFinding(f"OutOfRange mask {err.bad!r} for {err.batch.count} records") from err
        return "out_of_range", err.batch
    except RecordDecodeError as err:
        if err.reason not in RecordDecodeError.REASONS:
            raise FuzzFinding(f"unknown reason {err.reason!r}") from err
        return err.reason, None


def _same(a: RecordBatch, b: RecordBatch) -> bool:
    return (
        a.device == b.device
        and np.array_equal(a.seq, b.seq)
        and np.array_equal(a.event_time, b.event_time)
        and a.features.shape == b.features.shape
        and np.array_equal(a.features.view(np.uint32), b.features.view(np.uint32))
        and ((a.labels is None and b.labels is None) or (
            a.labels is not None and b.labels is not None and np.array_equal(a.labels, b.labels)))
    )


def _check_batch(batch: RecordBatch, msg: bytes, opts: dict, in_range: bool) -> None:
    limits = opts["limits"]
    if batch.count < 1 or batch.count > limits.max_records:
        raise FuzzFinding(f"decoded {batch.count} records")
    if not (np.isfinite(batch.features).all() and np.isfinite(batch.event_time).all()):
        raise FuzzFinding("decoded batch holds NaN or infinity")
    if batch.labels is not None and batch.labels.size:
        bound = limits.num_classes if limits.num_classes is not None else 1 << 31
        if int(batch.labels.min()) < 0 or int(batch.labels.max()) >= bound:
            raise FuzzFinding(f"labels {batch.labels} outside [0, {bound})")
    if opts["expected_device"] is not None and batch.device != opts["expected_device"]:
        raise FuzzFinding(f"device {batch.device!r} accepted on the stream of {opts['expected_device']!r}")
    if opts["expected_shape"] is not None and batch.feature_shape != opts["expected_shape"]:
        raise FuzzFinding(f"shape {batch.feature_shape} accepted, expected {opts['expected_shape']}")
    if in_range and opts["value_range"] is not None:
        lo, hi = opts["value_range"]
        flat = batch.features.reshape(batch.count, -1).astype(np.float64)
        if ((flat < np.asarray(lo) - 1e-6) | (flat > np.asarray(hi) + 1e-6)).any():
            raise FuzzFinding("a value outside the declared range was accepted")
    again = encode(batch, version=msg[4])
    if again != msg:
        raise FuzzFinding(f"re-encoding the decoded batch gives other bytes ({len(again)} vs {len(msg)})")


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, msg = data[0], bytes(data[1:])
    if mode & FIX_COUNT:
        msg = _fix_count(msg)
    if mode & FIX_CRC:
        msg = _fix_crc(msg)
    opts = _options(mode)
    kwargs = {k: opts[k] for k in ("expected_device", "expected_shape", "value_range")}
    verdict, batch = _outcome(lambda m: decode(m, opts["limits"], **kwargs), msg)
    if batch is not None:
        _check_batch(batch, msg, opts, in_range=verdict == "ok")

    decoder = Decoder(opts["limits"], **kwargs)
    for attempt in (1, 2):  # the second call may take the cached-header path
        got, other = _outcome(decoder.decode, msg)
        if got != verdict or (batch is None) != (other is None) or (batch is not None and not _same(batch, other)):
            raise FuzzFinding(f"Decoder.decode (call {attempt}) says {got!r}, decode says {verdict!r}")

    try:
        run = decoder.decode_run([msg, msg])
    except Exception as err:
        raise FuzzFinding(f"decode_run raised {type(err).__name__}: {err}") from err
    if run is not None:
        if verdict != "ok" or batch is None:
            raise FuzzFinding(f"decode_run accepted a run of a message decode rejects ({verdict})")
        twice = RecordBatch(
            device=batch.device,
            seq=np.concatenate([batch.seq, batch.seq]),
            event_time=np.concatenate([batch.event_time, batch.event_time]),
            features=np.concatenate([batch.features, batch.features]),
            labels=None if batch.labels is None else np.concatenate([batch.labels, batch.labels]),
        )
        if not _same(run, twice):
            raise FuzzFinding("decode_run differs from the messages decoded one by one")


def seeds() -> dict[str, bytes]:
    """Valid messages (and a few near misses) with a mode byte each."""
    rng = np.random.default_rng(0)

    def batch(device: str, shape: tuple[int, ...], count: int, labels: bool, scale: float = 1.0) -> RecordBatch:
        return RecordBatch(
            device=device,
            seq=np.arange(count, dtype=np.uint64) + 100,
            event_time=1_700_000_000.0 + np.arange(count) * 0.01,
            features=(rng.random((count, *shape)) * scale).astype(np.float32),
            labels=rng.integers(0, 10, count).astype(np.int32) if labels else None,
        )

    out: dict[str, bytes] = {}
    flat = batch("dev01", (_WIDTH,), 3, True)
    out["v2_labels_w4"] = bytes([FIX_CRC | CLASSES | EXPECT | RANGE | FIX_COUNT]) + encode(flat)
    # Enough records for the per-feature range's reduction path (>= 256 records).
    out["v2_300_records"] = bytes([FIX_CRC | FIX_COUNT | EXPECT | PER_FEATURE]) + encode(
        batch("dev01", (_WIDTH,), 300, True))
    out["v2_labels_w4_perfeature"] = bytes([FIX_CRC | EXPECT | PER_FEATURE]) + encode(flat)
    out["v2_nolabels_2d"] = bytes([FIX_CRC]) + encode(batch("sensor.a-b_c", (2, 3), 2, False))
    out["v2_scalar"] = bytes([0]) + encode(batch("d", (), 5, True))
    out["v2_4d"] = bytes([FIX_CRC | CLASSES]) + encode(batch("dev02", (1, 2, 1, 2), 1, True))
    out["v1_labels"] = bytes([CLASSES | EXPECT]) + encode(flat, version=1)
    out["v2_out_of_range"] = bytes([FIX_CRC | EXPECT | RANGE]) + encode(batch("dev01", (_WIDTH,), 4, True, 3.0))
    nan = batch("dev01", (_WIDTH,), 2, False)
    nan.features[1, 2] = np.nan
    out["v2_nan"] = bytes([FIX_CRC]) + encode(nan)
    return out


def dictionary() -> list[bytes]:
    """Tokens for libFuzzer: the magic, a version-1 and -2 header start, device ids."""
    return [codec.MAGIC, codec.MAGIC + b"\x02\x01\x01\x01", codec.MAGIC + b"\x01\x00\x01\x00", b"dev01",
            b"\x04\x00\x00\x00", b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\xff\xff\xff\xff"]
