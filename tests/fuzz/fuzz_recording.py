"""Fuzz target: recordings (``streams.recording.RecordingReader``: manifest, file headers, frames).

Input: one mode byte, then segments separated by ``SEP``: the first is ``manifest.json``,
each further one a ``.esrec`` file as ``<topic>\\n<bytes>`` (a name that is not a legal
topic becomes ``t<i>``). They are written to a scratch directory, then read with
``RecordingReader`` and every message of every topic is iterated (per topic, or with
``merged()``), and ``summary()`` is built. Mode bits:

* 1: ``allow_truncated=True``; 2: ``verify=True``; 4: write no manifest at all;
* 8: fix the header CRC and every frame CRC of each file before writing it, so
  mutations reach the frame bodies; 16: fix each manifest entry's ``bytes`` and
  ``sha256`` to the file written (so ``verify`` passes and the entries are trusted);
* 32: iterate ``merged()`` instead of ``messages(topic)``; 64: ``max_frame_bytes=64``.

Allowed to escape (docs/recording-format.md, "Errors"): ``RecordingCorrupt``,
``RecordingVersionError``, ``ManifestError`` (all ``RecordingError``); with
``allow_truncated=True`` ``RecordingCorrupt`` is a bug too ("reads what is intact
instead of raising"). Also a bug: a message that is not what the format can carry
(types, negative partition or offset) or does not survive ``encode_body`` /
``decode_body``, and a ``summary()`` that raises or is not JSON.
"""

from __future__ import annotations

import hashlib
import json
import struct
import tempfile
import zlib
from pathlib import Path

from edgestream.streams.recording import (
    FILE_SUFFIX,
    MANIFEST_NAME,
    RecordedMessage,
    RecordingCorrupt,
    RecordingError,
    RecordingReader,
    RecordingWriter,
    check_topic,
    decode_body,
    encode_body,
)
from tests.fuzz.targets import FuzzFinding, scratch_dir

MAX_LEN = 8192
ALLOWED = (RecordingError,)
SEP = b"\n%%ESREC%%\n"

ALLOW_TRUNCATED, VERIFY, NO_MANIFEST, FIX_CRC, FIX_MANIFEST, MERGED, SMALL_FRAMES = 1, 2, 4, 8, 16, 32, 64
_MAX_FILES = 4

_scratch: Path | None = None


def _directory() -> Path:
    """One scratch directory per process (in memory where possible), emptied per input."""
    global _scratch
    if _scratch is None:
        _scratch = scratch_dir("edgestream-fuzz-rec-")
    for entry in _scratch.iterdir():
        entry.unlink()
    return _scratch


def fix_crcs(content: bytes) -> bytes:
    """``content`` with a correct header CRC and frame CRCs wherever the lengths allow."""
    buf = bytearray(content)
    if len(buf) < 10:
        return content
    (topic_len,) = struct.unpack_from("<H", buf, 8)
    end = 10 + topic_len
    if end + 4 > len(buf):
        return bytes(buf)
    struct.pack_into("<I", buf, end, zlib.crc32(bytes(buf[:end])))
    pos = end + 4
    while pos + 8 <= len(buf):
        (body_len,) = struct.unpack_from("<I", buf, pos)
        if body_len > len(buf) - pos - 8:
            break
        struct.pack_into("<I", buf, pos + 4, zlib.crc32(bytes(buf[pos + 8 : pos + 8 + body_len])))
        pos += 8 + body_len
    return bytes(buf)


def fix_manifest(text: bytes, files: dict[str, bytes]) -> bytes:
    """The manifest with every entry's ``bytes`` / ``sha256`` matching the files (if it parses)."""
    try:
        manifest = json.loads(text)
    except (ValueError, RecursionError):
        return text
    topics = manifest.get("topics") if isinstance(manifest, dict) else None
    if not isinstance(topics, dict):
        return text
    for topic, entry in topics.items():
        content = files.get(f"{topic}{FILE_SUFFIX}")
        if isinstance(entry, dict) and content is not None:
            entry["bytes"] = len(content)
            entry["sha256"] = hashlib.sha256(content).hexdigest()
    return json.dumps(manifest).encode()


def split(data: bytes) -> tuple[int, bytes, dict[str, bytes]]:
    """(mode, manifest bytes, {file name: content}) of an input."""
    mode, rest = data[0], data[1:]
    manifest, *segments = rest.split(SEP)
    files: dict[str, bytes] = {}
    for index, segment in enumerate(segments[:_MAX_FILES]):
        name, _, content = segment.partition(b"\n")
        try:
            topic = check_topic(name.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            topic = f"t{index}"
        if mode & FIX_CRC:
            content = fix_crcs(content)
        files[f"{topic}{FILE_SUFFIX}"] = content
    if mode & FIX_MANIFEST:
        manifest = fix_manifest(manifest, files)
    return mode, manifest, files


def _check_message(msg: RecordedMessage, topic: str) -> None:
    if msg.topic != topic and topic != "*":
        raise FuzzFinding(f"message of topic {msg.topic!r} read from {topic!r}")
    if not (isinstance(msg.partition, int) and msg.partition >= 0 and isinstance(msg.offset, int) and msg.offset >= 0):
        raise FuzzFinding(f"partition {msg.partition!r} / offset {msg.offset!r}")
    if not (msg.key is None or isinstance(msg.key, bytes)) or not isinstance(msg.value, bytes):
        raise FuzzFinding("key or value of the wrong type")
    if not all(isinstance(n, str) and isinstance(v, bytes) for n, v in msg.headers):
        raise FuzzFinding(f"headers {msg.headers!r}")
    if decode_body(msg.topic, encode_body(msg)) != msg:
        raise FuzzFinding("a message read does not survive encode_body / decode_body")


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, manifest, files = split(data)
    directory = _directory()
    for name, content in files.items():
        (directory / name).write_bytes(content)
    if not mode & NO_MANIFEST:
        (directory / MANIFEST_NAME).write_bytes(manifest)
    allow_truncated = bool(mode & ALLOW_TRUNCATED)
    try:
        reader = RecordingReader(
            directory,
            allow_truncated,
            verify=bool(mode & VERIFY),
            max_frame_bytes=64 if mode & SMALL_FRAMES else 64 * 1024 * 1024,
        )
        if mode & MERGED:
            for msg in reader.merged():
                _check_message(msg, "*")
        else:
            for topic in reader.topics:
                for msg in reader.messages(topic):
                    _check_message(msg, topic)
        summary = reader.summary()
    except RecordingCorrupt as err:
        if allow_truncated:
            raise FuzzFinding(f"RecordingCorrupt with allow_truncated=True: {err}") from err
        return
    except RecordingError:
        return
    try:
        json.dumps(summary)
    except (TypeError, ValueError) as err:
        raise FuzzFinding(f"summary() is not JSON: {err}") from err


def _join(mode: int, manifest: bytes, files: dict[str, bytes]) -> bytes:
    segments = [manifest] + [topic.encode() + b"\n" + content for topic, content in files.items()]
    return bytes([mode]) + SEP.join(segments)


def seeds() -> dict[str, bytes]:
    """Small valid recordings (read in several modes) and two damaged ones."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "rec"
        with RecordingWriter(root, topics=["sensors.empty"]) as writer:
            for i in range(3):
                writer.write(RecordedMessage("sensors.dev01", 0, i, 1_700_000_000_000 + 10 * i, None,
                                             b"EDGS" + bytes([i]) * 5, (("edgestream.kind", b"x"),)))
            writer.write(RecordedMessage("sensors.dev02", 1, 9, 1_700_000_000_005, b"k", b"", ()))
            writer.write(RecordedMessage("sensors.dev02", 0, 2, -1, b"", b"v" * 7, (("a", b""), ("\u00e9", b"\x00"))))
        manifest = (root / MANIFEST_NAME).read_bytes()
        files = {p.name[: -len(FILE_SUFFIX)]: p.read_bytes() for p in sorted(root.glob(f"*{FILE_SUFFIX}"))}
    out = {
        "valid_verify": _join(VERIFY, manifest, files),
        "valid_merged": _join(VERIFY | MERGED | FIX_CRC | FIX_MANIFEST, manifest, files),
        "valid_noverify_truncated": _join(ALLOW_TRUNCATED, manifest, files),
        "no_manifest": _join(ALLOW_TRUNCATED | NO_MANIFEST | FIX_CRC, b"", files),
        "small_frames": _join(ALLOW_TRUNCATED | VERIFY | SMALL_FRAMES | FIX_CRC | FIX_MANIFEST, manifest, files),
    }
    dev01 = files["sensors.dev01"]
    out["truncated_file"] = _join(ALLOW_TRUNCATED | VERIFY, manifest, {**files, "sensors.dev01": dev01[:-5]})
    return out


def dictionary() -> list[bytes]:
    """Tokens for libFuzzer: the separator, the file magic, the manifest's keys."""
    keys = ["format", "version", "complete", "messages", "bytes", "min_timestamp_ms", "max_timestamp_ms",
            "ordered", "topics", "file", "sha256", "first_timestamp_ms", "last_timestamp_ms", "partitions",
            "min_offset", "max_offset", "edgestream-recording", "sensors.dev01", "sensors.dev01.esrec"]
    return [SEP, b"ESRC\x01\x00\x00\x00", b"\xff\xff\xff\xff", *(f'"{k}"'.encode() for k in keys),
            b"null", b"true", b"false", b"-1", b"9223372036854775807"]
