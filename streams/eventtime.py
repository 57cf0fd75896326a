"""Whether a device's event times are believable: within a skew of the broker's clock.

A record's event time comes from the device's clock; the broker stamps every message
with its own (``CreateTime`` from the producer's clock, or ``LogAppendTime``). A record
whose event time lies more than ``max_skew_s`` from its message's timestamp (an unset
clock: 1970, a sign error: 1938, a clock a year ahead), or more than ``max_skew_s``
behind the newest event time accepted from the device (a clock that jumped back), is
rejected as ``bad_timestamp``. Out of order within the skew is accepted.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

#: The reason a rejected record is dead-lettered with.
BAD_TIMESTAMP = "bad_timestamp"


@dataclass(frozen=True)
class TimestampVerdict:
    """Which records of a message are rejected (``bad``) and why (one line, or "")."""

    bad: np.ndarray  # bool [n]
    detail: str = ""

    @property
    def count(self) -> int:
        return int(self.bad.sum())


class EventTimeCheck:
    """The event-time check of one device.

    Invariant: ``newest_s`` is the latest event time of a record that passed (None before
    the first); ``verdict`` changes nothing, ``accept`` moves ``newest_s``.
    """

    def __init__(self, max_skew_s: float) -> None:
        if not max_skew_s > 0 or not math.isfinite(max_skew_s):
            raise ValueError(f"the event-time skew must be a finite number of seconds > 0 (got {max_skew_s})")
        self.max_skew_s = float(max_skew_s)
        self.newest_s: float | None = None

    def verdict(self, event_time: np.ndarray, reference_s: np.ndarray | float) -> TimestampVerdict:
        """Judge ``event_time`` (seconds since the epoch, in arrival order) against
        ``reference_s``: the broker timestamp of each record's message (or one for all).

        A record going back more than the skew is judged against the newest event time
        accepted before it, in this call too (records rejected here do not count)."""
        event_time = np.asarray(event_time, dtype=np.float64)
        reference = np.broadcast_to(np.asarray(reference_s, dtype=np.float64), event_time.shape)
        offset = event_time - reference
        off_clock = ~(np.abs(offset) <= self.max_skew_s)  # NaN counts as off
        if len(event_time) and not off_clock.any():
            # The common case, without the running maximum: nothing lies further back than
            # the skew from the newest of all (accepted before, or in this call).
            newest = float(event_time.max()) if self.newest_s is None else max(self.newest_s, float(event_time.max()))
            if float(event_time.min()) >= newest - self.max_skew_s:
                return TimestampVerdict(off_clock)
        # The newest accepted event time before each record (off-clock records excluded).
        candidates = np.where(off_clock, -np.inf, event_time)
        before = np.maximum.accumulate(np.concatenate(([-np.inf if self.newest_s is None else self.newest_s],
                                                       candidates[:-1])))
        backwards = ~off_clock & (event_time < before - self.max_skew_s)
        bad = off_clock | backwards
        if not bad.any():
            return TimestampVerdict(bad)
        return TimestampVerdict(bad, self._detail(event_time, reference, offset, before, off_clock, backwards))

    def run_passes(self, event_time: np.ndarray, lowest_reference_s: float, highest_reference_s: float) -> bool:
        """True if ``verdict(event_time, reference)`` rejects nothing for any reference
        with every value in ``[lowest_reference_s, highest_reference_s]``: the bounds of
        a run, checked with two reductions. False does not mean a record is bad (call
        ``verdict`` for that): only that the bounds alone cannot tell."""
        if not len(event_time):
            return True
        lo, hi = float(np.min(event_time)), float(np.max(event_time))  # NaN: every test below fails
        newest = hi if self.newest_s is None else max(self.newest_s, hi)
        skew = self.max_skew_s
        return hi - lowest_reference_s <= skew and highest_reference_s - lo <= skew and lo >= newest - skew

    def accept_if_clean(self, event_time: np.ndarray, reference_s: float) -> bool:
        """The common case of one message, with two reductions: if its bounds show that
        ``verdict(event_time, reference_s)`` rejects nothing, ``accept`` them and return
        True; otherwise change nothing and return False. False does not mean a record is
        bad (records out of order by more than the skew may all pass): call ``verdict``."""
        if not len(event_time):
            return True
        lo, hi = float(event_time.min()), float(event_time.max())  # NaN: every test below fails
        newest = hi if self.newest_s is None else max(self.newest_s, hi)
        skew = self.max_skew_s
        if hi - reference_s <= skew and reference_s - lo <= skew and lo >= newest - skew:
            self.newest_s = newest
            return True
        return False

    def accept(self, event_time: np.ndarray) -> None:
        """The records with these event times passed: the newest of them moves ``newest_s``."""
        if len(event_time):
            top = float(np.max(event_time))
            self.newest_s = top if self.newest_s is None else max(self.newest_s, top)

    def _detail(self, event_time: np.ndarray, reference: np.ndarray, offset: np.ndarray, before: np.ndarray,
                off_clock: np.ndarray, backwards: np.ndarray) -> str:
        parts = []
        if off_clock.any():
            i = int(np.argmax(off_clock))
            parts.append(
                f"{int(off_clock.sum())} record(s) off their message's Kafka timestamp, e.g. event time {_iso(event_time[i])} "
                f"is {abs(offset[i]):.0f} s {'ahead of' if offset[i] > 0 else 'behind'} the message's timestamp "
                f"{_iso(reference[i])}")
        if backwards.any():
            i = int(np.argmax(backwards))
            parts.append(
                f"{int(backwards.sum())} record(s) going back in time, e.g. event time {_iso(event_time[i])} is "
                f"{before[i] - event_time[i]:.0f} s before the device's newest {_iso(before[i])}")
        return "; ".join(parts) + (f" (data.max_timestamp_skew_s = {self.max_skew_s:g}): "
                                   "check the device's clock (NTP) and how it stamps its records")


def _iso(seconds: float) -> str:
    """``seconds`` since the epoch as UTC ISO 8601, or the number if no date can show it."""
    if not math.isfinite(seconds):
        return str(seconds)
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
    except (OverflowError, OSError, ValueError):
        return f"{seconds:g} s since the epoch"
