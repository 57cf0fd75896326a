"""`edgestream run` inside the edge testbed (docs/testbed.md): what is testbed-specific about a run.

A job with ``[testbed] enabled = true`` runs on network-namespace hosts with shaped links
(``deploy.testbed``). Which namespace runs what:

- ``b0`` .. ``b{n-1}``: one Kafka node each, listening on ``0.0.0.0:9092`` in its namespace
  and advertising ``<host address>:9092`` (controller ``:9093``); the run's bootstrap is
  the brokers' addresses.
- ``w0`` .. (one per worker) and ``server``: ``edgestream worker`` / ``server`` started
  under ``ip netns exec`` (``Testbed.exec_prefix``), their ``/metrics`` bound to the
  host's address.
- ``devices``: the simulators (a thread of the orchestrating process that entered the
  namespace with ``Testbed.enter`` before creating its producers).
- the root namespace (the orchestrator itself): topic set-up, consumer-group positions,
  scrapes of every ``/metrics`` over the testbed's bridge, the simulator's own
  ``/metrics`` on 127.0.0.1, and the Prometheus targets file.

``open_testbed`` brings the hosts and brokers up and always takes them down again
(error, Ctrl-C), unless asked to keep them. The helpers above it are pure and
unit-tested (tests/unit/pipeline/test_testbed_run.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from edgestream.job.config import JobConfig
from edgestream.pipeline.errors import RunError
from edgestream.pipeline.worker import SERVER_NAME

#: Where each broker host's Kafka node listens (in its own namespace) and its controller.
BROKER_PORT = 9092
CONTROLLER_PORT = 9093
#: The host the simulators run on.
DEVICES_HOST = "devices"
#: The host of a strategy's parameter server.
SERVER_HOST = "server"


class TestbedUnavailable(RunError):
    """The testbed (or its brokers) could not be brought up: not root, no iproute2, ...
    (a ``RunError``: the CLI reports it as one line, exit status 1)."""

    __test__ = False


# --- pure helpers -------------------------------------------------------------------------
def host_of(process: str) -> str:
    """The testbed host a run's process runs on: ``server`` for the server, else the worker's own."""
    return SERVER_HOST if process == SERVER_NAME else process


def broker_hosts(count: int) -> list[str]:
    """The broker hosts of a testbed with ``count`` brokers: ``b0`` .. ``b{count-1}``."""
    return [f"b{i}" for i in range(count)]


def bootstrap_of(addresses: Sequence[str], port: int = BROKER_PORT) -> str:
    """``["10.0.0.2", "10.0.0.3"]`` -> ``"10.0.0.2:9092,10.0.0.3:9092"``."""
    if not addresses:
        raise ValueError("a testbed run needs at least one broker address")
    return ",".join(f"{address}:{port}" for address in addresses)


def metrics_override(address: str) -> list[str]:
    """The worker's extra arguments: its ``/metrics`` bound to its host's address (so the
    root namespace scrapes ``http://<address>:<port>/metrics`` over the bridge)."""
    return ["--set", f"workers.metrics_host={address}"]


def process_placement(testbed: Any, process: str) -> tuple[list[str], list[str]]:
    """(command prefix, extra arguments) that start ``process`` on its testbed host:
    ``ip netns exec <ns>`` before the command, the metrics override after it."""
    host = host_of(process)
    return list(testbed.exec_prefix(host)), metrics_override(testbed.hosts[host].address)


def enter_devices(testbed: Any) -> None:
    """Move the calling thread (the simulators' thread) into the devices host; every thread
    it starts afterwards (the producers' I/O threads) is there too."""
    testbed.enter(DEVICES_HOST)


@dataclass
class HostRow:
    """One line of the testbed table."""

    host: str
    kind: str
    netns: str
    address: str
    link: str
    runs: str


def host_rows(cfg: JobConfig, hosts: dict[str, Any], *, server: bool) -> list[HostRow]:
    """What runs on each host of the testbed, with its address and link (``hosts``: name ->
    ``Host`` with ``kind``, ``netns``, ``address``, ``link``)."""
    rows = []
    for name, host in hosts.items():
        if name in cfg.worker_names():
            runs = f"worker {name} ({', '.join(cfg.devices_of(name))})"
        elif name == SERVER_HOST:
            runs = "parameter server" if server else "-"
        elif name == DEVICES_HOST:
            runs = f"simulators ({len(cfg.devices.device_ids())} devices)"
        elif getattr(host, "kind", "") == "broker" or name.startswith("b"):
            runs = f"Kafka node :{BROKER_PORT} (controller :{CONTROLLER_PORT})"
        else:
            runs = "-"
        link = getattr(host, "link", None)
        rows.append(HostRow(name, str(getattr(host, "kind", "")), str(getattr(host, "netns", "")),
                            str(getattr(host, "address", "")), str(link) if link is not None and str(link) else
                            "unshaped", runs))
    return rows


def hosts_table(rows: list[HostRow], title: str = "testbed hosts") -> Table:
    table = Table(title=title)
    for col in ("host", "kind", "netns", "address", "link", "runs"):
        table.add_column(col, justify="left")
    for r in rows:
        table.add_row(r.host, r.kind, r.netns, r.address, r.link, r.runs)
    return table


def uses_testbed(cfg: JobConfig) -> bool:
    section = getattr(cfg, "testbed", None)
    return bool(section is not None and section.enabled)


# --- brokers in the testbed ---------------------------------------------------------------
@dataclass
class TestbedBrokers:
    """The Kafka node(s) of a testbed run: a ``LocalBroker`` or a ``LocalCluster``."""

    __test__ = False

    runner: Any
    bootstrap: str
    work_dir: Path
    hosts: list[str] = field(default_factory=list)

    def stop(self) -> None:
        self.runner.stop()


def start_brokers(testbed: Any, count: int, work_dir: Path, heap: str = "512m") -> TestbedBrokers:
    """Start ``count`` Kafka nodes, one in each broker host's namespace (1: one combined
    node; 3: a KRaft cluster of three), and wait until they answer from here (the root
    namespace, over the bridge)."""
    from edgestream.deploy.kafka import broker as kafka

    names = broker_hosts(count)
    hosts = [testbed.hosts[n] for n in names]
    addresses = [h.address for h in hosts]
    if count == 1:
        runner = kafka.LocalBroker(work_dir / "b0", port=BROKER_PORT, controller_port=CONTROLLER_PORT, heap=heap,
                                   host=addresses[0], bind_host="0.0.0.0", netns=hosts[0].netns)
    else:
        runner = kafka.LocalCluster(work_dir, brokers=count, hosts=addresses, netns=[h.netns for h in hosts],
                                    ports=[BROKER_PORT] * count, controller_ports=[CONTROLLER_PORT] * count,
                                    bind_host="0.0.0.0", heap=heap)
    try:
        runner.start()
    except BaseException:
        runner.stop()
        raise
    return TestbedBrokers(runner, bootstrap_of(addresses), work_dir, names)


# --- a session: testbed up, brokers up, always down again -------------------------------
@dataclass
class TestbedSession:
    __test__ = False

    testbed: Any
    brokers: TestbedBrokers

    @property
    def bootstrap(self) -> str:
        return self.brokers.bootstrap


def require_root() -> None:
    if os.geteuid() != 0:
        raise TestbedUnavailable("the edge testbed creates network namespaces, veth pairs and qdiscs: run as "
                                 "root (e.g. sudo), or drop the job's [testbed] section to run on loopback")


@contextmanager
def open_testbed(cfg: JobConfig, *, keep: bool = False, console: Console | None = None,
                    work_dir: Path | None = None) -> Iterator[TestbedSession]:
    """Bring the job's testbed up (hosts, links) and its brokers (in their namespaces);
    yield; then stop the brokers and take the testbed down, also on error and Ctrl-C
    (``keep``: leave both running, for `edgestream testbed status` / `fault` by hand)."""
    require_root()
    from edgestream.deploy.testbed import Testbed, TestbedError

    console = console or Console()
    try:
        testbed = Testbed.for_job(cfg)
    except TestbedError as exc:
        raise TestbedUnavailable(str(exc)) from exc
    owned = work_dir is None
    work = work_dir or Path(tempfile.mkdtemp(prefix="testbed-brokers-", dir=str(_state_dir(cfg))))
    brokers = None
    try:
        try:
            with console.status("bringing the testbed up (namespaces, veth pairs, links)"):
                testbed.up()
        except TestbedError as exc:
            raise TestbedUnavailable(str(exc)) from exc
        with console.status(f"starting {cfg.testbed.brokers} Kafka node(s) in the broker host(s)"):
            brokers = start_brokers(testbed, cfg.testbed.brokers, work)
        console.print(f"testbed up: {len(testbed.hosts)} hosts; Kafka at {brokers.bootstrap}")
        yield TestbedSession(testbed, brokers)
    finally:
        if not keep:
            try:
                if brokers is not None:
                    brokers.stop()
            finally:
                testbed.down()
                if owned:
                    shutil.rmtree(work, ignore_errors=True)
        else:
            console.print("testbed and brokers kept running (--keep-testbed): "
                          "`edgestream testbed down` removes the hosts"
                          + (f"; the brokers' processes stay (data in {work})" if brokers is not None else ""))


def links_summary(cfg: JobConfig, testbed: Any, result) -> Table:
    """Per worker: its host, address and link beside what it did (steps, version, restarts)."""
    table = Table(title="workers on their hosts")
    for col in ("worker", "host", "address", "link", "steps", "version", "restarts", "metrics"):
        table.add_column(col, justify="left" if col in ("link", "metrics") else "right")
    names = ([SERVER_NAME] if SERVER_NAME in result.training else []) + list(cfg.worker_names())
    for name in names:
        host = testbed.hosts.get(host_of(name))
        t = result.training.get(name, {})
        link = getattr(host, "link", None)
        table.add_row(name, host_of(name), getattr(host, "address", "?"), str(link) if link and str(link)
                      else "unshaped", str(t.get("steps", "-")), str(t.get("version", "-")),
                      str(result.restarted.count(name)), result.workers.get(name, ""))
    return table


def has_server(cfg: JobConfig) -> bool:
    """The job trains with a strategy that has a server process."""
    from edgestream.trainers.strategies import roles

    return cfg.train.enabled and "server" in roles(cfg.train.strategy)


def _state_dir(cfg: JobConfig) -> Path:
    path = cfg.state_path()
    path.mkdir(parents=True, exist_ok=True)
    return path
