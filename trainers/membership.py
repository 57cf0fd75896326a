"""Who is live: the liveness table behind a process's view of its job's workers.

Every worker process publishes a small ``control`` message on ``control.<job>`` every
``train.heartbeat_s`` (meta ``op: heartbeat``) and ``op: leave`` when it stops on
purpose; every process reads that topic and hands each message to :class:`Liveness`
with the time it read it. The live set is this process (if it is a worker) plus every
worker heard from within ``timeout_s`` that has not left since; a heartbeat after a
leave is a re-join. The adapter (``pipeline/training.py``) asks :meth:`Liveness.report`
on every loop turn and calls ``TrainingDriver.membership`` with what it returns.

A process says nothing about the job until it has *listened*: :meth:`start` is called
once it reads back its own first heartbeat (its consumer of the control topic is live),
and the first report comes ``listen_s`` (default: ``timeout_s``) after that, so every
live worker had time to be heard. A configured worker never heard by then is not live.

Pure: no clock reads, no I/O; times are any monotonic seconds the caller hands in.
"""

from __future__ import annotations

import math

#: ``meta["op"]`` of a worker's periodic "I am here" on the control channel.
HEARTBEAT = "heartbeat"
#: ``meta["op"]`` of a worker that stops on purpose (SIGTERM/SIGINT), sent before it stops.
LEAVE = "leave"
OPS = (HEARTBEAT, LEAVE)


class Liveness:
    """Per worker, when it was last heard and whether it left; the live set from that.

    ``me``: this process's worker id (always live), or None for a process that is not a
    worker (a parameter server). Invariant: :meth:`report` returns a set only after
    :meth:`start` plus ``listen_s``, and only when it differs from the last one returned.
    """

    def __init__(self, me: str | None, timeout_s: float, *, listen_s: float | None = None) -> None:
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s}")
        self.me = me
        self.timeout_s = float(timeout_s)
        self.listen_s = self.timeout_s if listen_s is None else float(listen_s)
        self._heard: dict[str, float] = {}
        self._left: set[str] = set()
        self._started_at: float | None = None
        self._reported: tuple[str, ...] | None = None

    @property
    def started(self) -> bool:
        return self._started_at is not None

    @property
    def reported(self) -> tuple[str, ...] | None:
        """The live set last returned by :meth:`report` (None before the first report)."""
        return self._reported

    def start(self, now: float) -> None:
        """This process reads the control channel live from ``now`` on (idempotent)."""
        if self._started_at is None:
            self._started_at = now

    def observe(self, worker: str, now: float, op: str = HEARTBEAT) -> None:
        """A control message ``op`` of ``worker`` was read at ``now`` (in log order)."""
        if op not in OPS:
            raise ValueError(f"unknown liveness op {op!r}; known: {OPS}")
        if not worker:
            raise ValueError("worker must be a non-empty id")
        if op == LEAVE:
            self._left.add(worker)
            return
        self._left.discard(worker)  # a heartbeat after a leave: the worker is back
        self._heard[worker] = max(now, self._heard.get(worker, -math.inf))

    def last_heard(self, worker: str) -> float | None:
        return self._heard.get(worker)

    def left(self) -> tuple[str, ...]:
        """Workers whose last word was ``leave``, sorted."""
        return tuple(sorted(self._left))

    def live(self, now: float) -> tuple[str, ...]:
        """This process (if a worker) and every worker heard within ``timeout_s`` that has not left, sorted."""
        out = {w for w, at in self._heard.items() if w not in self._left and now - at <= self.timeout_s}
        if self.me is not None:
            out.add(self.me)
        return tuple(sorted(out))

    def report(self, now: float) -> tuple[str, ...] | None:
        """The live set, if the listening period is over and it changed since the last
        report (the first report always counts as a change); None otherwise."""
        if self._started_at is None or now - self._started_at < self.listen_s:
            return None
        current = self.live(now)
        if current == self._reported:
            return None
        self._reported = current
        return current


def is_stale(sent_at: float, now: float, timeout_s: float) -> bool:
    """A control message sent at ``sent_at`` (its log timestamp, wall-clock seconds) and read
    at ``now`` (same clock) is too old to say anything about liveness: a replay of the
    log after a restart. Hosts' clocks must agree to well within ``timeout_s``."""
    return now - sent_at > timeout_s

