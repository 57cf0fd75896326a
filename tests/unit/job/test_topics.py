"""The topic plan: every topic a job uses, by kind, from the config alone."""

from __future__ import annotations

import pytest

from edgestream.job.config import load_config
from edgestream.job.topics import job_topics, sensor_topics_for, training_topics
from edgestream.pipeline.worker import SERVER_NAME, check_training_config, process_topics


def job(*extra: str):
    return load_config(overrides=["job.name=j1", "devices.count=4", "workers.count=2", *extra], env={})


def test_an_ingest_only_job_uses_its_device_topics_and_the_dead_letter_topic():
    cfg = job()

    assert job_topics(cfg) == {"sensors.dev00": "sensors", "sensors.dev01": "sensors", "sensors.dev02": "sensors",
                               "sensors.dev03": "sensors", "sensors.dlq": "dlq"}
    assert job_topics(cfg) == sensor_topics_for(cfg.devices.device_ids())
    assert job_topics(cfg, training=True) == {**job_topics(cfg), **training_topics("j1")}


def test_a_training_job_adds_its_channels_and_every_workers_inbox_only_for_an_inbox_strategy():
    plain = job("train.enabled=true", "train.strategy=bsp")
    gossip = job("train.enabled=true", "train.strategy=gossip")

    assert job_topics(plain, check_training_config(plain)) == {
        **sensor_topics_for(plain.devices.device_ids()), "gradients.j1": "gradients", "models.j1": "models",
        "control.j1": "gradients", "gradients.j1.dlq": "dlq"}
    inboxes = {t: k for t, k in job_topics(gossip, check_training_config(gossip)).items() if t.startswith("inbox.")}
    assert inboxes == {"inbox.j1.w0": "gradients", "inbox.j1.w1": "gradients"}
    assert job_topics(gossip, check_training_config(gossip), training=False) == job_topics(job())


@pytest.mark.parametrize("strategy", ["bsp", "gossip"])
def test_every_topic_a_process_uses_is_in_the_job_plan(strategy):
    cfg = job("train.enabled=true", f"train.strategy={strategy}")
    subscribes = check_training_config(cfg)
    plan = job_topics(cfg, subscribes)

    for name in [*cfg.worker_names(), SERVER_NAME]:
        mine = process_topics(cfg, name, subscribes if name != SERVER_NAME else ())
        assert mine.items() <= plan.items(), name


def test_a_job_with_a_topic_pattern_uses_it_for_every_device_topic():
    cfg = job("input.topic=plant1.{device}.imu", "train.enabled=true", "train.strategy=bsp")

    sensors = {t: k for t, k in job_topics(cfg).items() if k == "sensors"}

    assert sensors == {f"plant1.dev0{i}.imu": "sensors" for i in range(4)}
    assert job_topics(cfg)["sensors.dlq"] == "dlq"  # dead letters keep their topic
    for worker in ("w0", "w1"):
        read = {t for t, k in process_topics(cfg, worker).items() if k == "sensors"}
        assert read == {f"plant1.{d}.imu" for d in cfg.devices_of(worker)} and len(read) == 2


@pytest.mark.parametrize(("pattern", "says"), [
    ("{device}.{device}", "input.topic: .*once"),
    ("models.{device}", "input.topic: .*job's own topics"),
])
def test_a_bad_topic_pattern_is_a_configuration_error(pattern, says):
    from edgestream.job.config import ConfigError

    with pytest.raises(ConfigError, match=says):
        job(f"input.topic={pattern}")


def test_a_device_whose_topic_would_be_the_dead_letter_topic_is_a_configuration_error():
    from edgestream.job.config import ConfigError

    with pytest.raises(ConfigError, match="devices: .*dead-letter topic"):
        job("devices.ids=dlq,dev01", "devices.count=2", "workers.count=1")
