"""Times to a target that some runs never reach: ratios and medians with the misses kept.

A run that misses the target within the budget is *censored*: its time is only known to
exceed the budget. A ratio of two times then is a bound (``>`` or ``<`` the value computed
with the budget in place of the missing time), and a median over runs keeps that mark.
"""

from __future__ import annotations

import math
from typing import Any


def censored_ratio(a: float | None, b: float | None, budget: float) -> dict[str, Any] | None:
    """``a / b`` with a missed target counted as the budget: ``{"value", "bound": "=" | ">" | "<"}``;
    None when neither reached it (nothing known)."""
    if a is None and b is None:
        return None
    if a is None:
        return {"value": budget / b, "bound": ">"}
    if b is None:
        return {"value": a / budget, "bound": "<"}
    return {"value": a / b, "bound": "="}


def median_bound(values: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The median of censored values (None entries left out), its mark, and the min-max."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    ordered = sorted(known, key=lambda v: v["value"])
    mid = ordered[(len(ordered) - 1) // 2] if len(ordered) % 2 else None
    if mid is None:  # even count: mean of the middle two, marked if either is a bound
        lo, hi = ordered[len(ordered) // 2 - 1], ordered[len(ordered) // 2]
        marks = {lo["bound"], hi["bound"]} - {"="}
        mid = {"value": (lo["value"] + hi["value"]) / 2, "bound": marks.pop() if len(marks) == 1 else "="}
    return {"value": mid["value"], "bound": mid["bound"], "min": ordered[0]["value"], "max": ordered[-1]["value"]}


def censored_median(ttas: list[float | None], budget: float) -> dict[str, Any] | None:
    """The median time to target of runs, a miss counted as ``> budget``."""
    return median_bound([{"value": t, "bound": "="} if t is not None else {"value": budget, "bound": ">"}
                         for t in ttas])


def text(value: dict[str, Any] | None, digits: int = 2, suffix: str = "", spread: bool = True,
         missing: str = "-") -> str:
    """A censored value for a table: its mark (``>`` / ``<``; none when exact), the value with
    ``digits`` decimals and ``suffix``, then the min-max over runs when ``spread`` and they
    differ (``>1.20x (0.90-1.40)``); ``missing`` when nothing is known."""
    if value is None:
        return missing
    mark = "" if value["bound"] == "=" else value["bound"]
    out = f"{mark}{value['value']:.{digits}f}{suffix}"
    if spread and not math.isclose(value["min"], value["max"]):
        out += f" ({value['min']:.{digits}f}-{value['max']:.{digits}f})"
    return out
