"""The systemd units' command lines, run as systemd would run them, against the real broker.

No systemd here: each test reads a unit of deploy/systemd/ and starts its ``ExecStart=``
the way the service manager does (tests/unit/deploy/test_systemd_units.py checks the units
themselves with ``systemd-analyze``):

* specifiers expanded for the instance (``%i`` = ``w0``), ``%S``/``%C`` moved under the
  test's directory; ``Environment=``, then the repository's example ``edgestream.env`` and
  the instance's own env file (which points at the test broker and picks the metrics port);
  ``$VAR``/``${VAR}`` expanded; ``WorkingDirectory=``, ``StateDirectory=`` and
  ``CacheDirectory=`` created; a clean environment;
* ``/opt/edgestream/bin/edgestream`` is this checkout's CLI in this interpreter, and
  ``/etc/edgestream/job.toml`` a small job written by the test;
* ``NOTIFY_SOCKET`` is a datagram socket bound by the test, which records every
  notification with its sender's pid (``NotifyAccess=main`` drops any other sender's);
  ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` are set as for ``WatchdogSec=``;
* the stop is ``KillMode=mixed``'s: SIGTERM to the main process only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from edgestream.job.config import dump_config
from tests.integration.jobs import (
    REPO,
    http_status,
    newest_checkpoint,
    start_cli,
    stop_session,
    train_job,
    wait_until,
)
from tests.unit.deploy.unitfile import (
    INSTALLED_EDGESTREAM,
    UNIT_DIR,
    exec_argv,
    expand_specifiers,
    parse_assignments,
    parse_unit,
    read_environment_file,
    seconds,
    unit_specifiers,
)

pytestmark = pytest.mark.integration

JOB_FILE = "/etc/edgestream/job.toml"
#: The watchdog the tests run the processes with (the units: 30 s): pings every 2 s.
WATCHDOG_USEC = 4_000_000


# --- systemd's notify socket ----------------------------------------------------------------
@dataclass
class Notification:
    at: float  # time.monotonic() on receipt
    pid: int  # the sender, from its credentials
    fields: dict[str, str]


class NotifySocket:
    """A bound AF_UNIX datagram socket in place of systemd's, read by a thread. The kernel
    attaches each sender's credentials (SO_PASSCRED), as systemd reads them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[Notification] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, name="notify-socket", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        creds = struct.calcsize("3i")
        while not self._closed.is_set():
            try:
                data, ancillary, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(creds))
            except TimeoutError:
                continue
            except OSError:
                return
            pid = -1
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid, _uid, _gid = struct.unpack("3i", payload[:creds])
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._lock:
                self.messages.append(Notification(time.monotonic(), pid, fields))

    def received(self) -> list[Notification]:
        with self._lock:
            return list(self.messages)

    def with_field(self, key: str, value: str | None = None) -> list[Notification]:
        return [m for m in self.received() if key in m.fields and (value is None or m.fields[key] == value)]

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self.sock.close()


# --- an edge host in a directory --------------------------------------------------------------
@dataclass
class Service:
    unit: str  # e.g. edgestream-worker@w0.service
    proc: subprocess.Popen
    notify: NotifySocket
    metrics_port: int
    log_path: Path
    timeout_start_s: float
    timeout_stop_s: float

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.metrics_port}{path}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def alive_or_fail(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise AssertionError(f"{self.unit} exited with {code} before it was ready:\n{self.log_tail()}")


@dataclass
class EdgeHost:
    """/etc/edgestream, /var/lib and /var/cache of an edge host under ``root``."""

    root: Path
    kafka_bootstrap: str
    notify_dir: Path
    services: list[Service] = field(default_factory=list)

    @property
    def etc(self) -> Path:
        return self.root / "etc" / "edgestream"

    @property
    def state_root(self) -> Path:  # %S
        return self.root / "var" / "lib"

    @property
    def cache_root(self) -> Path:  # %C
        return self.root / "var" / "cache"

    @property
    def state(self) -> Path:  # StateDirectory=edgestream
        return self.state_root / "edgestream"

    def install(self, job) -> None:
        """README's install steps: the example env file as /etc/edgestream/edgestream.env
        and the job (written as the JSON `edgestream run` hands to its processes)."""
        self.etc.mkdir(parents=True)
        shutil.copy(UNIT_DIR / "edgestream.env", self.etc / "edgestream.env")
        (self.etc / "job.json").write_text(dump_config(job))

    def instance_env(self, name: str, port: int) -> None:
        """The instance's own env file (e.g. worker-w0.env): its port and the test broker."""
        (self.etc / name).write_text(
            f"EDGESTREAM_METRICS_PORT={port}\nEDGESTREAM__KAFKA__BOOTSTRAP={self.kafka_bootstrap}\n")

    def host_path(self, path: str) -> Path:
        """A path of the units (/etc/edgestream/...) in this host."""
        return self.root / path.lstrip("/")

    def start(self, unit_file: str, unit_name: str) -> Service:
        """``systemctl start unit_name``, as far as the process can tell."""
        unit = parse_unit(UNIT_DIR / unit_file)
        spec = unit_specifiers(unit_name, str(self.state_root), str(self.cache_root))

        def value(key: str) -> str | None:
            raw = unit.get("Service", key)
            return expand_specifiers(raw, spec) if raw is not None else None

        for key, root in (("StateDirectory", self.state_root), ("CacheDirectory", self.cache_root)):
            for name in (value(key) or "").split():
                (root / name).mkdir(parents=True, exist_ok=True)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(self.state),
               "PYTHONPATH": str(REPO)}  # this checkout stands in for the installed package
        for assignment in unit.values("Service", "Environment"):
            env.update(parse_assignments(expand_specifiers(assignment, spec)))
        for entry in unit.values("Service", "EnvironmentFile"):
            entry = expand_specifiers(entry, spec)
            optional = entry.startswith("-")
            path = self.host_path(entry.lstrip("-"))
            if path.exists() or not optional:
                env.update(read_environment_file(path))
        notify = NotifySocket(self.notify_dir / f"{len(self.services)}.sock")  # one per start
        env["NOTIFY_SOCKET"] = str(notify.path)
        env["WATCHDOG_USEC"] = str(WATCHDOG_USEC)  # WATCHDOG_PID: set to the main pid below

        (line,) = unit.values("Service", "ExecStart")
        argv = exec_argv(expand_specifiers(line, spec), env)
        assert argv[0] == INSTALLED_EDGESTREAM
        args = [str(self.etc / "job.json") if a == JOB_FILE else a for a in argv[1:]]
        log_path = self.root / "journal" / f"{unit_name}.log"
        # exec keeps the pid: WATCHDOG_PID names the process that must ping, as systemd sets it.
        proc = start_cli(args, log_path, env=env, cwd=value("WorkingDirectory"),
                         wrapper=["/bin/sh", "-c", 'WATCHDOG_PID=$$; export WATCHDOG_PID; exec "$@"', "sh"])
        service = Service(unit_name, proc, notify, int(env["EDGESTREAM_METRICS_PORT"]), log_path,
                          seconds(value("TimeoutStartSec")), seconds(value("TimeoutStopSec")))
        self.services.append(service)
        return service

    def cleanup(self) -> None:
        for service in self.services:
            if service.proc.poll() is None:
                stop_session(service.proc, signal.SIGKILL, timeout_s=10)
            service.notify.close()


@pytest.fixture
def host(tmp_path, kafka_bootstrap):
    # The socket path must fit sockaddr_un (108 bytes): not under pytest's long tmp_path.
    notify_dir = Path(tempfile.mkdtemp(prefix="sdnotify-", dir="/tmp"))
    edge = EdgeHost(tmp_path / "host", kafka_bootstrap, notify_dir)
    try:
        yield edge
    finally:
        edge.cleanup()
        shutil.rmtree(notify_dir, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steps_of(service: Service, worker: str) -> float:
    from edgestream.monitoring.scrape import scrape

    s = scrape(service.url("/metrics"))
    return s.get("edgestream_steps_total", worker=worker) if s is not None else 0.0


def grace_s(host: EdgeHost) -> float:
    return float(read_environment_file(host.etc / "edgestream.env")["EDGESTREAM__SERVICE__SHUTDOWN_GRACE_S"])


# --- what every unit's process must do --------------------------------------------------------
def assert_becomes_ready(service: Service) -> Notification:
    """READY=1 within TimeoutStartSec, with /readyz answering 200 by then."""
    def ready():
        service.alive_or_fail()
        return service.notify.with_field("READY", "1")

    (first, *_) = wait_until(ready, service.timeout_start_s, f"READY=1 from {service.unit}")
    assert http_status(service.url("/readyz")) == 200, "READY=1 sent while /readyz does not say ready"
    assert http_status(service.url("/healthz")) == 200
    return first


def assert_pings_the_watchdog(service: Service, ready: Notification, pings: int = 3) -> None:
    """WATCHDOG=1 repeatedly after READY=1 (when systemd arms the watchdog), never
    WATCHDOG_USEC apart: systemd would kill it then."""
    def pinged():
        service.alive_or_fail()
        after = [m for m in service.notify.with_field("WATCHDOG", "1") if m.at >= ready.at]
        return after if len(after) >= pings else None

    limit_s = WATCHDOG_USEC / 1e6
    after = wait_until(pinged, pings * limit_s + 10, f"{pings} WATCHDOG=1 from {service.unit}")
    times = [ready.at] + [m.at for m in after]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) < limit_s, f"watchdog pings {gaps} s apart; WATCHDOG_USEC allows {limit_s} s"


def assert_notifications_come_from_the_main_process(service: Service) -> None:
    senders = {m.pid for m in service.notify.received()}
    assert senders == {service.proc.pid}, f"senders {senders}, main pid {service.proc.pid} (NotifyAccess=main)"
    assert service.notify.with_field("STATUS"), "no STATUS= line"


def assert_stops_cleanly(service: Service, grace: float) -> float:
    """SIGTERM to the main process (KillMode=mixed): STOPPING=1, exit 0 within the grace
    period (below TimeoutStopSec, after which systemd would SIGKILL). Returns the seconds."""
    assert grace < service.timeout_stop_s
    started = time.monotonic()
    os.kill(service.proc.pid, signal.SIGTERM)
    try:
        code = service.proc.wait(timeout=service.timeout_stop_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{service.unit} still running {service.timeout_stop_s} s after SIGTERM "
                             f"(systemd would SIGKILL it):\n{service.log_tail()}") from None
    took = time.monotonic() - started
    assert code == 0, f"{service.unit} exited {code} after SIGTERM:\n{service.log_tail()}"
    assert took < grace, f"{service.unit} took {took:.1f} s to stop, grace is {grace} s"
    stopping = wait_until(lambda: service.notify.with_field("STOPPING", "1"), 5, f"STOPPING=1 from {service.unit}")
    assert not [m for m in service.notify.with_field("READY", "1") if m.at > stopping[0].at]
    return took


# --- the tests --------------------------------------------------------------------------------
def one_worker_job(unique: str, state_dir, *overrides: str):
    """One device at 200 records/s, one BSP worker training an MLP. Periodic checkpoints
    are effectively off: a checkpoint after the first (checkpoint 0) is the stop's."""
    return train_job(unique, state_dir, f"devices.ids=a{unique}", "devices.count=1", "devices.rates_hz=200",
                     "workers.count=1", "train.strategy=bsp", "train.checkpoint_every_steps=1000000",
                     *overrides)


def test_simulate_and_worker_units_notify_stop_on_sigterm_and_the_worker_resumes_from_its_checkpoint(
        host, unique, tmp_path):
    """The worker unit with the simulator unit feeding it: each ready, pinging the watchdog
    and stopping cleanly; the worker's stop checkpoints, and its restart (README's upgrade:
    stop, swap the venv, start) resumes. (One simulator for both units' checks: its start
    is the expensive part.)"""
    job = one_worker_job(unique, tmp_path / "unused")
    host.install(job)
    host.instance_env("simulate-lab.env", free_port())
    host.instance_env("worker-w0.env", free_port())
    grace = grace_s(host)

    sim = host.start("edgestream-simulate@.service", "edgestream-simulate@lab.service")
    sim_ready = assert_becomes_ready(sim)
    assert_pings_the_watchdog(sim, sim_ready)
    assert_notifications_come_from_the_main_process(sim)
    worker = host.start("edgestream-worker@.service", "edgestream-worker@w0.service")
    ready = assert_becomes_ready(worker)
    assert_pings_the_watchdog(worker, ready)
    assert_notifications_come_from_the_main_process(worker)

    def trained() -> float:
        worker.alive_or_fail()
        return steps_of(worker, "w0") >= 3

    wait_until(trained, 120, "w0 to take 3 steps")
    steps_before_stop = steps_of(worker, "w0")
    assert_stops_cleanly(worker, grace)

    # The state is in the unit's StateDirectory (EDGESTREAM__RUN__STATE_DIR=%S/edgestream
    # overrides the job's run.state_dir), and the stop wrote a checkpoint with every step.
    checkpoint = newest_checkpoint(host.state, "w0")
    assert checkpoint is not None, f"no checkpoint under {host.state}"
    assert checkpoint.meta["steps"] >= steps_before_stop >= 3
    assert not (tmp_path / "unused").exists()

    again = host.start("edgestream-worker@.service", "edgestream-worker@w0.service")
    assert_becomes_ready(again)
    assert_stops_cleanly(again, grace)
    summary = json.loads((host.state / "workers" / "w0" / "training.json").read_text())
    assert summary["restored_from"] == checkpoint.meta["model_version"]

    assert_stops_cleanly(sim, grace)


def test_server_unit_notifies_and_stops_on_sigterm(host, unique, tmp_path):
    host.install(one_worker_job(unique, tmp_path / "unused", "train.strategy=asp"))
    host.instance_env("server.env", free_port())

    server = host.start("edgestream-server.service", "edgestream-server.service")
    ready = assert_becomes_ready(server)
    assert_pings_the_watchdog(server, ready)
    assert_notifications_come_from_the_main_process(server)
    assert_stops_cleanly(server, grace_s(host))
    assert newest_checkpoint(host.state, "server") is not None


def corrupt_checkpoints(directory: Path) -> dict[str, str]:
    """Four unusable checkpoint files in ``directory``, each broken another way: name -> the
    words of the reason the store gives for it."""
    import hashlib

    from edgestream.trainers.checkpoint import MAGIC, checkpoint_name

    not_torch = b"not a torch payload"
    files = {
        checkpoint_name(1): (b"garbage", "bad magic"),
        checkpoint_name(2): (b"", "bad magic"),
        checkpoint_name(3): (MAGIC + bytes(32) + b"payload", "digest mismatch"),
        checkpoint_name(4): (MAGIC + hashlib.sha256(not_torch).digest() + not_torch, "does not load safely"),
    }
    directory.mkdir(parents=True)
    for name, (content, _) in files.items():
        (directory / name).write_bytes(content)
    return {name: why for name, (_, why) in files.items()}


def test_worker_unit_without_a_usable_checkpoint_exits_3_which_the_unit_does_not_restart(host, unique, tmp_path):
    """Every checkpoint corrupt: the worker exits 3 with one complete line (each file's reason,
    what to do), the unit's RestartPreventExitStatus= holds 3, and nothing is moved aside."""
    host.install(one_worker_job(unique, tmp_path / "unused"))
    host.instance_env("worker-w0.env", free_port())
    checkpoints = host.state / "workers" / "w0" / "checkpoints"
    reasons = corrupt_checkpoints(checkpoints)

    worker = host.start("edgestream-worker@.service", "edgestream-worker@w0.service")
    try:
        code = worker.proc.wait(timeout=worker.timeout_start_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the worker still runs on unusable checkpoints:\n{worker.log_tail()}") from None

    unit = parse_unit(UNIT_DIR / "edgestream-worker@.service")
    assert code == 3, f"exit {code}:\n{worker.log_tail()}"
    assert str(code) in unit.words("Service", "RestartPreventExitStatus")  # systemd leaves it failed
    assert unit.get("Service", "Restart") == "on-failure"
    # The log holds the store's JSON warnings and then the process's last word, on one line.
    plain = [line for line in worker.log_path.read_text().splitlines() if line and not line.startswith("{")]
    assert len(plain) == 1, plain
    (line,) = plain
    assert line.startswith(f"edgestream worker w0: cannot start: NoUsableCheckpoint: checkpoint {checkpoints}: "
                           "none of the 4 checkpoint file(s) is usable (")
    for name, why in reasons.items():
        assert f"{name}: " in line and why in line, (name, why)
    assert f"move them aside, e.g. `mv {checkpoints} {checkpoints}.rejected`" in line
    assert f"or put a good checkpoint file back into {checkpoints}" in line and "more with --debug" not in line
    assert not worker.notify.with_field("READY", "1")
    verdict = json.loads((host.state / "workers" / "w0" / "exit.json").read_text())
    assert verdict["code"] == 3 and verdict["reason"].startswith("NoUsableCheckpoint: ")
    # Starting from scratch is the operator's call: every file is still where it was.
    assert sorted(p.name for p in checkpoints.iterdir()) == sorted(reasons)
