"""Certificates for a local TLS Kafka listener, made with the ``openssl`` command.

``make_pki(dir, hosts)`` writes a CA (``ca.pem``, its key ``ca.key``), a broker
certificate for ``hosts`` (IP addresses and names in its subjectAltName; ``broker.pem``)
with its key in one PEM file (``broker-keystore.pem``: key then certificate, what Kafka's
PEM keystore reads),
and a client certificate (``client.pem``, ``client.key``) for mutual TLS. Keys are
unencrypted PKCS#8, readable by the owner only. An ``other-ca.pem`` (a CA nobody uses)
lets tests present an untrusted certificate.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: Validity of every certificate made here (days): a test run's, not a deployment's.
DAYS = 30


class PkiError(RuntimeError):
    """openssl is missing or refused to make a certificate."""


@dataclass(frozen=True)
class Pki:
    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def broker_keystore(self) -> Path:
        return self.directory / "broker-keystore.pem"

    @property
    def client_cert(self) -> Path:
        return self.directory / "client.pem"

    @property
    def client_key(self) -> Path:
        return self.directory / "client.key"

    @property
    def other_ca(self) -> Path:
        return self.directory / "other-ca.pem"


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise PkiError("the TLS listener needs the `openssl` command (Debian: apt-get install openssl)")
    done = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise PkiError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")


def _key(name: str, cwd: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", name, cwd=cwd)
    os.chmod(cwd / name, 0o600)


def _ca(stem: str, cwd: Path) -> None:
    _key(f"{stem}.key", cwd)
    _openssl("req", "-x509", "-new", "-key", f"{stem}.key", "-sha256", "-days", str(DAYS),
             "-subj", f"/CN=edgestream {stem}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-out", f"{stem}.pem", cwd=cwd)


def _signed(stem: str, cn: str, usage: str, sans: list[str], cwd: Path) -> None:
    _key(f"{stem}.key", cwd)
    _openssl("req", "-new", "-key", f"{stem}.key", "-subj", f"/CN={cn}", "-out", f"{stem}.csr", cwd=cwd)
    ext = [f"extendedKeyUsage={usage}", "basicConstraints=CA:FALSE"]
    if sans:
        ext.append("subjectAltName=" + ",".join(sans))
    (cwd / f"{stem}.ext").write_text("\n".join(ext) + "\n")
    _openssl("x509", "-req", "-in", f"{stem}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-sha256", "-days", str(DAYS), "-extfile", f"{stem}.ext", "-out", f"{stem}.pem", cwd=cwd)
    (cwd / f"{stem}.csr").unlink()
    (cwd / f"{stem}.ext").unlink()


def make_pki(directory: Path, hosts: list[str]) -> Pki:
    """Make (or keep, if already made) the CA, broker and client certificates in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    if pki.broker_keystore.exists() and pki.client_cert.exists() and pki.other_ca.exists():
        return pki
    sans = []
    for host in hosts:
        try:
            ipaddress.ip_address(host)
            sans.append(f"IP:{host}")
        except ValueError:
            sans.append(f"DNS:{host}")
    _ca("ca", directory)
    _ca("other-ca", directory)
    _signed("broker", "edgestream broker", "serverAuth,clientAuth", sans, directory)  # client of its controller too
    _signed("client", "edgestream client", "clientAuth", [], directory)
    # Kafka's PEM keystore file: the private key (PKCS#8, unencrypted) then the certificate.
    pki.broker_keystore.write_text((directory / "broker.key").read_text() + (directory / "broker.pem").read_text())
    os.chmod(pki.broker_keystore, 0o600)
    return pki
