"""The broker's class archive (deploy/kafka/class_archive.py): where it lives, the JVM
options that map it, and when ``ensure_class_archive`` makes none (no broker is started
here; tests/integration/test_class_archive.py makes one for real)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edgestream.deploy.kafka import broker, class_archive


def fake_java(directory: Path, text: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    java = directory / "java"
    java.write_text(f"#!/bin/sh\n# {text}\n")
    java.chmod(0o755)


def test_the_archive_is_keyed_by_the_jdk(tmp_path, monkeypatch):
    fake_java(tmp_path / "jdk-a", "a")
    fake_java(tmp_path / "jdk-b", "another jdk")
    monkeypatch.setenv("PATH", str(tmp_path / "jdk-a"))
    first = class_archive.archive_path(tmp_path / "jars")
    assert first == class_archive.archive_path(tmp_path / "jars")  # stable
    assert first.parent == tmp_path / "jars" and first.suffix == ".jsa"
    monkeypatch.setenv("PATH", str(tmp_path / "jdk-b"))
    assert class_archive.archive_path(tmp_path / "jars") != first
    assert class_archive.failed_path(first).name == first.stem + ".failed"


def test_java_options_map_the_archive_and_keep_cds_quiet(tmp_path):
    assert class_archive.java_options(None) == []
    options = class_archive.java_options(tmp_path / "classes-x.jsa")
    assert options[0] == f"-XX:SharedArchiveFile={tmp_path / 'classes-x.jsa'}"
    assert "-Xlog:cds=off" in options


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_the_environment_turns_it_off(tmp_path, monkeypatch, value):
    monkeypatch.setenv(class_archive.ENV, value)
    assert broker.ensure_class_archive(tmp_path) is None
    assert list(tmp_path.iterdir()) == []  # nothing made, no lock file


def test_an_existing_archive_is_used_and_a_recent_failure_stops_retries(tmp_path, monkeypatch):
    monkeypatch.delenv(class_archive.ENV, raising=False)

    def no_broker(*args, **kwargs):
        raise AssertionError("no broker may start when the answer is on disk")

    monkeypatch.setattr(broker.LocalBroker, "start", no_broker)
    archive = class_archive.archive_path(tmp_path)
    archive.write_bytes(b"an archive")
    assert broker.ensure_class_archive(tmp_path) == archive
    os.unlink(archive)
    class_archive.failed_path(archive).write_text("making the archive failed: ...\n")  # written just now
    assert broker.ensure_class_archive(tmp_path) is None


def test_a_failed_attempt_is_tried_again_an_hour_later_three_times_in_all(tmp_path, monkeypatch):
    monkeypatch.delenv(class_archive.ENV, raising=False)
    archive = class_archive.archive_path(tmp_path)
    marker = class_archive.failed_path(archive)
    starts: list[float] = []
    clock = [1_000_000.0]
    monkeypatch.setattr(class_archive.time, "time", lambda: clock[0])

    def failing_start(self, timeout_s=0.0):
        starts.append(clock[0])
        raise broker.BrokerError("the archiving broker did not start in time")

    monkeypatch.setattr(broker.LocalBroker, "start", failing_start)
    assert broker.ensure_class_archive(tmp_path) is None
    assert class_archive.failures(marker) == (1, clock[0])
    assert "did not start in time" in marker.read_text()
    clock[0] += class_archive.RETRY_AFTER_S - 1
    assert broker.ensure_class_archive(tmp_path) is None and len(starts) == 1  # too soon
    for attempt in (2, 3):
        clock[0] += class_archive.RETRY_AFTER_S
        assert broker.ensure_class_archive(tmp_path) is None
        assert len(starts) == attempt and class_archive.failures(marker)[0] == attempt
    assert "no more attempts" in marker.read_text()
    clock[0] += 100 * class_archive.RETRY_AFTER_S
    assert broker.ensure_class_archive(tmp_path) is None and len(starts) == 3  # given up
    marker.unlink()  # the documented way to try again at once
    assert broker.ensure_class_archive(tmp_path) is None and len(starts) == 4


def test_an_old_plain_text_marker_counts_as_one_failure_at_its_time(tmp_path):
    marker = tmp_path / "classes-x.failed"
    marker.write_text("making the archive failed: ...\n")
    os.utime(marker, (5000.0, 5000.0))
    assert class_archive.failures(marker) == (1, 5000.0)
    assert not class_archive.may_try(marker, now=5000.0 + class_archive.RETRY_AFTER_S - 1)
    assert class_archive.may_try(marker, now=5000.0 + class_archive.RETRY_AFTER_S)
    assert class_archive.may_try(tmp_path / "none.failed")


def test_a_node_with_given_options_uses_them_instead(tmp_path):
    node = broker.LocalBroker(tmp_path, jvm_options=["-XX:+PrintFlagsFinal"])
    node.jar_dir = tmp_path
    assert node._java("kafka.Kafka", "x")[:2] == ["java", "-XX:+PrintFlagsFinal"]
