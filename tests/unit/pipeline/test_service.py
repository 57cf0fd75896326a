"""Service behaviour without Kafka: health state and endpoints, sd_notify, stop signals, JSON logs."""

from __future__ import annotations

import gzip
import json
import logging
import os
import signal
import socket
import sys
import urllib.error
import urllib.request

import pytest

from edgestream.job.config import ConfigError, load_config
from edgestream.monitoring.health import Health
from edgestream.monitoring.metrics import Metrics, serve
from edgestream.pipeline.service import (
    EXIT_GRACE_EXPIRED,
    JsonFormatter,
    LogContext,
    SdNotify,
    ServiceMonitor,
    StopSignals,
    watchdog_interval_s,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- Health ---------------------------------------------------------------------------------
def test_ready_only_once_every_condition_holds_and_not_while_stopping():
    health = Health(clock=Clock())
    assert health.readiness()[0]  # nothing declared: ready
    health.require("kafka", "assigned", "restored")
    health.set("kafka", True)
    health.set("restored", True, "fresh start")
    ready, body = health.readiness()
    assert not ready
    assert body["checks"]["assigned"] == {"ok": False, "detail": "not yet"}
    assert body["checks"]["restored"] == {"ok": True, "detail": "fresh start"}
    health.set("assigned", True)
    assert health.readiness()[0]
    health.begin_stop()
    ready, body = health.readiness()
    assert not ready and body["stopping"] and all(c["ok"] for c in body["checks"].values())


def test_alive_until_the_loop_stops_beating():
    clock = Clock()
    health = Health(liveness_timeout_s=30.0, clock=clock)
    clock.now += 1000
    assert health.liveness() == (True, {"alive": True, "loop": "not started"})  # start-up: no loop yet
    health.beat()
    clock.now += 30.0
    assert health.liveness()[0]
    clock.now += 0.5
    alive, body = health.liveness()
    assert not alive and body["last_beat_s"] == pytest.approx(30.5)
    health.require()
    assert not health.readiness()[0]  # a stuck process is not ready either
    health.beat()
    assert health.liveness()[0]


def test_liveness_timeout_must_be_positive():
    with pytest.raises(ValueError, match="liveness_timeout_s"):
        Health(liveness_timeout_s=0)


def test_listeners_hear_every_change():
    health = Health()
    calls = []
    health.on_change(lambda: calls.append(health.readiness()[0]))
    health.require("a")
    health.set("a", True)
    health.begin_stop()
    assert calls == [False, True, False]


def _get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_one_port_serves_metrics_healthz_and_readyz():
    metrics = Metrics()
    metrics.worker_up.labels("w0").set(1)
    metrics.health.require("assigned")
    port = serve(metrics, 0)
    base = f"http://127.0.0.1:{port}"

    status, headers, body = _get(f"{base}/readyz")
    assert status == 503 and headers["Content-Type"] == "application/json"
    assert json.loads(body)["checks"]["assigned"]["ok"] is False
    metrics.health.set("assigned", True, "partitions assigned")
    status, _, body = _get(f"{base}/readyz")
    assert status == 200 and json.loads(body)["ready"] is True

    status, _, body = _get(f"{base}/healthz")
    assert status == 200 and json.loads(body)["alive"] is True

    status, headers, body = _get(f"{base}/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert b'edgestream_worker_up{worker="w0"} 1.0' in body
    status, headers, body = _get(f"{base}/metrics", {"Accept-Encoding": "gzip"})
    assert headers.get("Content-Encoding") == "gzip" and b"edgestream_worker_up" in gzip.decompress(body)
    assert b"edgestream_records_in_total" in gzip.decompress(body)  # the whole page by default
    # name[] restricts the page to those series, as Prometheus's own exporter does
    status, _, body = _get(f"{base}/metrics?name[]=edgestream_worker_up")
    assert status == 200 and b'edgestream_worker_up{worker="w0"} 1.0' in body
    assert b"edgestream_records_in_total" not in body and body.count(b"# TYPE") == 1

    status, _, body = _get(f"{base}/other")
    assert status == 404 and b"/readyz" in body


def test_a_stuck_loop_answers_503_on_healthz():
    clock = Clock()
    metrics = Metrics(health=Health(liveness_timeout_s=5, clock=clock))
    port = serve(metrics, 0)
    metrics.health.beat()
    clock.now += 6
    status, _, body = _get(f"http://127.0.0.1:{port}/healthz")
    assert status == 503 and json.loads(body)["alive"] is False


# --- sd_notify ---------------------------------------------------------------------------------
@pytest.fixture
def notify_socket(tmp_path):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    yield str(path), sock
    sock.close()


def test_notifications_reach_the_socket(notify_socket):
    path, sock = notify_socket
    notifier = SdNotify({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.send("READY=1", "STATUS=w0 ready")
    assert sock.recv(4096) == b"READY=1\nSTATUS=w0 ready"


def test_without_a_socket_nothing_is_sent_and_nothing_fails(tmp_path):
    assert not SdNotify({}).send("READY=1")
    gone = SdNotify({"NOTIFY_SOCKET": str(tmp_path / "missing.sock")})
    assert gone.enabled and not gone.send("READY=1")  # the supervisor went away: logged, not raised


def test_watchdog_interval_is_half_the_timeout_for_this_process_only():
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, pid=2) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_interval_s({}) is None


def test_monitor_sends_ready_once_and_feeds_the_watchdog_only_while_alive(notify_socket):
    path, sock = notify_socket
    clock = Clock()
    health = Health(liveness_timeout_s=10, clock=clock)
    health.require("assigned")
    monitor = ServiceMonitor(health, SdNotify({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000"}), "w0")
    monitor.tick(0.0)
    assert sock.recv(4096) == b"STATUS=w0 waiting for: assigned"
    assert sock.recv(4096) == b"WATCHDOG=1"
    monitor.tick(1.0)  # the same status is not repeated; the watchdog is fed every 2 s
    health.set("assigned", True)
    monitor.tick(2.0)
    assert sock.recv(4096) == b"READY=1\nSTATUS=w0 ready"
    assert sock.recv(4096) == b"WATCHDOG=1"
    monitor.tick(3.0)
    health.beat()
    clock.now += 11  # the loop stopped beating: no more watchdog pings
    monitor.tick(10.0)
    sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        sock.recv(4096)


# --- stop signals ------------------------------------------------------------------------------
class FakeTimer:
    made: list[FakeTimer] = []

    def __init__(self, interval, function):
        self.interval, self.function = interval, function
        self.started = self.cancelled = False
        self.daemon = False
        FakeTimer.made.append(self)

    def start(self):
        self.started = True

    def cancel(self):
        self.cancelled = True


def test_first_signal_stops_under_the_grace_timer_second_exits_at_once():
    exits, stops = [], []
    health = Health()
    signals = StopSignals(20.0, stops.append, health=health, exit=exits.append, timer=FakeTimer)
    signals(signal.SIGTERM)
    assert stops == [signal.SIGTERM] and exits == []
    assert health.stopping and not health.readiness()[0]
    timer = FakeTimer.made[-1]
    assert timer.started and timer.interval == 20.0 and timer.daemon
    signals(signal.SIGINT)
    assert exits == [128 + signal.SIGINT] and stops == [signal.SIGTERM]


def test_a_stop_past_the_grace_period_exits_1_and_a_finished_one_cancels_the_timer(capfd):
    exits = []
    signals = StopSignals(5.0, lambda s: None, exit=exits.append, timer=FakeTimer)
    signals(signal.SIGTERM)
    FakeTimer.made[-1].function()  # the grace period ran out
    assert exits == [EXIT_GRACE_EXPIRED]
    # Before it exits, it says where each thread was (what the stop waited for).
    err = capfd.readouterr().err
    assert "where each thread was when the shutdown grace expired" in err
    assert "test_a_stop_past_the_grace_period" in err  # this thread's stack
    other = StopSignals(5.0, lambda s: None, exit=exits.append, timer=FakeTimer)
    other(signal.SIGTERM)
    other.done()
    assert FakeTimer.made[-1].cancelled


def test_stop_signal_notifies_systemd(notify_socket):
    path, sock = notify_socket
    signals = StopSignals(5.0, lambda s: None, notifier=SdNotify({"NOTIFY_SOCKET": path}),
                          exit=lambda code: None, timer=FakeTimer)
    signals(signal.SIGTERM)
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=stopping (SIGTERM)"


# --- logs and configuration -------------------------------------------------------------------
def test_json_log_lines_name_job_process_and_step():
    context = LogContext()
    context.job, context.process, context.step = "demo", "w1", lambda: 42
    record = logging.LogRecord("edgestream.pipeline.training", logging.WARNING, __file__, 1, "w1: %s", ("live",), None)
    line = json.loads(JsonFormatter(context).format(record))
    assert line["msg"] == "w1: live" and line["level"] == "warning" and line["logger"] == "edgestream.pipeline.training"
    assert (line["job"], line["process"], line["step"]) == ("demo", "w1", 42)
    assert line["ts"].endswith("Z") and "T" in line["ts"]
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert "ValueError: boom" in json.loads(JsonFormatter(context).format(failed))["exc"]


def test_a_failing_step_source_does_not_break_a_log_line():
    context = LogContext()
    context.step = lambda: 1 / 0
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", (), None)
    assert json.loads(JsonFormatter(context).format(record))["msg"] == "hello"


def test_service_settings_are_checked():
    cfg = load_config(overrides=[], env={"EDGESTREAM__SERVICE__SHUTDOWN_GRACE_S": "12.5",
                                         "EDGESTREAM__SERVICE__LOG_FORMAT": "json"})
    assert cfg.service.shutdown_grace_s == 12.5 and cfg.service.log_format == "json"
    with pytest.raises(ConfigError, match="service.log_format"):
        load_config(overrides=["service.log_format=xml"], env={})
    with pytest.raises(ConfigError, match="service.shutdown_grace_s"):
        load_config(overrides=["service.shutdown_grace_s=0"], env={})


_BLOCKED_SUBJECT = """
import sys, threading
from edgestream.pipeline.service import StopSignals
stopped = threading.Event()
signals = StopSignals(5.0, lambda signum: stopped.set())
signals.install()
print("ready", flush=True)
sys.exit(3 if stopped.wait(20) else 0)
"""


def test_stop_signals_arrive_even_if_the_parent_blocked_them():
    """A process started with SIGTERM blocked (a parent's mask is inherited) still stops on it."""
    import subprocess

    def blocked() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})

    proc = subprocess.Popen([sys.executable, "-c", _BLOCKED_SUBJECT], stdout=subprocess.PIPE, text=True,
                            preexec_fn=blocked)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 3  # on_stop ran: the signal reached the handler
    finally:
        proc.kill()
        proc.wait()
