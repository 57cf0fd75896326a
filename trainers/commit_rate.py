"""ADSP commit-rate control: the commit interval, the commit timer, the loss-curve fit
and the online search for the commit target ``C``.

Everything here is pure: no clock is read, time is handed in as ``now`` (seconds, any
monotonic origin). The ADSP strategy (``trainers/strategies/adsp.py``) runs a
:class:`CommitScheduler` on every worker and a :class:`CommitRateSearch` on the server.

The search (ADSP, AAAI 2020): time is cut into check periods; in each period every
worker commits ``C`` times, whatever its speed. The server samples the global loss at
the start, middle and end of the period, fits ``l(t) = 1 / (a^2 t + b) + c0`` to the
three samples, and scores the period by the inverse of the time the fitted curve needs
to bring the loss down to the target. It tries ``C + 1`` while the score improves and
then settles on the best ``C``; it searches again every ``research_every_periods``
periods, and at once when the loss jumps by ``jump_ratio`` (30 %) or more against the
last period's end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "CommitRateSearch",
    "CommitScheduler",
    "LossCurve",
    "commit_interval",
    "fit_loss_curve",
]


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def commit_interval(period_s: float, c: int, min_interval_s: float = 0.0, overhead_s: float = 0.0) -> float:
    """Seconds between two commits of one worker: ``max(min_interval_s, period_s / c - overhead_s)``.

    ``period_s`` is the check period (> 0), ``c`` the commit target per period (>= 1),
    ``min_interval_s`` a floor (>= 0) and ``overhead_s`` the time one commit costs the
    worker (>= 0: sending the delta and pulling the model), taken off so that ``c``
    commits still fit in a period.
    """
    period_s = _finite("period_s", period_s)
    min_interval_s = _finite("min_interval_s", min_interval_s)
    overhead_s = _finite("overhead_s", overhead_s)
    if period_s <= 0:
        raise ValueError(f"period_s must be > 0, got {period_s}")
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise ValueError(f"the commit target c must be an int >= 1, got {c!r}")
    if min_interval_s < 0:
        raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s}")
    if overhead_s < 0:
        raise ValueError(f"overhead_s must be >= 0, got {overhead_s}")
    return max(min_interval_s, period_s / c - overhead_s)


class CommitScheduler:
    """When a worker's next commit is due, for a given interval.

    The timer starts at the first :meth:`due` call (the first time the worker is
    polled); a commit is due once ``interval_s`` has passed since the start or the
    last commit's *due time*: a commit made late (a slow worker is polled only between
    its long steps) keeps the cadence, so slow and fast workers commit equally often.
    A commit later than a whole interval restarts the cadence at the commit (no burst of
    catch-up commits). Changing the interval (a new ``C``) moves the next due time to
    ``last anchor + new interval``, so a shorter interval takes effect at once.

    Invariant: ``next_due`` is None before the timer started, else ``anchor + interval_s``.
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = self._check(interval_s)
        self._anchor: float | None = None  # start, or due time (or time, if very late) of the last commit

    @staticmethod
    def _check(interval_s: float) -> float:
        interval_s = _finite("interval_s", interval_s)
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        return interval_s

    @property
    def next_due(self) -> float | None:
        """Time of the next commit (None until the timer started)."""
        return None if self._anchor is None else self._anchor + self.interval_s

    def due(self, now: float) -> bool:
        """True if a commit is due at ``now`` (starts the timer on the first call)."""
        now = _finite("now", now)
        if self._anchor is None or now < self._anchor:
            # Not started, or restored from a checkpoint taken on another clock (another
            # host, or before a reboot: monotonic time went backwards): start afresh.
            self._anchor = now
            return False
        return now >= self._anchor + self.interval_s

    def committed(self, now: float) -> None:
        """A commit happened at ``now``: the next one is due ``interval_s`` after the time
        this one was due, or after ``now`` if it came early or more than an interval late."""
        now = _finite("now", now)
        due = self.next_due
        self._anchor = due if due is not None and due <= now < due + self.interval_s else now

    def set_interval(self, interval_s: float) -> None:
        """Use a new interval from the last commit (or the start) on."""
        self.interval_s = self._check(interval_s)

    def state_dict(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "anchor": self._anchor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.interval_s = self._check(float(state["interval_s"]))
        anchor = state["anchor"]
        self._anchor = None if anchor is None else float(anchor)


# -- the loss curve -----------------------------------------------------------------------------


@dataclass(frozen=True)
class LossCurve:
    """A fitted ``l(t) = 1 / (a^2 t + b) + c0`` (``a2`` is ``a^2 >= 0``); ``rmse`` in loss units."""

    a2: float
    b: float
    c0: float
    rmse: float

    def __call__(self, t: float) -> float:
        """The fitted loss at time ``t`` (inf where the curve has its pole)."""
        denominator = self.a2 * t + self.b
        return math.inf if denominator <= 0 else 1.0 / denominator + self.c0

    def time_at(self, loss: float) -> float:
        """The time at which the curve reaches ``loss``; inf if it never does
        (``loss <= c0``, or a flat curve)."""
        if loss <= self.c0 or self.a2 <= 0:
            return math.inf
        return (1.0 / (loss - self.c0) - self.b) / self.a2

    def predicted_time_to(self, target_loss: float, from_loss: float | None = None) -> float:
        """Time until the curve reaches ``target_loss``: from ``t = 0`` (the start of the
        fitted samples' time axis), or, with ``from_loss``, from where the curve is at
        ``from_loss``. inf if the target is never reached; may be <= 0 if it already was."""
        target = self.time_at(target_loss)
        if math.isinf(target):
            return math.inf
        start = 0.0 if from_loss is None else self.time_at(from_loss)
        return target - start


def _linear_fit(ts: np.ndarray, losses: np.ndarray, c0: float) -> tuple[float, float, float]:
    """For a fixed ``c0``: least squares of ``1 / (l - c0) = A t + B`` with ``A >= 0``;
    returns ``(A, B, sse)`` with the sum of squared errors measured in loss units."""
    y = 1.0 / (losses - c0)
    design = np.stack([ts, np.ones_like(ts)], axis=1)
    (slope, intercept), *_ = np.linalg.lstsq(design, y, rcond=None)
    if slope < 0:  # a rising curve: the best non-decreasing-in-t fit is flat
        slope, intercept = 0.0, float(np.mean(y))
    fitted = slope * ts + intercept
    if np.any(fitted <= 0):
        return float(slope), float(intercept), math.inf
    sse = float(np.sum((1.0 / fitted + c0 - losses) ** 2))
    return float(slope), float(intercept), sse


def fit_loss_curve(
    ts: Any,
    losses: Any,
    *,
    c0_floor: float | None = None,
    grid: int = 200,
    refine_iterations: int = 60,
) -> LossCurve:
    """Fit ``l(t) = 1 / (a^2 t + b) + c0`` to loss samples ``losses`` at times ``ts``.

    Method: for a fixed floor ``c0`` the model is linear in ``1 / (l - c0) = a^2 t + b``,
    so ``(a^2, b)`` come from a linear least-squares fit (``a^2`` clamped at 0). The
    floor is searched below ``min(losses)``: first on a grid of ``grid`` values whose
    gaps ``min(losses) - c0`` are log-spaced from ``1e-6`` of the loss scale up to
    ``min(losses) - c0_floor``, then refined by golden-section search between the grid
    neighbours of the best point. The score of a ``c0`` is the sum of squared errors in
    loss units (not in the transformed space). ``c0_floor`` is the lowest floor
    considered (default: ``0`` when every loss is positive, as for cross-entropy, else
    ``min - 10 * (max - min + 1)``). Needs at least three samples with distinct times;
    with exactly three it interpolates them when a curve of this form can.
    """
    t = np.asarray(ts, dtype=np.float64).ravel()
    y = np.asarray(losses, dtype=np.float64).ravel()
    if t.shape != y.shape:
        raise ValueError(f"ts and losses differ in length: {t.size} != {y.size}")
    if t.size < 3:
        raise ValueError(f"fitting needs at least 3 samples, got {t.size}")
    if not (np.all(np.isfinite(t)) and np.all(np.isfinite(y))):
        raise ValueError("ts and losses must be finite")
    if np.unique(t).size < 2:
        raise ValueError("fitting needs samples at two or more distinct times")
    if grid < 3 or refine_iterations < 0:
        raise ValueError(f"grid must be >= 3 and refine_iterations >= 0, got {grid}, {refine_iterations}")
    low = float(y.min())
    spread = float(y.max()) - low
    if c0_floor is None:
        c0_floor = 0.0 if low > 0 else low - 10.0 * (spread + 1.0)
    c0_floor = _finite("c0_floor", c0_floor)
    if c0_floor >= low:
        raise ValueError(f"c0_floor {c0_floor} must be below the smallest loss {low}")
    scale = max(spread, abs(low), 1e-12)
    gaps = np.geomspace(min(1e-6 * scale, (low - c0_floor) / 2), low - c0_floor, grid)
    candidates = low - gaps  # from just below min(losses) down to c0_floor

    def sse(c0: float) -> float:
        return _linear_fit(t, y, c0)[2]

    scores = [sse(float(c)) for c in candidates]
    best = int(np.argmin(scores))
    # Golden-section search between the best grid point's neighbours (in gap space).
    lo_gap = gaps[max(best - 1, 0)]
    hi_gap = gaps[min(best + 1, grid - 1)]
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    left, right = float(lo_gap), float(hi_gap)
    x1, x2 = right - ratio * (right - left), left + ratio * (right - left)
    f1, f2 = sse(low - x1), sse(low - x2)
    for _ in range(refine_iterations):
        if f1 <= f2:
            right, x2, f2 = x2, x1, f1
            x1 = right - ratio * (right - left)
            f1 = sse(low - x1)
        else:
            left, x1, f1 = x1, x2, f2
            x2 = left + ratio * (right - left)
            f2 = sse(low - x2)
    c0_best, sse_best = float(candidates[best]), scores[best]
    for gap, value in ((x1, f1), (x2, f2)):
        if value < sse_best:
            c0_best, sse_best = low - gap, value
    a2, b, sse_final = _linear_fit(t, y, c0_best)
    return LossCurve(a2=a2, b=b, c0=c0_best, rmse=math.sqrt(sse_final / t.size))


# -- the search for C ------------------------------------------------------------------------------


class CommitRateSearch:
    """The server's online search for the commit target ``C`` (pure state machine).

    Feed it the global loss with :meth:`observe_loss` whenever a new value is known, and
    call :meth:`poll` regularly; ``poll`` returns the new ``C`` when it changes (the
    server broadcasts it), else None.

    A check period starts at the first ``poll`` that knows a loss. Its samples are the
    latest known loss at the period start, at the first poll at or after its middle and
    at the first poll at or after its end. At the end the three samples (times relative
    to the period start) are fitted with :func:`fit_loss_curve` and the period scored:

    - ``score = 1 / T`` with ``T`` the fitted curve's time to go from the *reference
      loss* (the loss at the start of the current search) down to ``target_loss``.
      Measuring every period over the same loss interval makes periods that start at
      different losses comparable (``T`` does not depend on ``b``).
    - With no ``target_loss`` or a target at or above the reference loss, ``T`` is the
      time to halve the excess loss ``reference - c0`` (``score = a^2 (reference - c0)``).
    - A curve that never reaches the target (flat, rising, or target below its floor)
      scores 0.

    While searching: the first period of a search records its score and moves to
    ``C + 1``; each further period moves on to ``C + 1`` if its score beats the best so
    far, else the search settles on the best ``C`` (also at ``max_c``). Settled, a new
    search starts after ``research_every_periods`` periods, and at the next poll when a
    loss at least ``(1 + jump_ratio)`` times the previous period's end is observed. A
    new search starts from ``max(min_c, C - 1)`` so ``C`` can also come down.
    """

    def __init__(
        self,
        period_s: float,
        *,
        initial_c: int = 1,
        target_loss: float | None = None,
        min_c: int = 1,
        max_c: int = 64,
        research_every_periods: int = 10,
        jump_ratio: float = 0.3,
    ) -> None:
        """``period_s``: check period (> 0); ``initial_c``: the first ``C`` tried;
        ``target_loss``: the loss whose predicted time is minimised (None: halving time);
        ``min_c``/``max_c``: bounds of ``C``; ``research_every_periods``: settled periods
        before searching again (>= 1); ``jump_ratio``: relative loss rise that restarts
        the search (> 0)."""
        self.period_s = _finite("period_s", period_s)
        if self.period_s <= 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        for name, value in (("initial_c", initial_c), ("min_c", min_c), ("max_c", max_c),
                            ("research_every_periods", research_every_periods)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not min_c <= initial_c <= max_c:
            raise ValueError(f"need min_c <= initial_c <= max_c, got {min_c}, {initial_c}, {max_c}")
        if target_loss is not None:
            target_loss = _finite("target_loss", target_loss)
        jump_ratio = _finite("jump_ratio", jump_ratio)
        if jump_ratio <= 0:
            raise ValueError(f"jump_ratio must be > 0, got {jump_ratio}")
        self.target_loss = target_loss
        self.min_c, self.max_c = min_c, max_c
        self.research_every_periods = research_every_periods
        self.jump_ratio = jump_ratio
        self.c = initial_c
        self.searching = True
        self.best_c: int | None = None
        self.best_score: float | None = None
        self.reference_loss: float | None = None
        self.settled_periods = 0
        self.searches = 1
        self.last_fit: LossCurve | None = None
        self.last_score: float | None = None
        self._latest: float | None = None  # latest known global loss
        self._jumped = False
        self._last_end: float | None = None  # loss at the previous period's end
        self._start: tuple[float, float] | None = None  # (time, loss) of the current period's start
        self._middle: tuple[float, float] | None = None

    # -- inputs ------------------------------------------------------------------------------

    def observe_loss(self, now: float, loss: float) -> None:
        """The global loss is ``loss`` at ``now`` (finite; a jump is acted on at the next poll)."""
        _finite("now", now)
        self._latest = _finite("loss", loss)
        if self._last_end is not None and self._latest >= (1.0 + self.jump_ratio) * self._last_end:
            self._jumped = True

    def poll(self, now: float) -> int | None:
        """Advance the period clock to ``now``; return the new ``C`` if it changed."""
        now = _finite("now", now)
        if self._latest is None:
            return None  # no loss known yet: the first period has not started
        if self._start is None or now < self._start[0]:
            # Not started, or restored from a checkpoint taken on another clock: a new period.
            self._begin(now)
            return None
        if self._jumped:
            self._jumped = False
            self._last_end = self._latest  # the new level: one jump starts one search
            before = self.c
            self._new_search()
            self._begin(now)
            return self.c if self.c != before else None
        t0 = self._start[0]
        if self._middle is None and now >= t0 + self.period_s / 2:
            self._middle = (now, self._latest)
        if now < t0 + self.period_s or self._middle is None:
            return None
        return self._end_period(now)

    # -- the period's end --------------------------------------------------------------------

    def _begin(self, now: float) -> None:
        assert self._latest is not None
        self._start = (now, self._latest)
        self._middle = None
        if self.searching and self.reference_loss is None:
            self.reference_loss = self._latest

    def _new_search(self) -> None:
        self.searching = True
        self.searches += 1
        self.best_c = self.best_score = self.reference_loss = None
        self.settled_periods = 0
        self.c = max(self.min_c, self.c - 1)

    def score(self, curve: LossCurve) -> float:
        """The inverse predicted time of ``curve`` from the reference loss to the target (see class doc)."""
        reference = self.reference_loss
        if reference is None or curve.a2 <= 0 or reference <= curve.c0:
            return 0.0
        if self.target_loss is not None and self.target_loss < reference:
            duration = curve.predicted_time_to(self.target_loss, from_loss=reference)
            return 0.0 if not math.isfinite(duration) or duration <= 0 else 1.0 / duration
        return curve.a2 * (reference - curve.c0)

    def _end_period(self, now: float) -> int | None:
        assert self._start is not None and self._middle is not None and self._latest is not None
        t0 = self._start[0]
        samples = [self._start, self._middle, (now, self._latest)]
        curve = fit_loss_curve([t - t0 for t, _ in samples], [loss for _, loss in samples])
        self.last_fit = curve
        before = self.c
        if self.searching:
            score = self.score(curve)
            self.last_score = score
            if self.best_score is None or score > self.best_score:
                self.best_c, self.best_score = self.c, score
                if self.c < self.max_c:
                    self.c += 1
                else:
                    self._settle()
            else:
                self._settle()
        else:
            self.settled_periods += 1
            if self.settled_periods >= self.research_every_periods:
                self._new_search()
        self._last_end = self._latest
        self._begin(now)
        return self.c if self.c != before else None

    def _settle(self) -> None:
        assert self.best_c is not None
        self.c = self.best_c
        self.searching = False
        self.settled_periods = 0

    # -- persistence and observability ---------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Primitives only (safe for a weights_only checkpoint)."""
        fit = self.last_fit
        return {
            "c": self.c, "searching": self.searching, "best_c": self.best_c, "best_score": self.best_score,
            "reference_loss": self.reference_loss, "settled_periods": self.settled_periods,
            "searches": self.searches, "last_score": self.last_score,
            "last_fit": None if fit is None else [fit.a2, fit.b, fit.c0, fit.rmse],
            "latest": self._latest, "jumped": self._jumped, "last_end": self._last_end,
            "start": None if self._start is None else list(self._start),
            "middle": None if self._middle is None else list(self._middle),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        def opt(value: Any, kind: type) -> Any:
            return None if value is None else kind(value)

        self.c = int(state["c"])
        self.searching = bool(state["searching"])
        self.best_c = opt(state["best_c"], int)
        self.best_score = opt(state["best_score"], float)
        self.reference_loss = opt(state["reference_loss"], float)
        self.settled_periods = int(state["settled_periods"])
        self.searches = int(state["searches"])
        self.last_score = opt(state["last_score"], float)
        fit = state["last_fit"]
        self.last_fit = None if fit is None else LossCurve(*(float(v) for v in fit))
        self._latest = opt(state["latest"], float)
        self._jumped = bool(state["jumped"])
        self._last_end = opt(state["last_end"], float)
        self._start = None if state["start"] is None else (float(state["start"][0]), float(state["start"][1]))
        self._middle = None if state["middle"] is None else (float(state["middle"][0]), float(state["middle"][1]))

    def stats(self) -> dict[str, Any]:
        """The current ``C``, the search's state and the last fitted curve (JSON-able)."""
        fit = self.last_fit
        return {
            "c": self.c, "searching": self.searching, "best_c": self.best_c, "best_score": self.best_score,
            "searches": self.searches, "last_score": self.last_score, "reference_loss": self.reference_loss,
            "fit": None if fit is None else {"a2": fit.a2, "b": fit.b, "c0": fit.c0, "rmse": fit.rmse},
        }
