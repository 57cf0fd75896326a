"""Predictions on the stream (``serve.predictions``) on the real broker: every record a worker
trains on is published on ``predictions.<job>`` with the prediction its model made before
training on it, once, and every field says the truth about the record and the model."""

from __future__ import annotations

import collections

import numpy as np
import orjson
import pytest

from edgestream.pipeline.run import run_job
from edgestream.streams import codec, topics
from edgestream.streams.predictions import Prediction, decode
from tests.integration.jobs import (
    JSON_READINGS,
    quiet,
    read_topic_to_end,
    show,
    train_job,
    workers_of,
)

pytestmark = pytest.mark.integration

PREDICTING = ("serve.predictions=true", "serve.top_k=10")  # digits: every class, so the p's sum to 1


def predictions_of(bootstrap: str, job: str) -> list[Prediction]:
    """Every message of ``predictions.<job>``, decoded and checked, in log order."""
    records = read_topic_to_end(bootstrap, topics.predictions_topic(job))
    out = []
    for record in records:
        prediction = decode(record.value)
        assert record.key == prediction.device.encode()  # keyed by device
        out.append(prediction)
    return out


def edgestream_records(bootstrap: str, topic: str) -> dict[tuple[int, int], dict[int, tuple[float, int]]]:
    """``(partition, offset) -> {seq: (event time, label)}`` of every message of a device topic
    in edgestream's format, with the message's Kafka timestamp under key -1."""
    out = {}
    for record in read_topic_to_end(bootstrap, topic):
        batch = codec.decode(record.value)
        labels = batch.labels if batch.labels is not None else np.full(batch.count, -1)  # delayed labels: none
        rows = {int(s): (float(t), int(y)) for s, t, y in zip(batch.seq, batch.event_time, labels, strict=True)}
        rows[-1] = (record.timestamp / 1000.0, -1)
        out[(record.partition, record.offset)] = rows
    return out


def device_topic_records(bootstrap: str, cfg) -> dict[str, dict]:
    """``edgestream_records`` of each of the job's per-device topics, by topic."""
    topics = {cfg.input.layout().topic(d) for d in cfg.devices.device_ids()}
    return {topic: edgestream_records(bootstrap, topic) for topic in sorted(topics)}


def check_predictions(result, cfg, predictions: list[Prediction], sources: dict[str, dict],
                      made: tuple[str, ...] = ("step",)) -> None:
    """What every run with predictions must show (``sources``: topic -> ``edgestream_records``-like map)."""
    trained = {device: a["consumed"] for device, a in result.accounting.items()}
    counted = collections.Counter(p.device for p in predictions)
    assert sum(trained.values()) > 500
    assert dict(counted) == trained  # one prediction per trained record, per device
    published = collections.Counter()
    for t in workers_of(result).values():
        published.update(t["predictions"]["by_device"])
        assert t["predictions"]["published"] == sum(t["predictions"]["by_device"].values())
    assert dict(published) == trained
    assert len({(p.topic, p.partition, p.offset, p.record_id) for p in predictions}) == len(predictions)

    owner = {d: w for w in cfg.worker_names() for d in cfg.devices_of(w)}
    digests: dict[tuple[str, int], set[str]] = collections.defaultdict(set)
    last_version: dict[str, int] = {}
    for p in predictions:
        assert (p.job, p.worker) == (cfg.job.name, owner[p.device]) and p.at in made
        assert p.topic == cfg.input.layout().topic(p.device)
        message = sources[p.topic][(p.partition, p.offset)]  # the source message is a real one ...
        event_time, _label = message[p.record_id]  # ... that carried this record
        assert p.event_time == event_time
        assert p.kafka_timestamp == pytest.approx(message[-1][0], abs=1e-3)
        if p.at == "step":  # published in the order they were made
            assert p.model_version >= last_version.get(p.worker, 0)  # non-decreasing per worker
            last_version[p.worker] = p.model_version
        digests[(p.worker, p.model_version)].add(p.model_digest)
        assert sum(prob for _, prob in p.top_k) == pytest.approx(1.0, abs=1e-3)
        assert len(p.top_k) == 10 and p.top_k[0][0] == p.predicted
        # The simulated devices stamp a message's readings over its interval (0.05 s): a few may
        # lie just ahead of when it was sent.
        assert p.latency_event_s is not None and p.latency_event_s > -cfg.devices.message_interval_s
        assert p.latency_append_s is not None and p.latency_append_s > 0
        assert p.published_at >= p.predicted_at
    assert all(len(d) == 1 for d in digests.values())  # one model state per version


def live_accuracy(predictions: list[Prediction], sources: dict[str, dict]) -> float:
    """Accuracy of the published predictions against the records' labels."""
    hits = [p.predicted == sources[p.topic][(p.partition, p.offset)][p.record_id][1] for p in predictions]
    return float(np.mean(hits))


def prequential_accuracy(result) -> float:
    """The run's reported prequential accuracy over all workers (weighted by records)."""
    scored = [t["prequential"] for t in workers_of(result).values()]
    return sum(s["accuracy"] * s["records"] for s in scored) / sum(s["records"] for s in scored)


def test_every_trained_record_is_published_once_with_a_truthful_prediction(kafka_bootstrap, unique, state_dir):
    cfg = train_job(unique, state_dir, "train.strategy=bsp", "run.duration_s=8", *PREDICTING)

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False)
    show(result)

    assert result.balanced
    predictions = predictions_of(kafka_bootstrap, cfg.job.name)
    sources = device_topic_records(kafka_bootstrap, cfg)
    check_predictions(result, cfg, predictions, sources)
    # BSP replicas are bitwise identical at every version: so are their digests.
    by_version: dict[int, set[str]] = collections.defaultdict(set)
    for p in predictions:
        by_version[p.model_version].add(p.model_digest)
    assert all(len(d) == 1 for d in by_version.values())
    assert len(by_version) > 5  # the model moved on while predicting
    # What the predictions say the model got right is what the run reports as prequential accuracy.
    live, reported = live_accuracy(predictions, sources), prequential_accuracy(result)
    print(f"live accuracy from predictions {live:.4f}, reported prequential {reported:.4f}")
    assert live == pytest.approx(reported, abs=0.01)
    assert live > 0.5  # it learned while it predicted


def json_records(bootstrap: str, topic: str) -> dict[tuple[int, int], dict[int, tuple[float, int]]]:
    """``edgestream_records`` of a shared topic of JSON readings (``JSON_READINGS``) without a
    mapped record id: a reading's id is ``offset * limits.max_records_per_message + index``."""
    out = {}
    for record in read_topic_to_end(bootstrap, topic):
        doc = orjson.loads(record.value)
        readings = doc if isinstance(doc, list) else [doc]
        base = record.offset * 65_536
        rows = {base + i: (r["ts"] / 1000.0, int(r["digit"])) for i, r in enumerate(readings)}
        rows[-1] = (record.timestamp / 1000.0, -1)
        out[(record.partition, record.offset)] = rows
    return out


def two_per_partition(unique: str, partitions: int) -> list[str]:
    """Device ids, two in each partition of a shared topic of ``partitions`` (a device's
    partition follows from its id): every worker reads devices."""
    chosen: dict[int, list[str]] = collections.defaultdict(list)
    for i in range(1000):
        device = f"s{unique}-{i}"
        mine = chosen[topics.TopicLayout.partition_of(device, partitions)]
        if len(mine) < 2:
            mine.append(device)
        if sum(map(len, chosen.values())) == 2 * partitions:
            return sorted(d for ids in chosen.values() for d in ids)
    raise AssertionError("no two devices in every partition")


def test_json_readings_on_a_shared_keyed_topic_are_predicted_per_device(kafka_bootstrap, unique, state_dir):
    shared = f"plant{unique}.readings"
    devices = two_per_partition(unique, 3)
    cfg = train_job(unique, state_dir, "train.strategy=localsgd",
                    f"input.topic={shared}", "input.partitions=3", f"devices.ids={','.join(devices)}",
                    "devices.count=6", "devices.rates_hz=80,60,40", "run.duration_s=6", *JSON_READINGS, *PREDICTING)

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False)
    show(result)

    assert result.balanced
    predictions = predictions_of(kafka_bootstrap, cfg.job.name)
    sources = {shared: json_records(kafka_bootstrap, shared)}
    check_predictions(result, cfg, predictions, sources)
    assert {p.partition for p in predictions} == {topics.TopicLayout.partition_of(d, 3) for d in devices}
    assert all(p.partition == topics.TopicLayout.partition_of(p.device, 3) for p in predictions)
    live, reported = live_accuracy(predictions, sources), prequential_accuracy(result)
    print(f"live accuracy from predictions {live:.4f}, reported prequential {reported:.4f}")
    assert live == pytest.approx(reported, abs=0.01)


def test_with_delayed_labels_the_prediction_made_on_arrival_is_published_once_trained(
        kafka_bootstrap, unique, state_dir):
    labels_topic = f"labels.t{unique}"
    cfg = train_job(unique, state_dir, "train.strategy=bsp", "run.duration_s=8", f"labels.topic={labels_topic}",
                    "labels.simulate_delay_s=0.5,2", "labels.simulate_missing=0.05", "labels.max_delay_s=6",
                    *PREDICTING)

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False)
    show(result)

    assert result.balanced
    predictions = predictions_of(kafka_bootstrap, cfg.job.name)
    sources = device_topic_records(kafka_bootstrap, cfg)
    check_predictions(result, cfg, predictions, sources, made=("step", "arrival"))
    unlabeled = sum(a["dropped_by_reason"].get("unlabeled", 0) for a in result.accounting.values())
    assert unlabeled > 0  # readings whose label never came: not trained, so not published
    arrival = [p for p in predictions if p.at == "arrival"]
    assert len(arrival) > 0.9 * len(predictions)  # labels come 0.5-2 s after their reading
    # Made when the reading arrived, published once it trained with its label, which the
    # simulated devices send 0.5-2 s after the reading (the reading's ingest may lag a little).
    assert float(np.median([p.published_at - p.predicted_at for p in arrival])) > 0.5
    assert all(p.predicted_at >= p.kafka_timestamp - 0.01 for p in arrival)
    label_of = {}
    for record in read_topic_to_end(kafka_bootstrap, labels_topic):
        for item in orjson.loads(record.value):
            label_of[(item["device"], item["record_id"])] = item["label"]
    live = float(np.mean([p.predicted == label_of[(p.device, p.record_id)] for p in arrival]))
    reported = result.labels["correct"] / result.labels["scored"]  # the arrival-time predictions, scored
    print(f"arrival-time accuracy from predictions {live:.4f}, reported {reported:.4f} "
          f"({len(arrival)} of {len(predictions)} at arrival; {result.labels['scored']} scored)")
    assert live == pytest.approx(reported, abs=0.02)


def test_a_killed_worker_publishes_its_replayed_records_again_and_its_counts_continue(
        kafka_bootstrap, unique, state_dir):
    from edgestream.monitoring.scrape import scrape
    from edgestream.pipeline.run import RunContext
    from tests.integration.jobs import steps_of, wait_until

    # run.duration_s is a cap (long enough for a slow machine to reach the kill and the restart):
    # streaming ends once the restarted w1 trains again.
    cfg = train_job(unique, state_dir, "train.strategy=bsp", "run.duration_s=40", "run.restart_backoff_s=0.5",
                    "train.checkpoint_every_steps=5", *PREDICTING)

    def crash(ctx: RunContext) -> None:
        w1 = ctx.worker("w1")
        wait_until(lambda: (s := scrape(w1.metrics_url)) is not None
                   and s.get("edgestream_steps_total", worker="w1") >= 8, 90, "w1 to take 8 steps")
        ctx.kill("w1")  # SIGKILL: the steps since its last checkpoint are trained (and predicted) again
        wait_until(lambda: ctx.restarts == ["w1"] and ctx.worker("w1").ready, 120, "the supervisor to restart w1")
        # The restarted w1 trains from its checkpoint (its replayed records predicted again);
        # the drain then trains what is left.
        wait_until(lambda: steps_of(ctx, "w1") >= 1, 60, "the restarted w1 to take a step")
        ctx.stop_streaming()

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=crash)
    show(result)

    assert result.restarted == ["w1"] and result.balanced
    trained = {device: a["consumed"] for device, a in result.accounting.items()}
    published = collections.Counter()
    for t in workers_of(result).values():
        published.update(t["predictions"]["by_device"])
    assert dict(published) == trained  # the counts continue from the checkpoint, as the ledger does
    predictions = predictions_of(kafka_bootstrap, cfg.job.name)
    distinct = collections.Counter(p.device for p in {(p.device, p.partition, p.offset, p.record_id): p
                                                      for p in predictions}.values())
    assert dict(distinct) == trained  # every trained record has its prediction ...
    victim = cfg.devices_of("w1")[0]
    print(f"{victim}: {sum(p.device == victim for p in predictions)} messages for {trained[victim]} records")
    assert sum(p.device == victim for p in predictions) >= trained[victim]  # ... some twice (at least once)
