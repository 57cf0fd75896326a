"""Certificates for a local TLS Kafka listener, made with the ``openssl`` command.

``make_pki(dir, hosts)`` writes a CA (``ca.pem``, its key ``ca.key``), a broker
certificate for ``hosts`` (IP addresses and names in its subjectAltName; ``broker.pem``;
every node of a local cluster presents it, so ``hosts`` are all the nodes' addresses)
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
    def broker_cert(self) -> Path:
        return self.directory / "broker.pem"

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


def _san(host: str) -> str:
    try:
        return f"IP:{ipaddress.ip_address(host)}"
    except ValueError:
        return f"DNS:{host}"


def certificate_hosts(pem: Path) -> list[str]:
    """The IP addresses and DNS names in the subjectAltName of the certificate ``pem``."""
    exe = shutil.which("openssl")
    if exe is None:
        raise PkiError("reading a certificate needs the `openssl` command (Debian: apt-get install openssl)")
    done = subprocess.run([exe, "x509", "-in", str(pem), "-noout", "-ext", "subjectAltName"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise PkiError(f"openssl cannot read the certificate {pem}: {done.stderr.strip()[-500:]}")
    hosts = []
    for entry in done.stdout.replace("\n", ",").split(","):
        kind, sep, value = entry.strip().partition(":")
        if sep and kind in ("IP Address", "DNS"):
            hosts.append(value.strip())
    return hosts


def uncovered(pem: Path, hosts: list[str]) -> list[str]:
    """The ``hosts`` (addresses or names a client or a peer connects to) that the
    certificate ``pem`` does not name in its subjectAltName: TLS hostname checks fail
    for them."""
    named = {_san(host) for host in certificate_hosts(pem)}
    return [host for host in dict.fromkeys(hosts) if _san(host) not in named]


def make_pki(directory: Path, hosts: list[str]) -> Pki:
    """Make (or keep, if already made) the CA, broker and client certificates in ``directory``.

    The broker certificate names every one of ``hosts`` in its subjectAltName (every
    address a node of the cluster advertises or binds its controller listener to). One
    made earlier for fewer hosts is issued again by the same CA for all of them (the
    ones it named and ``hosts``), so clients keep trusting ``ca.pem``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    made = pki.broker_keystore.exists() and pki.client_cert.exists() and pki.other_ca.exists()
    if made and not uncovered(pki.broker_cert, hosts):
        return pki
    if made:
        hosts = [*certificate_hosts(pki.broker_cert), *hosts]
    else:
        _ca("ca", directory)
        _ca("other-ca", directory)
        _signed("client", "edgestream client", "clientAuth", [], directory)
    sans = [_san(host) for host in dict.fromkeys(hosts)]
    _signed("broker", "edgestream broker", "serverAuth,clientAuth", sans, directory)  # client of its controller too
    # Kafka's PEM keystore file: the private key (PKCS#8, unencrypted) then the certificate.
    keystore = directory / "broker-keystore.pem.tmp"
    keystore.write_text((directory / "broker.key").read_text() + pki.broker_cert.read_text())
    os.chmod(keystore, 0o600)
    keystore.replace(pki.broker_keystore)
    return pki
