"""Client security settings without a broker: what each client library gets, where the
password comes from, that it is never shown; the job's ACL grants; the SCRAM client."""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct

import pytest

from edgestream.deploy.kafka.tls import make_pki
from edgestream.job.config import ConfigError, load_config
from edgestream.pipeline import acl, security


def kafka_cfg(tmp_path, **keys):
    overrides = [f"kafka.{k}={v}" for k, v in keys.items()]
    return load_config(overrides=overrides, env={}).kafka


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), ["127.0.0.1", "localhost"])


def test_plaintext_gives_every_client_nothing(tmp_path):
    sec = security.ClientSecurity.from_config(kafka_cfg(tmp_path), env={})
    assert sec.kafka_python() == {} and sec.aiokafka() == {} and sec.faust_credentials() is None


def test_sasl_ssl_settings_for_each_client_library(tmp_path, pki):
    (tmp_path / "pw").write_text("s3cret\n")
    sec = security.ClientSecurity.from_config(kafka_cfg(
        tmp_path, security_protocol="SASL_SSL", ssl_cafile=pki.ca, sasl_username="w",
        sasl_password_file=tmp_path / "pw"), env={})
    kp = sec.kafka_python()
    assert (kp["security_protocol"], kp["sasl_mechanism"], kp["sasl_plain_username"], kp["sasl_plain_password"]) \
        == ("SASL_SSL", "SCRAM-SHA-512", "w", "s3cret")
    assert kp["ssl_context"].check_hostname
    assert sec.aiokafka()["sasl_plain_password"] == "s3cret"
    creds = sec.faust_credentials()
    assert (creds.username, creds.password, creds.mechanism.value, creds.protocol.value) == \
        ("w", "s3cret", "SCRAM-SHA-512", "SASL_SSL")
    assert "s3cret" not in repr(sec) and "s3cret" not in repr(creds)


def test_password_from_the_environment_and_clear_errors_without_one(tmp_path, pki):
    cfg = kafka_cfg(tmp_path, security_protocol="SASL_SSL", ssl_cafile=pki.ca, sasl_username="w")
    assert security.ClientSecurity.from_config(cfg, env={security.PASSWORD_ENV: "p"}).password() == "p"
    with pytest.raises(security.SecurityError, match=security.PASSWORD_ENV):
        security.ClientSecurity.from_config(cfg, env={}).password()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(security.SecurityError, match="is empty"):
        security.ClientSecurity(**{**_fields(cfg), "password_file": str(tmp_path / "empty")}).password()
    with pytest.raises(security.SecurityError, match="cannot read"):
        security.ClientSecurity(**{**_fields(cfg), "password_file": str(tmp_path / "missing")}).password()


def _fields(kafka) -> dict:
    sec = security.ClientSecurity.from_config(kafka, env={})
    return {"protocol": sec.protocol, "cafile": sec.cafile, "username": sec.username, "env": {}}


def test_the_password_is_not_in_the_configuration(tmp_path, pki):
    (tmp_path / "pw").write_text("s3cret")
    cfg = load_config(overrides=["kafka.security_protocol=SASL_SSL", f"kafka.ssl_cafile={pki.ca}",
                                 "kafka.sasl_username=w", f"kafka.sasl_password_file={tmp_path / 'pw'}"], env={})
    assert "s3cret" not in str(cfg.to_dict())


@pytest.mark.parametrize(("overrides", "message"), [
    (["kafka.security_protocol=SASL_SSL", "kafka.sasl_username=w"], "needs kafka.ssl_cafile"),
    (["kafka.security_protocol=SASL_SSL", "kafka.ssl_cafile=ca.pem"], "needs kafka.sasl_username"),
    (["kafka.security_protocol=TLS"], "kafka.security_protocol"),
    (["kafka.ssl_certfile=c.pem"], "go together"),
    (["kafka.sasl_mechanism=PLAIN"], "kafka.sasl_mechanism"),
])
def test_inconsistent_settings_are_configuration_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides, env={})


def test_unreadable_tls_files_are_one_line(tmp_path):
    sec = security.ClientSecurity("SSL", str(tmp_path / "none.pem"), env={})
    with pytest.raises(security.SecurityError, match="cannot load the TLS files"):
        sec.kafka_python()


def test_job_grants_keep_devices_to_their_own_topic_and_updates_to_the_workers():
    cfg = load_config(overrides=["job.name=j", "devices.count=2", "devices.ids=d1,d2", "train.enabled=true"],
                      env={})
    grants = acl.job_grants(cfg)
    writes = {(g.user, g.name) for g in grants if "WRITE" in g.operations}
    assert ("d1", "sensors.d1") in writes and ("d1", "sensors.d2") not in writes
    # dead letters: the workers' and the gateway's (the MQTT bridge), never a device's own
    assert {u for u, name in writes if name == "sensors.dlq"} == {"j-workers", "j-devices"}
    assert {u for u, name in writes if name == "gradients.j"} == {"j-workers"}
    assert not any(g.user in ("d1", "d2", "j-devices") and "READ" in g.operations for g in grants)
    groups = [g for g in grants if g.resource == "group"]
    assert [(g.user, g.name, g.prefixed) for g in groups] == [("j-workers", "edgestream-j-", True)]
    assert acl.users(cfg) == ["d1", "d2", "j-devices", "j-workers"]


def test_passwords_are_made_once_with_owner_only_access(tmp_path):
    first = acl.password_for(tmp_path / "creds", "w")
    assert acl.password_for(tmp_path / "creds", "w") == first and len(first) >= 24
    assert (tmp_path / "creds" / "w.password").stat().st_mode & 0o777 == 0o600


class FakeScramBroker:
    """The server side of a SCRAM-SHA-256 exchange over Kafka frames, for ``scram_login``."""

    def __init__(self, password: str) -> None:
        self.salt, self.iterations = b"salt-of-the-user", 4096
        salted = hashlib.pbkdf2_hmac("sha256", password.encode(), self.salt, self.iterations)
        self.stored_key = hashlib.sha256(hmac.new(salted, b"Client Key", "sha256").digest()).digest()
        self.replies: list[bytes] = []
        self.step = 0

    def sendall(self, frame: bytes) -> None:
        (correlation,) = struct.unpack(">i", frame[8:12])
        body = frame[14 + struct.unpack(">h", frame[12:14])[0]:]
        if self.step == 0:  # SaslHandshake
            reply = struct.pack(">hi", 0, 0)
        elif self.step == 1:  # client-first
            self.first_bare = body[4:].decode()[3:]
            self.nonce = self.first_bare.split("r=", 1)[1] + "server"
            self.server_first = f"r={self.nonce},s={base64.b64encode(self.salt).decode()},i={self.iterations}"
            reply = _auth_reply(0, None, self.server_first.encode())
        else:  # client-final: check the proof
            final = body[4:].decode()
            without_proof, proof = final.rsplit(",p=", 1)
            auth = f"{self.first_bare},{self.server_first},{without_proof}".encode()
            signature = hmac.new(self.stored_key, auth, "sha256").digest()
            client_key = bytes(a ^ b for a, b in zip(base64.b64decode(proof), signature, strict=True))
            ok = hashlib.sha256(client_key).digest() == self.stored_key
            reply = _auth_reply(0 if ok else 58, None if ok else "invalid credentials", b"v=x" if ok else b"")
        self.step += 1
        self.replies.append(struct.pack(">i", len(reply) + 4) + struct.pack(">i", correlation) + reply)

    def recv(self, n: int) -> bytes:
        data, self.replies[0] = self.replies[0][:n], self.replies[0][n:]
        if not self.replies[0]:
            self.replies.pop(0)
        return data


def _auth_reply(code: int, message: str | None, payload: bytes) -> bytes:
    text = b"" if message is None else message.encode()
    head = struct.pack(">hh", code, -1 if message is None else len(text)) + text
    return head + struct.pack(">i", len(payload)) + payload + struct.pack(">q", 0)


def test_scram_client_proves_the_right_password_and_reports_a_refusal():
    assert security.scram_login(FakeScramBroker("pw"), "SCRAM-SHA-256", "w", "pw") is None
    assert security.scram_login(FakeScramBroker("pw"), "SCRAM-SHA-256", "w", "wrong") == "invalid credentials"


def test_run_gives_its_workers_the_workers_principal_and_refuses_an_unreadable_password_file(tmp_path):
    from edgestream.job.config import ConfigError, load_config
    from edgestream.pipeline.run import process_config

    secure = ["kafka.security_protocol=SASL_SSL", "kafka.ssl_cafile=/ca.pem", "kafka.sasl_username=admin",
              "kafka.sasl_password_file=/admin.password", "job.name=j1"]
    password = tmp_path / "j1-workers.password"
    password.write_text("secret\n")
    cfg = load_config(overrides=[*secure, f"run.workers_password_file={password}"], env={})

    workers = process_config(cfg)
    assert (workers.kafka.sasl_username, workers.kafka.sasl_password_file) == ("j1-workers", str(password))
    assert (cfg.kafka.sasl_username, cfg.kafka.sasl_password_file) == ("admin", "/admin.password")  # the run's own
    assert workers.kafka.ssl_cafile == "/ca.pem" and process_config(load_config(overrides=secure, env={})).kafka \
        .sasl_username == "admin"
    missing = load_config(overrides=[*secure, f"run.workers_password_file={tmp_path / 'none'}"], env={})
    with pytest.raises(ConfigError, match="not a readable file: `edgestream acl apply --job JOB --password-dir DIR` "
                                          "writes DIR/j1-workers.password"):
        process_config(missing)
    with pytest.raises(ConfigError, match="run.workers_password_file logs the workers in with SCRAM"):
        load_config(overrides=[f"run.workers_password_file={password}"], env={})
