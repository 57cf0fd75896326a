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
