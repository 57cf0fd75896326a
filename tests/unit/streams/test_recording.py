"""Recording file format: round trips, manifest, merge order and every damage path."""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from pathlib import Path

import pytest

from edgestream.streams import recording as rec
from edgestream.streams.recording import (
    ManifestError,
    RecordedMessage,
    RecordingCorrupt,
    RecordingReader,
    RecordingVersionError,
    RecordingWriter,
    describe,
)

TOPICS = ("sensors.dev01", "sensors.dev-02", "gradients.job_1")


def sample_messages() -> list[RecordedMessage]:
    """Several topics and partitions; keys None and bytes; empty values; headers; ties."""
    out = []
    for t_index, topic in enumerate(TOPICS):
        for i in range(7):
            partition = i % (t_index + 1)
            out.append(
                RecordedMessage(
                    topic=topic,
                    partition=partition,
                    offset=100 * partition + i,
                    # equal timestamps across topics exercise the tie-break
                    timestamp_ms=1_700_000_000_000 + 10 * i + (t_index % 2) * 5 * (i % 2),
                    key=None if i % 3 == 0 else f"k{i}".encode(),
                    value=b"" if i % 4 == 0 else bytes(range(i * 7 % 256)) * (i + 1),
                    headers=(
                        ()
                        if i % 2
                        else (("edgestream.reason", b"ok"), ("ünïcode", b""), ("bin", b"\x00\xff"))
                    ),
                )
            )
    out.append(RecordedMessage(TOPICS[0], 0, 9_999, 1_700_000_001_000, b"", b"x" * 200_000, ()))
    return out


def by_topic(msgs, topic):
    return [m for m in msgs if m.topic == topic]


def write_recording(directory: Path, msgs, **kwargs) -> Path:
    with RecordingWriter(directory, **kwargs) as w:
        for m in msgs:
            w.write(m)
    return directory


def frame_layout(path: Path) -> tuple[int, list[int], int]:
    """(header length, start offset of each frame, file size), parsed per the docs."""
    data = path.read_bytes()
    assert data[:4] == b"ESRC"
    (topic_len,) = struct.unpack_from("<H", data, 8)
    pos = header_len = 10 + topic_len + 4
    starts = []
    while pos < len(data):
        (body_len,) = struct.unpack_from("<I", data, pos)
        starts.append(pos)
        pos += 8 + body_len
    assert pos == len(data)
    return header_len, starts, len(data)


@pytest.fixture
def recorded(tmp_path):
    msgs = sample_messages()
    return write_recording(tmp_path / "rec", msgs), msgs


# ----------------------------------------------------------------------- round trip


def test_round_trip_every_topic_in_file_order(recorded):
    directory, msgs = recorded
    reader = RecordingReader(directory)
    assert reader.topics == tuple(sorted(TOPICS))
    for topic in TOPICS:
        assert list(reader.messages(topic)) == by_topic(msgs, topic)
    assert reader.truncated == []
    # iterating twice works (each call streams the file afresh)
    assert list(reader.messages(TOPICS[1])) == by_topic(msgs, TOPICS[1])


def test_round_trip_preserves_none_key_empty_value_and_headers(recorded):
    directory, msgs = recorded
    got = list(RecordingReader(directory).merged())
    assert any(m.key is None for m in got) and any(m.key == b"" for m in got)
    assert any(m.value == b"" for m in got)
    with_headers = [m for m in got if m.headers]
    assert with_headers and all(isinstance(m.headers, tuple) for m in got)
    assert with_headers[0].headers == (
        ("edgestream.reason", b"ok"),
        ("ünïcode", b""),
        ("bin", b"\x00\xff"),
    )
    assert sorted(got, key=lambda m: m.sort_key) == sorted(msgs, key=lambda m: m.sort_key)


def test_headers_given_as_lists_are_normalised_to_tuples():
    m = RecordedMessage("t", 0, 0, 0, None, b"", [["a", b"1"]])
    assert m.headers == (("a", b"1"),)


@pytest.mark.parametrize("flush_bytes", [1, 1 << 20])
def test_merged_is_sorted_by_timestamp_topic_partition_offset(tmp_path, flush_bytes):
    msgs = sample_messages()
    directory = write_recording(tmp_path / "rec", msgs, flush_bytes=flush_bytes)
    reader = RecordingReader(directory)
    assert reader.ordered
    merged = list(reader.merged())
    assert merged == sorted(msgs, key=lambda m: m.sort_key)
    subset = list(reader.merged([TOPICS[0], TOPICS[2]]))
    assert subset == sorted(
        by_topic(msgs, TOPICS[0]) + by_topic(msgs, TOPICS[2]), key=lambda m: m.sort_key
    )


def test_unordered_topic_is_flagged_and_merge_keeps_every_message(tmp_path):
    msgs = [RecordedMessage("a", 0, i, 1000 - i, None, b"v", ()) for i in range(5)]
    msgs += [RecordedMessage("b", 0, i, 500 + 100 * i, None, b"w", ()) for i in range(5)]
    directory = write_recording(tmp_path / "rec", msgs)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["topics"]["a"]["ordered"] is False
    assert manifest["topics"]["b"]["ordered"] is True
    assert manifest["ordered"] is False
    reader = RecordingReader(directory)
    assert not reader.ordered
    merged = list(reader.merged())
    assert sorted(merged, key=lambda m: m.sort_key) == sorted(msgs, key=lambda m: m.sort_key)
    assert [m for m in merged if m.topic == "a"] == msgs[:5]  # file order kept per topic


def test_unknown_topic_is_a_key_error(recorded):
    directory, _ = recorded
    with pytest.raises(KeyError, match="nope"):
        RecordingReader(directory).messages("nope")


def test_declared_topic_without_messages_is_recorded(tmp_path):
    with RecordingWriter(tmp_path / "rec", topics=["empty"]) as w:
        w.write(RecordedMessage("full", 3, 7, 42, b"k", b"v", ()))
    reader = RecordingReader(tmp_path / "rec")
    assert reader.topics == ("empty", "full")
    assert list(reader.messages("empty")) == []
    entry = reader.manifest["topics"]["empty"]
    assert entry["messages"] == 0 and entry["min_timestamp_ms"] is None
    assert entry["bytes"] == (tmp_path / "rec" / "empty.esrec").stat().st_size


# ------------------------------------------------------------------------- manifest


def test_manifest_contents(recorded):
    directory, msgs = recorded
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["format"] == "edgestream-recording"
    assert manifest["version"] == rec.VERSION == 1
    assert manifest["complete"] is True
    assert manifest["messages"] == len(msgs)
    assert manifest["min_timestamp_ms"] == min(m.timestamp_ms for m in msgs)
    assert manifest["max_timestamp_ms"] == max(m.timestamp_ms for m in msgs)
    assert set(manifest["topics"]) == set(TOPICS)
    total = 0
    for topic in TOPICS:
        entry = manifest["topics"][topic]
        mine = by_topic(msgs, topic)
        path = directory / f"{topic}.esrec"
        data = path.read_bytes()
        total += len(data)
        assert entry["file"] == path.name
        assert entry["messages"] == len(mine)
        assert entry["bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert entry["first_timestamp_ms"] == mine[0].timestamp_ms
        assert entry["last_timestamp_ms"] == mine[-1].timestamp_ms
        assert entry["min_timestamp_ms"] == min(m.timestamp_ms for m in mine)
        assert entry["max_timestamp_ms"] == max(m.timestamp_ms for m in mine)
        expected_parts = {}
        for p in sorted({m.partition for m in mine}):
            offsets = [m.offset for m in mine if m.partition == p]
            expected_parts[str(p)] = {
                "messages": len(offsets),
                "min_offset": min(offsets),
                "max_offset": max(offsets),
            }
        assert entry["partitions"] == expected_parts
    assert manifest["bytes"] == total
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        ["manifest.json"] + [f"{t}.esrec" for t in TOPICS]
    )  # no temporary file left behind


def test_manifest_appears_only_on_close_and_frames_are_flushed_periodically(tmp_path):
    directory = tmp_path / "rec"
    w = RecordingWriter(directory, flush_bytes=1)
    for i in range(3):
        w.write(RecordedMessage("t", 0, i, i, None, b"abc" * 10, ()))
        assert (directory / "t.esrec").stat().st_size == w.manifest()["topics"]["t"]["bytes"]
    assert not (directory / "manifest.json").exists()
    w.close()
    assert (directory / "manifest.json").exists()
    w.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        w.write(RecordedMessage("t", 0, 3, 3, None, b"", ()))


def test_exception_inside_with_still_writes_manifest_marked_incomplete(tmp_path):
    directory = tmp_path / "rec"
    with pytest.raises(RuntimeError, match="boom"):
        with RecordingWriter(directory) as w:
            w.write(RecordedMessage("t", 0, 0, 5, None, b"v", ()))
            raise RuntimeError("boom")
    reader = RecordingReader(directory)
    assert reader.manifest["complete"] is False
    assert [m.offset for m in reader.messages("t")] == [0]


def test_describe_summarises_counts_and_time_range(recorded):
    directory, msgs = recorded
    d = describe(directory)
    assert d["messages"] == len(msgs)
    assert d["min_timestamp_ms"] == min(m.timestamp_ms for m in msgs)
    assert d["max_timestamp_ms"] == max(m.timestamp_ms for m in msgs)
    assert {t: v["messages"] for t, v in d["topics"].items()} == {
        t: len(by_topic(msgs, t)) for t in TOPICS
    }
    assert d["truncated"] == [] and d["complete"] is True and d["version"] == 1
    assert "sha256" not in d["topics"][TOPICS[0]]
    json.dumps(d)  # printable by a CLI as JSON


def test_writer_refuses_a_directory_that_already_holds_a_recording(recorded):
    directory, _ = recorded
    with pytest.raises(FileExistsError, match="already holds a recording"):
        RecordingWriter(directory)


@pytest.mark.parametrize("topic", ["", ".", "..", "a/b", "x" * 250, "tópic", "a b"])
def test_writer_rejects_topic_names_kafka_would_reject(tmp_path, topic):
    with RecordingWriter(tmp_path / "rec") as w:
        with pytest.raises(ValueError, match="invalid topic name"):
            w.write(RecordedMessage(topic, 0, 0, 0, None, b"", ()))


@pytest.mark.parametrize(
    "changes, error",
    [
        ({"key": "str"}, TypeError),
        ({"value": None}, TypeError),
        ({"headers": (("h", "str"),)}, TypeError),
        ({"headers": ((1, b"v"),)}, TypeError),
        ({"partition": -1}, ValueError),
        ({"partition": True}, TypeError),
        ({"offset": -1}, ValueError),
        ({"timestamp_ms": 1 << 63}, ValueError),
        ({"timestamp_ms": 1.5}, TypeError),
    ],
)
def test_writer_validates_fields(tmp_path, changes, error):
    fields = dict(topic="t", partition=0, offset=0, timestamp_ms=0, key=None, value=b"", headers=())
    fields.update(changes)
    with RecordingWriter(tmp_path / "rec") as w:
        with pytest.raises(error):
            w.write(RecordedMessage(**fields))
    assert list(RecordingReader(tmp_path / "rec").merged()) == []


# --------------------------------------------------------------- truncation/corruption


CUTS = {
    # name: (cut position, expected damage position, number of intact frames)
    "inside_magic": lambda h, s, n: (2, 0, 0),
    "inside_header_topic": lambda h, s, n: (12, 0, 0),
    "inside_header_crc": lambda h, s, n: (h - 1, 0, 0),
    "after_header": lambda h, s, n: (h, h, 0),
    "inside_frame_length": lambda h, s, n: (s[2] + 2, s[2], 2),
    "inside_frame_crc": lambda h, s, n: (s[2] + 6, s[2], 2),
    "inside_body": lambda h, s, n: (s[2] + 8 + 3, s[2], 2),
    "inside_last_body": lambda h, s, n: (n - 1, s[-1], len(s) - 1),
    "at_frame_boundary": lambda h, s, n: (s[3], s[3], 3),
}


def _cut(directory: Path, topic: str, case: str):
    path = directory / f"{topic}.esrec"
    header_len, starts, size = frame_layout(path)
    cut, position, intact = CUTS[case](header_len, starts, size)
    path.write_bytes(path.read_bytes()[:cut])
    return path, position, intact


@pytest.mark.parametrize("case", sorted(CUTS))
def test_truncated_file_is_reported_with_file_and_position(recorded, case):
    directory, _ = recorded
    path, position, _ = _cut(directory, TOPICS[0], case)
    with pytest.raises(RecordingCorrupt) as info:
        RecordingReader(directory)
    err = info.value
    assert err.path == path and err.position == position
    assert str(path) in str(err) and f"byte {position}" in str(err)


@pytest.mark.parametrize("case", sorted(CUTS))
def test_truncated_file_detected_while_streaming_without_upfront_verification(recorded, case):
    directory, msgs = recorded
    path, position, intact = _cut(directory, TOPICS[0], case)
    reader = RecordingReader(directory, verify=False)
    got = []
    with pytest.raises(RecordingCorrupt) as info:
        for m in reader.messages(TOPICS[0]):
            got.append(m)
    assert (info.value.path, info.value.position) == (path, position)
    assert got == by_topic(msgs, TOPICS[0])[:intact]


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("case", sorted(CUTS))
def test_allow_truncated_reads_exactly_the_intact_prefix(recorded, case, verify):
    directory, msgs = recorded
    path, position, intact = _cut(directory, TOPICS[0], case)
    reader = RecordingReader(directory, allow_truncated=True, verify=verify)
    assert list(reader.messages(TOPICS[0])) == by_topic(msgs, TOPICS[0])[:intact]
    for topic in TOPICS[1:]:
        assert list(reader.messages(topic)) == by_topic(msgs, topic)
    assert [(p, pos) for p, pos, _ in reader.truncated] == [(path, position)]
    expected = by_topic(msgs, TOPICS[0])[:intact] + [m for m in msgs if m.topic != TOPICS[0]]
    assert list(reader.merged()) == sorted(expected, key=lambda m: m.sort_key)
    if verify:  # the damage was located up front, so the summary counts what is readable
        assert reader.summary()["topics"][TOPICS[0]]["messages"] == intact
        assert describe(directory, allow_truncated=True)["truncated"][0]["position"] == position


def _flip(path: Path, index: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[index] ^= mask
    path.write_bytes(bytes(data))


FLIPS = {
    # name: (byte index, xor mask, expected damage position, intact frames, reason)
    "header_topic": lambda h, s: (10, 0x01, 0, 0, "header CRC mismatch"),
    "header_crc": lambda h, s: (h - 2, 0x40, 0, 0, "header CRC mismatch"),
    "frame_crc": lambda h, s: (s[1] + 5, 0x01, s[1], 1, "frame CRC mismatch"),
    "body_start": lambda h, s: (s[1] + 8, 0x80, s[1], 1, "frame CRC mismatch"),
    "body_end": lambda h, s: (s[2] - 1, 0x10, s[1], 1, "frame CRC mismatch"),
    "length_high_byte": lambda h, s: (s[1] + 3, 0xFF, s[1], 1, "exceeds the limit"),
    "length_low_byte": lambda h, s: (s[1], 0x01, s[1], 1, "frame CRC mismatch"),
}


@pytest.mark.parametrize("case", sorted(FLIPS))
def test_flipped_byte_is_detected(recorded, case):
    directory, msgs = recorded
    path = directory / f"{TOPICS[0]}.esrec"
    header_len, starts, _ = frame_layout(path)
    index, mask, position, intact, reason = FLIPS[case](header_len, starts)
    _flip(path, index, mask)
    with pytest.raises(RecordingCorrupt, match=reason) as info:
        RecordingReader(directory)
    assert (info.value.path, info.value.position) == (path, position)
    with pytest.raises(RecordingCorrupt, match=reason):
        list(RecordingReader(directory, verify=False).messages(TOPICS[0]))
    reader = RecordingReader(directory, allow_truncated=True)
    assert list(reader.messages(TOPICS[0])) == by_topic(msgs, TOPICS[0])[:intact]
    assert reader.truncated[0][:2] == (path, position)


def test_bytes_appended_after_the_recorded_end_are_reported(recorded):
    directory, msgs = recorded
    path = directory / f"{TOPICS[1]}.esrec"
    size = path.stat().st_size
    with open(path, "ab") as fh:
        fh.write(rec.encode_frame(rec.encode_body(msgs[0])))
    with pytest.raises(RecordingCorrupt, match="unexpected bytes") as info:
        RecordingReader(directory)
    assert info.value.position == size
    reader = RecordingReader(directory, allow_truncated=True)
    assert list(reader.messages(TOPICS[1])) == by_topic(msgs, TOPICS[1])


def test_missing_topic_file_is_reported(recorded):
    directory, msgs = recorded
    path = directory / f"{TOPICS[2]}.esrec"
    path.unlink()
    with pytest.raises(RecordingCorrupt, match="missing") as info:
        RecordingReader(directory)
    assert info.value.path == path
    reader = RecordingReader(directory, allow_truncated=True)
    assert list(reader.messages(TOPICS[2])) == []
    assert list(reader.messages(TOPICS[0])) == by_topic(msgs, TOPICS[0])


@pytest.mark.parametrize("declared", [rec.MAX_FRAME_BYTES + 1, 0xFFFFFFFF])
@pytest.mark.parametrize("verify", [True, False])
def test_huge_declared_frame_length_is_rejected(recorded, declared, verify):
    directory, msgs = recorded
    path = directory / f"{TOPICS[0]}.esrec"
    _, starts, _ = frame_layout(path)
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, starts[1], declared)
    path.write_bytes(bytes(data))
    with pytest.raises(RecordingCorrupt, match=f"declared frame length {declared} exceeds") as info:
        list(RecordingReader(directory, verify=verify).messages(TOPICS[0]))
    assert (info.value.path, info.value.position) == (path, starts[1])
    reader = RecordingReader(directory, allow_truncated=True, verify=verify)
    assert list(reader.messages(TOPICS[0])) == by_topic(msgs, TOPICS[0])[:1]


def test_frame_limit_is_enforced_on_write_and_read(tmp_path):
    big = RecordedMessage("t", 0, 0, 0, None, b"x" * 1000, ())
    with RecordingWriter(tmp_path / "a", max_frame_bytes=500) as w:
        with pytest.raises(ValueError, match="limit is 500"):
            w.write(big)
    write_recording(tmp_path / "b", [big])
    with pytest.raises(RecordingCorrupt, match="exceeds the limit of 500"):
        list(RecordingReader(tmp_path / "b", max_frame_bytes=500).merged())


def test_frame_with_valid_crc_but_inconsistent_body_is_rejected(recorded):
    directory, _ = recorded
    path = directory / f"{TOPICS[0]}.esrec"
    header_len, starts, _ = frame_layout(path)
    data = path.read_bytes()
    body = bytearray(data[starts[0] + 8 : starts[1]])
    struct.pack_into("<I", body, 24, 1 << 30)  # value_len far beyond the body
    frame = struct.pack("<II", len(body), zlib.crc32(bytes(body))) + bytes(body)
    path.write_bytes(data[: starts[0]] + frame + data[starts[1] :])
    with pytest.raises(RecordingCorrupt, match="malformed frame body.*value") as info:
        list(RecordingReader(directory, verify=False).messages(TOPICS[0]))
    assert info.value.position == starts[0]


# --------------------------------------------------------------------------- version


@pytest.mark.parametrize("allow_truncated", [False, True])
@pytest.mark.parametrize("version", [0, 2, "1", None])
def test_unknown_manifest_version_is_rejected(recorded, version, allow_truncated):
    directory, _ = recorded
    mpath = directory / "manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["version"] = version
    mpath.write_text(json.dumps(manifest))
    with pytest.raises(RecordingVersionError, match="version") as info:
        RecordingReader(directory, allow_truncated=allow_truncated)
    assert info.value.path == mpath and info.value.version == version


@pytest.mark.parametrize("allow_truncated", [False, True])
@pytest.mark.parametrize("verify", [False, True])
def test_unknown_file_version_is_rejected(recorded, allow_truncated, verify):
    directory, _ = recorded
    path = directory / f"{TOPICS[1]}.esrec"
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, 4, 2)
    path.write_bytes(bytes(data))
    with pytest.raises(RecordingVersionError, match="version 2 is not supported") as info:
        reader = RecordingReader(directory, allow_truncated=allow_truncated, verify=verify)
        list(reader.merged())
    assert info.value.path == path


# -------------------------------------------------------------------------- manifest


def test_missing_manifest_is_a_clear_error(recorded):
    directory, _ = recorded
    (directory / "manifest.json").unlink()
    with pytest.raises(ManifestError, match="manifest missing.*allow_truncated=True") as info:
        RecordingReader(directory)
    assert info.value.path == directory / "manifest.json"
    assert str(directory / "manifest.json") in str(info.value)


def test_unclosed_writer_can_be_recovered_with_allow_truncated(tmp_path):
    msgs = sample_messages()
    directory = tmp_path / "rec"
    w = RecordingWriter(directory)
    for m in msgs:
        w.write(m)
    w.flush()
    with pytest.raises(ManifestError):
        RecordingReader(directory)
    reader = RecordingReader(directory, allow_truncated=True)
    assert reader.manifest is None
    assert list(reader.merged()) == sorted(msgs, key=lambda m: m.sort_key)
    assert reader.truncated[0][0] == directory / "manifest.json"
    summary = reader.summary()
    assert summary["messages"] == len(msgs) and summary["complete"] is None
    w.close()


def test_recovery_without_manifest_stops_at_a_partial_last_frame(tmp_path):
    msgs = sample_messages()
    directory = write_recording(tmp_path / "rec", msgs)
    (directory / "manifest.json").unlink()
    path = directory / f"{TOPICS[0]}.esrec"
    _, starts, size = frame_layout(path)
    path.write_bytes(path.read_bytes()[: size - 5])
    reader = RecordingReader(directory, allow_truncated=True)
    assert list(reader.messages(TOPICS[0])) == by_topic(msgs, TOPICS[0])[:-1]
    assert (path, starts[-1]) in [(p, pos) for p, pos, _ in reader.truncated]


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not valid JSON"),
        ("[]", "not an edgestream recording manifest"),
        ('{"format": "other", "version": 1}', "not an edgestream recording manifest"),
    ],
)
def test_malformed_manifest_is_rejected(recorded, content, match):
    directory, _ = recorded
    (directory / "manifest.json").write_text(content)
    with pytest.raises(ManifestError, match=match):
        RecordingReader(directory)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda e: e.update(file="../../etc/passwd"), "file must be"),
        (lambda e: e.update(sha256="abc"), "sha256"),
        (lambda e: e.update(bytes=-1), "bytes"),
        (lambda e: e.pop("partitions"), "partitions"),
    ],
)
def test_manifest_topic_entries_are_validated(recorded, mutate, match):
    directory, _ = recorded
    mpath = directory / "manifest.json"
    manifest = json.loads(mpath.read_text())
    mutate(manifest["topics"][TOPICS[0]])
    mpath.write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=match):
        RecordingReader(directory)


def test_not_a_recording_directory(tmp_path):
    with pytest.raises(ManifestError, match="not a directory"):
        RecordingReader(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ManifestError, match="no \\*.esrec files"):
        RecordingReader(tmp_path / "empty", allow_truncated=True)
