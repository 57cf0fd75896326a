"""The pure parts of a run in the edge testbed (pipeline/testbed_run.py): where each process
of a run starts, with which command, where its metrics are scraped, what the targets file
lists, and the table of hosts."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgestream.job.config import load_config
from edgestream.monitoring.prometheus import run_targets
from edgestream.pipeline.launcher import LAUNCH_ENV
from edgestream.pipeline.run import start_worker_process
from edgestream.pipeline.testbed_run import (
    DEVICES_HOST,
    bootstrap_of,
    broker_hosts,
    host_of,
    host_rows,
    metrics_override,
    process_placement,
    uses_testbed,
)
from edgestream.pipeline.worker import SERVER_NAME

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "testbed.toml"


@dataclass
class FakeHost:
    name: str
    kind: str
    netns: str
    address: str
    link: str


class FakeTestbed:
    """The two things ``process_placement`` reads of a testbed: its hosts and exec prefixes."""

    def __init__(self) -> None:
        self.hosts = {
            "w0": FakeHost("w0", "worker", "es-t1-w0", "10.77.0.10", ""),
            "w1": FakeHost("w1", "worker", "es-t1-w1", "10.77.0.11", "1mbit"),
            "server": FakeHost("server", "server", "es-t1-server", "10.77.0.5", ""),
            "devices": FakeHost("devices", "devices", "es-t1-devices", "10.77.0.6", ""),
            "b0": FakeHost("b0", "broker", "es-t1-b0", "10.77.0.2", ""),
        }
        self.entered: list[str] = []

    def exec_prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[name].netns]

    def enter(self, name: str) -> None:
        self.entered.append(name)


def test_each_process_runs_on_its_own_host_and_the_server_on_the_server_host():
    assert host_of("w3") == "w3"
    assert host_of(SERVER_NAME) == "server"
    assert broker_hosts(3) == ["b0", "b1", "b2"]


def test_bootstrap_lists_every_broker_address_on_the_client_port():
    assert bootstrap_of(["10.77.0.2"]) == "10.77.0.2:9092"
    assert bootstrap_of(["10.77.0.2", "10.77.0.3", "10.77.0.4"]) == "10.77.0.2:9092,10.77.0.3:9092,10.77.0.4:9092"
    with pytest.raises(ValueError, match="at least one broker"):
        bootstrap_of([])


def test_a_worker_starts_under_its_namespace_with_metrics_on_its_host_address():
    tb = FakeTestbed()
    prefix, extra = process_placement(tb, "w1")
    assert prefix == ["ip", "netns", "exec", "es-t1-w1"]
    assert extra == ["--set", "workers.metrics_host=10.77.0.11"]
    prefix, extra = process_placement(tb, SERVER_NAME)
    assert prefix[-1] == "es-t1-server" and extra == metrics_override("10.77.0.5")


def test_the_worker_command_is_the_loopback_one_with_the_prefix_before_and_the_override_after(tmp_path,
                                                                                             monkeypatch):
    seen: list[list[str]] = []

    class Recorder:
        def __init__(self, argv, **kwargs):
            seen.append(list(argv))

    class Launcher:
        def start(self, argv, log_path):
            seen.append(["<forked>", *argv])

    monkeypatch.setattr("edgestream.pipeline.run.subprocess.Popen", Recorder)
    monkeypatch.setattr("edgestream.pipeline.run.launcher", Launcher)
    job = tmp_path / "job.json"
    monkeypatch.setenv(LAUNCH_ENV, "exec")
    start_worker_process(job, "w1", "10.77.0.2:9092", 0, tmp_path / "w1.log")
    prefix, extra = process_placement(FakeTestbed(), "w1")
    # With a prefix the command is exec'd under it whether or not forking is on.
    monkeypatch.delenv(LAUNCH_ENV)
    start_worker_process(job, "w1", "10.77.0.2:9092", 0, tmp_path / "w1.log", prefix=prefix, extra_args=extra)
    start_worker_process(job, "w1", "10.77.0.2:9092", 0, tmp_path / "w1.log")
    plain, placed, forked = seen
    command = ["worker", "--worker", "w1", "--job", str(job), "--bootstrap", "10.77.0.2:9092", "--metrics-port", "0"]
    assert plain == [sys.executable, "-m", "edgestream", *command]
    assert placed == [*prefix, *plain, *extra]
    assert forked == ["<forked>", *command]  # the same command, forked from the preloaded launcher


def test_the_targets_file_lists_each_process_at_its_host_address():
    urls = {"w0": "http://10.77.0.10:41000/metrics", "w1": "http://10.77.0.11:41001/metrics",
            "server": "http://10.77.0.5:41002/metrics"}
    targets = run_targets(urls, simulator_url="http://127.0.0.1:42000/metrics")
    assert ("worker", "10.77.0.11:41001", {"worker": "w1"}) in targets
    assert ("server", "10.77.0.5:41002", {}) in targets
    assert ("simulator", "127.0.0.1:42000", {}) in targets  # served by the orchestrator, root namespace


def test_the_host_table_says_what_runs_where_and_on_which_link(tmp_path):
    cfg = load_config(overrides=["workers.count=2", "devices.count=4", f"run.state_dir={tmp_path}"], env={})
    rows = {r.host: r for r in host_rows(cfg, FakeTestbed().hosts, server=False)}
    assert rows["w1"].link == "1mbit" and rows["w0"].link == "unshaped"
    assert rows["w0"].runs.startswith("worker w0 (") and rows["w1"].address == "10.77.0.11"
    assert rows[DEVICES_HOST].runs == "simulators (4 devices)"
    assert rows["b0"].runs.startswith("Kafka node :9092")
    assert rows["server"].runs == "-"


def test_a_job_without_a_testbed_section_runs_on_loopback(tmp_path):
    cfg = load_config(overrides=[f"run.state_dir={tmp_path}"], env={})
    assert uses_testbed(cfg) is False


def test_without_root_the_run_stops_before_anything_exists_and_says_what_to_do(tmp_path, monkeypatch):
    from edgestream.cli.errors import failure
    from edgestream.pipeline.testbed_run import TestbedUnavailable, open_testbed

    monkeypatch.setattr("edgestream.pipeline.testbed_run.os.geteuid", lambda: 1000)
    cfg = load_config(EXAMPLE, [f"run.state_dir={tmp_path}"], env={})
    with pytest.raises(TestbedUnavailable) as failed, open_testbed(cfg):
        pass
    code, line, _ = failure(failed.value, argparse_namespace("run"))
    assert code == 1 and line.startswith("the edge testbed creates network namespaces") and "root" in line


def test_a_testbed_job_refuses_an_outside_cluster(capsys):
    from edgestream.cli.main import main

    code = main(["run", "--job", str(EXAMPLE), "--bootstrap", "127.0.0.1:9"])
    assert code == 2
    assert "runs its own brokers in the testbed" in capsys.readouterr().err


def argparse_namespace(command: str):
    import argparse

    return argparse.Namespace(command=command)


def test_a_ready_worker_that_cannot_be_scraped_is_left_running(tmp_path, monkeypatch):
    """A worker host partitioned in the testbed: its process lives, its /metrics does not
    answer. The supervisor judges a ready process by its exit alone: no death, no restart."""
    import json

    import edgestream.pipeline.run as run_module
    from edgestream.pipeline.run import READY_TIMEOUT_S, RunContext

    class Proc:
        pid = 4242

        def poll(self):
            return None  # alive throughout

    class Ready:
        def get(self, name, default=0.0, **labels):
            return 1.0 if name == "edgestream_worker_ready" else default

    def start(cfg_path, name, bootstrap, port, log_path, **placement):
        endpoint = tmp_path / "workers" / name / "endpoint.json"
        endpoint.parent.mkdir(parents=True, exist_ok=True)
        endpoint.write_text(json.dumps({"metrics": f"http://10.77.0.1{name[-1]}:1/metrics"}))
        return Proc()

    reachable = {"yes": True}
    now = {"t": 100.0}
    monkeypatch.setattr(run_module, "start_worker_process", start)
    monkeypatch.setattr(run_module, "scrape", lambda url: Ready() if reachable["yes"] else None)
    monkeypatch.setattr(RunContext, "publish_targets", lambda self: None)
    cfg = load_config(overrides=["devices.count=2", "workers.count=2", f"run.state_dir={tmp_path}"], env={})
    ctx = RunContext(cfg, "10.77.0.7:9092", tmp_path, tmp_path / "job.json", [], clock=lambda: now["t"],
                     started_at=now["t"], testbed=FakeTestbed())
    for name in cfg.worker_names():
        ctx.start(name)
    ctx.supervise()
    assert ctx.all_ready()

    reachable["yes"] = False  # cut off
    for _ in range(3):
        now["t"] += READY_TIMEOUT_S
        ctx.supervise()

    assert ctx.deaths == [] and ctx.restarts == [] and ctx.all_ready()
