"""``TopicLayout``: the device topics of a job named by a pattern (``input.topic``)."""

from __future__ import annotations

import numpy as np
import pytest

from edgestream.streams.errors import TopicNameError
from edgestream.streams.topics import (
    DEFAULT_LAYOUT,
    SENSOR_DLQ,
    TopicLayout,
    device_of,
    sensor_topic,
)


@pytest.mark.parametrize("pattern", ["sensors.{device}", "plant1.{device}.imu", "{device}", "{device}-raw",
                                     "site_3.line-2.{device}.v1"])
@pytest.mark.parametrize("device", ["dev00", "a", "x" * 64, "imu_7-b"])
def test_a_device_topic_reads_back_as_its_device(pattern, device):
    layout = TopicLayout(pattern)

    topic = layout.topic(device)

    assert topic == pattern.replace("{device}", device)
    assert layout.matches(topic) and layout.device_of(topic) == device


def test_the_default_layout_is_edgestreams_own_topics():
    assert DEFAULT_LAYOUT == TopicLayout("sensors.{device}") and DEFAULT_LAYOUT.is_default
    assert sensor_topic("dev03") == "sensors.dev03" and device_of("sensors.dev03") == "dev03"
    assert not TopicLayout("plant1.{device}.imu").is_default


@pytest.mark.parametrize("topic", [
    "plant1.dev00.gyro",        # another suffix
    "plant2.dev00.imu",         # another prefix
    "plant1.a.b.imu",           # a dot inside the device part
    "plant1..imu",              # no device
    "plant1.dev00.imu\n",       # a trailing newline
    "plant1." + "x" * 65 + ".imu",  # a device id too long
    "xplant1.dev00.imu",
])
def test_topics_outside_the_pattern_are_not_device_topics(topic):
    layout = TopicLayout("plant1.{device}.imu")

    assert not layout.matches(topic)
    with pytest.raises(TopicNameError, match="not a device topic"):
        layout.device_of(topic)


@pytest.mark.parametrize(("pattern", "says"), [
    ("{device}.{device}", "once"),
    ("", "once"),
    ("sensors.dlq", "cannot be 'sensors.dlq'"),
    ("readings!", "characters a Kafka topic name cannot"),
    ("r" * 250, "too long"),
    ("gradients.all", "job's own topics"),
    ("plant 1.{device}", "characters a Kafka topic name cannot"),
    ("plant/{device}", "characters a Kafka topic name cannot"),
    ("p" * 190 + ".{device}", "too long"),
    ("gradients.{device}", "job's own topics"),
    ("inbox.x.{device}", "job's own topics"),
    ("__{device}", "job's own topics"),
])
def test_a_bad_pattern_is_refused_saying_what_is_wrong(pattern, says):
    with pytest.raises(TopicNameError, match=says):
        TopicLayout(pattern)


def test_no_device_writes_to_the_dead_letter_topic():
    for layout in (DEFAULT_LAYOUT, TopicLayout("{device}.dlq")):
        with pytest.raises(TopicNameError, match="dead-letter topic"):
            layout.topic("dlq" if layout.is_default else "sensors")
        assert not layout.matches(SENSOR_DLQ)


@pytest.mark.parametrize("device", ["a.b", "a b", "", "x" * 65, "dé"])
def test_a_device_id_that_cannot_be_in_a_topic_name_is_refused(device):
    with pytest.raises(TopicNameError, match="device id"):
        TopicLayout("plant1.{device}.imu").topic(device)


def test_a_name_without_device_is_one_topic_shared_by_every_device():
    layout = TopicLayout("plant1.readings")

    assert layout.keyed and not DEFAULT_LAYOUT.keyed
    assert layout.topic("dev00") == layout.topic("x-1") == "plant1.readings"
    assert layout.matches("plant1.readings") and not layout.matches("plant1.readings2")
    with pytest.raises(TopicNameError, match="its key"):
        layout.device_of("plant1.readings")
    with pytest.raises(TopicNameError, match="device id"):
        layout.topic("a.b")  # still a device id that a key may hold


def test_a_devices_partition_is_kafkas_default_for_its_key():
    # Values of the Java client's Utils.murmur2 (toPositive, modulo), as in Kafka's own tests:
    # murmur2("21") = -973932308, murmur2("foobar") = -790332482, murmur2("a-little-bit-long-string")
    # = -985981536.
    assert TopicLayout.partition_of("21", 1000) == (-973932308 & 0x7FFFFFFF) % 1000
    assert TopicLayout.partition_of("foobar", 12) == (-790332482 & 0x7FFFFFFF) % 12
    assert TopicLayout.partition_of("a-little-bit-long-string", 7) == (-985981536 & 0x7FFFFFFF) % 7
    spread = {TopicLayout.partition_of(f"dev{i:04d}", 12) for i in range(2000)}
    assert spread == set(range(12))


def test_murmur2_is_kafkas():
    from kafka.partitioner.default import murmur2 as kafka_python_murmur2

    from edgestream.streams.topics import murmur2

    rng = np.random.default_rng(0)
    keys = [b"", b"a", b"ab", b"abc", b"abcd", b"abcde"] + [rng.bytes(int(n)) for n in rng.integers(0, 40, 500)]
    for key in keys:
        assert murmur2(key) == kafka_python_murmur2(key) & 0xFFFFFFFF, key
