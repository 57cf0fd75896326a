"""The MQTT side of the edge bridge, as pure logic (no MQTT or Kafka client here).

``MqttTopics`` turns the job's MQTT topic patterns (``sensors/{device}/imu``) into the
subscription filters (``sensors/+/imu``) and an MQTT topic back into its device.
``AckOrder`` says which QoS 1 messages may be acknowledged to the MQTT broker once Kafka
has acknowledged them: MQTT wants acknowledgements in the order the messages came
(MQTT 3.1.1 section 4.6, MQTT 5 section 4.6), while Kafka acknowledges each partition on
its own. ``pipeline/bridge.py`` runs both against real clients.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from edgestream.streams.errors import TopicNameError

#: MQTT's topic-level separator and wildcards.
LEVEL = "/"
ONE_LEVEL = "+"
MANY_LEVELS = "#"
DEVICE = "{device}"


@dataclass(frozen=True)
class MqttPattern:
    """One pattern: ``filter`` to subscribe to, and the level that holds the device."""

    pattern: str
    filter: str
    device_level: int
    levels: int  # levels of the pattern (the last may be '#': any number, at least zero)

    def device_of(self, topic: str) -> str | None:
        """The device of an MQTT topic this pattern matches; None if it does not match."""
        parts = topic.split(LEVEL)
        wanted = self.filter.split(LEVEL)
        if wanted[-1] == MANY_LEVELS:
            if len(parts) < len(wanted) - 1:
                return None
            wanted = wanted[:-1]
            parts_head = parts[:len(wanted)]
        else:
            if len(parts) != len(wanted):
                return None
            parts_head = parts
        for have, want in zip(parts_head, wanted, strict=True):
            if want != ONE_LEVEL and have != want:
                return None
        return parts[self.device_level]


class MqttTopics:
    """The MQTT topic patterns of a bridge: each names the device by one whole level written
    ``{device}``; other levels are literal, ``+`` (any one level) or, last, ``#`` (the rest).

    ``sensors/{device}/imu`` subscribes to ``sensors/+/imu`` and reads ``sensors/a7/imu``
    as device ``a7``. A topic matched by no pattern, or whose device level is empty, has no
    device (``device_of`` returns None): the bridge dead-letters it.
    """

    def __init__(self, patterns: list[str]) -> None:
        if not patterns:
            raise TopicNameError("no MQTT topic pattern: give one, e.g. 'sensors/{device}/readings'")
        self.patterns = [self._parse(p) for p in patterns]
        filters = [p.filter for p in self.patterns]
        if len(set(filters)) != len(filters):
            raise TopicNameError(f"two MQTT topic patterns subscribe to the same filter: {filters}")

    @staticmethod
    def _parse(pattern: str) -> MqttPattern:
        if not isinstance(pattern, str) or not pattern:
            raise TopicNameError(f"MQTT topic pattern {pattern!r}: give a topic like 'sensors/{{device}}/readings'")
        if "\x00" in pattern or len(pattern.encode()) > 65535:
            raise TopicNameError(f"MQTT topic pattern {pattern!r} is not a valid MQTT topic (NUL or over 65535 bytes)")
        levels = pattern.split(LEVEL)
        devices = [i for i, level in enumerate(levels) if level == DEVICE]
        if len(devices) != 1 or pattern.count(DEVICE) != 1:
            raise TopicNameError(
                f"MQTT topic pattern {pattern!r} must hold {DEVICE} once, as a whole level "
                "(e.g. 'sensors/{device}/readings'): the device is read from that level"
            )
        for i, level in enumerate(levels):
            if level == MANY_LEVELS and i != len(levels) - 1:
                raise TopicNameError(f"MQTT topic pattern {pattern!r}: '#' may only be the last level")
            if level not in (ONE_LEVEL, MANY_LEVELS, DEVICE) and (ONE_LEVEL in level or MANY_LEVELS in level):
                raise TopicNameError(f"MQTT topic pattern {pattern!r}: '+' and '#' must each be a whole level")
        if levels[0].startswith("$"):
            raise TopicNameError(f"MQTT topic pattern {pattern!r}: topics starting with '$' are the broker's own")
        filt = LEVEL.join(ONE_LEVEL if level == DEVICE else level for level in levels)
        return MqttPattern(pattern, filt, devices[0], len(levels))

    @property
    def filters(self) -> list[str]:
        return [p.filter for p in self.patterns]

    def device_of(self, topic: str) -> str | None:
        """The device of MQTT ``topic`` by the first pattern that matches it; None if none
        does or its device level is empty."""
        for pattern in self.patterns:
            device = pattern.device_of(topic)
            if device is not None:
                return device or None
        return None


class AckOrder:
    """Which received QoS 1 messages may be acknowledged now, in the order they came.

    ``received(mid)`` takes a message (its MQTT packet id) and returns a ticket;
    ``done(ticket)`` says Kafka has it (or its dead letter) and returns the packet ids that
    may be acknowledged now: those of every message up to the oldest one not done yet.
    A new MQTT connection (``reconnected``) voids the tickets of the old one: the broker
    sends their messages again, and a packet id of the old connection may already name
    another message on the new one, so an old ticket acknowledges nothing.
    Thread-safe: the MQTT network thread calls ``received``, Kafka's I/O thread ``done``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = 0
        self._next = 0  # ticket of the next message
        self._waiting: deque[list] = deque()  # [ticket, mid, done] in arrival order
        self._index: dict[int, list] = {}

    def received(self, mid: int) -> tuple[int, int]:
        with self._lock:
            ticket = self._next
            self._next += 1
            entry = [ticket, mid, False]
            self._waiting.append(entry)
            self._index[ticket] = entry
            return self._generation, ticket

    def done(self, token: tuple[int, int]) -> list[int]:
        generation, ticket = token
        with self._lock:
            if generation != self._generation:
                return []
            entry = self._index.pop(ticket, None)
            if entry is None:
                raise KeyError(f"ticket {ticket} is not waiting (done twice?)")
            entry[2] = True
            ready: list[int] = []
            while self._waiting and self._waiting[0][2]:
                ready.append(self._waiting.popleft()[1])
            return ready

    def reconnected(self) -> int:
        """Void every waiting ticket (a new connection); return how many were waiting."""
        with self._lock:
            voided = len(self._waiting)
            self._generation += 1
            self._waiting.clear()
            self._index.clear()
            return voided

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)
