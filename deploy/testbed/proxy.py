"""Delay without netem: a Toxiproxy inside a delayed host, in front of every broker.

In a delayed host, each broker's advertised address (``<subnet>.x``, port 9092) is also
put on the host's ``lo`` as a /32, so a Kafka client there connects to the local proxy
instead; the proxy forwards to the broker's alias address over the host's shaped veth.
Two latency toxics per broker (upstream: client -> broker, downstream: back) each add half
the link's delay and half its jitter, so a request/response round trip gains the delay.
Broker-to-broker traffic, the controller's traffic and metrics scrapes are not delayed.

The proxy's HTTP API listens on 127.0.0.1:8474 inside the host's namespace; this module
talks to it from a short-lived thread that enters the namespace (setns), with urllib.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from edgestream.deploy.testbed.links import LinkSpec
from edgestream.deploy.testbed.system import TestbedError, setns

TOXIPROXY_VERSION = "2.5.0"
TOXIPROXY_MODULE = f"github.com/Shopify/toxiproxy/v2/cmd/server@v{TOXIPROXY_VERSION}"
API_PORT = 8474
BUILD_TIMEOUT_S = 900.0
START_TIMEOUT_S = 10.0


def binary_path() -> Path:
    from edgestream.deploy.kafka.broker import cache_root

    return cache_root() / f"toxiproxy-{TOXIPROXY_VERSION}" / "bin" / "server"


def find_go() -> str | None:
    return shutil.which("go") or (str(p) if (p := Path("/usr/local/go/bin/go")).exists() else None)


def ensure_binary() -> Path:
    """The Toxiproxy server, built once into the cache with `go install` (about a minute)."""
    binary = binary_path()
    if binary.exists():
        return binary
    go = find_go()
    if go is None:
        raise TestbedError("a link delay needs Toxiproxy, which is built with Go, and `go` is not installed: "
                           "install Go (https://go.dev/dl/) or drop the delay from the link "
                           f"(e.g. \"1mbit\" instead of \"1mbit 80ms\"); it would go to {binary}")
    binary.parent.mkdir(parents=True, exist_ok=True)
    with open(binary.parent.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time (concurrent testbeds)
        if binary.exists():
            return binary
        env = {**os.environ, "GOBIN": str(binary.parent)}
        try:
            proc = subprocess.run([go, "install", TOXIPROXY_MODULE], env=env, capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise TestbedError(f"`go install {TOXIPROXY_MODULE}` took over {BUILD_TIMEOUT_S:.0f} s: "
                               "check the network access to proxy.golang.org") from None
        if proc.returncode != 0 or not binary.exists():
            raise TestbedError(f"`go install {TOXIPROXY_MODULE}` failed: {proc.stderr.strip()[-400:]} "
                               "(needs access to the Go module proxy)")
    return binary


def start(netns: str, log_file: Path) -> int:
    """Start the proxy server inside ``netns`` (detached); returns its pid once its API answers."""
    binary = ensure_binary()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, str(binary), "-host", "127.0.0.1", "-port", str(API_PORT)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise TestbedError(f"Toxiproxy in {netns} exited with {proc.returncode}: see {log_file}")
        try:
            api(netns, "GET", "/version")
            return proc.pid  # `ip netns exec` execs the server: same pid
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise TestbedError(f"Toxiproxy in {netns} did not answer on 127.0.0.1:{API_PORT} within "
                                   f"{START_TIMEOUT_S:.0f} s: see {log_file}") from None
        time.sleep(0.05)


def api(netns: str, method: str, path: str, body: dict | None = None, timeout: float = 3.0):
    """One call to the proxy API of ``netns``; the decoded JSON answer (None if empty)."""
    result: dict = {}

    def call() -> None:
        try:
            setns(netns)
            data = json.dumps(body).encode() if body is not None else None
            request = urllib.request.Request(f"http://127.0.0.1:{API_PORT}{path}", data=data, method=method,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=timeout) as response:
                text = response.read()
            try:
                result["value"] = json.loads(text) if text.strip() else None
            except ValueError:  # /version answers plain text
                result["value"] = text.decode(errors="replace")
        except BaseException as exc:  # handed to the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=call, name=f"toxiproxy-api-{netns}", daemon=True)
    thread.start()
    thread.join(timeout + 2)
    if "error" in result:
        error = result["error"]
        if isinstance(error, urllib.error.HTTPError):
            detail = error.read().decode(errors="replace")
            raise TestbedError(f"Toxiproxy in {netns}: {method} {path} -> {error.code} {detail}")
        raise error
    if "value" not in result:
        raise TimeoutError(f"Toxiproxy in {netns}: {method} {path} did not answer")
    return result["value"]


def toxics(link: LinkSpec) -> list[dict]:
    """The latency toxics for ``link``: half the delay and jitter each way (none if no delay)."""
    if not link.delayed:
        return []
    attributes = {"latency": round(link.delay_ms / 2), "jitter": round(link.jitter_ms / 2)}
    return [{"name": f"latency_{stream}", "type": "latency", "stream": stream, "toxicity": 1.0,
             "attributes": attributes} for stream in ("upstream", "downstream")]


def configure(netns: str, routes: list[tuple[str, str, str]], link: LinkSpec) -> None:
    """Make the proxy in ``netns`` forward ``routes`` (name, listen, upstream) with the
    toxics of ``link``; replaces whatever it had."""
    existing = api(netns, "GET", "/proxies") or {}
    for name, listen, upstream in routes:
        if name in existing:
            api(netns, "DELETE", f"/proxies/{name}")
        api(netns, "POST", "/proxies", {"name": name, "listen": listen, "upstream": upstream, "enabled": True})
        for toxic in toxics(link):
            api(netns, "POST", f"/proxies/{name}/toxics", toxic)


def set_link(netns: str, link: LinkSpec) -> None:
    """Replace the toxics of every proxy in ``netns`` by those of ``link`` (open connections too)."""
    for name in api(netns, "GET", "/proxies") or {}:
        for toxic in api(netns, "GET", f"/proxies/{name}/toxics") or []:
            api(netns, "DELETE", f"/proxies/{name}/toxics/{toxic['name']}")
        for toxic in toxics(link):
            api(netns, "POST", f"/proxies/{name}/toxics", toxic)


def listed(netns: str) -> dict:
    """{proxy name: {"listen", "upstream", "toxics": [...]}} as the API reports it."""
    out = {}
    for name, proxy in (api(netns, "GET", "/proxies") or {}).items():
        out[name] = {"listen": proxy["listen"], "upstream": proxy["upstream"], "enabled": proxy["enabled"],
                     "toxics": proxy.get("toxics", [])}
    return out


def is_proxy_pid(pid: int) -> bool:
    """Whether ``pid`` runs the cached Toxiproxy binary (never signal a reused pid)."""
    try:
        return Path(os.readlink(f"/proc/{pid}/exe")) == binary_path()
    except OSError:
        return False
