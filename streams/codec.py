"""Versioned binary wire format of sensor messages (one ``RecordBatch`` per Kafka message).

``encode`` writes version 2; ``decode`` reads versions 1 and 2. Layout, all little-endian::

    offset  size          field
    0       4             magic  b"EDGS"
    4       1             version (2; 1 in old recordings)
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
    ..      4             CRC32C of every preceding byte (u32; version 2 only)

Version 1 is exactly version 2 without the trailer. The message length must equal the
sum exactly. Decoding checks every size against the bytes actually present *before*
touching the payload, then (version 2) the CRC32C trailer, so a corrupted copy of a
real message is rejected as ``bad_checksum`` instead of decoding to absurd values; then
enforces ``DecodeLimits`` and rejects non-finite values; nothing is unpickled or eval'd.

Optionally a stream declares a value range (``value_range=(lo, hi)``, one bound for every
feature or one per feature): a message whose records are all finite but some lie
outside it raises ``OutOfRange`` carrying the decoded batch and a mask of the bad records,
so the caller can keep the good ones. ``widen`` builds such ranges from observed data.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass

import crc32c
import numpy as np

from edgestream.streams.errors import OutOfRange, RecordDecodeError
from edgestream.streams.records import RecordBatch

MAGIC = b"EDGS"
#: The version ``encode`` writes.
VERSION = 2
#: The versions ``decode`` reads: 1 (no trailer; old recordings) and 2.
READ_VERSIONS = (1, 2)
#: Size of the CRC32C trailer of a version-2 message.
TRAILER_SIZE = 4
_HEADER = struct.Struct("<4sBBBBIHH")
_TRAILER = struct.Struct("<I")
FLAG_LABELS = 0x01
DTYPE_CODES = {1: np.dtype("<f4")}
DTYPE_FROM_NUMPY = {np.dtype("<f4"): 1}
DEVICE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}\Z")  # \Z: "$" would also match before a final newline


@dataclass(frozen=True)
class DecodeLimits:
    """Upper bounds a message must respect; anything larger is rejected as ``too_large``."""

    max_message_bytes: int = 1 << 20
    max_records: int = 65_536
    max_features_per_record: int = 65_536
    max_ndim: int = 4
    num_classes: int | None = None  # if set, labels must lie in [0, num_classes)


DEFAULT_LIMITS = DecodeLimits()


def encode(batch: RecordBatch, *, version: int = VERSION) -> bytes:
    """Serialise a ``RecordBatch`` into one message (version 2; ``version=1`` only to
    produce old-format bytes, e.g. for compatibility tests)."""
    if version not in READ_VERSIONS:
        raise ValueError(f"cannot write format version {version}; versions: {READ_VERSIONS}")
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
        _HEADER.pack(MAGIC, version, flags, 1, len(dims), batch.count, len(device), 0),
        device,
        np.asarray(dims, dtype="<u4").tobytes(),
        np.ascontiguousarray(batch.seq, dtype="<u8").tobytes(),
        np.ascontiguousarray(batch.event_time, dtype="<f8").tobytes(),
    ]
    if batch.labels is not None:
        parts.append(np.ascontiguousarray(batch.labels, dtype="<i4").tobytes())
    parts.append(features.tobytes())
    if version >= 2:
        # Chained over the parts, so the message is assembled (copied) only once.
        crc = 0
        for part in parts:
            crc = crc32c.crc32c(part, crc)
        parts.append(_TRAILER.pack(crc))
    return b"".join(parts)


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The CRC32C of ``data``, as a version-2 trailer holds it for the bytes before it."""
    return _crc32c(memoryview(data))


def decode(
    data: bytes | bytearray | memoryview,
    limits: DecodeLimits = DEFAULT_LIMITS,
    *,
    expected_device: str | None = None,
    expected_shape: tuple[int, ...] | None = None,
    value_range: tuple[np.ndarray, np.ndarray] | None = None,
) -> RecordBatch:
    """Parse and validate one message; raise ``RecordDecodeError`` naming the problem.

    ``value_range=(lo, hi)``: float bounds broadcasting against one record's flattened
    features (shape ``()`` or ``(F,)``); finite values outside raise ``OutOfRange``.
    The returned arrays are read-only views into ``data`` (no copy).
    """
    bounds = Bounds.of(value_range)
    layout = _check_header(data, limits, expected_device, expected_shape, bounds)
    return _decode_payload(data, layout, limits, bounds)


class Decoder:
    """``decode`` for one stream (fixed limits and expectations), remembering its last header.

    The messages of a stream usually share their header bytes (device, shape, record
    count, flags). The header checks read nothing but those bytes and the message
    length, so a message with the same header bytes and length as the last one that
    passed passes them again: that message skips straight to the payload checks,
    which always run (the version-2 CRC lies in the trailer, outside the header bytes,
    so it is among them). The ingest hot path decodes through one ``Decoder`` per device.
    """

    def __init__(
        self,
        limits: DecodeLimits = DEFAULT_LIMITS,
        *,
        expected_device: str | None = None,
        expected_shape: tuple[int, ...] | None = None,
        value_range: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.limits = limits
        self.expected_device = expected_device
        self.expected_shape = tuple(expected_shape) if expected_shape is not None else None
        self.value_range = value_range
        self._bounds = Bounds.of(value_range)
        self._last: Layout | None = None

    def decode(
        self, data: bytes | bytearray | memoryview, *, timestamp_s: float | None = None,
        offset: int | None = None,
    ) -> RecordBatch:
        """Like ``decode(data, limits, expected_device=..., expected_shape=...)``. A message
        carries its own event times and sequence numbers: ``timestamp_s`` and ``offset``
        (``streams.formats.FormatDecoder``'s) are taken and ignored."""
        last = self._last
        if (
            last is not None
            and len(data) == last.size
            and isinstance(data, bytes)
            and data.startswith(last.header)
        ):
            layout = last
        else:
            layout = _check_header(data, self.limits, self.expected_device, self.expected_shape, self._bounds)
            self._last = layout
        return _decode_payload(data, layout, self.limits, self._bounds)

    @property
    def last_layout(self) -> Layout | None:
        """The layout of the last message whose header passed (what ``decode_run`` expects)."""
        return self._last

    def decode_run(self, values: list[bytes]) -> RecordBatch | None:
        """All of ``values`` as one batch (copied, in order), or None if they need one by one.

        The fast path of a stream whose consecutive messages share one header: each
        message is checked only for its length and header bytes (the last layout that
        passed every header check) and, for version 2, its own CRC; then the payload
        checks run once over the whole run. None when any message differs from that
        layout, fails its CRC or any payload check fails (a value out of range included):
        the caller then decodes the messages one by one, which names each bad one.
        """
        last = self._last
        if last is None or not values:
            return None
        size, header = last.size, last.header
        # Types, lengths and (below) CRCs through C-level maps: no Python loop per message.
        if set(map(type, values)) != _BYTES_ONLY or set(map(len, values)) != {size}:
            return None
        k, count = len(values), last.count
        joined = b"".join(values)
        rows = np.frombuffer(joined, np.uint8).reshape(k, size)
        if not (rows[:, : len(header)] == np.frombuffer(header, np.uint8)).all():
            return None
        # A message followed by the CRC32C of it (little-endian) has the CRC32C residue:
        # one call over each whole message checks its trailer, no slicing.
        if last.checksummed and set(map(_crc32c, values)) != _CRC_RESIDUE_ONLY:
            return None
        # Each column is copied out of the rows into a fresh (aligned, contiguous) array,
        # then checked there: numpy checks unaligned views far more slowly.
        pos = len(header)
        seq, pos = _column(rows, pos, (k * count,), _U8)
        event_time, pos = _column(rows, pos, (k * count,), _F8)
        labels = None
        if last.has_labels:
            labels, pos = _column(rows, pos, (k * count,), _I4)
        features, pos = _column(rows, pos, (k * count, *last.dims), last.dtype)
        if not _isfinite(event_time).all():
            return None
        bounds = self._bounds
        # With a range, its min/max check also fails on NaN or infinity (instead of isfinite).
        if not (_isfinite(features).all() if bounds is None else bounds.holds(features)):
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
    size: int  # the whole message, trailer included
    device: str
    count: int
    dims: tuple[int, ...]
    dtype: np.dtype
    has_labels: bool
    checksummed: bool  # version 2: the last TRAILER_SIZE bytes are the CRC32C of the rest


def _check_header(
    data: bytes | bytearray | memoryview,
    limits: DecodeLimits,
    expected_device: str | None,
    expected_shape: tuple[int, ...] | None,
    bounds: Bounds | None = None,
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
    if version not in READ_VERSIONS:
        raise RecordDecodeError(
            "bad_version", f"format version {version}; this reader understands {READ_VERSIONS}"
        )
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
    if bounds is not None and bounds.width is not None and per_record != bounds.width:
        raise RecordDecodeError(
            "bad_shape", f"feature shape {dims} has {per_record} values; the value range declares {bounds.width}"
        )

    has_labels = bool(flags & FLAG_LABELS)
    checksummed = version >= 2
    body = count * (8 + 8 + (4 if has_labels else 0) + dtype.itemsize * per_record)
    end = pos + body + (TRAILER_SIZE if checksummed else 0)
    if size != end:
        kind = "truncated" if size < end else "length_mismatch"
        raise RecordDecodeError(kind, f"{size} bytes, but header and shape imply {end}")
    return Layout(bytes(data[:pos]), size, device, count, dims, dtype, has_labels, checksummed)


def _decode_payload(
    data: bytes | bytearray | memoryview, layout: Layout, limits: DecodeLimits, bounds: Bounds | None
) -> RecordBatch:
    """The CRC (version 2), then the columns as views into ``data`` (sizes checked by
    ``_check_header``), checked for values."""
    # Once per Kafka message on the ingest hot path: as few numpy calls as possible (each
    # costs about a microsecond whatever the size).
    if layout.checksummed:
        _check_crc(data, layout.size)
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
    # With a range, its min/max check replaces isfinite: NaN and infinity fail it too, and
    # only then does the slow path tell non_finite (whole message) from out_of_range.
    in_range = True
    if bounds is None or not (in_range := bounds.holds(features)):
        if not _isfinite(features).all():
            bad = int(np.count_nonzero(~np.isfinite(features.reshape(count, -1)).all(axis=1)))
            raise RecordDecodeError("non_finite", f"{bad} of {count} records have NaN or infinite features")
    if labels is not None and not _labels_in_range(labels, limits):
        lo, hi = int(labels.min()), int(labels.max())
        raise RecordDecodeError("bad_label", f"labels span [{lo}, {hi}], allowed [0, {limits.num_classes})")
    batch = RecordBatch(
        device=layout.device, seq=seq, event_time=event_time, features=features, labels=labels
    )
    # Last: every whole-message check passed, so the caller may keep the good records.
    if not in_range:
        assert bounds is not None
        raise bounds.violation(batch)
    return batch


def _check_crc(data: bytes | bytearray | memoryview, size: int) -> None:
    """Raise ``bad_checksum`` unless the trailer is the CRC32C of the ``size - 4`` bytes before it."""
    end = size - TRAILER_SIZE
    stored = _TRAILER.unpack_from(data, end)[0]
    actual = _crc32c(memoryview(data)[:end])  # a view: no copy of the message
    if stored != actual:
        raise RecordDecodeError(
            "bad_checksum", f"CRC32C of the first {end} bytes is 0x{actual:08x}; the trailer says 0x{stored:08x}"
        )


def _labels_in_range(labels: np.ndarray, limits: DecodeLimits) -> bool:
    """All labels in ``[0, num_classes)`` (any non-negative int32 without a class count)."""
    # One reduction checks both bounds: read as unsigned, a negative label is >= 2**31.
    bound = limits.num_classes if limits.num_classes is not None else 1 << 31
    return int(_max(labels.view(_U4))) < bound


def widen(lo: np.ndarray | float, hi: np.ndarray | float, margin: float) -> tuple[np.ndarray, np.ndarray]:
    """``[lo, hi]`` widened by ``margin`` times its span on each side (elementwise, float64).

    For value ranges built from observed data (e.g. per-feature min/max). A zero span
    (a feature constant in the data) counts as ``1e-6 * max(|lo|, |hi|, 1)``, so that
    feature still gets a band around its value instead of an exact point.
    """
    lo64, hi64 = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(f"margin must be a finite number >= 0 (got {margin})")
    if not (np.isfinite(lo64).all() and np.isfinite(hi64).all()) or (lo64 > hi64).any():
        raise ValueError("widen needs finite bounds with lo <= hi")
    span = np.maximum(hi64 - lo64, 1e-6 * np.maximum(np.maximum(np.abs(lo64), np.abs(hi64)), 1.0))
    return lo64 - margin * span, hi64 + margin * span


_F4_MAX = float(np.finfo(np.float32).max)
#: Below this many records a per-feature range is checked by comparisons, above by reductions.
_FEW_ROWS = 256


@dataclass(frozen=True)
class Bounds:
    """A declared value range prepared for the hot path (``Bounds.of(value_range)``; every
    input format of ``streams.formats`` checks its records with it, as ``decode`` does).

    Invariant: ``lo``/``hi`` are float32, shape ``()`` (``width`` None) or ``(width,)``,
    rounded outward from the declared float64 bounds (a float32 value is in range exactly
    when it lies in the declared range, up to one float32 ulp at each bound) and clamped to
    the finite float32 range, so NaN or an infinity never passes ``holds``.
    """

    lo: np.ndarray
    hi: np.ndarray
    width: int | None

    @staticmethod
    def of(value_range: tuple[np.ndarray, np.ndarray] | None) -> Bounds | None:
        if value_range is None:
            return None
        lo, hi = value_range
        lo64, hi64 = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
        if lo64.ndim > 1 or hi64.ndim > 1:
            raise ValueError(f"value_range bounds must have shape () or (F,); got {lo64.shape}, {hi64.shape}")
        if np.isnan(lo64).any() or np.isnan(hi64).any():
            raise ValueError("value_range bounds must not be NaN")
        lo64, hi64 = np.broadcast_arrays(lo64, hi64)  # ValueError for (F,) against (G,)
        if (lo64 > hi64).any():
            raise ValueError("value_range needs lo <= hi for every feature")
        with np.errstate(over="ignore"):  # a bound beyond float32 becomes +-inf, then clamped
            lo32, hi32 = lo64.astype(np.float32), hi64.astype(np.float32)
        lo32 = np.maximum(np.where(lo32 > lo64, np.nextafter(lo32, np.float32(-np.inf)), lo32), -_F4_MAX)
        hi32 = np.minimum(np.where(hi32 < hi64, np.nextafter(hi32, np.float32(np.inf)), hi32), _F4_MAX)
        width = int(lo64.shape[0]) if lo64.ndim else None
        return Bounds(lo32.astype(np.float32), hi32.astype(np.float32), width)

    def holds(self, features: np.ndarray) -> bool:
        """Every value of ``features`` (one row per record) in ``[lo, hi]``; False for NaN."""
        # Min/max reductions, not elementwise comparisons: no temporary arrays, and NaN
        # propagates through them, so one failed comparison covers non-finite values too.
        if self.width is None:
            return bool(_min(features, axis=None) >= self.lo) and bool(_max(features, axis=None) <= self.hi)
        flat = features.reshape(len(features), self.width)
        if len(flat) < _FEW_ROWS:
            # One message: numpy pays per row in axis-0 reductions; two comparisons of the
            # whole block (False for NaN as well) are cheaper at this size.
            return bool((flat >= self.lo).all()) and bool((flat <= self.hi).all())
        return bool((_per_feature(np.minimum, flat) >= self.lo).all()) and bool(
            (_per_feature(np.maximum, flat) <= self.hi).all()
        )

    def violation(self, batch: RecordBatch) -> OutOfRange:
        """The ``OutOfRange`` of an all-finite ``batch`` that failed ``holds``: mask and diagnosis."""
        count = batch.count
        flat = batch.features.reshape(count, -1)
        bad = ((flat < self.lo) | (flat > self.hi)).any(axis=1)
        # The most extreme value is the one farthest beyond its bound (float64: no overflow).
        values = flat.astype(np.float64)
        lo = np.broadcast_to(self.lo.astype(np.float64), flat.shape[1:])
        hi = np.broadcast_to(self.hi.astype(np.float64), flat.shape[1:])
        excess = np.maximum(lo - values, values - hi)
        record, feature = (int(i) for i in np.unravel_index(int(np.argmax(excess)), excess.shape))
        value = float(values[record, feature])
        broke = f"> hi {hi[feature]:.6g}" if value > hi[feature] else f"< lo {lo[feature]:.6g}"
        dims = batch.feature_shape
        where = str(feature) if len(dims) <= 1 else str(tuple(int(i) for i in np.unravel_index(feature, dims)))
        return OutOfRange(
            f"{int(np.count_nonzero(bad))} of {count} records out of range; most extreme: "
            f"record {record} feature {where} = {value:.6g} {broke}",
            batch=batch,
            bad=bad,
        )


def _per_feature(ufunc: np.ufunc, flat: np.ndarray) -> np.ndarray:
    """``ufunc.reduce(flat, axis=0)`` for an ``(n, F)`` array, shape ``(F,)``, faster.

    numpy reduces axis 0 one row at a time (one short inner loop of F values per row).
    Folding ~sqrt(n) blocks of rows onto each other first makes that ~2*sqrt(n) long
    loops: about 3x faster for a decode_run of 2048 records of 64 features.
    """
    n, width = flat.shape
    rows = math.isqrt(n)
    if rows < 8:
        return ufunc.reduce(flat, axis=0)
    per_block = n // rows
    head = flat[: rows * per_block].reshape(rows, per_block * width)
    out = ufunc.reduce(ufunc.reduce(head, axis=0).reshape(per_block, width), axis=0)
    if rows * per_block < n:
        ufunc(out, ufunc.reduce(flat[rows * per_block :], axis=0), out=out)
    return out


_U8, _F8, _I4, _U4 = np.dtype("<u8"), np.dtype("<f8"), np.dtype("<i4"), np.dtype("<u4")
_isfinite = np.isfinite
_min = np.minimum.reduce
_max = np.maximum.reduce
_crc32c = crc32c.crc32c
#: CRC32C of any message followed by its own CRC32C as 4 little-endian bytes (a version-2
#: trailer): the CRC's residue, the same for every such message and for no other trailer.
CRC_RESIDUE = 0x48674BC7
_CRC_RESIDUE_ONLY = {CRC_RESIDUE}
_BYTES_ONLY = {bytes}


def _need(size: int, end: int, what: str) -> None:
    if size < end:
        raise RecordDecodeError("truncated", f"{size} bytes end before the {what} (need {end})")
