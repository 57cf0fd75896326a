"""The versioned binary wire format of compressed tensors (no pickle, no torch.load).

Layout, all integers little-endian::

    message   = header layer*
    header    = magic "ESTW" (4) | version u8 (=1) | flags u8 (=0) | n_layers u16
                | body_len u32 (bytes after the header)
    layer     = name_len u16 | name (utf-8) | codec_id u16 | dtype u8 | ndim u8
                | n_parts u8 | reserved u8 (=0) | shape: ndim x u32 | part*
    part      = dtype u8 | numel u32 | numel * itemsize raw little-endian bytes

``dtype`` of a layer is the dtype the dense tensor is restored to; a part's dtype
describes its own raw bytes. What the parts mean is the codec's business
(``Compressor.decompress`` validates that); this module validates the structure:
magic, version, reserved fields, every length against ``len(data)`` *before* any
allocation, the total dense size against ``max_numel``, dtype codes, UTF-8 names,
duplicates, expected names and shapes, and that every float part is finite.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from edgestream.compression import errors
from edgestream.compression.errors import CompressionError, PayloadDecodeError

MAGIC = b"ESTW"
VERSION = 1
MAX_NDIM = 8
MAX_PARTS = 8
MAX_NAME_BYTES = 1024
# Defaults sized for gradients of edge models; callers pass tighter limits when
# they know the model (expected shapes bound the allocation exactly).
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_NUMEL = 64 * 1024 * 1024

_HEADER = struct.Struct("<4sBBHI")
_NAME_LEN = struct.Struct("<H")
_LAYER_FIXED = struct.Struct("<HBBBB")
_DIM = struct.Struct("<I")
_PART = struct.Struct("<BI")

MESSAGE_HEADER_SIZE = _HEADER.size

# Wire dtype codes. Never renumber: they are in every stored and in-flight message.
_TORCH_TO_CODE: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.int16: 7,
    torch.uint16: 8,
    torch.int32: 9,
    torch.int64: 10,
}
_CODE_TO_TORCH = {code: dtype for dtype, code in _TORCH_TO_CODE.items()}
# bfloat16 has no numpy dtype: it travels as its raw 16-bit pattern.
_CODE_TO_NUMPY: dict[int, np.dtype] = {
    1: np.dtype("<f4"),
    2: np.dtype("<f2"),
    3: np.dtype("<u2"),
    4: np.dtype("<f8"),
    5: np.dtype("u1"),
    6: np.dtype("i1"),
    7: np.dtype("<i2"),
    8: np.dtype("<u2"),
    9: np.dtype("<i4"),
    10: np.dtype("<i8"),
}
FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
_FLOAT_CODES = frozenset(_TORCH_TO_CODE[d] for d in FLOAT_DTYPES)
_BF16_CODE = _TORCH_TO_CODE[torch.bfloat16]


@dataclass(frozen=True, eq=False)
class Compressed:
    """One layer in compressed form: what a codec produced and the wire carries.

    Invariant: every part is a contiguous 1-D CPU tensor of a wire dtype, and
    ``shape``/``dtype`` describe the dense tensor that ``decompress`` restores.
    """

    codec_id: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[torch.Tensor, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def payload_nbytes(self) -> int:
        """Bytes of raw part data, excluding framing."""
        return sum(part.numel() * part.element_size() for part in self.parts)


@dataclass(frozen=True)
class PartLayout:
    """Where one part's raw bytes sit inside a message."""

    dtype: torch.dtype
    offset: int
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * _CODE_TO_NUMPY[_TORCH_TO_CODE[self.dtype]].itemsize


@dataclass(frozen=True)
class LayerLayout:
    """A parsed layer frame: header fields plus the byte ranges of its parts."""

    name: str
    codec_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    parts: tuple[PartLayout, ...]
    offset: int


def dtype_itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of a wire dtype."""
    return _CODE_TO_NUMPY[_wire_code(dtype)].itemsize


def frame_size(name: str, ndim: int, part_nbytes: Sequence[int]) -> int:
    """Exact bytes of one layer frame with parts of the given raw sizes."""
    fixed = _NAME_LEN.size + len(name.encode("utf-8")) + _LAYER_FIXED.size
    return fixed + ndim * _DIM.size + len(part_nbytes) * _PART.size + sum(part_nbytes)


def encoded_size(layers: Mapping[str, Compressed]) -> int:
    """Exact length of ``encode_layers(layers)`` without building it."""
    return MESSAGE_HEADER_SIZE + sum(
        frame_size(name, len(c.shape), [p.numel() * p.element_size() for p in c.parts])
        for name, c in layers.items()
    )


def _wire_code(dtype: torch.dtype) -> int:
    try:
        return _TORCH_TO_CODE[dtype]
    except KeyError:
        raise CompressionError(errors.DTYPE, f"dtype {dtype} has no wire encoding") from None


def _part_array(part: torch.Tensor) -> np.ndarray:
    """A little-endian numpy view (copy only on big-endian hosts) of a part."""
    flat = part.detach().cpu().contiguous().reshape(-1)
    if flat.dtype == torch.bfloat16:
        arr = flat.view(torch.int16).numpy().view(np.uint16)
    else:
        arr = flat.numpy()
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False)


def all_finite(arr: np.ndarray, bfloat16: bool = False) -> bool:
    """True when a float array (or the raw uint16 bits of a bfloat16 one) holds no NaN or inf."""
    if arr.size == 0:
        return True
    if bfloat16 or arr.dtype.kind == "f" and arr.dtype.itemsize == 2:
        # Exponent bits all ones means inf or NaN; numpy's isfinite on float16 is
        # several times slower than this integer test.
        limit = 0x7F80 if bfloat16 else 0x7C00
        # Keep the array's byte order ("<" from the wire, native from torch).
        bits = arr.view(np.dtype(arr.dtype.str[0] + "u2"))
        return int((bits & np.uint16(0x7FFF)).max()) < limit
    return bool(np.isfinite(arr).all())


def _all_finite(arr: np.ndarray, code: int) -> bool:
    return all_finite(arr, bfloat16=code == _BF16_CODE)


def encode_layers(layers: Mapping[str, Compressed]) -> bytes:
    """Serialise compressed layers into one message.

    Raises ``CompressionError`` for anything the decoder would reject (so a
    sender finds out, not the receiver): bad names, shapes, dtypes or
    non-finite float parts.
    """
    if len(layers) > 0xFFFF:
        raise CompressionError(errors.TOO_LARGE, f"{len(layers)} layers exceed 65535")
    chunks: list[bytes | memoryview] = []
    body_len = 0
    for name, comp in layers.items():
        name_bytes = name.encode("utf-8")
        if not name_bytes or len(name_bytes) > MAX_NAME_BYTES:
            raise CompressionError(errors.BAD_NAME, "layer name must be 1..1024 UTF-8 bytes")
        if comp.dtype not in FLOAT_DTYPES:
            raise CompressionError(
                errors.DTYPE, f"dense dtype {comp.dtype} is not a float dtype", layer=name
            )
        if len(comp.shape) > MAX_NDIM or any(not 0 < d <= 0xFFFFFFFF for d in comp.shape):
            raise CompressionError(
                errors.SHAPE_MISMATCH, f"unsupported shape {comp.shape}", layer=name
            )
        if len(comp.parts) > MAX_PARTS or not 0 < comp.codec_id <= 0xFFFF:
            raise CompressionError(errors.BAD_HEADER, "too many parts or bad codec id", layer=name)
        head = [
            _NAME_LEN.pack(len(name_bytes)),
            name_bytes,
            _LAYER_FIXED.pack(
                comp.codec_id, _wire_code(comp.dtype), len(comp.shape), len(comp.parts), 0
            ),
            *(_DIM.pack(d) for d in comp.shape),
        ]
        chunks.extend(head)
        body_len += sum(len(h) for h in head)
        for part in comp.parts:
            code = _wire_code(part.dtype)
            arr = _part_array(part)
            if arr.size > 0xFFFFFFFF:
                raise CompressionError(errors.TOO_LARGE, "part exceeds 2**32 elements", layer=name)
            if code in _FLOAT_CODES and not _all_finite(arr, code):
                raise CompressionError(
                    errors.NON_FINITE, "refusing to send NaN/inf values", layer=name
                )
            chunks.append(_PART.pack(code, arr.size))
            chunks.append(memoryview(arr).cast("B"))
            body_len += _PART.size + arr.nbytes
    if body_len > 0xFFFFFFFF:
        raise CompressionError(errors.TOO_LARGE, "message exceeds 4 GiB")
    chunks.insert(0, _HEADER.pack(MAGIC, VERSION, 0, len(layers), body_len))
    return b"".join(chunks)


class _Reader:
    """Bounds-checked cursor: every read is checked against the real buffer length."""

    def __init__(self, data: bytes | bytearray | memoryview, offset: int) -> None:
        self.data = data
        self.offset = offset
        self.end = len(data)

    def take(self, nbytes: int, what: str) -> int:
        start = self.offset
        if nbytes > self.end - start:
            raise PayloadDecodeError(
                errors.TRUNCATED,
                f"{what} needs {nbytes} bytes at offset {start}, {self.end - start} left",
            )
        self.offset = start + nbytes
        return start

    def unpack(self, fmt: struct.Struct, what: str) -> tuple[int, ...]:
        start = self.take(fmt.size, what)
        return fmt.unpack_from(self.data, start)


def parse_layout(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_numel: int = DEFAULT_MAX_NUMEL,
) -> list[LayerLayout]:
    """Validate a message's structure and return where everything is; copies nothing.

    ``max_numel`` bounds the total dense elements of all layers together, so a
    hostile header cannot make a receiver allocate more than the caller allows.
    """
    if len(data) > max_bytes:
        raise PayloadDecodeError(
            errors.TOO_LARGE, f"message of {len(data)} bytes exceeds max_bytes={max_bytes}"
        )
    reader = _Reader(data, 0)
    magic, version, flags, n_layers, body_len = reader.unpack(_HEADER, "message header")
    if magic != MAGIC:
        raise PayloadDecodeError(
            errors.BAD_MAGIC, f"expected magic {MAGIC!r}, got {bytes(magic)!r}"
        )
    if version != VERSION:
        raise PayloadDecodeError(
            errors.BAD_VERSION, f"wire version {version} is not supported (want {VERSION})"
        )
    if flags != 0:
        raise PayloadDecodeError(errors.BAD_HEADER, f"reserved flags are {flags:#x}, must be 0")
    actual_body = len(data) - MESSAGE_HEADER_SIZE
    if body_len > actual_body:
        raise PayloadDecodeError(
            errors.TRUNCATED, f"header declares {body_len} body bytes, {actual_body} present"
        )
    if body_len < actual_body:
        raise PayloadDecodeError(
            errors.TRAILING_BYTES, f"{actual_body - body_len} bytes after the declared body"
        )

    layouts: list[LayerLayout] = []
    seen: set[str] = set()
    total_numel = 0
    for _ in range(n_layers):
        layer_offset = reader.offset
        (name_len,) = reader.unpack(_NAME_LEN, "layer name length")
        if not 0 < name_len <= MAX_NAME_BYTES:
            raise PayloadDecodeError(
                errors.BAD_NAME, f"layer name length {name_len} not in 1..{MAX_NAME_BYTES}"
            )
        start = reader.take(name_len, "layer name")
        try:
            name = bytes(data[start : start + name_len]).decode("utf-8")
        except UnicodeDecodeError:
            raise PayloadDecodeError(
                errors.BAD_NAME, f"layer name at offset {start} is not UTF-8"
            ) from None
        if name in seen:
            raise PayloadDecodeError(errors.DUPLICATE_LAYER, "layer appears twice", layer=name)
        seen.add(name)
        codec_id, dtype_code, ndim, n_parts, reserved = reader.unpack(_LAYER_FIXED, "layer header")
        if reserved != 0 or ndim > MAX_NDIM or n_parts > MAX_PARTS:
            raise PayloadDecodeError(
                errors.BAD_HEADER,
                f"reserved={reserved} ndim={ndim} n_parts={n_parts} out of bounds",
                layer=name,
            )
        dense_dtype = _CODE_TO_TORCH.get(dtype_code)
        if dense_dtype not in FLOAT_DTYPES:
            raise PayloadDecodeError(
                errors.DTYPE, f"dense dtype code {dtype_code} is not a float dtype", layer=name
            )
        shape = tuple(reader.unpack(_DIM, "shape")[0] for _ in range(ndim))
        numel = math.prod(shape)
        if numel == 0:
            raise PayloadDecodeError(errors.SHAPE_MISMATCH, f"empty shape {shape}", layer=name)
        total_numel += numel
        if total_numel > max_numel:
            raise PayloadDecodeError(
                errors.TOO_LARGE,
                f"dense size {total_numel} elements exceeds max_numel={max_numel}",
                layer=name,
            )
        parts = []
        for _ in range(n_parts):
            code, part_numel = reader.unpack(_PART, "part header")
            np_dtype = _CODE_TO_NUMPY.get(code)
            if np_dtype is None:
                raise PayloadDecodeError(
                    errors.DTYPE, f"unknown part dtype code {code}", layer=name
                )
            # Python ints: the product cannot overflow, and take() compares it
            # with the bytes actually present before anything is allocated.
            offset = reader.take(part_numel * np_dtype.itemsize, "part data")
            parts.append(PartLayout(_CODE_TO_TORCH[code], offset, part_numel))
        layouts.append(LayerLayout(name, codec_id, dense_dtype, shape, tuple(parts), layer_offset))
    if reader.offset != len(data):
        raise PayloadDecodeError(
            errors.TRAILING_BYTES, f"{len(data) - reader.offset} bytes after the last layer"
        )
    return layouts


def _materialise(
    data: bytes | bytearray | memoryview, part: PartLayout, layer: str
) -> torch.Tensor:
    code = _TORCH_TO_CODE[part.dtype]
    if part.numel == 0:
        return torch.empty(0, dtype=part.dtype)
    raw = np.frombuffer(data, dtype=_CODE_TO_NUMPY[code], count=part.numel, offset=part.offset)
    if code in _FLOAT_CODES and not _all_finite(raw, code):
        raise PayloadDecodeError(errors.NON_FINITE, "float part holds NaN or inf", layer=layer)
    # Copy: the result must not alias a buffer the caller may reuse, and numpy
    # gives us native byte order and alignment in the same step.
    arr = raw.astype(raw.dtype.newbyteorder("="), copy=True)
    if code == _BF16_CODE:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def decode_layers(
    data: bytes | bytearray | memoryview,
    expected: Mapping[str, Sequence[int]] | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_numel: int = DEFAULT_MAX_NUMEL,
) -> dict[str, Compressed]:
    """Parse and validate a message into compressed layers (still compressed).

    With ``expected``, the message must hold exactly those layer names with
    exactly those shapes; this is checked before any part is copied.
    """
    layouts = parse_layout(data, max_bytes=max_bytes, max_numel=max_numel)
    if expected is not None:
        names = {layout.name for layout in layouts}
        missing = [name for name in expected if name not in names]
        if missing:
            raise PayloadDecodeError(
                errors.MISSING_LAYER, f"layers {missing[:5]} missing", layer=missing[0]
            )
        for layout in layouts:
            if layout.name not in expected:
                raise PayloadDecodeError(
                    errors.UNEXPECTED_LAYER, "layer not expected", layer=layout.name
                )
            want = tuple(int(d) for d in expected[layout.name])
            if layout.shape != want:
                raise PayloadDecodeError(
                    errors.SHAPE_MISMATCH,
                    f"shape {layout.shape} but expected {want}",
                    layer=layout.name,
                )
    return {
        layout.name: Compressed(
            codec_id=layout.codec_id,
            shape=layout.shape,
            dtype=layout.dtype,
            parts=tuple(_materialise(data, part, layout.name) for part in layout.parts),
        )
        for layout in layouts
    }
