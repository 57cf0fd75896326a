"""Saying once, in one line, that the Kafka cluster is unreachable, and once that it is back."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

#: Seconds without a reachable broker before a process says so.
UNREACHABLE_AFTER_S = 5.0
#: Seconds between two reachability checks.
CHECK_EVERY_S = 1.0


class OutageWatch:
    """Turns reachability observations into at most two lines per outage.

    ``observe(reachable, now)`` returns the line to say, or None: "unreachable" once the
    cluster has been unreachable for ``after_s`` seconds, "reachable again" once it answers
    after that. A shorter blip says nothing.

    Invariant: lines alternate, unreachable first; each outage longer than ``after_s``
    gives exactly one of each (the second once it ends).
    """

    def __init__(self, address: str, who: str, after_s: float = UNREACHABLE_AFTER_S) -> None:
        self.address = address
        self.who = who
        self.after_s = after_s
        self._down_since: float | None = None
        self._said = False
        #: Outages said so far (each longer than ``after_s``).
        self.outages = 0

    @property
    def down(self) -> bool:
        """An outage longer than ``after_s`` is going on (its line was said)."""
        return self._said

    def observe(self, reachable: bool, now: float) -> str | None:
        if reachable:
            down_since, said = self._down_since, self._said
            self._down_since, self._said = None, False
            if said and down_since is not None:
                return (f"{self.who}: Kafka at {self.address} is reachable again after "
                        f"{now - down_since:.0f}s; carrying on")
            return None
        if self._down_since is None:
            self._down_since = now
        if not self._said and now - self._down_since >= self.after_s:
            self._said = True
            self.outages += 1
            return (f"{self.who}: Kafka at {self.address} unreachable for {now - self._down_since:.0f}s; "
                    "waiting for it to come back (a local broker: `edgestream broker start` with the same "
                    "--state-dir restarts it on this address)")
        return None


def reachable(bootstrap: str, timeout_s: float = 1.0) -> bool:
    """True if a TCP connection to any server of ``bootstrap`` succeeds (any protocol:
    plaintext or TLS listeners alike)."""
    for address in bootstrap.split(","):
        host, sep, port = address.strip().rpartition(":")
        if not sep or not port.isdigit():
            continue
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return True
        except OSError:
            continue
    return False


class BrokerWatch:
    """A daemon thread that checks ``bootstrap`` every ``CHECK_EVERY_S`` and hands the
    ``OutageWatch`` lines to ``say``; ``stop()`` ends it."""

    def __init__(self, bootstrap: str, who: str, say: Callable[[str], None],
                 after_s: float = UNREACHABLE_AFTER_S) -> None:
        self.watch = OutageWatch(bootstrap, who, after_s)
        self.bootstrap = bootstrap
        self.say = say
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"broker-watch-{who}", daemon=True)

    def start(self) -> BrokerWatch:
        self._thread.start()
        return self

    def down(self) -> bool:
        """The last check found the cluster unreachable for longer than the bound."""
        return self.watch.down

    def _run(self) -> None:
        while not self._stop.wait(CHECK_EVERY_S):
            line = self.watch.observe(reachable(self.bootstrap), time.monotonic())
            if line:
                self.say(line)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
