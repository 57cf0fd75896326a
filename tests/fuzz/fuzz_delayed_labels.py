"""Fuzz target: delayed labels (``labels.topic``) in a worker's ingest: readings without
labels, label messages (``streams.labels.LabelDecoder``, ``LabelJoin``) and ticks, in any
order, through ``IngestCore.on_message`` / ``on_tick``.

Input: a sequence of frames. Each frame is one op byte, then for a message a value length
byte and the value. Op bits:

* 0-1: ``0`` readings of ``dev00`` (edgestream's binary format; the value's first byte is
  the first sequence number, its second the count, 1-8, and labels are carried inline when
  its third byte is odd); ``1`` a label message (the value as sent: JSON, possibly bad);
  ``2`` a tick; ``3`` the sink settles every batch it holds (trained).
* 2: a label message is keyed by ``dev00`` (else no key).
* 3-7: how far the clock moves before the op (0-31 tenths of a second;
  ``labels.max_delay_s = 2``, ``labels.max_pending = 6``).

Allowed to escape: nothing (a bad label message is a dead letter, never an exception).
Broken if, after any op, the device's ``records_in`` is not ``consumed + dropped +
dead_records + pending``; if a token is acknowledged twice; if a label message is
acknowledged while a record it labelled is still unsettled; or if, after a final tick
past every wait and a settle, a reading still waits or a token stays unacknowledged.
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
LABELS = "labels.fuzz"
KEYED = 4


def _core() -> IngestCore:
    cfg = load_config(overrides=["devices.count=2", "batcher.mode=fixed", "batcher.batch_size=3",
                                 "buffer.capacity=16", "buffer.policy=truncate", f"labels.topic={LABELS}",
                                 "labels.max_delay_s=2", "labels.max_pending=6"], env={})
    return IngestCore(cfg, ["dev00"], Metrics(), start=0.0, expected_shape=(2,), num_classes=4,
                      require_labels=True)


def _readings(value: bytes) -> bytes:
    first = value[0] if value else 0
    n = 1 + (value[1] % 8 if len(value) > 1 else 0)
    inline = len(value) > 2 and value[2] & 1
    return codec.encode(RecordBatch(device="dev00", seq=np.arange(first, first + n, dtype=np.uint64),
                                    event_time=np.full(n, 1_700_000_000.0), features=np.full((n, 2), 0.5, np.float32),
                                    labels=np.ones(n, np.int32) if inline else None))


def _frames(data: bytes):
    i = 0
    while i < len(data):
        op = data[i]
        i += 1
        if op & 3 in (0, 1):
            size = data[i] if i < len(data) else 0
            yield op, data[i + 1 : i + 1 + size]
            i += 1 + size
        else:
            yield op, b""


def test_one_input(data: bytes) -> None:
    core, held, now, offsets = _core(), [], 0.0, {"r": 0, "l": 0}
    acked: set = set()
    registered: set = set()

    def ack(tokens) -> None:
        for token in tokens:
            if token in acked:
                raise FuzzFinding(f"token {token} acknowledged twice")
            acked.add(token)

    def perform(actions) -> None:
        nonlocal held
        held += actions.batches
        ack(actions.ack)
        for letter in actions.dead_letters:
            ack(core.letter_sent(letter))

    for op, value in _frames(data):
        now += (op >> 3) / 10
        kind = op & 3
        if kind == 0:
            token = ("r", offsets["r"])
            registered.add(token)
            perform(core.on_message("sensors.dev00", 0, offsets["r"], None, _readings(value), token, now, now))
            offsets["r"] += 1
        elif kind == 1:
            token = ("l", offsets["l"])
            registered.add(token)
            key = b"dev00" if op & KEYED else None
            perform(core.on_message(LABELS, 0, offsets["l"], key, value, token, now, now))
            offsets["l"] += 1
        elif kind == 2:
            perform(core.on_tick(now))
        else:
            for batch in held:
                ack(core.settle_batch(batch))
            held = []
        _check(core, acked)
    # Past every wait, and everything trained: nothing may be left waiting or unacknowledged.
    perform(core.on_tick(now + 10))
    perform(core.flush(now + 10))
    for batch in held:
        ack(core.settle_batch(batch))
    _check(core, acked)
    if core.label_join is not None and (core.label_join.waiting or core.label_join.early):
        raise FuzzFinding(f"{core.label_join.waiting} readings and {core.label_join.early} labels still wait")
    if registered - acked:
        raise FuzzFinding(f"tokens never acknowledged: {sorted(registered - acked)[:5]}")


def _check(core: IngestCore, acked: set) -> None:
    a = core.accounting()["dev00"]
    if a["records_in"] != a["consumed"] + a["dropped"] + a["dead_records"] + a["pending"]:
        raise FuzzFinding(f"dev00 does not balance: {a}")
    for token, entry in core._open.items():  # noqa: SLF001 - the invariant lives in the core's books
        for label_token in entry.label_tokens or ():
            if label_token in acked:
                raise FuzzFinding(f"label message {label_token} acknowledged while reading {token} is unsettled")


def _msg(kind: int, value: bytes = b"", gap: int = 1, keyed: bool = False) -> bytes:
    op = (gap << 3) | kind | (KEYED if keyed else 0)
    return bytes([op]) + (bytes([len(value)]) + value if kind in (0, 1) else b"")


def seeds() -> dict[str, bytes]:
    """Readings then labels, labels first, labels that never come, late labels, inline
    labels, a full wait, and bad label messages."""

    def labels(*pairs: tuple[int, int]) -> bytes:
        return orjson.dumps([{"device": "dev00", "record_id": r, "label": y} for r, y in pairs])

    tick, settle = _msg(2), _msg(3)
    return {
        "readings_then_labels": _msg(0, bytes([0, 2])) + _msg(1, labels((0, 1), (1, 2), (2, 3))) + settle + tick,
        "labels_first": _msg(1, labels((5, 1), (6, 0))) + _msg(0, bytes([5, 1])) + settle,
        "never_and_late": _msg(0, bytes([0, 3])) + _msg(1, labels((0, 1))) + _msg(2, gap=25) + settle
        + _msg(1, labels((1, 1))) + _msg(2, gap=25),
        "inline_and_full": _msg(0, bytes([0, 1, 1])) + _msg(0, bytes([10, 7])) + _msg(0, bytes([20, 7])) + settle,
        "bad_labels": _msg(1, b"{") + _msg(1, b'{"record_id": 1, "label": 1}', keyed=True)
        + _msg(1, b'{"device": "dev00", "record_id": 1, "label": 9}') + _msg(1, b"[]") + tick,
        "foreign_and_resend": _msg(1, orjson.dumps({"device": "dev07", "record_id": 1, "label": 1}))
        + _msg(0, bytes([3, 0])) + _msg(0, bytes([3, 0])) + _msg(1, labels((3, 2), (3, 1))) + settle,
    }
