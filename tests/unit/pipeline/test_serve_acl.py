"""The grants `edgestream serve` needs on a secure cluster (it logs in as the job's workers
principal): write ``predictions.<job>`` whatever ``serve.predictions`` says, read the device
topics and ``models.<job>``, use its consumer group; and ``acl apply`` creates the topic."""

from __future__ import annotations

import pytest

from edgestream.job.config import load_config
from edgestream.pipeline import acl


def job(*overrides: str):
    return load_config(overrides=["job.name=j", "devices.count=2", "devices.ids=d1,d2", "train.enabled=true",
                                  *overrides], env={})


def allowed(grants: list[acl.Grant], user: str, resource: str, name: str, op: str) -> bool:
    """What the authorizer would answer: a literal match, or a prefixed grant the name starts with."""
    return any(g.user == user and g.resource == resource and op in g.operations
               and (name.startswith(g.name) if g.prefixed else name == g.name) for g in grants)


@pytest.mark.parametrize("predictions", ["true", "false"])
def test_the_serve_principal_may_do_what_serve_does(predictions):
    cfg = job(f"serve.predictions={predictions}", "train.strategy=ssp")
    grants = acl.job_grants(cfg)
    serve = acl.workers_user(cfg)  # serve's principal (docs/serving.md "Deploying")

    for op in ("WRITE", "DESCRIBE"):
        assert allowed(grants, serve, "topic", "predictions.j", op)
    for topic in ("sensors.d1", "sensors.d2", "models.j"):
        assert allowed(grants, serve, "topic", topic, "READ")
    assert allowed(grants, serve, "topic", "sensors.dlq", "WRITE")  # a record it cannot decode
    assert allowed(grants, serve, "group", cfg.serve.group_of(cfg), "READ")
    # ... and nobody else writes predictions.
    assert {g.user for g in grants if g.name == "predictions.j" and "WRITE" in g.operations} == {serve}
    assert acl.serve_topics(cfg) == {"predictions.j": "predictions"}


def test_a_serve_group_outside_the_job_prefix_is_granted_to_serve_alone():
    cfg = job("serve.group=fleet-serving")
    grants = acl.job_grants(cfg)

    assert allowed(grants, "j-workers", "group", "fleet-serving", "READ")
    assert [(g.user, g.name, g.prefixed) for g in grants if g.resource == "group"] == [
        ("j-workers", "edgestream-j-", True), ("j-workers", "fleet-serving", False)]
    # The default group lies inside the prefix: no grant of its own.
    assert [g.name for g in acl.job_grants(job()) if g.resource == "group"] == ["edgestream-j-"]


def test_a_job_that_does_not_train_has_no_predictions_topic_nor_grant():
    cfg = job("train.enabled=false")

    assert acl.serve_topics(cfg) == {}
    assert not any(g.name.startswith("predictions.") for g in acl.job_grants(cfg))
