"""Kafka topic names and per-kind topic settings used across edgestream."""

from __future__ import annotations

import re

from edgestream.streams.errors import TopicNameError

SENSOR_PREFIX = "sensors."
SENSOR_DLQ = "sensors.dlq"
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

#: Message size limit for edgestream's producers, consumers and gradient/model topics.
#: The local broker is started with the same ``message.max.bytes``
#: (deploy.kafka.broker.DEFAULT_MESSAGE_MAX_BYTES); point ``--bootstrap`` at a cluster
#: configured at least as large, or lower it in the job config.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

#: Dead-letter headers (values are UTF-8 bytes).
DLQ_HEADER_REASON = "edgestream.reason"
DLQ_HEADER_DETAIL = "edgestream.detail"
DLQ_HEADER_TOPIC = "edgestream.source.topic"
DLQ_HEADER_PARTITION = "edgestream.source.partition"
DLQ_HEADER_OFFSET = "edgestream.source.offset"
DLQ_HEADER_WORKER = "edgestream.worker"
#: On a dead letter that carries records of a decoded message (re-encoded) rather than the
#: message itself: how many, and the offsets ``first-last`` of the messages they came from.
DLQ_HEADER_RECORDS = "edgestream.records"
DLQ_HEADER_OFFSETS = "edgestream.source.offsets"

#: The name of a job's one server process (the strategies with a server role), in the live
#: runtime and on the simulated clock alike (its topics and metrics carry it).
SERVER_NAME = "server"


def _check(name: str, what: str) -> str:
    if not _NAME_RE.match(name):
        raise TopicNameError(
            f"{what} {name!r} cannot be used in a topic name: use letters, digits, '_' or '-', 1-64 chars"
        )
    return name


#: The pattern of edgestream's own device topics (``input.topic``'s default).
DEFAULT_PATTERN = SENSOR_PREFIX + "{device}"
#: Kafka's topic-name limit, and the characters a name may hold.
MAX_TOPIC_CHARS = 249
_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]+$")
#: Prefixes of a job's own topics (``job.topics``): no device topic may start with one.
RESERVED_PREFIXES = ("gradients.", "models.", "control.", "inbox.", "predictions.", "__")


class TopicLayout:
    """Where each device's readings are: one topic per device named by a pattern, or one
    topic shared by every device, keyed by device.

    A pattern holding ``{device}`` once (``plant1.{device}.imu``) names one topic per
    device; the device is read back from a topic name by the same pattern. A device id is
    1-64 of letters, digits, ``_`` and ``-`` (no ``.``), so a pattern whose literal parts
    are joined by dots is never ambiguous. A name without ``{device}`` (``readings``) is
    one shared topic (``keyed``): a message's device is its key, and a device's partition
    is Kafka's default for that key (``partition_of``).

    Invariant: ``device_of(topic(d)) == d`` for every valid device id ``d`` of a
    per-device layout, and ``topic`` never returns the dead-letter topic or a job topic.
    """

    def __init__(self, pattern: str = DEFAULT_PATTERN) -> None:
        if not isinstance(pattern, str) or pattern.count("{device}") > 1 or not pattern:
            raise TopicNameError(
                f"the device topic pattern {pattern!r} must hold {{device}} once (one topic per device, "
                "e.g. 'plant1.{device}.imu') or not at all (one topic shared by every device, keyed by "
                "device, e.g. 'readings')"
            )
        self.keyed = "{device}" not in pattern
        prefix, _, suffix = pattern.partition("{device}")
        literal = prefix + suffix
        what = "shared device topic" if self.keyed else "device topic pattern"
        if literal and not _TOPIC_RE.match(literal):
            raise TopicNameError(
                f"the {what} {pattern!r} holds characters a Kafka topic name cannot: "
                "use letters, digits, '.', '_' and '-'" + ("" if self.keyed else " around {device}")
            )
        if len(literal) + (0 if self.keyed else 64) > MAX_TOPIC_CHARS:
            raise TopicNameError(
                f"the {what} {pattern!r} is too long: "
                + (f"Kafka allows {MAX_TOPIC_CHARS} characters" if self.keyed else
                   f"with a 64-character device id its topics would pass Kafka's {MAX_TOPIC_CHARS} characters")
            )
        reserved = next((r for r in RESERVED_PREFIXES if prefix.startswith(r)), None)
        if reserved is not None:
            raise TopicNameError(
                f"the {what} {pattern!r} starts with {reserved!r}, which a job's own topics "
                "use: choose another prefix"
            )
        if self.keyed and pattern == SENSOR_DLQ:
            raise TopicNameError(f"the shared device topic cannot be {pattern!r}: choose another name")
        self.pattern = pattern
        self.prefix = prefix
        self.suffix = suffix
        self.regex = re.compile(
            re.escape(pattern) + r"\Z" if self.keyed
            else re.escape(prefix) + r"([A-Za-z0-9_-]{1,64})" + re.escape(suffix) + r"\Z"
        )

    def topic(self, device: str) -> str:
        """The topic of ``device`` (``TopicNameError`` for an id that cannot be in a name, or
        whose topic would be the dead-letter topic); a keyed layout's one topic."""
        name = self.prefix + _check(device, "device id") + self.suffix
        if self.keyed:
            return self.pattern
        if name == SENSOR_DLQ:
            raise TopicNameError(
                f"device id {device!r} would write to the dead-letter topic {SENSOR_DLQ}: choose another id"
            )
        return name

    def matches(self, topic: str) -> bool:
        """Whether ``topic`` is a device topic of this layout (never the dead-letter topic)."""
        return topic != SENSOR_DLQ and self.regex.match(topic) is not None

    def device_of(self, topic: str) -> str:
        """Inverse of ``topic``; ``TopicNameError`` if ``topic`` is not a device topic here, or
        is the shared topic (whose messages name their device in their key)."""
        found = self.regex.match(topic)
        if found is None or topic == SENSOR_DLQ:
            raise TopicNameError(f"{topic!r} is not a device topic ({self.pattern})")
        if self.keyed:
            raise TopicNameError(f"{topic!r} is shared by every device: a message's device is its key")
        return found.group(1)

    @staticmethod
    def partition_of(device: str, partitions: int) -> int:
        """The partition of a shared topic with ``partitions`` partitions that a message keyed
        ``device`` goes to: Kafka's default partitioner (``murmur2`` of the key's UTF-8 bytes,
        made positive, modulo the partition count), as the Java, kafka-python and aiokafka
        producers compute it."""
        return (murmur2(device.encode()) & 0x7FFFFFFF) % partitions

    @property
    def is_default(self) -> bool:
        return self.pattern == DEFAULT_PATTERN

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TopicLayout) and other.pattern == self.pattern

    def __hash__(self) -> int:
        return hash(self.pattern)

    def __repr__(self) -> str:
        return f"TopicLayout({self.pattern!r})"


def murmur2(data: bytes) -> int:
    """MurmurHash2 of ``data`` as Kafka's Java client computes it (``Utils.murmur2``: seed
    0x9747b28c, little-endian 4-byte blocks), as an unsigned 32-bit value; Kafka's default
    partitioner takes it ``& 0x7fffffff`` modulo the partition count."""
    m, mask = 0x5BD1E995, 0xFFFFFFFF
    length = len(data)
    h = (0x9747B28C ^ length) & mask
    body = length & ~3
    for i in range(0, body, 4):
        k = (int.from_bytes(data[i : i + 4], "little") * m) & mask
        k ^= k >> 24
        k = (k * m) & mask
        h = ((h * m) & mask) ^ k
    tail = length - body
    if tail == 3:
        h ^= data[body + 2] << 16
    if tail >= 2:
        h ^= data[body + 1] << 8
    if tail >= 1:
        h ^= data[body]
        h = (h * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    return h ^ (h >> 15)


#: edgestream's own layout: ``sensors.<device>``.
DEFAULT_LAYOUT = TopicLayout()


def sensor_topic(device: str) -> str:
    """``sensors.<device>``: one topic per device stream (the default layout's)."""
    return DEFAULT_LAYOUT.topic(device)


def device_of(topic: str) -> str:
    """Inverse of ``sensor_topic``."""
    return DEFAULT_LAYOUT.device_of(topic)


def gradients_topic(job: str) -> str:
    return "gradients." + _check(job, "job name")


def models_topic(job: str) -> str:
    return "models." + _check(job, "job name")


def inbox_topic(job: str, worker: str) -> str:
    """``inbox.<job>.<worker>``: the messages addressed to one process (the ``inbox`` channel)."""
    return "inbox." + _check(job, "job name") + "." + _check(worker, "worker id")


def predictions_topic(job: str) -> str:
    """``predictions.<job>``: every trained record's prediction (``serve.predictions``)."""
    return "predictions." + _check(job, "job name")


def gradients_dlq_topic(job: str) -> str:
    return "gradients." + _check(job, "job name") + ".dlq"


def topic_configs(kind: str) -> dict[str, str]:
    """Topic-level settings edgestream creates each kind of topic with."""
    if kind == "sensors":
        return {"max.message.bytes": str(MAX_MESSAGE_BYTES)}
    if kind == "gradients":
        return {"max.message.bytes": str(MAX_MESSAGE_BYTES), "retention.ms": str(6 * 3600 * 1000)}
    if kind == "models":
        return {"max.message.bytes": str(MAX_MESSAGE_BYTES), "cleanup.policy": "compact"}
    if kind in ("dlq", "predictions"):
        return {"max.message.bytes": str(MAX_MESSAGE_BYTES)}
    raise ValueError(f"unknown topic kind {kind!r}")
