"""Recording file format: Kafka messages written to disk per topic, read back merged.

A recording is a directory holding one ``<topic>.esrec`` file per topic plus a
``manifest.json`` written when the writer is closed. The byte layout, the manifest
fields and the error behaviour are documented in ``docs/recording-format.md``; the
short version, all integers little-endian, format version 1::

    file   = header frame*
    header = magic b"ESRC" | version u16 | flags u16 (0) | topic_len u16
             | topic (ASCII) | header_crc u32 (CRC32 of the preceding header bytes)
    frame  = body_len u32 | body_crc u32 (CRC32 of body) | body
    body   = partition i32 | offset i64 | timestamp_ms i64 | key_len i32 (-1 = None)
             | value_len u32 | header_count u16 | key | value
             | header_count * (name_len u16 | value_len u32 | name UTF-8 | value)

Everything is streamed: the writer appends one frame per message (flushing every
``flush_bytes``) and hashes as it writes; the reader decodes one frame at a time and
``merged()`` is a ``heapq.merge`` over per-topic generators. Declared lengths are
checked against a limit and against the bytes actually present before anything is
allocated. Nothing is unpickled or eval'd; only the standard library is used.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
import re
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgestream.streams.errors import StreamsError

MAGIC = b"ESRC"
VERSION = 1
SUPPORTED_VERSIONS = (1,)
FORMAT_NAME = "edgestream-recording"
FILE_SUFFIX = ".esrec"
MANIFEST_NAME = "manifest.json"
MAX_FRAME_BYTES = 64 * 1024 * 1024
DEFAULT_FLUSH_BYTES = 1 << 20

_HEADER_FIXED = struct.Struct("<4sHHH")  # magic, version, flags, topic_len
_U32 = struct.Struct("<I")
_FRAME_HEAD = struct.Struct("<II")  # body_len, body_crc
_BODY_FIXED = struct.Struct("<iqqiIH")  # partition, offset, ts, key_len, value_len, n_headers
_HDR_ITEM = struct.Struct("<HI")  # name_len, value_len
_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_HASH_CHUNK = 1 << 20
_ENTRY_TIMESTAMPS = ("first_timestamp_ms", "last_timestamp_ms", "min_timestamp_ms", "max_timestamp_ms")


# --------------------------------------------------------------------------- errors


class RecordingError(StreamsError):
    """Base class of every recording error."""


class RecordingCorrupt(RecordingError):
    """A recording file is truncated or corrupt at byte ``position`` of ``path``.

    ``position`` is where the first bad header or frame starts, which is also the
    length of the intact prefix of the file (everything before it decoded cleanly).
    """

    def __init__(self, path: str | os.PathLike[str], position: int, reason: str) -> None:
        self.path = Path(path)
        self.position = position
        self.reason = reason
        super().__init__(f"{self.path}: corrupt recording at byte {position}: {reason}")


class RecordingVersionError(RecordingError):
    """A file or manifest declares a format version this code cannot read."""

    def __init__(self, path: str | os.PathLike[str], version: object) -> None:
        self.path = Path(path)
        self.version = version
        super().__init__(
            f"{self.path}: recording format version {version!r} is not supported "
            f"(this edgestream reads versions {', '.join(map(str, SUPPORTED_VERSIONS))})"
        )


class ManifestError(RecordingError):
    """The manifest is missing or malformed, or the directory is not a recording."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


# --------------------------------------------------------------- replay speed

#: Speed value meaning "as fast as the producer goes".
MAX_SPEED = math.inf


class ReplayError(StreamsError):
    """The replay cannot proceed (bad option, destination topic mismatch, send failure)."""


def parse_speed(text: str | float) -> float:
    """``"1"``, ``"2.5"``, ``"10x"`` or ``"max"`` -> a positive speed factor (``inf`` for max)."""
    if isinstance(text, (int, float)):
        speed = float(text)
    else:
        raw = text.strip().lower()
        if raw in ("max", "inf", "fastest"):
            return MAX_SPEED
        try:
            speed = float(raw[:-1] if raw.endswith("x") else raw)
        except ValueError:
            raise ReplayError(f"speed {text!r} is not a number or 'max' (e.g. 1, 2.5, 10x, max)") from None
    if not speed > 0:
        raise ReplayError(f"speed must be > 0 (or 'max'), got {text!r}")
    return speed


# ------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class RecordedMessage:
    """One Kafka message as recorded: where it was, when, and its exact bytes."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.headers, tuple) or any(
            not isinstance(h, tuple) for h in self.headers
        ):
            object.__setattr__(self, "headers", tuple(tuple(h) for h in self.headers))

    @property
    def sort_key(self) -> tuple[int, str, int, int]:
        """``(timestamp_ms, topic, partition, offset)``: the replay order."""
        return (self.timestamp_ms, self.topic, self.partition, self.offset)


def check_topic(topic: str) -> str:
    """A Kafka-legal topic name (also safe as a file name), or ``ValueError``."""
    if not isinstance(topic, str) or not _TOPIC_RE.match(topic) or topic in (".", ".."):
        raise ValueError(
            f"invalid topic name {topic!r}: Kafka topics use [A-Za-z0-9._-], 1-249 chars"
        )
    return topic


def topic_file_name(topic: str) -> str:
    return check_topic(topic) + FILE_SUFFIX


def encode_header(topic: str) -> bytes:
    name = check_topic(topic).encode("ascii")
    head = _HEADER_FIXED.pack(MAGIC, VERSION, 0, len(name)) + name
    return head + _U32.pack(zlib.crc32(head))


def encode_body(msg: RecordedMessage) -> bytes:
    """The frame body of ``msg`` (topic excluded: it is in the file header)."""
    if isinstance(msg.partition, bool) or not isinstance(msg.partition, int):
        raise TypeError(f"partition must be an int, got {type(msg.partition).__name__}")
    if not 0 <= msg.partition < (1 << 31):
        raise ValueError(f"partition {msg.partition} out of range [0, 2**31)")
    for name in ("offset", "timestamp_ms"):
        v = getattr(msg, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if not _I64_MIN <= v <= _I64_MAX:
            raise ValueError(f"{name} {v} does not fit in a signed 64-bit integer")
    if msg.offset < 0:
        raise ValueError(f"offset {msg.offset} is negative")
    if msg.key is not None and not isinstance(msg.key, bytes):
        raise TypeError(f"key must be bytes or None, got {type(msg.key).__name__}")
    if not isinstance(msg.value, bytes):
        raise TypeError(f"value must be bytes, got {type(msg.value).__name__}")
    if len(msg.headers) > 0xFFFF:
        raise ValueError(f"{len(msg.headers)} headers; at most 65535 are supported")
    key = msg.key if msg.key is not None else b""
    parts = [
        _BODY_FIXED.pack(
            msg.partition,
            msg.offset,
            msg.timestamp_ms,
            -1 if msg.key is None else len(key),
            len(msg.value),
            len(msg.headers),
        ),
        key,
        msg.value,
    ]
    for item in msg.headers:
        if len(item) != 2:
            raise ValueError(f"a header is a (name, value) pair, got {item!r}")
        hname, hvalue = item
        if not isinstance(hname, str):
            raise TypeError(f"header name must be str, got {type(hname).__name__}")
        if not isinstance(hvalue, bytes):
            raise TypeError(f"header {hname!r} value must be bytes, got {type(hvalue).__name__}")
        raw = hname.encode("utf-8")
        if len(raw) > 0xFFFF:
            raise ValueError(f"header name of {len(raw)} bytes; at most 65535 are supported")
        parts += [_HDR_ITEM.pack(len(raw), len(hvalue)), raw, hvalue]
    return b"".join(parts)


def encode_frame(body: bytes) -> bytes:
    return _FRAME_HEAD.pack(len(body), zlib.crc32(body)) + body


def decode_body(topic: str, body: bytes) -> RecordedMessage:
    """Inverse of ``encode_body``; ``ValueError`` says what is malformed."""
    if len(body) < _BODY_FIXED.size:
        raise ValueError(
            f"body of {len(body)} bytes is shorter than its {_BODY_FIXED.size}-byte fixed part"
        )
    partition, offset, ts, key_len, value_len, n_headers = _BODY_FIXED.unpack_from(body, 0)
    pos = _BODY_FIXED.size
    if partition < 0 or offset < 0 or key_len < -1:
        raise ValueError(f"negative partition/offset/key length ({partition}, {offset}, {key_len})")

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if n > len(body) - pos:
            raise ValueError(f"{what} of {n} bytes overruns the body ({len(body) - pos} left)")
        out = body[pos : pos + n]
        pos += n
        return out

    key = None if key_len == -1 else take(key_len, "key")
    value = take(value_len, "value")
    headers = []
    for i in range(n_headers):
        name_len, hv_len = _HDR_ITEM.unpack(take(_HDR_ITEM.size, f"header {i} lengths"))
        try:
            name = take(name_len, f"header {i} name").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"header {i} name is not UTF-8: {exc}") from None
        headers.append((name, take(hv_len, f"header {i} value")))
    if pos != len(body):
        raise ValueError(f"{len(body) - pos} trailing bytes after the last field of the body")
    return RecordedMessage(topic, partition, offset, ts, key, value, tuple(headers))


# ----------------------------------------------------------------------- statistics


@dataclass
class _TopicStats:
    """Counts and ranges of one topic file, kept incrementally (O(partitions) memory)."""

    messages: int = 0
    first_ts: int | None = None
    last_ts: int | None = None
    min_ts: int | None = None
    max_ts: int | None = None
    ordered: bool = True
    last_key: tuple[int, int, int] | None = None
    partitions: dict[int, list[int]] = field(default_factory=dict)  # p -> [n, min, max]

    def add(self, msg: RecordedMessage) -> None:
        ts = msg.timestamp_ms
        self.messages += 1
        if self.first_ts is None:
            self.first_ts = ts
        self.last_ts = ts
        self.min_ts = ts if self.min_ts is None else min(self.min_ts, ts)
        self.max_ts = ts if self.max_ts is None else max(self.max_ts, ts)
        key = (ts, msg.partition, msg.offset)
        if self.last_key is not None and key < self.last_key:
            self.ordered = False
        self.last_key = key
        p = self.partitions.get(msg.partition)
        if p is None:
            self.partitions[msg.partition] = [1, msg.offset, msg.offset]
        else:
            p[0] += 1
            p[1] = min(p[1], msg.offset)
            p[2] = max(p[2], msg.offset)

    def to_dict(self) -> dict[str, Any]:
        return {
            "messages": self.messages,
            "first_timestamp_ms": self.first_ts,
            "last_timestamp_ms": self.last_ts,
            "min_timestamp_ms": self.min_ts,
            "max_timestamp_ms": self.max_ts,
            "ordered": self.ordered,
            "partitions": {
                str(p): {"messages": n, "min_offset": lo, "max_offset": hi}
                for p, (n, lo, hi) in sorted(self.partitions.items())
            },
        }


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- writer


class _TopicFile:
    def __init__(self, path: Path, topic: str) -> None:
        self.path = path
        self.topic = topic
        self.fh = open(path, "xb")  # closed by RecordingWriter.close
        self.sha = hashlib.sha256()
        self.bytes = 0
        self.unflushed = 0
        self.stats = _TopicStats()
        self.append(encode_header(topic))

    def append(self, data: bytes) -> None:
        self.fh.write(data)
        self.sha.update(data)
        self.bytes += len(data)
        self.unflushed += len(data)


class RecordingWriter:
    """Append messages to a new recording directory; ``close()`` writes the manifest.

    One ``<topic>.esrec`` file per topic, created on the topic's first message (or at
    construction for topics passed in ``topics``, so empty topics are recorded too).
    Memory use is O(topics x partitions): frames go straight to the file, which is
    flushed to the OS every ``flush_bytes``; the sha256 is computed while writing.
    ``close()`` fsyncs every file, then writes ``manifest.json`` atomically (temporary
    file, fsync, rename, fsync of the directory). Leaving a ``with`` block by an
    exception still writes the manifest, with ``"complete": false``.

    Not thread-safe. Refuses a directory that already holds a recording.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        topics: Iterable[str] = (),
        flush_bytes: int = DEFAULT_FLUSH_BYTES,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        self.directory = Path(directory)
        self.flush_bytes = flush_bytes
        self.max_frame_bytes = max_frame_bytes
        self._files: dict[str, _TopicFile] = {}
        self._closed = False
        self.directory.mkdir(parents=True, exist_ok=True)
        existing = sorted(
            p.name
            for p in self.directory.iterdir()
            if p.name == MANIFEST_NAME or p.name.endswith(FILE_SUFFIX)
        )
        if existing:
            raise FileExistsError(
                f"{self.directory} already holds a recording ({', '.join(existing[:3])}); "
                "record into a new or empty directory"
            )
        for topic in topics:
            self._file(topic)

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close(complete=False)
        except Exception:  # keep the original exception
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    def _file(self, topic: str) -> _TopicFile:
        tf = self._files.get(topic)
        if tf is None:
            tf = _TopicFile(self.directory / topic_file_name(topic), topic)
            self._files[topic] = tf
        return tf

    def write(self, msg: RecordedMessage) -> None:
        """Append one message to its topic's file (validated; nothing is buffered here)."""
        if self._closed:
            raise ValueError("write() on a closed RecordingWriter")
        check_topic(msg.topic)
        body = encode_body(msg)
        if len(body) > self.max_frame_bytes:
            raise ValueError(
                f"message {msg.topic}[{msg.partition}]@{msg.offset} needs a {len(body)}-byte "
                f"frame; the limit is {self.max_frame_bytes}"
            )
        tf = self._file(msg.topic)
        tf.append(encode_frame(body))
        tf.stats.add(msg)
        if tf.unflushed >= self.flush_bytes:
            tf.fh.flush()
            tf.unflushed = 0

    def flush(self, fsync: bool = False) -> None:
        """Hand buffered frames to the OS (and to the disk with ``fsync=True``)."""
        for tf in self._files.values():
            tf.fh.flush()
            tf.unflushed = 0
            if fsync:
                os.fsync(tf.fh.fileno())

    def manifest(self, complete: bool = True) -> dict[str, Any]:
        """The manifest as it would be written now."""
        topics = {}
        for topic in sorted(self._files):
            tf = self._files[topic]
            topics[topic] = {
                "file": tf.path.name,
                "bytes": tf.bytes,
                "sha256": tf.sha.hexdigest(),
                **tf.stats.to_dict(),
            }
        return _build_manifest(topics, complete)

    def close(self, complete: bool = True) -> None:
        """Fsync and close every file, then write ``manifest.json`` atomically."""
        if self._closed:
            return
        self._closed = True
        try:
            for tf in self._files.values():
                tf.fh.flush()
                os.fsync(tf.fh.fileno())
        finally:
            for tf in self._files.values():
                tf.fh.close()
        text = json.dumps(self.manifest(complete), indent=2, sort_keys=True) + "\n"
        tmp = self.directory / (MANIFEST_NAME + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.directory / MANIFEST_NAME)
        _fsync_dir(self.directory)


def _build_manifest(topics: dict[str, dict[str, Any]], complete: bool | None) -> dict[str, Any]:
    mins = [t["min_timestamp_ms"] for t in topics.values() if t["messages"]]
    maxs = [t["max_timestamp_ms"] for t in topics.values() if t["messages"]]
    return {
        "format": FORMAT_NAME,
        "version": VERSION,
        "complete": complete,
        "messages": sum(t["messages"] for t in topics.values()),
        "bytes": sum(t["bytes"] for t in topics.values()),
        "min_timestamp_ms": min(mins) if mins else None,
        "max_timestamp_ms": max(maxs) if maxs else None,
        "ordered": all(t["ordered"] for t in topics.values()),
        "topics": topics,
    }


# --------------------------------------------------------------------------- reader


class _FrameError(Exception):
    def __init__(self, position: int, reason: str) -> None:
        super().__init__(position, reason)
        self.position = position
        self.reason = reason


def _read_header(fh, path: Path, size: int) -> tuple[str, int]:
    """Parse the file header; return ``(topic, header_length)``."""
    fixed = fh.read(_HEADER_FIXED.size)
    if len(fixed) >= 4 and fixed[:4] != MAGIC:
        raise _FrameError(0, f"bad magic {fixed[:4]!r} (expected {MAGIC!r}): not a recording file")
    if len(fixed) < _HEADER_FIXED.size:
        raise _FrameError(0, f"file header truncated: {size} bytes present")
    _, version, flags, topic_len = _HEADER_FIXED.unpack(fixed)
    if version not in SUPPORTED_VERSIONS:
        raise RecordingVersionError(path, version)
    rest = fh.read(topic_len + 4)
    if len(rest) < topic_len + 4:
        raise _FrameError(0, f"file header truncated: {size} bytes present")
    name, crc = rest[:topic_len], _U32.unpack(rest[topic_len:])[0]
    if zlib.crc32(fixed + name) != crc:
        raise _FrameError(0, "file header CRC mismatch")
    if flags != 0:
        raise _FrameError(0, f"unknown header flags {flags:#06x}")
    try:
        topic = check_topic(name.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise _FrameError(0, f"invalid topic name {name!r} in the file header") from None
    return topic, _HEADER_FIXED.size + topic_len + 4


def _iter_frames(
    path: Path, expected_topic: str | None, max_frame_bytes: int, stop: int | None = None
) -> Iterator[tuple[int, RecordedMessage]]:
    """Yield ``(end_position, message)`` per frame; raise ``_FrameError`` at the first bad one.

    A clean end is EOF exactly at a frame boundary, or reaching ``stop`` (a frame
    boundary) when given. ``RecordingVersionError`` propagates as is.
    """
    with open(path, "rb", buffering=1 << 16) as fh:
        size = os.fstat(fh.fileno()).st_size
        topic, pos = _read_header(fh, path, size)
        if expected_topic is not None and topic != expected_topic:
            raise _FrameError(0, f"file header names topic {topic!r}, expected {expected_topic!r}")
        while stop is None or pos < stop:
            head = fh.read(_FRAME_HEAD.size)
            if not head:
                if stop is not None and pos < stop:
                    raise _FrameError(
                        pos,
                        f"file ends at byte {pos} but the manifest records {stop} bytes "
                        "(truncated at a frame boundary)",
                    )
                return
            if len(head) < _FRAME_HEAD.size:
                raise _FrameError(
                    pos, f"frame header truncated: {len(head)} of {_FRAME_HEAD.size} bytes present"
                )
            body_len, crc = _FRAME_HEAD.unpack(head)
            if body_len > max_frame_bytes:
                raise _FrameError(
                    pos,
                    f"declared frame length {body_len} exceeds the limit of {max_frame_bytes} bytes",
                )
            remaining = size - pos - _FRAME_HEAD.size
            if body_len > remaining:
                raise _FrameError(
                    pos,
                    f"frame body truncated: declares {body_len} bytes, {remaining} present "
                    "(truncated file or corrupt length)",
                )
            body = fh.read(body_len)
            if len(body) != body_len:  # file shrank while reading
                raise _FrameError(
                    pos, f"frame body truncated: {len(body)} of {body_len} bytes read"
                )
            if zlib.crc32(body) != crc:
                raise _FrameError(pos, "frame CRC mismatch")
            try:
                msg = decode_body(topic, body)
            except ValueError as exc:
                raise _FrameError(pos, f"malformed frame body: {exc}") from None
            pos += _FRAME_HEAD.size + body_len
            yield pos, msg


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class _TopicState:
    topic: str
    path: Path
    stop: int | None  # read frames up to this byte offset (None: to EOF)
    summary: dict[str, Any]  # manifest-shaped entry (without sha256 when scanned)
    missing: bool = False


class RecordingReader:
    """Read a recording: per topic in file order, or all topics merged by timestamp.

    On construction the manifest is loaded and its version checked, and (with
    ``verify=True``) every file's size and sha256 are compared with it. Any mismatch,
    a missing manifest, or a truncated/corrupt frame raises ``RecordingCorrupt`` /
    ``ManifestError`` naming the file and byte offset, unless ``allow_truncated=True``:
    then each damaged file is read up to its last intact frame, the damage is listed
    in ``truncated`` as ``(path, position, reason)`` and ``summary()`` describes what
    is actually readable. A missing manifest with ``allow_truncated=True`` recovers
    every ``*.esrec`` file in the directory (a recording whose writer never closed).
    ``RecordingVersionError`` is raised for an unknown version in either mode.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        allow_truncated: bool = False,
        *,
        verify: bool = True,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        self.directory = Path(directory)
        self.allow_truncated = allow_truncated
        self.max_frame_bytes = max_frame_bytes
        self._truncated: dict[Path, tuple[Path, int, str]] = {}
        self._topics: dict[str, _TopicState] = {}
        if not self.directory.is_dir():
            raise ManifestError(self.directory, "not a directory: no recording here")
        manifest_path = self.directory / MANIFEST_NAME
        if manifest_path.exists():
            self.manifest: dict[str, Any] | None = _load_manifest(manifest_path)
            for topic, entry in self.manifest["topics"].items():
                self._topics[topic] = self._open_topic(topic, entry, verify)
        else:
            self.manifest = None
            if not allow_truncated:
                raise ManifestError(
                    manifest_path,
                    "manifest missing: the recording is incomplete (its writer was never "
                    "closed) or this is not a recording directory; pass allow_truncated=True "
                    "to read the intact frames of its *.esrec files",
                )
            self._recover_without_manifest()

    # -- opening

    def _damaged(self, path: Path, position: int, reason: str) -> None:
        if not self.allow_truncated:
            raise RecordingCorrupt(path, position, reason)
        self._truncated.setdefault(path, (path, position, reason))

    def _scan(
        self, path: Path, topic: str | None, stop: int | None
    ) -> tuple[str | None, _TopicStats, int, int | None, str | None]:
        """Decode ``path`` up to ``stop``: (topic, stats, intact_end, bad_pos, reason)."""
        stats = _TopicStats()
        end = 0
        try:
            with open(path, "rb") as fh:
                found, end = _read_header(fh, path, os.fstat(fh.fileno()).st_size)
            if topic is not None and found != topic:
                return topic, stats, 0, 0, f"file header names topic {found!r}, expected {topic!r}"
            topic = found
            for frame_end, msg in _iter_frames(path, topic, self.max_frame_bytes, stop):
                stats.add(msg)
                end = frame_end
        except _FrameError as exc:
            return topic, stats, exc.position, exc.position, exc.reason
        return topic, stats, end, None, None

    def _open_topic(self, topic: str, entry: dict[str, Any], verify: bool) -> _TopicState:
        path = self.directory / entry["file"]
        if not path.is_file():
            self._damaged(path, 0, "file listed in the manifest is missing")
            return _TopicState(
                topic, path, 0, {**_TopicStats().to_dict(), "file": path.name, "bytes": 0}, True
            )
        size = path.stat().st_size
        if not verify or (size == entry["bytes"] and _sha256_file(path) == entry["sha256"]):
            return _TopicState(topic, path, entry["bytes"], dict(entry))
        # Locate the damage: scan the frames the manifest covers.
        _, stats, end, bad, reason = self._scan(path, topic, entry["bytes"])
        if bad is None:
            if size > entry["bytes"]:
                bad, reason = (
                    end,
                    f"{size - entry['bytes']} unexpected bytes after the recorded end ({entry['bytes']} bytes)",
                )
            else:
                bad, reason = (
                    end,
                    "sha256 does not match the manifest although every frame's CRC is valid",
                )
        self._damaged(path, bad, reason)
        return _TopicState(topic, path, end, {**stats.to_dict(), "file": path.name, "bytes": end})

    def _recover_without_manifest(self) -> None:
        files = sorted(p for p in self.directory.iterdir() if p.name.endswith(FILE_SUFFIX))
        if not files:
            raise ManifestError(
                self.directory / MANIFEST_NAME,
                f"manifest missing and no *{FILE_SUFFIX} files: not a recording directory",
            )
        self._damaged(
            self.directory / MANIFEST_NAME, 0, "manifest missing; recovered from the *.esrec files"
        )
        for path in files:
            stem = path.name[: -len(FILE_SUFFIX)]
            topic, stats, end, bad, reason = self._scan(path, None, None)
            topic = topic or stem
            if topic != stem:
                bad, reason, end = (
                    0,
                    f"file header names topic {topic!r}, file name says {stem!r}",
                    0,
                )
                topic, stats = stem, _TopicStats()
            if bad is not None:
                self._damaged(path, bad, reason)
            if topic in self._topics:  # pragma: no cover - file names are unique
                continue
            self._topics[topic] = _TopicState(
                topic, path, end, {**stats.to_dict(), "file": path.name, "bytes": end}
            )

    # -- reading

    @property
    def topics(self) -> tuple[str, ...]:
        return tuple(sorted(self._topics))

    @property
    def truncated(self) -> list[tuple[Path, int, str]]:
        """Damage found so far (only ever non-empty with ``allow_truncated=True``)."""
        return list(self._truncated.values())

    @property
    def ordered(self) -> bool:
        """True if every file is in (timestamp, partition, offset) order, so ``merged()`` is exact."""
        return all(s.summary["ordered"] for s in self._topics.values())

    def messages(self, topic: str) -> Iterator[RecordedMessage]:
        """The messages of one topic in file (= consumption) order, streamed."""
        state = self._topics.get(topic)
        if state is None:
            raise KeyError(
                f"topic {topic!r} is not in the recording {self.directory} (has: {', '.join(self.topics) or 'none'})"
            )
        return self._messages(state)

    def _messages(self, state: _TopicState) -> Iterator[RecordedMessage]:
        if state.missing:
            return
        try:
            for _, msg in _iter_frames(state.path, state.topic, self.max_frame_bytes, state.stop):
                yield msg
        except _FrameError as exc:
            self._damaged(state.path, exc.position, exc.reason)

    def merged(self, topics: Iterable[str] | None = None) -> Iterator[RecordedMessage]:
        """All (or the given) topics merged by ``(timestamp_ms, topic, partition, offset)``.

        A streaming ``heapq.merge`` over one generator per topic: exact when every file
        is itself in that order (``ordered``, recorded in the manifest); otherwise each
        topic's file order is kept and the topics are interleaved by timestamp.
        """
        names = self.topics if topics is None else tuple(topics)
        iters = [self.messages(t) for t in names]
        return heapq.merge(*iters, key=lambda m: m.sort_key)

    def summary(self) -> dict[str, Any]:
        """Counts and time ranges of what is readable (manifest-shaped, plus ``truncated``)."""
        topics = {
            t: {k: v for k, v in s.summary.items() if k != "sha256"}
            for t, s in sorted(self._topics.items())
        }
        out = _build_manifest(topics, None if self.manifest is None else self.manifest["complete"])
        out["directory"] = str(self.directory)
        out["truncated"] = [
            {"path": str(p), "position": pos, "reason": r} for p, pos, r in self.truncated
        ]
        return out


def _load_manifest(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ManifestError(path, f"manifest cannot be read: {exc}") from None
    except (ValueError, RecursionError) as exc:
        # ValueError: JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits;
        # RecursionError: arrays or objects nested too deeply.
        raise ManifestError(path, f"manifest is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise ManifestError(
            path, f"not an edgestream recording manifest (format must be {FORMAT_NAME!r})"
        )
    if data.get("version") not in SUPPORTED_VERSIONS:
        raise RecordingVersionError(path, data.get("version"))
    topics = data.get("topics")
    if not isinstance(topics, dict):
        raise ManifestError(path, "manifest has no 'topics' object")
    if not isinstance(data.get("complete"), bool):
        raise ManifestError(path, "manifest 'complete' must be true or false")
    for topic, entry in topics.items():
        try:
            check_topic(topic)
        except ValueError as exc:
            raise ManifestError(path, str(exc)) from None
        if not isinstance(entry, dict):
            raise ManifestError(path, f"topic {topic!r}: entry must be an object")
        if entry.get("file") != topic + FILE_SUFFIX:
            raise ManifestError(
                path,
                f"topic {topic!r}: file must be {topic + FILE_SUFFIX!r}, got {entry.get('file')!r}",
            )
        for k in ("bytes", "messages"):
            v = entry.get(k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ManifestError(path, f"topic {topic!r}: {k!r} must be a non-negative integer")
        if not isinstance(entry.get("sha256"), str) or not _SHA_RE.match(entry["sha256"]):
            raise ManifestError(path, f"topic {topic!r}: 'sha256' must be 64 lowercase hex digits")
        if not isinstance(entry.get("ordered"), bool) or not isinstance(
            entry.get("partitions"), dict
        ):
            raise ManifestError(path, f"topic {topic!r}: 'ordered' and 'partitions' are required")
        # summary() takes these from a verified entry: integers, or null for a topic
        # without messages (as the writer records them).
        for k in _ENTRY_TIMESTAMPS:
            v = entry.get(k)
            if (isinstance(v, bool) or not isinstance(v, int)) and (entry["messages"] or v is not None):
                raise ManifestError(
                    path, f"topic {topic!r}: {k!r} must be an integer (null only without messages)"
                )
    return data


def describe(
    directory: str | os.PathLike[str], *, allow_truncated: bool = False, verify: bool = True
) -> dict[str, Any]:
    """Summary of a recording for a CLI: per-topic counts, time ranges, partitions, damage."""
    return RecordingReader(directory, allow_truncated, verify=verify).summary()
