"""The [serve] section and the predictions topic in the job's topic plan."""

from __future__ import annotations

import pytest

from edgestream.job.config import ConfigError, load_config
from edgestream.job.topics import job_topics, prediction_topics
from edgestream.streams import topics
from edgestream.streams.errors import TopicNameError


def cfg_of(*overrides: str):
    return load_config(overrides=["job.name=shop", *overrides], env={})


def test_predictions_are_off_by_default_with_three_classes_listed():
    cfg = cfg_of()
    assert (cfg.serve.predictions, cfg.serve.top_k) == (False, 3)
    assert prediction_topics(cfg) == {}


def test_a_training_job_with_predictions_plans_its_predictions_topic():
    cfg = cfg_of("train.enabled=true", "serve.predictions=true", "serve.top_k=5")
    assert prediction_topics(cfg) == {"predictions.shop": "predictions"}
    assert job_topics(cfg)["predictions.shop"] == "predictions"
    assert "predictions.shop" not in job_topics(cfg_of("train.enabled=true"))
    assert topics.topic_configs("predictions") == {"max.message.bytes": str(topics.MAX_MESSAGE_BYTES)}


@pytest.mark.parametrize(("overrides", "message"), [
    (("serve.predictions=true",), "serve.predictions publishes what the training workers predict: it needs "
                                  "train.enabled = true"),
    (("train.enabled=true", "serve.predictions=true", "workers.count=2", "train.stages=fc1",
      "train.model=conv8", "train.strategy=pipeline_bp"), "serve.predictions cannot be used with train.stages"),
    (("serve.top_k=0",), "serve.top_k must be an integer in [1, 100] (got 0)"),
    (("serve.top_k=101",), "serve.top_k must be an integer in [1, 100]"),
    (("serve.top_k=two",), "serve.top_k='two' is not a valid int"),
    (("serve.predictions=maybe",), "serve.predictions='maybe' is not a valid bool"),
    (("serve.topic=x",), "unknown key 'serve.topic'; serve has: predictions, top_k"),
])
def test_a_bad_serve_setting_is_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        cfg_of(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_no_device_topic_may_look_like_a_predictions_topic():
    with pytest.raises(TopicNameError, match="starts with 'predictions.'"):
        topics.TopicLayout("predictions.{device}")
    with pytest.raises(ConfigError, match="predictions."):
        cfg_of("input.topic=predictions.shop")
