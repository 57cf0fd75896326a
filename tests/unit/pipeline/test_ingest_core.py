"""IngestCore: decode -> buffer -> batch with exact accounting, driven without Kafka."""

from __future__ import annotations

import numpy as np
import pytest

from edgestream.job.config import load_config
from edgestream.monitoring.metrics import Metrics
from edgestream.monitoring.scrape import Scrape
from edgestream.pipeline.ingest import IngestCore
from edgestream.streams import codec
from edgestream.streams.garbage import EXPECTED_REASON, KINDS, make_garbage
from edgestream.streams.records import RecordBatch


def message(device: str, start: int, n: int, shape=(4,)) -> bytes:
    return codec.encode(
        RecordBatch(
            device=device,
            seq=np.arange(start, start + n, dtype=np.uint64),
            event_time=np.full(n, 100.0),
            features=np.ones((n, *shape), dtype=np.float32),
            labels=np.zeros(n, dtype=np.int32),
        )
    )


def core_for(*overrides: str, devices=("dev00", "dev01")) -> IngestCore:
    cfg = load_config(overrides=["devices.count=2", *overrides], env={})
    return IngestCore(cfg, list(devices), Metrics(), start=0.0, expected_shape=(4,), num_classes=10)


def feed(core: IngestCore, device: str, value: bytes, offset: int, now: float):
    return core.on_message(f"sensors.{device}", 0, offset, None, value, f"{device}@{offset}", now, 101.0)


def test_window_mode_batches_everything_and_acks_in_order():
    core = core_for("batcher.mode=window", "batcher.window_s=1", "batcher.max_batch=100")
    acks, batches = [], []
    for i in range(10):
        actions = feed(core, "dev00", message("dev00", i * 3, 3), i, now=i * 0.1)
        acks += actions.ack
        batches += actions.batches
    assert batches == [] and acks == []  # nothing acked while records sit in the buffer
    actions = core.on_tick(1.0)
    (batch,) = actions.batches
    assert batch.size == 30 and batch.sources == [(f"dev00@{i}", 3) for i in range(10)]
    assert actions.ack == []  # handed to the sink is not settled yet
    acc = core.accounting()["dev00"]
    assert acc["records_in"] == acc["batched"] == acc["in_sink"] == acc["pending"] == 30
    assert core.settle_batch(batch) == [f"dev00@{i}" for i in range(10)]
    acc = core.accounting()["dev00"]
    assert acc["consumed"] == 30 and acc["pending"] == 0 and acc["buffered"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_garbage_is_dead_lettered_with_reason_and_never_buffered(kind):
    core = core_for()
    actions = feed(core, "dev01", make_garbage(kind, "dev01", (4,)), 7, now=0.0)
    (letter,) = actions.dead_letters
    assert letter.reason == EXPECTED_REASON[kind]
    assert (letter.topic, letter.offset, letter.token) == ("sensors.dev01", 7, "dev01@7")
    assert core.buffers["dev01"].depth == 0
    assert core.letter_sent(letter) == ["dev01@7"]
    resolved = core.resolved_ledgers()["dev01"]
    assert resolved["dead_letter_messages"] == 1 and resolved["dead_letters_by_reason"] == {letter.reason: 1}
    assert resolved["dead_records"] == 0 and resolved["dead_records_by_reason"] == {}  # no records in it
    scrape = Scrape.parse(_exposition(core))
    assert scrape.get("edgestream_dead_letter_messages_total", device="dev01", reason=letter.reason) == 1


def test_message_from_another_device_or_unassigned_topic_is_dead_lettered():
    core = core_for()
    actions = feed(core, "dev00", message("dev01", 0, 2), 0, now=0.0)
    assert actions.dead_letters[0].reason == "bad_device"
    actions = core.on_message("sensors.dev09", 0, 0, None, message("dev09", 0, 2), "t", 0.0, 0.0)
    assert actions.dead_letters[0].reason == "bad_device"


def test_truncate_policy_counts_drops_and_acks_dropped_messages():
    core = core_for("buffer.policy=truncate", "buffer.capacity=5", "batcher.mode=fixed", "batcher.batch_size=50")
    acked = []
    for i in range(4):
        acked += feed(core, "dev00", message("dev00", i * 3, 3), i, now=0.0).ack
    acc = core.accounting()["dev00"]
    assert acc["dropped"] == 7 and acc["buffered"] == 5
    assert acked == ["dev00@0", "dev00@1"]
    scrape = Scrape.parse(_exposition(core))
    assert scrape.get("edgestream_buffer_dropped_records_total", device="dev00", reason="overflow") == 7


def test_backpressure_pauses_then_resumes_after_the_sink():
    core = core_for("buffer.policy=backpressure", "buffer.capacity=6", "batcher.max_batch=4")
    actions = feed(core, "dev00", message("dev00", 0, 6), 0, now=0.0)
    assert actions.pause == ["dev00"]
    tick = core.on_tick(1.0)
    assert [b.size for b in tick.batches] == [4]
    assert core.after_sink("dev00").resume == ["dev00"]


def test_invariant_holds_under_random_traffic():
    core = core_for("buffer.policy=truncate", "buffer.capacity=40", "batcher.window_overflow=truncate",
                    "batcher.max_batch=16", "batcher.window_s=0.5")
    rng = np.random.default_rng(3)
    t, seq = 0.0, 0
    for offset in range(300):
        t += float(rng.exponential(0.05))
        n = int(rng.integers(1, 12))
        feed(core, "dev00", message("dev00", seq, n), offset, now=t)
        seq += n
        for batch in core.on_tick(t).batches:
            if rng.random() < 0.5:  # the sink settles some batches now, the rest stay in it
                core.settle_batch(batch)
        acc = core.accounting()["dev00"]
        assert acc["records_in"] == seq
        assert seq == acc["consumed"] + acc["dropped"] + acc["dead_records"] + acc["buffered"] + acc["in_sink"]


def _exposition(core: IngestCore) -> str:
    from prometheus_client import generate_latest

    return generate_latest(core.metrics.registry).decode()


@pytest.mark.parametrize("kind", KINDS)
def test_garbage_is_rejected_after_good_messages_with_the_same_header(kind):
    # The per-device decoder skips the header checks for a header it has just validated;
    # every garbage kind must still be caught once good messages have gone through.
    core = core_for()
    for i in range(3):
        assert not feed(core, "dev01", message("dev01", i * 4, 4), i, now=0.0).dead_letters
    actions = feed(core, "dev01", make_garbage(kind, "dev01", (4,)), 3, now=0.0)
    (letter,) = actions.dead_letters
    assert letter.reason == EXPECTED_REASON[kind]
    assert core.accounting()["dev01"]["records_in"] == 12


def test_same_header_with_bad_values_or_length_is_still_rejected():
    core = core_for()
    good = message("dev01", 0, 4)
    feed(core, "dev01", good, 0, now=0.0)
    batch = codec.decode(good)
    bad_label = codec.encode(RecordBatch(device="dev01", seq=batch.seq, event_time=batch.event_time,
                                         features=batch.features, labels=np.full(4, 99, np.int32)))
    reasons = [
        feed(core, "dev01", bad_label, 1, now=0.0).dead_letters[0].reason,
        feed(core, "dev01", good + b"\0", 2, now=0.0).dead_letters[0].reason,
        feed(core, "dev01", good[:-1], 3, now=0.0).dead_letters[0].reason,
    ]
    assert reasons == ["bad_label", "length_mismatch", "truncated"]


def _drive(core: IngestCore, traffic, runs: bool):
    """Feed ``traffic`` (lists of (offset, value) per fetch) through ``on_run`` or ``on_message``.

    Returns what came out and how many runs ``on_run`` took whole.
    """
    out = {"batches": [], "letters": [], "acked": set(), "pauses": []}
    fast = 0  # runs taken as one chunk

    def take(actions, at):
        out["batches"] += [(b.device, b.records.seq.tolist()) for b in actions.batches]
        out["letters"] += [(d.offset, d.reason) for d in actions.dead_letters]
        tokens = list(actions.ack)
        for d in actions.dead_letters:
            tokens += core.letter_sent(d)
        for b in actions.batches:
            tokens += core.settle_batch(b)
        for first, last in tokens:
            out["acked"].update(range(first, last + 1))
        out["pauses"] += [(at, d) for d in actions.pause]
        for b in actions.batches:
            out["pauses"] += [("resume", d) for d in core.after_sink(b.device).resume]

    for now, fetch in traffic:
        for start in range(0, len(fetch), 8):
            run = fetch[start : start + 8]
            actions = None
            if runs:
                token = (run[0][0], run[-1][0])
                actions = core.on_run("sensors.dev00", [v for _, v in run], token, now, 101.0)
            if actions is not None:
                fast += 1
                take(actions, run[-1][0])
            else:
                for offset, value in run:
                    take(core.on_message("sensors.dev00", 0, offset, None, value, (offset, offset), now, 101.0),
                         offset)
        take(core.on_tick(now), None)
        acc = core.accounting()["dev00"]
        assert acc["records_in"] == acc["consumed"] + acc["dropped"] + acc["buffered"] + acc["in_sink"]
        assert acc["in_sink"] == 0  # ``take`` settles every batch at once
    take(core.flush(now + 1), None)
    out["accounting"] = core.accounting()
    return out, fast


@pytest.mark.parametrize("overrides", [
    ("batcher.mode=window", "batcher.max_batch=50", "batcher.window_s=0.5"),
    ("batcher.mode=window", "batcher.max_batch=20", "batcher.window_overflow=truncate"),
    ("batcher.mode=fixed", "batcher.batch_size=24"),
    ("buffer.policy=truncate", "buffer.capacity=30", "batcher.mode=window", "batcher.max_batch=10"),
    ("buffer.policy=backpressure", "buffer.capacity=100", "batcher.window_s=0.2", "batcher.max_batch=60"),
    ("buffer.policy=persist", "buffer.capacity=10", "buffer.hard_limit_factor=10", "batcher.window_s=0.2", "batcher.max_batch=60"),
], ids=["window", "window_truncate", "fixed", "truncate", "backpressure", "persist_hard_limit"])
def test_runs_give_exactly_what_one_message_at_a_time_gives(overrides):
    rng = np.random.default_rng(11)
    traffic, offset, seq, t = [], 0, 0, 0.0
    for _ in range(60):
        t += float(rng.exponential(0.2))
        fetch = []
        for _ in range(int(rng.integers(1, 30))):
            if rng.random() < 0.05:
                value = make_garbage(KINDS[int(rng.integers(len(KINDS)))], "dev00", (4,))
            elif rng.random() < 0.05:
                value = message("dev00", seq, 5)  # another record count: another header
                seq += 5
            else:
                value = message("dev00", seq, 3)
                seq += 3
            fetch.append((offset, value))
            offset += 1
        traffic.append((t, fetch))

    one_by_one, _ = _drive(core_for(*overrides), traffic, runs=False)
    in_runs, fast = _drive(core_for(*overrides), traffic, runs=True)

    # The one difference: a run enters the buffer at once, so the depth's high-water mark
    # may be higher by up to one run (8 messages of at most 5 records).
    high = {mode: run.pop("accounting")["dev00"].pop("max_depth") for mode, run in
            (("one", one_by_one), ("runs", in_runs))}
    assert high["one"] <= high["runs"] <= high["one"] + 8 * 5
    assert in_runs == one_by_one
    assert fast > 20 and one_by_one["letters"] and one_by_one["batches"]
    assert one_by_one["acked"] == set(range(offset))  # every message resolved by the end


def test_a_run_is_one_chunk_and_one_token():
    core = core_for("batcher.mode=window", "batcher.max_batch=100")
    feed(core, "dev00", message("dev00", 0, 3), 0, now=0.0)  # validates the header
    actions = core.on_run("sensors.dev00", [message("dev00", 3 + 3 * i, 3) for i in range(4)], "run@1-4", 0.1, 101.0)
    assert actions is not None and not actions
    (batch,) = core.on_tick(1.0).batches
    assert batch.records.seq.tolist() == list(range(15)) and batch.sources == [("dev00@0", 3), ("run@1-4", 12)]
    assert core.settle_batch(batch) == ["dev00@0", "run@1-4"]
    acc = core.accounting()["dev00"]
    assert (acc["messages_in"], acc["records_in"], acc["batched"]) == (5, 15, 15)
    scrape = Scrape.parse(_exposition(core))
    assert scrape.get("edgestream_records_in_total", device="dev00") == 15


def test_a_run_is_declined_with_nothing_done():
    core = core_for("buffer.policy=backpressure", "buffer.capacity=10")
    good = [message("dev00", 3 * i, 3) for i in range(3)]
    assert core.on_run("sensors.dev00", good, "t", 0.0, 101.0) is None  # no header validated yet
    feed(core, "dev00", good[0], 0, now=0.0)
    assert core.on_run("sensors.dev09", good, "t", 0.0, 101.0) is None  # not a device of this worker
    assert core.on_run("sensors.dev00", [good[1], b"junk"], "t", 0.0, 101.0) is None
    assert core.on_run("sensors.dev00", good * 2, "t", 0.0, 101.0) is None  # 3 + 18 records reach the pause
    assert core.accounting()["dev00"]["records_in"] == 3
    assert core.on_run("sensors.dev00", good[1:], "t", 0.0, 101.0) is not None  # 3 + 6 stays below it


def test_a_message_is_acked_only_once_every_record_is_settled():
    # 10 records per message, 4 per window batch: message m0 ends up in three batches.
    core = core_for("batcher.mode=window", "batcher.window_s=1", "batcher.max_batch=4")
    feed(core, "dev00", message("dev00", 0, 10), 0, now=0.0)
    first = core.on_tick(1.0).batches[0]
    second = core.on_tick(2.0).batches[0]
    third = core.on_tick(3.0).batches[0]
    assert [b.sources for b in (first, second, third)] == [[("dev00@0", 4)], [("dev00@0", 4)], [("dev00@0", 2)]]
    assert core.settle_batch(first) == [] and core.settle_batch(third, "dead", "gradient_norm") == []
    assert core.resolved_ledgers()["dev00"]["records_in"] == 0  # not settled whole yet
    assert core.settle_batch(second) == ["dev00@0"]
    resolved = core.resolved_ledgers()["dev00"]
    assert (resolved["records_in"], resolved["consumed"], resolved["dead_records"]) == (10, 8, 2)
    assert resolved["dead_records_by_reason"] == {"gradient_norm": 2}


def test_records_of_a_rejected_step_are_counted_dead_not_trained():
    core = core_for("batcher.mode=fixed", "batcher.batch_size=6")
    (batch,) = feed(core, "dev00", message("dev00", 0, 6), 0, now=0.0).batches
    assert core.settle_batch(batch, "dead", "non_finite_loss") == ["dev00@0"]
    acc = core.accounting()["dev00"]
    assert (acc["consumed"], acc["dead_records"], acc["pending"]) == (0, 6, 0)
    assert acc["dead_records_by_reason"] == {"non_finite_loss": 6}
    scrape = Scrape.parse(_exposition(core))
    assert scrape.get("edgestream_dead_letter_records_total", device="dev00", reason="non_finite_loss") == 6
    assert scrape.get("edgestream_ledger_records", device="dev00", state="dead_lettered") == 6
    assert scrape.get("edgestream_ledger_records", device="dev00", state="trained") == 0


def test_a_restored_ledger_is_continued_and_only_settled_tokens_are_resolved():
    restored = {"dev00": {"messages_in": 5, "records_in": 50, "consumed": 40, "dropped": 6, "dead_records": 4,
                          "dead_letter_messages": 1, "dead_letters_by_reason": {"bad_magic": 1},
                          "dead_records_by_reason": {"gradient_norm": 4}}}
    cfg = load_config(overrides=["devices.count=2", "batcher.mode=fixed", "batcher.batch_size=3"], env={})
    core = IngestCore(cfg, ["dev00", "dev01"], Metrics(), expected_shape=(4,), num_classes=10, restored=restored)
    (batch,) = feed(core, "dev00", message("dev00", 50, 3), 9, now=0.0).batches
    feed(core, "dev00", message("dev00", 53, 2), 10, now=0.0)  # stays buffered
    core.settle_batch(batch)
    acc = core.accounting()["dev00"]
    assert (acc["records_in"], acc["consumed"], acc["pending"]) == (55, 43, 2)
    resolved = core.resolved_ledgers()["dev00"]
    assert (resolved["messages_in"], resolved["records_in"], resolved["consumed"]) == (6, 53, 43)
    assert resolved["dead_letters_by_reason"] == {"bad_magic": 1}
    scrape = Scrape.parse(_exposition(core))
    assert scrape.get("edgestream_ledger_records", device="dev00", state="read") == 55


def test_a_training_job_dead_letters_messages_without_labels():
    cfg = load_config(overrides=["devices.count=2"], env={})
    core = IngestCore(cfg, ["dev00", "dev01"], Metrics(), expected_shape=(4,), num_classes=10, require_labels=True)
    unlabelled = codec.encode(RecordBatch(device="dev00", seq=np.arange(2, dtype=np.uint64),
                                          event_time=np.full(2, 1.0), features=np.ones((2, 4), np.float32)))
    (letter,) = feed(core, "dev00", unlabelled, 0, now=0.0).dead_letters
    assert letter.reason == "no_labels" and core.buffers["dev00"].depth == 0


def test_records_out_of_the_declared_range_are_dead_lettered_and_the_rest_goes_on():
    cfg = load_config(overrides=["devices.count=2", "batcher.mode=fixed", "batcher.batch_size=3"], env={})
    core = IngestCore(cfg, ["dev00", "dev01"], Metrics(), expected_shape=(4,), num_classes=10,
                      value_range=(np.float32(0.0), np.float32(1.0)))
    features = np.full((4, 4), 0.5, np.float32)
    features[1, 2] = 1e38
    value = codec.encode(RecordBatch(device="dev00", seq=np.arange(4, dtype=np.uint64), event_time=np.full(4, 1.0),
                                     features=features, labels=np.zeros(4, np.int32)))
    actions = feed(core, "dev00", value, 0, now=0.0)
    (letter,) = actions.dead_letters
    assert (letter.reason, letter.records, letter.token) == ("out_of_range", 1, "dev00@0")
    assert codec.decode(letter.value).seq.tolist() == [1]  # the bad record itself, re-encoded
    (batch,) = actions.batches
    assert batch.records.seq.tolist() == [0, 2, 3]
    assert core.letter_sent(letter) == []  # the good records are not trained yet
    assert core.settle_batch(batch) == ["dev00@0"]
    acc = core.accounting()["dev00"]
    assert (acc["records_in"], acc["consumed"], acc["dead_records"], acc["dead_letter_messages"]) == (4, 3, 1, 0)
    scrape = Scrape.parse(_exposition(core))
    assert scrape.get("edgestream_dead_letter_records_total", device="dev00", reason="out_of_range") == 1


def test_backlog_beyond_one_window_is_exported_and_in_the_accounting():
    core = core_for("batcher.window_s=1", "batcher.max_batch=8", "batcher.max_batch_widen=16")
    for i in range(10):
        feed(core, "dev00", message("dev00", i * 10, 10), i, now=0.1 * i)  # 100 records
        feed(core, "dev01", message("dev01", i, 1), i, now=0.1 * i)  # 10 records
    for t in (1.0, 2.0, 3.0):
        for batch in core.on_tick(t).batches:
            core.settle_batch(batch)  # the sink keeps up: what is pending sits in the buffer

    acc = core.accounting()
    # windows 1 and 2 left records behind at the cap of 8: the third batch took 16
    assert acc["dev00"]["batch_cap"] == 16 and acc["dev00"]["window_records"] == 16
    assert acc["dev00"]["pending"] == 100 - 8 - 8 - 16 == 68 and acc["dev00"]["backlog"] == 68 - 16
    assert acc["dev00"]["capacity_hz"] == 16.0
    assert acc["dev01"]["pending"] == 0 and acc["dev01"]["backlog"] == 0
    scrape = Scrape.parse(_exposition(core))
    assert scrape.get("edgestream_device_backlog_records", device="dev00") == 52
    assert scrape.get("edgestream_device_backlog_records", device="dev01") == 0
    assert scrape.get("edgestream_batch_cap_records", device="dev00") == 16
    assert scrape.get("edgestream_batch_cap_records", device="dev01") == 8
