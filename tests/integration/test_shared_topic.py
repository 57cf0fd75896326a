"""Devices sharing one keyed topic (``input.topic`` without ``{device}``) on the real broker:
each worker reads its partitions, keeps per-device state for the devices it meets there, and
every device's records balance; bad messages are dead-lettered under their device."""

from __future__ import annotations

import orjson
import pytest

from edgestream.pipeline.kafka_io import admin_client, topic_names
from edgestream.pipeline.run import RunContext, run_job
from edgestream.streams import topics
from tests.integration.jobs import quiet, show, steps_of, train_job, wait_until, workers_of

pytestmark = pytest.mark.integration

JSON = ("input.format=json", "input.features_array=pixels", "input.label=digit", "input.event_time=ts",
        "input.time_unit=ms")


def test_a_job_trains_on_devices_sharing_one_keyed_topic(kafka_bootstrap, unique, state_dir):
    shared = f"plant{unique}.readings"
    devices = [f"s{unique}-{i:02d}" for i in range(24)]
    cfg = train_job(unique, state_dir, "train.strategy=scadles", "train.target_accuracy=0.9",
                    f"input.topic={shared}", "input.partitions=6", f"devices.ids={','.join(devices)}",
                    "devices.count=24", "devices.rates_hz=40,20,10", "devices.message_interval_s=0.1", *JSON)
    owned = {w: cfg.devices_of(w) for w in cfg.worker_names()}
    assert sorted(sum(owned.values(), [])) == devices and all(owned.values())
    victim = owned["w2"][0]

    def inject(ctx: RunContext) -> None:
        wait_until(lambda: steps_of(ctx, "w2") >= 5, 60, "w2 to train")
        ctx.inject(victim, [b'{"pixels": [0.5, ', orjson.dumps({"pixels": [0.5] * 64, "digit": 3, "ts": "x"})])

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=inject)
    show(result)

    assert min(t["accuracy"] for t in workers_of(result).values()) >= 0.9
    assert result.balanced  # per device: produced = trained + dropped + dead-lettered + pending
    assert sorted(result.accounting) == devices
    assert all(result.accounting[d]["records_in"] > 0 for d in devices)
    assert result.accounting[victim]["dead_letters_by_reason"] == {"bad_json": 1, "bad_time": 1}
    names = set(topic_names(kafka_bootstrap))
    assert shared in names and not any(topics.sensor_topic(d) in names for d in devices)
    admin = admin_client(kafka_bootstrap)
    try:
        (entry,) = admin.describe_topics([shared])
    finally:
        admin.close()
    assert len(entry["partitions"]) == 6
