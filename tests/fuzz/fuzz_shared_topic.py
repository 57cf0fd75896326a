"""Fuzz target: a worker's ingest of a topic shared by every device (``IngestCore.on_message``
on ``input.topic`` without ``{device}``), where the device is each message's key.

Input: a sequence of frames. Each frame is one op byte, then for a message a key length
byte (255: no key), the key, a value length (u16, little-endian) and the value. Op bits:

* 0-1: ``0``/``1`` a message (JSON readings when bit 2 is set, edgestream's binary format
  otherwise: both cores see every message); ``2`` a tick (windows close, idle devices are
  forgotten: ``input.device_idle_s = 2``, ``input.max_devices = 4``); ``3`` the sink
  settles every batch it holds (trained).
* 3-7: how far the clock moves before the op (0-31 tenths of a second).

Allowed to escape: nothing (a bad message is a dead letter, never an exception). Broken
if, after every op, for some device ``records_in != consumed + dropped + dead_records +
pending``; if a device met beyond ``input.max_devices`` leaves an idle device held (only
devices with records in flight may keep the worker over the cap); or if the records of
the held and the forgotten devices do not add up to every record registered.
"""

from __future__ import annotations

import numpy as np
import orjson

from edgestream.job.config import load_config
from edgestream.monitoring.metrics import Metrics
from edgestream.pipeline.ingest import IngestCore
from edgestream.streams import codec
from edgestream.streams.records import RecordBatch
from tests.fuzz.targets import FuzzFinding

MAX_LEN = 4096
ALLOWED: tuple[type[BaseException], ...] = ()
TOPIC = "fleet.readings"
JSON_BIT = 4

_CORES: dict[str, tuple] = {}


def _core(fmt: str) -> IngestCore:
    overrides = [f"input.topic={TOPIC}", "input.partitions=2", "workers.count=1", "devices.count=1",
                 "input.device_idle_s=2", "input.max_devices=4", "batcher.mode=window", "batcher.window_s=0.5",
                 "buffer.capacity=64", "buffer.policy=truncate", "data.duplicate_window=16"]
    if fmt == "json":
        overrides += ["input.format=json", "input.features=a,b", "input.label=y", "input.record_id=n"]
    cfg = load_config(overrides=overrides, env={})
    return IngestCore(cfg, [], Metrics(), start=0.0, expected_shape=(2,), num_classes=4)


def _frames(data: bytes):
    i = 0
    while i < len(data):
        op = data[i]
        i += 1
        if op & 3 in (0, 1):
            if i >= len(data):
                return
            n = data[i]
            i += 1
            key = None if n == 255 else data[i : i + n]
            i += 0 if n == 255 else n
            size = int.from_bytes(data[i : i + 2], "little")
            value = data[i + 2 : i + 2 + size]
            i += 2 + size
            yield op, key, value
        else:
            yield op, None, None


def test_one_input(data: bytes) -> None:
    for fmt in ("edgestream", "json"):
        core, held, now, offset, read = _core(fmt), [], 0.0, 0, 0
        for op, key, value in _frames(data):
            now += (op >> 3) / 10
            kind = op & 3
            if kind in (0, 1):
                if bool(op & JSON_BIT) != (fmt == "json"):
                    continue
                before = set(core.devices)
                actions = core.on_message(TOPIC, offset % 2, offset, key, value, ("t", offset), now, now,
                                          timestamp_s=1_700_000_000.0)
                offset += 1
                if set(core.devices) - before:
                    _check_cap(core, before)
                for letter in actions.dead_letters:
                    core.letter_sent(letter)
            elif kind == 2:
                actions = core.on_tick(now)
            else:
                for batch in held:
                    core.settle_batch(batch)
                held = []
                _check(core)
                continue
            held += actions.batches
            _check(core)
            if _read(core) < read:
                raise FuzzFinding(f"records read went from {read} to {_read(core)}: forgetting a device lost counts")
            read = _read(core)


def _read(core: IngestCore) -> int:
    """Records read by the held devices and the forgotten ones."""
    return sum(a["records_in"] for a in core.accounting().values()) + core.evicted.records_in


def _check(core: IngestCore) -> None:
    accounting = core.accounting()
    for device, a in accounting.items():
        if a["records_in"] != a["consumed"] + a["dropped"] + a["dead_records"] + a["pending"]:
            raise FuzzFinding(f"device {device!r} does not balance: {a}")


def _check_cap(core: IngestCore, before: set[str]) -> None:
    """A device met beyond ``input.max_devices`` found every other held device busy (records
    pending or a token open): only those may keep the worker over the cap."""
    if len(core.devices) <= core.cfg.input.max_devices:
        return
    idle = [d for d in before if d in core.devices and (s := core.state_of(d)) and not s.pending and not s.open]
    if idle:
        raise FuzzFinding(f"{len(core.devices)} devices held (max_devices {core.cfg.input.max_devices}) "
                          f"while {idle} had nothing in flight")


def _message(key: bytes | None, value: bytes, json: bool, gap: int = 1) -> bytes:
    op = (gap << 3) | (JSON_BIT if json else 0)
    head = bytes([op, 255]) if key is None else bytes([op, len(key)]) + key
    return head + len(value).to_bytes(2, "little") + value


def seeds() -> dict[str, bytes]:
    """Messages of a few devices in both formats, ticks that close windows and forget idle
    devices, settles, and near misses (no key, a key that is no device id, a key and a
    message naming different devices)."""

    def binary(device: str, seq: int, n: int = 2) -> bytes:
        return codec.encode(RecordBatch(device=device, seq=np.arange(seq, seq + n, dtype=np.uint64),
                                        event_time=np.full(n, 1_700_000_000.0),
                                        features=np.full((n, 2), 0.5, dtype=np.float32),
                                        labels=np.ones(n, dtype=np.int32)))

    def reading(n: int) -> bytes:
        return orjson.dumps([{"a": 0.5, "b": 1.0, "y": 1, "n": n}, {"a": 0.0, "b": 2.0, "y": 3, "n": n + 1}])

    tick, settle = bytes([2 | (8 << 3)]), bytes([3])
    many = b"".join(_message(f"d{i}".encode(), binary(f"d{i}", 0), False) for i in range(7))
    return {
        "devices_and_ticks": many + tick + settle + tick + tick + settle,
        "json_devices": b"".join(_message(f"j{i}".encode(), reading(i * 10), True) for i in range(6)) + tick + settle,
        "no_key": _message(None, binary("d9", 0), False) + _message(None, reading(0), True) + tick,
        "bad_keys": _message(b"a b", binary("d1", 0), False) + _message(b"\xff", reading(0), True)
        + _message(b"d1", binary("d2", 0), False),
        "resend": _message(b"d1", binary("d1", 0), False) + _message(b"d1", binary("d1", 0), False) + tick + settle,
    }
