"""A local Mosquitto MQTT broker (Debian's ``mosquitto``), for the MQTT bridge's tests and examples.

``LocalMosquitto`` writes a configuration beside its data (a loopback listener on a free
port, kept in ``address.json`` so a restart on the same data reuses it; anonymous access;
persistence, so queued messages of persistent sessions survive a restart; no queue limit,
so an absent bridge loses nothing while the disk lasts), starts ``mosquitto``, waits until
it answers an MQTT CONNECT, and stops it (SIGTERM: it saves its persistence file) or kills it.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from edgestream.deploy.kafka.broker import free_port, stop_pid

#: Where Debian installs it (not on a non-root PATH).
CANDIDATES = ("mosquitto", "/usr/sbin/mosquitto")
INSTALL_HINT = "install Debian's mosquitto (apt-get install mosquitto; scripts/system-deps.sh does it as root)"


class MosquittoError(RuntimeError):
    """Mosquitto is missing or did not start: the message says why and what to do."""


def mosquitto_binary() -> str:
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    raise MosquittoError(f"no mosquitto binary: {INSTALL_HINT}")


def mqtt_answers(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether an MQTT broker at host:port accepts a CONNECT (MQTT 3.1.1, clean session)."""
    connect = bytes([0x10, 0x12, 0x00, 0x04]) + b"MQTT" + bytes([0x04, 0x02, 0x00, 0x0A, 0x00, 0x06]) + b"probe1"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(connect)
            reply = sock.recv(4)
            sock.sendall(bytes([0xE0, 0x00]))  # DISCONNECT
    except OSError:
        return False
    return len(reply) == 4 and reply[0] == 0x20 and reply[3] == 0


class LocalMosquitto:
    """One Mosquitto broker whose configuration, data and log live in ``state_dir``."""

    def __init__(self, state_dir: Path, port: int | None = None) -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        address = self.state_dir / "address.json"
        if port is None and address.exists():
            port = json.loads(address.read_text())["port"]
        self.port = port or free_port()
        address.write_text(json.dumps({"port": self.port}))
        self.host = "127.0.0.1"
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "mosquitto.log"

    def _config(self) -> Path:
        conf = self.state_dir / "mosquitto.conf"
        data = self.state_dir / "data"
        data.mkdir(exist_ok=True)
        conf.write_text("\n".join([
            f"listener {self.port} {self.host}",
            # Started as root, mosquitto would switch to the 'mosquitto' user, which cannot
            # write this directory: it keeps the user that starts it.
            f"user {pwd.getpwuid(os.getuid()).pw_name}",
            "allow_anonymous true",
            "persistence true",
            f"persistence_location {data}/",
            "autosave_interval 1",
            "max_queued_messages 0",
            "max_inflight_messages 0",
            f"log_dest file {self.log_file}",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "",
        ]))
        return conf

    def start(self, timeout_s: float = 15.0) -> LocalMosquitto:
        binary = mosquitto_binary()
        conf = self._config()
        self.proc = subprocess.Popen([binary, "-c", str(conf)], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not mqtt_answers(self.host, self.port):
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read() or b"").decode(errors="replace").strip()
                raise MosquittoError(f"mosquitto exited with {self.proc.returncode} at start: {err or 'no output'}"
                                     f" (log: {self.log_file})")
            if time.monotonic() > deadline:
                self.kill()
                raise MosquittoError(f"mosquitto did not answer on {self.address} within {timeout_s:.0f}s "
                                     f"(log: {self.log_file})")
            time.sleep(0.05)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (it writes its persistence file) and wait; SIGKILL past ``timeout_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        stop_pid(self.proc.pid, timeout_s)
        self.proc.poll()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def __enter__(self) -> LocalMosquitto:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
