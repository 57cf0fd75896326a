"""Metric definitions follow the naming rules; the consumer-lag helper is exact."""

from __future__ import annotations

import re
from collections import namedtuple

import pytest

from edgestream.monitoring.metrics import (
    LOSS_FIT_PARAMS,
    OBSERVATIONS,
    Metrics,
    consumer_lag,
    name_of,
)
from edgestream.monitoring.scrape import scrape

# ``state``: the five states of a device's record ledger (read, trained, dropped, dead_lettered, pending).
# ``member``: another worker as seen by ``worker`` (membership from heartbeats).
# ``param``: a parameter of the ADSP server's fitted loss curve (``LOSS_FIT_PARAMS``).
# ``peer``: a process a gossip worker mixes with or holds a model of (itself included).
# ``index``: a component of the model sketch (0 .. dim - 1).
# ``topic``, ``partition``: a partition of an update topic (how far a process wrote or read it).
ALLOWED_LABELS = {"device", "worker", "strategy", "codec", "reason", "split", "state", "member", "param",
                  "peer", "index", "topic", "partition"}
# ``_fit``: the fitted loss curve, each ``param`` in its own unit. ``_sketch``: the model
# sketch, in the model's parameter units.
UNIT_SUFFIXES = ("_total", "_seconds", "_bytes", "_records", "_messages", "_hz", "_ratio", "_versions", "_info",
                 "_up", "_ready", "_workers", "_devices", "_paused", "_version", "_loss", "_vote", "_commits", "_steps",
                 "_fit", "_sketch", "_per_second", "_stage")


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
    from edgestream.monitoring.prometheus import REPO_ROOT

    doc = (REPO_ROOT / "docs" / "monitoring.md").read_text()
    missing = [name_of(m) for m in Metrics().metric_objects() if f"`{name_of(m)}`" not in doc]
    assert not missing, f"docs/monitoring.md does not list {missing}"


def test_a_sent_gradient_or_delta_is_one_commit_of_its_worker(served):
    metrics, url = served
    metrics.init_worker("w0")
    metrics.init_worker("w1")

    for _ in range(3):
        metrics.record_sent("w0", "dense", 100, 100)
    metrics.record_sent("w1", "topk", 10, 100)

    s = scrape(url)
    assert s.get("edgestream_commits_total", worker="w0") == 3
    assert s.get("edgestream_commits_total", worker="w1") == 1
    assert s.get("edgestream_gradient_bytes_sent_total", worker="w0", codec="dense") == 300


def test_observed_levels_set_gauges_and_none_records_nothing(served):
    metrics, url = served
    fit = {"fit_a2": 0.25, "fit_b": 2.0, "fit_c0": 0.1, "fit_rmse": 0.01}

    metrics.record_observations("server", {"commit_target": 5, "clock_gap_steps": None, **fit})
    metrics.record_observations("w0", {"commit_target": 4, "blocked_seconds": None})

    s = scrape(url)
    assert s.by_label("edgestream_target_commits", "worker") == {"server": 5, "w0": 4}
    assert s.by_label("edgestream_loss_curve_fit", "param") == {"a2": 0.25, "b": 2.0, "c0": 0.1, "rmse": 0.01}
    assert s.get("edgestream_loss_curve_fit", worker="w0", default=-1) == -1
    assert "edgestream_clock_gap_steps" not in {x.name for x in s.samples}
    assert "edgestream_blocked_seconds_total" not in {x.name for x in s.samples}


def test_observed_totals_count_their_growth_from_the_first_value(served):
    metrics, url = served
    # restored from a checkpoint: 40 s blocked and 120 committed local steps before this process
    metrics.record_observations("w0", {"blocked_seconds": 40.0, "committed_local_steps": 120})
    first = scrape(url)
    metrics.record_observations("w0", {"blocked_seconds": 41.5, "committed_local_steps": 126})
    metrics.record_observations("w0", {"blocked_seconds": 41.5, "committed_local_steps": 130})
    metrics.record_observations("w0", {"blocked_seconds": 3.0})  # a reset: the new base, no decrease
    metrics.record_observations("w0", {"blocked_seconds": 3.5})

    s = scrape(url)
    assert first.get("edgestream_blocked_seconds_total", worker="w0", default=-1) == 0  # born at 0
    assert first.get("edgestream_committed_local_steps_total", worker="w0", default=-1) == 0
    assert s.get("edgestream_blocked_seconds_total", worker="w0") == pytest.approx(2.0)
    assert s.get("edgestream_committed_local_steps_total", worker="w0") == 10


def test_totals_are_kept_per_worker():
    metrics = Metrics()
    metrics.record_observations("w0", {"committed_local_steps": 5})
    metrics.record_observations("w1", {"committed_local_steps": 50})
    metrics.record_observations("w0", {"committed_local_steps": 7})

    assert metrics.observed["committed_local_steps"].labels("w0")._value.get() == 2
    assert metrics.observed["committed_local_steps"].labels("w1")._value.get() == 0


def test_an_unknown_observation_is_refused():
    with pytest.raises(ValueError, match="unknown observations \\['wall_clock'\\]"):
        Metrics().record_observations("w0", {"commit_target": 3, "wall_clock": 1.0})


KEYED = {"neighbour_lag": {"w1": 2}, "mixing_weights": {"w0": 0.5, "w1": 0.5}, "model_sketch": (0.1, -0.2),
         "link_bandwidth": {"w1": 1e6}, "link_ratio": {"w1": 0.1}, "link_bytes": {"w1": 100.0},
         "knowledge_transfers": {"w1": 1.0}, "updates_clipped": {"w1": 2.0}, "updates_norm_rejected": {"w2": 1.0}}


def test_every_observation_has_its_metric():
    metrics = Metrics()
    for key in OBSERVATIONS:
        metrics.record_observations("w0", {key: KEYED.get(key, 1.0)})
    assert {f"fit_{p}" for p in LOSS_FIT_PARAMS} <= set(OBSERVATIONS)
    assert set(KEYED) <= set(OBSERVATIONS)


def test_gossip_levels_set_their_gauges(served):
    metrics, url = served
    metrics.record_observations("w0", {"idle_fraction": 0.25, "iteration_time_s": 0.04, "iteration_time_cv": 0.5,
                                       "commit_target": None})
    metrics.record_observations("w1", {"idle_fraction": 0.75, "iteration_time_s": None})

    s = scrape(url)
    assert s.by_label("edgestream_idle_ratio", "worker") == {"w0": 0.25, "w1": 0.75}
    assert s.by_label("edgestream_iteration_seconds", "worker") == {"w0": 0.04}
    assert s.by_label("edgestream_iteration_cv_ratio", "worker") == {"w0": 0.5}


def _series(url: str, name: str, key: str) -> dict[tuple[str, str], float]:
    """The served samples of ``name`` by (worker, ``key`` label)."""
    return {(dict(x.labels)["worker"], dict(x.labels)[key]): x.value for x in scrape(url).samples if x.name == name}


def test_keyed_observations_set_one_child_per_peer_and_index(served):
    metrics, url = served
    metrics.record_observations("w0", {"neighbour_lag": {"w1": 3, "w2": 0},
                                       "mixing_weights": {"w0": 0.5, "w1": 0.25, "w2": 0.25},
                                       "model_sketch": [0.5, -1.0, 2.0]})
    metrics.record_observations("w1", {"neighbour_lag": {"w0": 1}, "model_sketch": (1.5, 0.0, 2.0)})

    assert _series(url, "edgestream_neighbour_lag_steps", "peer") == {("w0", "w1"): 3, ("w0", "w2"): 0,
                                                                       ("w1", "w0"): 1}
    assert _series(url, "edgestream_mixing_weight_ratio", "peer") == {("w0", "w0"): 0.5, ("w0", "w1"): 0.25,
                                                                       ("w0", "w2"): 0.25}
    assert _series(url, "edgestream_model_sketch", "index") == {
        ("w0", "0"): 0.5, ("w0", "1"): -1.0, ("w0", "2"): 2.0, ("w1", "0"): 1.5, ("w1", "1"): 0.0, ("w1", "2"): 2.0}


def test_a_key_that_disappeared_leaves_no_stale_series(served):
    metrics, url = served
    metrics.record_observations("w0", {"neighbour_lag": {"w1": 3, "w2": 1},
                                       "mixing_weights": {"w0": 0.4, "w1": 0.3, "w2": 0.3},
                                       "model_sketch": [1.0, 2.0, 3.0]})
    metrics.record_observations("w1", {"neighbour_lag": {"w2": 5}})
    # w2 left w0's neighbourhood; the sketch shrank (a smaller dim)
    metrics.record_observations("w0", {"neighbour_lag": {"w1": 4}, "mixing_weights": {"w0": 0.5, "w1": 0.5},
                                       "model_sketch": [1.5, 2.5]})

    lag = "edgestream_neighbour_lag_steps"
    assert _series(url, lag, "peer") == {("w0", "w1"): 4, ("w1", "w2"): 5}  # w1's view of w2 is untouched
    assert _series(url, "edgestream_mixing_weight_ratio", "peer") == {("w0", "w0"): 0.5, ("w0", "w1"): 0.5}
    assert _series(url, "edgestream_model_sketch", "index") == {("w0", "0"): 1.5, ("w0", "1"): 2.5}

    # None: not observed this time, the series stay; an empty mapping: no neighbour left
    metrics.record_observations("w0", {"neighbour_lag": None})
    assert _series(url, lag, "peer") == {("w0", "w1"): 4, ("w1", "w2"): 5}
    metrics.record_observations("w0", {"neighbour_lag": {}})
    assert _series(url, lag, "peer") == {("w1", "w2"): 5}
    # a neighbour that comes back gets its series again
    metrics.record_observations("w0", {"neighbour_lag": {"w2": 0}})
    assert _series(url, lag, "peer") == {("w0", "w2"): 0, ("w1", "w2"): 5}


def test_a_keyed_observation_must_be_a_mapping_or_a_sequence_and_a_level_a_number():
    metrics = Metrics()
    with pytest.raises(TypeError, match="neighbour_lag"):
        metrics.record_observations("w0", {"neighbour_lag": 3})
    with pytest.raises(TypeError, match="model_sketch"):
        metrics.record_observations("w0", {"model_sketch": "0.1,0.2"})
    with pytest.raises(TypeError, match="idle_fraction"):
        metrics.record_observations("w0", {"idle_fraction": [0.5]})


def test_observations_of_the_strategy_dataclass_are_exported(served):
    """``dataclasses.asdict(Observations(...))``, as the runtime hands it over."""
    import dataclasses

    from edgestream.trainers.strategies.base import Observations

    metrics, url = served
    obs = Observations(idle_fraction=0.1, iteration_time_s=0.2, iteration_time_cv=0.3,
                       neighbour_lag={"w1": 2}, mixing_weights={"w0": 0.6, "w1": 0.4}, model_sketch=(0.0, 1.0))
    metrics.record_observations("w0", dataclasses.asdict(obs))

    assert _series(url, "edgestream_mixing_weight_ratio", "peer") == {("w0", "w0"): 0.6, ("w0", "w1"): 0.4}
    assert _series(url, "edgestream_model_sketch", "index") == {("w0", "0"): 0.0, ("w0", "1"): 1.0}
    assert _series(url, "edgestream_neighbour_lag_steps", "peer") == {("w0", "w1"): 2}
    assert scrape(url).get("edgestream_idle_ratio", worker="w0") == 0.1


# -- keyed totals and DLion's observations -----------------------------------------------------


def test_keyed_totals_count_each_keys_growth_from_its_first_value(served):
    metrics, url = served
    name = "edgestream_link_bytes_total"
    # restored from a checkpoint: 5000 bytes to w1 and 700 to w2 before this process
    metrics.record_observations("w0", {"link_bytes": {"w1": 5000.0, "w2": 700.0}})
    assert _series(url, name, "peer") == {("w0", "w1"): 0, ("w0", "w2"): 0}  # born at 0
    metrics.record_observations("w0", {"link_bytes": {"w1": 5600.0, "w2": 700.0}})
    metrics.record_observations("w1", {"link_bytes": {"w0": 10.0}})
    metrics.record_observations("w0", {"link_bytes": {"w1": 6000.0, "w2": 750.0, "w3": 40.0}})
    assert _series(url, name, "peer") == {("w0", "w1"): 1000, ("w0", "w2"): 50, ("w0", "w3"): 0,
                                          ("w1", "w0"): 0}
    # a reset of one key (the strategy's state began again): its new base, no decrease
    metrics.record_observations("w0", {"link_bytes": {"w1": 100.0, "w2": 750.0, "w3": 40.0}})
    metrics.record_observations("w0", {"link_bytes": {"w1": 160.0, "w2": 760.0, "w3": 40.0}})
    assert _series(url, name, "peer") == {("w0", "w1"): 1060, ("w0", "w2"): 60, ("w0", "w3"): 0,
                                          ("w1", "w0"): 0}
    # None: not observed, nothing changes
    metrics.record_observations("w0", {"link_bytes": None})
    assert _series(url, name, "peer")[("w0", "w1")] == 1060


def test_a_keyed_total_whose_key_disappeared_is_removed_and_starts_over(served):
    metrics, url = served
    name = "edgestream_knowledge_transfers_total"
    metrics.record_observations("w0", {"knowledge_transfers": {"w1": 2, "w2": 3}})
    metrics.record_observations("w1", {"knowledge_transfers": {"w2": 1}})
    metrics.record_observations("w0", {"knowledge_transfers": {"w1": 4, "w2": 5}})
    metrics.record_observations("w0", {"knowledge_transfers": {"w1": 6}})  # w2 left
    assert _series(url, name, "peer") == {("w0", "w1"): 4, ("w1", "w2"): 0}
    # w2 comes back with a total of 9: a new series from 0, its base 9 (not 5)
    metrics.record_observations("w0", {"knowledge_transfers": {"w1": 6, "w2": 9}})
    metrics.record_observations("w0", {"knowledge_transfers": {"w1": 6, "w2": 10}})
    assert _series(url, name, "peer") == {("w0", "w1"): 4, ("w0", "w2"): 1, ("w1", "w2"): 0}
    metrics.record_observations("w0", {"knowledge_transfers": {}})
    assert _series(url, name, "peer") == {("w1", "w2"): 0}


def test_dlion_observations_are_exported(served):
    """``dataclasses.asdict(Observations(...))`` with DLion's fields, as the runtime hands it over."""
    import dataclasses

    from edgestream.trainers.strategies.base import Observations

    metrics, url = served
    obs = Observations(link_bandwidth={"w1": 1.5e6, "w2": 2.5e5}, link_ratio={"w1": 0.1, "w2": 0.01},
                       link_bytes={"w1": 1000.0, "w2": 200.0}, batch_size=48, capacity=350.0,
                       knowledge_transfers={"w2": 3})
    metrics.record_observations("w0", dataclasses.asdict(obs))
    metrics.record_observations("w0", dataclasses.asdict(dataclasses.replace(
        obs, link_bytes={"w1": 1500.0, "w2": 200.0}, knowledge_transfers={"w2": 4}, batch_size=64)))

    assert _series(url, "edgestream_link_bandwidth_bytes_per_second", "peer") == {("w0", "w1"): 1.5e6,
                                                                                  ("w0", "w2"): 2.5e5}
    assert _series(url, "edgestream_link_ratio", "peer") == {("w0", "w1"): 0.1, ("w0", "w2"): 0.01}
    assert _series(url, "edgestream_link_bytes_total", "peer") == {("w0", "w1"): 500, ("w0", "w2"): 0}
    assert _series(url, "edgestream_knowledge_transfers_total", "peer") == {("w0", "w2"): 1}
    s = scrape(url)
    assert s.get("edgestream_step_batch_records", worker="w0") == 64
    assert s.get("edgestream_capacity_samples_per_second", worker="w0") == 350.0


def _histogram_exposition(registry) -> list[str]:
    from prometheus_client import generate_latest

    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


@pytest.mark.parametrize("labelled", [False, True])
def test_observe_many_exposes_exactly_what_observing_each_value_does(labelled):
    import numpy as np
    from prometheus_client import CollectorRegistry, Histogram

    from edgestream.monitoring.metrics import SECONDS_BUCKETS, observe_many

    rng = np.random.default_rng(7)
    # Values on the bounds themselves, between them, below the first and above the last.
    values = np.concatenate([np.array(SECONDS_BUCKETS, dtype=np.float64), rng.exponential(0.3, 500),
                             [0.0, -0.5, 1e-9, 31.0, 1e6], rng.uniform(0, 40, 300)])
    rng.shuffle(values)
    one, bulk = CollectorRegistry(), CollectorRegistry()
    labels = ["device"] if labelled else []
    h_one = Histogram("x_seconds", "x", labels, buckets=SECONDS_BUCKETS, registry=one)
    h_bulk = Histogram("x_seconds", "x", labels, buckets=SECONDS_BUCKETS, registry=bulk)
    if labelled:
        h_one, h_bulk = h_one.labels("a"), h_bulk.labels("a")
    for chunk in np.array_split(values, 7):  # several calls accumulate like the per-value ones
        for v in chunk.tolist():
            h_one.observe(v)
        observe_many(h_bulk, chunk)
    observe_many(h_bulk, np.array([]))  # nothing observed: nothing changes
    assert _histogram_exposition(one) == _histogram_exposition(bulk)
    count = [line for line in _histogram_exposition(bulk) if line.startswith("x_seconds_count")]
    assert count and float(count[0].split()[-1]) == len(values)


def test_observe_many_refuses_a_labelled_histogram_itself():
    from prometheus_client import CollectorRegistry, Histogram

    from edgestream.monitoring.metrics import observe_many

    h = Histogram("y_seconds", "y", ["device"], registry=CollectorRegistry())
    with pytest.raises(ValueError):
        observe_many(h, [0.1])
