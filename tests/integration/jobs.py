"""Small jobs and helpers shared by the integration tests that run training over the broker."""

from __future__ import annotations

import io
import time

from rich.console import Console

from pipeline.config import JobConfig, load_config


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


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def wait_until(predicate, timeout_s: float, what: str):
    """Poll ``predicate`` until it returns a truthy value; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)  # poll interval of a deadline wait
    return value


def workers_of(result) -> dict[str, dict]:
    return {name: t for name, t in result.training.items() if name != "server"}


def steps_of(ctx, worker: str) -> float:
    """The worker's ``edgestream_steps_total`` now (0 if it cannot be scraped)."""
    from monitoring.scrape import scrape

    w = ctx.worker(worker)
    s = scrape(w.metrics_url) if w.metrics_url else None
    return s.get("edgestream_steps_total", worker=worker) if s is not None else 0.0


def show(result, training: bool = True) -> None:
    """Print the run's accounting (and training) tables: seen with ``pytest -s``, kept in the
    captured output of a failing test."""
    from rich.console import Console

    from pipeline.run import summary_table, training_table

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


def send_gradients(bootstrap: str, job: str, values, key: bytes = b"w0") -> None:
    """Produce raw ``values`` (encoded update messages, good or bad) to ``gradients.<job>``."""
    from pipeline.kafka_io import producer
    from pipeline.training import channel_topic

    prod = producer(bootstrap)
    try:
        for value in values:
            prod.send(channel_topic(job, "gradients"), value=value, key=key)
        prod.flush()
    finally:
        prod.close()


def dead_letter_reasons(bootstrap: str, job: str) -> list[str]:
    """The reason header of every record of ``gradients.<job>.dlq``, in log order."""
    from streams import topics

    return [dict(r.headers)[topics.DLQ_HEADER_REASON].decode()
            for r in read_topic(bootstrap, topics.gradients_dlq_topic(job))]


def published_by_sender(bootstrap: str, topic: str, kind: str) -> dict[str, int]:
    """How many messages of ``kind`` each sender (the record key) published on ``topic``."""
    from trainers.wire import HEADER_KIND

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
    from trainers.checkpoint import CheckpointStore, load_checkpoint
    from trainers.errors import CheckpointError

    store = CheckpointStore(state_dir / "workers" / worker / "checkpoints")
    for path in store.candidates():
        try:
            return load_checkpoint(path)
        except CheckpointError:
            continue  # pruned between listing and reading: the next newest
    return None
