"""The local broker across restarts, the broker data a run leaves, and how a run ends (issue #30,
defects 1, 2 and 8), through the `edgestream` command line on real brokers.

- ``broker start`` after a SIGKILL comes back on the same address with its topics;
  ``--fresh`` empties the data (refused while the broker runs).
- ``run`` against that broker survives a SIGKILL of it mid-stream and a plain
  ``broker start``: exit 0, balanced, the summary's outcome says so, and the run said the
  outage and its end in one line each.
- ``run`` removes the data of the broker it started, unless ``--keep-broker``.
- a broker whose picked port another process binds before its JVM does starts on new
  ports, and its log holds the bind error.
- a drain that ends at its cap still writes the summary (outcome ``drain_timeout``) and
  prints the tables; exit 1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgestream.deploy.kafka import class_archive
from edgestream.deploy.kafka.broker import LocalBroker, metadata_ok, resolve_jars, saved_address
from edgestream.monitoring.scrape import scrape
from edgestream.pipeline.kafka_io import ensure_topics, topic_names
from edgestream.streams.topics import SENSOR_DLQ
from tests.integration.jobs import REPO, cli_at_once, start_cli, stop_session, wait_until

pytestmark = pytest.mark.integration


def cli(*args: str, cwd: Path = REPO, timeout_s: float = 180.0) -> subprocess.CompletedProcess:
    """``edgestream ARGS`` to its end (this checkout, this interpreter)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "edgestream", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


def job_args(unique: str, state: Path, *overrides: str) -> list[str]:
    """A small training job: two devices, two BSP workers, an MLP."""
    sets = [f"job.name=r{unique}", f"run.state_dir={state}", f"devices.ids=a{unique},b{unique}",
            "devices.count=2", "devices.rates_hz=60,40", "devices.message_interval_s=0.1",
            "batcher.window_s=0.25", "batcher.max_batch=64", "workers.count=2", "train.enabled=true",
            "train.model=mlp", "train.lr=0.1", "train.eval_every_s=1", "train.checkpoint_every_steps=10",
            "run.drain_timeout_s=60", *overrides]
    return [arg for value in sets for arg in ("--set", value)]


class Broker:
    """A local broker of ``edgestream broker start --state-dir STATE``."""

    def __init__(self, state: Path) -> None:
        self.state = state

    def start(self, *args: str) -> subprocess.CompletedProcess:
        return cli("broker", "start", "--state-dir", str(self.state), *args)

    def started(self, *args: str) -> str:
        """Start it; its bootstrap address (the last line it prints)."""
        done = self.start(*args)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout.strip().splitlines()[-1]

    def pid(self) -> int:
        return json.loads((self.state / "broker.json").read_text())["pid"]

    def kill(self) -> None:
        """SIGKILL the broker JVM's process group: no controlled shutdown."""
        os.killpg(self.pid(), signal.SIGKILL)

    def stop(self) -> None:
        cli("broker", "stop", "--state-dir", str(self.state), timeout_s=60)


@pytest.fixture
def broker(tmp_path):
    running = Broker(tmp_path / "broker")
    try:
        yield running
    finally:
        running.stop()


def test_broker_start_after_sigkill_comes_back_on_its_address_and_fresh_empties_it(broker):
    address = broker.started()
    # Its JVM maps the cache's class archive (deploy/kafka/class_archive.py; made on first use).
    archive = class_archive.archive_path(resolve_jars())
    assert archive.exists()
    assert f"-XX:SharedArchiveFile={archive}".encode() in Path(f"/proc/{broker.pid()}/cmdline").read_bytes()
    topic = SENSOR_DLQ  # a dead-letter dump of a later run must not show this broker's old letters
    ensure_topics(address, {topic: "dlq"})

    broker.kill()
    wait_until(lambda: cli("broker", "status", "--state-dir", str(broker.state)).returncode == 1, 30,
               "the killed broker to be down")
    again = broker.start()
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.strip().splitlines()[-1] == address  # same port, not a new free one
    assert topic in topic_names(address)  # same data

    refused = broker.start("--fresh")
    assert refused.returncode != 0
    message = (refused.stdout + refused.stderr).strip()
    assert "is running; stop it first" in message and len(message.splitlines()) == 1
    assert topic in topic_names(address)  # nothing removed by the refused --fresh

    broker.stop()
    assert broker.started() == address and topic in topic_names(address)  # stop/start keeps both
    broker.stop()
    fresh_address = broker.started("--fresh")
    assert topic not in topic_names(fresh_address)


def test_a_run_survives_a_broker_sigkill_and_a_plain_broker_start(broker, unique, tmp_path):
    began = time.monotonic()
    at: dict[str, float] = {}  # seconds into the test of each step, printed as evidence
    address = broker.started()
    state = tmp_path / "state"
    log = tmp_path / "run.log"
    # Equal rates: BSP holds no records of the faster device at the end.
    run = start_cli(["run", "--bootstrap", address,
                     *job_args(unique, state, "run.duration_s=20", "devices.rates_hz=50,50")], log)
    try:
        endpoints = wait_until(lambda: re.search(r"metrics endpoints:\s*w0 (\S+), w1 (\S+),", log.read_text()),
                               120, "the run to start streaming")
        urls = {"w0": endpoints.group(1), "w1": endpoints.group(2)}

        def trained() -> bool:
            scrapes = {w: scrape(url) for w, url in urls.items()}
            return all(s is not None and s.get("edgestream_steps_total", worker=w) >= 3 for w, s in scrapes.items())

        at["streaming"] = time.monotonic() - began
        wait_until(trained, 60, "both workers to train a few steps")
        broker.kill()
        at["broker killed"] = time.monotonic() - began
        wait_until(lambda: f"run: Kafka at {address} unreachable" in log.read_text(), 30,
                   "the run to say the broker is unreachable")
        at["outage said"] = time.monotonic() - began
        assert broker.started() == address  # a plain `broker start`: the same address
        at["broker back"] = time.monotonic() - began
        code = run.wait(timeout=180)
        at["run ended"] = time.monotonic() - began
    finally:
        if run.poll() is None:
            stop_session(run)
    output = log.read_text()
    print(output[-6000:])
    print("seconds into the test: " + ", ".join(f"{what} {t:.0f}" for what, t in at.items()))
    assert code == 0, output[-3000:]
    summary = json.loads((state / "summary.json").read_text())
    assert summary["outcome"] == "balanced" and summary["balanced"]
    assert all(summary["accounting"][d]["records_in"] == n for d, n in summary["produced"].items())
    assert sum(summary["produced"].values()) > 0
    assert output.count(f"run: Kafka at {address} unreachable") == 1
    assert f"run: Kafka at {address} is reachable again" in output
    simulation = json.loads((state / "simulation.json").read_text())
    assert simulation["refused"] == {}  # the simulator kept the records for the restarted broker


def test_run_removes_the_data_of_the_broker_it_started_unless_kept(tmp_path, unique):
    # Two runs at once, each in a directory without a running local broker
    # (.edgestream/broker), so each starts its own: one plain, one with --keep-broker.
    dirs = {keep: tmp_path / ("kept" if keep else "removed") for keep in (False, True)}
    runs = [(["run", *job_args(unique, dirs[keep] / "state", "train.enabled=false", "run.duration_s=3"),
              *(["--keep-broker"] if keep else [])], dirs[keep]) for keep in (False, True)]
    for directory in dirs.values():
        directory.mkdir()
    removed, kept = cli_at_once(runs, dict(os.environ, PYTHONPATH=str(REPO)))
    for done in (removed, kept):
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for keep, done in ((False, removed), (True, kept)):
        state = dirs[keep] / "state"
        left = sorted(p.name for p in state.glob("broker-*"))
        if keep:
            assert len(left) == 1 and (state / left[0] / "data").is_dir()
            assert f"the run's broker data is kept in {state / left[0]}" in done.stdout.replace("\n", "")
        else:
            assert left == []
        assert json.loads((state / "summary.json").read_text())["outcome"] == "balanced"


def test_a_port_taken_before_the_jvm_binds_it_gives_a_picked_port_broker_new_ones(tmp_path):
    broker = LocalBroker(tmp_path / "broker")
    taken = broker.controller_port
    # Bound but not listening: the pre-start check (a connect) finds the port free, the JVM's
    # bind does not, as when another run or a client's ephemeral port takes it in between.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        try:
            broker.start()
            assert broker.controller_port != taken
            assert saved_address(broker.work_dir)["controller_port"] == broker.controller_port
            assert "Address already in use" in broker.log_file.read_text(errors="replace")
            assert metadata_ok(broker.bootstrap, timeout_s=5.0)
        finally:
            broker.stop()


def test_a_drain_at_its_cap_writes_the_summary_and_prints_the_tables(kafka_bootstrap, unique, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "summary.json").write_text('{"outcome": "a previous run"}')
    # 400 records/s per device against at most max_batch / window_s = 256 records/s trained:
    # records are still unread when streaming ends, and the drain may wait 0.5 s in all.
    done = cli("run", "--bootstrap", kafka_bootstrap,
               *job_args(unique, state, "devices.rates_hz=400,400", "run.duration_s=4", "run.drain_max_s=0.5"))
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert "final accounting" in output and "training summary" in output
    assert "the drain timed out: the drain reached run.drain_max_s=0.5s" in output.replace("\n", "")
    summary = json.loads((state / "summary.json").read_text())
    assert summary["outcome"] == "drain_timeout"
    assert "run.drain_max_s" in summary["reason"]
    assert set(summary["accounting"]) == {f"a{unique}", f"b{unique}"}


def test_an_interrupted_run_prints_the_tables_writes_its_outcome_and_removes_its_broker(tmp_path, unique):
    state = tmp_path / "state"
    log = tmp_path / "run.log"
    # cwd without a running local broker: the run starts its own (STATE/broker-*)
    run = start_cli(["run", *job_args(unique, state, "train.enabled=false", "run.duration_s=120")], log,
                    cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        wait_until(lambda: "metrics endpoints:" in log.read_text(), 120, "the run to start streaming")
        assert len(list(state.glob("broker-*"))) == 1
        os.kill(run.pid, signal.SIGINT)  # Ctrl-C (the run's own process; it stops the others)
        code = run.wait(timeout=120)
    finally:
        if run.poll() is None:
            stop_session(run)
    output = log.read_text()
    assert code == 130, output[-3000:]
    assert "final accounting" in output and "outcome: interrupted" in output
    summary = json.loads((state / "summary.json").read_text())
    assert summary["outcome"] == "interrupted"
    assert set(summary["accounting"]) == {f"a{unique}", f"b{unique}"} and summary["missing"] == {}
    assert list(state.glob("broker-*")) == []
