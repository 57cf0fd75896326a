"""A local schema registry (Apicurio Registry, Apache-2.0) for the Avro tests and examples.

Apicurio serves the Confluent-compatible REST API that ``input.schema_registry`` names
(``/apis/ccompat/v7``). ``build`` packages it from Maven Central artefacts with
``deploy/apicurio/pom.xml`` (the only place its version is written) into the user cache,
once per pom hash, as the Kafka jars are resolved; ``LocalSchemaRegistry`` starts it on a
free loopback port with a capped heap, waits until ``/health/ready`` answers, and stops it.
Its storage is in memory: the schemas live as long as the process.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from edgestream.deploy.kafka.broker import cache_root, free_port, stop_pid

POM = Path(__file__).resolve().parent / "apicurio" / "pom.xml"
#: Heap of the registry's JVM (idle RSS is about 200 MB with it).
HEAP = "256m"
#: The Confluent-compatible API under the registry's address.
CCOMPAT_PATH = "/apis/ccompat/v7"


class SchemaRegistryError(RuntimeError):
    """The registry could not be built or did not start: the message says why and what to do."""


def build(cache_dir: Path | None = None) -> Path:
    """The registry's ``quarkus-app`` directory, built into the cache on first use (Maven
    downloads about 200 MB from Maven Central then, a few minutes; later calls return at once)."""
    cache_dir = cache_dir or cache_root()
    key = hashlib.sha256(POM.read_bytes()).hexdigest()[:12]
    target = cache_dir / f"apicurio-{key}"
    if (target / ".complete").exists():
        return target / "target" / "quarkus-app"
    for tool, why in (("mvn", "to build it once from Maven Central"), ("java", "to run it (JDK 17+)")):
        if shutil.which(tool) is None:
            raise SchemaRegistryError(f"'{tool}' is not on PATH: the schema registry needs it {why}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="apicurio-", dir=cache_dir))
    shutil.copy(POM, staging / "pom.xml")
    # The app jar's own application.properties asks for a legacy jar; only -D outranks it.
    proc = subprocess.run(["mvn", "-B", "-q", "-f", str(staging / "pom.xml"), "package",
                           "-Dquarkus.package.type=fast-jar"], capture_output=True, text=True)
    app = staging / "target" / "quarkus-app"
    if proc.returncode != 0 or not (app / "quarkus-run.jar").exists():
        shutil.rmtree(staging, ignore_errors=True)
        raise SchemaRegistryError(f"building the schema registry from Maven Central failed (mvn exit "
                                  f"{proc.returncode}); is Maven Central reachable?\n{(proc.stdout + proc.stderr)[-3000:]}")
    (staging / ".complete").touch()
    try:
        staging.rename(target)
    except OSError:  # another process built it meanwhile; theirs is complete too
        shutil.rmtree(staging, ignore_errors=True)
    return target / "target" / "quarkus-app"


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


class LocalSchemaRegistry:
    """One Apicurio Registry process on 127.0.0.1; its log in ``state_dir``."""

    def __init__(self, state_dir: Path, port: int | None = None) -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The Confluent-compatible API: what ``input.schema_registry`` takes."""
        return self.address + CCOMPAT_PATH

    @property
    def log_file(self) -> Path:
        return self.state_dir / "registry.log"

    def start(self, timeout_s: float = 120.0) -> LocalSchemaRegistry:
        app = build()
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                ["java", f"-Xmx{HEAP}", "-XX:+UseSerialGC", "-Dquarkus.http.host=127.0.0.1",
                 f"-Dquarkus.http.port={self.port}", "-jar", str(app / "quarkus-run.jar")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self.state_dir,
                start_new_session=True, env=dict(os.environ, QUARKUS_LOG_CONSOLE_LEVEL="WARN"))
        deadline = time.monotonic() + timeout_s
        while not _ready(self.address + "/health/ready"):
            if self.proc.poll() is not None:
                raise SchemaRegistryError(f"the schema registry exited with {self.proc.returncode} at start: "
                                          f"{self.log_file.read_text(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise SchemaRegistryError(f"the schema registry did not answer on {self.address} within "
                                          f"{timeout_s:.0f}s (log: {self.log_file})")
            time.sleep(0.2)  # poll interval of a deadline wait
        return self

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the registry's process group; SIGKILL past ``timeout_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        stop_pid(self.proc.pid, timeout_s)
        self.proc.poll()

    def __enter__(self) -> LocalSchemaRegistry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
