"""Duplicate filters of received messages, shared by the strategies that need one."""

from __future__ import annotations

from collections.abc import Sequence


class StepSet:
    """Steps seen of one sender incarnation: everything up to ``floor`` plus ``above``."""

    def __init__(self, floor: int = 0, above: Sequence[int] = ()) -> None:
        self.floor = floor
        self.above = set(above)

    def add(self, step: int) -> bool:
        """Record ``step``; False if it was seen already."""
        if step <= self.floor or step in self.above:
            return False
        self.above.add(step)
        while self.floor + 1 in self.above:
            self.floor += 1
            self.above.discard(self.floor)
        return True

    def raise_floor(self, step: int) -> None:
        """Count every step up to ``step`` as seen."""
        if step > self.floor:
            self.floor = step
            self.above = {s for s in self.above if s > step}
            while self.floor + 1 in self.above:
                self.floor += 1
                self.above.discard(self.floor)

    @property
    def newest(self) -> int:
        return max(self.floor, *self.above) if self.above else self.floor
