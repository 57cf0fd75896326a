"""Who may do what on a secure cluster: the principals and ACLs a job needs (docs/security.md).

``job_grants(cfg)`` is pure: the grants of one job. ``apply(bootstrap, cfg, password_dir)``
creates the job's topics (as the admin that runs it; replicated as the cluster's size
says), the ACLs and a SCRAM-SHA-512 user per principal (passwords generated into
``password_dir/<user>.password`` if absent, mode 0600), and waits until every broker
of the cluster knows them. Principals:

* ``<device>``: one per device; writes only ``sensors.<device>``.
* ``<job>-devices``: a gateway for all the job's devices (``edgestream simulate`` / ``replay``);
  writes the job's device topics and nothing else.
* ``<job>-workers``: the job's workers and server; read the device topics, write the
  dead-letter topics, read and write the job's update topics (``gradients``, ``models``,
  ``control``, inboxes), write ``predictions.<job>`` (with or without ``serve.predictions``:
  `edgestream serve` logs in as this principal too), use the consumer groups
  ``edgestream-<job>-*`` (and ``serve.group`` where it is set outside them).

Nobody else (no ACL: the authorizer denies) reads or writes them; the admin is a super user.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from edgestream.job.config import JobConfig
from edgestream.job.topics import job_topics, sensor_partitions, training_topics
from edgestream.streams import topics

#: kafka-python's names of the operations granted.
DEVICE_OPS = ("WRITE", "DESCRIBE")
READ_OPS = ("READ", "DESCRIBE", "DESCRIBE_CONFIGS")
READ_WRITE_OPS = ("READ", "WRITE", "DESCRIBE", "DESCRIBE_CONFIGS")


@dataclass(frozen=True)
class Grant:
    """``principal`` (a user name) may do ``operations`` on ``resource`` (``topic`` or
    ``group``) ``name``, matched literally or as a prefix."""

    user: str
    resource: str
    name: str
    operations: tuple[str, ...]
    prefixed: bool = False


def workers_user(cfg: JobConfig) -> str:
    return f"{cfg.job.name}-workers"


def devices_user(cfg: JobConfig) -> str:
    return f"{cfg.job.name}-devices"


def job_grants(cfg: JobConfig) -> list[Grant]:
    job = cfg.job.name
    devices = cfg.devices.device_ids()
    workers, gateway = workers_user(cfg), devices_user(cfg)
    topic = cfg.input.layout().topic  # input.topic: each device's topic
    grants = [Grant(d, "topic", topic(d), DEVICE_OPS) for d in devices]
    grants += [Grant(gateway, "topic", topic(d), DEVICE_OPS) for d in devices]
    grants += [Grant(workers, "topic", topic(d), READ_OPS) for d in devices]
    grants.append(Grant(workers, "topic", topics.SENSOR_DLQ, ("WRITE", "DESCRIBE", "DESCRIBE_CONFIGS")))
    # The gateway writes dead letters too: what the MQTT bridge cannot put in a device topic.
    grants.append(Grant(gateway, "topic", topics.SENSOR_DLQ, ("WRITE", "DESCRIBE", "DESCRIBE_CONFIGS")))
    for topic in training_topics(job, []):
        grants.append(Grant(workers, "topic", topic, READ_WRITE_OPS))
    grants.append(Grant(workers, "topic", f"inbox.{job}.", READ_WRITE_OPS, prefixed=True))
    for topic in serve_topics(cfg):  # the workers (serve.predictions) and `edgestream serve` write them
        grants.append(Grant(workers, "topic", topic, ("WRITE", "DESCRIBE", "DESCRIBE_CONFIGS")))
    grants.append(Grant(workers, "group", f"edgestream-{job}-", ("READ", "DESCRIBE"), prefixed=True))
    serve_group = cfg.serve.group_of(cfg)
    if cfg.train.enabled and not serve_group.startswith(f"edgestream-{job}-"):  # serve.group outside the prefix
        grants.append(Grant(workers, "group", serve_group, ("READ", "DESCRIBE")))
    return grants


def serve_topics(cfg: JobConfig) -> dict[str, str]:
    """``predictions.<job>`` for every job that trains: its workers write it with
    ``serve.predictions``, and `edgestream serve` (which logs in as the workers' principal) writes
    it whatever that key says, so ``apply`` creates it and grants it either way."""
    if not cfg.train.enabled:
        return {}
    return {topics.predictions_topic(cfg.job.name): "predictions"}


def users(cfg: JobConfig) -> list[str]:
    return [*cfg.devices.device_ids(), devices_user(cfg), workers_user(cfg)]


def password_for(password_dir: Path, user: str) -> str:
    """The password of ``user`` from ``password_dir/<user>.password``, made (0600) if absent."""
    path = password_dir / f"{user}.password"
    if not path.exists():
        password_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(24) + "\n")
    return path.read_text().strip()


#: How long ``apply`` waits for every broker to accept the new logins (metadata propagation).
PROPAGATION_TIMEOUT_S = 30.0


def apply(bootstrap: str, cfg: JobConfig, password_dir: Path,
          propagation_timeout_s: float = PROPAGATION_TIMEOUT_S) -> dict[str, int]:
    """Create the job's topics, users and ACLs on the cluster (as this process's principal,
    which must be allowed to: the admin). Idempotent. Returns counts of what it set.

    Topics are replicated as the cluster's size says (``kafka_io.ensure_topics``: RF 3,
    ``min.insync.replicas`` 2 on three brokers or more). The ACLs are created before the
    users, and on a SASL cluster ``apply`` returns once every live broker accepts the login
    of the last user: a broker applies metadata in order, so it then knows the ACLs too,
    and a principal may use any broker of a cluster as soon as ``apply`` returned."""
    from kafka.admin import (
        ACL,
        ACLOperation,
        ACLPermissionType,
        ResourcePattern,
        ResourceType,
        ScramMechanism,
        UserScramCredentialUpsertion,
    )

    from edgestream.pipeline.kafka_io import admin_client, ensure_topics

    ensure_topics(bootstrap, {**job_topics(cfg, training=True), **serve_topics(cfg)}, sized=sensor_partitions(cfg))
    admin = admin_client(bootstrap)
    try:
        acls = []
        for grant in job_grants(cfg):
            pattern = ResourcePattern(ResourceType.TOPIC if grant.resource == "topic" else ResourceType.GROUP,
                                      grant.name, _pattern_type(grant.prefixed))
            for op in grant.operations:
                acls.append(ACL(f"User:{grant.user}", "*", ACLOperation[op], ACLPermissionType.ALLOW, pattern))
        result = admin.create_acls(acls)
        failed = result.get("failed", [])
        if failed:
            raise RuntimeError(f"{len(failed)} ACL(s) were refused, e.g. {failed[0]}")
        upserts = [UserScramCredentialUpsertion(user, ScramMechanism.SCRAM_SHA_512, password_for(password_dir, user))
                   for user in users(cfg)]
        admin.alter_user_scram_credentials(upserts)
        brokers = [f"{b['host']}:{b['port']}" for b in admin.describe_cluster().get("brokers") or []
                   if not b.get("is_fenced")]
    finally:
        admin.close()
    last = users(cfg)[-1]
    wait_for_login(brokers, last, password_dir / f"{last}.password", propagation_timeout_s)
    return {"users": len(upserts), "acls": len(acls)}


def wait_for_login(brokers: list[str], user: str, password_file: Path, timeout_s: float) -> None:
    """Wait until every broker of ``brokers`` (``host:port``) accepts the SCRAM login of
    ``user`` (over this process's TLS settings); ``RuntimeError`` naming the broker that
    still refuses after ``timeout_s``. Nothing to wait for without SASL."""
    import dataclasses
    import time

    from edgestream.pipeline import security

    mine = security.current()
    if not mine.sasl:
        return
    settings = dataclasses.replace(mine, username=user, password_file=str(password_file))
    deadline = time.monotonic() + timeout_s
    for broker in brokers:
        while True:
            try:
                security.preflight(broker, settings, timeout_s=5.0)
                break
            except security.SecurityError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the broker at {broker} still refuses the new login of {user!r} "
                                       f"{timeout_s:.0f}s after it was created: {exc}") from None
            time.sleep(0.2)  # poll interval of a deadline wait


def _pattern_type(prefixed: bool):
    from kafka.admin import ACLResourcePatternType

    return ACLResourcePatternType.PREFIXED if prefixed else ACLResourcePatternType.LITERAL
