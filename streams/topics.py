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


def sensor_topic(device: str) -> str:
    """``sensors.<device>``: one topic per device stream."""
    return SENSOR_PREFIX + _check(device, "device id")


def device_of(topic: str) -> str:
    """Inverse of ``sensor_topic``."""
    if not topic.startswith(SENSOR_PREFIX) or topic == SENSOR_DLQ:
        raise TopicNameError(f"{topic!r} is not a device topic (sensors.<device>)")
    return topic[len(SENSOR_PREFIX) :]


def gradients_topic(job: str) -> str:
    return "gradients." + _check(job, "job name")


def models_topic(job: str) -> str:
    return "models." + _check(job, "job name")


def inbox_topic(job: str, worker: str) -> str:
    """``inbox.<job>.<worker>``: the messages addressed to one process (the ``inbox`` channel)."""
    return "inbox." + _check(job, "job name") + "." + _check(worker, "worker id")


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
    if kind == "dlq":
        return {"max.message.bytes": str(MAX_MESSAGE_BYTES)}
    raise ValueError(f"unknown topic kind {kind!r}")
