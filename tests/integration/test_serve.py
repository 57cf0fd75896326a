"""``edgestream serve`` on the real broker: after a short ASP run, two serve instances in one
consumer group predict the job's device streams while the server's model on ``models.<job>``
is replaced three times (and an older version is offered once): every record of the device
topics is predicted exactly once, each instance's versions never go back on a partition, and
the older model is refused and never used."""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
import pytest

from edgestream.job.config import load_config
from edgestream.job.plan import training_plan
from edgestream.job.sources import job_fleet_data
from edgestream.job.topics import channel_topic
from edgestream.monitoring.scrape import scrape
from edgestream.pipeline.kafka_io import end_offsets, group_positions, producer
from edgestream.pipeline.run import run_job
from edgestream.streams import codec, topics
from edgestream.streams.predictions import decode
from edgestream.streams.records import RecordBatch
from edgestream.trainers import assembly
from edgestream.trainers.strategies.base import snapshot_message
from edgestream.trainers.validation import TensorSpec
from edgestream.trainers.wire import decode_update, encode_update
from tests.integration.jobs import (
    quiet,
    read_topic,
    start_cli,
    stop_session,
    wait_until,
    worker_endpoint,
)

pytestmark = pytest.mark.integration

#: Records per message and messages per second per device while serve runs.
RECORDS_PER_MESSAGE = 10
MESSAGES_PER_S = 20
#: Sequence numbers of the test's own records: above the simulated devices' (no duplicates).
FIRST_SEQ = 1_000_000


def overrides_of(unique: str, state_dir) -> list[str]:
    return [
        f"job.name=sv{unique}", f"run.state_dir={state_dir}",
        f"devices.ids=a{unique},b{unique},c{unique}", "devices.count=3", "devices.rates_hz=120",
        "devices.message_interval_s=0.05", "batcher.window_s=0.25", "batcher.max_batch=64",
        "workers.count=2", "train.enabled=true", "train.model=mlp", "train.lr=0.1", "train.strategy=asp",
        "train.strategy_params=publish_every=5", "train.checkpoint_every_steps=10", "train.eval_every_s=2",
        "run.duration_s=5", "run.drain_timeout_s=60", "serve.max_wait_s=0.02", "serve.max_batch=64",
    ]


class Stream(threading.Thread):
    """Writes ``RECORDS_PER_MESSAGE``-record messages of the job's own data to every device
    topic, ``MESSAGES_PER_S`` a second each, until stopped."""

    def __init__(self, bootstrap: str, cfg, data) -> None:
        super().__init__(daemon=True)
        self.prod = producer(bootstrap)
        self.cfg, self.data = cfg, data
        self.halt = threading.Event()
        self.sent = 0

    def run(self) -> None:
        layout, devices = self.cfg.input.layout(), self.cfg.devices.device_ids()
        row, seq = 0, FIRST_SEQ
        while not self.halt.is_set():
            for device in devices:
                take = np.arange(row, row + RECORDS_PER_MESSAGE) % len(self.data.train.features)
                batch = RecordBatch(device=device, seq=np.arange(seq, seq + RECORDS_PER_MESSAGE, dtype=np.uint64),
                                    event_time=np.full(RECORDS_PER_MESSAGE, time.time()),
                                    features=self.data.train.features[take], labels=self.data.train.labels[take])
                self.prod.send(layout.topic(device), key=device.encode(), value=codec.encode(batch))
                self.sent += RECORDS_PER_MESSAGE
            row += RECORDS_PER_MESSAGE
            seq += RECORDS_PER_MESSAGE
            self.halt.wait(1.0 / MESSAGES_PER_S)  # the stream's pace
        self.prod.flush()
        self.prod.close()


def metric(url: str, name: str, **labels: str) -> float:
    found = scrape(url)
    return found.get(name, **labels) if found is not None else float("nan")


def test_two_instances_predict_every_record_once_across_model_swaps(kafka_bootstrap, unique, state_dir, tmp_path):
    overrides = overrides_of(unique, state_dir)
    cfg = load_config(overrides=overrides, env={})
    job = cfg.job.name
    # Step 1. A short ASP run: the server publishes its model on models.<job>.
    result = run_job(cfg, kafka_bootstrap, console=quiet())
    assert result.training["server"]["version"] > 0
    models_topic = channel_topic(job, "models")
    snapshots = [r for r in read_topic(kafka_bootstrap, models_topic) if r.key == b"server"]
    plan, data = training_plan(cfg), job_fleet_data(cfg)
    trainer = assembly.build_trainer(plan, "server", data)
    last = decode_update(snapshots[-1].value, expected_shapes=TensorSpec.from_trainer(trainer),
                         max_bytes=cfg.kafka.max_message_bytes, job=job)
    trainer.load_snapshot(last.tensors, last.buffers, version=last.base_version)
    trained_version = last.base_version

    def publish_model(version: int, scale: float) -> None:
        trainer.load_snapshot({k: v * scale for k, v in last.tensors.items()}, last.buffers, version=version)
        value, headers = encode_update(snapshot_message(trainer, "server"), job=job)
        prod = producer(kafka_bootstrap)
        prod.send(models_topic, key=b"server", value=value, headers=list(headers.items()))
        prod.flush()
        prod.close()

    # Step 2. Two serve instances in one group, the second joining while the first predicts.
    base = ["serve", "--bootstrap", kafka_bootstrap, "--model-from", "models", "--loglevel", "info"]
    for item in overrides:
        base += ["--set", item]
    procs, urls = {}, {}

    def start(name: str) -> None:
        procs[name] = start_cli([*base, "--name", name], tmp_path / f"{name}.log")
        info = wait_until(lambda: worker_endpoint(state_dir, name, procs[name].pid), 120, f"{name}'s endpoint")
        urls[name] = info["metrics"]
        wait_until(lambda: metric(urls[name], "edgestream_serve_model_version") == trained_version, 120,
                   f"{name} serving the trained model")

    def predicted(name: str) -> float:
        return metric(urls[name], "edgestream_serve_predictions_total")

    try:
        start("s0")
        stream = Stream(kafka_bootstrap, cfg, data)
        stream.start()
        wait_until(lambda: predicted("s0") > 0, 60, "s0 predicting")
        start("s1")  # joins the group mid-stream: s0 finishes what it read from the partitions it gives up
        # A message that is no record: dead-lettered by whichever instance reads it, no crash.
        bad_topic = cfg.input.layout().topic(cfg.devices.device_ids()[0])
        prod = producer(kafka_bootstrap)
        prod.send(bad_topic, key=b"junk", value=b"not a record")
        prod.flush()
        prod.close()

        def serving(version: int) -> bool:
            return all(metric(urls[n], "edgestream_serve_model_version") == version for n in urls)

        def both_predict_more() -> None:
            before = {n: predicted(n) for n in urls}
            wait_until(lambda: all(predicted(n) >= before[n] + 50 for n in urls), 60, "both instances predicting",
                       lambda: {n: predicted(n) for n in urls})

        # Step 3. Three newer models mid-stream, and one older one in between.
        both_predict_more()
        versions = [trained_version + 10, trained_version + 20, trained_version + 30]
        for i, version in enumerate(versions):
            publish_model(version, 1.0 + 0.05 * (i + 1))
            wait_until(lambda v=version: serving(v), 60, f"both instances serving version {version}")
            both_predict_more()
            if i == 0:
                publish_model(version - 5, 0.5)  # older than the one in use: refused by both
                wait_until(lambda: all(metric(urls[n], "edgestream_serve_models_refused_total", reason="backwards")
                                       >= 1 for n in urls), 60, "the older model refused")
                assert serving(version)
        stream.halt.set()
        stream.join(timeout=30)
        # Step 4. Everything in the device topics predicted, then a clean stop.
        sources = {}
        for device in cfg.devices.device_ids():
            topic = cfg.input.layout().topic(device)
            for record in read_topic(kafka_bootstrap, topic):
                if record.value == b"not a record":
                    continue
                batch = codec.decode(record.value)
                for seq in batch.seq.tolist():
                    sources[(topic, record.partition, record.offset, int(seq))] = device
        wait_until(lambda: sum(predicted(n) for n in urls) >= len(sources), 120, "every record predicted",
                   lambda: (sum(predicted(n) for n in urls), len(sources)))
        refused = {n: metric(urls[n], "edgestream_serve_models_refused_total", reason="backwards") for n in urls}
        for name, proc in procs.items():
            assert stop_session(proc) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                stop_session(proc)

    # Both stopped gracefully: the group committed every device partition up to its end.
    device_topics = sorted({t for t, _, _, _ in sources} | {bad_topic})
    ends = {f"{tp.topic}:{tp.partition}": end for tp, end in end_offsets(kafka_bootstrap, device_topics).items()}
    assert group_positions(kafka_bootstrap, cfg.serve.group_of(cfg), device_topics) == ends
    predictions = [decode(r.value) for r in read_topic(kafka_bootstrap, topics.predictions_topic(job))]
    keys = [(p.topic, p.partition, p.offset, p.record_id) for p in predictions]
    assert len(keys) == len(set(keys)) == len(sources)  # each record once ...
    assert set(keys) == set(sources)  # ... and every one of them
    assert all(p.at == "serve" and p.worker in ("s0", "s1") and p.device == sources[k]
               for p, k in zip(predictions, keys, strict=True))
    assert {p.worker for p in predictions} == {"s0", "s1"}  # the group shared the partitions
    last_version: dict[tuple[str, str, int], int] = {}
    for p in predictions:  # in log order: each instance publishes a micro-batch after the last is acknowledged
        key = (p.worker, p.topic, p.partition)
        assert p.model_version >= last_version.get(key, 0)
        last_version[key] = p.model_version
    seen = {p.model_version for p in predictions}
    assert set(versions) <= seen and versions[0] - 5 not in seen
    digests = collections.defaultdict(set)
    for p in predictions:
        digests[p.model_version].add(p.model_digest)
    assert all(len(d) == 1 for d in digests.values())  # one model per version
    assert all(n >= 1 for n in refused.values())
    dead = [r for r in read_topic(kafka_bootstrap, topics.SENSOR_DLQ)
            if dict(r.headers).get(topics.DLQ_HEADER_TOPIC) == bad_topic.encode()]
    assert [dict(r.headers)[topics.DLQ_HEADER_WORKER] for r in dead] in ([b"s0"], [b"s1"])
    # The longest pause in an instance's predictions across a swap (published_at), for the docs.
    gaps = []
    for name in ("s0", "s1"):
        mine = sorted((p.published_at, p.model_version) for p in predictions if p.worker == name)
        gaps += [b[0] - a[0] for a, b in zip(mine, mine[1:], strict=False) if b[1] != a[1]]
    print(f"serve: {len(predictions)} predictions, versions {sorted(seen)}, longest gap across a swap "
          f"{max(gaps):.3f} s")
