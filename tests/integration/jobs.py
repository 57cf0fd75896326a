"""Small jobs and helpers shared by the integration tests that run training over the broker."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from edgestream.job.config import JobConfig, load_config

REPO = Path(__file__).resolve().parents[2]


def train_job(unique: str, state_dir, *overrides: str) -> JobConfig:
    """Three devices at 240 / 160 / 120 records/s, one per worker, digits, an MLP."""
    return load_config(
        overrides=[
            f"job.name=t{unique}",
            f"run.state_dir={state_dir}",
            f"devices.ids=a{unique},b{unique},c{unique}",
            "devices.count=3",
            "devices.rates_hz=240,160,120",
            "devices.message_interval_s=0.05",
            "batcher.window_s=0.25",
            "batcher.max_batch=64",
            "workers.count=3",
            "train.enabled=true",
            "train.model=mlp",
            "train.lr=0.1",
            "train.eval_every_s=1",
            "train.checkpoint_every_steps=10",
            "run.duration_s=60",
            "run.drain_timeout_s=60",
            *overrides,
        ],
        env={},
    )


#: A JSON mapping (``input.*``) of readings ``{"pixels": [64 numbers], "digit": 7, "ts": ms}``.
JSON_READINGS = ("input.format=json", "input.features_array=pixels", "input.label=digit", "input.event_time=ts",
                 "input.time_unit=ms")


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def wait_until(predicate, timeout_s: float, what: str, detail=None):
    """Poll ``predicate`` until it returns a truthy value; fail after ``timeout_s``, with
    ``detail()`` (what was last seen) in the message when given."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f"; last seen: {detail()}" if detail else ""))
        time.sleep(0.2)  # poll interval of a deadline wait
    return value


def workers_of(result) -> dict[str, dict]:
    return {name: t for name, t in result.training.items() if name != "server"}


def steps_of(ctx, worker: str) -> float:
    """The worker's ``edgestream_steps_total`` now (0 if it cannot be scraped)."""
    from edgestream.monitoring.scrape import scrape

    w = ctx.worker(worker)
    s = scrape(w.metrics_url) if w.metrics_url else None
    return s.get("edgestream_steps_total", worker=worker) if s is not None else 0.0


def show(result, training: bool = True) -> None:
    """Print the run's accounting (and training) tables: seen with ``pytest -s``, kept in the
    captured output of a failing test."""
    from rich.console import Console

    from edgestream.pipeline.run import summary_table, training_table

    console = Console(width=200)
    console.print(summary_table(result, training))
    if training:
        console.print(training_table(result))


def read_topic(bootstrap: str, topic: str, timeout_ms: int = 5000) -> list:
    """Every record of ``topic`` now (from the beginning until nothing came for ``timeout_ms``)."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             enable_auto_commit=False, consumer_timeout_ms=timeout_ms)
    try:
        return list(consumer)
    finally:
        consumer.close()


def read_topic_to_end(bootstrap: str, topic: str, timeout_s: float = 60.0) -> list:
    """Every record of ``topic`` up to its end offsets as they are now (what ``read_topic``
    returns once its writers stopped; each partition in log order), without waiting out
    ``read_topic``'s idle timeout; fails if the end is not reached within ``timeout_s``."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False,
                             consumer_timeout_ms=int(timeout_s * 1000))
    try:
        partitions = wait_until(lambda: consumer.partitions_for_topic(topic), timeout_s, f"{topic}'s partitions")
        parts = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        ends = consumer.end_offsets(parts)

        def at_end() -> bool:
            return all(consumer.position(tp) >= ends[tp] for tp in parts)

        records: list = []
        if at_end():
            return records
        deadline = time.monotonic() + timeout_s
        for record in consumer:
            records.append(record)
            if at_end():
                return records
            if time.monotonic() > deadline:
                break
        raise AssertionError(f"timed out reading {topic} to its end offsets {ends}: {len(records)} record(s) read")
    finally:
        consumer.close()


def send_gradients(bootstrap: str, job: str, values, key: bytes = b"w0") -> None:
    """Produce raw ``values`` (encoded update messages, good or bad) to ``gradients.<job>``."""
    from edgestream.job.topics import channel_topic
    from edgestream.pipeline.kafka_io import producer

    prod = producer(bootstrap)
    try:
        for value in values:
            prod.send(channel_topic(job, "gradients"), value=value, key=key)
        prod.flush()
    finally:
        prod.close()


def dead_letter_reasons(bootstrap: str, job: str) -> list[str]:
    """The reason header of every record of ``gradients.<job>.dlq``, in log order."""
    from edgestream.streams import topics

    return [dict(r.headers)[topics.DLQ_HEADER_REASON].decode()
            for r in read_topic(bootstrap, topics.gradients_dlq_topic(job))]


def published_by_sender(bootstrap: str, topic: str, kind: str) -> dict[str, int]:
    """How many messages of ``kind`` each sender (the record key) published on ``topic``."""
    from edgestream.trainers.wire import HEADER_KIND

    counts: dict[str, int] = {}
    for record in read_topic(bootstrap, topic):
        if dict(record.headers).get(HEADER_KIND) == kind.encode():
            sender = (record.key or b"").decode()
            counts[sender] = counts.get(sender, 0) + 1
    return counts


def gossip_job(unique: str, state_dir, *overrides: str) -> JobConfig:
    """Four devices at 160 records/s, one per worker, four workers, one 16-record batch per
    step (about 10 steps/s each), an MLP; heartbeats every 0.5 s, silence for 3 s drops a
    worker."""
    return train_job(
        unique, state_dir,
        f"devices.ids=a{unique},b{unique},c{unique},d{unique}", "devices.count=4", "devices.rates_hz=160",
        "workers.count=4", "batcher.mode=fixed", "batcher.batch_size=16", "train.max_step_batch=16",
        "train.heartbeat_s=0.5", "train.member_timeout_s=3", "run.restart_backoff_s=1",
        "run.duration_s=120",  # a cap: the tests end streaming once they saw what they wait for
        *overrides,
    )


def newest_checkpoint(state_dir, worker: str):
    """The newest checkpoint ``worker`` wrote (``trainers.checkpoint.Checkpoint``), None if
    there is none or it vanished while being read (pruned)."""
    from edgestream.trainers.checkpoint import CheckpointStore, load_checkpoint
    from edgestream.trainers.errors import CheckpointError

    store = CheckpointStore(state_dir / "workers" / worker / "checkpoints")
    for path in store.candidates():
        try:
            return load_checkpoint(path)
        except CheckpointError:
            continue  # pruned between listing and reading: the next newest
    return None


# --- edgestream processes started from the command line ---------------------------------------
def start_cli(args, log_path: Path, *, cwd=REPO, env: dict | None = None, wrapper=()) -> subprocess.Popen:
    """``edgestream ARGS`` (this checkout's CLI in this interpreter, behind ``wrapper``'s
    argv if any) in a session of its own, stdout and stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:  # the process holds its own copy
        return subprocess.Popen([*wrapper, sys.executable, "-m", "edgestream", *args], env=env, cwd=cwd,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop_session(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
    """``sig`` to every process of ``proc``'s session (its process group); its exit code."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass  # the whole group is gone already
    return proc.wait(timeout=timeout_s)


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes] | None:
    """(status, body) of a GET of ``url``, error statuses included; None while nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return None


def http_status(url: str, timeout_s: float = 5.0) -> int | None:
    answer = http_get(url, timeout_s)
    return answer[0] if answer is not None else None


def probe(url: str) -> tuple[int, dict] | None:
    """(status, JSON body) of a health endpoint (/healthz, /readyz); None while nothing answers."""
    answer = http_get(url)
    return (answer[0], json.loads(answer[1])) if answer is not None else None


def worker_endpoint(state_dir: Path, worker: str, pid: int) -> dict | None:
    """``STATE/workers/<worker>/endpoint.json`` of ``worker``'s incarnation ``pid``, once it wrote it."""
    path = state_dir / "workers" / worker / "endpoint.json"
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return info if info.get("pid") == pid else None


@dataclass
class WorkerCli:
    """An ``edgestream worker`` process started by ``start_worker_cli``."""

    name: str
    proc: subprocess.Popen
    state_dir: Path
    log_path: Path

    def wait_endpoint(self, timeout_s: float) -> dict:
        """Its endpoint file (metrics, health and ready URLs), once it wrote it."""
        return wait_until(lambda: worker_endpoint(self.state_dir, self.name, self.proc.pid), timeout_s,
                          f"{self.name}'s endpoint")

    def wait_ready(self, timeout_s: float, what: str) -> dict:
        """Its endpoint file, once its /readyz answers 200 (each waited for up to ``timeout_s``)."""
        info = self.wait_endpoint(timeout_s)
        wait_until(lambda: http_status(info["ready"], timeout_s=2) == 200, timeout_s, what)
        return info

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM to its session; its exit code."""
        return stop_session(self.proc, signal.SIGTERM, timeout_s)


def start_worker_cli(job_file: Path, worker: str, state_dir: Path, log_path: Path, *args: str,
                     cwd=REPO, env: dict | None = None) -> WorkerCli:
    """``edgestream worker --job JOB_FILE --worker WORKER ARGS`` (its state under ``state_dir``,
    the job's ``run.state_dir``), logging to ``log_path``."""
    proc = start_cli(["worker", "--job", str(job_file), "--worker", worker, *args], log_path, cwd=cwd, env=env)
    return WorkerCli(worker, proc, state_dir, log_path)


def cli_at_once(runs: list[tuple[list[str], Path]], env: dict[str, str],
                timeout_s: float = 180.0) -> list[subprocess.CompletedProcess]:
    """Several ``edgestream ARGS`` (each in its ``cwd``, this interpreter) at once: their
    results in order, as ``subprocess.run`` gives one. For commands that spend most of
    their time starting up or waiting (a broker's start, a run's fixed streaming time)."""
    procs = [subprocess.Popen([sys.executable, "-m", "edgestream", *args], cwd=cwd, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
             for args, cwd in runs]
    try:
        outputs = [proc.communicate(timeout=timeout_s) for proc in procs]
        return [subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
                for proc, (out, err) in zip(procs, outputs, strict=True)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
