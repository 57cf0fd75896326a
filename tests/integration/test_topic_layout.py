"""Device topics named by the user's pattern (``input.topic``) on the real broker: a job whose
devices write JSON to ``plant<id>.<device>.imu`` trains, and a recording is replayed into
such topics; nothing is written to ``sensors.<device>``, every record is accounted for."""

from __future__ import annotations

import io

import orjson
import pytest
from rich.console import Console

from edgestream.job.config import load_config
from edgestream.job.importer import ImportSpec, import_table
from edgestream.pipeline.kafka_io import topic_names
from edgestream.pipeline.run import RunContext, run_job
from edgestream.streams import topics
from tests.integration.jobs import (
    JSON_READINGS,
    quiet,
    read_topic,
    show,
    steps_of,
    train_job,
    wait_until,
    workers_of,
)
from tests.integration.test_own_data import write_breast_cancer_csv

pytestmark = pytest.mark.integration



def test_a_job_trains_on_json_readings_in_topics_named_by_its_pattern(kafka_bootstrap, unique, state_dir):
    pattern = f"plant{unique}.{{device}}.imu"
    cfg = train_job(unique, state_dir, "train.strategy=scadles", "train.target_accuracy=0.9",
                    f"input.topic={pattern}", *JSON_READINGS)
    device = cfg.devices_of("w1")[0]

    def inject(ctx: RunContext) -> None:
        wait_until(lambda: steps_of(ctx, "w1") >= 5, 60, "w1 to train")
        ctx.inject(device, [b'{"pixels": [0.5, ', orjson.dumps({"pixels": [0.5] * 64, "digit": 3, "ts": "x"})])

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=inject)
    show(result)

    assert min(t["accuracy"] for t in workers_of(result).values()) >= 0.87  # the target holds on the validation split; held-out lands within a few points
    assert result.balanced  # produced = trained + dropped + dead-lettered + pending, per device
    assert result.accounting[device]["dead_letters_by_reason"] == {"bad_json": 1, "bad_time": 1}
    names = set(topic_names(kafka_bootstrap))
    for d in cfg.devices.device_ids():
        assert f"plant{unique}.{d}.imu" in names and topics.sensor_topic(d) not in names
    first = orjson.loads(read_topic(kafka_bootstrap, f"plant{unique}.{device}.imu", timeout_ms=3000)[0].value)
    assert isinstance(first, list) and set(first[0]) == {"pixels", "digit", "ts"}
    # each dead letter says which of the pattern's topics it came from
    letters = [m for m in read_topic(kafka_bootstrap, topics.SENSOR_DLQ, timeout_ms=3000)
               if dict(m.headers).get(topics.DLQ_HEADER_WORKER) == b"w1"
               and dict(m.headers).get(topics.DLQ_HEADER_TOPIC) == f"plant{unique}.{device}.imu".encode()]
    assert len(letters) == 2


def test_a_recording_is_replayed_into_the_patterns_topics(kafka_bootstrap, unique, state_dir, tmp_path):
    table = write_breast_cancer_csv(tmp_path / "bc.csv")
    spec = ImportSpec(devices=2, rates_hz=[200, 100], duration_s=5.0, device_prefix=f"r{unique}-")
    imported = import_table(table, "diagnosis", tmp_path / "rec", spec)
    cfg = load_config(overrides=[
        f"job.name=lay{unique}", f"run.state_dir={state_dir}", "data.source=recording",
        f"data.recording={tmp_path / 'rec'}", "data.replay_speed=max", "workers.count=2",
        f"input.topic=line{unique}-{{device}}", "run.duration_s=20", "run.drain_timeout_s=60",
    ], env={})

    result = run_job(cfg, kafka_bootstrap, console=Console(file=io.StringIO(), width=160), live=False)
    show(result, training=False)

    assert result.produced == {d: v["records"] for d, v in imported.devices.items()}
    assert result.balanced and all(a["dead_letter_messages"] == 0 for a in result.accounting.values())
    names = set(topic_names(kafka_bootstrap))
    for d in cfg.devices.device_ids():
        assert f"line{unique}-{d}" in names and topics.sensor_topic(d) not in names
