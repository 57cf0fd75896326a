"""Launches a real single-node Apache Kafka broker (KRaft) from Maven Central artefacts.

The jars are resolved once with Maven from ``deploy/kafka/pom.xml`` (the only place
the Kafka version is written; ``EDGESTREAM_KAFKA_VERSION`` overrides it for one run, to
test against another release) into a user cache dir, one directory per version.
``LocalBroker`` formats storage, starts ``kafka.Kafka`` on free loopback ports (kept
beside its data in ``address.json``: a restart on the same data reuses them) with a
capped heap, waits until the broker answers a metadata request, and stops it (the
whole process group) on ``stop()``.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgestream.deploy.kafka import class_archive, wire

HERE = Path(__file__).resolve().parent
POM = HERE / "pom.xml"
LOG4J2 = HERE / "log4j2.yaml"
#: Environment variable naming another Kafka release for the local broker.
KAFKA_VERSION_ENV = "EDGESTREAM_KAFKA_VERSION"

#: Broker-wide message size limit; gradient topics need more than Kafka's ~1 MiB default.
#: Producers (max_request_size) and consumers (fetch sizes) are configured from the
#: same number in streams.topics.
DEFAULT_MESSAGE_MAX_BYTES = 16 * 1024 * 1024


def new_cluster_id() -> str:
    """A fresh Kafka cluster id, as ``kafka-storage random-uuid`` makes one (base64url
    UUID without padding), never starting with '-' (it would be parsed as an option)."""
    cluster_id = "-"
    while cluster_id.startswith("-"):
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    return cluster_id


class BrokerError(RuntimeError):
    """The local broker could not be resolved, started or reached; the message says why."""


class PortClash(BrokerError):
    """A node could not start because another process holds one of its ports."""


def pinned_kafka_version() -> str:
    """The Kafka version pinned in pom.xml."""
    match = re.search(r"<kafka.version>([^<]+)</kafka.version>", POM.read_text())
    if not match:
        raise BrokerError(f"no <kafka.version> in {POM}")
    return match.group(1)


def kafka_version() -> str:
    """The Kafka version the local broker runs: ``EDGESTREAM_KAFKA_VERSION`` if set (to run
    the suite against another release, e.g. 3.9.1), else the one pinned in pom.xml."""
    override = os.environ.get(KAFKA_VERSION_ENV, "").strip()
    if override:
        if not re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+", override):
            raise BrokerError(f"{KAFKA_VERSION_ENV}={override!r} is not a Kafka release like 3.9.1")
        return override
    return pinned_kafka_version()


def cache_root() -> Path:
    base = os.environ.get("EDGESTREAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "edgestream"
    )
    return Path(base)


def resolve_jars(cache_dir: Path | None = None, quiet: bool = True) -> Path:
    """Resolve the broker classpath into the cache (once) and return the jar directory.

    Keyed by a hash of pom.xml, so changing the version or a dependency re-resolves.
    """
    cache_dir = cache_dir or cache_root()
    pom_key = hashlib.sha256(POM.read_bytes()).hexdigest()[:12]
    version = kafka_version()
    target = cache_dir / f"kafka-{version}-{pom_key}"
    if (target / ".complete").exists():
        return target
    if shutil.which("mvn") is None:
        raise BrokerError("Maven ('mvn') is not on PATH; it is needed once to fetch the Kafka jars")
    if shutil.which("java") is None:
        raise BrokerError("Java ('java', JDK 17+) is not on PATH; the Kafka broker runs on the JVM")
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="kafka-jars-", dir=cache_dir))
    cmd = [
        "mvn", "-B", "-f", str(POM), "dependency:copy-dependencies",
        "-DincludeScope=runtime", f"-DoutputDirectory={staging}", f"-Dkafka.version={version}",
    ]
    if quiet:
        cmd.insert(1, "-q")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise BrokerError(
            "resolving the Kafka broker from Maven Central failed "
            f"(mvn exit {proc.returncode}); is Maven Central reachable?\n{tail}"
        )
    (staging / ".complete").touch()
    try:
        staging.rename(target)
    except OSError:  # another process won the race; theirs is complete too
        shutil.rmtree(staging, ignore_errors=True)
    return target


def ensure_class_archive(jar_dir: Path, timeout_s: float = 180.0) -> Path | None:
    """The class archive of ``jar_dir`` for this JDK (``class_archive.py``), made now if
    there is none: a broker is started on a scratch directory with the JVM told to archive
    the classes it loaded, and stopped cleanly (the JVM writes the archive as it exits).
    None if the archive is turned off or could not be made (the reason is kept in the
    ``.failed`` marker, and brokers start without it until ``class_archive.may_try``)."""
    if not class_archive.enabled():
        return None
    archive = class_archive.archive_path(jar_dir)
    failed = class_archive.failed_path(archive)
    if archive.exists():
        return archive
    if not class_archive.may_try(failed):
        return None
    with class_archive.creation_lock(jar_dir):
        if archive.exists():
            return archive
        if not class_archive.may_try(failed):  # another process failed meanwhile
            return None
        part = archive.with_name(f"{archive.name}.{os.getpid()}.part")
        scratch = Path(tempfile.mkdtemp(prefix="kafka-classes-"))
        node = LocalBroker(scratch / "node", jvm_options=[f"-XX:ArchiveClassesAtExit={part}"])
        node.jar_dir = jar_dir  # the classpath the archive is for
        reason = ""
        try:
            node.start(timeout_s=timeout_s)
            assert node.proc is not None
            os.killpg(node.proc.pid, signal.SIGTERM)  # a clean exit: the JVM writes the archive
            code = node.proc.wait(timeout=timeout_s)
            node.proc = None
            if code in (0, 128 + signal.SIGTERM) and part.exists():
                os.replace(part, archive)
                failed.unlink(missing_ok=True)
                return archive
            reason = f"the archiving broker exited with code {code} and wrote no archive"
        except (BrokerError, subprocess.TimeoutExpired, OSError) as exc:
            reason = f"making the archive failed: {exc}"
        finally:
            node.stop()
            part.unlink(missing_ok=True)
            shutil.rmtree(scratch, ignore_errors=True)
        class_archive.record_failure(failed, reason)
        return None


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports: every socket stays bound until all are picked, so the
    kernel cannot hand the same port out twice (it may once a socket is closed)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


#: Beside a node's data: the address it was started on (``saved_address``).
ADDRESS_FILE = "address.json"


def saved_address(work_dir: Path) -> dict[str, Any]:
    """The host, client port and controller port a node's data was last started with
    (``{}``: never started, or an unreadable file)."""
    try:
        data = json.loads((Path(work_dir) / ADDRESS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if k in ("host", "port", "controller_port")} if isinstance(data, dict) else {}


def save_address(work_dir: Path, host: str, port: int, controller_port: int) -> None:
    """Keep a node's address beside its data, so a restart on that data reuses it."""
    path = Path(work_dir) / ADDRESS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"host": host, "port": port, "controller_port": controller_port}))
    tmp.replace(path)


def port_owner(port: int) -> str:
    """Who listens on TCP ``port`` on this host, in words (``pid 123 (java ...)``), from
    /proc; "another process" where that cannot be read."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines, None)
                for line in lines:
                    fields = line.split()
                    # local_address is HEXIP:HEXPORT; state 0A is LISTEN
                    if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        except OSError:
            continue
    if inodes:
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit():
                continue
            try:
                fds = list((pid_dir / "fd").iterdir())
            except OSError:
                continue
            links = set()
            for fd in fds:
                try:
                    links.add(os.readlink(fd))
                except OSError:
                    continue  # closed meanwhile
            if any(f"socket:[{inode}]" in links for inode in inodes):
                try:
                    argv = (pid_dir / "cmdline").read_bytes().split(b"\0")
                    command = " ".join(a.decode(errors="replace") for a in argv[:3] if a)
                except OSError:
                    command = "?"
                return f"pid {pid_dir.name} ({command[:80]})"
    return "another process"


#: Metadata v4 (Kafka >= 1.0, still served by 4.x, which dropped v0-v3): the request
#: names no topics, so the answer is the broker list only.
_METADATA_API_KEY = 3
_METADATA_VERSION = 4
_PROBE_CORRELATION_ID = 0x45533031  # any value; the reply must echo it
_METADATA_BODY = struct.pack(">ib", 0, 0)  # topics: an empty array (not null = all); no auto-create
_PROBE_CLIENT_ID = b"edgestream-probe"
_PROBE_MAX_REPLY = 64 * 1024 * 1024  # a size beyond this (or below 12) is not a metadata reply


def host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError if it is neither."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _metadata_brokers(host: str, port: int, deadline: float,
                      wrap: Callable[[socket.socket, str], socket.socket] | None = None) -> tuple[int, str | None]:
    """(number of brokers listed, None) from a metadata reply of ``host:port``, or
    (0, what went wrong). ``wrap(sock, host)``, if given, turns the connected socket into
    the one to ask on (e.g. TLS and a login; it raises OSError if it cannot)."""
    try:
        with socket.create_connection((host, port), timeout=max(0.01, deadline - time.monotonic())) as raw:
            raw.settimeout(max(0.01, deadline - time.monotonic()))
            sock = wrap(raw, host) if wrap is not None else raw
            try:
                reply = wire.exchange(sock, _METADATA_API_KEY, _METADATA_VERSION, _PROBE_CORRELATION_ID,
                                      _METADATA_BODY, client_id=_PROBE_CLIENT_ID,
                                      min_size=12, max_size=_PROBE_MAX_REPLY, deadline=deadline)
            except wire.BadReplySize as exc:
                if exc.tls_record:
                    return 0, (f"{host}:{port} speaks TLS, not plaintext: set kafka.security_protocol "
                               "(SSL or SASL_SSL) and kafka.ssl_cafile")
                return 0, f"{host}:{port} is not a Kafka broker (reply of {exc.size} bytes)"
            except wire.OtherCorrelation:
                return 0, f"{host}:{port} is not a Kafka broker (unexpected reply)"
            finally:
                if sock is not raw:
                    sock.close()
    except TimeoutError:
        return 0, f"{host}:{port} did not answer a metadata request in time"
    except ConnectionRefusedError:
        return 0, f"connection to {host}:{port} refused"
    except OSError as exc:
        return 0, f"{host}:{port}: {exc.strerror or exc}"
    _throttle, brokers = struct.unpack(">ii", reply[:8])
    return brokers, None


def _probe_one(host: str, port: int, deadline: float) -> str | None:
    """None if the broker at ``host:port`` lists at least one broker in a metadata reply."""
    brokers, problem = _metadata_brokers(host, port, deadline)
    if problem is None and brokers <= 0:
        return f"{host}:{port} answered but lists no brokers yet (still starting?)"
    return problem


def broker_count(address: str, timeout_s: float = 2.0,
                 wrap: Callable[[socket.socket, str], socket.socket] | None = None) -> tuple[int, str | None]:
    """How many live brokers the server at ``address`` (one ``host:port``) lists in its
    metadata: (count, None), or (0, what went wrong). A raw wire-protocol probe like
    ``probe``; a KRaft cluster lists only registered, unfenced brokers. For a TLS
    listener, ``wrap(sock, host)`` makes the TLS connection (and logs in) on the
    connected socket, raising OSError (its message the problem) if it cannot."""
    try:
        host, port = host_port(address)
    except ValueError as exc:
        return 0, str(exc)
    return _metadata_brokers(host, port, time.monotonic() + timeout_s, wrap)


def probe(bootstrap: str, timeout_s: float = 2.0) -> str | None:
    """Ask the servers of ``bootstrap`` (``host:port[,host:port...]``) for cluster metadata.

    Returns None as soon as one answers with a broker list, else what went wrong (one
    line, the last server's problem). Speaks the Kafka wire protocol over a plain socket,
    so the whole probe (connect, request, reply) stays within ``timeout_s`` and needs no
    client library: a client's bootstrap retries for 30 s before it gives up.
    """
    deadline = time.monotonic() + timeout_s
    problem = f"no server in {bootstrap!r}"
    for address in bootstrap.split(","):
        if not address.strip():
            continue
        try:
            host, port = host_port(address)
        except ValueError as exc:
            return str(exc)
        problem = _probe_one(host, port, deadline) or ""
        if not problem:
            return None
        if time.monotonic() >= deadline:
            break
    return problem


def metadata_ok(bootstrap: str, timeout_s: float = 2.0) -> bool:
    """True if a broker at ``bootstrap`` answers a metadata request within ``timeout_s``."""
    return probe(bootstrap, timeout_s) is None


@dataclass
class NodeInfo:
    """One node of a local cluster, as saved in ``broker.json``."""

    node_id: int
    pid: int
    bootstrap: str
    controller_port: int
    work_dir: str
    log_file: str
    netns: str | None = None


@dataclass
class BrokerInfo:
    """What a running local broker (or cluster) is: enough to find, use and stop it later.

    A single broker has ``nodes == []``. A cluster lists every node in ``nodes``; then
    ``bootstrap`` is the comma list of all nodes, ``pid``/``controller_port`` are the
    first node's, and ``work_dir`` is the cluster's dir. Old single-broker files (no
    ``nodes`` key) load unchanged.
    """

    pid: int
    bootstrap: str
    controller_port: int
    work_dir: str
    log_file: str
    version: str
    nodes: list[NodeInfo] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        """Every JVM of this broker or cluster."""
        return [node.pid for node in self.nodes] if self.nodes else [self.pid]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> BrokerInfo:
        data = json.loads(path.read_text())
        data["nodes"] = [NodeInfo(**node) for node in data.get("nodes") or []]
        return cls(**data)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); treat it as gone.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def is_broker_pid(pid: int) -> bool:
    """True if ``pid`` is alive and is a Kafka broker JVM (``kafka.Kafka`` on its command line).

    A broker.json outlives its broker; after a reboot or a crash its pid may belong to
    another process, which must be neither reported as the broker nor signalled.
    """
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"kafka.Kafka" in cmdline.read()
    except OSError:
        return True  # no /proc (not Linux) or not ours to read: trust the pid


def _said(exc: BaseException) -> str:
    """``exc`` in one line, its class named once (kafka-python's errors name it themselves)."""
    text = str(exc).strip() or type(exc).__name__
    return text if text.startswith(type(exc).__name__) else f"{type(exc).__name__}: {text}"


#: The super user of a secure local broker (SCRAM-SHA-512, made when its storage is formatted).
ADMIN_USER = "admin"


@dataclass
class BrokerSecurity:
    """A secure local broker (docs/security.md): its client listener speaks ``SASL_SSL``
    (TLS with the certificates of ``deploy.kafka.tls``, SCRAM-SHA-512 logins), its
    controller listener mutual TLS; the ``StandardAuthorizer`` denies what no ACL allows.
    ``admin_password`` is the password of ``ADMIN_USER``, a super user; the broker's own
    certificate principal is the other one."""

    pki_dir: Path
    admin_password: str
    authorizer: bool = True

    def client_kwargs(self) -> dict[str, Any]:
        """kafka-python keyword arguments that log in as the admin."""
        import ssl

        context = ssl.create_default_context(cafile=str(self.pki_dir / "ca.pem"))
        return {"security_protocol": "SASL_SSL", "ssl_context": context, "sasl_mechanism": "SCRAM-SHA-512",
                "sasl_plain_username": ADMIN_USER, "sasl_plain_password": self.admin_password}

    def check_covers(self, hosts: list[str]) -> None:
        """``BrokerError`` unless the brokers' certificate names every one of ``hosts`` (the
        addresses nodes advertise and bind their controller listeners to) in its
        subjectAltName: clients and peer nodes check it (TLS hostname verification)."""
        from edgestream.deploy.kafka.tls import PkiError, uncovered

        cert = self.pki_dir / "broker.pem"
        try:
            missing = uncovered(cert, hosts)
        except PkiError as exc:
            raise BrokerError(str(exc)) from None
        if missing:
            raise BrokerError(
                f"the broker certificate {cert} does not name {', '.join(missing)} (nodes advertise "
                f"{', '.join(dict.fromkeys(hosts))}): clients and peer nodes would refuse it; make the "
                "certificates with every node's address (deploy.kafka.tls.make_pki(dir, hosts))")

    def broker_count(self, bootstrap: str, timeout_s: float = 3.0) -> tuple[int, str | None]:
        """How many live (unfenced) brokers the cluster at ``bootstrap`` has, asked over TLS
        as the admin: (count, None) or (0, what went wrong). The login and metadata come
        from ``bootstrap`` itself; the broker list from any node of the cluster."""
        from kafka import KafkaAdminClient

        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="edgestream-broker-ready",
                                     bootstrap_timeout_ms=int(timeout_s * 1000),
                                     request_timeout_ms=int(max(timeout_s, 1.0) * 1000), **self.client_kwargs())
        except Exception as exc:  # noqa: BLE001 - any failure is "not ready", said in one line
            return 0, f"{bootstrap}: no TLS login as {ADMIN_USER} ({_said(exc)})"
        try:
            brokers = admin.describe_cluster().get("brokers") or []
        except Exception as exc:  # noqa: BLE001
            return 0, f"{bootstrap}: describing the cluster failed ({_said(exc)})"
        finally:
            admin.close()
        return sum(1 for broker in brokers if not broker.get("is_fenced")), None


class LocalBroker:
    """One KRaft Kafka node (combined broker + controller).

    Alone (the default) it is a single-node cluster on 127.0.0.1 with free ports. As a
    member of a ``LocalCluster`` it gets its ``node_id``, the cluster's ``quorum_voters``
    and the cluster's ``cluster_id``. ``host`` is the address it advertises and binds
    its controller listener to; ``bind_host`` (default ``host``) is where its PLAINTEXT
    listener listens (the testbed binds ``0.0.0.0`` so an alias address on the same
    host reaches it). With ``netns`` every java command (storage format included) runs
    inside that network namespace (``ip netns exec NETNS``); readiness is probed from
    the caller's namespace, which must reach ``host:port`` (the testbed's bridge).

    Invariant: after ``start()`` returns, the node answers metadata requests at
    ``bootstrap``; ``stop()`` leaves no process of it behind.
    """

    def __init__(
        self,
        work_dir: Path,
        port: int | None = None,
        controller_port: int | None = None,
        heap: str = "512m",
        message_max_bytes: int = DEFAULT_MESSAGE_MAX_BYTES,
        extra_config: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        bind_host: str | None = None,
        netns: str | None = None,
        node_id: int = 1,
        quorum_voters: str | None = None,
        cluster_id: str | None = None,
        security: BrokerSecurity | None = None,
        jvm_options: list[str] | None = None,
    ) -> None:
        self.work_dir = Path(work_dir).resolve()
        #: Extra JVM options of every java command of this node; ``None``: the class
        #: archive's (``class_archive.py``), made on the first start if need be.
        self.jvm_options = jvm_options
        self.security = security
        self.host = host
        self.bind_host = bind_host or host
        self.netns = netns
        self.node_id = node_id
        # The address is part of the data's identity: a node restarted on its storage comes
        # back where its clients (a running job) still look for it.
        saved = saved_address(self.work_dir)
        if saved.get("host", host) != host:
            saved = {}
        port = port or saved.get("port")
        controller_port = controller_port or saved.get("controller_port")
        #: Both ports picked here (none given or saved, no netns, no cluster's voters): ``start``
        #: may pick others if something takes one before the JVM binds it.
        self.ports_picked = not port and not controller_port and not netns and quorum_voters is None
        if not port or not controller_port:
            spare = free_ports(2)
            port, controller_port = port or spare[0], controller_port or spare[1]
        self.port, self.controller_port = port, controller_port
        self.quorum_voters = quorum_voters or f"{node_id}@{host}:{self.controller_port}"
        #: Where this launch's lines begin in ``broker.log`` (the file is appended to).
        self._log_offset = 0
        self.heap = heap
        self.message_max_bytes = message_max_bytes
        self.extra_config = extra_config or {}
        self.given_cluster_id = cluster_id
        self.proc: subprocess.Popen | None = None
        self.jar_dir: Path | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.work_dir / "broker.log"

    def properties(self) -> dict[str, str]:
        """The node's server.properties as a dict (``extra_config`` applied last)."""
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": self.quorum_voters,
            "listeners": f"PLAINTEXT://{self.bind_host}:{self.port},"
                         f"CONTROLLER://{self.host}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self.host}:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.work_dir / "data"),
            "num.partitions": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "true",
            "message.max.bytes": str(self.message_max_bytes),
            "replica.fetch.max.bytes": str(self.message_max_bytes),
            "log.retention.hours": "168",
            "log.segment.bytes": str(64 * 1024 * 1024),
            "num.network.threads": "2",
            "num.io.threads": "2",
        }
        if self.security is not None:
            props.update(self._secure_properties())
        props.update(self.extra_config)
        return props

    def _secure_properties(self) -> dict[str, str]:
        assert self.security is not None
        pki = self.security.pki_dir
        jaas = ('org.apache.kafka.common.security.scram.ScramLoginModule required '
                f'username="{ADMIN_USER}" password="{self.security.admin_password}";')
        props = {
            "listeners": f"SASL_SSL://{self.bind_host}:{self.port},CONTROLLER://{self.host}:{self.controller_port}",
            "advertised.listeners": f"SASL_SSL://{self.host}:{self.port}",
            "inter.broker.listener.name": "SASL_SSL",
            # The controller listener: mutual TLS, the broker's own certificate (its principal
            # a super user); nothing else can log in there.
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:SSL",
            "listener.name.controller.ssl.client.auth": "required",
            "sasl.enabled.mechanisms": "SCRAM-SHA-512",
            "sasl.mechanism.inter.broker.protocol": "SCRAM-SHA-512",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": jaas,
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(pki / "broker-keystore.pem"),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(pki / "ca.pem"),
            "ssl.client.auth": "none",
        }
        if self.security.authorizer:
            props.update({
                "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                "super.users": f"User:{ADMIN_USER};User:CN=edgestream broker",
                "allow.everyone.if.no.acl.found": "false",
            })
        return props

    def _properties(self) -> str:
        return "".join(f"{k}={v}\n" for k, v in self.properties().items())

    def _java(self, main: str, *args: str, heap: str = "256m") -> list[str]:
        """A java command line for ``main``, inside ``netns`` if the node has one."""
        assert self.jar_dir is not None
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        return [
            *prefix, "java", *(self.jvm_options or []), f"-Xmx{heap}", "-Xms64m",
            "-XX:+UseG1GC", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={LOG4J2}",
            "-cp", f"{self.jar_dir}/*", main, *args,
        ]

    #: Starts on new ports after a port clash, when this node picked its ports itself.
    PORT_RETRIES = 3

    def start(self, timeout_s: float = 90.0) -> LocalBroker:
        """Resolve jars, format storage, start the broker and wait until it is ready.

        Ports this node picked itself are free when picked, but another process may bind
        one before the JVM does (two runs starting at once, a client's ephemeral port). Such
        a node starts again on newly picked ports, up to ``PORT_RETRIES`` times; a port the
        caller gave, or the saved address of existing data, is never changed."""
        for attempt in range(self.PORT_RETRIES + 1):
            try:
                self.launch()
                self._wait_ready(timeout_s)
                return self
            except PortClash:
                if not self.ports_picked or attempt == self.PORT_RETRIES:
                    raise
                self.port, self.controller_port = free_ports(2)
                self.quorum_voters = f"{self.node_id}@{self.host}:{self.controller_port}"
        raise AssertionError("unreachable")

    def launch(self) -> None:
        """Resolve jars, format storage (unless already formatted) and start the JVM;
        returns without waiting (a cluster member cannot be ready before a quorum of
        its peers runs). ``start`` is ``launch`` + wait until ready."""
        self.jar_dir = self.jar_dir or resolve_jars()
        if self.jvm_options is None:
            self.jvm_options = class_archive.java_options(ensure_class_archive(self.jar_dir))
        if self.security is not None:
            self.security.check_covers([self.host])
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._check_ports_free()
        save_address(self.work_dir, self.host, self.port, self.controller_port)
        props_file = self.work_dir / "server.properties"
        props_file.write_text(self._properties())
        cluster_id = self._cluster_id()
        if not (self.work_dir / "data" / "meta.properties").exists():
            fmt = subprocess.run(self.format_command(props_file, cluster_id), capture_output=True, text=True)
            if fmt.returncode != 0:
                raise BrokerError(f"formatting Kafka storage in {self.work_dir} failed:\n"
                                  f"{(fmt.stdout + fmt.stderr)[-3000:]}")
        log = open(self.log_file, "ab")
        self._log_offset = log.tell()
        self.proc = subprocess.Popen(
            self._java("kafka.Kafka", str(props_file), heap=self.heap),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, cwd=self.work_dir,
        )
        log.close()

    def _check_ports_free(self) -> None:
        """``BrokerError`` (one line) if another process listens on this node's client or
        controller port: naming it, and how to start elsewhere."""
        if self.netns:
            return  # its own namespace: the caller's sockets say nothing about it
        for what, port in (("client", self.port), ("controller", self.controller_port)):
            if _port_open(port, self.host):
                raise PortClash(
                    f"the {what} port {self.host}:{port} of the broker data in {self.work_dir} is taken by "
                    f"{port_owner(port)}; stop that process, or start on another address with --port PORT "
                    "(keeps the data) or --fresh (empty data, free ports)")

    def format_command(self, props_file: Path, cluster_id: str) -> list[str]:
        """The storage format command of this node. A secure node's adds the admin's SCRAM
        credentials to the bootstrap metadata (``--add-scram``): every node of a cluster is
        formatted with them, so brokers can log in to each other before any metadata
        is replicated."""
        scram = ([] if self.security is None else
                 ["--add-scram", f"SCRAM-SHA-512=[name={ADMIN_USER},password={self.security.admin_password}]"])
        return self._java("kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props_file),
                          "--ignore-formatted", *scram)

    def check_running(self) -> None:
        """Raise ``BrokerError`` (with the log tail) if the launched JVM has exited."""
        assert self.proc is not None, "launch() first"
        if self.proc.poll() is not None:
            cause = self._start_failure()
            error = PortClash if "Address already in use" in cause else BrokerError
            raise error(
                f"Kafka node {self.node_id} exited with code {self.proc.returncode} during start-up: "
                f"{cause}; last log lines from {self.log_file}:\n{self._log_tail()}"
            )

    def _start_failure(self) -> str:
        """The line of this launch's log that says why the JVM stopped: the first naming an
        exception or error with its message, else the last line (``"no log lines"``)."""
        try:
            with open(self.log_file, "rb") as log:
                log.seek(self._log_offset)
                lines = [line.strip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no log"
        for line in lines:
            if re.search(r"(Exception|Error)(: | \()", line) and "Exiting Kafka" not in line:
                return line[:400]
        return lines[-1][:400] if lines else "no log lines"

    def _cluster_id(self) -> str:
        """The cluster id of this work dir: the one given (a cluster's members share it),
        else a new one; kept in ``cluster.id``, so a restart on existing storage formats
        nothing and keeps the id."""
        id_file = self.work_dir / "cluster.id"
        if id_file.exists():
            return id_file.read_text().strip()
        cluster_id = self.given_cluster_id or new_cluster_id()
        id_file.write_text(cluster_id)
        return cluster_id

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_running()
            if _port_open(self.port, self.host) and self._answers():
                return
            time.sleep(0.25)  # polling interval of a readiness wait, not synchronisation
        self.stop()
        raise BrokerError(
            f"Kafka broker did not answer a metadata request at {self.bootstrap} within "
            f"{timeout_s:.0f}s; log tail:\n{self._log_tail()}"
        )

    def _answers(self) -> bool:
        """The node answers a metadata request (as the admin, over TLS, if it is secure)."""
        if self.security is None:
            return metadata_ok(self.bootstrap, timeout_s=3.0)
        return self.live_brokers(3.0)[0] > 0

    def live_brokers(self, timeout_s: float = 2.0) -> tuple[int, str | None]:
        """How many live brokers this node's cluster has, asked at this node (plaintext
        metadata, or TLS + SCRAM as the admin if the node is secure): (count, None) or
        (0, what went wrong)."""
        if self.security is None:
            return broker_count(self.bootstrap, timeout_s)
        return self.security.broker_count(self.bootstrap, timeout_s)

    def _log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def node_info(self) -> NodeInfo:
        """This node as a cluster member in ``broker.json``."""
        assert self.proc is not None
        return NodeInfo(node_id=self.node_id, pid=self.proc.pid, bootstrap=self.bootstrap,
                        controller_port=self.controller_port, work_dir=str(self.work_dir),
                        log_file=str(self.log_file), netns=self.netns)

    def info(self) -> BrokerInfo:
        assert self.proc is not None
        return BrokerInfo(
            pid=self.proc.pid, bootstrap=self.bootstrap, controller_port=self.controller_port,
            work_dir=str(self.work_dir), log_file=str(self.log_file), version=kafka_version(),
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None:
            return
        stop_pid(self.proc.pid, timeout_s)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None

    def __enter__(self) -> LocalBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def replication_for(brokers: int) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) for topics on a cluster of ``brokers``
    live brokers: RF ``min(3, brokers)``; with RF 3, two in-sync replicas must have
    every acks=all write (one broker may be down without stopping writes or losing
    acknowledged ones); with fewer brokers, one."""
    if brokers < 1:
        raise ValueError(f"a cluster has at least one broker, not {brokers}")
    rf = min(3, brokers)
    return rf, (2 if rf >= 3 else 1)


#: Failure detection of a local cluster, shorter than Kafka's defaults (9 s session,
#: 30 s replica lag) so a killed node is fenced, leaves the ISRs and loses its
#: leaderships within a few seconds, not half a minute. Heartbeats stay well inside.
CLUSTER_FAILURE_DETECTION = {
    "broker.heartbeat.interval.ms": "500",
    "broker.session.timeout.ms": "4000",
    "replica.lag.time.max.ms": "10000",
}


class LocalCluster:
    """A local KRaft Kafka cluster of ``brokers`` nodes, every one combined
    ``broker,controller``.

    Layout: node ids 1..N, all N nodes are voters of the controller quorum
    (``controller.quorum.voters`` lists all of them) and brokers. With the default
    N = 3 that is a 3-voter quorum and 3 brokers: one node down leaves a quorum (2 of
    3) and two replicas of every partition (RF 3, ``min.insync.replicas`` 2), so
    metadata, leader elections and acks=all writes go on. Every node has its own work
    dir (``<work_dir>/node<id>``), all are formatted with one shared cluster id.
    Topic defaults come from ``replication_for(N)``: RF 3 / min ISR 2 for N >= 3, RF 2 /
    min ISR 1 for N = 2, for the internal topics (offsets, transactions, share state)
    too.

    Addresses: by default every node runs on 127.0.0.1 with free ports. With ``hosts``
    (the testbed: one address per node) the nodes listen on 9092 (clients) and 9093
    (controller) of their own address unless ``ports``/``controller_ports`` say
    otherwise; ``netns[i]`` runs node i inside that network namespace; ``bind_host``
    (e.g. ``0.0.0.0``) is where every node's client listener binds.

    With ``security`` every node is secure as a single ``LocalBroker`` is
    (docs/security.md): its client listener speaks only SASL_SSL (SCRAM-SHA-512; the
    admin is created when each node's storage is formatted), brokers talk to each other
    over it as the admin, the controller listeners (quorum and broker-to-controller
    traffic) use mutual TLS with the one broker certificate, whose subjectAltName must
    name every node's host (``start`` checks), and the ``StandardAuthorizer`` denies
    what no ACL allows. Readiness is then probed over TLS as the admin.
    """

    def __init__(
        self,
        work_dir: Path,
        brokers: int = 3,
        hosts: list[str] | None = None,
        netns: list[str | None] | None = None,
        ports: list[int] | None = None,
        heap: str = "384m",
        controller_ports: list[int] | None = None,
        bind_host: str | None = None,
        extra_config: dict[str, str] | None = None,
        security: BrokerSecurity | None = None,
    ) -> None:
        if brokers < 1:
            raise ValueError(f"a cluster needs at least 1 broker, not {brokers}")
        for name, values in (("hosts", hosts), ("netns", netns), ("ports", ports),
                             ("controller_ports", controller_ports)):
            if values is not None and len(values) != brokers:
                raise ValueError(f"{name} lists {len(values)} entries for {brokers} brokers; give one per broker")
        self.work_dir = Path(work_dir).resolve()
        self.size = brokers
        self.security = security
        fixed = hosts is not None
        hosts = hosts or ["127.0.0.1"] * brokers
        picked = free_ports(2 * brokers) if not fixed and (ports is None or controller_ports is None) else []
        ports = ports or ([9092] * brokers if fixed else picked[:brokers])
        controller_ports = controller_ports or ([9093] * brokers if fixed else picked[brokers:])
        addresses = [*zip(hosts, ports, strict=True), *zip(hosts, controller_ports, strict=True)]
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"two listeners of the cluster share an address ({sorted(addresses)}); "
                             "give every node its own host or its own ports")
        netns = netns or [None] * brokers
        self.cluster_id = new_cluster_id()
        voters = ",".join(f"{i + 1}@{hosts[i]}:{controller_ports[i]}" for i in range(brokers))
        config = {**self.topic_defaults(brokers), **CLUSTER_FAILURE_DETECTION, **(extra_config or {})}
        self.nodes = [
            LocalBroker(
                self.work_dir / f"node{i + 1}", port=ports[i], controller_port=controller_ports[i],
                heap=heap, extra_config=config, host=hosts[i], bind_host=bind_host, netns=netns[i],
                node_id=i + 1, quorum_voters=voters, cluster_id=self.cluster_id, security=security,
            )
            for i in range(brokers)
        ]

    @staticmethod
    def topic_defaults(brokers: int) -> dict[str, str]:
        """Broker settings for replication on a cluster of ``brokers`` nodes."""
        rf, min_isr = replication_for(brokers)
        return {
            "default.replication.factor": str(rf),
            "min.insync.replicas": str(min_isr),
            "offsets.topic.replication.factor": str(rf),
            "transaction.state.log.replication.factor": str(rf),
            "transaction.state.log.min.isr": str(min_isr),
            "share.coordinator.state.topic.replication.factor": str(rf),
            "share.coordinator.state.topic.min.isr": str(min_isr),
        }

    @property
    def bootstrap(self) -> str:
        """Every node's client address, comma-separated."""
        return ",".join(node.bootstrap for node in self.nodes)

    def node(self, i: int) -> LocalBroker:
        """Node ``i`` (0-based; its Kafka node id is ``i + 1``)."""
        return self.nodes[i]

    def index_of(self, node_id: int) -> int:
        """The index of the node with Kafka node id ``node_id`` (as metadata names leaders)."""
        for i, node in enumerate(self.nodes):
            if node.node_id == node_id:
                return i
        raise KeyError(f"no node {node_id} in this cluster (ids {[n.node_id for n in self.nodes]})")

    def start(self, timeout_s: float = 120.0) -> LocalCluster:
        """Format and start every node concurrently, then wait until every node answers
        metadata listing all N brokers. On failure every node is stopped again."""
        if self.security is not None:  # one certificate for every node: it must name all their addresses
            self.security.check_covers([node.host for node in self.nodes])
        resolve_jars()  # once, before N threads would race for it
        try:
            self._parallel(lambda node: node.launch())
            self._wait_all(range(self.size), timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, i: int) -> int:
        """SIGKILL node ``i``'s process group (no controlled shutdown) and reap it; returns
        the pid that was killed. The node's storage stays for ``restart(i)``."""
        node = self.nodes[i]
        if node.proc is None:
            raise BrokerError(f"node {node.node_id} is not running")
        pid = node.proc.pid
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node.proc.wait(timeout=10)
        node.proc = None
        return pid

    def restart(self, i: int, timeout_s: float = 90.0) -> None:
        """Start node ``i`` again on its existing storage and wait until it answers
        metadata listing all N brokers (it has registered and been unfenced)."""
        node = self.nodes[i]
        if node.proc is not None and node.proc.poll() is None:
            raise BrokerError(f"node {node.node_id} is still running; kill({i}) or stop it first")
        node.launch()
        self._wait_all([i], timeout_s)

    def alive(self, i: int) -> bool:
        node = self.nodes[i]
        return node.proc is not None and node.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every node (SIGTERM to all at once, SIGKILL after ``timeout_s``)."""
        self._parallel(lambda node: node.stop(timeout_s))

    def info(self) -> BrokerInfo:
        """The cluster as saved in ``broker.json`` (see ``BrokerInfo``)."""
        nodes = [node.node_info() for node in self.nodes if node.proc is not None]
        first = nodes[0]
        return BrokerInfo(
            pid=first.pid, bootstrap=self.bootstrap, controller_port=first.controller_port,
            work_dir=str(self.work_dir), log_file=first.log_file, version=kafka_version(), nodes=nodes,
        )

    def _parallel(self, fn) -> None:
        errors: list[BaseException] = []

        def run(node: LocalBroker) -> None:
            try:
                fn(node)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(node,), daemon=True) for node in self.nodes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def _wait_all(self, indices, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = {i: "not probed yet" for i in indices}
        while waiting:
            for i in list(waiting):
                node = self.nodes[i]
                node.check_running()
                count, problem = node.live_brokers(timeout_s=2.0)
                if problem is None and count >= self.size:
                    del waiting[i]
                else:
                    waiting[i] = problem or f"lists {count} of {self.size} brokers"
            if not waiting:
                return
            if time.monotonic() > deadline:
                detail = "; ".join(f"node {self.nodes[i].node_id} at {self.nodes[i].bootstrap}: {why}"
                                   for i, why in waiting.items())
                raise BrokerError(
                    f"Kafka cluster not ready within {timeout_s:.0f}s ({detail}); logs in "
                    f"{self.work_dir}/node*/broker.log"
                )
            time.sleep(0.25)  # polling interval of a readiness wait, not synchronisation

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_pids(pids: list[int], timeout_s: float = 30.0) -> None:
    """``stop_pid`` for several process groups at once (a cluster stops in one timeout)."""
    threads = [threading.Thread(target=stop_pid, args=(pid, timeout_s), daemon=True) for pid in pids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def stop_pid(pid: int, timeout_s: float = 30.0) -> None:
    """SIGTERM the broker's process group, then SIGKILL it if it does not exit in time."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + (timeout_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.1)  # polling a process exit with a deadline
