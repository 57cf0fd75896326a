"""Metric definitions follow the naming rules; the consumer-lag helper is exact."""

from __future__ import annotations

import re
from collections import namedtuple

import pytest

from monitoring.metrics import Metrics, consumer_lag, name_of

# ``state``: the five states of a device's record ledger (read, trained, dropped, dead_lettered, pending).
# ``member``: another worker as seen by ``worker`` (membership from heartbeats).
ALLOWED_LABELS = {"device", "worker", "strategy", "codec", "reason", "split", "state", "member"}
UNIT_SUFFIXES = ("_total", "_seconds", "_bytes", "_records", "_messages", "_hz", "_ratio", "_versions", "_info",
                 "_up", "_ready", "_workers", "_paused", "_version", "_loss", "_vote")


@pytest.mark.parametrize("metric", Metrics().metric_objects(), ids=lambda m: m._name)
def test_every_metric_is_named_and_labelled_by_the_rules(metric):
    name = name_of(metric)
    assert re.fullmatch(r"edgestream_[a-z0-9_]+", name)
    assert name.endswith(UNIT_SUFFIXES), name
    assert set(metric._labelnames) <= ALLOWED_LABELS, (name, metric._labelnames)
    assert metric._documentation


def test_each_metric_is_defined_once():
    names = [name_of(m) for m in Metrics().metric_objects()]
    assert len(names) == len(set(names))


def test_issue_metrics_exist():
    names = Metrics().exposition_names()
    for required in (
        "edgestream_records_in_total", "edgestream_bytes_in_total", "edgestream_arrival_rate_hz",
        "edgestream_event_time_lag_seconds", "edgestream_consumer_lag_records",
        "edgestream_buffer_depth_records", "edgestream_buffer_dropped_records_total",
        "edgestream_dead_letter_messages_total", "edgestream_batch_size_records_bucket",
        "edgestream_wait_for_data_seconds_bucket", "edgestream_step_seconds_bucket", "edgestream_model_version",
        "edgestream_staleness_versions_bucket", "edgestream_staleness_seconds_bucket",
        "edgestream_gradient_bytes_sent_total", "edgestream_gradient_bytes_received_total",
        "edgestream_compression_ratio", "edgestream_compressed_steps_total", "edgestream_steps_total",
        "edgestream_compression_vote", "edgestream_commits_total", "edgestream_loss",
        "edgestream_accuracy_ratio", "edgestream_worker_up", "edgestream_last_checkpoint_timestamp_seconds",
        "edgestream_updates_rejected_total",
    ):
        assert required in names, required


TP = namedtuple("TP", "topic partition")


def test_consumer_lag_sums_partitions_per_device_and_ignores_other_topics():
    end = {TP("sensors.dev00", 0): 100, TP("sensors.dev00", 1): 50, TP("sensors.dev01", 0): 7,
           TP("sensors.dlq", 0): 999, TP("gradients.job", 0): 5}
    positions = {TP("sensors.dev00", 0): 90, TP("sensors.dev00", 1): 50, ("sensors.dev01", 0): None}

    lag = consumer_lag(end, positions)

    assert lag == {"dev00": 10, "dev01": 7}


def test_consumer_lag_never_negative():
    assert consumer_lag({("sensors.a", 0): 5}, {("sensors.a", 0): 9}) == {"a": 0}


def test_the_monitoring_doc_lists_every_metric():
    from monitoring.prometheus import REPO_ROOT

    doc = (REPO_ROOT / "docs" / "monitoring.md").read_text()
    missing = [name_of(m) for m in Metrics().metric_objects() if f"`{name_of(m)}`" not in doc]
    assert not missing, f"docs/monitoring.md does not list {missing}"
