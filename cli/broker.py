"""`edgestream broker start|stop|status`: the local Kafka broker or cluster."""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from edgestream.cli.errors import CommandError
from edgestream.cli.options import (
    DEFAULT_BROKER_STATE,
    bootstrap_address,
    broker_nodes,
    heap_size,
    local_broker_bootstrap,
    port,
)
from edgestream.job.config import load_config
from edgestream.pipeline.exits import EXIT_CONFIG

#: Seconds `broker status` gives a broker to answer (the command must answer within 2 s).
STATUS_TIMEOUT_S = 1.0

#: Where `broker start --brokers N` (N > 1) keeps its nodes; emptied at every start.
CLUSTER_DIR = "cluster"


def cmd_broker(args: argparse.Namespace) -> int:
    from edgestream.deploy.kafka.broker import (
        BrokerInfo,
        LocalBroker,
        LocalCluster,
        is_broker_pid,
        kafka_version,
        pid_alive,
        probe,
        stop_pid,
        stop_pids,
    )

    console = Console()
    state: Path = args.state_dir
    info_file = state / "broker.json"
    if args.action == "start":
        if args.bootstrap:
            problem = probe(args.bootstrap, STATUS_TIMEOUT_S)
            console.print(f"using existing cluster {args.bootstrap}: "
                          f"{'reachable' if problem is None else f'NOT reachable ({problem})'}")
            return 0 if problem is None else 1
        if args.port and args.brokers > 1:
            raise CommandError(
                f"--port sets the port of a single broker; the {args.brokers} nodes of a cluster each take a "
                "free port: drop --port (`edgestream broker status` lists every node's address)", EXIT_CONFIG)
        running = local_broker_bootstrap(state)
        if running and args.fresh:
            raise CommandError(f"the local broker at {running} is running; stop it first (`edgestream broker stop "
                               f"--state-dir {state}`), then `broker start --fresh` empties its data")
        if args.fresh:
            shutil.rmtree(state / "kafka", ignore_errors=True)  # topics, offsets and its address
        if running:
            size = len(BrokerInfo.load(info_file).nodes) or 1
            if size != args.brokers:
                raise CommandError(
                    f"a local {'cluster of ' + str(size) + ' nodes' if size > 1 else 'single broker'} is already "
                    f"running at {running}; stop it first (`edgestream broker stop`) to start "
                    f"{args.brokers} node(s)")
            console.print(f"local broker already running at {running}")
            return 0
        security = _secure_broker_files(state) if args.secure else None
        if security is None:
            (state / "client.toml").unlink(missing_ok=True)  # a stale one would make `status` log in
        if args.brokers == 1:
            with console.status(f"starting Kafka {kafka_version()} (first run resolves the jars from Maven Central)"):
                broker = LocalBroker(state / "kafka", port=args.port or None, heap=args.heap or "512m",
                                     security=security).start()
            broker.info().save(info_file)
            broker.proc = None  # keep running after this command exits
            console.print(f"Kafka {kafka_version()} broker ready at [bold]{broker.bootstrap}[/bold] "
                          f"(log: {broker.log_file}); stop with `edgestream broker stop`")
            if security is not None:
                client = _write_client_settings(state, broker.bootstrap, security)
                console.print(f"SASL_SSL only (TLS + SCRAM-SHA-512, ACLs enforced); the admin's client settings "
                              f"are in {client}: copy its \\[kafka] table into your job file", soft_wrap=True)
            print(broker.bootstrap)
            return 0
        work = state / CLUSTER_DIR
        shutil.rmtree(work, ignore_errors=True)  # a cluster starts empty: new id, new ports
        cluster = LocalCluster(work, brokers=args.brokers, heap=args.heap or "384m", security=security)
        with console.status(f"starting a {args.brokers}-node{' secure' if security else ''} "
                            f"Kafka {kafka_version()} cluster"):
            cluster.start()
        cluster.info().save(info_file)
        for node in cluster.nodes:
            node.proc = None  # keep running after this command exits
        console.print(f"Kafka {kafka_version()} cluster of {args.brokers} nodes ready (each broker + controller; "
                      f"logs: {work}/node*/broker.log); stop with `edgestream broker stop`", soft_wrap=True)
        for node in cluster.nodes:
            console.print(f"  node {node.node_id}: {node.bootstrap} (controller :{node.controller_port})")
        if security is not None:
            client = _write_client_settings(state, cluster.bootstrap, security)
            console.print(f"every node SASL_SSL only (TLS + SCRAM-SHA-512, ACLs enforced; brokers and controllers "
                          f"authenticate each other); the admin's client settings are in {client}: copy its "
                          "\\[kafka] table into your job file", soft_wrap=True)
        print(cluster.bootstrap)
        return 0
    if args.action == "status":
        # Answers within ~STATUS_TIMEOUT_S per node: a raw metadata probe, no client bootstrap retries.
        if args.bootstrap:
            problem = probe(args.bootstrap, STATUS_TIMEOUT_S)
            console.print(f"{args.bootstrap}: {'up' if problem is None else f'down ({problem})'}", soft_wrap=True)
            return 0 if problem is None else 1
        if not info_file.exists():
            console.print(f"no local broker started with --state-dir {state}")
            return 1
        info = BrokerInfo.load(info_file)
        if info.nodes:
            client_toml = state / "client.toml"
            return _cluster_status(console, info, info_file, client_toml if client_toml.exists() else None)
        if not is_broker_pid(info.pid):
            problem = (f"process {info.pid} is not a Kafka broker; {info_file} is stale" if pid_alive(info.pid)
                       else f"process {info.pid} is gone")
        elif (state / "client.toml").exists():  # a secure broker: TLS handshake and the admin's login
            problem = _secure_problem(state / "client.toml", info.bootstrap)
        else:
            problem = probe(info.bootstrap, STATUS_TIMEOUT_S)
        console.print(f"local Kafka {info.version} at {info.bootstrap} (pid {info.pid}): "
                      f"{'up' if problem is None else f'down ({problem})'}", soft_wrap=True)
        return 0 if problem is None else 1
    if args.action == "stop":
        if not info_file.exists():
            console.print(f"no local broker started with --state-dir {state}")
            return 0
        info = BrokerInfo.load(info_file)
        if info.nodes:
            # never signal a process that reused a dead node's pid
            stop_pids([pid for pid in info.pids if is_broker_pid(pid)])
            info_file.unlink()
            console.print(f"local cluster of {len(info.nodes)} nodes at {info.bootstrap} stopped", soft_wrap=True)
            return 0
        if is_broker_pid(info.pid):  # never signal a process that reused a dead broker's pid
            stop_pid(info.pid)
        info_file.unlink()
        console.print(f"local broker at {info.bootstrap} stopped")
        return 0
    raise AssertionError(args.action)


def _secure_broker_files(state: Path):
    """The certificates (``state/tls``) and admin password of a secure local broker, made
    once and kept with its data (a restart must present the same)."""
    import secrets

    from edgestream.deploy.kafka.broker import BrokerSecurity
    from edgestream.deploy.kafka.tls import make_pki

    tls = state / "tls"
    pki = make_pki(tls, ["127.0.0.1", "localhost"])
    password_file = tls / "admin.password"
    if not password_file.exists():
        password_file.touch(mode=0o600)
        password_file.write_text(secrets.token_urlsafe(24) + "\n")
    return BrokerSecurity(pki.directory, password_file.read_text().strip())


def _secure_problem(client_toml: Path, bootstrap: str) -> str | None:
    """What keeps the admin of a secure local broker from logging in (None: nothing)."""
    from edgestream.pipeline import security

    cfg = load_config(client_toml, env={})
    try:
        security.preflight(bootstrap, security.ClientSecurity.from_config(cfg.kafka), STATUS_TIMEOUT_S * 2)
    except security.SecurityError as exc:
        return str(exc)
    return None


def _write_client_settings(state: Path, bootstrap: str, security) -> Path:
    """``state/client.toml``: the [kafka] table that logs in as the admin (no password in it)."""
    from edgestream.deploy.kafka.broker import ADMIN_USER

    path = state / "client.toml"
    path.write_text(
        "# Client settings of the secure local broker or cluster (edgestream broker start --secure).\n[kafka]\n"
        f'bootstrap = "{bootstrap}"\nsecurity_protocol = "SASL_SSL"\n'
        f'ssl_cafile = "{(security.pki_dir / "ca.pem").resolve()}"\n'
        f'sasl_username = "{ADMIN_USER}"\nsasl_password_file = "{(security.pki_dir / "admin.password").resolve()}"\n')
    return path


def _admin_login(client_toml: Path):
    """``wrap`` for ``deploy.kafka.broker.broker_count``: TLS (certificate and hostname checked)
    and the SCRAM login of the admin of ``client_toml``, on a connected socket."""
    from edgestream.pipeline import security

    settings = security.ClientSecurity.from_config(load_config(client_toml, env={}).kafka)

    def wrap(sock, host: str):
        context = settings.ssl_context()
        assert context is not None, f"{client_toml} names no TLS"
        tls = context.wrap_socket(sock, server_hostname=host)
        try:
            refused = security.scram_login(tls, settings.mechanism, settings.username, settings.password())
        except (security.ProtocolError, security.SecurityError) as exc:
            tls.close()
            raise ConnectionError(f"no login as {settings.username!r}: {exc}") from None
        except BaseException:
            tls.close()
            raise
        if refused is not None:
            tls.close()
            raise ConnectionError(f"the login of {settings.username!r} was refused: {refused}")
        return tls

    return wrap


def _cluster_status(console: Console, info, info_file: Path, client_toml: Path | None = None) -> int:
    """One line per node of a local cluster (pid, address, alive, answers); exit 0 only
    if every node is up. A secure cluster (``client_toml``: the admin's settings) is asked
    over TLS, each node after the admin logged in there."""
    from edgestream.deploy.kafka.broker import broker_count, is_broker_pid, pid_alive

    up = 0
    for node in info.nodes:
        if not is_broker_pid(node.pid):
            state = (f"down (process {node.pid} is not a Kafka broker; {info_file} is stale)"
                     if pid_alive(node.pid) else "down (process gone)")
        else:
            problem = _secure_problem(client_toml, node.bootstrap) if client_toml is not None else None
            count = 0
            if problem is None:
                wrap = _admin_login(client_toml) if client_toml is not None else None
                count, problem = broker_count(node.bootstrap, STATUS_TIMEOUT_S * (2 if wrap else 1), wrap=wrap)
            state = f"up, sees {count} of {len(info.nodes)} brokers" if problem is None else f"alive, not answering ({problem})"
            up += problem is None
        console.print(f"  node {node.node_id}: {node.bootstrap} pid {node.pid}: {state}", soft_wrap=True)
    verdict = "up" if up == len(info.nodes) else ("down" if up == 0 else "degraded")
    secure = "; SASL_SSL, the admin's login checked at each node" if client_toml is not None else ""
    console.print(f"local Kafka {info.version} cluster at {info.bootstrap}: {verdict} "
                  f"({up}/{len(info.nodes)} nodes answer{secure})", soft_wrap=True)
    return 0 if up == len(info.nodes) else 1


def register(sub: argparse._SubParsersAction, add_job_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `broker` subcommand."""
    p = sub.add_parser("broker", help="start, stop or check the local Kafka broker (or cluster)")
    p.add_argument("action", choices=("start", "stop", "status"))
    p.add_argument("--state-dir", type=Path, default=DEFAULT_BROKER_STATE,
                   help="where the broker's data, log and pid file live (default: %(default)s)")
    p.add_argument("--brokers", type=broker_nodes, default=1, metavar="N",
                   help="start: N nodes, each broker + controller (3: one node may fail; topics get "
                        "replication factor 3, min.insync.replicas 2); a cluster starts empty (default: 1)")
    p.add_argument("--port", type=port, default=0,
                   help="client port of a single broker (default: the one its data was last started on, "
                        "else a free one)")
    p.add_argument("--fresh", action="store_true",
                   help="start: empty the local broker's data first (topics, sensors.dlq, committed offsets, "
                        "its address); refused while it runs. Without it a single broker keeps its topics "
                        "and address across stop/start")
    p.add_argument("--heap", default=None, type=heap_size,
                   help="JVM heap per node (default: 512m, 384m per node of a cluster)")
    p.add_argument("--bootstrap", metavar="HOST:PORT", type=bootstrap_address,
                   help="check an existing cluster instead")
    p.add_argument("--secure", action="store_true",
                   help="start: clients must speak SASL_SSL (TLS with certificates made for this broker, "
                        "SCRAM-SHA-512 logins, ACLs enforced; with --brokers N every node, brokers and controllers "
                        "authenticating each other); writes STATE_DIR/client.toml (docs/security.md)")
    p.set_defaults(func=cmd_broker)
