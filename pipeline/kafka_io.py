"""Kafka plumbing shared by the CLI commands: reachability, topic creation and layout
checks, producer/consumer factories, consumer-group offsets."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.errors import (
    CoordinatorLoadInProgressError,
    CoordinatorNotAvailableError,
    KafkaError,
    NoError,
    TopicAlreadyExistsError,
    for_code,
)
from kafka.structs import OffsetAndMetadata, TopicPartition

from edgestream.deploy.kafka.broker import replication_for
from edgestream.pipeline import security
from edgestream.streams import topics

log = logging.getLogger(__name__)

#: What to do when Kafka cannot be reached; part of every such error line.
KAFKA_HINT = "Start the local broker with `edgestream broker start` or check --bootstrap"
#: Seconds a command waits for the first answer of the cluster before it gives up.
PREFLIGHT_TIMEOUT_S = 5.0
#: The admin client's bootstrap limit (kafka-python retries for 30 s by default).
ADMIN_BOOTSTRAP_TIMEOUT_MS = 10_000
#: Topic kinds whose messages need one total order, hence exactly one partition: every
#: replica must apply the same gradients and control messages in the same order.
ORDERED_KINDS = frozenset({"gradients"})
#: Topic kinds that must be compacted (the latest model per key survives retention).
COMPACTED_KINDS = frozenset({"models"})


class KafkaUnreachable(ConnectionError):
    """No server of a bootstrap list answered a metadata request in time."""

    def __init__(self, bootstrap: str, detail: str) -> None:
        self.bootstrap = bootstrap
        self.detail = detail
        super().__init__(f"cannot reach Kafka at {bootstrap}: {detail}. {KAFKA_HINT}")


class TopicSetupError(RuntimeError):
    """A topic a process needs could not be created (not authorised, refused by policy)."""


class TopicLayoutError(TopicSetupError):
    """A topic exists with a layout edgestream cannot work with (partition count, cleanup policy)."""


def check_reachable(bootstrap: str, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> None:
    """Raise ``KafkaUnreachable`` unless a broker of ``bootstrap`` answers within ``timeout_s``.

    Commands call this first: Kafka clients retry a dead address for 30 s or more and
    then fail with a long traceback.
    """
    from edgestream.deploy.kafka.broker import probe

    if security.current().tls:
        security.preflight(bootstrap, timeout_s=timeout_s)  # TLS handshake and login, one line if refused
        return
    problem = probe(bootstrap, timeout_s)
    if problem is not None:
        raise KafkaUnreachable(bootstrap, problem)


def admin_client(bootstrap: str) -> KafkaAdminClient:
    return KafkaAdminClient(bootstrap_servers=bootstrap, client_id="edgestream-admin",
                            bootstrap_timeout_ms=ADMIN_BOOTSTRAP_TIMEOUT_MS, **security.current().kafka_python())


def topic_names(bootstrap: str) -> list[str]:
    """Every topic of the cluster."""
    admin = admin_client(bootstrap)
    try:
        return list(admin.list_topics())
    finally:
        admin.close()


def ensure_topics(bootstrap: str, wanted: dict[str, str], partitions: int = 1,
                  sized: Mapping[str, int] | None = None) -> list[str]:
    """Create the missing topics of ``wanted`` (name -> kind, see ``topics.topic_configs``)
    with ``partitions`` partitions (those in ``sized``: with their own count, a shared
    device topic's ``input.partitions``), then check the layout of those whose layout
    matters (a ``sized`` topic must have its count: ``TopicLayoutError`` otherwise).

    Replication follows the cluster (``replication_for`` of its live broker count),
    for topics of every kind: one broker gives RF 1 as always; three or more give RF 3
    and ``min.insync.replicas=2``, so acks=all writes survive one broker down. An
    existing topic keeps its replication (a warning names one below the cluster's).

    Idempotent and safe against concurrent creators (a topic another process created
    meanwhile is fine). Returns the topics this call created. Raises
    ``TopicLayoutError`` if an ordered topic (``ORDERED_KINDS``) does not have exactly
    ``partitions`` partitions or a ``COMPACTED_KINDS`` topic is not compacted, and
    ``TopicSetupError`` if the cluster refuses to create a topic.
    """
    admin = admin_client(bootstrap)
    try:
        existing = set(admin.list_topics())
        brokers = cluster_size(admin)
        rf, min_isr = replication_for(brokers)
        missing = {
            name: {
                "num_partitions": (sized or {}).get(name, partitions),
                "replication_factor": rf,
                "configs": replicated_configs(topics.topic_configs(kind), brokers),
            }
            for name, kind in wanted.items()
            if name not in existing
        }
        created = _create(admin, missing) if missing else []
        _check_layout(admin, wanted, partitions)
        if sized:
            _check_sized(admin, {name: n for name, n in sized.items() if name in wanted})
        if rf > 1:
            _warn_underreplicated(admin, sorted(set(wanted) & existing), rf)
        return created
    finally:
        admin.close()


def cluster_size(admin: KafkaAdminClient) -> int:
    """How many live brokers the cluster has (its unfenced brokers)."""
    brokers = admin.describe_cluster().get("brokers") or []
    return max(1, sum(1 for broker in brokers if not broker.get("is_fenced")))


def replicated_configs(configs: dict[str, str], brokers: int) -> dict[str, str]:
    """``configs`` of a new topic plus ``min.insync.replicas`` on a cluster of
    ``brokers`` brokers (only where it differs from Kafka's default of 1)."""
    _rf, min_isr = replication_for(brokers)
    return {**configs, "min.insync.replicas": str(min_isr)} if min_isr > 1 else dict(configs)


def _warn_underreplicated(admin: KafkaAdminClient, names: list[str], rf: int) -> None:
    """Warn about existing topics with fewer replicas than new ones get (made on a
    smaller cluster); they work, but lose data if their broker dies."""
    if not names:
        return
    for entry in admin.describe_topics(names):
        replicas = min((len(p.get("replica_nodes") or []) for p in entry.get("partitions") or []), default=rf)
        if entry.get("error_code", 0) == 0 and replicas < rf:
            log.warning(
                "topic %s has replication factor %d, below the cluster's %d; it is used as it is "
                "(kafka-reassign-partitions.sh raises it, or delete it to have it recreated)",
                entry["name"], replicas, rf,
            )


def _create(admin: KafkaAdminClient, missing: dict[str, dict]) -> list[str]:
    try:
        result = admin.create_topics(missing, raise_errors=False)
    except KafkaError as exc:
        if exc.retriable:
            raise  # connection trouble: reported as such by the caller
        raise _refused(sorted(missing), type(exc).__name__, str(exc)) from exc
    created: list[str] = []
    refused: list[tuple[str, str, str]] = []
    for entry in result.get("topics", []):
        error = for_code(entry["error_code"])
        if error is NoError:
            created.append(entry["name"])
        elif error is not TopicAlreadyExistsError:  # already there: created concurrently
            refused.append((entry["name"], error.__name__, entry.get("error_message") or ""))
    if refused:
        name, error, message = refused[0]
        raise _refused([r[0] for r in refused], error, message)
    if created:
        admin.wait_for_topics(created)  # leaders elected before any client uses them
    return created


def _refused(names: list[str], error: str, message: str) -> TopicSetupError:
    detail = f"{error}: {message}" if message and message not in error else error
    hint = ("grant this client CREATE on the cluster, or create them beforehand"
            if "Authorization" in error else "create them beforehand or check the cluster's topic policy")
    return TopicSetupError(f"cannot create topic(s) {', '.join(names)}: {detail}; {hint}")


#: Seconds ``_check_layout`` asks again for a new topic's configuration a broker cannot describe yet.
DESCRIBE_TIMEOUT_S = 10.0


def _check_sized(admin: KafkaAdminClient, sized: Mapping[str, int]) -> None:
    """Each topic of ``sized`` has its partition count (a shared device topic: which worker
    reads a device follows from the count)."""
    if not sized:
        return
    for entry in admin.describe_topics(sorted(sized)):
        count = len(entry.get("partitions") or [])
        want = sized.get(entry["name"])
        if entry.get("error_code", 0) == 0 and want is not None and count != want:
            raise TopicLayoutError(
                f"topic {entry['name']} has {count} partitions but the job says input.partitions={want} "
                f"(each worker reads its share of the partitions, and a device's partition follows from the "
                f"count): set input.partitions={count}, or use another topic"
            )


def _check_layout(admin: KafkaAdminClient, wanted: dict[str, str], partitions: int) -> None:
    ordered = sorted(name for name, kind in wanted.items() if kind in ORDERED_KINDS)
    if ordered:
        for entry in admin.describe_topics(ordered):
            count = len(entry.get("partitions") or [])
            if entry.get("error_code", 0) == 0 and count != partitions:
                raise TopicLayoutError(
                    f"topic {entry['name']} has {count} partitions but edgestream needs exactly {partitions} "
                    "(every replica must see one order of updates); delete it "
                    f"(kafka-topics.sh --delete --topic {entry['name']}) or use another job name (--set job.name=...)"
                )
    compacted = sorted(name for name, kind in wanted.items() if kind in COMPACTED_KINDS)
    policies: dict[str, str] = {}
    deadline = time.monotonic() + DESCRIBE_TIMEOUT_S
    while compacted and len(policies) < len(compacted):
        # A topic just created may not be described yet by the broker asked (a cluster
        # spreads new metadata in its own time): an unknown policy is asked again, never
        # taken for a wrong one.
        resources = [ConfigResource(ConfigResourceType.TOPIC, name, {"cleanup.policy": None})
                     for name in compacted if name not in policies]
        described = admin.describe_configs(resources, config_filter="all").get("topic", {})
        for name in compacted:
            value = (described.get(name, {}).get("cleanup.policy") or {}).get("value")
            if value is not None:
                policies[name] = str(value)
        if len(policies) < len(compacted):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)  # poll interval of a deadline wait for the cluster's metadata
    if compacted:
        for name in compacted:
            policy = policies.get(name, "")
            if "compact" not in policy.split(","):
                raise TopicLayoutError(
                    f"topic {name} has cleanup.policy={policy or '?'} but edgestream needs cleanup.policy=compact "
                    f"(the latest model per key must survive retention); delete it "
                    f"(kafka-topics.sh --delete --topic {name}) or use another job name (--set job.name=...)"
                )


def producer(bootstrap: str, max_message_bytes: int = topics.MAX_MESSAGE_BYTES, **kwargs) -> KafkaProducer:
    options = dict(
        bootstrap_servers=bootstrap,
        max_request_size=max_message_bytes,
        linger_ms=5,
        # Every write is acknowledged by all in-sync replicas (min.insync.replicas of
        # them on a replicated cluster), and retries after a leader change write no
        # duplicate (idempotence: producer id + sequence numbers per partition).
        acks="all",
        enable_idempotence=True,
        client_id="edgestream-producer",
        **security.current().kafka_python(),
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
        **security.current().kafka_python(),
    )
    options.update(kwargs)
    return KafkaConsumer(*topic_names, **options)


def read_range(bootstrap: str, tp: TopicPartition, first: int, end: int, *, timeout_s: float,
               max_message_bytes: int = topics.MAX_MESSAGE_BYTES, client_id: str = "edgestream-range"):
    """Yield the records of ``tp`` at offsets ``[first, end)`` in order (no group, nothing
    committed); stops early, without an error, when ``timeout_s`` has passed."""
    cons = consumer(bootstrap, max_message_bytes=max_message_bytes, client_id=client_id)
    try:
        cons.assign([tp])
        cons.seek(tp, first)
        position = first
        deadline = time.monotonic() + timeout_s
        while position < end and time.monotonic() < deadline:
            for record in cons.poll(timeout_ms=500).get(tp, []):
                if record.offset >= end:
                    return
                position = record.offset + 1
                yield record
    finally:
        cons.close()


def end_offsets(bootstrap: str, topic_names: list[str]) -> dict[TopicPartition, int]:
    """Current end offset of every partition of ``topic_names``."""
    cons = KafkaConsumer(bootstrap_servers=bootstrap, client_id="edgestream-offsets", **security.current().kafka_python())
    try:
        tps = [
            TopicPartition(t, p)
            for t in topic_names
            for p in sorted(cons.partitions_for_topic(t) or {0})
        ]
        return dict(cons.end_offsets(tps))
    finally:
        cons.close()


def start_groups_at_end(bootstrap: str, groups: dict[str, list[str]],
                        at: dict[TopicPartition, int] | None = None) -> None:
    """Commit each group's offsets at the current end of its topics.

    ``edgestream run`` does this before starting workers so a run consumes exactly the
    records produced during it, even on a cluster whose topics hold older data. ``at``:
    offsets taken earlier for some partitions, committed instead of their current end (a
    run of external devices counts what they write from exactly there).
    """
    admin = admin_client(bootstrap)
    try:
        for group, topic_names in groups.items():
            ends = end_offsets(bootstrap, topic_names)
            ends.update({tp: off for tp, off in (at or {}).items() if tp in ends})
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
    admin = admin_client(bootstrap)
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
    listed = _committed(bootstrap, [from_group, to_group], timeout_s)
    have = {tp for tp, meta in (listed.get(to_group) or {}).items() if meta.offset >= 0}
    copy = {
        f"{tp.topic}:{tp.partition}": meta.offset
        for tp, meta in (listed.get(from_group) or {}).items()
        if tp.topic in wanted and meta.offset >= 0 and tp not in have
    }
    set_group_offsets(bootstrap, to_group, copy)
    return copy


def group_positions(bootstrap: str, group: str, topic_names: list[str], timeout_s: float = 30.0) -> dict[str, int]:
    """Where ``group`` would start reading each partition of ``topic_names`` now:
    its committed offset, else the partition's beginning (``auto_offset_reset="earliest"``,
    as every edgestream consumer uses). As ``"topic:partition" -> offset``."""
    if not topic_names:
        return {}
    committed = _committed(bootstrap, [group], timeout_s).get(group) or {}
    cons = KafkaConsumer(bootstrap_servers=bootstrap, client_id="edgestream-offsets", **security.current().kafka_python())
    try:
        tps = [TopicPartition(t, p) for t in topic_names for p in sorted(cons.partitions_for_topic(t) or {0})]
        beginnings = cons.beginning_offsets(tps)
    finally:
        cons.close()
    out = {}
    for tp in tps:
        meta = committed.get(tp)
        out[f"{tp.topic}:{tp.partition}"] = meta.offset if meta is not None and meta.offset >= 0 else beginnings[tp]
    return out


def _committed(bootstrap: str, groups: list[str], timeout_s: float) -> dict:
    """``{group: {TopicPartition: OffsetAndMetadata}}`` of ``groups``, retried while the
    error is retriable (the offsets topic is created lazily on a new broker, then loads)."""
    admin = admin_client(bootstrap)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                return admin.list_group_offsets(dict.fromkeys(groups))
            except KafkaError as exc:
                if not exc.retriable or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)  # retry interval while the coordinator loads
    finally:
        admin.close()


def _offset_errors(result: dict) -> str:
    """Partition-level errors of an ``alter_group_offsets`` result ({tp: error class}), '' if none."""
    return "; ".join(f"{tp}: {err.__name__}" for tp, err in (result or {}).items() if err.errno != 0)
