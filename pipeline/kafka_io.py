"""Kafka plumbing shared by the CLI commands: topic creation and producer/consumer factories."""

from __future__ import annotations

import time

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.errors import (
    CoordinatorLoadInProgressError,
    CoordinatorNotAvailableError,
    KafkaError,
    TopicAlreadyExistsError,
)
from kafka.structs import OffsetAndMetadata, TopicPartition

from streams import topics


def ensure_topics(bootstrap: str, wanted: dict[str, str], partitions: int = 1) -> None:
    """Create missing topics; ``wanted`` maps topic name -> kind (see ``topics.topic_configs``)."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="edgestream-admin")
    try:
        existing = set(admin.list_topics())
        missing = {
            name: {
                "num_partitions": partitions,
                "replication_factor": 1,
                "configs": topics.topic_configs(kind),
            }
            for name, kind in wanted.items()
            if name not in existing
        }
        if missing:
            try:
                admin.create_topics(missing, wait_for_metadata=True)
            except TopicAlreadyExistsError:
                pass  # created concurrently by another process
    finally:
        admin.close()


def sensor_topics_for(devices: list[str]) -> dict[str, str]:
    wanted = {topics.sensor_topic(d): "sensors" for d in devices}
    wanted[topics.SENSOR_DLQ] = "dlq"
    return wanted


def producer(bootstrap: str, max_message_bytes: int = topics.MAX_MESSAGE_BYTES, **kwargs) -> KafkaProducer:
    options = dict(
        bootstrap_servers=bootstrap,
        max_request_size=max_message_bytes,
        linger_ms=5,
        acks="all",
        client_id="edgestream-producer",
    )
    options.update(kwargs)
    return KafkaProducer(**options)


def consumer(bootstrap: str, *topic_names: str, max_message_bytes: int = topics.MAX_MESSAGE_BYTES,
             **kwargs) -> KafkaConsumer:
    options = dict(
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        max_partition_fetch_bytes=max_message_bytes,
        fetch_max_bytes=max(max_message_bytes, 52428800),
        client_id="edgestream-consumer",
    )
    options.update(kwargs)
    return KafkaConsumer(*topic_names, **options)


def end_offsets(bootstrap: str, topic_names: list[str]) -> dict[TopicPartition, int]:
    """Current end offset of every partition of ``topic_names``."""
    cons = KafkaConsumer(bootstrap_servers=bootstrap, client_id="edgestream-offsets")
    try:
        tps = [
            TopicPartition(t, p)
            for t in topic_names
            for p in sorted(cons.partitions_for_topic(t) or {0})
        ]
        return dict(cons.end_offsets(tps))
    finally:
        cons.close()


def start_groups_at_end(bootstrap: str, groups: dict[str, list[str]]) -> None:
    """Commit each group's offsets at the current end of its topics.

    ``edgestream run`` does this before starting workers so a run consumes exactly the
    records produced during it, even on a cluster whose topics hold older data.
    """
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="edgestream-admin")
    try:
        for group, topic_names in groups.items():
            ends = end_offsets(bootstrap, topic_names)
            if not any(ends.values()):
                continue  # empty topics: "earliest" already means "what this run produces"
            offsets = {tp: OffsetAndMetadata(off, "", -1) for tp, off in ends.items()}
            deadline = time.monotonic() + 30
            while True:
                try:
                    admin.alter_group_offsets(group, offsets)
                    break
                except (CoordinatorNotAvailableError, CoordinatorLoadInProgressError):
                    # The offsets topic is created lazily on a new broker, then loads.
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
    finally:
        admin.close()


def set_group_offsets(bootstrap: str, group: str, offsets: dict[str, int], timeout_s: float = 60.0) -> None:
    """Commit ``offsets`` (``"topic:partition" -> offset``) for ``group`` before it starts.

    A worker restoring a checkpoint does this so its consumers resume exactly at the
    checkpoint. Kafka refuses while the group still has members (a crashed process's
    membership lasts until its session times out), so this retries until the deadline.
    """
    if not offsets:
        return
    parsed = {}
    for key, offset in offsets.items():
        topic, _, partition = key.rpartition(":")
        parsed[TopicPartition(topic, int(partition))] = OffsetAndMetadata(int(offset), "", -1)
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="edgestream-admin")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                result = admin.alter_group_offsets(group, parsed)
                errors = _offset_errors(result)
                if not errors:
                    return
                last = errors
            except KafkaError as exc:
                last = str(exc)
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not reset offsets of consumer group {group!r}: {last}")
            time.sleep(1.0)  # retry interval while the old member's session expires
    finally:
        admin.close()


def adopt_group_offsets(
    bootstrap: str, from_group: str, to_group: str, topic_names: list[str], timeout_s: float = 30.0
) -> dict[str, int]:
    """Give ``to_group`` the committed offsets of ``from_group`` for partitions it has none of.

    The direct ingest source commits device-topic offsets for its own group; a worker
    that used to run the Faust source, or a caller that positioned the Faust group
    (``start_groups_at_end``), left them in the app's group. Partitions ``to_group``
    already has are left alone (its own commits or a restored checkpoint win).
    Returns what was copied, as ``"topic:partition" -> offset``.
    """
    wanted = set(topic_names)
    if not wanted:
        return {}
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="edgestream-admin")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                listed = admin.list_group_offsets({from_group: None, to_group: None})
                break
            except KafkaError as exc:
                # Retriable: the offsets topic is created lazily on a new broker, then loads.
                if not exc.retriable or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        admin.close()
    have = {tp for tp, meta in (listed.get(to_group) or {}).items() if meta.offset >= 0}
    copy = {
        f"{tp.topic}:{tp.partition}": meta.offset
        for tp, meta in (listed.get(from_group) or {}).items()
        if tp.topic in wanted and meta.offset >= 0 and tp not in have
    }
    set_group_offsets(bootstrap, to_group, copy)
    return copy


def _offset_errors(result: dict) -> str:
    """Partition-level errors of an ``alter_group_offsets`` result ({tp: error class}), '' if none."""
    return "; ".join(f"{tp}: {err.__name__}" for tp, err in (result or {}).items() if err.errno != 0)
