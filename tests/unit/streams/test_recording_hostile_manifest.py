"""Manifests the fuzzer found that escaped as crashes: each is now a ManifestError.

(tests/fuzz/regressions/recording/ holds the inputs themselves; these name each behaviour.)
"""

from __future__ import annotations

import json

import pytest

from edgestream.streams.recording import (
    ManifestError,
    RecordedMessage,
    RecordingReader,
    RecordingWriter,
    describe,
)


@pytest.fixture
def recording(tmp_path):
    directory = tmp_path / "rec"
    with RecordingWriter(directory, topics=["sensors.empty"]) as writer:
        for i in range(3):
            writer.write(RecordedMessage("sensors.dev01", 0, i, 1_700_000_000_000 + i, None, b"v", ()))
    return directory


def rewrite(directory, mutate) -> None:
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    mutate(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("text, match", [
    ("[" * 3000, "not valid JSON.*recursion"),
    ('{"version": ' + "1" * 5000 + "}", "not valid JSON.*digits"),
])
def test_undecodable_manifests_are_manifest_errors(recording, text, match):
    (recording / "manifest.json").write_text(text)
    with pytest.raises(ManifestError, match=match):
        RecordingReader(recording)


@pytest.mark.parametrize("mutate, match", [
    (lambda e: e.pop("min_timestamp_ms"), "'min_timestamp_ms' must be an integer"),
    (lambda e: e.update(max_timestamp_ms="late"), "'max_timestamp_ms' must be an integer"),
    (lambda e: e.update(first_timestamp_ms=None), "'first_timestamp_ms' must be an integer"),
    (lambda e: e.update(last_timestamp_ms=True), "'last_timestamp_ms' must be an integer"),
])
def test_timestamps_of_a_topic_with_messages_must_be_integers(recording, mutate, match):
    # summary() builds the time range from these entries: before, a missing or non-integer
    # one escaped describe() as KeyError / TypeError.
    rewrite(recording, lambda m: mutate(m["topics"]["sensors.dev01"]))
    with pytest.raises(ManifestError, match=match):
        describe(recording)


def test_timestamps_of_an_empty_topic_may_be_null_but_not_text(recording):
    assert describe(recording)["topics"]["sensors.empty"]["min_timestamp_ms"] is None
    rewrite(recording, lambda m: m["topics"]["sensors.empty"].update(min_timestamp_ms="x"))
    with pytest.raises(ManifestError, match="null only without messages"):
        describe(recording)


def test_a_directory_in_place_of_the_manifest_is_a_manifest_error(recording):
    (recording / "manifest.json").unlink()
    (recording / "manifest.json").mkdir()
    with pytest.raises(ManifestError, match="cannot be read"):
        RecordingReader(recording)
