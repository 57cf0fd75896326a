"""The broker's class archive made for real (deploy/kafka/class_archive.py): a broker on
a copy of the jar directory archives its classes as it exits, and the JDK accepts the
archive with sharing required (``-Xshare:on`` refuses to start on an unusable one).
(test_broker_restart.py checks that a broker of ``edgestream broker start`` maps the
cache's archive.)"""

from __future__ import annotations

import subprocess

import pytest

from edgestream.deploy.kafka import class_archive
from edgestream.deploy.kafka.broker import ensure_class_archive, resolve_jars

pytestmark = pytest.mark.integration


def test_a_clean_broker_exit_writes_an_archive_the_jdk_accepts(tmp_path, monkeypatch):
    monkeypatch.delenv(class_archive.ENV, raising=False)
    jars = tmp_path / "jars"
    jars.mkdir()
    for jar in resolve_jars().glob("*.jar"):
        (jars / jar.name).symlink_to(jar)

    archive = ensure_class_archive(jars)

    assert archive is not None, [f.read_text() for f in jars.glob("*.failed")]
    assert archive.exists() and archive.stat().st_size > 1_000_000
    assert not list(jars.glob("*.part")) and not list(jars.glob("*.failed"))
    done = subprocess.run(["java", f"-XX:SharedArchiveFile={archive}", "-Xshare:on", "-cp", f"{jars}/*",
                           "kafka.tools.StorageTool", "random-uuid"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(done.stdout.strip()) == 22  # a base64url uuid
