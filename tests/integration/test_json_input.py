"""A job on JSON readings (``input.format = json``) on the real broker: the simulated devices
write JSON laid out as the job's mapping says, the workers read it through the mapping and
train, and bad JSON is dead-lettered with its reason, every record accounted for."""

from __future__ import annotations

import time

import orjson
import pytest

from edgestream.pipeline.run import RunContext, run_job
from edgestream.streams import topics
from tests.integration.jobs import (
    quiet,
    read_topic,
    show,
    steps_of,
    train_job,
    wait_until,
    workers_of,
)

pytestmark = pytest.mark.integration

MAPPING = ("input.format=json", "input.features_array=reading.pixels", "input.label=reading.digit",
           "input.event_time=ts", "input.time_unit=ms", "input.record_id=n", "input.extra=reject")


def _reading(**overrides) -> dict:
    reading = {"reading": {"pixels": [0.5] * 64, "digit": 3}, "ts": time.time() * 1e3, "n": 10**12}
    reading.update(overrides)
    return reading


def test_a_job_on_json_readings_trains_and_dead_letters_bad_json(kafka_bootstrap, unique, state_dir):
    cfg = train_job(unique, state_dir, "train.strategy=bsp", "train.target_accuracy=0.9",
                    "devices.rates_hz=480,320,240", "batcher.window_s=0.0625", *MAPPING)
    device = cfg.devices_of("w0")[0]
    bad = {
        b"{\"reading\": {\"pixels\": [0.5,": "bad_json",
        orjson.dumps(_reading(reading={"pixels": ["0.5"] * 64, "digit": 3})): "bad_type",  # numbers as strings
        orjson.dumps(_reading(reading={"pixels": [0.5] * 64})): "no_labels",  # a training job needs them
        orjson.dumps([_reading(), _reading(reading={"pixels": [0.5] * 64})]): "missing_field",  # one of two
        orjson.dumps(_reading(battery=0.93)): "extra_field",
        orjson.dumps(_reading(reading={"pixels": [0.5] * 63, "digit": 3})): "bad_shape",
        orjson.dumps(_reading(ts="yesterday")): "bad_time",
    }

    def inject(ctx: RunContext) -> None:
        wait_until(lambda: steps_of(ctx, "w0") >= 5, 60, "w0 to train")
        ctx.inject(device, list(bad))

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=inject)
    show(result)

    trained = workers_of(result)
    assert min(t["accuracy"] for t in trained.values()) >= 0.87  # the target holds on the validation split; held-out lands within a few points
    assert result.balanced  # produced = trained + dropped + dead-lettered + pending, per device
    acc = result.accounting[device]
    assert acc["dead_letters_by_reason"] == {reason: 1 for reason in bad.values()}
    assert acc["dead_records"] == 0  # the bad messages are dead-lettered whole, none of the simulated ones
    # what the simulated devices wrote is JSON laid out as the mapping says
    first = orjson.loads(read_topic(kafka_bootstrap, topics.sensor_topic(device), timeout_ms=3000)[0].value)
    assert isinstance(first, list) and set(first[0]) == {"reading", "ts", "n"}
    assert len(first[0]["reading"]["pixels"]) == 64 and isinstance(first[0]["reading"]["digit"], int)
