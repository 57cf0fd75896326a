"""Link specs ("10mbit", "1mbit 80ms", "5mbit 40ms 10ms") and the tbf parameters for a rate.

Pure: no commands are run here. A spec is a rate, then optionally a delay, a jitter and a
loss percentage. The delay is the round-trip time added between a host and the brokers
(half on the way out, half on the way back); the jitter is split the same way.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

#: Rates a link may have: tbf is exact from 8 kbit/s to well beyond what veth carries here.
MIN_RATE_BPS = 8_000
MAX_RATE_BPS = 10_000_000_000
#: Delays (and jitters) up to this many ms; beyond it Kafka's own timeouts dominate.
MAX_DELAY_MS = 10_000.0

_RATE_UNITS = {"bit": 1, "kbit": 1_000, "mbit": 1_000_000, "gbit": 1_000_000_000}
_TIME_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0}
_NUMBER = r"(\d+(?:\.\d+)?)"
_RATE_RE = re.compile(_NUMBER + r"(bit|kbit|mbit|gbit)")
_TIME_RE = re.compile(_NUMBER + r"(us|ms|s)")
_LOSS_RE = re.compile(_NUMBER + r"%")
EXAMPLES = '"10mbit", "1mbit 80ms", "5mbit 40ms 10ms", "80ms", "" (unshaped)'


@dataclass(frozen=True)
class LinkSpec:
    """One host's link: ``rate_bps`` None = not rate-limited; delay/jitter in ms (round trip)."""

    rate_bps: int | None = None
    delay_ms: float = 0
    jitter_ms: float = 0
    loss_pct: float = 0

    @property
    def shaped(self) -> bool:
        return self.rate_bps is not None

    @property
    def delayed(self) -> bool:
        return self.delay_ms > 0 or self.jitter_ms > 0

    def __str__(self) -> str:
        parts = [format_rate(self.rate_bps)] if self.rate_bps is not None else []
        if self.delayed:
            parts.append(f"{_num(self.delay_ms)}ms")
        if self.jitter_ms:
            parts.append(f"{_num(self.jitter_ms)}ms")
        if self.loss_pct:
            parts.append(f"{_num(self.loss_pct)}%")
        return " ".join(parts)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def format_rate(rate_bps: int) -> str:
    for unit, factor in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if rate_bps % factor == 0:
            return f"{rate_bps // factor}{unit}"
    return f"{rate_bps}bit"


def parse_link(text: str) -> LinkSpec:
    """``"RATE [DELAY [JITTER]] [LOSS%]"`` -> LinkSpec; ValueError saying what is allowed.

    RATE: a number with bit, kbit, mbit or gbit (tc's units; bits per second); it may be
    left out ("80ms": delay only). DELAY and JITTER: a number with us, ms or s. LOSS: a
    percentage. An empty string is an unshaped link.
    """
    tokens = str(text).lower().split()
    rate: int | None = None
    times: list[float] = []
    loss = 0.0
    for index, token in enumerate(tokens):
        if m := _RATE_RE.fullmatch(token):
            if index != 0:
                raise ValueError(f"link {text!r}: the rate {token!r} must come first (e.g. {EXAMPLES})")
            rate_f = float(m.group(1)) * _RATE_UNITS[m.group(2)]
            if not MIN_RATE_BPS <= rate_f <= MAX_RATE_BPS:
                raise ValueError(f"link {text!r}: rate {token} is outside {format_rate(MIN_RATE_BPS)}.."
                                 f"{format_rate(MAX_RATE_BPS)}")
            rate = int(round(rate_f))
        elif m := _TIME_RE.fullmatch(token):
            if loss:
                raise ValueError(f"link {text!r}: delay and jitter come before the loss %")
            ms = float(m.group(1)) * _TIME_UNITS[m.group(2)]
            if ms > MAX_DELAY_MS:
                raise ValueError(f"link {text!r}: {token} is above {MAX_DELAY_MS:g} ms")
            times.append(ms)
        elif m := _LOSS_RE.fullmatch(token):
            loss = float(m.group(1))
            if not 0 < loss < 100:
                raise ValueError(f"link {text!r}: loss must lie in (0, 100) % (a total cut is "
                                 "`edgestream testbed fault HOST partition`)")
        else:
            hint = ""
            if re.fullmatch(r"-.*", token):
                hint = " (negative values are not allowed)"
            elif re.fullmatch(_NUMBER + r"[kmg]?(bps|b/s|bits?/s|bits)", token) or re.fullmatch(_NUMBER, token):
                hint = " (write rates as tc does: bit, kbit, mbit or gbit per second, e.g. 10mbit)"
            raise ValueError(f"link {text!r}: cannot read {token!r}{hint}; write RATE [DELAY [JITTER]] "
                             f"[LOSS%], e.g. {EXAMPLES}")
    if len(times) > 2:
        raise ValueError(f"link {text!r}: at most two times (delay, then jitter)")
    delay = times[0] if times else 0.0
    jitter = times[1] if len(times) > 1 else 0.0
    if jitter > delay:
        raise ValueError(f"link {text!r}: jitter {_num(jitter)} ms is larger than the delay {_num(delay)} ms")
    return LinkSpec(rate, delay, jitter, loss)


# --- tbf ------------------------------------------------------------------------------
#: Bytes of a full Ethernet frame; a tbf bucket holds at least two.
FRAME_BYTES = 1514
#: A bucket refills this many seconds of traffic (bursts above the rate last at most this long).
BURST_S = 0.005
#: The tbf queue holds this many seconds of traffic at the rate (beyond it, packets drop).
QUEUE_S = 0.1


@dataclass(frozen=True)
class TbfParams:
    rate_bps: int
    burst_bytes: int
    limit_bytes: int

    def args(self) -> list[str]:
        """The tc arguments after ``root handle 1:``."""
        return ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(self.burst_bytes),
                "limit", str(self.limit_bytes)]


def tbf_params(rate_bps: int) -> TbfParams:
    """Bucket and queue for ``rate_bps``: burst = max(2 frames, 5 ms at the rate) and a
    queue of 100 ms at the rate plus one burst (256 kbit/s: 3028 B burst, 6228 B queue,
    at least 16 KiB; 1 gbit/s: 625 kB burst, 13.1 MB queue)."""
    byte_rate = rate_bps / 8
    burst = max(2 * FRAME_BYTES, math.ceil(byte_rate * BURST_S))
    limit = max(16 * 1024, burst + math.ceil(byte_rate * QUEUE_S))
    return TbfParams(rate_bps, burst, limit)
