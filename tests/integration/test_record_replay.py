"""Record and replay on the real broker: round trip, 1x timing, damage, and training accounting."""

from __future__ import annotations

import io
import json
import time

import numpy as np
import pytest
from kafka import KafkaProducer
from rich.console import Console

from edgestream.cli.main import main as cli_main
from edgestream.job.config import load_config
from edgestream.pipeline.kafka_io import ensure_topics
from edgestream.pipeline.record import record
from edgestream.pipeline.replay import replay
from edgestream.pipeline.replay_workers import replay_through_workers
from edgestream.pipeline.run import run_job
from edgestream.streams.garbage import KINDS
from edgestream.streams.recording import (
    RecordedMessage,
    RecordingCorrupt,
    RecordingReader,
    RecordingWriter,
)

pytestmark = pytest.mark.integration


def by_partition(directory, rename=lambda t: t) -> dict[tuple[str, int], list[tuple]]:
    """(topic, partition) -> [(key, value, headers)] in recorded order."""
    out: dict[tuple[str, int], list[tuple]] = {}
    reader = RecordingReader(directory)
    for topic in reader.topics:
        for m in reader.messages(topic):
            out.setdefault((rename(topic), m.partition), []).append((m.key, m.value, m.headers))
    return out


def produce(bootstrap: str, messages: list[tuple]) -> None:
    prod = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=2)
    try:
        for topic, partition, key, value, headers, ts in messages:
            prod.send(topic, key=key, value=value, partition=partition, headers=headers, timestamp_ms=ts)
        prod.flush()
    finally:
        prod.close()


def test_record_replay_record_round_trip_is_identical_per_partition(kafka_bootstrap, unique, tmp_path):
    # Arrange: two topics x two partitions; keys (some None), headers, binary values.
    src = [f"sensors.rt{unique}a", f"sensors.rt{unique}b"]
    ensure_topics(kafka_bootstrap, {t: "sensors" for t in src}, partitions=2)
    rng = np.random.default_rng(7)
    t0 = int(time.time() * 1000) - 10_000
    sent = []
    for i in range(60):
        topic, partition = src[i % 2], (i // 2) % 2
        key = None if i % 7 == 0 else f"k{i % 5}".encode()
        headers = [("seq", str(i).encode()), ("blob", rng.bytes(i % 4))]
        sent.append((topic, partition, key, rng.bytes(50 + i * 13), headers, t0 + i * 3))
    sent.append((src[0], 1, b"gone", None, [], t0 + 500))  # a tombstone: skipped, counted
    produce(kafka_bootstrap, sent)

    # Act: record -> replay into fresh topics at max speed -> record the fresh topics.
    first = record(kafka_bootstrap, [f"sensors.rt{unique}*"], tmp_path / "first", until_end=True)
    rep = replay(tmp_path / "first", kafka_bootstrap, speed=float("inf"),
                 rename=[f"sensors.rt{unique}*:sensors.rr{unique}*"])
    second = record(kafka_bootstrap, [f"sensors.rr{unique}*"], tmp_path / "second", until_end=True)

    # Assert
    assert first.messages == 60 and first.skipped_tombstones == 1 and first.stopped_by == "end"
    assert rep.messages == 60 and rep.timing is None
    assert second.messages == 60
    expected: dict[tuple[str, int], list[tuple]] = {}
    for topic, partition, key, value, headers, _ in sent[:-1]:
        expected.setdefault((topic, partition), []).append((key, value, tuple(headers)))
    assert by_partition(tmp_path / "first") == expected
    back = by_partition(tmp_path / "second", lambda t: t.replace(f".rr{unique}", f".rt{unique}"))
    assert back == expected
    # Recorded timestamps travel with the messages.
    ts_first = sorted(m.timestamp_ms for m in RecordingReader(tmp_path / "first").merged())
    ts_second = sorted(m.timestamp_ms for m in RecordingReader(tmp_path / "second").merged())
    assert ts_first == ts_second == sorted(s[5] for s in sent[:-1])


def synthetic_recording(directory, topic_names, n: int, seed: int = 0) -> list[int]:
    """``n`` messages with irregular gaps (mean 25 ms) spread over ``topic_names``."""
    rng = np.random.default_rng(seed)
    gaps = np.clip(rng.exponential(25.0, n), 1, 120).astype(int)
    ts = (1_700_000_000_000 + np.cumsum(gaps)).tolist()
    offsets = dict.fromkeys(topic_names, 0)
    with RecordingWriter(directory, topics=topic_names) as w:
        for i, t in enumerate(ts):
            topic = topic_names[i % len(topic_names)]
            w.write(RecordedMessage(topic, 0, offsets[topic], t, b"k", rng.bytes(200)))
            offsets[topic] += 1
    return ts


def test_replay_at_1x_keeps_inter_arrival_times(kafka_bootstrap, unique, tmp_path):
    names = [f"sensors.tm{unique}a", f"sensors.tm{unique}b"]
    ts = synthetic_recording(tmp_path / "rec", names, 80)

    report = replay(tmp_path / "rec", kafka_bootstrap, speed=1.0,
                    rename=[f"sensors.tm{unique}*:sensors.tr{unique}*"])
    fast = replay(tmp_path / "rec", kafka_bootstrap, speed=float("inf"), rewrite_timestamps=True,
                  rename=[f"sensors.tm{unique}*:sensors.tw{unique}*"])
    back = record(kafka_bootstrap, [f"sensors.tr{unique}*"], tmp_path / "back", until_end=True)
    rewritten = record(kafka_bootstrap, [f"sensors.tw{unique}*"], tmp_path / "rewritten", until_end=True)

    timing = report.timing
    assert timing["messages"] == 80 == report.messages == fast.messages
    assert timing["requested_s"] == pytest.approx((ts[-1] - ts[0]) / 1000)
    # Loose bounds: two shared cores run the broker and the tests.
    assert timing["inter_arrival_error_p50_ms"] < 20
    assert timing["inter_arrival_error_p99_ms"] < 250
    assert abs(timing["achieved_s"] - timing["requested_s"]) < 1.0
    assert sorted(m.timestamp_ms for m in RecordingReader(tmp_path / "back").merged()) == ts
    assert back.messages == rewritten.messages == 80
    assert min(m.timestamp_ms for m in RecordingReader(tmp_path / "rewritten").merged()) > ts[-1]


def test_corrupt_recording_is_named_and_its_intact_prefix_replays(kafka_bootstrap, unique, tmp_path, capsys):
    names = [f"sensors.cr{unique}a"]
    synthetic_recording(tmp_path / "rec", names, 30)
    damaged = tmp_path / "rec" / f"{names[0]}.esrec"
    data = damaged.read_bytes()
    frame = 8 + 30 + 1 + 200  # frame head + fixed body + key + value
    cut = len(data) - 150  # inside the last frame
    damaged.write_bytes(data[:cut])

    with pytest.raises(RecordingCorrupt) as exc:
        replay(tmp_path / "rec", kafka_bootstrap, speed=float("inf"))
    code = cli_main(["replay", str(tmp_path / "rec"), "--bootstrap", kafka_bootstrap, "--speed", "max"])
    report = replay(tmp_path / "rec", kafka_bootstrap, speed=float("inf"), allow_truncated=True,
                    rename=[f"{names[0]}:sensors.cp{unique}"])
    back = record(kafka_bootstrap, [f"sensors.cp{unique}"], tmp_path / "back", until_end=True)

    assert exc.value.path == damaged and exc.value.position == len(data) - frame
    err = capsys.readouterr().err
    assert code == 2
    assert str(damaged.name) in err and f"byte {exc.value.position}" in err and "--allow-truncated" in err
    assert report.messages == back.messages == 29 and report.truncated[0]["position"] == exc.value.position
    intact = [m.value for m in RecordingReader(tmp_path / "rec", allow_truncated=True).messages(names[0])]
    assert [v for _, v, _ in by_partition(tmp_path / "back")[(f"sensors.cp{unique}", 0)]] == intact


@pytest.mark.parametrize("train", [False, True], ids=["ingest", "training"])
def test_recorded_run_replayed_through_workers_gives_the_live_accounting(kafka_bootstrap, unique, tmp_path,
                                                                         train):
    # Arrange: a live run (ingest only, or training BSP) with garbage of every kind,
    # recorded afterwards.
    live_ids = [f"la{unique}", f"lb{unique}"]
    replay_ids = [f"ra{unique}", f"rb{unique}"]

    def job(name, ids, state):
        return load_config(overrides=[
            f"job.name={name}", f"run.state_dir={state}", f"devices.ids={','.join(ids)}",
            "devices.count=2", "devices.rates_hz=60,20", "run.duration_s=3", "run.drain_timeout_s=40",
            "workers.count=1", "batcher.mode=window", "buffer.policy=persist",
            *([f"train.enabled={train}", "train.strategy=bsp", "train.model=mlp"]),
        ], env={})

    live_cfg = job(f"rl{unique}", live_ids, tmp_path / "live")
    live = run_job(live_cfg, kafka_bootstrap, garbage_per_device=len(KINDS),
                   console=Console(file=io.StringIO()), live=False)
    rec = record(kafka_bootstrap, [f"sensors.{d}" for d in live_ids], tmp_path / "rec", until_end=True)

    # Act: replay into fresh device topics consumed by a second set of workers.
    replay_cfg = job(f"rr{unique}", replay_ids, tmp_path / "replayed")
    report, accounting = replay_through_workers(
        replay_cfg, kafka_bootstrap, tmp_path / "rec",
        rename=[f"sensors.{a}:sensors.{b}" for a, b in zip(live_ids, replay_ids, strict=True)], speed=2.0,
    )

    # Assert
    assert live.balanced
    assert rec.messages == report.messages == sum(
        a["messages_in"] for a in live.accounting.values())
    keys = ("messages_in", "records_in", "batched", "dropped", "buffered", "dead_letter_messages")
    for old, new in zip(live_ids, replay_ids, strict=True):
        assert live.accounting[old]["batched"] == live.produced[old] > 0
        assert live.accounting[old]["dead_letter_messages"] == len(KINDS)
        assert {k: accounting[new][k] for k in keys} == {k: live.accounting[old][k] for k in keys}
    if train:
        assert live.training["w0"]["trained_records"] == sum(live.produced.values())


def test_cli_import_replay_record(kafka_bootstrap, unique, tmp_path, capsys):
    rng = np.random.default_rng(3)
    rows = ["x,y,z,label"] + [f"{a:.3f},{b:.3f},{c:.3f},{['up', 'down'][i % 2]}"
                              for i, (a, b, c) in enumerate(rng.random((60, 3)))]
    (tmp_path / "own.csv").write_text("\n".join(rows) + "\n")
    prefix = f"im{unique}x"

    codes = [
        cli_main(["import", "--file", str(tmp_path / "own.csv"), "--label-column", "label",
                  "--out", str(tmp_path / "rec"), "--devices", "2", "--rates", "40,10",
                  "--partition", "dirichlet", "--duration", "1", "--device-prefix", prefix]),
        cli_main(["replay", str(tmp_path / "rec"), "--bootstrap", kafka_bootstrap, "--speed", "4",
                  "--report", str(tmp_path / "replay.json")]),
        cli_main(["record", "--bootstrap", kafka_bootstrap, "--topics", f"sensors.{prefix}*",
                  "--out", str(tmp_path / "back"), "--until-end"]),
    ]

    assert codes == [0, 0, 0]
    out = capsys.readouterr().out
    assert "inter-arrival error" in out and "recorded" in out
    report = json.loads((tmp_path / "replay.json").read_text())
    assert report["messages"] == 20 and report["speed"] == 4.0
    assert by_partition(tmp_path / "back") == by_partition(tmp_path / "rec")
