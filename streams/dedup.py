"""Which sequence numbers of one device were already seen: a bounded duplicate window.

A device numbers its records (``RecordBatch.seq``); a message sent again (a device
retrying after a lost acknowledgement, a gateway replaying its queue) carries the same
numbers. ``SeqWindow`` remembers the highest number seen and, in a ring of ``size``
bits, which of the ``size`` numbers at or below it were seen: constant memory per
device, whatever the stream's length.

A number more than ``size`` below the highest one cannot be checked (the window moved
past it): it is accepted and not remembered; a 0 down there starts the window again
(a device that restarted its numbering keeps streaming; its earlier numbers are
forgotten). A device that restarts its numbering before sending ``size`` records has
its new numbers taken for duplicates until they pass the old ones: the message format
carries no boot epoch to tell a restart from a resend.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np


class SeqWindow:
    """The sequence numbers seen of one device, within ``size`` of the highest.

    Invariant: for every ``n`` with ``high - size < n <= high``, ``bits[n % size]`` is
    true exactly when ``n`` was added; numbers at or below ``high - size`` are unknown.
    ``high`` is -1 before the first number.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a duplicate window holds at least 1 sequence number (got {size})")
        self.size = size
        self.high = -1
        self._bits = np.zeros(size, dtype=bool)

    # --- queries (no change) -------------------------------------------------------
    def all_new(self, seq: np.ndarray) -> bool:
        """True if ``seq`` is strictly increasing and above everything seen (the common
        case, checked without a loop): none of it is a duplicate."""
        if len(seq) == 0:
            return True
        numbers = _as_int64(seq)
        return bool(numbers[0] > self.high and (len(numbers) == 1 or np.all(numbers[1:] > numbers[:-1])))

    def seen(self, number: int) -> bool:
        """True if ``number`` was added and is still inside the window."""
        return number >= 0 and self.high - self.size < number <= self.high and bool(self._bits[number % self.size])

    # --- updates --------------------------------------------------------------------
    def add_if_new(self, seq: np.ndarray) -> bool:
        """The common case of one message, in a few operations: if ``seq`` is all new
        (``all_new``), mark it seen and return True; otherwise change nothing and return
        False (``check_and_add`` then says which are duplicates)."""
        numbers = _as_int64(seq)
        n = len(numbers)
        if n == 0:
            return True
        if int(numbers[0]) <= self.high or (n > 1 and not (numbers[1:] > numbers[:-1]).all()):
            return False
        self._advance(numbers)
        return True

    def check_and_add(self, seq: np.ndarray) -> np.ndarray:
        """Mark ``seq`` seen; returns the mask of those seen before (duplicates, also of
        an earlier number in ``seq`` itself)."""
        numbers = _as_int64(seq)
        duplicate = np.zeros(len(numbers), dtype=bool)
        if self.add_if_new(numbers):
            return duplicate
        for i, number in enumerate(numbers.tolist()):
            if number > self.high:
                self._clear(self.high + 1, number)
                self.high = number
                self._bits[number % self.size] = True
            elif number < 0 or number <= self.high - self.size:
                # Below the window (or beyond int64): cannot tell, accepted. A 0 down there
                # is a device that restarted its numbering: the window starts again with it.
                if number == 0:
                    self._bits[:] = False
                    self.high = 0
                    self._bits[0] = True
            elif self._bits[number % self.size]:
                duplicate[i] = True
            else:
                self._bits[number % self.size] = True
        return duplicate

    def add(self, seq: np.ndarray) -> None:
        """Mark ``seq`` seen (in any order)."""
        if not self.add_if_new(seq):
            self.check_and_add(seq)

    def add_new(self, seq: np.ndarray) -> None:
        """Mark ``seq`` seen, where ``all_new(seq)`` was true (not checked again)."""
        self._advance(_as_int64(seq))

    def _advance(self, numbers: np.ndarray) -> None:
        """``numbers`` increase and lie above ``high``: move the window up to their last."""
        if len(numbers) == 0:
            return
        first, top = int(numbers[0]), int(numbers[-1])
        self._clear(self.high + 1, top)
        if top - first + 1 == len(numbers):
            # Consecutive numbers (a device's usual message): ring slices, no index array.
            self._fill(max(first, top - self.size + 1), top, True)
        else:
            inside = numbers[numbers > top - self.size]
            self._bits[inside % self.size] = True
        self.high = top

    def _clear(self, first: int, last: int) -> None:
        """Forget the slots of ``first..last`` (numbers the window moves onto)."""
        if last < first:
            return
        if last - first + 1 >= self.size:
            self._bits[:] = False
        else:
            self._fill(first, last, False)

    def _fill(self, first: int, last: int, value: bool) -> None:
        """Set the slots of ``first..last`` (at most ``size`` numbers) to ``value``."""
        start, end = first % self.size, last % self.size
        if start <= end:
            self._bits[start : end + 1] = value
        else:  # wraps around the ring
            self._bits[start:] = value
            self._bits[: end + 1] = value

    # --- persistence ------------------------------------------------------------------
    def copy(self) -> SeqWindow:
        other = SeqWindow(self.size)
        other.high = self.high
        other._bits = self._bits.copy()
        return other

    def to_dict(self) -> dict[str, Any]:
        """JSON-able state (what a checkpoint stores): the size, the highest number and
        the bits of the ring, packed and base64-encoded."""
        return {"size": self.size, "high": self.high,
                "bits": base64.b64encode(np.packbits(self._bits).tobytes()).decode("ascii")}

    @classmethod
    def from_dict(cls, data: dict[str, Any], size: int) -> SeqWindow:
        """The window ``to_dict`` stored, held in a ring of ``size`` (the job's window now:
        a smaller one keeps the newest numbers, a larger one knows no more than was stored).

        Raises ``ValueError`` if ``data`` is not such a state."""
        try:
            stored_size, high = int(data["size"]), int(data["high"])
            packed = np.frombuffer(base64.b64decode(data["bits"], validate=True), dtype=np.uint8)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a duplicate window state: {exc}") from None
        if stored_size < 1 or high < -1 or len(packed) != (stored_size + 7) // 8:
            raise ValueError(f"not a duplicate window state: size {stored_size}, high {high}, "
                             f"{len(packed)} bytes of bits")
        bits = np.unpackbits(packed)[:stored_size].astype(bool)
        window = cls(size)
        if high < 0:
            return window
        lowest = max(0, high - min(size, stored_size) + 1)
        numbers = np.arange(lowest, high + 1, dtype=np.int64)
        window.high = high
        window._bits[numbers[bits[numbers % stored_size]] % size] = True
        return window


def _as_int64(seq: np.ndarray) -> np.ndarray:
    """Sequence numbers (uint64 on the wire) as int64, for arithmetic with -1 and the window.

    uint64 is reinterpreted in place (a view: the same two's-complement values a cast
    gives, numbers from 2**63 up negative), so the hot path copies nothing."""
    numbers = np.asarray(seq)
    if numbers.dtype == np.uint64:
        return numbers.view(np.int64)
    return numbers.astype(np.int64, copy=False)
