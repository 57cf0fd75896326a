"""Replay scheduling with a fake clock, topic renaming and selection, device rewrite, import."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgestream.job.importer import ImportSpec, TableImportError, import_table, load_table
from edgestream.pipeline.record import RecordError, resolve_topics
from edgestream.pipeline.replay import (
    Pacer,
    ReplayError,
    ReplaySchedule,
    TimingStats,
    TopicRenamer,
    loop_period_ms,
    rewrite_device,
    topic_kind,
)
from edgestream.streams import codec
from edgestream.streams.errors import RecordDecodeError
from edgestream.streams.garbage import KINDS, make_garbage
from edgestream.streams.recording import RecordingReader, parse_speed
from edgestream.streams.records import RecordBatch


class FakeClock:
    """A monotonic clock that moves only when a test sleeps on it."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


# ------------------------------------------------------------------ schedule


@pytest.mark.parametrize("speed, expected", [
    (1.0, [0.0, 0.010, 0.250, 1.000]),
    (2.0, [0.0, 0.005, 0.125, 0.500]),
    (math.inf, [0.0, 0.0, 0.0, 0.0]),
])
def test_due_times_scale_recorded_gaps_by_speed(speed, expected):
    schedule = ReplaySchedule(speed)
    timestamps = [1_000_000, 1_000_010, 1_000_250, 1_001_000]

    due = [schedule.due(ts) for ts in timestamps]

    assert due == pytest.approx(expected)


def test_out_of_order_and_unknown_timestamps_are_sent_with_their_predecessor():
    schedule = ReplaySchedule(1.0)

    due = [schedule.due(ts) for ts in (5_000, 5_500, 5_200, -1, 6_000)]

    assert due == pytest.approx([0.0, 0.5, 0.5, 0.5, 1.0])
    assert all(b >= a for a, b in zip(due, due[1:], strict=False))


def test_loop_passes_are_shifted_by_the_period():
    period = loop_period_ms(1_000, 2_000, 11)  # span 1000 ms + mean gap 100 ms
    schedule = ReplaySchedule(2.0, period)

    first_pass = [schedule.due(ts, 0) for ts in (1_000, 2_000)]
    second_pass = [schedule.due(ts, 1) for ts in (1_000, 2_000)]

    assert period == pytest.approx(1_100)
    assert first_pass == pytest.approx([0.0, 0.5])
    assert second_pass == pytest.approx([0.55, 1.05])


def test_loop_period_of_degenerate_recordings_is_positive():
    assert loop_period_ms(None, None, 0) == 1000.0
    assert loop_period_ms(5, 5, 1) == 1000.0


@pytest.mark.parametrize("text, expected", [("1", 1.0), ("2.5", 2.5), ("10x", 10.0), ("max", math.inf)])
def test_parse_speed(text, expected):
    assert parse_speed(text) == expected


@pytest.mark.parametrize("text", ["0", "-1", "fast", ""])
def test_parse_speed_rejects_nonsense(text):
    with pytest.raises(ReplayError, match="speed"):
        parse_speed(text)


# --------------------------------------------------------------------- pacer


def run_paced(timestamps_ms, speed, clock, jitter_s=lambda i: 0.0):
    """Drive a Pacer like the replay loop does, with a fake clock and per-send jitter."""
    schedule = ReplaySchedule(speed)
    pacer = Pacer(clock)
    pacer.begin()
    for i, ts in enumerate(timestamps_ms):
        due = schedule.due(ts)
        clock.sleep(pacer.delay(due))
        clock.sleep(jitter_s(i))  # time the send takes
        pacer.sent(due)
    return pacer.stats.summary()


def test_perfect_clock_gives_zero_inter_arrival_error():
    clock = FakeClock()

    summary = run_paced([0, 10, 30, 60, 100], 1.0, clock)

    assert summary["messages"] == 5
    assert summary["inter_arrival_error_p50_ms"] == pytest.approx(0.0, abs=1e-6)
    assert summary["inter_arrival_error_p99_ms"] == pytest.approx(0.0, abs=1e-6)
    assert summary["requested_s"] == pytest.approx(0.1)
    assert summary["achieved_s"] == pytest.approx(0.1)
    assert clock.now == pytest.approx(100.1)


def test_a_late_send_shows_as_error_on_both_neighbouring_gaps():
    clock = FakeClock()
    late = {2: 0.004}  # the third message leaves 4 ms late

    summary = run_paced([0, 10, 20, 30, 40, 50], 1.0, clock, lambda i: late.get(i, 0.0))

    # gaps: 10, 14, 6, 10, 10 ms -> errors 0, 4, 4, 0, 0 ms
    assert summary["inter_arrival_error_p50_ms"] == pytest.approx(0.0, abs=1e-6)
    assert summary["inter_arrival_error_max_ms"] == pytest.approx(4.0)
    assert summary["lateness_p50_ms"] == pytest.approx(0.0, abs=1e-6)


def test_pacer_never_asks_to_wait_for_an_overdue_message():
    clock = FakeClock()
    pacer = Pacer(clock)
    pacer.begin()
    clock.sleep(2.0)

    assert pacer.delay(1.0) == 0.0
    assert pacer.delay(2.5) == pytest.approx(0.5)


def test_timing_stats_percentiles_in_ms():
    stats = TimingStats()
    for i in range(101):
        stats.add(i * 0.01, i * 0.01 + (0.001 * (i % 2)))  # alternate 0 / 1 ms late

    summary = stats.summary()

    assert summary["inter_arrival_error_p50_ms"] == pytest.approx(1.0)
    assert summary["lateness_p99_ms"] == pytest.approx(1.0)


# -------------------------------------------------------------- rename, kinds


def test_renamer_exact_then_longest_prefix_then_identity():
    renamer = TopicRenamer([
        "sensors.*:sensors.r1-*", "sensors.dev0*:sensors.x*", "sensors.dev01:sensors.special",
    ])

    assert renamer("sensors.dev01") == "sensors.special"
    assert renamer("sensors.dev02") == "sensors.x2"
    assert renamer("sensors.abc") == "sensors.r1-abc"
    assert renamer("other") == "other"


@pytest.mark.parametrize("spec", ["nocolon", "a*:b", "a:b*", ":b", "a:bad/name"])
def test_renamer_rejects_malformed_rules(spec):
    with pytest.raises(ReplayError, match="--rename"):
        TopicRenamer([spec])


@pytest.mark.parametrize("topic, kind", [
    ("sensors.dev01", "sensors"), ("sensors.dlq", "dlq"), ("gradients.j", "gradients"),
    ("gradients.j.dlq", "dlq"), ("models.j", "models"), ("anything", "sensors"),
])
def test_topic_kind(topic, kind):
    assert topic_kind(topic) == kind


def test_resolve_topics_excludes_dlq_and_internal_unless_named():
    available = ["sensors.a", "sensors.b", "sensors.dlq", "__consumer_offsets", "models.j"]

    assert resolve_topics(available, ["sensors.*"]) == ["sensors.a", "sensors.b"]
    assert resolve_topics(available, ["sensors.*,sensors.dlq"]) == ["sensors.a", "sensors.b", "sensors.dlq"]
    assert resolve_topics(available, ["*"]) == ["models.j", "sensors.a", "sensors.b"]
    with pytest.raises(RecordError, match="no topic matches nope"):
        resolve_topics(available, ["nope.*"])


# -------------------------------------------------------------- device rewrite


def batch(device: str, n: int = 3) -> RecordBatch:
    rng = np.random.default_rng(0)
    return RecordBatch(device, np.arange(n, dtype=np.uint64), np.full(n, 1.7e9),
                       rng.random((n, 4), dtype=np.float32), np.arange(n, dtype=np.int32))


def test_rewrite_device_changes_only_the_device_id():
    original = codec.encode(batch("dev01"))

    rewritten = rewrite_device(original, "dev01", "replayed-dev-7")
    decoded = codec.decode(rewritten, expected_device="replayed-dev-7")

    before = codec.decode(original)
    assert decoded.device == "replayed-dev-7"
    np.testing.assert_array_equal(decoded.features, before.features)
    np.testing.assert_array_equal(decoded.seq, before.seq)
    np.testing.assert_array_equal(decoded.event_time, before.event_time)
    assert rewrite_device(original, "other", "x") is original


@pytest.mark.parametrize("kind", KINDS)
def test_rewritten_garbage_is_rejected_for_the_same_reason(kind):
    value = make_garbage(kind, "dev01", (4,), seed=1)

    def reason(data: bytes, device: str) -> str:
        with pytest.raises(RecordDecodeError) as exc:
            codec.decode(data, expected_device=device, expected_shape=(4,))
        return exc.value.reason

    assert reason(rewrite_device(value, "dev01", "dev99"), "dev99") == reason(value, "dev01")


# ------------------------------------------------------------------- import


def write_csv(path, rows: int = 120, seed: int = 0):
    rng = np.random.default_rng(seed)
    lines = ["temp,hum,acc,activity"]
    names = ["walk", "run", "sit"]
    for i in range(rows):
        x = rng.random(3)
        lines.append(f"{x[0]:.4f},{x[1]:.4f},{x[2]:.4f},{names[i % 3]}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_import_csv_gives_device_streams_at_their_rates(tmp_path):
    src = write_csv(tmp_path / "data.csv")
    spec = ImportSpec(devices=3, rates_hz=[50, 20, 10], partition="classes", classes_per_device=1,
                      duration_s=2.0, device_prefix="imp", start_time_s=1_700_000_000.0)

    report = import_table(src, "activity", tmp_path / "rec", spec)

    reader = RecordingReader(tmp_path / "rec")
    assert reader.topics == ("sensors.imp00", "sensors.imp01", "sensors.imp02")
    assert report.source["label_names"] == ["run", "sit", "walk"]
    for device, rate in zip(("imp00", "imp01", "imp02"), (50, 20, 10), strict=True):
        batches = [codec.decode(m.value, expected_device=device, expected_shape=(3,))
                   for m in reader.messages(f"sensors.{device}")]
        records = sum(b.count for b in batches)
        assert records == rate * 2 == report.devices[device]["records"]
        labels = np.concatenate([b.labels for b in batches])
        assert len(np.unique(labels)) == 1  # non-IID: one class per device
        seqs = np.concatenate([b.seq for b in batches])
        np.testing.assert_array_equal(seqs, np.arange(records))
    first = next(reader.merged())
    assert first.timestamp_ms == 1_700_000_000_100
    assert reader.summary()["max_timestamp_ms"] == 1_700_000_002_000


def test_import_records_per_device_is_exact(tmp_path):
    src = write_csv(tmp_path / "data.csv")
    spec = ImportSpec(devices=2, rates_hz=[30, 7], records_per_device=25)

    report = import_table(src, "activity", tmp_path / "rec", spec)

    assert {d: v["records"] for d, v in report.devices.items()} == {"dev00": 25, "dev01": 25}


def test_import_npz_and_npy(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.random((40, 2, 3)).astype(np.float32), np.arange(40) % 4
    np.savez(tmp_path / "d.npz", features=x, label=y)
    np.save(tmp_path / "d.npy", np.column_stack([x.reshape(40, -1), y]))

    table_z = load_table(tmp_path / "d.npz", "label")
    table_y = load_table(tmp_path / "d.npy", "-1")

    assert table_z.features.shape == (40, 2, 3) and table_z.labels.tolist() == y.tolist()
    assert table_y.features.shape == (40, 6)
    np.testing.assert_allclose(table_y.features, x.reshape(40, -1))


@pytest.mark.parametrize("content, label, match", [
    ("a,b,label\n1,2,x\n", "missing", "no label column 'missing'"),
    ("a,b,label\n1,2,x\n3,oops,y\n", "label", r"data row 2, column 'b': 'oops' is not a number"),
    ("a,b,label\n1,2,x\n3,4\n", "label", "data row 2 has 2 fields"),
    ("a,b,label\n1,nan,x\n", "label", "non-finite value in data row 1, column 'b'"),
])
def test_import_errors_name_the_file_and_place(tmp_path, content, label, match):
    path = tmp_path / "bad.csv"
    path.write_text(content)

    with pytest.raises(TableImportError, match=match) as exc:
        load_table(path, label)
    assert str(path) in str(exc.value)


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as in this venv: not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")

    with pytest.raises(TableImportError, match="Parquet needs pyarrow"):
        load_table(path, "label")


def test_replayer_counts_records_of_sensor_messages_only():
    from edgestream.pipeline.replay import sensor_record_count
    from edgestream.streams import codec as sensor_codec
    from edgestream.streams.garbage import make_garbage
    from edgestream.streams.records import RecordBatch

    batch = RecordBatch(device="d1", seq=np.arange(5, dtype=np.uint64), event_time=np.zeros(5),
                        features=np.zeros((5, 2), dtype=np.float32))
    assert sensor_record_count(sensor_codec.encode(batch)) == 5
    assert sensor_record_count(make_garbage("random_bytes", "d1", (2,))) == 0
    assert sensor_record_count(b"") == 0
