"""`edgestream run` in the edge testbed (root): one short run with every process on its own
host (pipeline/testbed_run.py). The long fault runs are in tests/chaos (make chaos)."""

from __future__ import annotations

import json
import random
import urllib.parse
from pathlib import Path

import pytest

from edgestream.deploy.testbed.plan import HOST_IF
from edgestream.deploy.testbed.testbed import read_qdisc
from edgestream.monitoring.prometheus import file_sd_path
from edgestream.pipeline.run import run_job
from edgestream.pipeline.testbed_run import open_testbed
from tests.integration.jobs import quiet, show, train_job

pytestmark = pytest.mark.integration


def sent_by(testbed, host: str) -> int:
    """Bytes the host has sent over its veth: what the bridge end received (root namespace)."""
    bridge_if = testbed.plan.host(host).bridge_if
    return int(Path(f"/sys/class/net/{bridge_if}/statistics/rx_bytes").read_text())


def test_a_run_in_the_testbed_places_every_process_on_its_host_and_balances(unique, state_dir):
    subnet = f"10.78.{2 * random.randrange(10, 120)}.0/24"  # its own block, beside other testbeds
    cfg = train_job(unique, state_dir, f"devices.ids=a{unique},b{unique}", "devices.count=2",
                    "devices.rates_hz=200", "workers.count=2", "train.strategy=bsp", "run.duration_s=8",
                    "testbed.enabled=true", "testbed.brokers=1", f"testbed.subnet={subnet}",
                    "testbed.links.w1=10mbit")
    with open_testbed(cfg, console=quiet()) as session:
        tb = session.testbed
        devices_sent_before = sent_by(tb, "devices")
        result = run_job(cfg, session.bootstrap, console=quiet(), live=False, testbed=tb)
        devices_sent = sent_by(tb, "devices")
        shaped = read_qdisc(["tc", "-n", tb.hosts["w1"].netns], HOST_IF)
    show(result)

    assert result.balanced and result.deaths == []
    # Each worker served /metrics on its own host's address, and the targets file says so.
    for name in ("w0", "w1"):
        assert urllib.parse.urlsplit(result.workers[name]).hostname == tb.hosts[name].address
    targets = {g["labels"].get("worker"): g["targets"][0] for g in json.loads(file_sd_path(cfg.job.name).read_text())}
    assert targets["w1"].startswith(tb.hosts["w1"].address + ":")
    # The simulators produced from the devices host: every sensor byte left through its link.
    produced_bytes = json.loads((cfg.state_path() / "simulation.json").read_text())["bytes"]
    assert produced_bytes > 0 and devices_sent - devices_sent_before > produced_bytes
    assert shaped["kind"] == "tbf" and shaped["rate_bps"] == 10_000_000
    # And training happened across hosts: BSP replicas identical.
    trained = result.training
    assert len({t["digest"] for t in trained.values()}) == 1 and min(t["steps"] for t in trained.values()) > 0
