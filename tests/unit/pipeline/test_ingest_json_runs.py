"""``IngestCore.on_run`` on JSON readings: a run of messages of different sizes is counted
as one by one, and a training job without delayed labels takes no unlabelled run."""

from __future__ import annotations

import json

from prometheus_client import generate_latest

from edgestream.job.config import load_config
from edgestream.monitoring.metrics import Metrics
from edgestream.monitoring.scrape import Scrape
from edgestream.pipeline.ingest import IngestCore

MAPPING = ("input.format=json", "input.features_array=px", "input.label=y", "input.event_time=t",
           "input.record_id=n")
TOPIC = "sensors.dev00"


def message(first: int, labelled: bool = True) -> bytes:
    readings = [{"px": [0.5] * 4, "t": 1.0 + first + i, "n": first + i, **({"y": i} if labelled else {})}
                for i in range(3)]
    return json.dumps(readings, indent=first % 3).encode()  # sizes differ message to message


def core_for(**kwargs) -> IngestCore:
    cfg = load_config(overrides=["devices.count=2", "batcher.mode=window", "batcher.max_batch=100", *MAPPING],
                      env={})
    return IngestCore(cfg, ["dev00", "dev01"], Metrics(), expected_shape=(4,), num_classes=10, **kwargs)


def test_a_json_run_counts_its_messages_bytes_and_records():
    core = core_for()
    first = message(0)
    core.on_message(TOPIC, 0, 0, None, first, "dev00@0", 0.0, 101.0)
    run = [message(3 * i) for i in range(1, 6)]

    actions = core.on_run(TOPIC, run, "run@1-5", 0.1, 101.0)

    assert actions is not None
    (batch,) = core.on_tick(1.0).batches
    assert batch.records.seq.tolist() == list(range(18)) and batch.sources == [("dev00@0", 3), ("run@1-5", 15)]
    acc = core.accounting()["dev00"]
    assert (acc["messages_in"], acc["records_in"]) == (6, 18)
    scrape = Scrape.parse(generate_latest(core.metrics.registry).decode())
    assert scrape.get("edgestream_bytes_in_total", device="dev00") == len(first) + sum(map(len, run))


def test_a_training_job_takes_no_unlabelled_run():
    core = core_for(require_labels=True)
    (letter,) = core.on_message(TOPIC, 0, 0, None, message(0, labelled=False), "dev00@0", 0.0, 101.0).dead_letters
    assert letter.reason == "no_labels"
    assert core.on_run(TOPIC, [message(3 * i, labelled=False) for i in range(1, 4)], "run", 0.1, 101.0) is None
    assert core.accounting()["dev00"]["records_in"] == 0
