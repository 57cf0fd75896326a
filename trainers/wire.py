"""Versioned binary wire format of update messages (one ``UpdateMessage`` per Kafka record).

This is the ``GradientMessage`` of the gradients / models / control topics: a
:class:`trainers.messages.UpdateMessage` framed with a small JSON header around
tensor payloads in the ``compression`` wire format. Pure Python / torch, no Kafka.

Layout, all integers little-endian, version 1::

    offset  size  field
    0       4     magic  b"EDGG"
    4       1     version (1)
    5       1     flags (0; other values are rejected)
    6       2     reserved (0)
    8       4     H: header length in bytes (u32, 2..MAX_HEADER_BYTES)
    12      4     T: tensors section length (u32)
    16      4     B: float buffers section length (u32)
    20      4     O: optimizer section length (u32)
    24      4     R: integer buffers section length (u32)
    28      H     header: UTF-8 JSON object (below)
    ..      T     tensors:   compression wire message (``ESTW``), codec ``header.codec``
    ..      B     buffers:   compression wire message, dense; floating-point buffers only
    ..      O     optimizer: compression wire message, dense
    ..      R     integer buffers: raw little-endian values, C order, in header order

The record length must equal ``28 + H + T + B + O + R`` exactly. A section of
length 0 holds no tensors. The header is exactly these keys::

    {"job": str, "kind": str, "sender": str, "step": int, "base_version": int,
     "batch_size": int, "codec": str, "meta": {...},
     "tensors":   [[name, dtype, shape], ...],
     "buffers":   [[name, dtype, shape], ...],
     "optimizer": [[name, dtype, shape], ...]}

``dtype`` is a torch dtype name without the ``torch.`` prefix (``float32``,
``float16``, ``bfloat16``, ``float64``; buffers may also be ``int64``, ``int32``,
``int16``, ``int8`` or ``uint8``, which travel in the integer section) and
``shape`` a list of at most 8 dims in ``1..2**32-1``. Floating-point tensors are
restored to their declared dtype but pass through float32 on the wire (float64
loses its low bits). ``codec`` names the registered compressor every layer of
the tensors section was encoded with (``dense`` for anything sent uncompressed).

Decoding checks, before touching any payload: the record size against
``max_bytes``, magic, version, flags, every declared length against the bytes
actually present, the header length against ``MAX_HEADER_BYTES``, the JSON's
structure and types, the job, the codec, and the declared names and shapes
against the receiver's ``TensorSpec`` (which bounds every allocation). Then the
sections are decoded by ``compression.decode_tensors`` with the header's shapes
as the expected ones, and the result goes through
``trainers.validation.validate_update``. Every failure raises
:class:`MessageRejected` with a stable ``reason``; nothing is unpickled, eval'd
or ``torch.load``-ed.

Kafka headers (:func:`encode_update`'s second result) repeat a few header fields
as UTF-8 for routing, filtering and metrics without decoding the value; they are
hints only and :func:`decode_update` never trusts them.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np
import torch

from edgestream.compression import registry
from edgestream.compression.base import LayerContext
from edgestream.compression.errors import CompressionError
from edgestream.compression.pipeline import GradientCodec, decode_tensors, encode_tensors
from edgestream.trainers.errors import UpdateRejected
from edgestream.trainers.guard import gradient_norm
from edgestream.trainers.messages import MESSAGE_KINDS, UpdateMessage
from edgestream.trainers.validation import Shape, TensorSpec, validate_update

__all__ = [
    "COMPRESSED_KINDS",
    "FORMAT_TAG",
    "HEADER_BASE_VERSION",
    "HEADER_CODEC",
    "HEADER_FORMAT",
    "HEADER_JOB",
    "HEADER_KIND",
    "HEADER_SENDER",
    "HEADER_STEP",
    "HEADER_TO",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MessageEncodeError",
    "MessageRejected",
    "PREFIX_SIZE",
    "VERSION",
    "decode_update",
    "encode_update",
]

MAGIC = b"EDGG"
VERSION = 1
_PREFIX = struct.Struct("<4sBBHIIIII")
PREFIX_SIZE = _PREFIX.size  # 28
MAX_HEADER_BYTES = 64 * 1024
_U32_MAX = 0xFFFFFFFF
_MAX_NDIM = 8
_MAX_NAME_BYTES = 1024
_JOB_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HEADER_KEYS = frozenset(
    {
        "job",
        "kind",
        "sender",
        "step",
        "base_version",
        "batch_size",
        "codec",
        "meta",
        "tensors",
        "buffers",
        "optimizer",
    }
)

COMPRESSED_KINDS: frozenset[str] = frozenset({"gradient", "delta"})
"""Kinds whose ``tensors`` go through the caller's ``GradientCodec``; all others travel dense."""

_FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
_INT_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "int64": (torch.int64, np.dtype("<i8")),
    "int32": (torch.int32, np.dtype("<i4")),
    "int16": (torch.int16, np.dtype("<i2")),
    "int8": (torch.int8, np.dtype("i1")),
    "uint8": (torch.uint8, np.dtype("u1")),
}
_DTYPE_NAMES: dict[torch.dtype, str] = {
    **{dtype: name for name, dtype in _FLOAT_DTYPES.items()},
    **{dtype: name for name, (dtype, _) in _INT_DTYPES.items()},
}

# Kafka header keys (values are UTF-8; integers as decimal ASCII).
HEADER_FORMAT = "edgestream.format"
HEADER_JOB = "edgestream.job"
HEADER_KIND = "edgestream.kind"
HEADER_SENDER = "edgestream.sender"
HEADER_STEP = "edgestream.step"
HEADER_BASE_VERSION = "edgestream.base_version"
HEADER_CODEC = "edgestream.codec"
HEADER_TO = "edgestream.to"
FORMAT_TAG = f"{MAGIC.decode()}/{VERSION}".encode()

_Entry = tuple[str, str, tuple[int, ...]]


class MessageRejected(Exception):
    """An update record was rejected; it must be dead-lettered, never applied.

    ``reason`` is a short stable slug for a metric label and a DLQ header:
    framing (``truncated``, ``trailing_bytes``, ``bad_magic``, ``bad_version``,
    ``bad_header``, ``too_large``), routing (``wrong_job``, ``unknown_codec``,
    ``codec_not_allowed``), content (``payload`` for a tensor section that the
    compression decoder rejects or that disagrees with the header, ``non_finite``)
    and every :class:`trainers.errors.UpdateRejected` reason (``unknown_kind``,
    ``missing_tensor``, ``unexpected_tensor``, ``shape_mismatch``, ``bad_dtype``,
    ``bad_meta``), and ``out_of_range`` for a gradient or delta whose norm is above the
receiver's bound. ``detail`` is human-readable; ``sender`` / ``step`` are set once
    the header was readable; ``layer`` names the tensor concerned when known.
    """

    REASONS = frozenset(
        {
            "truncated",
            "trailing_bytes",
            "bad_magic",
            "bad_version",
            "bad_header",
            "too_large",
            "wrong_job",
            "unknown_codec",
            "codec_not_allowed",
            "payload",
            "out_of_range",
            *UpdateRejected.REASONS,
        }
    )

    def __init__(
        self,
        reason: str,
        detail: str,
        *,
        sender: str | None = None,
        step: int | None = None,
        layer: str | None = None,
    ) -> None:
        if reason not in self.REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        self.reason = reason
        self.detail = detail
        self.sender = sender
        self.step = step
        self.layer = layer
        where = f" (layer {layer!r})" if layer is not None else ""
        super().__init__(f"update message rejected ({reason}): {detail}{where}")


class MessageEncodeError(ValueError):
    """``encode_update`` refused a message the decoder would reject (or cannot frame).

    ``reason`` uses the same slugs as :class:`MessageRejected` where one applies
    (compression errors keep their own reason, e.g. ``non_finite``, ``dtype``).
    """

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"cannot encode update ({reason}): {detail}")


# ---------------------------------------------------------------------------- encode


def encode_update(
    msg: UpdateMessage,
    *,
    job: str,
    codec: GradientCodec | None = None,
    compress: bool = True,
    contexts: Mapping[str, LayerContext] | None = None,
    to: str | None = None,
) -> tuple[bytes, dict[str, bytes]]:
    """Serialise ``msg`` for the topics of ``job``; return ``(value, kafka_headers)``.

    ``codec`` (one per outgoing link) compresses the ``tensors`` of ``gradient``
    and ``delta`` messages, with its error feedback; ``compress=False`` makes it
    send a dense step (see ``GradientCodec.encode``). ``None``, and every other
    kind (model snapshots, activations, control), send tensors dense and leave
    the codec untouched. Buffers and optimizer slots are always dense.

    Everything that can fail is checked before the codec runs, so a refused
    message never changes the codec's residuals. ``to`` adds the recipient
    header (``Outgoing.to``). Raises :class:`MessageEncodeError`.
    """
    if not isinstance(job, str) or not _JOB_RE.match(job):
        raise MessageEncodeError("bad_header", f"job {job!r} must match [A-Za-z0-9_-]{{1,64}}")
    if msg.kind not in MESSAGE_KINDS:
        raise MessageEncodeError(
            "unknown_kind", f"kind {msg.kind!r} is not one of {sorted(MESSAGE_KINDS)}"
        )
    if not isinstance(msg.sender, str) or not msg.sender:
        raise MessageEncodeError("bad_header", "sender must be a non-empty string")
    for name in ("step", "base_version", "batch_size"):
        value = getattr(msg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise MessageEncodeError("bad_header", f"{name} must be an int >= 0, got {value!r}")
    if not isinstance(msg.meta, dict):
        raise MessageEncodeError("bad_meta", "meta must be a dict")
    if to is not None and (not isinstance(to, str) or not to):
        raise MessageEncodeError("bad_header", "to must be a non-empty string or None")

    use_codec = codec is not None and msg.kind in COMPRESSED_KINDS and bool(msg.tensors)
    codec_name = (codec.compressor.name if compress else codec.dense.name) if use_codec else "dense"

    tensor_entries = _entries(msg.tensors, "tensor", allow_int=False)
    buffer_entries = _entries(msg.buffers, "buffer", allow_int=True)
    optimizer_entries = _entries(msg.optimizer, "optimizer slot", allow_int=False)
    header = {
        "job": job,
        "kind": msg.kind,
        "sender": msg.sender,
        "step": msg.step,
        "base_version": msg.base_version,
        "batch_size": msg.batch_size,
        "codec": codec_name,
        "meta": msg.meta,
        "tensors": [[n, d, list(s)] for n, d, s in tensor_entries],
        "buffers": [[n, d, list(s)] for n, d, s in buffer_entries],
        "optimizer": [[n, d, list(s)] for n, d, s in optimizer_entries],
    }
    try:
        header_bytes = json.dumps(
            header, allow_nan=False, ensure_ascii=False, separators=(",", ":")
        ).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise MessageEncodeError("bad_meta", f"meta is not finite JSON: {exc}") from None
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise MessageEncodeError(
            "too_large", f"header is {len(header_bytes)} bytes, limit {MAX_HEADER_BYTES}"
        )

    float_buffers = {n: t for n, t in msg.buffers.items() if t.is_floating_point()}
    int_buffers = [msg.buffers[n] for n, d, _ in buffer_entries if d in _INT_DTYPES]
    try:
        buffers_section = encode_tensors(float_buffers) if float_buffers else b""
        optimizer_section = encode_tensors(msg.optimizer) if msg.optimizer else b""
        raw_section = b"".join(_raw_bytes(t) for t in int_buffers)
        if not msg.tensors:
            tensors_section = b""
        elif use_codec:
            assert codec is not None
            # Last: the codec commits its residuals once the bytes exist.
            tensors_section = codec.encode(msg.tensors, compress=compress, contexts=contexts)
        else:
            tensors_section = encode_tensors(msg.tensors)
    except CompressionError as err:
        raise MessageEncodeError(err.reason, str(err)) from None

    sections = (tensors_section, buffers_section, optimizer_section, raw_section)
    if any(len(s) > _U32_MAX for s in sections):
        raise MessageEncodeError("too_large", "a section exceeds 4 GiB")
    prefix = _PREFIX.pack(MAGIC, VERSION, 0, 0, len(header_bytes), *(len(s) for s in sections))
    value = b"".join((prefix, header_bytes, *sections))

    headers = {
        HEADER_FORMAT: FORMAT_TAG,
        HEADER_JOB: job.encode(),
        HEADER_KIND: msg.kind.encode(),
        HEADER_SENDER: msg.sender.encode("utf-8"),
        HEADER_STEP: str(msg.step).encode(),
        HEADER_BASE_VERSION: str(msg.base_version).encode(),
        HEADER_CODEC: codec_name.encode(),
    }
    if to is not None:
        headers[HEADER_TO] = to.encode("utf-8")
    return value, headers


def _entries(named: Mapping[str, torch.Tensor], what: str, *, allow_int: bool) -> list[_Entry]:
    if not isinstance(named, dict):
        raise MessageEncodeError("bad_header", f"{what}s must be a dict")
    out: list[_Entry] = []
    for name, tensor in named.items():
        if not isinstance(name, str) or not 0 < len(name.encode("utf-8")) <= _MAX_NAME_BYTES:
            raise MessageEncodeError(
                "bad_header", f"{what} name {name!r} must be 1..1024 UTF-8 bytes"
            )
        if not isinstance(tensor, torch.Tensor):
            raise MessageEncodeError("bad_dtype", f"{what} {name!r} is {type(tensor).__name__}")
        dtype = _DTYPE_NAMES.get(tensor.dtype)
        if dtype is None or (dtype in _INT_DTYPES and not allow_int):
            raise MessageEncodeError(
                "bad_dtype", f"{what} {name!r} has unsupported dtype {tensor.dtype}"
            )
        shape = tuple(int(d) for d in tensor.shape)
        if len(shape) > _MAX_NDIM or any(not 0 < d <= _U32_MAX for d in shape):
            raise MessageEncodeError(
                "shape_mismatch", f"{what} {name!r} has unsupported shape {shape}"
            )
        out.append((name, dtype, shape))
    return out


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    _, np_dtype = _INT_DTYPES[_DTYPE_NAMES[tensor.dtype]]
    arr = tensor.detach().cpu().contiguous().numpy()
    return arr.astype(np_dtype, copy=False).tobytes(order="C")


# ---------------------------------------------------------------------------- decode


def decode_update(
    value: bytes | bytearray | memoryview | None,
    *,
    expected_shapes: TensorSpec | Mapping[str, Shape] | Callable[[str], TensorSpec],
    max_bytes: int,
    allowed_codecs: Collection[str] | None = None,
    job: str | None = None,
    max_numel: int | None = None,
    max_norm: float | None = None,
    partial: bool | Callable[[str], bool] = False,
    max_abs: float | None = None,
) -> UpdateMessage:
    """Parse, bound-check and validate one record value; raise :class:`MessageRejected`.

    ``expected_shapes`` is the receiver's ``TensorSpec`` (or a plain parameter
    ``{name: shape}`` mapping, which admits no buffers). ``allowed_codecs``
    restricts the tensors section's codec (``None``: any registered one).
    ``job``, if given, must equal the header's job. ``max_numel`` bounds the
    total elements of tensors matched by wildcard (``None``) dims, e.g.
    activations (default: ``max_bytes``); all other allocations are bounded
    exactly by the spec. ``max_norm`` (if set) bounds the L2 norm of the tensors of a
    ``gradient`` or ``delta`` (finite but absurd values). The returned message has passed
    ``validate_update``. ``partial``: a parameter kind may carry a subset of the parameters.
    ``max_abs`` (if set) bounds every value of a ``model`` snapshot (parameters, buffers,
    optimizer slots), as checkpoints are bounded.
    ``expected_shapes`` and ``partial`` may also be functions of the message kind (read
    from the header), for receivers whose kinds carry different tensors.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    if value is None:
        raise MessageRejected("truncated", "record has no value (tombstone)")
    data = memoryview(value).cast("B")
    size = len(data)

    # Step 1. Fixed prefix and the declared lengths, against the bytes present.
    if size > max_bytes:
        raise MessageRejected("too_large", f"record is {size} bytes; the limit is {max_bytes}")
    if size < PREFIX_SIZE:
        raise MessageRejected(
            "truncated", f"{size} bytes is shorter than the {PREFIX_SIZE}-byte prefix"
        )
    magic, version, flags, reserved, header_len, *section_lens = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise MessageRejected("bad_magic", f"magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise MessageRejected(
            "bad_version", f"format version {version}; this reader understands {VERSION}"
        )
    if flags != 0 or reserved != 0:
        raise MessageRejected("bad_header", f"flags {flags:#x} / reserved {reserved} must be 0")
    if header_len > MAX_HEADER_BYTES:
        raise MessageRejected(
            "too_large", f"header of {header_len} bytes exceeds {MAX_HEADER_BYTES}"
        )
    if header_len < 2:
        raise MessageRejected("bad_header", f"header of {header_len} bytes cannot be a JSON object")
    total = PREFIX_SIZE + header_len + sum(section_lens)
    if total > size:
        raise MessageRejected("truncated", f"{size} bytes, but the prefix declares {total}")
    if total < size:
        raise MessageRejected("trailing_bytes", f"{size - total} bytes after the declared sections")

    # Step 2. The JSON header: bounded size (checked above), exact keys and types.
    header = _parse_header(data[PREFIX_SIZE : PREFIX_SIZE + header_len])
    sender, step = header["sender"], header["step"]

    def reject(reason: str, detail: str, layer: str | None = None) -> MessageRejected:
        return MessageRejected(reason, detail, sender=sender, step=step, layer=layer)

    if job is not None and header["job"] != job:
        raise reject("wrong_job", f"record of job {header['job']!r} on a receiver of {job!r}")
    if callable(expected_shapes):
        expected_shapes = expected_shapes(header["kind"])
    if callable(partial):
        partial = partial(header["kind"])
    spec = (
        expected_shapes
        if isinstance(expected_shapes, TensorSpec)
        else TensorSpec(parameters=dict(expected_shapes))
    )
    codec_name = header["codec"]
    if codec_name not in registry.names():
        raise reject("unknown_codec", f"codec {codec_name!r} is not registered")
    if allowed_codecs is not None and codec_name not in allowed_codecs:
        raise reject("codec_not_allowed", f"codec {codec_name!r} is not accepted here")

    # Step 3. Declared names and shapes against the spec, before any allocation.
    _check_declared(header, spec, reject, max_bytes if max_numel is None else max_numel, partial)
    tensors_len, buffers_len, optimizer_len, raw_len = section_lens
    int_entries = [e for e in header["buffers"] if e[1] in _INT_DTYPES]
    float_buffer_entries = [e for e in header["buffers"] if e[1] in _FLOAT_DTYPES]
    raw_expected = sum(math.prod(s) * _INT_DTYPES[d][1].itemsize for _, d, s in int_entries)
    if raw_expected != raw_len:
        raise reject(
            "payload", f"integer section is {raw_len} bytes, header implies {raw_expected}"
        )

    # Step 4. Sections, each decoded against the header's exact names and shapes.
    pos = PREFIX_SIZE + header_len
    bounds = []
    for length in section_lens:
        bounds.append((pos, pos + length))
        pos += length
    tensors = _decode_section(data, bounds[0], header["tensors"], codec_name, "tensors", reject)
    buffers = _decode_section(data, bounds[1], float_buffer_entries, "dense", "buffers", reject)
    optimizer = _decode_section(data, bounds[2], header["optimizer"], "dense", "optimizer", reject)
    start = bounds[3][0]
    for name, dtype, shape in int_entries:
        _, np_dtype = _INT_DTYPES[dtype]
        count = math.prod(shape)
        arr = np.frombuffer(data, dtype=np_dtype, count=count, offset=start)
        start += count * np_dtype.itemsize
        buffers[name] = torch.from_numpy(arr.astype(np_dtype.newbyteorder("="))).reshape(shape)
    # Keep the sender's buffer order (float and integer buffers interleaved).
    buffers = {name: buffers[name] for name, _, _ in header["buffers"]}

    msg = UpdateMessage(
        kind=header["kind"],
        sender=sender,
        step=step,
        base_version=header["base_version"],
        batch_size=header["batch_size"],
        tensors=tensors,
        buffers=buffers,
        optimizer=optimizer,
        meta=header["meta"],
    )
    # Step 5. The same gate every strategy input passes (finiteness, meta, dtypes).
    try:
        validate_update(msg, spec, partial=partial)
    except UpdateRejected as err:
        raise reject(err.reason, err.detail) from None
    # Step 6. A finite but absurd update (the step guard's bound, applied on receipt).
    if max_norm and msg.kind in ("gradient", "delta"):
        norm = gradient_norm(msg.tensors)
        if not norm <= max_norm:
            raise reject("out_of_range", f"{msg.kind} norm {norm:.4g} exceeds the bound {max_norm:g}")
    if max_abs and msg.kind == "model":
        for part, named in (("tensor", msg.tensors), ("buffer", msg.buffers), ("optimizer slot", msg.optimizer)):
            for name, tensor in named.items():
                if tensor.is_floating_point() and tensor.numel() and float(tensor.abs().max()) > max_abs:
                    raise reject("out_of_range", f"model {part} {name!r} holds a value above the bound {max_abs:g}",
                                 layer=name)
    return msg


def _parse_header(raw: memoryview) -> dict[str, Any]:
    def bad(detail: str) -> MessageRejected:
        return MessageRejected("bad_header", detail)

    def no_constants(token: str) -> Any:
        raise ValueError(f"non-finite number {token}")

    try:
        header = json.loads(bytes(raw).decode("utf-8"), parse_constant=no_constants)
    except UnicodeDecodeError as exc:
        raise bad(f"header is not UTF-8: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise bad(f"header is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(header, dict):
        raise bad(f"header is a JSON {type(header).__name__}, not an object")
    keys = set(header)
    if keys != _HEADER_KEYS:
        raise bad(
            f"header keys differ: missing {sorted(_HEADER_KEYS - keys)}, "
            f"unknown {sorted(keys - _HEADER_KEYS)[:10]}"
        )
    sender, step = header["sender"], header["step"]
    if not isinstance(sender, str) or not sender:
        raise bad("sender must be a non-empty string")
    kind = header["kind"]
    if not isinstance(kind, str) or kind not in MESSAGE_KINDS:
        raise MessageRejected(
            "unknown_kind",
            f"kind {str(kind)[:64]!r} is not one of {sorted(MESSAGE_KINDS)}",
            sender=sender,
            step=step if _is_count(step) else None,
        )
    for name in ("step", "base_version", "batch_size"):
        if not _is_count(header[name]):
            raise MessageRejected(
                "bad_header",
                f"{name} must be an int >= 0, got {str(header[name])[:64]}",
                sender=sender,
            )
    for name in ("job", "codec"):
        if not isinstance(header[name], str):
            raise MessageRejected(
                "bad_header", f"{name} must be a string", sender=sender, step=step
            )
    if not isinstance(header["meta"], dict):
        raise MessageRejected("bad_header", "meta must be a JSON object", sender=sender, step=step)
    for section in ("tensors", "buffers", "optimizer"):
        header[section] = _parse_entries(header[section], section, sender, step)
    return header


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_entries(raw: object, section: str, sender: str, step: int) -> list[_Entry]:
    def bad(detail: str) -> MessageRejected:
        return MessageRejected("bad_header", f"{section}: {detail}", sender=sender, step=step)

    allowed = (*_FLOAT_DTYPES, *_INT_DTYPES) if section == "buffers" else tuple(_FLOAT_DTYPES)
    if not isinstance(raw, list):
        raise bad("must be a list of [name, dtype, shape]")
    out: list[_Entry] = []
    seen: set[str] = set()
    for entry in raw:
        if not isinstance(entry, list) or len(entry) != 3:
            raise bad("each entry must be [name, dtype, shape]")
        name, dtype, shape = entry
        if not isinstance(name, str) or not 0 < len(name.encode("utf-8")) <= _MAX_NAME_BYTES:
            raise bad("names must be 1..1024 UTF-8 bytes")
        if name in seen:
            raise bad(f"{name!r} appears twice")
        seen.add(name)
        if dtype not in allowed:
            raise bad(f"{name!r} has dtype {str(dtype)[:32]!r}, allowed {list(allowed)}")
        if (
            not isinstance(shape, list)
            or len(shape) > _MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
            or not all(0 < d <= _U32_MAX for d in shape)
        ):
            raise bad(f"{name!r} shape must be <= {_MAX_NDIM} dims in 1..2**32-1")
        out.append((name, dtype, tuple(shape)))
    return out


def _shape_ok(declared: tuple[int, ...], want: Shape) -> bool:
    return len(declared) == len(want) and all(
        w is None or w == d for w, d in zip(want, declared, strict=True)
    )


def _check_declared(header: dict[str, Any], spec: TensorSpec, reject: Any, max_numel: int,
                    partial: bool = False) -> None:
    """``validate_update``'s name/shape rules applied to the header's declarations, before
    anything is allocated (so a header declaring huge tensors costs nothing); the decoded
    message then passes ``validate_update`` itself (values, dtypes, meta)."""
    kind = header["kind"]
    tensors, buffers, optimizer = header["tensors"], header["buffers"], header["optimizer"]
    if kind == "control":
        if tensors or buffers or optimizer:
            raise reject("unexpected_tensor", "control messages carry no tensors")
        return
    wildcard_numel = 0

    def check_shape(label: str, declared: tuple[int, ...], want: Shape) -> None:
        nonlocal wildcard_numel
        if not _shape_ok(declared, want):
            raise reject(
                "shape_mismatch", f"{label} declares shape {declared}, expected {tuple(want)}"
            )
        if any(w is None for w in want):
            wildcard_numel += math.prod(declared)
            if wildcard_numel > max_numel:
                raise reject(
                    "too_large",
                    f"declared shapes total {wildcard_numel} elements, limit {max_numel}",
                )

    names = {name for name, _, _ in tensors}
    missing = sorted(spec.parameters.keys() - names)
    if missing and not partial:
        raise reject("missing_tensor", f"missing tensors {missing[:10]}")
    extra = sorted(names - spec.parameters.keys())
    if extra:
        raise reject("unexpected_tensor", f"unexpected tensors {extra[:10]}")
    for name, _, shape in tensors:
        check_shape(f"tensor {name!r}", shape, spec.parameters[name])
    for name, dtype, shape in buffers:
        if name not in spec.buffers:
            raise reject("unexpected_tensor", f"unknown buffer {name!r}")
        want_shape, want_dtype = spec.buffers[name]
        check_shape(f"buffer {name!r}", shape, want_shape)
        if (dtype in _FLOAT_DTYPES) != want_dtype.is_floating_point:
            raise reject("bad_dtype", f"buffer {name!r} declares {dtype}, model has {want_dtype}")
        if kind != "model" and dtype not in _FLOAT_DTYPES:
            raise reject("bad_dtype", f"buffer delta {name!r} must be floating point")
    if optimizer and kind != "model":
        raise reject("unexpected_tensor", "optimizer slots are only accepted on model snapshots")
    for name, _, shape in optimizer:
        if name not in spec.parameters:
            raise reject("unexpected_tensor", f"optimizer slot for unknown parameter {name!r}")
        check_shape(f"optimizer slot {name!r}", shape, spec.parameters[name])


def _decode_section(
    data: memoryview,
    bounds: tuple[int, int],
    entries: list[_Entry],
    codec_name: str,
    section: str,
    reject: Any,
) -> dict[str, torch.Tensor]:
    start, end = bounds
    if start == end:
        if entries:
            raise reject(
                "payload", f"{section} section is empty but the header lists {len(entries)}"
            )
        return {}
    if not entries:
        raise reject(
            "payload", f"{section} section has {end - start} bytes but the header lists none"
        )
    expected = {name: shape for name, _, shape in entries}
    try:
        out = decode_tensors(
            data[start:end],
            expected,
            max_bytes=end - start,
            allowed_codecs=(codec_name,),
        )
    except CompressionError as err:
        reason = err.reason if err.reason in ("non_finite", "too_large") else "payload"
        raise reject(reason, f"{section} section: {err}", err.layer) from None
    for name, dtype, _ in entries:
        if out[name].dtype != _FLOAT_DTYPES[dtype]:
            raise reject(
                "payload",
                f"{section} section restores {out[name].dtype}, header says {dtype}",
                name,
            )
    # The header's order, which is the sender's.
    return {name: out[name] for name, _, _ in entries}
