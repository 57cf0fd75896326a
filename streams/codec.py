"""Versioned binary wire format of sensor messages (one ``RecordBatch`` per Kafka message).

Layout, all little-endian, version 1::

    offset  size          field
    0       4             magic  b"EDGS"
    4       1             version (1)
    5       1             flags  (bit 0: labels present; other bits must be 0)
    6       1             dtype code of the features (1 = float32)
    7       1             ndim of one record's features (0..4)
    8       4             count: records in this message (u32, >= 1)
    12      2             device id length in bytes (u16)
    14      2             reserved (0)
    16      L             device id, UTF-8, [A-Za-z0-9_.-]{1,64}
    ..      4*ndim        feature dims (u32 each, >= 1)
    ..      8*count       seq          (u64)
    ..      8*count       event_time   (f64, seconds since the epoch)
    ..      4*count       labels       (i32, only if flag bit 0)
    ..      4*count*prod  features     (f32, C order)

The message length must equal the sum exactly. Decoding checks every size against
the bytes actually present *before* touching the payload, enforces ``DecodeLimits``,
and rejects non-finite values; nothing is unpickled or eval'd.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import numpy as np

from streams.errors import RecordDecodeError
from streams.records import RecordBatch

MAGIC = b"EDGS"
VERSION = 1
_HEADER = struct.Struct("<4sBBBBIHH")
FLAG_LABELS = 0x01
DTYPE_CODES = {1: np.dtype("<f4")}
DTYPE_FROM_NUMPY = {np.dtype("<f4"): 1}
DEVICE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class DecodeLimits:
    """Upper bounds a message must respect; anything larger is rejected as ``too_large``."""

    max_message_bytes: int = 1 << 20
    max_records: int = 65_536
    max_features_per_record: int = 65_536
    max_ndim: int = 4
    num_classes: int | None = None  # if set, labels must lie in [0, num_classes)


DEFAULT_LIMITS = DecodeLimits()


def encode(batch: RecordBatch) -> bytes:
    """Serialise a ``RecordBatch`` into one message."""
    features = np.ascontiguousarray(batch.features, dtype="<f4")
    if not DEVICE_RE.match(batch.device):
        raise ValueError(f"invalid device id {batch.device!r}: use [A-Za-z0-9_.-], 1-64 chars")
    if batch.count < 1:
        raise ValueError("a message carries at least one record")
    dims = features.shape[1:]
    if len(dims) > 4:
        raise ValueError(f"features have {len(dims)} dims per record; at most 4 are supported")
    device = batch.device.encode()
    flags = FLAG_LABELS if batch.labels is not None else 0
    parts = [
        _HEADER.pack(MAGIC, VERSION, flags, 1, len(dims), batch.count, len(device), 0),
        device,
        np.asarray(dims, dtype="<u4").tobytes(),
        np.ascontiguousarray(batch.seq, dtype="<u8").tobytes(),
        np.ascontiguousarray(batch.event_time, dtype="<f8").tobytes(),
    ]
    if batch.labels is not None:
        parts.append(np.ascontiguousarray(batch.labels, dtype="<i4").tobytes())
    parts.append(features.tobytes())
    return b"".join(parts)


def decode(
    data: bytes | bytearray | memoryview,
    limits: DecodeLimits = DEFAULT_LIMITS,
    *,
    expected_device: str | None = None,
    expected_shape: tuple[int, ...] | None = None,
) -> RecordBatch:
    """Parse and validate one message; raise ``RecordDecodeError`` naming the problem.

    The returned arrays are read-only views into ``data`` (no copy).
    """
    layout = _check_header(data, limits, expected_device, expected_shape)
    return _decode_payload(data, layout, limits)


class Decoder:
    """``decode`` for one stream (fixed limits and expectations), remembering its last header.

    The messages of a stream usually share their header bytes (device, shape, record
    count, flags). The header checks read nothing but those bytes and the message
    length, so a message with the same header bytes and length as the last one that
    passed passes them again: that message skips straight to the payload checks,
    which always run. The ingest hot path decodes through one ``Decoder`` per device.
    """

    def __init__(
        self,
        limits: DecodeLimits = DEFAULT_LIMITS,
        *,
        expected_device: str | None = None,
        expected_shape: tuple[int, ...] | None = None,
    ) -> None:
        self.limits = limits
        self.expected_device = expected_device
        self.expected_shape = tuple(expected_shape) if expected_shape is not None else None
        self._last: Layout | None = None

    def decode(self, data: bytes | bytearray | memoryview) -> RecordBatch:
        """Like ``decode(data, limits, expected_device=..., expected_shape=...)``."""
        last = self._last
        if (
            last is not None
            and len(data) == last.size
            and isinstance(data, bytes)
            and data.startswith(last.header)
        ):
            layout = last
        else:
            layout = _check_header(data, self.limits, self.expected_device, self.expected_shape)
            self._last = layout
        return _decode_payload(data, layout, self.limits)

    @property
    def last_layout(self) -> Layout | None:
        """The layout of the last message whose header passed (what ``decode_run`` expects)."""
        return self._last

    def decode_run(self, values: list[bytes]) -> RecordBatch | None:
        """All of ``values`` as one batch (copied, in order), or None if they need one by one.

        The fast path of a stream whose consecutive messages share one header: each
        message is checked only for its length and header bytes (the last layout that
        passed every header check), then the payload checks run once over the whole
        run. None when any message differs from that layout or any payload check fails:
        the caller then decodes the messages one by one, which names each bad one.
        """
        last = self._last
        if last is None or not values:
            return None
        size, header = last.size, last.header
        for v in values:
            if type(v) is not bytes or len(v) != size or not v.startswith(header):
                return None
        k, count = len(values), last.count
        rows = np.frombuffer(b"".join(values), np.uint8).reshape(k, size)
        # Each column is copied out of the rows into a fresh (aligned, contiguous) array,
        # then checked there: numpy checks unaligned views far more slowly.
        pos = len(header)
        seq, pos = _column(rows, pos, (k * count,), _U8)
        event_time, pos = _column(rows, pos, (k * count,), _F8)
        labels = None
        if last.has_labels:
            labels, pos = _column(rows, pos, (k * count,), _I4)
        features, pos = _column(rows, pos, (k * count, *last.dims), last.dtype)
        if not (_isfinite(event_time).all() and _isfinite(features).all()):
            return None
        if labels is not None and not _labels_in_range(labels, self.limits):
            return None
        return RecordBatch(device=last.device, seq=seq, event_time=event_time, features=features, labels=labels)


def _column(rows: np.ndarray, pos: int, shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, int]:
    """The column at byte ``pos`` of every row, as one array of ``shape``; the next column's ``pos``."""
    out = np.empty(shape, dtype)
    width = out.nbytes // rows.shape[0]
    out.view(np.uint8).reshape(rows.shape[0], width)[...] = rows[:, pos : pos + width]
    return out, pos + width


@dataclass(frozen=True)
class Layout:
    """Where the columns of a message lie, from a header that passed every check."""

    header: bytes  # the bytes the checks read: fixed header, device id, dims
    size: int
    device: str
    count: int
    dims: tuple[int, ...]
    dtype: np.dtype
    has_labels: bool


def _check_header(
    data: bytes | bytearray | memoryview,
    limits: DecodeLimits,
    expected_device: str | None,
    expected_shape: tuple[int, ...] | None,
) -> Layout:
    """Every check of the header, the dims and the total length; the payload's layout."""
    size = len(data)
    if size > limits.max_message_bytes:
        raise RecordDecodeError(
            "too_large", f"message is {size} bytes; the limit is {limits.max_message_bytes}"
        )
    if size < _HEADER.size:
        raise RecordDecodeError("truncated", f"{size} bytes is shorter than the {_HEADER.size}-byte header")
    magic, version, flags, dtype_code, ndim, count, device_len, reserved = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise RecordDecodeError("bad_magic", f"magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise RecordDecodeError("bad_version", f"format version {version}; this reader understands {VERSION}")
    if flags & ~FLAG_LABELS or reserved != 0:
        raise RecordDecodeError("bad_version", f"unknown flags 0x{flags:02x} / reserved {reserved}")
    dtype = DTYPE_CODES.get(dtype_code)
    if dtype is None:
        raise RecordDecodeError("bad_dtype", f"dtype code {dtype_code} is not one of {sorted(DTYPE_CODES)}")
    if ndim > limits.max_ndim:
        raise RecordDecodeError("bad_shape", f"{ndim} feature dims; at most {limits.max_ndim}")
    if count < 1:
        raise RecordDecodeError("bad_count", "message declares 0 records")
    if count > limits.max_records:
        raise RecordDecodeError("too_large", f"{count} records; the limit is {limits.max_records}")

    pos = _HEADER.size
    _need(size, pos + device_len + 4 * ndim, "device id and dims")
    try:
        device = bytes(data[pos : pos + device_len]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordDecodeError("bad_device", f"device id is not UTF-8: {exc}") from None
    if not DEVICE_RE.match(device):
        raise RecordDecodeError("bad_device", f"device id {device!r} is not [A-Za-z0-9_.-]{{1,64}}")
    if expected_device is not None and device != expected_device:
        raise RecordDecodeError("bad_device", f"device {device!r} on the stream of {expected_device!r}")
    pos += device_len
    dims = struct.unpack_from(f"<{ndim}I", data, pos)
    pos += 4 * ndim
    if 0 in dims:
        raise RecordDecodeError("bad_shape", f"feature dims {dims} contain a zero")
    per_record = 1
    for d in dims:
        per_record *= d
        if per_record > limits.max_features_per_record:
            raise RecordDecodeError(
                "too_large", f"feature shape {dims} exceeds {limits.max_features_per_record} values per record"
            )
    if expected_shape is not None and dims != tuple(expected_shape):
        raise RecordDecodeError("bad_shape", f"feature shape {dims}, the stream's is {tuple(expected_shape)}")

    has_labels = bool(flags & FLAG_LABELS)
    body = count * (8 + 8 + (4 if has_labels else 0) + dtype.itemsize * per_record)
    if size != pos + body:
        kind = "truncated" if size < pos + body else "length_mismatch"
        raise RecordDecodeError(kind, f"{size} bytes, but header and shape imply {pos + body}")
    return Layout(bytes(data[:pos]), size, device, count, dims, dtype, has_labels)


def _decode_payload(data: bytes | bytearray | memoryview, layout: Layout, limits: DecodeLimits) -> RecordBatch:
    """The columns as views into ``data`` (sizes checked by ``_check_header``), checked for values."""
    # Once per Kafka message on the ingest hot path: as few numpy calls as possible (each
    # costs about a microsecond whatever the size).
    count = layout.count
    pos = len(layout.header)
    seq = np.ndarray((count,), _U8, data, pos)
    pos += 8 * count
    event_time = np.ndarray((count,), _F8, data, pos)
    pos += 8 * count
    labels = None
    if layout.has_labels:
        labels = np.ndarray((count,), _I4, data, pos)
        pos += 4 * count
    features = np.ndarray((count, *layout.dims), layout.dtype, data, pos)

    if not _isfinite(event_time).all():
        raise RecordDecodeError("non_finite", "event_time contains NaN or infinity")
    if not _isfinite(features).all():
        bad = int(np.count_nonzero(~np.isfinite(features.reshape(count, -1)).all(axis=1)))
        raise RecordDecodeError("non_finite", f"{bad} of {count} records have NaN or infinite features")
    if labels is not None and not _labels_in_range(labels, limits):
        lo, hi = int(labels.min()), int(labels.max())
        raise RecordDecodeError("bad_label", f"labels span [{lo}, {hi}], allowed [0, {limits.num_classes})")
    return RecordBatch(
        device=layout.device, seq=seq, event_time=event_time, features=features, labels=labels
    )


def _labels_in_range(labels: np.ndarray, limits: DecodeLimits) -> bool:
    """All labels in ``[0, num_classes)`` (any non-negative int32 without a class count)."""
    # One reduction checks both bounds: read as unsigned, a negative label is >= 2**31.
    bound = limits.num_classes if limits.num_classes is not None else 1 << 31
    return int(_max(labels.view(_U4))) < bound


_U8, _F8, _I4, _U4 = np.dtype("<u8"), np.dtype("<f8"), np.dtype("<i4"), np.dtype("<u4")
_isfinite = np.isfinite
_max = np.maximum.reduce


def _need(size: int, end: int, what: str) -> None:
    if size < end:
        raise RecordDecodeError("truncated", f"{size} bytes end before the {what} (need {end})")
