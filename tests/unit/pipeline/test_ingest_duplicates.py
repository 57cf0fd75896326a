"""IngestCore: duplicate sequence numbers dropped, event times off the broker's clock
dead-lettered, both in the accounting and continued across a checkpoint restore."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edgestream.job.config import ConfigError, load_config
from edgestream.monitoring.metrics import Metrics
from edgestream.monitoring.scrape import Scrape
from edgestream.pipeline.ingest import IngestCore
from edgestream.streams import codec
from edgestream.streams.records import RecordBatch

BROKER_NOW = 1_795_000_000.0  # the fake broker clock: what Kafka stamps every message with
YEAR = 365 * 86400.0
TOPIC = "sensors.dev00"


def message(start: int, n: int, event_time: float | list[float] = BROKER_NOW) -> bytes:
    times = np.broadcast_to(np.asarray(event_time, dtype=np.float64), (n,)).copy()
    return codec.encode(RecordBatch(
        device="dev00", seq=np.arange(start, start + n, dtype=np.uint64), event_time=times,
        features=np.full((n, 4), 0.5, np.float32), labels=np.zeros(n, np.int32),
    ))


def make_core(*overrides: str, restored: dict[str, dict[str, Any]] | None = None) -> IngestCore:
    cfg = load_config(overrides=["devices.count=2", "batcher.mode=fixed", "batcher.batch_size=4",
                                 "data.max_timestamp_skew_s=600", "data.duplicate_window=64", *overrides], env={})
    return IngestCore(cfg, ["dev00", "dev01"], Metrics(), expected_shape=(4,), num_classes=10, restored=restored)


def feed(core: IngestCore, value: bytes, offset: int, broker_s: float = BROKER_NOW):
    return core.on_message(TOPIC, 0, offset, None, value, f"dev00@{offset}", 0.0, broker_s, broker_s)


def balances(acc: dict[str, Any]) -> bool:
    return acc["records_in"] == acc["consumed"] + acc["dropped"] + acc["dead_records"] + acc["pending"]


def scrape(core: IngestCore) -> Scrape:
    from prometheus_client import generate_latest

    return Scrape.parse(generate_latest(core.metrics.registry).decode())


def test_the_same_message_sent_three_times_is_trained_once_and_dropped_twice():
    core = make_core()
    value = message(0, 4)

    first, second, third = (feed(core, value, offset) for offset in range(3))

    (batch,) = first.batches
    assert second.batches == third.batches == []
    assert second.ack == ["dev00@1"] and third.ack == ["dev00@2"]  # nothing left of them to settle
    assert core.settle_batch(batch) == ["dev00@0"]
    acc = core.accounting()["dev00"]
    assert (acc["records_in"], acc["consumed"], acc["dropped"], acc["pending"]) == (12, 4, 8, 0)
    assert acc["dropped_by_reason"] == {"duplicate": 8} and balances(acc)
    assert core.resolved_ledgers()["dev00"]["dropped_by_reason"] == {"duplicate": 8}
    s = scrape(core)
    assert s.get("edgestream_duplicate_records_total", device="dev00") == 8
    assert s.get("edgestream_ledger_records", device="dev00", state="dropped") == 8


def test_a_message_partly_resent_keeps_its_new_records():
    core = make_core()
    feed(core, message(0, 4), 0)
    actions = feed(core, message(2, 4), 1)  # 2, 3 again; 4, 5 new
    assert actions.ack == []
    assert core.accounting()["dev00"]["dropped_by_reason"] == {"duplicate": 2}
    (batch,) = core.flush(1.0).batches
    assert batch.records.seq.tolist() == [4, 5]


@pytest.mark.parametrize("event_time", [0.0, -1_000_000_000.0, BROKER_NOW + YEAR],
                         ids=["1970", "1938", "a-year-ahead"])
def test_an_event_time_off_the_broker_clock_is_dead_lettered_with_the_reason(event_time):
    core = make_core()
    value = message(0, 4, [BROKER_NOW, event_time, BROKER_NOW - 1, BROKER_NOW + 1])

    actions = feed(core, value, 0)

    (letter,) = actions.dead_letters
    assert (letter.reason, letter.records, letter.token, letter.offset) == ("bad_timestamp", 1, "dev00@0", 0)
    assert codec.decode(letter.value).seq.tolist() == [1]  # the bad record alone, re-encoded
    assert "max_timestamp_skew_s = 600" in letter.detail
    (batch,) = core.flush(1.0).batches
    assert batch.records.seq.tolist() == [0, 2, 3]
    assert core.letter_sent(letter) == [] and core.settle_batch(batch) == ["dev00@0"]
    acc = core.accounting()["dev00"]
    assert acc["dead_records_by_reason"] == {"bad_timestamp": 1} and acc["dead_letter_messages"] == 0
    assert balances(acc)
    assert scrape(core).get("edgestream_dead_letter_records_total", device="dev00", reason="bad_timestamp") == 1


def test_going_back_beyond_the_skew_is_dead_lettered_within_it_accepted():
    core = make_core()
    feed(core, message(0, 1, BROKER_NOW + 500), 0)
    within = feed(core, message(1, 1, BROKER_NOW - 50), 1)  # back 550 s: out of order, fine
    beyond = feed(core, message(2, 1, BROKER_NOW - 200), 2)  # back 700 s, though 200 s off the broker

    assert within.dead_letters == []
    (letter,) = beyond.dead_letters
    assert letter.reason == "bad_timestamp" and "going back in time" in letter.detail
    assert core.letter_sent(letter) == ["dev00@2"]


def test_a_record_with_a_bad_time_is_not_remembered_as_seen():
    # Sent again with its clock fixed, it is trained, not dropped as a duplicate.
    core = make_core()
    (letter,) = feed(core, message(0, 2, [BROKER_NOW, 0.0]), 0).dead_letters
    core.letter_sent(letter)
    actions = feed(core, message(1, 1), 1)
    assert actions.dead_letters == [] and core.accounting()["dev00"]["dropped"] == 0


def test_restart_drops_a_resent_settled_message_but_trains_one_reread_unsettled():
    core = make_core()
    (trained,) = feed(core, message(0, 4), 0).batches
    core.settle_batch(trained)  # offset 0 settled: in the checkpoint
    feed(core, message(4, 2), 1)  # offset 1 read, buffered (a crash now: not committed)
    checkpoint = core.resolved_ledgers()
    assert checkpoint["dev00"]["records_in"] == 4  # only what was settled

    restarted = make_core(restored=checkpoint)
    reread = feed(restarted, message(4, 2), 1)  # at-least-once redelivery of offset 1
    resent = feed(restarted, message(0, 4), 2)  # the device sends offset 0's records again

    assert reread.dead_letters == [] and reread.ack == []
    assert resent.ack == ["dev00@2"]
    (batch,) = restarted.flush(1.0).batches
    assert batch.records.seq.tolist() == [4, 5]  # re-read records trained, not dropped
    restarted.settle_batch(batch)
    acc = restarted.accounting()["dev00"]
    assert (acc["records_in"], acc["consumed"], acc["dropped_by_reason"]) == (10, 6, {"duplicate": 4})
    assert balances(acc)


def test_a_message_dropped_as_a_duplicate_of_a_pending_one_is_counted_once_across_a_restart():
    core = make_core("batcher.batch_size=100")
    feed(core, message(0, 4), 0)  # pending (not settled)
    assert feed(core, message(0, 4), 1).ack == ["dev00@1"]  # duplicate of it: settled, dropped
    checkpoint = core.resolved_ledgers()
    assert checkpoint["dev00"]["dropped_by_reason"] == {"duplicate": 4} and checkpoint["dev00"]["records_in"] == 4

    restarted = make_core("batcher.batch_size=100", restored=checkpoint)
    feed(restarted, message(0, 4), 0)  # the original, re-read: trained (its offset was never settled)
    (batch,) = restarted.flush(1.0).batches
    assert batch.size == 4


def test_a_run_with_a_duplicate_or_a_bad_time_is_declined_and_one_by_one_gives_the_outcome():
    core = make_core("batcher.batch_size=100")
    feed(core, message(0, 2), 0)  # validates the header
    assert core.on_run(TOPIC, [message(2, 2), message(4, 2)], "run", 0.0, BROKER_NOW,
                       [BROKER_NOW, BROKER_NOW]) is not None
    before = core.accounting()["dev00"]
    assert core.on_run(TOPIC, [message(6, 2), message(4, 2)], "t", 0.0, BROKER_NOW, [BROKER_NOW] * 2) is None
    assert core.on_run(TOPIC, [message(6, 2), message(8, 2, 0.0)], "t", 0.0, BROKER_NOW, [BROKER_NOW] * 2) is None
    assert core.accounting()["dev00"] == before  # nothing done
    feed(core, message(4, 2), 9)
    assert core.accounting()["dev00"]["dropped_by_reason"] == {"duplicate": 2}


def test_checks_off():
    core = make_core("data.duplicate_window=0", "data.max_timestamp_skew_s=none")
    for offset in range(2):
        assert feed(core, message(0, 4, 0.0), offset).dead_letters == []
    acc = core.accounting()["dev00"]
    assert (acc["dropped"], acc["dead_records"], acc["pending"]) == (0, 0, 8)  # both copies go on
    assert "seen" not in core.resolved_ledgers()["dev00"]


def test_without_a_kafka_timestamp_there_is_no_event_time_check():
    core = make_core()
    actions = core.on_message(TOPIC, 0, 0, None, message(0, 4, 0.0), "t", 0.0, BROKER_NOW, None)
    assert actions.dead_letters == []


@pytest.mark.parametrize("source, value, expected", [
    ("digits", "auto", 3600.0), ("synthetic", "auto", 3600.0), ("digits", "none", None), ("digits", "90", 90.0),
])
def test_the_skew_setting(source, value, expected):
    cfg = load_config(overrides=[f"data.source={source}", f"data.max_timestamp_skew_s={value}"], env={})
    assert cfg.data.timestamp_skew_s() == expected


@pytest.mark.parametrize("override, words", [
    ("data.max_timestamp_skew_s=soon", "use auto, none, or seconds > 0"),
    ("data.max_timestamp_skew_s=0", "use auto, none, or seconds > 0"),
    ("data.duplicate_window=-1", "data.duplicate_window"),
])
def test_bad_settings_are_refused_in_one_line(override, words):
    with pytest.raises(ConfigError, match=words):
        load_config(overrides=[override], env={})
