"""When the end-of-run drain should stop waiting: still making progress, or stuck."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

#: What ``DrainProgress.verdict`` returns.
WAIT, STALLED, OVER_MAX = "wait", "stalled", "over_max"


class DrainProgress:
    """Tells "still making progress" from "stuck" while ``edgestream run`` drains.

    ``observe(figures)`` is given what the run can see now (records read, trained and
    pending per device, every process's steps, trained records and model version, the
    consumer lag, ...): any change in them is progress. The drain waits while progress was
    seen within ``stall_s`` seconds, and never longer than ``max_s`` in all.
    ``restarted(at)`` counts a process that (re)joined as progress: its figures only show
    once it is ready.

    Invariant: ``verdict()`` is ``WAIT`` while ``clock() - last progress < stall_s`` and
    ``clock() - start < max_s``; then ``STALLED`` or ``OVER_MAX`` (the cap wins).
    """

    def __init__(self, stall_s: float, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if stall_s <= 0 or max_s <= 0:
            raise ValueError(f"stall_s and max_s must be positive (got {stall_s}, {max_s})")
        self.stall_s = stall_s
        self.max_s = max_s
        self.clock = clock
        self.started_at = clock()
        self.progress_at = self.started_at
        self._last: str | None = None
        #: How many times the figures moved (0: nothing moved since the drain began).
        self.moves = 0

    def observe(self, figures: Any) -> bool:
        """Record what the run sees now; True if it differs from the last observation."""
        key = json.dumps(figures, sort_keys=True, default=str)
        if self._last is None:
            self._last = key
            return False
        if key == self._last:
            return False
        self._last = key
        self.moves += 1
        self.progress_at = self.clock()
        return True

    def restarted(self, at: float) -> None:
        """A process became ready at ``at`` (on ``clock``): progress, if it is the latest."""
        self.progress_at = max(self.progress_at, at)

    def quiet_s(self) -> float:
        """Seconds since the last progress."""
        return self.clock() - self.progress_at

    def elapsed_s(self) -> float:
        return self.clock() - self.started_at

    def verdict(self) -> str:
        if self.elapsed_s() >= self.max_s:
            return OVER_MAX
        if self.quiet_s() >= self.stall_s:
            return STALLED
        return WAIT

    def status(self, waiting_for: str) -> str:
        """The live view's line: what the drain waits for and how long it still may."""
        moving = "no progress yet" if not self.moves else f"last progress {self.quiet_s():.0f}s ago"
        return (f"draining {self.elapsed_s():.0f}s: waiting for {waiting_for}; {moving} "
                f"(gives up after {self.stall_s:.0f}s without progress, at most {self.max_s:.0f}s)")

    def timeout_reason(self, waiting_for: str) -> str:
        """One line: why the drain ended without every record settled."""
        if self.verdict() == OVER_MAX:
            return (f"the drain reached run.drain_max_s={self.max_s:g}s (last progress {self.quiet_s():.0f}s ago) "
                    f"while waiting for {waiting_for}; raise run.drain_max_s")
        return (f"no progress for run.drain_timeout_s={self.stall_s:g}s while waiting for {waiting_for}; "
                "raise run.drain_timeout_s if the workers were only slow")


def waiting_for(rows: dict[str, dict], produced: dict[str, int]) -> str:
    """In words, what the drain still waits for: records unread and pending, over how many
    devices (``rows``: the run's device view, ``produced``: per device)."""
    unread = {d: max(0, produced.get(d, 0) - r.get("read", 0)) for d, r in rows.items()}
    pending = {d: r.get("pending", 0) for d, r in rows.items()}
    parts = []
    if sum(unread.values()):
        parts.append(f"{sum(unread.values())} unread record(s) on {sum(1 for v in unread.values() if v)} device(s)")
    if sum(pending.values()):
        parts.append(f"{sum(pending.values())} pending record(s) on "
                     f"{sum(1 for v in pending.values() if v)} device(s)")
    return ", ".join(parts) or "the workers to settle (lag, versions)"
