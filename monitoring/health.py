"""Liveness and readiness of one process, and the HTTP endpoint that serves them with /metrics.

``Health`` is plain state with an injectable clock (thread-safe: the event loop, the
training thread and the HTTP server thread all touch it):

* **alive** (``/healthz``): the process answers, and once its main loop has started
  beating (``beat``), the last beat is younger than ``liveness_timeout_s``. A process
  whose event loop is stuck stops beating and turns unhealthy, so a supervisor
  (Kubernetes' liveness probe, systemd's watchdog) restarts it.
* **ready** (``/readyz``): alive, not stopping, and every declared condition holds
  (``require("kafka", "assigned", "restored")`` then ``set("kafka", True)`` ...).
  A stopping process is not ready: it takes no more work.

``serve`` answers ``/metrics`` (Prometheus text format, gzip on request, as
``prometheus_client`` does), ``/healthz`` and ``/readyz`` (JSON bodies naming each
condition, 200 or 503) on one port, from a daemon thread.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted

#: Seconds without a beat of the main loop after which a process is reported not alive.
DEFAULT_LIVENESS_TIMEOUT_S = 30.0


class Health:
    """What ``/healthz`` and ``/readyz`` report; see the module docstring."""

    def __init__(self, liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not liveness_timeout_s > 0:
            raise ValueError(f"liveness_timeout_s must be > 0 (got {liveness_timeout_s})")
        self.liveness_timeout_s = liveness_timeout_s
        self.clock = clock
        self._lock = threading.Lock()
        self._conditions: dict[str, tuple[bool, str]] = {}
        self._last_beat: float | None = None
        self._stopping = False
        self._listeners: list[Callable[[], None]] = []

    # --- what the process says ---------------------------------------------------------
    def require(self, *names: str) -> None:
        """Declare conditions readiness waits for (each starts false)."""
        with self._lock:
            for name in names:
                self._conditions.setdefault(name, (False, "not yet"))
        self._changed()

    def set(self, name: str, ok: bool, detail: str = "") -> None:
        """Condition ``name`` holds (or not), with a short reason for the body."""
        with self._lock:
            self._conditions[name] = (bool(ok), detail)
        self._changed()

    def beat(self) -> None:
        """The main loop is turning (call it from the loop, every second or so)."""
        with self._lock:
            self._last_beat = self.clock()

    def begin_stop(self) -> None:
        """The process is shutting down: not ready from now on."""
        with self._lock:
            self._stopping = True
        self._changed()

    def on_change(self, listener: Callable[[], None]) -> None:
        """``listener()`` runs after every ``require``/``set``/``begin_stop`` (outside the lock)."""
        with self._lock:
            self._listeners.append(listener)

    def _changed(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    # --- what the endpoints answer -----------------------------------------------------
    @property
    def stopping(self) -> bool:
        with self._lock:
            return self._stopping

    def liveness(self) -> tuple[bool, dict[str, Any]]:
        with self._lock:
            return self._liveness_locked()

    def _liveness_locked(self) -> tuple[bool, dict[str, Any]]:
        if self._last_beat is None:
            return True, {"alive": True, "loop": "not started"}
        age = self.clock() - self._last_beat
        alive = age <= self.liveness_timeout_s
        return alive, {"alive": alive, "last_beat_s": round(age, 3),
                       "liveness_timeout_s": self.liveness_timeout_s}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        with self._lock:
            alive, _ = self._liveness_locked()
            checks = {name: {"ok": ok, **({"detail": detail} if detail else {})}
                      for name, (ok, detail) in sorted(self._conditions.items())}
            ready = alive and not self._stopping and all(ok for ok, _ in self._conditions.values())
            return ready, {"ready": ready, "alive": alive, "stopping": self._stopping, "checks": checks}


#: Paths the endpoint answers; anything else is 404.
PATHS = ("/metrics", "/healthz", "/readyz")


def _handler(registry: CollectorRegistry, health: Health) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server API)
            url = urlsplit(self.path)
            if url.path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept"))
                # ``?name[]=a&name[]=b``: only those series, as Prometheus's own exporter
                # answers it (a poll for two counters does not render the whole page).
                names = parse_qs(url.query).get("name[]")
                shown = registry.restricted_registry(names) if names else registry
                body, headers = encoder(shown), [("Content-Type", content_type)]
                if gzip_accepted(self.headers.get("Accept-Encoding")):
                    body = gzip.compress(body)
                    headers.append(("Content-Encoding", "gzip"))
                self._reply(200, body, headers)
            elif url.path in ("/healthz", "/readyz"):
                ok, body = health.liveness() if url.path == "/healthz" else health.readiness()
                self._reply(200 if ok else 503, json.dumps(body, sort_keys=True).encode() + b"\n",
                            [("Content-Type", "application/json")])
            else:
                self._reply(404, b"not found: try /metrics, /healthz or /readyz\n",
                            [("Content-Type", "text/plain")])

        def _reply(self, status: int, body: bytes, headers: list[tuple[str, str]]) -> None:
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the API's name)
            pass  # a probe every few seconds is not worth a log line

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True


def serve(registry: CollectorRegistry, health: Health, port: int, host: str = "127.0.0.1") -> int:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port`` (0: a free port)
    from a daemon thread; return the port."""
    server = _Server((host, port), _handler(registry, health))
    thread = threading.Thread(target=server.serve_forever, name=f"http-{server.server_address[1]}", daemon=True)
    thread.start()
    return server.server_address[1]
