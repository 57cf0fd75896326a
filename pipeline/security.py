"""How this process's Kafka clients authenticate: TLS and SASL/SCRAM (docs/security.md).

One ``ClientSecurity`` per process, set once from the job's ``kafka.*`` keys (``use``)
and read by every client factory: kafka-python (``kafka_python()``), aiokafka
(``aiokafka()``) and Faust (``faust_credentials()``). The SASL password is read from its
file (``kafka.sasl_password_file``) or ``EDGESTREAM_KAFKA_PASSWORD`` when a client is
made; it is never stored in the configuration, printed or logged (``repr`` hides it).

``preflight`` checks the TLS handshake and the login in seconds, with one clear line for
the usual mistakes: an untrusted certificate, a wrong password, a plaintext client
against a TLS listener.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import socket
import ssl
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgestream.deploy.kafka import wire
from edgestream.deploy.kafka.wire import (
    ProtocolError,  # raised here, caught as security.ProtocolError
)

#: The environment variable that holds the SASL password when no file is configured.
PASSWORD_ENV = "EDGESTREAM_KAFKA_PASSWORD"


class SecurityError(RuntimeError):
    """The cluster refused this client's TLS or login; the message says what to change."""


@dataclass(frozen=True)
class ClientSecurity:
    protocol: str = "PLAINTEXT"
    cafile: str = ""
    certfile: str = ""
    keyfile: str = ""
    mechanism: str = "SCRAM-SHA-512"
    username: str = ""
    password_file: str = ""
    #: Where the password comes from when there is no file (tests pass their own).
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ), repr=False, compare=False)

    @classmethod
    def from_config(cls, kafka: Any, env: dict[str, str] | None = None) -> ClientSecurity:
        """From a ``KafkaSection`` (``cfg.kafka``)."""
        return cls(kafka.security_protocol, kafka.ssl_cafile, kafka.ssl_certfile, kafka.ssl_keyfile,
                   kafka.sasl_mechanism, kafka.sasl_username, kafka.sasl_password_file,
                   dict(os.environ) if env is None else dict(env))

    @property
    def tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    @property
    def sasl(self) -> bool:
        return self.protocol == "SASL_SSL"

    def password(self) -> str:
        """The SASL password (``SecurityError`` naming where it was looked for if none)."""
        if self.password_file:
            try:
                value = Path(self.password_file).read_text().strip()
            except OSError as exc:
                raise SecurityError(f"cannot read kafka.sasl_password_file {self.password_file}: "
                                    f"{exc.strerror or exc}") from None
            if not value:
                raise SecurityError(f"kafka.sasl_password_file {self.password_file} is empty")
            return value
        value = self.env.get(PASSWORD_ENV, "")
        if not value:
            raise SecurityError(f"kafka.security_protocol='SASL_SSL' needs a password: set "
                                f"kafka.sasl_password_file or the environment variable {PASSWORD_ENV}")
        return value

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client TLS context trusting ``cafile`` (hostname checked), with the client
        certificate if one is configured; None for PLAINTEXT."""
        if not self.tls:
            return None
        try:
            context = ssl.create_default_context(cafile=self.cafile)
            if self.certfile:
                context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise SecurityError(f"cannot load the TLS files (kafka.ssl_cafile={self.cafile!r}"
                                f"{', kafka.ssl_certfile=' + repr(self.certfile) if self.certfile else ''}): "
                                f"{exc}") from None
        return context

    # --- what each client library takes -------------------------------------------------
    def kafka_python(self) -> dict[str, Any]:
        """Keyword arguments for kafka-python's clients."""
        if not self.tls:
            return {}
        out: dict[str, Any] = {"security_protocol": self.protocol, "ssl_context": self.ssl_context()}
        if self.sasl:
            out.update(sasl_mechanism=self.mechanism, sasl_plain_username=self.username,
                       sasl_plain_password=self.password())
        return out

    def aiokafka(self) -> dict[str, Any]:
        """Keyword arguments for aiokafka's clients: the same names as kafka-python's."""
        return self.kafka_python()

    def faust_credentials(self) -> Any:
        """Faust's ``broker_credentials`` (None for PLAINTEXT)."""
        if not self.tls:
            return None
        import faust

        if self.sasl:
            return faust.SASLCredentials(username=self.username, password=self.password(),
                                         ssl_context=self.ssl_context(), mechanism=self.mechanism)
        return faust.SSLCredentials(self.ssl_context())

    def __repr__(self) -> str:  # never the password; the file's path only
        return (f"ClientSecurity(protocol={self.protocol!r}, cafile={self.cafile!r}, "
                f"username={self.username!r}, password_file={self.password_file!r})")


#: This process's settings; ``use`` sets them (``cli.options.job_config`` does, for every command).
_current = ClientSecurity()


def use(security: ClientSecurity) -> None:
    global _current
    _current = security


def current() -> ClientSecurity:
    return _current


# --- preflight -----------------------------------------------------------------------------
def preflight(bootstrap: str, security: ClientSecurity | None = None, timeout_s: float = 5.0) -> None:
    """For a TLS cluster: a TLS handshake with the first server that accepts a connection
    (certificate checked against ``cafile``), then, with SASL, a login (a metadata request
    of kafka-python's admin client). Raises ``SecurityError`` with one line saying what to
    change; returns quietly for PLAINTEXT (``kafka_io.check_reachable`` probes that)."""
    security = security or _current
    if not security.tls:
        return
    from edgestream.deploy.kafka.broker import host_port

    context = security.ssl_context()
    assert context is not None
    deadline = time.monotonic() + timeout_s
    problem = ""
    for address in bootstrap.split(","):
        host, port = host_port(address.strip())
        try:
            with socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic())) as raw:
                with context.wrap_socket(raw, server_hostname=host) as sock:
                    if security.sasl:
                        sock.settimeout(max(0.1, deadline - time.monotonic()))
                        refused = scram_login(sock, security.mechanism, security.username, security.password())
                        if refused is not None:
                            raise SecurityError(
                                f"Kafka at {host}:{port} refused the login of {security.username!r} "
                                f"({security.mechanism}): {refused}; check kafka.sasl_username and the password "
                                f"(kafka.sasl_password_file or {PASSWORD_ENV})")
                    return
        except ssl.SSLCertVerificationError as exc:
            raise SecurityError(
                f"the broker at {host}:{port} presented a certificate that kafka.ssl_cafile={security.cafile!r} "
                f"does not trust ({exc.verify_message}): use the CA that signed the brokers' certificates"
            ) from None
        except ssl.SSLError as exc:
            raise SecurityError(f"TLS handshake with {host}:{port} failed ({exc.reason or exc}): is that a TLS "
                                "listener? (kafka.security_protocol)") from None
        except (OSError, ProtocolError) as exc:
            problem = f"{host}:{port}: {getattr(exc, 'strerror', None) or exc}"
    raise SecurityError(f"cannot reach Kafka at {bootstrap}: {problem or 'no server listed'}")


# --- a SCRAM login over the Kafka protocol (RFC 5802; SaslHandshake v1, SaslAuthenticate v1) --
_HASHES = {"SCRAM-SHA-512": "sha512", "SCRAM-SHA-256": "sha256"}
_CLIENT_ID = b"edgestream-preflight"
_MAX_REPLY = 1 << 20  # SASL replies are small: a larger size is not Kafka


def _request(sock: ssl.SSLSocket, api_key: int, version: int, correlation: int, body: bytes) -> bytes:
    """The body of the reply to one request (the socket's own timeout applies)."""
    try:
        return wire.exchange(sock, api_key, version, correlation, body,
                             client_id=_CLIENT_ID, max_size=_MAX_REPLY)
    except wire.ConnectionClosed:
        raise ProtocolError("the broker closed the connection") from None


def _string(data: bytes, at: int) -> tuple[str | None, int]:
    (n,) = struct.unpack(">h", data[at:at + 2])
    if n < 0:
        return None, at + 2
    return data[at + 2:at + 2 + n].decode(errors="replace"), at + 2 + n


def _authenticate(sock: ssl.SSLSocket, correlation: int, payload: bytes) -> tuple[int, str | None, bytes]:
    reply = _request(sock, 36, 1, correlation, struct.pack(">i", len(payload)) + payload)
    (code,) = struct.unpack(">h", reply[:2])
    message, at = _string(reply, 2)
    (n,) = struct.unpack(">i", reply[at:at + 4])
    return code, message, reply[at + 4:at + 4 + max(n, 0)]


def scram_login(sock: ssl.SSLSocket, mechanism: str, username: str, password: str) -> str | None:
    """Log in on ``sock`` (TLS, nothing sent yet); None if the broker accepted, else its reason."""
    name = mechanism.encode()
    reply = _request(sock, 17, 1, 1, struct.pack(">h", len(name)) + name)
    (code,) = struct.unpack(">h", reply[:2])
    if code != 0:
        return f"the broker does not offer {mechanism} (error {code})"
    digest = _HASHES[mechanism]
    user = username.replace("=", "=3D").replace(",", "=2C")
    nonce = base64.b64encode(os.urandom(24)).decode()
    first_bare = f"n={user},r={nonce}"
    code, message, server_first = _authenticate(sock, 2, f"n,,{first_bare}".encode())
    if code != 0:
        return message or f"error {code}"
    fields = dict(item.split("=", 1) for item in server_first.decode().split(",") if "=" in item)
    if not fields.get("r", "").startswith(nonce) or "s" not in fields or "i" not in fields:
        raise ProtocolError("a SCRAM first reply without the client's nonce, salt or iterations")
    salted = hashlib.pbkdf2_hmac(digest, password.encode(), base64.b64decode(fields["s"]), int(fields["i"]))
    client_key = hmac.new(salted, b"Client Key", digest).digest()
    stored_key = hashlib.new(digest, client_key).digest()
    without_proof = f"c=biws,r={fields['r']}"
    auth_message = f"{first_bare},{server_first.decode()},{without_proof}".encode()
    signature = hmac.new(stored_key, auth_message, digest).digest()
    proof = base64.b64encode(bytes(a ^ b for a, b in zip(client_key, signature, strict=True))).decode()
    code, message, _final = _authenticate(sock, 3, f"{without_proof},p={proof}".encode())
    if code != 0:
        return message or f"error {code}"
    return None
