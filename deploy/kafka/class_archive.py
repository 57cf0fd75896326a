"""A class-data-sharing archive of the Kafka broker's classes, so a JVM starts faster.

A broker JVM spends a good part of its start-up loading and verifying the same few
thousand classes from the jars. The JDK can map them from an archive instead (class data
sharing, ``-XX:SharedArchiveFile``); measured here on a loaded 2-core machine, a local
broker's start (storage format + broker up) went from 14.6-18.2 s to 5.9-11.0 s with it.

The archive is made once per jar directory and JDK, by a broker started with
``-XX:ArchiveClassesAtExit`` and stopped cleanly (``broker.ensure_class_archive``). It
lives beside the jars as ``classes-<jdk key>.jsa``; a new JDK gets a new key, so an archive
is never used by another JDK (which would refuse it and start without). An archive that
could not be made leaves ``classes-<jdk key>.failed`` with the reason, and brokers start
without one. A failure may be passing (a machine too busy for the archiving broker to start
in time, a killed run), so the archive is tried again an hour later, three times in all;
removing that file tries again at once. ``EDGESTREAM_KAFKA_CLASS_ARCHIVE=0`` turns the
archive off.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

#: Environment variable: ``0`` starts every broker JVM without the archive.
ENV = "EDGESTREAM_KAFKA_CLASS_ARCHIVE"
#: After a failed attempt the next comes this much later, up to ``MAX_ATTEMPTS`` in all.
RETRY_AFTER_S = 3600.0
MAX_ATTEMPTS = 3


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "no", "off")


def jdk_key() -> str:
    """A short key of the ``java`` on PATH (its resolved path, size and modification time):
    another JDK, or the same one upgraded, gets another key."""
    java = shutil.which("java")
    if java is None:
        return "nojava"
    real = Path(java).resolve()
    stat = real.stat()
    return hashlib.sha256(f"{real}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]


def archive_path(jar_dir: Path) -> Path:
    """Where the archive of ``jar_dir``'s classes for this JDK is (or will be)."""
    return jar_dir / f"classes-{jdk_key()}.jsa"


def failed_path(archive: Path) -> Path:
    """The marker an archive that could not be made leaves (with the reason)."""
    return archive.with_suffix(".failed")


def failures(marker: Path) -> tuple[int, float]:
    """How many attempts failed and when the last did (epoch seconds), from ``marker``
    ((0, 0.0) without one; a marker in another form counts as one attempt at its mtime)."""
    try:
        text = marker.read_text(encoding="utf-8")
    except FileNotFoundError:
        return 0, 0.0
    try:
        data = json.loads(text)
        return int(data["attempts"]), float(data["at"])
    except (ValueError, KeyError, TypeError):
        return 1, marker.stat().st_mtime


def may_try(marker: Path, now: float | None = None) -> bool:
    """Whether to try making the archive: no failure yet, or fewer than ``MAX_ATTEMPTS``
    and the last at least ``RETRY_AFTER_S`` ago."""
    attempts, at = failures(marker)
    now = time.time() if now is None else now
    return attempts == 0 or (attempts < MAX_ATTEMPTS and now - at >= RETRY_AFTER_S)


def record_failure(marker: Path, reason: str, now: float | None = None) -> None:
    """Count a failed attempt in ``marker``, with its reason."""
    attempts, _ = failures(marker)
    now = time.time() if now is None else now
    retry = "no more attempts (remove this file to try again)" if attempts + 1 >= MAX_ATTEMPTS else \
        f"tried again after {RETRY_AFTER_S:.0f} s"
    marker.write_text(json.dumps({"reason": reason, "attempts": attempts + 1, "at": now, "next": retry}) + "\n",
                      encoding="utf-8")


def java_options(archive: Path | None) -> list[str]:
    """The JVM options that map ``archive`` (none without one). CDS messages stay out of
    the broker's output: a refused archive only means a slower start."""
    if archive is None:
        return []
    return [f"-XX:SharedArchiveFile={archive}", "-Xlog:cds=off", "-Xlog:cds+dynamic=off"]


@contextlib.contextmanager
def creation_lock(jar_dir: Path) -> Iterator[None]:
    """Held while one process makes the archive; others wait, then find it made."""
    with open(jar_dir / "classes.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
