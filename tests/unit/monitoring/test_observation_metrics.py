"""A strategy metric is one declaration beside its ``Observations`` field; the exporter derives the rest."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import generate_latest

import edgestream.monitoring.metrics as metrics_module
from edgestream.monitoring.metrics import OBSERVATIONS, Metrics
from edgestream.trainers.observations import (
    ObservationMetric,
    Observations,
    metric_of,
    observation_metrics,
    observed,
)


def _samples(metrics: Metrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Served samples by sample name: (labels, value)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def test_the_exported_vocabulary_is_the_observations_fields():
    assert OBSERVATIONS == tuple(f.name for f in dataclasses.fields(Observations))
    assert set(observation_metrics()) == set(OBSERVATIONS)


@pytest.mark.parametrize(("key", "spec"), observation_metrics().items(), ids=str)
def test_every_declared_field_is_a_metric_with_its_declared_name_type_help_and_labels(key, spec):
    metric = Metrics().observed[key]

    assert metric._type == spec.kind
    assert metric._name == spec.name.removesuffix("_total")
    assert metric._documentation == spec.help
    assert metric._labelnames == ("worker", *spec.labels)


def test_fields_declaring_one_metric_share_its_object_and_fill_its_fixed_label():
    metrics = Metrics()
    metrics.record_observations("server", {"fit_a2": 0.25, "fit_rmse": 0.01})

    assert metrics.observed["fit_a2"] is metrics.observed["fit_rmse"]
    assert sorted((labels["param"], value) for labels, value in _samples(metrics)["edgestream_loss_curve_fit"]) == [
        ("a2", 0.25), ("rmse", 0.01)]


def test_a_metric_of_a_new_field_is_one_declaration(monkeypatch):
    # Arrange: a field declared as a strategy would add it, nothing else touched.
    @dataclasses.dataclass(frozen=True)
    class Extended(Observations):
        votes_cast: dict[str, float] | None = observed(
            "counter", "edgestream_votes_cast_total", "Votes the worker cast for `peer`", ("peer",))

    declared = {f.name: metric_of(f) for f in dataclasses.fields(Extended)}
    monkeypatch.setattr(metrics_module, "observation_metrics", lambda: declared)
    metrics = Metrics()

    # Act: the runtime exports the strategy's observations as it does for every strategy.
    metrics.record_observations("w0", dataclasses.asdict(Extended(votes_cast={"w1": 2.0})))
    metrics.record_observations("w0", dataclasses.asdict(Extended(votes_cast={"w1": 5.0})))

    # Assert: a counter of the growth, labelled worker and peer, described by its help.
    assert _samples(metrics)["edgestream_votes_cast_total"] == [({"worker": "w0", "peer": "w1"}, 3.0)]
    exposition = generate_latest(metrics.registry).decode()
    assert "# HELP edgestream_votes_cast_total Votes the worker cast for `peer`" in exposition
    assert "edgestream_votes_cast_total" in metrics.exposition_names()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kind": "counter", "name": "edgestream_votes", "help": "h"}, "ends with '_total'"),
    ({"kind": "gauge", "name": "votes", "help": "h"}, "start with 'edgestream_'"),
    ({"kind": "gauge", "name": "edgestream_x", "help": "h", "fixed": ("a",)}, "more fixed values"),
])
def test_a_badly_named_declaration_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ObservationMetric(**kwargs)
