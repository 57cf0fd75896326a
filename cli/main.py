"""The `edgestream` command line: broker, simulate, worker, run, bench.

``main`` owns how a command fails: every error becomes one line on stderr naming the
problem and the fix, exit status 2 for configuration errors and 1 for runtime errors;
tracebacks go to the debug log (``--debug`` or ``EDGESTREAM_DEBUG=1`` prints them).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import NoReturn

from rich.console import Console

from pipeline.config import LOG_FORMATS, JobConfig, load_config
from pipeline.exits import EXIT_CONFIG, EXIT_NO_CHECKPOINT, EXIT_RUNTIME, EXIT_UNBALANCED

log = logging.getLogger("edgestream")

DEFAULT_BROKER_STATE = Path(".edgestream/broker")
#: Set to 1 to print the traceback of a failed command (as ``--debug`` does).
DEBUG_ENV = "EDGESTREAM_DEBUG"
#: Seconds `broker status` gives a broker to answer (the command must answer within 2 s).
STATUS_TIMEOUT_S = 1.0
LOGLEVELS = ("debug", "info", "warning", "error", "critical")
#: Error classes (by name, anywhere in the exception's MRO: matching by name keeps torch
#: and the Kafka clients out of the import path of a failing command) that mean "the
#: configuration is wrong": exit status 2.
CONFIG_ERRORS = frozenset({
    "ConfigError", "TopicNameError", "ModelConfigError", "UnknownStrategyError",
    "CompressorConfigError", "TopicLayoutError", "ArgumentTypeError",
})
#: Client errors (kafka-python, aiokafka) that mean "the cluster did not answer".
KAFKA_CONNECTION_ERRORS = frozenset({
    "NoBrokersAvailable", "KafkaTimeoutError", "KafkaConnectionError", "NodeNotReadyError",
    "RequestTimedOutError",
})

#: Modules that add subcommands: each has ``register(subparsers, add_job_args)``, which
#: adds its parsers with ``set_defaults(func=...)``; ``func(args) -> int``.
EXTENSIONS: tuple[str, ...] = ("monitoring.cli", "pipeline.record_cli", "pipeline.testbed_cli", "pipeline.models_cli")


class CommandError(Exception):
    """A command cannot proceed; the message says what to do, ``code`` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_RUNTIME) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (``edgestream simulate: ...``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_CONFIG, f"{self.prog}: {message} (see {self.prog} --help)\n")


# --- argument types: a bad value is refused by argparse, before anything starts ----------
def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0 (got {text})")
    return value


def positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be an integer > 0 (got {text})")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (got {text})")
    return value


def port(text: str) -> int:
    """A TCP port, or 0 for "a free one"."""
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535, 0 for a free one (got {text})")
    return value


def bootstrap_address(text: str) -> str:
    """``HOST:PORT[,HOST:PORT...]`` with ports in 1..65535."""
    from deploy.kafka.broker import host_port

    try:
        for address in text.split(","):
            host_port(address)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (e.g. 127.0.0.1:9092)") from None
    return text


def heap_size(text: str) -> str:
    """A JVM heap size as ``-Xmx`` takes it: digits with an optional k/m/g suffix."""
    if not re.fullmatch(r"[1-9][0-9]*[kKmMgG]?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a heap size like 512m or 2g")
    return text


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def job_config(args: argparse.Namespace) -> JobConfig:
    """The job's configuration; its ``kafka.*`` security settings become this process's
    (every Kafka client it makes uses them: ``pipeline.security``)."""
    from pipeline import security

    cfg = load_config(getattr(args, "job", None), getattr(args, "set", None) or [])
    security.use(security.ClientSecurity.from_config(cfg.kafka))
    return cfg


def _add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", type=Path, help="job file (TOML); defaults built in")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable), e.g. --set buffer.policy=truncate")
    p.add_argument("--bootstrap", metavar="HOST:PORT", type=bootstrap_address,
                   help="use this Kafka cluster instead of the local broker")


def _local_broker_bootstrap(state_dir: Path) -> str | None:
    from deploy.kafka.broker import BrokerInfo, is_broker_pid

    info_file = state_dir / "broker.json"
    if info_file.exists():
        info = BrokerInfo.load(info_file)
        # A cluster is usable while any of its nodes runs (one may be down for a test).
        if any(is_broker_pid(pid) for pid in info.pids):
            return info.bootstrap
    return None


def _bootstrap(args: argparse.Namespace, cfg: JobConfig | None) -> str | None:
    return (
        getattr(args, "bootstrap", None)
        or (cfg.kafka.bootstrap if cfg else None)
        or _local_broker_bootstrap(DEFAULT_BROKER_STATE)
    )


def need_bootstrap(args: argparse.Namespace, cfg: JobConfig | None) -> str:
    """The cluster this command uses, checked to answer (``KafkaUnreachable`` within seconds)."""
    from pipeline.kafka_io import check_reachable

    bootstrap = _bootstrap(args, cfg)
    if not bootstrap:
        raise CommandError(
            "no Kafka broker. Start the local one with `edgestream broker start`, "
            "or pass --bootstrap HOST:PORT (or set kafka.bootstrap in the job file)"
        )
    args.resolved_bootstrap = bootstrap  # named by main if Kafka fails later
    check_reachable(bootstrap)
    return bootstrap


# --- broker ---------------------------------------------------------------------------
#: Where `broker start --brokers N` (N > 1) keeps its nodes; emptied at every start.
CLUSTER_DIR = "cluster"


def broker_nodes(text: str) -> int:
    """``--brokers``: how many Kafka nodes to start (1 = a single broker)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be 1 (a single broker) or more (e.g. 3: a cluster that survives one node down), got {text}")
    return value


def cmd_broker(args: argparse.Namespace) -> int:
    from deploy.kafka.broker import (
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
        running = _local_broker_bootstrap(state)
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

    from deploy.kafka.broker import BrokerSecurity
    from deploy.kafka.tls import make_pki

    tls = state / "tls"
    pki = make_pki(tls, ["127.0.0.1", "localhost"])
    password_file = tls / "admin.password"
    if not password_file.exists():
        password_file.touch(mode=0o600)
        password_file.write_text(secrets.token_urlsafe(24) + "\n")
    return BrokerSecurity(pki.directory, password_file.read_text().strip())


def _secure_problem(client_toml: Path, bootstrap: str) -> str | None:
    """What keeps the admin of a secure local broker from logging in (None: nothing)."""
    from pipeline import security

    cfg = load_config(client_toml, env={})
    try:
        security.preflight(bootstrap, security.ClientSecurity.from_config(cfg.kafka), STATUS_TIMEOUT_S * 2)
    except security.SecurityError as exc:
        return str(exc)
    return None


def _write_client_settings(state: Path, bootstrap: str, security) -> Path:
    """``state/client.toml``: the [kafka] table that logs in as the admin (no password in it)."""
    from deploy.kafka.broker import ADMIN_USER

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
    from pipeline import security

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
    from deploy.kafka.broker import broker_count, is_broker_pid, pid_alive

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


# --- simulate ---------------------------------------------------------------------------
def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from monitoring.metrics import serve_process
    from pipeline.service import ProcessService
    from pipeline.simulate import check_stream_options, stream_devices

    cfg = job_config(args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    use_log_format(args, cfg)
    check_stream_options(cfg, args.garbage)
    if args.forever and args.duration:
        raise CommandError("simulate: --forever and --duration exclude each other", EXIT_CONFIG)
    bootstrap = need_bootstrap(args, cfg)
    duration = math.inf if args.forever else (args.duration or cfg.run.duration_s)
    metrics, metrics_url = serve_process(args.metrics_port, cfg.workers.metrics_host,
                                         liveness_timeout_s=cfg.service.liveness_timeout_s)
    metrics.health.require("producing")
    stop = threading.Event()
    service = ProcessService("simulate", cfg.job.name, metrics.health, cfg.service.shutdown_grace_s)
    service.signals.on_stop = lambda _signum: stop.set()
    Console().print(f"simulator /metrics: {metrics_url}")
    try:
        with Progress(TextColumn("simulating {task.fields[devices]} devices"), BarColumn(),
                      TextColumn("{task.fields[records]} records"), TimeElapsedColumn()) as progress:
            task = progress.add_task("sim", total=None if args.forever else duration,
                                     devices=cfg.devices.count, records=0)

            producing = False

            def on_progress(report):
                nonlocal producing
                if not producing:  # the first messages went out: ready
                    producing = True
                    metrics.health.set("producing", True, "devices streaming")
                metrics.health.beat()
                progress.update(task, completed=report.duration_s, records=sum(report.records.values()))

            # A stop's flush: 3/4 of the grace or the grace minus 5 s, whichever is longer (docs/deploy.md).
            flush_s = max(cfg.service.shutdown_grace_s * 0.75, cfg.service.shutdown_grace_s - 5.0, 0.5)
            report = stream_devices(cfg, bootstrap, duration, garbage_per_device=args.garbage, stop=stop,
                                    progress=on_progress, report_path=args.report, metrics=metrics,
                                    stop_flush_s=flush_s)
    finally:
        service.close()
    stopped = ""
    if stop.is_set():
        stopped = " (stopped by a signal; " + ("not everything sent was acknowledged)" if report.unconfirmed
                                               else "everything sent was flushed)")
    Console().print(f"produced {sum(report.records.values())} records in "
                    f"{sum(report.messages.values())} messages ({report.bytes} bytes) in {report.duration_s:.1f}s"
                    + stopped)
    if report.unconfirmed:
        Console().print(f"[yellow]not acknowledged by the stop's end[/yellow]: {sum(report.unconfirmed.values())} "
                        "records (they may or may not have been written)")
    for device, reasons in sorted(report.refused.items()):
        Console().print(f"[yellow]refused by the cluster[/yellow]: {sum(reasons.values())} records of {device} "
                        f"({', '.join(sorted(reasons))}): not produced")
    return 0


# --- worker -----------------------------------------------------------------------------
def cmd_worker(args: argparse.Namespace) -> int:
    from pipeline.worker import check_training_config, run_worker, worker_cpus

    cfg, bootstrap = _process_config(args, args.worker)
    worker_cpus(cfg, args.worker)
    check_training_config(cfg)  # before any side effect (topics, state, /metrics)
    run_worker(cfg, args.worker, bootstrap, args.metrics_port, loglevel=args.loglevel, join=args.join)
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    from pipeline.worker import SERVER_NAME, check_training_config, run_server

    cfg, bootstrap = _process_config(args, SERVER_NAME)
    check_training_config(cfg)
    from trainers.strategies import names, roles

    if not cfg.train.enabled or "server" not in roles(cfg.train.strategy):
        with_server = ", ".join(n for n in names() if "server" in roles(n))
        raise CommandError(f"train.strategy={cfg.train.strategy!r} (train.enabled={cfg.train.enabled}) has "
                           f"no server role; `edgestream server` runs strategies that have one ({with_server}), "
                           "e.g. --set train.enabled=true --set train.strategy=asp", EXIT_CONFIG)
    run_server(cfg, bootstrap, args.metrics_port, loglevel=args.loglevel)
    return 0


def _process_config(args: argparse.Namespace, name: str) -> tuple[JobConfig, str]:
    """Config and cluster of a worker/server process, checked without side effects (the
    cluster answers; worker, device and job names make valid topic names). Sets up its
    log and where ``main`` reports how it ended (``exit.json``, read by `run`)."""
    from pipeline.worker import (
        EXIT_FILE,
        SERVER_NAME,
        process_topics,
        quiet_tracebacks,
        worker_state_dir,
    )

    level = getattr(logging, args.loglevel.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_tracebacks(logging.getLogger(), level)
    cfg = job_config(args)
    use_log_format(args, cfg)
    if name != SERVER_NAME:
        cfg.devices_of(name)  # a worker of this job
    args.exit_file = worker_state_dir(cfg, name) / EXIT_FILE
    args.exit_file.unlink(missing_ok=True)  # a previous run's verdict is not this one's
    bootstrap = need_bootstrap(args, cfg)  # before torch is imported: unreachable is reported in seconds
    process_topics(cfg, name)
    return cfg, bootstrap


def use_log_format(args: argparse.Namespace, cfg: JobConfig) -> None:
    """``--log-format`` (else ``service.log_format``) for this process's log lines; the
    choice is written back to ``cfg`` (a Faust process keeps its own handlers for JSON)."""
    from pipeline.service import use_json_logs

    fmt = getattr(args, "log_format", None) or cfg.service.log_format
    cfg.service.log_format = fmt
    if fmt == "json":
        use_json_logs()


def add_service_args(p: argparse.ArgumentParser) -> None:
    """Flags of the long-running commands (worker, server, simulate, replay)."""
    p.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                   help="log lines as text or one JSON object a line (default: service.log_format, text)")


# --- acl --------------------------------------------------------------------------------
def cmd_acl(args: argparse.Namespace) -> int:
    from pipeline import acl

    cfg = job_config(args)
    console = Console()
    grants = acl.job_grants(cfg)
    if args.action == "list":
        for g in grants:
            console.print(f"User:{g.user}  {'/'.join(g.operations)}  {g.resource} {g.name}"
                          f"{'*' if g.prefixed else ''}", soft_wrap=True, markup=False)
        return 0
    bootstrap = need_bootstrap(args, cfg)
    done = acl.apply(bootstrap, cfg, args.password_dir)
    console.print(f"job {cfg.job.name}: topics created, {done['users']} SCRAM-SHA-512 users "
                  f"(passwords in {args.password_dir}/<user>.password), {done['acls']} ACLs "
                  f"({len(grants)} grants; `edgestream acl list` shows them)", soft_wrap=True)
    return 0


# --- run --------------------------------------------------------------------------------
def _sigterm_interrupts() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread (the cleanup path of Ctrl-C)."""
    import signal

    def interrupt(_signum, _frame) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


#: Width of ``run``'s output when it goes to a file or a pipe: wide enough that no table is cut
#: (a cut cell ends in an ellipsis and its value is lost from the log); each row stays one line.
PIPED_WIDTH = 10_000


def run_console() -> Console:
    """The console ``run`` prints to: the terminal's width, or no limit that a table meets when piped."""
    return Console() if sys.stdout.isatty() else Console(width=PIPED_WIDTH)


def cmd_run(args: argparse.Namespace) -> int:
    from deploy.kafka.broker import LocalBroker, kafka_version
    from pipeline.kafka_io import check_reachable
    from pipeline.run import process_config, run_job
    from pipeline.testbed_run import run_in_testbed, uses_testbed
    from pipeline.worker import check_training_config, process_topics, worker_cpus

    _sigterm_interrupts()  # `kill`/`timeout` stop the run like Ctrl-C: every process it started too
    cfg = job_config(args)
    if args.duration:
        cfg.run.duration_s = args.duration
    process_config(cfg)  # the workers' principal (run.workers_password_file): refused before anything else
    in_testbed = uses_testbed(cfg)  # the brokers are the testbed's own (pipeline/testbed_run.py)
    if in_testbed and (args.bootstrap or cfg.kafka.bootstrap):
        raise CommandError("a job with [testbed] enabled runs its own brokers in the testbed's broker hosts: "
                           "drop --bootstrap / kafka.bootstrap, or set testbed.enabled=false", EXIT_CONFIG)
    bootstrap = None if in_testbed else _bootstrap(args, cfg)
    if bootstrap:  # first, before torch is imported: an unreachable cluster is reported in seconds
        args.resolved_bootstrap = bootstrap
        check_reachable(bootstrap)
    # Everything a process of the run would refuse, refused now: before a broker or topic exists.
    for name in cfg.worker_names():
        process_topics(cfg, name)
        worker_cpus(cfg, name)
    check_training_config(cfg)
    console = run_console()
    broker = None
    work: Path | None = None  # the data of the broker this run starts (removed at its end)
    try:
        if in_testbed:
            result = run_in_testbed(cfg, console, garbage_per_device=args.garbage, keep=args.keep_testbed)
        elif not bootstrap:
            work = Path(tempfile.mkdtemp(prefix="broker-", dir=str(_ensure(cfg.state_path()))))
            with console.status(f"starting a local Kafka {kafka_version()} broker "
                                "(first run resolves the jars from Maven Central)"):
                broker = LocalBroker(work).start()
            bootstrap = broker.bootstrap
            args.resolved_bootstrap = bootstrap
            console.print(f"local Kafka {kafka_version()} broker at {bootstrap}")
        if not in_testbed:
            result = run_job(cfg, bootstrap, garbage_per_device=args.garbage, console=console)
    except KeyboardInterrupt:
        console.print("interrupted; stopped every process this run started")
        return 130
    finally:
        if broker is not None:
            broker.stop()
        if work is not None:
            if args.keep_broker:
                console.print(f"the run's broker data is kept in {work} (--keep-broker)")
            else:
                shutil.rmtree(work, ignore_errors=True)
    if result.outcome == "drain_timeout":
        console.print(f"[red]the drain timed out: {result.reason.split('; per device:')[0]}[/red]", soft_wrap=True)
        return EXIT_RUNTIME
    if not result.balanced:
        console.print("[red]accounting does not balance: see the table above[/red]")
        return EXIT_UNBALANCED
    if result.backlog:
        console.print("[yellow]rate above capacity: " + ", ".join(
            f"{d} has {n} records pending beyond one window" for d, n in result.backlog.items())
            + " (it arrives faster than its worker batches and trains: see the balanced column, and "
              "docs/ingest.md#backlog for batcher.max_batch_widen and train.max_step_batch)[/yellow]", soft_wrap=True)
    console.print(f"[green]every record accounted for[/green]; summary in {cfg.state_path() / 'summary.json'}")
    return 0


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


# --- bench ------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    import runpy

    root = Path(__file__).resolve().parent.parent / "benchmarks"
    script = root / f"{args.name}.py"
    if not script.exists():
        names = sorted(p.stem for p in root.glob("*.py") if not p.stem.startswith("_"))
        raise CommandError(f"no benchmark {args.name!r}; available: {', '.join(names)}", EXIT_CONFIG)
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="edgestream",
        description="Online deep learning on edge sensor streams over Kafka.",
    )
    parser.add_argument("--debug", action="store_true",
                        help=f"print the traceback of a failed command (or set {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", required=True)

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

    p = sub.add_parser("simulate", help="stream the job's devices into their topics (simulated, or its recording)")
    _add_job_args(p)
    p.add_argument("--duration", type=positive_float, help="seconds (default: run.duration_s)")
    p.add_argument("--garbage", type=non_negative_int, default=0, metavar="N",
                   help="also send N malformed messages per device (tests the dead-letter path)")
    p.add_argument("--report", type=Path, help="write what was produced as JSON here")
    p.add_argument("--forever", action="store_true",
                   help="stream until stopped (SIGTERM/SIGINT), as a service does; excludes --duration")
    p.add_argument("--metrics-port", type=port, default=0,
                   help="serve /metrics (records produced per device), /healthz and /readyz on this port "
                        "(0: a free one)")
    add_service_args(p)
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("worker", help="run one worker (a Faust worker) until stopped")
    _add_job_args(p)
    p.add_argument("--worker", required=True, help="worker name, w0 .. w{workers.count-1}")
    p.add_argument("--join", action="store_true",
                   help="enter a running job: read the update topics from their end and wait for the model "
                        "(a worker without a checkpoint also joins when the job's gradients log already holds "
                        "records of other workers; one with a checkpoint resumes from it)")
    p.add_argument("--metrics-port", type=port, default=0, help="/metrics port (0: a free one)")
    p.add_argument("--loglevel", default="warning", type=str.lower, choices=LOGLEVELS,
                   help="log level; debug also logs the traceback of a crash (default: %(default)s)")
    add_service_args(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("server", help="run the parameter server of a job whose strategy has one "
                                         "(e.g. asp; a strategy without one is refused, naming those that have one)")
    _add_job_args(p)
    p.add_argument("--metrics-port", type=port, default=0, help="/metrics port (0: a free one)")
    p.add_argument("--loglevel", default="warning", type=str.lower, choices=LOGLEVELS,
                   help="log level; debug also logs the traceback of a crash (default: %(default)s)")
    add_service_args(p)
    p.set_defaults(func=cmd_server)

    p = sub.add_parser("acl", help="the principals and ACLs a job needs on a secure cluster (docs/security.md)")
    p.add_argument("action", choices=("apply", "list"),
                   help="apply: create the job's topics, users and ACLs (run it as the admin); list: print them")
    _add_job_args(p)
    p.add_argument("--password-dir", type=Path, default=Path(".edgestream/credentials"),
                   help="apply: where each user's password is kept (made if absent, mode 0600; default: %(default)s)")
    p.set_defaults(func=cmd_acl)

    p = sub.add_parser("run", help="broker + simulated devices + workers, with a live view")
    _add_job_args(p)
    p.add_argument("--duration", type=positive_float, help="seconds of streaming (default: run.duration_s)")
    p.add_argument("--garbage", type=non_negative_int, default=0, metavar="N",
                   help="inject N malformed messages per device")
    p.add_argument("--keep-testbed", action="store_true",
                   help="with [testbed]: leave the hosts and brokers up after the run (`edgestream testbed down`)")
    p.add_argument("--keep-broker", action="store_true",
                   help="a run that starts its own broker (no --bootstrap, no local broker running) removes its "
                        "data (STATE/broker-*) when it ends; keep it instead")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("bench", help="run a benchmark from benchmarks/ (table + JSON)")
    p.add_argument("name", help="benchmark name, e.g. ingest")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    p.set_defaults(func=cmd_bench)

    import importlib

    for module in EXTENSIONS:
        importlib.import_module(module).register(sub, _add_job_args)
    for name, command in sub.choices.items():
        if name != "bench":  # bench passes everything after its name to the benchmark
            # SUPPRESS: absent after the command, the top-level value stands.
            command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                 help="print the traceback if the command fails")
    return parser


def one_line(text: object) -> str:
    """The first line of ``text``, whitespace collapsed; ' (...)' if lines were left out."""
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    first = " ".join(lines[0].split())
    return first + (" (more with --debug)" if len(lines) > 1 else "")


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def failure(exc: BaseException, args: argparse.Namespace) -> tuple[int, str, str]:
    """How a command that raised ``exc`` ends: exit status, the problem as one line, and
    the reason alone (what `run` shows for a worker: ``CheckpointError: ...``)."""
    names = _names(exc)
    kind = f"{type(exc).__name__}: "
    if "ProcessCrashed" in names:
        cause = getattr(exc, "reason", None)
        if cause is not None and _names(cause) & KAFKA_CONNECTION_ERRORS:  # lost the cluster
            _, line, reason = failure(cause, args)
            return EXIT_RUNTIME, f"crashed: {line}", reason
        if cause is not None and "NoUsableCheckpoint" in _names(cause):
            return failure(cause, args)
        reason = one_line(exc)
        return EXIT_RUNTIME, f"crashed: {reason}", reason
    if names & CONFIG_ERRORS:
        reason = one_line(exc)
        return EXIT_CONFIG, f"configuration error: {reason}", reason
    if "NoUsableCheckpoint" in names:
        reason = kind + one_line(exc)
        return EXIT_NO_CHECKPOINT, f"cannot start: {reason}", reason
    if "KafkaUnreachable" in names or "SecurityError" in names:
        reason = one_line(exc)
        return EXIT_RUNTIME, reason, reason
    if names & KAFKA_CONNECTION_ERRORS:
        from pipeline.kafka_io import KAFKA_HINT

        where = getattr(args, "resolved_bootstrap", None) or getattr(args, "bootstrap", None) or "?"
        reason = f"cannot reach Kafka at {where}: {kind}{one_line(exc)}"
        return EXIT_RUNTIME, f"{reason}. {KAFKA_HINT}", reason
    if isinstance(exc, CommandError):
        return exc.code, one_line(exc), one_line(exc)
    if names & {"RunError", "BrokerError", "TopicSetupError", "StreamsError", "PrometheusError"}:
        return EXIT_RUNTIME, one_line(exc), one_line(exc)
    reason = kind + one_line(exc)
    if args.command in ("worker", "server"):
        return EXIT_RUNTIME, f"crashed: {reason}", reason
    return EXIT_RUNTIME, f"failed: {reason} (--debug shows the traceback)", reason


def _label(args: argparse.Namespace) -> str:
    worker = getattr(args, "worker", None) if args.command == "worker" else None
    return f"edgestream {args.command}" + (f" {worker}" if worker else "")


def _report_exit(args: argparse.Namespace, code: int, reason: str | None) -> None:
    """Write how a worker/server ended where `run` looks (``args.exit_file``, if set)."""
    path: Path | None = getattr(args, "exit_file", None)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"code": code, "reason": reason, "pid": os.getpid()}))
        tmp.replace(path)
    except OSError as exc:  # the state dir itself may be what failed
        log.debug("could not write %s: %s", path, exc)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        _report_exit(args, 130, "interrupted")
        return 130
    except Exception as exc:
        code, line, reason = failure(exc, args)
        log.debug("%s failed", _label(args), exc_info=exc)
        if debug:
            traceback.print_exception(exc, file=sys.stderr)
        _report_exit(args, code, reason)
        print(f"{_label(args)}: {line}", file=sys.stderr, flush=True)
        _end_process(args, argv, code)
        return code
    _report_exit(args, code, None)
    _end_process(args, argv, code)
    return code


def _end_process(args: argparse.Namespace, argv: list[str] | None, code: int) -> None:
    """End a worker/server process now, skipping interpreter teardown.

    Everything is written and flushed by now; teardown only adds noise after the
    process's last line: torch's optimizer imports triton, whose bindings print a page
    of "nanobind: leaked ..." at finalisation. Only when ``main`` is the program
    (``argv is None``), never when a caller (a test) passes its own arguments.
    """
    if argv is not None or args.command not in ("worker", "server"):
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
