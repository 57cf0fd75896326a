"""Delayed labels on the real broker (issue 33, point 4).

The simulated devices send their readings without labels; each label follows on the label
topic 0-5 s later, and 5 % never come. Every reading is trained with its label, or dropped
as ``unlabeled`` (exactly the withheld ones); every label sent is joined; the run balances;
held-out accuracy is within 2 points of the same stream with its labels inline. A worker
killed mid-stream resumes from its checkpoint and committed offsets, with the readings and
labels it had not settled read again.
"""

from __future__ import annotations

import orjson
import pytest

from edgestream.pipeline.run import RunContext, run_job
from tests.integration.jobs import (
    JSON_READINGS,
    quiet,
    show,
    steps_of,
    train_job,
    wait_until,
    workers_of,
)

pytestmark = pytest.mark.integration

DELAYED = ("labels.simulate_delay_s=0,5", "labels.simulate_missing=0.05", "labels.max_delay_s=8")


def unlabeled(result) -> int:
    return sum(a["dropped_by_reason"].get("unlabeled", 0) for a in result.accounting.values())


def label_counts_add_up(result) -> None:
    labels = result.labels
    assert labels["withheld"] > 0 and labels["sent"] > 0
    assert unlabeled(result) == labels["withheld"]  # no reading waited in vain but the withheld ones
    assert labels["joined"] == labels["sent"]  # every label sent met its reading
    assert labels["read"] == labels["joined"] + labels["late"] + labels["foreign"]
    assert labels["dead_lettered"] == 0


@pytest.mark.timeout(600)
def test_delayed_labels_train_as_well_as_inline_ones_and_every_reading_is_accounted_for(
        kafka_bootstrap, unique, state_dir):
    common = ("train.strategy=bsp", "run.duration_s=40")
    inline = train_job(unique + "i", state_dir / "inline", *common)
    delayed = train_job(unique, state_dir / "delayed", *common, f"labels.topic=labels.t{unique}", *DELAYED)

    base = run_job(inline, kafka_bootstrap, console=quiet(), live=False)
    show(base)
    result = run_job(delayed, kafka_bootstrap, console=quiet(), live=False)
    show(result)
    print("labels:", result.labels)

    assert base.balanced and result.balanced
    label_counts_add_up(result)
    assert result.labels["late"] == 0  # 0-5 s delays inside an 8 s wait
    assert result.labels["scored"] > 0.9 * result.labels["joined"]  # the model's guess when each reading came
    produced = sum(result.produced.values())
    assert sum(a["consumed"] for a in result.accounting.values()) == produced - result.labels["withheld"]
    inline_acc = min(t["accuracy"] for t in workers_of(base).values())
    delayed_acc = min(t["accuracy"] for t in workers_of(result).values())
    print(f"held-out accuracy: inline {inline_acc:.3f}, delayed {delayed_acc:.3f}")
    assert delayed_acc >= inline_acc - 0.02


@pytest.mark.timeout(600)
def test_a_killed_worker_reads_its_unsettled_readings_and_labels_again(kafka_bootstrap, unique, state_dir):
    cfg = train_job(unique, state_dir, "train.strategy=bsp", "run.duration_s=30", "run.restart_backoff_s=0.5",
                    f"labels.topic=labels.t{unique}", *DELAYED)

    def crash(ctx: RunContext) -> None:
        wait_until(lambda: steps_of(ctx, "w1") >= 12, 90, "w1 to take 12 steps (a checkpoint every 10)")
        ctx.kill("w1")  # SIGKILL: readings waiting for labels are lost in memory, not in Kafka
        wait_until(lambda: ctx.restarts == ["w1"] and ctx.worker("w1").ready, 120, "the supervisor to restart w1")

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=crash)
    show(result)
    print("labels:", result.labels)

    assert result.restarted == ["w1"]
    assert workers_of(result)["w1"]["restored_from"] > 0  # a periodic checkpoint, not the initial one
    assert result.balanced  # per device: produced = trained + dropped + dead-lettered + pending
    assert unlabeled(result) == result.labels["withheld"]  # none lost to the crash either


@pytest.mark.timeout(600)
def test_labels_of_devices_sharing_a_keyed_topic_reach_the_worker_reading_them(kafka_bootstrap, unique,
                                                                                state_dir):
    devices = [f"s{unique}-{i:02d}" for i in range(12)]
    cfg = train_job(unique, state_dir, "train.strategy=bsp", "run.duration_s=20", f"input.topic=plant{unique}",
                    "input.partitions=6", f"devices.ids={','.join(devices)}", "devices.count=12",
                    "devices.rates_hz=40,20,10", "devices.message_interval_s=0.1", *JSON_READINGS,
                    f"labels.topic=labels.t{unique}", "labels.match=event_time", "labels.time_unit=ms", *DELAYED)
    sent_bad = orjson.dumps({"device": devices[0], "event_time": "soon", "label": 1})

    def inject(ctx: RunContext) -> None:
        from kafka import KafkaProducer

        wait_until(lambda: steps_of(ctx, "w0") >= 3, 60, "w0 to train")
        producer = KafkaProducer(bootstrap_servers=ctx.bootstrap)
        try:
            producer.send(cfg.labels.topic, sent_bad, key=devices[0].encode()).get(timeout=30)
        finally:
            producer.close()

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=inject)
    show(result)
    print("labels:", result.labels)

    assert result.balanced and sorted(result.accounting) == devices
    labels = result.labels
    assert labels["foreign"] == 0  # each worker reads only the label partitions of its own devices
    assert labels["dead_lettered"] == 1
    assert unlabeled(result) == labels["withheld"] and labels["joined"] == labels["sent"]
