"""The topic plan: every Kafka topic a job uses, by kind, in one place.

Names come from ``streams.topics``; this module decides which of them a job, a process
or a strategy channel uses, and of which kind (``sensors``, ``dlq``, ``gradients``,
``models``, ``predictions``: ``streams.topics.topic_configs``). Creating them (``ensure_topics``) is
``pipeline.kafka_io``'s; nothing here talks to Kafka.
"""

from __future__ import annotations

from edgestream.job.config import JobConfig
from edgestream.streams import topics


def sensor_topics_for(devices: list[str], layout: topics.TopicLayout = topics.DEFAULT_LAYOUT) -> dict[str, str]:
    """The topics of ``devices``, name -> kind: each device's topic in ``layout``
    (``sensors.<device>`` by default; a keyed layout's one shared topic) and ``sensors.dlq``."""
    wanted = {layout.topic(d): "sensors" for d in devices}
    wanted[topics.SENSOR_DLQ] = "dlq"
    return wanted


def sensor_partitions(cfg: JobConfig) -> dict[str, int]:
    """Device topics created with their own partition count (``ensure_topics``'s ``sized``):
    a shared topic's ``input.partitions``, and the label topic's (``labels.topic``) the same, so
    a device's labels, keyed by it, land in the partition number of its readings; none for one
    topic per device."""
    layout = cfg.input.layout()
    sized = {layout.pattern: cfg.input.partitions} if layout.keyed else {}
    if cfg.labels.delayed:
        sized[cfg.labels.topic] = cfg.input.partitions if layout.keyed else 1
    return sized


def label_topics(cfg: JobConfig) -> dict[str, str]:
    """The label topic (``labels.topic``), if the job's labels come on their own."""
    return {cfg.labels.topic: "sensors"} if cfg.labels.delayed else {}


def prediction_topics(cfg: JobConfig) -> dict[str, str]:
    """``predictions.<job>`` (kind ``predictions``) if the job's workers publish a prediction
    per trained record (``serve.predictions``); else nothing."""
    if not (cfg.serve.predictions and cfg.train.enabled):
        return {}
    return {topics.predictions_topic(cfg.job.name): "predictions"}


#: Channels with one topic per job, read by every subscriber (``inbox`` is per recipient).
SHARED_CHANNELS = ("gradients", "models", "control")


def channel_topic(job: str, channel: str, to: str | None = None) -> str:
    """The Kafka topic of a strategy channel: ``gradients.<job>``, ``models.<job>``,
    ``control.<job>``; for ``inbox``, recipient ``to``'s own topic ``inbox.<job>.<to>``."""
    if channel == "gradients":
        return topics.gradients_topic(job)
    if channel == "models":
        return topics.models_topic(job)
    if channel == "control":
        return "control." + job
    if channel == "inbox":
        if not to:
            raise ValueError("the inbox channel needs a recipient (to=...)")
        return topics.inbox_topic(job, to)
    raise ValueError(f"unknown channel {channel!r}")


def topic_channel(job: str, topic: str) -> str | None:
    """Inverse of ``channel_topic``: the channel of a training topic of ``job`` (None: not one)."""
    for channel in SHARED_CHANNELS:
        if topic == channel_topic(job, channel):
            return channel
    if topic.startswith(f"inbox.{job}.") and topic.count(".") == 2:
        return "inbox"
    return None


def training_topics(job: str, inboxes: tuple[str, ...] | list[str] = ()) -> dict[str, str]:
    """Topics a training job needs, name -> kind (for ``ensure_topics``); ``inboxes``: the
    processes whose ``inbox.<job>.<name>`` topic to add (kind ``gradients``: one
    partition, retention, never compacted)."""
    wanted = {
        channel_topic(job, "gradients"): "gradients",
        channel_topic(job, "models"): "models",
        channel_topic(job, "control"): "gradients",
        topics.gradients_dlq_topic(job): "dlq",
    }
    wanted.update({channel_topic(job, "inbox", name): "gradients" for name in inboxes})
    return wanted


def read_topics(job: str, name: str, subscribes: tuple[str, ...] | list[str]) -> list[str]:
    """The topics process ``name`` reads for a strategy subscribing to ``subscribes``: each
    subscribed channel's topic (``inbox``: its own ``inbox.<job>.<name>`` only), then
    ``control.<job>`` (the heartbeats) whether or not the strategy takes control messages."""
    read = [channel_topic(job, ch, name if ch == "inbox" else None) for ch in subscribes]
    control = channel_topic(job, "control")
    return read if control in read else [*read, control]


def job_topics(cfg: JobConfig, subscribes: tuple[str, ...] | list[str] = (), *,
               training: bool | None = None) -> dict[str, str]:
    """Every topic of the job, name -> kind: each device's topic (``input.topic``) and
    ``sensors.dlq``; when it
    trains (``training``, default ``train.enabled``), its training topics, with every
    configured worker's inbox when its strategy subscribes to ``inbox`` (a message to a
    worker that starts later, or joins, waits in its topic), and its predictions topic
    (``prediction_topics``)."""
    wanted = sensor_topics_for(cfg.devices.device_ids(), cfg.input.layout())
    wanted.update(label_topics(cfg))
    if cfg.train.enabled if training is None else training:
        inboxes = cfg.worker_names() if "inbox" in subscribes else []
        wanted.update(training_topics(cfg.job.name, inboxes))
        wanted.update(prediction_topics(cfg))
    return wanted
