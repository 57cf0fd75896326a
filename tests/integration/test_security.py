"""TLS, SCRAM logins and ACLs on a real secure broker (docs/security.md)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from kafka.errors import KafkaError

from edgestream.deploy.kafka.broker import ADMIN_USER, BrokerSecurity, LocalBroker
from edgestream.deploy.kafka.tls import make_pki
from edgestream.job.config import load_config
from edgestream.pipeline import acl, security
from edgestream.pipeline.kafka_io import consumer, producer
from edgestream.pipeline.run import run_job
from edgestream.pipeline.simulate import simulate
from tests.integration.jobs import REPO, quiet, start_worker_cli, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory):
    """A single-node broker whose only client listener is SASL_SSL, with ACLs enforced."""
    work = tmp_path_factory.mktemp("secure-kafka")
    pki = make_pki(work / "tls", ["127.0.0.1"])
    (work / "admin.password").write_text(secrets.token_urlsafe(16))
    broker = LocalBroker(work / "kafka", security=BrokerSecurity(pki.directory, (work / "admin.password").read_text()))
    broker.start()
    try:
        yield broker, work
    finally:
        broker.stop()


def settings(broker, work: Path, user: str = ADMIN_USER, password_file: Path | None = None, **extra: str) -> list[str]:
    """``--set`` overrides that log in as ``user``."""
    values = {"kafka.bootstrap": broker.bootstrap, "kafka.security_protocol": "SASL_SSL",
              "kafka.ssl_cafile": str(work / "tls" / "ca.pem"), "kafka.sasl_username": user,
              "kafka.sasl_password_file": str(password_file or work / "admin.password"), **extra}
    return [f"{k}={v}" for k, v in values.items()]


def job(unique: str, state_dir: Path, *overrides: str):
    return load_config(overrides=[
        f"job.name=s{unique}", f"devices.ids=a{unique},b{unique}", "devices.count=2", "devices.rates_hz=200,100",
        "devices.message_interval_s=0.05", "workers.count=1", "train.enabled=true", "train.model=mlp",
        f"run.state_dir={state_dir}", *overrides], env={})


@pytest.fixture
def as_user():
    """Switch this process's Kafka principal (``pipeline.security.use``); restored after the test."""
    before = security.current()

    def use(cfg) -> None:
        security.use(security.ClientSecurity.from_config(cfg.kafka, env={}))

    yield use
    security.use(before)


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgestream", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "EDGESTREAM_KAFKA_PASSWORD": ""})


@pytest.mark.parametrize("case", ["wrong password", "untrusted certificate", "plaintext client"])
def test_a_refused_client_fails_fast_with_one_clear_line(secure_broker, tmp_path, unique, case):
    broker, work = secure_broker
    (tmp_path / "wrong").write_text("not-the-password")
    override = {"wrong password": {"kafka.sasl_password_file": str(tmp_path / "wrong")},
                "untrusted certificate": {"kafka.ssl_cafile": str(work / "tls" / "other-ca.pem")},
                "plaintext client": {"kafka.security_protocol": "PLAINTEXT"}}[case]
    sets = [f"--set={s}" for s in settings(broker, work, **override)]
    done = cli("simulate", *sets, "--set", f"run.state_dir={tmp_path}", "--duration", "1")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    expected = {"wrong password": "refused the login of 'admin' (SCRAM-SHA-512)",
                "untrusted certificate": "presented a certificate that kafka.ssl_cafile",
                "plaintext client": "speaks TLS, not plaintext"}[case]
    assert last.startswith("edgestream simulate: ") and expected in last, done.stderr[-2000:]
    assert "not-the-password" not in done.stdout + done.stderr
    assert (work / "admin.password").read_text() not in done.stdout + done.stderr  # never printed


def test_roles_devices_write_their_own_topics_only_and_strangers_read_nothing(
        secure_broker, tmp_path, unique, as_user):
    broker, work = secure_broker
    state, creds = tmp_path / "state", tmp_path / "creds"
    admin_cfg = job(unique, state, *settings(broker, work))
    as_user(admin_cfg)
    done = acl.apply(broker.bootstrap, admin_cfg, creds)
    assert done["users"] == 4 and done["acls"] == sum(len(g.operations) for g in acl.job_grants(admin_cfg))
    first, second = admin_cfg.devices.device_ids()
    workers = acl.workers_user(admin_cfg)

    # A worker with the workers' principal trains on what the devices send.
    worker_sets = settings(broker, work, workers, creds / f"{workers}.password")
    (tmp_path / "job.json").write_text(json.dumps(admin_cfg.to_dict()))
    w0 = start_worker_cli(tmp_path / "job.json", "w0", state, tmp_path / "w0.log",
                          *(f"--set={s}" for s in worker_sets))
    try:
        info = w0.wait_ready(90, "w0 ready with its restricted principal")

        # Device `first` may write its own topic; the other device's records are refused and counted.
        device_cfg = job(unique, state, *settings(broker, work, first, creds / f"{first}.password"))
        as_user(device_cfg)
        report = device_writes_only_its_own(device_cfg, broker.bootstrap, first, second, 3.0)
        # Nor may a device write an update topic.
        with pytest.raises(KafkaError, match="TopicAuthorization"):
            _send(broker.bootstrap, f"gradients.{admin_cfg.job.name}")

        # A stranger (another device's principal) cannot read the gradients.
        stranger_cfg = job(unique, state, *settings(broker, work, second, creds / f"{second}.password"))
        as_user(stranger_cfg)
        with pytest.raises(KafkaError, match="Authorization"):
            _read(broker.bootstrap, f"gradients.{admin_cfg.job.name}", group=f"edgestream-{admin_cfg.job.name}-w9")

        # The run is unaffected: the worker trains on every record device `first` sent.
        def trained() -> float:
            with urllib.request.urlopen(info["metrics"], timeout=2) as reply:
                text = reply.read().decode()
            return sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("edgestream_trained_records_total{"))

        wait_until(lambda: trained() >= report.records[first], 90,
                   f"w0 to train the {report.records[first]} records of {first}")
    finally:
        code = w0.stop(timeout_s=60)
    assert code == 0, (tmp_path / "w0.log").read_text()[-3000:]
    accounting = json.loads((state / "workers" / "w0" / "accounting.json").read_text())["devices"]
    assert accounting[first]["records_in"] == accounting[first]["consumed"] == report.records[first]


def test_run_starts_its_workers_as_the_workers_principal(secure_broker, tmp_path, unique, as_user):
    broker, work = secure_broker
    state, creds = tmp_path / "state", tmp_path / "creds"
    admin_cfg = job(unique, state, *settings(broker, work))
    as_user(admin_cfg)
    acl.apply(broker.bootstrap, admin_cfg, creds)
    workers = acl.workers_user(admin_cfg)
    cfg = job(unique, state, *settings(broker, work), "run.duration_s=4",
              f"run.workers_password_file={creds / f'{workers}.password'}")

    result = run_job(cfg, broker.bootstrap, console=quiet(), live=False)

    # The worker loaded a job logged in as the workers' principal, and under its ACLs alone
    # trained on every record the devices (the admin, here) sent.
    worker_job = json.loads((state / "job.json").read_text())["kafka"]
    assert (worker_job["sasl_username"], worker_job["sasl_password_file"]) == (
        workers, str((creds / f"{workers}.password").resolve()))
    assert result.balanced and result.deaths == []
    assert result.training["w0"]["trained_records"] == sum(result.produced.values()) > 0


def device_writes_only_its_own(device_cfg, bootstrap: str, own: str, other: str, seconds: float):
    """Simulate both devices of ``device_cfg`` (logged in as device ``own``) for ``seconds``:
    ``own``'s records are written, every one of ``other``'s refused and counted. Returns the
    simulation's report."""
    report = simulate(device_cfg, bootstrap, seconds)
    assert report.records[own] > 0
    assert report.records[other] == 0
    assert set(report.refused) == {other} and report.refused[other]["TopicAuthorizationFailedError"] > 0
    return report


def _send(bootstrap: str, topic: str) -> None:
    prod = producer(bootstrap)
    try:
        prod.send(topic, b"x").get(timeout=20)
    finally:
        prod.close(timeout=5)


def _read(bootstrap: str, topic: str, group: str) -> None:
    cons = consumer(bootstrap, topic, group_id=group, consumer_timeout_ms=5000)
    try:
        for _ in cons:
            break
    finally:
        cons.close()
