"""Shared fixtures: one real Kafka broker per test session, unique names per test."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory) -> str:
    """A real single-node Kafka broker (KRaft) for the whole session.

    Set EDGESTREAM_TEST_BOOTSTRAP to use an existing cluster instead. If the broker
    cannot start, every test that needs it errors with the broker's own message:
    integration tests never skip.
    """
    existing = os.environ.get("EDGESTREAM_TEST_BOOTSTRAP")
    if existing:
        yield existing
        return
    from edgestream.deploy.kafka.broker import LocalBroker

    broker = LocalBroker(tmp_path_factory.mktemp("kafka"))
    broker.start()
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory) -> str:
    """A real schema registry (Apicurio, deploy/schema_registry.py) for the whole session: the
    Confluent-compatible API's base URL. Built from Maven Central on first use (cached); if it
    cannot be built or started, every test that needs it errors with the reason."""
    from edgestream.deploy.schema_registry import LocalSchemaRegistry

    registry = LocalSchemaRegistry(tmp_path_factory.mktemp("registry")).start()
    try:
        yield registry.url
    finally:
        registry.stop()


@pytest.fixture
def unique() -> str:
    """A short unique suffix for topic, job and group names of one test."""
    return uuid.uuid4().hex[:8]


@pytest.fixture
def state_dir(tmp_path) -> Path:
    return tmp_path / "state"
