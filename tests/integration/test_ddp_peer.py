"""The DDP (gloo) benchmark peer over the real broker: 3 ranks on pre-filled device topics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from edgestream.benchmarks import ddp_peer
from edgestream.job.config import JobConfig, load_config
from edgestream.job.sources import job_fleet_data
from edgestream.job.topics import sensor_topics_for
from edgestream.pipeline.kafka_io import ensure_topics, producer
from edgestream.pipeline.run import stop_process
from edgestream.streams import codec, topics
from edgestream.streams.garbage import EXPECTED_REASON, KINDS, make_garbage
from edgestream.streams.simulator import build_simulators

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


BATCH = 32
RECORDS_PER_MESSAGE = 16
GOOD_MESSAGES = 60  # 960 records per device: 30 batches
MAX_STEPS = 30
TARGET = 0.6


def peer_job(unique: str, state_dir: Path) -> tuple[JobConfig, Path]:
    cfg = load_config(
        overrides=[
            f"job.name=p{unique}",
            f"run.state_dir={state_dir}",
            "devices.count=3",
            f"devices.ids=a{unique},b{unique},c{unique}",
            "data.source=digits",
            "train.model=mlp",
            "train.lr=0.1",
            "train.momentum=0.9",
        ],
        env={},
    )
    state_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = state_dir / "job.json"
    cfg_path.write_text(json.dumps(cfg.to_dict()))
    return cfg, cfg_path


def prefill(bootstrap: str, cfg: JobConfig, garbage_device: str | None = None) -> float:
    """GOOD_MESSAGES messages of RECORDS_PER_MESSAGE records per device; on ``garbage_device``
    one malformed message of every kind after each of the first good messages. Returns the
    wall time just before the first send."""
    devices = cfg.devices.device_ids()
    ensure_topics(bootstrap, sensor_topics_for(devices))
    data = job_fleet_data(cfg)
    rate_hz = RECORDS_PER_MESSAGE / 0.1
    sims = build_simulators(data, dict.fromkeys(devices, rate_hz), seed=cfg.job.seed)
    prod = producer(bootstrap)
    first_send = time.time()
    try:
        for sim in sims:
            topic = topics.sensor_topic(sim.device)
            for i in range(GOOD_MESSAGES):
                for batch in sim.step(i * 0.1, (i + 1) * 0.1, wall_origin=time.time()):
                    assert batch.count == RECORDS_PER_MESSAGE
                    prod.send(topic, value=codec.encode(batch), key=sim.device.encode())
                if sim.device == garbage_device and i < len(KINDS):
                    garbage = make_garbage(KINDS[i], sim.device, data.feature_shape, seed=i)
                    prod.send(topic, value=garbage, key=sim.device.encode())
        prod.flush()
    finally:
        prod.close()
    return first_send


def wait_exited(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    return [proc.returncode for proc in procs]


def test_three_ranks_step_together_and_skip_bad_records(kafka_bootstrap, unique, state_dir):
    cfg, cfg_path = peer_job(unique, state_dir)
    a, b, c = cfg.devices.device_ids()
    first_send = prefill(kafka_bootstrap, cfg, garbage_device=b)
    out = state_dir / "ddp"

    # No origin given: the ranks agree on the first producer timestamp they read.
    procs = ddp_peer.launch(
        cfg_path, kafka_bootstrap, out, batch=BATCH, slowdown=[1, 1, 2], origin=None,
        duration_s=150, target_accuracy=TARGET, eval_every_s=0.2, max_steps=MAX_STEPS,
    )
    try:
        codes = wait_exited(procs, timeout_s=180)
    finally:
        for proc in procs:
            stop_process(proc)
    result = ddp_peer.collect(out)

    assert codes == [0, 0, 0], [(out / f"rank{i}.log").read_text()[-2000:] for i in range(3)]
    assert result["complete"] and result["error"] is None
    assert result["stop_reason"] in ("target", "max_steps")
    steps = result["steps"]
    # Every garbage message sits before the 8th good one, so 4 steps read past all of them.
    assert 4 <= steps <= MAX_STEPS
    assert result["steps_per_rank"] == {a: steps, b: steps, c: steps}
    assert result["records_trained"] == {a: steps * BATCH, b: steps * BATCH, c: steps * BATCH}
    expected_bad = dict(Counter(EXPECTED_REASON[kind] for kind in KINDS))
    assert result["bad_messages"] == {a: {}, b: expected_bad, c: {}}
    assert result["messages_read"][b] - result["messages_read"][a] == len(KINDS)
    timeline = result["timeline"]
    assert [point[2] for point in timeline] == sorted(point[2] for point in timeline)
    assert timeline[0][2] == 0 and timeline[-1][2] == steps
    assert result["final_accuracy"] >= TARGET > timeline[0][1]
    if result["stop_reason"] == "target":
        assert result["tta_s"] is not None and all(p[1] >= TARGET for p in timeline[-3:])
    assert first_send - 0.002 <= result["origin"] <= first_send + 5
    assert result["bytes_sent"] == 3 * steps * result["parameters"] * 4
    assert all(len(samples) == steps for samples in result["backlog_samples"].values())
    assert result["emulated_sleep_s"][c] > 0 == result["emulated_sleep_s"][a]
    assert all(backlog >= 0 for backlog in result["max_backlog"].values())


LAUNCHER = r"""
import json, sys, time
from pathlib import Path
from edgestream.benchmarks import ddp_peer

procs = ddp_peer.launch(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), batch=32,
                        origin=time.time(), duration_s=120, target_accuracy=0.99)
print(json.dumps([p.pid for p in procs]), flush=True)
ddp_peer.wait_ready(Path(sys.argv[3]), procs)
print("ready", flush=True)
time.sleep(600)  # killed by the test
"""


def test_ranks_stop_together_when_their_launcher_dies(kafka_bootstrap, unique, state_dir):
    cfg, cfg_path = peer_job(unique, state_dir)
    out = state_dir / "ddp"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(cfg_path), kafka_bootstrap, str(out)],
        stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
    )
    pids: list[int] = []
    try:
        pids = json.loads(launcher.stdout.readline())
        assert launcher.stdout.readline().strip() == "ready"

        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)

        deadline = time.monotonic() + 45
        while any(alive(pid) for pid in pids):
            assert time.monotonic() < deadline, "ranks still running 45s after their launcher died"
            time.sleep(0.2)  # poll interval of a deadline wait
    finally:
        for pid in pids:
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)  # each rank leads its own process group
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=10)
    result = ddp_peer.collect(out)
    assert result["stop_reason"] == "parent_gone" and result["complete"]
    assert set(result["steps_per_rank"].values()) == {0}


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie left for init to reap counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"
