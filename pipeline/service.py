"""A long-running edgestream process as a managed service (docs/deploy.md).

What every long-running command (``worker``, ``server``, ``simulate``, ``replay``) gets:

* **Health**: ``/healthz`` and ``/readyz`` on its metrics port (``monitoring.health``); the
  process declares what readiness waits for and beats from its main loop.
* **systemd**: with ``NOTIFY_SOCKET`` set (``Type=notify``), ``READY=1`` once ready,
  ``WATCHDOG=1`` every half ``WATCHDOG_USEC`` while alive, ``STOPPING=1`` on a stop signal,
  ``STATUS=`` lines. Written here: the protocol is one datagram of ``KEY=VALUE`` lines.
* **Stop signals**: the first SIGTERM/SIGINT starts the graceful stop (``on_stop``) and a
  timer of ``service.shutdown_grace_s``: a stop that takes longer exits 1 at once; a
  second signal exits at once with ``128 + signal``.
* **Logs**: ``text`` or ``json`` (one object a line with ``job``, ``process`` and ``step``).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from edgestream.monitoring.health import Health

log = logging.getLogger(__name__)

#: Exit status when the graceful stop outlived ``service.shutdown_grace_s``.
EXIT_GRACE_EXPIRED = 1


# --- systemd notifications --------------------------------------------------------------
class SdNotify:
    """Sends systemd notifications to ``NOTIFY_SOCKET`` (a no-op without it)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        path = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = None
        if path.startswith("@"):
            self.address = "\0" + path[1:]  # an abstract socket
        elif path.startswith("/"):
            self.address = path
        self.watchdog_s = watchdog_interval_s(env)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *lines: str) -> bool:
        """Send ``KEY=VALUE`` lines in one datagram; False if it could not be sent (logged once
        at debug level: a supervisor that went away must not stop the process)."""
        if self.address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.connect(self.address)
                sock.sendall("\n".join(lines).encode())
            return True
        except OSError as exc:
            log.debug("sd_notify %s failed: %s", lines, exc)
            return False


def watchdog_interval_s(env: Mapping[str, str], pid: int | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` notifications: half of ``WATCHDOG_USEC``; None when
    systemd expects none (unset, zero, or ``WATCHDOG_PID`` names another process)."""
    usec = env.get("WATCHDOG_USEC", "")
    owner = env.get("WATCHDOG_PID", "")
    if not usec:
        return None
    if owner and owner != str(os.getpid() if pid is None else pid):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None


# --- logs -------------------------------------------------------------------------------
class LogContext:
    """What every log line of this process names: the job, the process and, if known, its step."""

    def __init__(self) -> None:
        self.job: str | None = None
        self.process: str | None = None
        self.step: Callable[[], int] | None = None

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.job is not None:
            out["job"] = self.job
        if self.process is not None:
            out["process"] = self.process
        if self.step is not None:
            try:
                out["step"] = int(self.step())
            except Exception:  # a log line must never fail on its context
                pass
        return out


#: The context of this process's log lines (one process, one service).
CONTEXT = LogContext()


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts`` (UTC, ms), ``level``, ``logger``, ``msg``, the
    ``LogContext`` fields, and ``exc`` when a traceback is shown."""

    def __init__(self, context: LogContext = CONTEXT) -> None:
        super().__init__()
        self.context = context

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **self.context.fields(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, default=str)


def use_json_logs(logger: logging.Logger | None = None) -> None:
    """Give every handler of ``logger`` (default: root) the JSON formatter."""
    for handler in (logger or logging.getLogger()).handlers:
        handler.setFormatter(JsonFormatter())


# --- stop signals -----------------------------------------------------------------------
class StopSignals:
    """The first stop signal calls ``on_stop`` and starts the grace timer; a second exits now.

    ``exit`` is ``os._exit`` in a process (no cleanup can hang it); tests pass their own.
    """

    def __init__(self, grace_s: float, on_stop: Callable[[int], None], *,
                 health: Health | None = None, notifier: SdNotify | None = None,
                 exit: Callable[[int], Any] = os._exit, timer: type[threading.Timer] = threading.Timer) -> None:
        self.grace_s = grace_s
        self.on_stop = on_stop
        self.health = health
        self.notifier = notifier
        self.exit = exit
        self.timer_class = timer
        self.received: list[int] = []
        self._timer: threading.Timer | None = None

    def __call__(self, signum: int) -> None:
        self.received.append(signum)
        name = signal.Signals(signum).name
        if len(self.received) > 1:
            log.error("second stop signal (%s): exiting now, without finishing the shutdown", name)
            _flush_logs()
            self.exit(128 + signum)
            return
        log.warning("stop signal (%s): checkpoint, commit and leave, then exit (at most %g s; "
                    "a second signal exits at once)", name, self.grace_s)
        if self.health is not None:
            self.health.begin_stop()
        if self.notifier is not None:
            self.notifier.send("STOPPING=1", f"STATUS=stopping ({name})")
        self._timer = self.timer_class(self.grace_s, self._expired)
        self._timer.daemon = True
        self._timer.start()
        self.on_stop(signum)

    def _expired(self) -> None:
        log.error("the shutdown did not finish within service.shutdown_grace_s = %g s: exiting %d now",
                  self.grace_s, EXIT_GRACE_EXPIRED)
        _flush_logs()
        _dump_threads("where each thread was when the shutdown grace expired")
        self.exit(EXIT_GRACE_EXPIRED)

    def done(self) -> None:
        """The graceful stop finished: the grace timer is no longer needed."""
        if self._timer is not None:
            self._timer.cancel()

    def install(self) -> None:
        """Route SIGTERM and SIGINT to this object (main thread only; a process whose signals
        an event loop handles calls it from there instead), and unblock them: a parent may
        start the process with them blocked, and a blocked stop signal would never arrive."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda s, _frame: self(s))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _dump_threads(title: str) -> None:
    """Every thread's stack on stderr: what a stop that hung was waiting for."""
    try:
        print(f"--- {title} ---", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except Exception:  # stderr closed or not a real file: nothing to say it on
        pass


# --- the service ------------------------------------------------------------------------
class ServiceMonitor:
    """A daemon thread that tells systemd what ``health`` says: ``READY=1`` once (when
    ready), ``WATCHDOG=1`` every ``notifier.watchdog_s`` while alive."""

    def __init__(self, health: Health, notifier: SdNotify, name: str, period_s: float = 0.5) -> None:
        self.health = health
        self.notifier = notifier
        self.name = name
        self.period_s = period_s if notifier.watchdog_s is None else min(period_s, notifier.watchdog_s)
        self.ready_sent = False
        self._status = ""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_watchdog = float("-inf")

    def start(self) -> ServiceMonitor:
        if not self.notifier.enabled:
            return self
        self.health.on_change(self._wake.set)
        self._thread = threading.Thread(target=self._run, name="service-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def tick(self, now: float) -> None:
        """One round (the thread calls it; tests too)."""
        ready, body = self.health.readiness()
        if ready and not self.ready_sent:
            self.ready_sent = self.notifier.send("READY=1", f"STATUS={self.name} ready")
        elif not ready and not self.ready_sent and not body["stopping"]:
            waiting = [name for name, check in body["checks"].items() if not check["ok"]]
            status = f"STATUS={self.name} waiting for: {', '.join(waiting)}"
            if waiting and status != self._status:
                self._status = status
                self.notifier.send(status)
        alive, _ = self.health.liveness()
        if self.notifier.watchdog_s is not None and alive and now - self._last_watchdog >= self.notifier.watchdog_s:
            self._last_watchdog = now
            self.notifier.send("WATCHDOG=1")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick(time.monotonic())
            self._wake.wait(self.period_s)
            self._wake.clear()


def _enable_faulthandler() -> None:
    """A watchdog kill (SIGABRT) or a fatal error prints every thread's Python stack to
    stderr: where the loop was stuck. Skipped where stderr is no file (a test's capture)."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            faulthandler.enable(file=stream)
            return
        except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both
            continue


def _abandon_start(signum: int) -> None:
    """A stop signal before the process started its main loop: nothing to save yet."""
    raise SystemExit(0)


class ProcessService:
    """The service side of one process: log context, systemd notifications (``monitor``),
    stop signals (``signals``, installed for the start-up phase: a signal then exits 0)."""

    def __init__(self, name: str, job: str, health: Health, grace_s: float,
                 env: Mapping[str, str] | None = None) -> None:
        CONTEXT.job, CONTEXT.process = job, name
        _enable_faulthandler()
        self.health = health
        self.notifier = SdNotify(env)
        self.monitor = ServiceMonitor(health, self.notifier, name).start()
        self.signals = StopSignals(grace_s, _abandon_start, health=health, notifier=self.notifier)
        if threading.current_thread() is threading.main_thread():
            self.signals.install()

    def close(self) -> None:
        """The process is done (stopped gracefully or not): no grace timer, no notifications."""
        self.signals.done()
        self.monitor.stop()
