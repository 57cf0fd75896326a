"""Delayed labels: readings that arrive without a label wait for it from a label topic.

Three pure pieces, no clock and no I/O (the ingest core drives them):

* ``LabelDecoder`` reads a label message: one JSON object, or an array of them, each
  naming the device (a field, or the message's Kafka key), the reading (its record id,
  or its event time) and the label. Anything else is a ``RecordDecodeError`` with the
  reason the dead-letter topic gets.
* ``LabelJoin`` pairs readings and labels by ``(device, key)``, in whichever order they
  come, within ``max_delay_s`` of the first of the two. A reading whose label does not
  come in time leaves as ``expired``; a label whose reading does not come in time
  (it came too late, or never) leaves as ``late``. Both stores are bounded by
  ``max_pending``: past it the oldest entry leaves early, the same way.
* ``LabelPlan`` decides, for simulated devices, when each record's label is sent, or
  that it never is (``labels.simulate_delay_s``, ``labels.simulate_missing``).

Invariant of ``LabelJoin``: every reading handed to ``hold`` comes back exactly once,
joined (``give`` or ``hold`` itself), expired or refused as a duplicate; every label
handed to ``give`` comes back exactly once, joined or late.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from edgestream.streams import codec
from edgestream.streams.errors import RecordDecodeError

#: How a label names its reading (``labels.match``).
MATCHES = ("record_id", "event_time")
#: ``labels.time_unit``: seconds per unit of a label's event time.
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
#: Event times are matched to the millisecond: a float's rounding (under a microsecond at today's epoch
#: seconds) never decides a match.
_TIME_KEY_SCALE = 1e3


def time_key(event_time_s: float) -> int:
    """The join key of an event time in seconds: whole milliseconds."""
    return int(round(event_time_s * _TIME_KEY_SCALE))


@dataclass(frozen=True)
class LabelFields:
    """Where a label message's fields are (``labels.device`` ...): top-level names."""

    device: str = "device"
    record_id: str = "record_id"
    event_time: str = "event_time"
    time_unit: str = "s"
    label: str = "label"
    match: str = "record_id"


@dataclass(frozen=True)
class Label:
    """One decoded label: the device, the reading's join key and the class."""

    device: str
    key: int
    label: int


class LabelDecoder:
    """Decodes label messages (see the module docstring); ``num_classes`` bounds the labels."""

    def __init__(self, fields: LabelFields, num_classes: int | None, *, max_bytes: int, max_labels: int) -> None:
        if fields.match not in MATCHES:
            raise ValueError(f"labels.match must be one of {', '.join(MATCHES)} (got {fields.match!r})")
        if fields.time_unit not in TIME_UNITS:
            raise ValueError(f"labels.time_unit must be one of {', '.join(TIME_UNITS)} (got {fields.time_unit!r})")
        self.fields = fields
        self.num_classes = num_classes
        self.max_bytes = max_bytes
        self.max_labels = max_labels
        self._scale = TIME_UNITS[fields.time_unit]

    def decode(self, value: bytes, key: bytes | None = None) -> list[Label]:
        if len(value) > self.max_bytes:
            raise RecordDecodeError("too_large", f"{len(value)} bytes, limit {self.max_bytes}")
        try:
            doc = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise RecordDecodeError("bad_json", f"not JSON: {str(exc)[:120]}") from None
        items = doc if isinstance(doc, list) else [doc]
        if not items:
            raise RecordDecodeError("bad_label", "an empty array: no label")
        if len(items) > self.max_labels:
            raise RecordDecodeError("bad_count", f"{len(items)} labels, limit {self.max_labels}")
        keyed = None
        if key is not None:
            try:
                keyed = key.decode("utf-8")
            except UnicodeDecodeError:
                keyed = None
        return [self._one(i, item, keyed) for i, item in enumerate(items)]

    def _one(self, i: int, item: Any, keyed: str | None) -> Label:
        f = self.fields
        if not isinstance(item, dict):
            raise RecordDecodeError("bad_type", f"label {i} is {type(item).__name__}, not an object")
        device = item.get(f.device, keyed)
        if device is None:
            raise RecordDecodeError("missing_field", f"label {i} has no {f.device!r} field and the message no key")
        if not isinstance(device, str) or not codec.DEVICE_RE.fullmatch(device):
            raise RecordDecodeError("bad_device", f"label {i}: {f.device} {str(device)[:80]!r} is not a device id")
        label = item.get(f.label)
        if label is None:
            raise RecordDecodeError("missing_field", f"label {i} has no {f.label!r} field")
        if type(label) is not int:
            raise RecordDecodeError("bad_type", f"label {i}: {f.label} is {type(label).__name__}, not an integer")
        bound = self.num_classes
        if label < 0 or (bound is not None and label >= bound):
            raise RecordDecodeError("bad_label", f"label {i}: {f.label} is {label}, allowed [0, {bound})")
        return Label(device, self._key(i, item), label)

    def _key(self, i: int, item: dict) -> int:
        f = self.fields
        if f.match == "record_id":
            rid = item.get(f.record_id)
            if rid is None:
                raise RecordDecodeError("missing_field", f"label {i} has no {f.record_id!r} field")
            if type(rid) is not int or not 0 <= rid < 2**64:
                raise RecordDecodeError("bad_type", f"label {i}: {f.record_id} {str(rid)[:40]} is not a record id "
                                        "(an integer in [0, 2^64))")
            return rid
        t = item.get(f.event_time)
        if t is None:
            raise RecordDecodeError("missing_field", f"label {i} has no {f.event_time!r} field")
        if type(t) not in (int, float) or not np.isfinite(t) or abs(t * self._scale) > 1e11:
            raise RecordDecodeError("bad_time", f"label {i}: {f.event_time} {str(t)[:40]} is not a time in "
                                    f"{f.time_unit} since the epoch")
        return time_key(t * self._scale)

    def keys_of(self, seq: np.ndarray, event_time: np.ndarray) -> list[int]:
        """The join keys of readings (their record ids or event times)."""
        return join_keys(self.fields.match, seq, event_time)


def join_keys(match: str, seq: np.ndarray, event_time: np.ndarray) -> list[int]:
    """The join keys of readings under ``labels.match``: record ids, or event times (ms)."""
    if match == "record_id":
        return seq.tolist()
    return [time_key(t) for t in event_time.tolist()]


class Waiting:
    """One reading waiting for its label: where it is in its batch, and the message token
    that settles it."""

    __slots__ = ("device", "key", "batch", "index", "token", "deadline", "prediction")

    def __init__(self, device: str, key: int, batch: Any, index: int, token: Any, deadline: float) -> None:
        self.device = device
        self.key = key
        self.batch = batch
        self.index = index
        self.token = token
        self.deadline = deadline
        self.prediction = -1  # the class predicted when it arrived (-1: none made)


class Early:
    """One label waiting for its reading."""

    __slots__ = ("label", "token", "deadline")

    def __init__(self, label: int, token: Any, deadline: float) -> None:
        self.label = label
        self.token = token
        self.deadline = deadline


@dataclass
class Joined:
    """A reading and its label, with the token of the label's message."""

    reading: Waiting
    label: int
    label_token: Any


@dataclass
class HoldResult:
    """What ``hold`` did with a batch's readings."""

    joined: list[Joined] = field(default_factory=list)  # their label had come first
    waiting: list[Waiting] = field(default_factory=list)  # now waiting for their label
    duplicates: list[int] = field(default_factory=list)  # indices whose key was waiting already
    evicted: list[Waiting] = field(default_factory=list)  # older readings pushed out (store full)


@dataclass
class Expired:
    """What left the join at ``expire``: readings whose label did not come, and the tokens
    of labels whose reading did not come."""

    readings: list[Waiting] = field(default_factory=list)
    late_tokens: list[Any] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.readings or self.late_tokens)


class LabelJoin:
    """Pairs readings with labels by ``(device, key)`` (see the module docstring)."""

    def __init__(self, max_delay_s: float, max_pending: int) -> None:
        if max_delay_s <= 0 or max_pending < 1:
            raise ValueError("max_delay_s must be > 0 and max_pending >= 1")
        self.max_delay_s = max_delay_s
        self.max_pending = max_pending
        # Insertion order is arrival order, and deadlines are arrival + max_delay_s with a
        # clock that does not go back: the first entry is always the next to expire.
        self._waiting: dict[tuple[str, int], Waiting] = {}
        self._early: dict[tuple[str, int], Early] = {}

    @property
    def waiting(self) -> int:
        """Readings waiting for their label."""
        return len(self._waiting)

    @property
    def early(self) -> int:
        """Labels waiting for their reading."""
        return len(self._early)

    def hold(self, device: str, keys: list[int], batch: Any, token: Any, now: float) -> HoldResult:
        """Readings of one message (``batch``, whose i-th reading has ``keys[i]``): each
        joins a label that came first, or waits."""
        out = HoldResult()
        deadline = now + self.max_delay_s
        waiting, early = self._waiting, self._early
        for index, key in enumerate(keys):
            k = (device, key)
            found = early.pop(k, None)
            if found is not None:
                out.joined.append(Joined(Waiting(device, key, batch, index, token, deadline), found.label,
                                         found.token))
            elif k in waiting:
                out.duplicates.append(index)
            else:
                waiting[k] = entry = Waiting(device, key, batch, index, token, deadline)
                out.waiting.append(entry)
        while len(waiting) > self.max_pending:
            out.evicted.append(waiting.pop(next(iter(waiting))))
        return out

    def give(self, label: Label, token: Any, now: float) -> tuple[Joined | None, list[Any]]:
        """A label: the reading it joins (None: it waits for its reading), and the tokens of
        older labels pushed out of a full store (they leave as late)."""
        k = (label.device, label.key)
        reading = self._waiting.pop(k, None)
        if reading is not None:
            return Joined(reading, label.label, token), []
        late = []
        old = self._early.pop(k, None)
        if old is not None:  # a second label for one reading: the newer one stands
            late.append(old.token)
        self._early[k] = Early(label.label, token, now + self.max_delay_s)
        while len(self._early) > self.max_pending:
            late.append(self._early.pop(next(iter(self._early))).token)
        return None, late

    def expire(self, now: float) -> Expired:
        out = Expired()
        for store, sink in ((self._waiting, out.readings), (self._early, None)):
            while store:
                k = next(iter(store))
                if store[k].deadline > now:
                    break
                entry = store.pop(k)
                if sink is not None:
                    sink.append(entry)
                else:
                    out.late_tokens.append(entry.token)
        return out


class LabelPlan:
    """When simulated devices send each record's label (``labels.simulate_*``): after a delay
    drawn uniformly from ``[low, high]`` seconds, or, with probability ``missing``, never.
    Deterministic from ``seed``."""

    def __init__(self, delay_s: tuple[float, float], missing: float, seed: int) -> None:
        low, high = delay_s
        if not 0 <= low <= high or not 0 <= missing < 1:
            raise ValueError("need 0 <= low <= high delay and 0 <= missing < 1")
        self.low, self.high, self.missing = low, high, missing
        self._rng = np.random.default_rng(seed)
        self._due: list[tuple[float, int, str, int, int]] = []  # (due, order, device, key, label)
        self._order = 0
        self.planned = 0
        self.withheld = 0

    def plan(self, device: str, keys: list[int], labels: np.ndarray, sent_at: float) -> None:
        """Schedule the labels of records sent at ``sent_at``."""
        n = len(keys)
        delays = self._rng.uniform(self.low, self.high, n)
        dropped = self._rng.random(n) < self.missing
        for key, label, delay, drop in zip(keys, labels.tolist(), delays.tolist(), dropped.tolist(), strict=True):
            if drop:
                self.withheld += 1
                continue
            self._order += 1
            self.planned += 1
            heapq.heappush(self._due, (sent_at + delay, self._order, device, key, label))

    def due(self, now: float) -> dict[str, list[tuple[int, int]]]:
        """Per device, the ``(key, label)`` pairs due by ``now``, in due order."""
        out: dict[str, list[tuple[int, int]]] = {}
        while self._due and self._due[0][0] <= now:
            _, _, device, key, label = heapq.heappop(self._due)
            out.setdefault(device, []).append((key, label))
        return out

    @property
    def outstanding(self) -> int:
        return len(self._due)

    def next_due(self) -> float | None:
        return self._due[0][0] if self._due else None


def encode_labels(fields: LabelFields, device: str, pairs: list[tuple[int, int]]) -> bytes:
    """One label message (a JSON array) for ``(key, label)`` pairs of one device, keys as
    ``fields.match`` says (an event time key is written back in ``fields.time_unit``)."""
    name = fields.record_id if fields.match == "record_id" else fields.event_time
    scale = TIME_UNITS[fields.time_unit]
    out = []
    for key, label in pairs:
        value: Hashable = key if fields.match == "record_id" else key / _TIME_KEY_SCALE / scale
        out.append({fields.device: device, name: value, fields.label: label})
    return orjson.dumps(out)
