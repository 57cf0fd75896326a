"""Where each strategy channel lives in Kafka: the shared per-job topics, the per-recipient
``inbox.<job>.<worker>`` topics, what a process reads and creates (pure functions; the
inbox ensure-once logic of the runtime with a fake topic creator, no broker)."""

from __future__ import annotations

import asyncio

import pytest

from edgestream.job.config import load_config
from edgestream.job.topics import channel_topic, read_topics, topic_channel, training_topics
from edgestream.pipeline.worker import (
    SERVER_NAME,
    check_training_config,
    process_topics,
    update_topics,
)
from edgestream.streams import topics
from edgestream.streams.errors import TopicNameError


def job(tmp_path, strategy: str = "gossip", *extra: str):
    return load_config(overrides=[f"run.state_dir={tmp_path / 'state'}", "job.name=j1", "devices.count=4",
                                  "workers.count=4", "train.enabled=true", "train.model=mlp",
                                  f"train.strategy={strategy}", *extra], env={})


def test_shared_channels_have_one_topic_per_job():
    assert channel_topic("j1", "gradients") == "gradients.j1" == topics.gradients_topic("j1")
    assert channel_topic("j1", "models") == "models.j1" == topics.models_topic("j1")
    assert channel_topic("j1", "control") == "control.j1"
    # A recipient changes nothing on a shared channel (``to`` travels as a header there).
    assert channel_topic("j1", "gradients", "w3") == "gradients.j1"


def test_the_inbox_channel_is_one_topic_per_recipient():
    assert channel_topic("j1", "inbox", "w2") == "inbox.j1.w2" == topics.inbox_topic("j1", "w2")
    assert channel_topic("j1", "inbox", "w2") != channel_topic("j1", "inbox", "w3")
    assert channel_topic("j2", "inbox", "w2") == "inbox.j2.w2"
    with pytest.raises(ValueError, match="recipient"):
        channel_topic("j1", "inbox")
    with pytest.raises(TopicNameError):
        channel_topic("j1", "inbox", "w/2")  # not a usable topic name part
    with pytest.raises(ValueError, match="unknown channel"):
        channel_topic("j1", "mailbox", "w2")


def test_topic_channel_inverts_channel_topic_for_its_job_only():
    for channel in ("gradients", "models", "control"):
        assert topic_channel("j1", channel_topic("j1", channel)) == channel
    assert topic_channel("j1", "inbox.j1.w0") == "inbox"
    assert topic_channel("j1", "inbox.j2.w0") is None  # another job's inbox
    assert topic_channel("j1", "gradients.j2") is None
    assert topic_channel("j1", "gradients.j1.dlq") is None
    assert topic_channel("j1", "sensors.dev00") is None


def test_training_topics_add_inboxes_only_when_asked_as_retained_single_partition_logs():
    base = training_topics("j1")
    assert base == {"gradients.j1": "gradients", "models.j1": "models", "control.j1": "gradients",
                    "gradients.j1.dlq": "dlq"}
    with_inboxes = training_topics("j1", ["w0", "w1"])
    assert with_inboxes == {**base, "inbox.j1.w0": "gradients", "inbox.j1.w1": "gradients"}
    # Kind "gradients": retention, never compaction (every delta counts, not just the last).
    settings = topics.topic_configs(with_inboxes["inbox.j1.w0"])
    assert "retention.ms" in settings and "cleanup.policy" not in settings


@pytest.mark.parametrize(("subscribes", "expected"), [
    (("inbox",), ["inbox.j1.w1", "control.j1"]),
    (("gradients", "models"), ["gradients.j1", "models.j1", "control.j1"]),
    (("models", "control"), ["models.j1", "control.j1"]),  # control read once
    (("gradients",), ["gradients.j1", "control.j1"]),
])
def test_a_process_reads_its_subscribed_channels_its_own_inbox_and_control(subscribes, expected):
    assert read_topics("j1", "w1", subscribes) == expected


def test_a_process_creates_only_its_own_inbox_and_checkpoints_it_with_the_update_topics(tmp_path):
    cfg = job(tmp_path)
    mine = process_topics(cfg, "w1", ("inbox",))
    assert mine["inbox.j1.w1"] == "gradients"
    assert not any(t.startswith("inbox.") and t != "inbox.j1.w1" for t in mine)
    assert process_topics(cfg, "w1") == {t: k for t, k in mine.items() if t != "inbox.j1.w1"}
    assert process_topics(cfg, "w1", ("gradients", "models")) == process_topics(cfg, "w1")
    assert not any(t.startswith("inbox.") for t in process_topics(cfg, SERVER_NAME, ("gradients",)))
    # The update topics (group offsets, checkpoint 0) include the inbox of that process only.
    assert update_topics(cfg) == ["gradients.j1", "models.j1", "control.j1"]
    assert update_topics(cfg, "w1", ("inbox",)) == ["gradients.j1", "models.j1", "control.j1", "inbox.j1.w1"]
    assert update_topics(cfg, "w1", ("gradients",)) == update_topics(cfg)


@pytest.mark.parametrize(("strategy", "expected"), [
    ("gossip", ("inbox",)), ("edgegossip", ("inbox",)), ("bsp", ("gradients", "models")),
])
def test_the_config_check_returns_the_channels_the_strategy_reads(tmp_path, strategy, expected):
    assert check_training_config(job(tmp_path, strategy)) == expected


def test_a_runtime_ensures_each_recipients_inbox_once_and_retries_a_failure(tmp_path):
    from edgestream.job.sources import job_fleet_data
    from edgestream.monitoring.metrics import Metrics
    from edgestream.pipeline.training import TrainingRuntime

    cfg = job(tmp_path)
    runtime = TrainingRuntime(cfg, "w0", job_fleet_data(cfg), Metrics(), tmp_path / "state" / "w0")
    assert runtime.own_topics() == {"inbox.j1.w0": "gradients"}
    calls: list[dict[str, str]] = []
    fail = {"next": False}

    def ensure(wanted: dict[str, str]) -> list[str]:
        calls.append(dict(wanted))
        if fail["next"]:
            fail["next"] = False
            raise RuntimeError("cluster refused")
        return list(wanted)

    runtime.ensure_topics = ensure

    async def scenario() -> None:
        await asyncio.gather(*(runtime._inbox_ready("w1") for _ in range(3)))  # concurrent first sends
        await runtime._inbox_ready("w1")
        await runtime._inbox_ready("w3")
        fail["next"] = True
        with pytest.raises(RuntimeError):
            await runtime._inbox_ready("w2")
        await runtime._inbox_ready("w2")  # not cached after the failure: tried again

    asyncio.run(scenario())
    assert calls == [{"inbox.j1.w1": "gradients"}, {"inbox.j1.w3": "gradients"},
                     {"inbox.j1.w2": "gradients"}, {"inbox.j1.w2": "gradients"}]
    runtime.executor.shutdown()


def test_a_runtime_of_a_shared_channel_strategy_has_no_topic_of_its_own(tmp_path):
    from edgestream.job.sources import job_fleet_data
    from edgestream.monitoring.metrics import Metrics
    from edgestream.pipeline.training import TrainingRuntime

    cfg = job(tmp_path, "bsp")
    runtime = TrainingRuntime(cfg, "w0", job_fleet_data(cfg), Metrics(), tmp_path / "state" / "w0")
    assert runtime.own_topics() == {}
    runtime.executor.shutdown()
