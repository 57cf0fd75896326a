"""The `edgestream` CLI as a user runs it: one-line errors with the right exit status and
within the promised time, standalone workers that create their own topics, and a worker
crash that exits non-zero with its reason."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType

from edgestream.deploy.kafka.broker import free_port
from edgestream.monitoring.scrape import scrape
from edgestream.streams.recording import RecordedMessage, RecordingWriter
from tests.integration.jobs import cli_at_once, wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
#: A hang guard for the commands given an unreachable cluster: each probes it once
#: (`pipeline.kafka_io.PREFLIGHT_TIMEOUT_S`, 5 s; no client retries) and exits 1; the whole wall
#: time (interpreter start and imports included) is not asserted, since it depends on the
#: machine's load (10.3 s once on a loaded CI run against a 10 s bound).
UNREACHABLE_HANG_S = 60.0
#: A hang guard for `broker status`: its probe waits ``cli.broker.STATUS_TIMEOUT_S`` (1 s) per
#: node, no client retries; the command's whole wall time (interpreter start included) is not
#: asserted, since it depends on the machine's load.
STATUS_HANG_S = 30.0


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("EDGESTREAM_DEBUG", None)
    return env


def cli(cwd: Path, *args: str, timeout_s: float = 180.0) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``edgestream ARGS`` as a subprocess in ``cwd``; the result and its wall time."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "edgestream", *args], cwd=cwd, env=cli_env(),
                          capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    return proc, time.monotonic() - started


def only_line(stream: str) -> str:
    lines = [line for line in stream.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got {len(lines)}:\n{stream}"
    return lines[0]


def unused_address() -> str:
    return f"127.0.0.1:{free_port()}"


def cluster_topics(bootstrap: str) -> set[str]:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        return set(admin.list_topics())
    finally:
        admin.close()


# --- configuration errors: one line, exit 2, nothing created ----------------------------
#: One unknown name per key, and the words its one line must hold.
UNKNOWN_NAMES = [
    ("train.strategy", "nosuch", ["train.strategy='nosuch'", "registered:", "asp", "bsp", "scadles"]),
    ("train.model", "nosuch", ["train.model='nosuch'", "registered:", "mlp"]),
    ("train.codec", "nosuch", ["train.codec='nosuch'", "known:", "topk"]),
]


def test_run_refuses_an_unknown_training_name_before_creating_anything(kafka_bootstrap, unique, tmp_path):
    # One `edgestream run` per unknown name, each in its own directory, all at once: each
    # spends its seconds starting up.
    job = f"bad{unique}"
    runs = [(tmp_path / key, ("run", "--bootstrap", kafka_bootstrap, "--set", f"job.name={job}",
                              "--set", f"devices.ids=x{unique},y{unique}", "--set", "devices.count=2",
                              "--set", "train.enabled=true", "--set", f"{key}={value}", "--set", "run.duration_s=5"))
            for key, value, _words in UNKNOWN_NAMES]
    for cwd, _args in runs:
        cwd.mkdir()

    procs = cli_at_once([(list(args), cwd) for cwd, args in runs], cli_env())

    for (key, _value, words), (cwd, _args), proc in zip(UNKNOWN_NAMES, runs, procs, strict=True):
        assert proc.returncode == 2, (key, proc.stderr)
        line = only_line(proc.stderr)
        assert line.startswith("edgestream run: configuration error: "), line
        assert all(w in line for w in words), line
        assert not (cwd / ".edgestream").exists()  # no state
    assert not {t for t in cluster_topics(kafka_bootstrap) if unique in t}  # nor any topic was created


@pytest.mark.parametrize("args", [
    ("simulate", "--duration", "-5"),
    ("simulate", "--duration", "0"),
    ("simulate", "--garbage", "-1"),
    ("simulate", "--metrics-port", "70000"),
    ("run", "--duration", "nan"),
    ("worker", "--worker", "w0", "--metrics-port", "-1"),
    ("record", "--topics", "x", "--out", "rec", "--max-records", "0"),
    ("replay", "rec", "--max-passes", "0"),
    ("broker", "start", "--port", "65536"),
    ("simulate", "--bootstrap", "127.0.0.1"),
])
def test_bad_flag_values_are_refused_by_argparse_in_one_line(tmp_path, args):
    proc, _ = cli(tmp_path, *args)

    assert proc.returncode == 2
    line = only_line(proc.stderr)
    assert line.startswith(f"edgestream {args[0]}: argument "), line
    assert "--help" in line


def test_simulate_with_an_unknown_rate_profile_is_one_line(kafka_bootstrap, tmp_path):
    proc, _ = cli(tmp_path, "simulate", "--bootstrap", kafka_bootstrap, "--duration", "1",
                  "--set", "devices.profile=nosuch")

    assert proc.returncode == 2
    line = only_line(proc.stderr)
    assert "configuration error: devices.profile" in line and "valid: constant, poisson" in line


# --- an unreachable cluster: one line within seconds, exit 1 ----------------------------
def tiny_recording(directory: Path) -> Path:
    with RecordingWriter(directory) as writer:
        writer.write(RecordedMessage("sensors.rec0", 0, 0, int(time.time() * 1000), b"k", b"v"))
    return directory


@pytest.mark.parametrize("command", ["simulate", "worker", "run", "record", "replay"])
def test_unreachable_bootstrap_is_reported_in_one_line_and_exits_1(tmp_path, command):
    address = unused_address()
    args = {
        "simulate": ["simulate", "--duration", "2"],
        "worker": ["worker", "--worker", "w0", "--set", "train.enabled=true"],
        "run": ["run", "--duration", "2", "--set", "train.enabled=true"],
        "record": ["record", "--topics", "sensors.*", "--out", str(tmp_path / "rec")],
        "replay": ["replay", str(tiny_recording(tmp_path / "rec"))],
    }[command]

    proc, _ = cli(tmp_path, *args, "--bootstrap", address, timeout_s=UNREACHABLE_HANG_S)

    assert proc.returncode == 1
    line = only_line(proc.stderr)
    assert line.startswith(f"edgestream {command}")
    assert f"cannot reach Kafka at {address}" in line and "edgestream broker start" in line, line


@pytest.mark.parametrize("pid_is", ["gone", "reused by another process"])
def test_broker_status_of_a_dead_local_broker_says_down(tmp_path, pid_is):
    if pid_is == "gone":
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()  # a pid that no longer runs
        pid = gone.pid
    else:
        pid = os.getpid()  # alive, but not a Kafka broker
    state = tmp_path / "broker"
    state.mkdir()
    (state / "broker.json").write_text(json.dumps({
        "pid": pid, "bootstrap": unused_address(), "controller_port": free_port(),
        "work_dir": str(state), "log_file": str(state / "broker.log"), "version": "4.1.1",
    }))

    proc, _ = cli(tmp_path, "broker", "status", "--state-dir", str(state), timeout_s=STATUS_HANG_S)

    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"(pid {pid}): down" in only_line(proc.stdout)


def test_broker_status_of_an_unreachable_bootstrap_says_down(tmp_path):
    address = unused_address()

    proc, _ = cli(tmp_path, "broker", "status", "--bootstrap", address, timeout_s=STATUS_HANG_S)

    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert only_line(proc.stdout).startswith(f"{address}: down")


def test_broker_status_of_a_live_cluster_says_up(kafka_bootstrap, tmp_path):
    proc, _ = cli(tmp_path, "broker", "status", "--bootstrap", kafka_bootstrap, timeout_s=STATUS_HANG_S)

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert only_line(proc.stdout) == f"{kafka_bootstrap}: up"


# --- standalone workers --------------------------------------------------------------
def job_flags(unique: str, state: Path, workers: int, *extra: str) -> list[str]:
    devices = ",".join(f"d{i}{unique}" for i in range(workers))
    flags = [f"job.name=s{unique}", f"run.state_dir={state}", f"devices.ids={devices}",
             f"devices.count={workers}", f"workers.count={workers}", "devices.rates_hz=200,150",
             "devices.message_interval_s=0.05", "batcher.window_s=0.25", "train.enabled=true",
             "train.strategy=bsp", "train.eval_every_s=1", *extra]
    return [arg for flag in flags for arg in ("--set", flag)]


def start(tmp_path: Path, name: str, *args: str) -> subprocess.Popen:
    err = open(tmp_path / f"{name}.err", "w")  # noqa: SIM115 - the process owns it
    return subprocess.Popen([sys.executable, "-m", "edgestream", *args], cwd=tmp_path, env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def metrics_of(state: Path, worker: str) -> str | None:
    path = state / "workers" / worker / "endpoint.json"
    return json.loads(path.read_text())["metrics"] if path.exists() else None


def gauge(state: Path, worker: str, name: str) -> float:
    url = metrics_of(state, worker)
    s = scrape(url) if url else None
    return s.get(name, worker=worker) if s is not None else -1.0


def stop(proc: subprocess.Popen, timeout_s: float = 60.0) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    return proc.wait(timeout=timeout_s)


def test_standalone_workers_create_their_topics_and_train(kafka_bootstrap, unique, tmp_path):
    state = tmp_path / "state"
    flags = ["--bootstrap", kafka_bootstrap, *job_flags(unique, state, 2)]
    job = f"s{unique}"
    workers = {w: start(tmp_path, w, "worker", "--worker", w, *flags) for w in ("w0", "w1")}
    sim = None
    try:
        for w in workers:
            wait_until(lambda w=w: workers[w].poll() is not None or gauge(state, w, "edgestream_worker_ready") == 1,
                       120, f"{w} to join its topics")
            assert workers[w].poll() is None, (tmp_path / f"{w}.err").read_text()

        admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        try:
            described = {t["name"]: len(t["partitions"]) for t in admin.describe_topics(
                [f"gradients.{job}", f"control.{job}", f"models.{job}", f"gradients.{job}.dlq",
                 f"sensors.d0{unique}", f"sensors.d1{unique}", "sensors.dlq"])}
            configs = admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, f"models.{job}", {"cleanup.policy": None})],
                config_filter="all")["topic"][f"models.{job}"]
        finally:
            admin.close()
        assert described[f"gradients.{job}"] == 1 and described[f"control.{job}"] == 1
        assert described[f"sensors.d0{unique}"] == 1 and described[f"sensors.d1{unique}"] == 1
        assert {f"models.{job}", f"gradients.{job}.dlq", "sensors.dlq"} <= set(described)
        assert configs["cleanup.policy"]["value"] == "compact"

        sim = start(tmp_path, "simulate", "simulate", "--duration", "30", *flags)
        # Before the fix the workers crawled: 1-2 steps in 30 s instead of ~115.
        for w in workers:
            wait_until(lambda w=w: gauge(state, w, "edgestream_steps_total") >= 40, 30, f"{w} to take 40 steps")
    finally:
        codes = {w: stop(p) for w, p in workers.items()}
        if sim is not None:
            stop(sim)
    assert codes == {"w0": 0, "w1": 0}, {w: (tmp_path / f"{w}.err").read_text()[-2000:] for w in workers}
    for w in workers:
        assert json.loads((state / "workers" / w / "exit.json").read_text())["code"] == 0


def test_a_worker_crash_exits_1_with_its_reason_on_one_line(kafka_bootstrap, unique, tmp_path):
    state = tmp_path / "state"
    flags = ["--bootstrap", kafka_bootstrap, *job_flags(unique, state, 1, "train.checkpoint_every_steps=5")]
    worker = start(tmp_path, "w0", "worker", "--worker", "w0", *flags)
    sim = start(tmp_path, "simulate", "simulate", "--duration", "60", *flags)
    try:
        wait_until(lambda: worker.poll() is not None or gauge(state, "w0", "edgestream_steps_total") >= 10,
                   120, "w0 to take 10 steps")
        # A realistic disk failure: the checkpoint directory becomes a regular file, so the
        # next checkpoint write fails inside the Faust app.
        checkpoints = state / "workers" / "w0" / "checkpoints"
        checkpoints.rename(checkpoints.with_name("checkpoints.moved"))
        checkpoints.write_text("not a directory\n")
        code = worker.wait(timeout=60)
    finally:
        stop(worker)
        stop(sim)

    stderr = (tmp_path / "w0.err").read_text()
    assert code == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("edgestream worker w0: crashed: CheckpointError: "), last
    assert "Not a directory" in last
    assert "Traceback" not in stderr  # tracebacks only at --loglevel debug
    verdict = json.loads((state / "workers" / "w0" / "exit.json").read_text())
    assert verdict["code"] == 1 and verdict["reason"].startswith("CheckpointError: ")
