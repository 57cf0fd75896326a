"""``TopicLayout``: the device topics of a job named by a pattern (``input.topic``)."""

from __future__ import annotations

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
    ("sensors", "exactly once"),
    ("{device}.{device}", "exactly once"),
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
