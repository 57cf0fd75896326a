"""What serving predictions costs, and how fresh they are: in a training worker
(``--part predictions``) and in ``edgestream serve`` (``--part serve``).

``--part predictions``: one worker trains on one device streaming faster than it can train
(``devices.rates_hz``, fixed 64-record steps, the digits MLP), so the trainer sets the
pace, once with ``serve.predictions = false`` and once with ``true``, in interleaved pairs
(off, on, off, on ...) on one local broker. Each run's training throughput is the worker's
``edgestream_trained_records_total`` over a fixed window after a warm-up; the ratio of each
pair (on / off) is reported with the median over pairs. For the runs with predictions, the
``predictions.<job>`` topic is read back whole: how many were published against trained
records, and the latency of each from its record's Kafka append to its publish
(``latency_append_s``) and from its event time (``latency_event_s``), p50/p99. Under that
saturation a record's latency is mostly its wait in the backlog, so one more run with
predictions on streams at ``--paced-rate`` (below what the worker trains, window batches as
a live job uses them) for the latency of a worker that keeps up.

``--part serve``: the inference-only processor (pipeline/serve.py) on an ``asp`` job with the
digits MLP, its model a server snapshot the benchmark publishes on ``models.<job>`` (as a
server would; ``--model-from models``). Three measurements:

1. Throughput: one device topic pre-filled with ``--records`` records (50 a message); then,
   interleaved (A B A B ...), ``--pairs`` times: (A) an ``edgestream serve`` process reading
   it from the start in a fresh group, (B) a plain loop in this process: an aiokafka consumer,
   the project's record decoder, the same model's forward pass on one torch thread in chunks
   of ``serve.max_batch`` rows (batches cut at ``serve.max_batch`` records or
   ``serve.max_wait_s``), the same prediction messages (``encode_scored``) sent as record
   batches by an aiokafka producer with serve's settings (idempotent, ``acks=all``, 2 ms
   linger, 1 MiB record batches) without waiting for each acknowledgement, the
   acknowledgements awaited and the offsets committed once a second.
   Each side's records/s is the predictions published after its first micro-batch over the
   time from that micro-batch's ``published_at`` to the last prediction's (read back from its
   predictions topic); the ratio serve/plain of each pair and its median.
2. Latency: serve (ready: model loaded, partition assigned) keeping up with a device paced at
   ``--paced-rate`` for ``--window`` s; Kafka append (the message's timestamp) -> prediction
   published (``latency_append_s``), p50/p99.
3. Hot swap: the same, with three newer model versions published at 1/4, 2/4 and 3/4 of the
   window; every prediction read back: records lost (no prediction) and duplicated, the
   longest gap between consecutive micro-batches' publish times across and around (+-1 s)
   each swap against the median gap, the time from each model's publish to its first
   prediction, and how many records each version predicted.

Each part prints a markdown table and merges its results into
benchmarks/results/serving.{json,md} (the other part's results are kept: ``--part serve``
under the JSON's ``serve`` key and the markdown's "edgestream serve" section). Never asserts.

    python -m edgestream bench serving [--pairs 3] [--window 12] [--rate 12000] [--paced-rate 1000]
    python -m edgestream bench serving --part serve [--records 500000] [--pairs 3] [--window 12] [--paced-rate 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: Trained records before the measurement window opens (start-up, first evaluation).
WARMUP_RECORDS = 2000


def _config(name: str, state: Path, rate: float, window_s: float, predictions: bool, paced: bool = False):
    from edgestream.job.config import load_config

    batching = (["batcher.mode=window", "batcher.window_s=0.25", "batcher.max_batch=512"] if paced else
                ["batcher.mode=fixed", "batcher.batch_size=64", "train.max_step_batch=64"])
    return load_config(overrides=[
        f"job.name={name}", f"run.state_dir={state}", f"devices.ids=d{name}", "devices.count=1",
        f"devices.rates_hz={rate:g}", "devices.message_interval_s=0.05", "workers.count=1",
        *batching, "train.strategy=bsp",
        "train.enabled=true", "train.model=mlp", "train.lr=0.1", "train.eval_every_s=5",
        "train.checkpoint_every_steps=50", f"run.duration_s={window_s + 30:g}", "run.drain_timeout_s=120",
        f"serve.predictions={'true' if predictions else 'false'}",
    ], env={})


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _read_predictions(bootstrap: str, topic: str) -> list:
    """Every message of ``topic`` (to its end offsets), decoded and checked."""
    from edgestream.streams.predictions import decode

    return [decode(r.value) for r in _read_records(bootstrap, topic)]


def one_run(bootstrap: str, work: Path, rate: float, window_s: float, predictions: bool,
            paced: bool = False) -> dict:
    from edgestream.monitoring.scrape import scrape
    from edgestream.pipeline.run import run_job
    from edgestream.streams.topics import predictions_topic

    name = f"serving{uuid.uuid4().hex[:6]}"
    cfg = _config(name, work / name, rate, window_s, predictions, paced)
    seen: dict[str, float] = {}

    def measure(ctx) -> None:
        worker = ctx.worker("w0")

        def trained() -> float:
            s = scrape(worker.metrics_url) if worker.metrics_url else None
            return s.get("edgestream_trained_records_total", worker="w0") if s is not None else 0.0

        deadline = time.monotonic() + 120
        while trained() < min(WARMUP_RECORDS, 4 * rate):
            if time.monotonic() > deadline:
                raise RuntimeError("the worker trained fewer than 2000 records in 120 s")
            time.sleep(0.5)  # a benchmark's polling, not a test's synchronisation
        first, began = trained(), time.monotonic()
        time.sleep(window_s)  # the measurement window
        seen["records_per_s"] = (trained() - first) / (time.monotonic() - began)

    result = run_job(cfg, bootstrap, console=Console(file=io.StringIO(), width=200), live=False,
                     on_streaming=measure)
    stats = result.training["w0"]
    row = {"predictions": predictions, "records_per_s": round(seen["records_per_s"], 1),
           "trained": stats["trained_records"], "balanced": result.balanced}
    if predictions:
        published = _read_predictions(bootstrap, predictions_topic(name))
        append = [p.latency_append_s for p in published if p.latency_append_s is not None]
        event = [p.latency_event_s for p in published if p.latency_event_s is not None]
        row.update({"published": len(published), "append_p50_s": _percentile(append, 0.5),
                    "append_p99_s": _percentile(append, 0.99), "event_p50_s": _percentile(event, 0.5),
                    "event_p99_s": _percentile(event, 0.99)})
    return row


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def predictions_part(args: argparse.Namespace) -> tuple[dict, str]:
    """``--part predictions``: the pairs and the paced run; the result and its markdown."""
    from edgestream.deploy.kafka.broker import LocalBroker

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp, LocalBroker(Path(tmp) / "kafka") as broker:
        for pair in range(args.pairs):
            for predictions in (False, True):
                row = one_run(broker.bootstrap, Path(tmp), args.rate, args.window, predictions)
                row["pair"] = pair + 1
                rows.append(row)
                print(f"pair {pair + 1}/{args.pairs} predictions {'on ' if predictions else 'off'}: "
                      f"{row['records_per_s']:.0f} records/s"
                      + (f", {row['published']} published for {row['trained']} trained, append->publish "
                         f"p50 {_seconds(row['append_p50_s'])} s p99 {_seconds(row['append_p99_s'])} s"
                         if predictions else ""), flush=True)
        paced = None
        if args.paced_rate:
            paced = one_run(broker.bootstrap, Path(tmp), args.paced_rate, args.window, True, paced=True)
            print(f"paced at {args.paced_rate:g} records/s, predictions on: {paced['published']} published for "
                  f"{paced['trained']} trained, append->publish p50 {_seconds(paced['append_p50_s'])} s "
                  f"p99 {_seconds(paced['append_p99_s'])} s", flush=True)
    ratios = []
    for pair in range(1, args.pairs + 1):
        off, on = (next(r for r in rows if r["pair"] == pair and r["predictions"] is p) for p in (False, True))
        ratios.append(on["records_per_s"] / off["records_per_s"] if off["records_per_s"] else None)
    valid = [r for r in ratios if r is not None]
    on_rows = [r for r in rows if r["predictions"]]
    result = {
        "benchmark": "serving", "part": args.part, "pairs": args.pairs, "window_s": args.window, "rate_hz": args.rate,
        "rows": rows, "ratio_on_over_off": ratios, "median_ratio": statistics.median(valid) if valid else None,
        "median_append_p50_s": statistics.median(r["append_p50_s"] for r in on_rows if r["append_p50_s"] is not None)
        if on_rows else None,
        "median_append_p99_s": statistics.median(r["append_p99_s"] for r in on_rows if r["append_p99_s"] is not None)
        if on_rows else None,
        "paced": None if paced is None else {**paced, "rate_hz": args.paced_rate},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
    }
    lines = [f"Training throughput with serve.predictions off and on: one worker, one device at {args.rate:g} "
             f"records/s (above what it trains), fixed 64-record steps, digits MLP, {args.window:g} s windows, "
             f"{args.pairs} interleaved pairs on one local broker",
             "", "| pair | predictions | trained records/s | on/off | published / trained | append->publish p50 (s) "
             "| p99 (s) | event->publish p50 (s) | p99 (s) | balanced |",
             "|---:|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for row in rows:
        ratio = ratios[row["pair"] - 1] if row["predictions"] else None
        lines.append(
            f"| {row['pair']} | {'on' if row['predictions'] else 'off'} | {row['records_per_s']:.0f} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | "
            f"{str(row['published']) + ' / ' + str(row['trained']) if row['predictions'] else '-'} | "
            f"{_seconds(row.get('append_p50_s'))} | {_seconds(row.get('append_p99_s'))} | "
            f"{_seconds(row.get('event_p50_s'))} | {_seconds(row.get('event_p99_s'))} | "
            f"{'yes' if row['balanced'] else 'NO'} |")
    if result["median_ratio"] is not None:
        lines += ["", f"Median on/off ratio over the pairs: **{result['median_ratio']:.2f}x**. Under this "
                  "saturation a record waits in the backlog, which is most of its latency."]
    if paced is not None:
        lines += ["", f"A worker that keeps up (one device at {args.paced_rate:g} records/s, window batches of "
                  "0.25 s, predictions on): "
                  f"{paced['published']} published for {paced['trained']} trained; Kafka append -> prediction "
                  f"published p50 **{_seconds(paced['append_p50_s'])} s**, p99 **{_seconds(paced['append_p99_s'])} "
                  f"s**; event time -> published p50 {_seconds(paced['event_p50_s'])} s, p99 "
                  f"{_seconds(paced['event_p99_s'])} s; balanced {'yes' if paced['balanced'] else 'NO'}."]
    return result, "\n".join(lines) + "\n"


# --- --part serve: edgestream serve against a plain loop, its latency, its hot swap ----------
#: Records per device message of the serve part (a device at 1,000 records/s sends 20 a second).
RECORDS_PER_MESSAGE = 50
#: The serve instance's name: its predictions' ``worker`` field.
SERVE_NAME = "bench-serve"
#: The plain loop's name in its predictions' ``worker`` field.
PLAIN_NAME = "plain"
#: The model version served first, and the three published mid-stream in the hot-swap run.
FIRST_VERSION = 1
NEWER_VERSIONS = (11, 21, 31)
#: Seconds either side of a swap in which the longest gap between micro-batches is looked for.
SWAP_WINDOW_S = 1.0
#: A section's heading in serving.md: what ``--part serve`` writes below it, the other part above.
SERVE_HEADING = "## edgestream serve"
#: Key of a prediction, and of a record read from the device topic: (topic, partition, offset, record id).
RecordKey = tuple[str, int, int, int]


def accounting(sources: list[RecordKey], predicted: list[RecordKey]) -> dict[str, int]:
    """Every record of ``sources`` against the predictions' keys: ``lost`` (a record without a
    prediction), ``duplicates`` (predictions beyond the first of a record), ``unexpected`` (a
    prediction of no source record)."""
    counts: dict[RecordKey, int] = {}
    for key in predicted:
        counts[key] = counts.get(key, 0) + 1
    wanted = set(sources)
    return {"records": len(wanted), "predictions": len(predicted),
            "lost": sum(1 for key in wanted if key not in counts),
            "duplicates": sum(n - 1 for n in counts.values() if n > 1),
            "unexpected": sum(n for key, n in counts.items() if key not in wanted)}


def swap_gaps(published: list[tuple[float, int]], window_s: float = SWAP_WINDOW_S) -> dict:
    """The pauses of one instance's predictions, from ``(published_at, model_version)`` of each.

    A micro-batch's predictions share one ``published_at``, so the distinct times, in order, are
    the micro-batches; a gap is the time between two consecutive ones. For each change of
    version: ``gap_across_s`` (last micro-batch of the old version to the first of the new) and
    ``longest_gap_near_s`` (the longest gap that overlaps ``window_s`` either side of the swap),
    beside the median gap over the whole stream."""
    batches = sorted(set(published))
    times = [t for t, _ in batches]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    swaps = []
    for i in range(1, len(batches)):
        if batches[i][1] == batches[i - 1][1]:
            continue
        at = times[i]
        near = [g for j, g in enumerate(gaps) if times[j + 1] >= at - window_s and times[j] <= at + window_s]
        swaps.append({"from_version": batches[i - 1][1], "to_version": batches[i][1], "at": at,
                      "gap_across_s": times[i] - times[i - 1], "longest_gap_near_s": max(near)})
    return {"micro_batches": len(batches), "median_gap_s": statistics.median(gaps) if gaps else None,
            "longest_gap_s": max(gaps) if gaps else None, "swaps": swaps}


def merge_markdown(old: str, part: str, text: str) -> str:
    """serving.md with ``part``'s ``text`` in its place and the other part's text kept: the
    predictions part above ``SERVE_HEADING``, the serve part from it on."""
    cut = old.find(SERVE_HEADING)
    predictions, serve_section = (old, "") if cut < 0 else (old[:cut], old[cut:])
    if part == "serve":
        serve_section = text
    else:
        predictions = text
    predictions = predictions.rstrip("\n") + "\n" if predictions.strip() else ""
    return predictions + ("\n" if predictions and serve_section else "") + serve_section


def merge_json(old: dict, part: str, result: dict) -> dict:
    """serving.json with ``part``'s ``result`` in its place: the predictions part at the top
    level, the serve part under ``serve``; the other part's keys kept."""
    if part == "serve":
        return {**old, "serve": result}
    return {**result, **({"serve": old["serve"]} if "serve" in old else {})}


class BenchJob:
    """One ``asp`` job of the serve part (its own name: its own predictions topic, group and
    models topic) on one device, and the server model the benchmark publishes for it."""

    def __init__(self, work: Path, device: str, tag: str, weights: tuple[dict, dict] | None = None) -> None:
        from edgestream.job.config import load_config
        from edgestream.job.plan import training_plan
        from edgestream.job.sources import job_fleet_data
        from edgestream.streams.topics import predictions_topic
        from edgestream.trainers import assembly

        self.name = f"{tag}{uuid.uuid4().hex[:6]}"
        self.device = device
        self.overrides = [
            f"job.name={self.name}", f"run.state_dir={work / self.name}", f"devices.ids={device}", "devices.count=1",
            "workers.count=1", "train.enabled=true", "train.model=mlp", "train.strategy=asp"]
        self.cfg = load_config(overrides=self.overrides, env={})
        self.plan, self.data = training_plan(self.cfg), job_fleet_data(self.cfg)
        self.trainer = assembly.build_trainer(self.plan, "server", self.data)
        self.weights = weights or ({k: v.clone() for k, v in self.trainer.get_parameters().items()},
                                   {k: v.clone() for k, v in self.trainer.get_buffers().items()})
        self.device_topic = self.cfg.input.layout().topic(device)
        self.predictions = predictions_topic(self.name)

    def model_message(self, version: int, scale: float = 1.0) -> tuple[bytes, list]:
        """A server's snapshot of the model at ``version`` (its weights times ``scale``)."""
        from edgestream.trainers.strategies.base import snapshot_message
        from edgestream.trainers.wire import encode_update

        parameters, buffers = self.weights
        self.trainer.load_snapshot({k: v * scale for k, v in parameters.items()}, buffers, version=version)
        value, headers = encode_update(snapshot_message(self.trainer, "server"), job=self.name)
        return value, list(headers.items())

    def publish_model(self, bootstrap: str, version: int, scale: float = 1.0) -> None:
        from edgestream.job.topics import channel_topic
        from edgestream.pipeline.kafka_io import ensure_topics, producer

        topic = channel_topic(self.name, "models")
        ensure_topics(bootstrap, {topic: "models"})
        value, headers = self.model_message(version, scale)
        prod = producer(bootstrap, self.cfg.kafka.max_message_bytes)
        prod.send(topic, key=b"server", value=value, headers=headers)
        prod.flush()
        prod.close()

    def serving_model(self):
        """The model serve loads from the first snapshot, loaded the same way (``ModelLoader``)."""
        from edgestream.trainers.serving import ModelLoader

        loader = ModelLoader(self.plan, self.data, "server", role="server")
        return loader.from_message(self.model_message(FIRST_VERSION)[0], "bench")

    def record_batch(self, first_seq: int, event_time: float):
        """``RECORDS_PER_MESSAGE`` records of the job's own training data (its value range)."""
        from edgestream.streams.records import RecordBatch

        train = self.data.train
        rows = np.arange(first_seq, first_seq + RECORDS_PER_MESSAGE) % len(train.features)
        return RecordBatch(device=self.device, seq=np.arange(first_seq, first_seq + RECORDS_PER_MESSAGE,
                                                             dtype=np.uint64),
                           event_time=np.full(RECORDS_PER_MESSAGE, event_time),
                           features=np.ascontiguousarray(train.features[rows], dtype=np.float32),
                           labels=train.labels[rows].astype(np.int32))


def _ensure_device_topic(bootstrap: str, job: BenchJob) -> None:
    from edgestream.job.topics import sensor_topics_for
    from edgestream.pipeline.kafka_io import ensure_topics

    ensure_topics(bootstrap, sensor_topics_for([job.device], job.cfg.input.layout()))


def prefill(bootstrap: str, job: BenchJob, records: int) -> int:
    """``records`` (rounded up to whole messages) on the job's device topic; the message count."""
    from edgestream.pipeline.kafka_io import producer
    from edgestream.streams import codec

    _ensure_device_topic(bootstrap, job)
    prod = producer(bootstrap, job.cfg.kafka.max_message_bytes, linger_ms=20, batch_size=1 << 20)
    messages = -(-records // RECORDS_PER_MESSAGE)
    for i in range(messages):
        prod.send(job.device_topic, key=job.device.encode(),
                  value=codec.encode(job.record_batch(i * RECORDS_PER_MESSAGE, time.time())))
    prod.flush()
    prod.close()
    return messages


def _wait_for_messages(bootstrap: str, topic: str, target: int, what: str, timeout_s: float,
                       proc: subprocess.Popen, log: Path) -> None:
    """Until ``topic`` holds ``target`` messages, looked at once a second through one consumer
    (this process takes little CPU from the serve process it watches; the timing comes from
    the predictions' own ``published_at``, not from this loop)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
            n = sum(consumer.end_offsets(parts).values()) if parts else 0
            if n >= target:
                return
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode} before {what} ({n} of {target}); see {log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: {n} of {target} after {timeout_s:g} s; see {log}")
            time.sleep(1.0)  # a benchmark's polling
    finally:
        consumer.close()


def _read_records(bootstrap: str, topic: str) -> list:
    """Every message of ``topic`` to its end offsets now."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=5000)
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        ends = consumer.end_offsets(parts)
        out: list = []
        while any(consumer.position(tp) < ends[tp] for tp in parts):
            for records in consumer.poll(timeout_ms=2000).values():
                out += records
        return out
    finally:
        consumer.close()


def _publish_span(bootstrap: str, topic: str) -> dict:
    """How the predictions on ``topic`` were published: their count, the first and the last
    ``published_at``, and how many share the first (the first micro-batch, whose work precedes
    the span). Reads the start of each partition up to its second publish time, and its last
    message."""
    import orjson
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)

    def read(tp: TopicPartition, offset: int, end: int):
        """The messages of ``tp`` from ``offset`` (below ``end``), a chunk at a time."""
        consumer.seek(tp, offset)
        deadline = time.monotonic() + 60
        while offset < end:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{topic}[{tp.partition}]@{offset} could not be read in 60 s")
            for records in consumer.poll(timeout_ms=1000).values():
                for record in records:
                    if record.offset >= offset:
                        offset = record.offset + 1
                        yield record

    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        begins, ends = consumer.beginning_offsets(parts), consumer.end_offsets(parts)
        firsts, lasts = [], []
        for tp in parts:
            if ends[tp] <= begins[tp]:
                continue
            consumer.assign([tp])
            first, same = None, 0
            for record in read(tp, begins[tp], ends[tp]):
                stamp = orjson.loads(record.value)["published_at"]
                if first is not None and stamp != first:
                    break
                first, same = stamp, same + 1
            firsts.append((first, same))
            lasts.append(orjson.loads(next(read(tp, ends[tp] - 1, ends[tp])).value)["published_at"])
        first, first_batch = min(firsts)
        return {"predictions": sum(ends[tp] - begins[tp] for tp in parts), "first": first, "last": max(lasts),
                "first_micro_batch": first_batch}
    finally:
        consumer.close()


def throughput_row(side: str, span: dict) -> dict:
    """Records/s after the first micro-batch: the predictions published after the first publish
    time over the time from it to the last."""
    seconds = span["last"] - span["first"]
    after = span["predictions"] - span["first_micro_batch"]
    return {"side": side, "predictions": span["predictions"], "first_micro_batch": span["first_micro_batch"],
            "seconds": seconds, "records_per_s": after / seconds if seconds > 0 else None}


def start_serve(bootstrap: str, job: BenchJob, log: Path) -> subprocess.Popen:
    """``edgestream serve --model-from models`` for ``job``, in a session of its own."""
    argv = [sys.executable, "-m", "edgestream", "serve", "--bootstrap", bootstrap, "--model-from", "models",
            "--name", SERVE_NAME, "--loglevel", "warning"]
    for item in job.overrides:
        argv += ["--set", item]
    with open(log, "ab") as out:  # the process holds its own copy
        return subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop_serve(proc: subprocess.Popen, log: Path) -> None:
    """SIGTERM to the serve process's session; it drains, commits and exits 0."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RuntimeError(f"serve did not stop within 120 s of SIGTERM; see {log}") from None
    if code != 0:
        raise RuntimeError(f"serve exited with {code}; see {log}")


def _wait_ready(job: BenchJob, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    """Until serve's /readyz answers 200 (its model loaded, its partitions assigned)."""
    import urllib.error
    import urllib.request

    from edgestream.pipeline.exits import ENDPOINT_FILE, worker_state_dir

    endpoint = worker_state_dir(job.cfg, SERVE_NAME) / ENDPOINT_FILE
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode} before it was ready; see {log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"serve not ready after {timeout_s:g} s; see {log}")
        if endpoint.exists():
            with contextlib.suppress(OSError, ValueError, urllib.error.URLError):
                with urllib.request.urlopen(json.loads(endpoint.read_text())["ready"], timeout=2) as reply:
                    if reply.status == 200:
                        return
        time.sleep(0.2)  # a benchmark's polling


def serve_throughput(bootstrap: str, work: Path, source: BenchJob, records: int) -> dict:
    """(A): a fresh serve job and group on ``source``'s device topic, from its start to the end."""
    job = BenchJob(work, source.device, "bsv", source.weights)
    job.publish_model(bootstrap, FIRST_VERSION)
    log = work / f"{job.name}.log"
    proc = start_serve(bootstrap, job, log)
    try:
        _wait_for_messages(bootstrap, job.predictions, records, "every record predicted", 900, proc, log)
    finally:
        stop_serve(proc, log)
    return throughput_row("serve", _publish_span(bootstrap, job.predictions))


async def _plain_loop(bootstrap: str, job: BenchJob, model, records: int) -> None:
    """(B): consume -> decode -> batch -> forward -> publish, the way a hand-written loop does."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from edgestream.pipeline.serve import PRODUCER_BATCH_BYTES
    from edgestream.streams import codec
    from edgestream.streams.predictions import AT_SERVE, Scored, encode_scored
    from edgestream.streams.topics import murmur2

    cfg = job.cfg
    max_batch, max_wait_s, top_k = cfg.serve.max_batch, cfg.serve.max_wait_s, cfg.serve.top_k
    consumer = AIOKafkaConsumer(job.device_topic, bootstrap_servers=bootstrap, group_id=f"{job.name}-plain",
                                enable_auto_commit=False, auto_offset_reset="earliest",
                                max_partition_fetch_bytes=cfg.kafka.max_message_bytes,
                                fetch_max_bytes=max(cfg.kafka.max_message_bytes, 52_428_800))
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=2,
                                max_request_size=cfg.kafka.max_message_bytes,
                                max_batch_size=min(PRODUCER_BATCH_BYTES, cfg.kafka.max_message_bytes))
    await consumer.start()
    await producer.start()
    try:
        partitions = sorted(await producer.partitions_for(job.predictions))
        key = job.device.encode()
        out_partition = partitions[(murmur2(key) & 0x7FFFFFFF) % len(partitions)]
        ident = model.ident
        pending: list[tuple] = []
        buffered = predicted = 0
        first_at: float | None = None
        acks: list = []
        positions: dict = {}
        committed_at = time.monotonic()

        async def flush_and_commit() -> None:
            await asyncio.gather(*acks)
            acks.clear()
            if positions:
                await consumer.commit(dict(positions))

        while predicted < records:
            fetched = await consumer.getmany(timeout_ms=max(1, int(max_wait_s * 1000)), max_records=1000)
            for tp, messages in fetched.items():
                for message in messages:
                    batch = codec.decode(message.value, expected_shape=tuple(job.data.feature_shape))
                    pending.append((batch, tp.partition, message.offset, message.timestamp / 1000.0))
                    buffered += batch.count
                    positions[tp] = message.offset + 1
            now = time.monotonic()
            if buffered and first_at is None:
                first_at = now
            if buffered and (buffered >= max_batch or now - first_at >= max_wait_s):
                batches = [b for b, _, _, _ in pending]
                counts = [b.count for b in batches]
                features = np.concatenate([b.features for b in batches])
                partition = np.repeat(np.array([p for _, p, _, _ in pending], dtype=np.int64), counts)
                offset = np.repeat(np.array([o for _, _, o, _ in pending], dtype=np.int64), counts)
                stamp = np.repeat(np.array([t for _, _, _, t in pending], dtype=np.float64), counts)
                seq = np.concatenate([b.seq for b in batches])
                event_time = np.concatenate([b.event_time for b in batches])
                for start in range(0, len(features), max_batch):
                    rows = slice(start, start + max_batch)
                    classes, probabilities = model.predict(features[rows], top_k)
                    n = len(classes)
                    scored = Scored(job.device, job.device_topic, partition[rows], offset[rows], seq[rows],
                                    event_time[rows], stamp[rows], np.full(n, ident.version, dtype=np.int64),
                                    [ident.digest] * n, classes, probabilities, np.zeros(n, dtype=bool),
                                    np.full(n, time.time()), AT_SERVE)
                    out = producer.create_batch()
                    for k, v in encode_scored(scored, job=job.name, worker=PLAIN_NAME, published_at=time.time()):
                        if out.append(key=k, value=v, timestamp=None) is None:
                            acks.append(await producer.send_batch(out, job.predictions, partition=out_partition))
                            out = producer.create_batch()
                            out.append(key=k, value=v, timestamp=None)
                    acks.append(await producer.send_batch(out, job.predictions, partition=out_partition))
                    predicted += n
                pending, buffered, first_at = [], 0, None
            if time.monotonic() - committed_at >= 1.0:
                await flush_and_commit()
                committed_at = time.monotonic()
        await flush_and_commit()
    finally:
        await consumer.stop()
        await producer.stop()


def plain_throughput(bootstrap: str, work: Path, source: BenchJob, records: int) -> dict:
    """(B): the plain loop on ``source``'s device topic, from its start, into a topic of its own."""
    from edgestream.pipeline.kafka_io import ensure_topics

    job = BenchJob(work, source.device, "bpl", source.weights)
    ensure_topics(bootstrap, {job.predictions: "predictions"})
    model = job.serving_model()
    asyncio.run(_plain_loop(bootstrap, job, model, records))
    return throughput_row("plain", _publish_span(bootstrap, job.predictions))


class PacedDevice(threading.Thread):
    """Writes ``RECORDS_PER_MESSAGE``-record messages to the job's device topic at ``rate``
    records/s (on a fixed schedule) until ``halt`` is set."""

    def __init__(self, bootstrap: str, job: BenchJob, rate: float) -> None:
        super().__init__(daemon=True)
        from edgestream.pipeline.kafka_io import producer

        self.prod = producer(bootstrap, job.cfg.kafka.max_message_bytes)
        self.job = job
        self.interval_s = RECORDS_PER_MESSAGE / rate
        self.halt = threading.Event()
        self.sent = 0

    def run(self) -> None:
        from edgestream.streams import codec

        began = time.monotonic()
        while not self.halt.is_set():
            value = codec.encode(self.job.record_batch(self.sent, time.time()))
            self.prod.send(self.job.device_topic, key=self.job.device.encode(), value=value)
            self.sent += RECORDS_PER_MESSAGE
            self.halt.wait(max(0.0, began + self.sent / RECORDS_PER_MESSAGE * self.interval_s - time.monotonic()))
        self.prod.flush()
        self.prod.close()


def paced_serve(bootstrap: str, work: Path, weights: tuple[dict, dict], rate: float, window_s: float,
                newer: tuple[int, ...]) -> dict:
    """Serve keeping up with one device at ``rate`` for ``window_s``, the ``newer`` versions
    published evenly spaced in the window; every prediction read back and checked."""
    from edgestream.streams import codec
    from edgestream.streams.predictions import decode

    device = f"p{uuid.uuid4().hex[:6]}"
    job = BenchJob(work, device, "bsw" if newer else "bsl", weights)
    _ensure_device_topic(bootstrap, job)
    job.publish_model(bootstrap, FIRST_VERSION)
    log = work / f"{job.name}.log"
    proc = start_serve(bootstrap, job, log)
    published_at: list[float] = []
    try:
        _wait_ready(job, proc, log)
        stream = PacedDevice(bootstrap, job, rate)
        began = time.monotonic()
        stream.start()
        for i, version in enumerate(newer):
            time.sleep(max(0.0, began + window_s * (i + 1) / (len(newer) + 1) - time.monotonic()))  # the schedule
            published_at.append(time.time())  # before the send: the swap may come before it returns
            job.publish_model(bootstrap, version, scale=1.0 + 0.05 * (i + 1))
        time.sleep(max(0.0, began + window_s - time.monotonic()))  # the stream's length
        stream.halt.set()
        stream.join(timeout=60)
        _wait_for_messages(bootstrap, job.predictions, stream.sent, "every paced record predicted", 300, proc, log)
    finally:
        stop_serve(proc, log)
    sources = []
    for message in _read_records(bootstrap, job.device_topic):
        sources += [(message.topic, message.partition, message.offset, seq)
                    for seq in codec.decode(message.value).seq.tolist()]
    predictions = [decode(m.value) for m in _read_records(bootstrap, job.predictions)]
    append = [p.latency_append_s for p in predictions if p.latency_append_s is not None]
    versions: dict[int, int] = {}
    for p in predictions:
        versions[p.model_version] = versions.get(p.model_version, 0) + 1
    gaps = swap_gaps([(p.published_at, p.model_version) for p in predictions])
    for swap in gaps["swaps"]:  # from the model's publish on models.<job> to its first prediction
        index = newer.index(swap["to_version"]) if swap["to_version"] in newer else None
        swap["publish_to_first_prediction_s"] = None if index is None else swap["at"] - published_at[index]
    return {"rate_hz": rate, "window_s": window_s, "sent": stream.sent,
            **accounting(sources, [(p.topic, p.partition, p.offset, p.record_id) for p in predictions]),
            "append_p50_s": _percentile(append, 0.5), "append_p99_s": _percentile(append, 0.99),
            "versions": {str(v): n for v, n in sorted(versions.items())}, "models_published_at": published_at, **gaps}


def serve_part(args: argparse.Namespace) -> tuple[dict, str]:
    """``--part serve``: the interleaved pairs, the latency run and the hot-swap run."""
    from edgestream.deploy.kafka.broker import LocalBroker
    from edgestream.trainers.local import limit_torch_threads

    limit_torch_threads(1)  # the plain loop's forward pass: one thread, as serve's
    load_before = os.getloadavg()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp, LocalBroker(Path(tmp) / "kafka") as broker:
        work = Path(tmp)
        source = BenchJob(work, f"d{uuid.uuid4().hex[:6]}", "bsrc")
        messages = prefill(broker.bootstrap, source, args.records)
        records = messages * RECORDS_PER_MESSAGE
        print(f"pre-filled {source.device_topic} with {records} records ({messages} messages)", flush=True)
        for pair in range(1, args.pairs + 1):
            for run in (serve_throughput, plain_throughput):
                row = {"pair": pair, **run(broker.bootstrap, work, source, records)}
                rows.append(row)
                print(f"pair {pair}/{args.pairs} {row['side']:<5}: {row['predictions']} predictions in "
                      f"{row['seconds']:.2f} s, {_rate(row['records_per_s'])} records/s", flush=True)
        latency = swap = None
        if args.paced_rate:
            latency = paced_serve(broker.bootstrap, work, source.weights, args.paced_rate, args.window, ())
            print(f"paced at {args.paced_rate:g} records/s: append->publish p50 {_seconds(latency['append_p50_s'])} s "
                  f"p99 {_seconds(latency['append_p99_s'])} s, lost {latency['lost']}", flush=True)
            swap = paced_serve(broker.bootstrap, work, source.weights, args.paced_rate, args.window, NEWER_VERSIONS)
            print(f"hot swap: lost {swap['lost']}, duplicates {swap['duplicates']}, versions {swap['versions']}",
                  flush=True)
    ratios = []
    for pair in range(1, args.pairs + 1):
        serve_row, plain_row = (next(r for r in rows if r["pair"] == pair and r["side"] == side)
                                for side in ("serve", "plain"))
        ratios.append(serve_row["records_per_s"] / plain_row["records_per_s"]
                      if serve_row["records_per_s"] and plain_row["records_per_s"] else None)
    valid = [r for r in ratios if r is not None]
    cfg = source.cfg
    result = {
        "benchmark": "serving", "part": "serve", "records": records, "records_per_message": RECORDS_PER_MESSAGE,
        "pairs": args.pairs, "max_batch": cfg.serve.max_batch, "max_wait_s": cfg.serve.max_wait_s,
        "top_k": cfg.serve.top_k, "rows": rows, "ratio_serve_over_plain": ratios,
        "median_ratio": statistics.median(valid) if valid else None, "latency": latency, "hot_swap": swap,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
    }
    return result, serve_markdown(result)


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def serve_markdown(result: dict) -> str:
    lines = [SERVE_HEADING, "",
             f"`edgestream serve` against a plain loop (aiokafka consumer, the project's decoder, the same model on "
             f"one torch thread in chunks of serve.max_batch = {result['max_batch']}, serve.max_wait_s = "
             f"{result['max_wait_s']:g}, the same prediction messages by an aiokafka producer with serve's settings: "
             "idempotent, acks=all, 2 ms linger, 1 MiB record batches): "
             f"{result['records']} records ({result['records_per_message']} a message) pre-filled on one device "
             f"topic, each run reading it from the start in a fresh group, {result['pairs']} interleaved pairs "
             "(serve, plain, ...), digits MLP, one local broker. Records/s: the predictions after a run's first "
             "micro-batch over the seconds from its publish to the last prediction's.", "",
             "| pair | side | predictions | first micro-batch | seconds | records/s | serve/plain |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        ratio = result["ratio_serve_over_plain"][row["pair"] - 1] if row["side"] == "serve" else None
        lines.append(f"| {row['pair']} | {row['side']} | {row['predictions']} | {row['first_micro_batch']} | "
                     f"{row['seconds']:.2f} | "
                     f"{_rate(row['records_per_s'])} | {'-' if ratio is None else f'{ratio:.2f}x'} |")
    if result["median_ratio"] is not None:
        lines += ["", f"Median serve/plain ratio over the pairs: **{result['median_ratio']:.2f}x** (target: at "
                  f"least 0.8x; {'met' if result['median_ratio'] >= 0.8 else 'NOT met'})."]
    for key, title in (("latency", "Latency"), ("hot_swap", "Hot swap")):
        run = result[key]
        if run is None:
            continue
        lines += ["", f"{title}: serve keeping up with one device at {run['rate_hz']:g} records/s for "
                  f"{run['window_s']:g} s" + (f", model versions {', '.join(map(str, NEWER_VERSIONS))} published "
                                              "at 1/4, 2/4 and 3/4 of it" if key == "hot_swap" else "") + ".", "",
                  "| records | predictions | lost | duplicates | append->publish p50 (s) | p99 (s) | micro-batches | "
                  "median gap (s) | longest gap (s) | predictions per version |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
                  f"| {run['records']} | {run['predictions']} | {run['lost']} | {run['duplicates']} | "
                  f"{_seconds(run['append_p50_s'])} | {_seconds(run['append_p99_s'])} | {run['micro_batches']} | "
                  f"{_seconds(run['median_gap_s'])} | {_seconds(run['longest_gap_s'])} | "
                  f"{', '.join(f'v{v}: {n}' for v, n in run['versions'].items())} |"]
        if run["swaps"]:
            lines += ["", "| swap | gap across it (s) | longest gap within 1 s of it (s) | median gap (s) | model "
                      "published -> its first prediction (s) |", "|---|---:|---:|---:|---:|"]
            lines += [f"| v{s['from_version']} -> v{s['to_version']} | {s['gap_across_s']:.3f} | "
                      f"{s['longest_gap_near_s']:.3f} | {_seconds(run['median_gap_s'])} | "
                      f"{_seconds(s['publish_to_first_prediction_s'])} |" for s in run["swaps"]]
    load = result["machine"]
    lines += ["", f"Load average (1, 5, 15 min) before {load['loadavg_before']}, after {load['loadavg_after']} "
              f"({load['cpus']} CPUs)."]
    return "\n".join(lines) + "\n"


def write_results(part: str, result: dict, text: str) -> None:
    """Merge ``part``'s result into serving.json and serving.md, keeping the other part's."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path, md_path = RESULTS / "serving.json", RESULTS / "serving.md"
    old = json.loads(json_path.read_text()) if json_path.exists() else {}
    json_path.write_text(json.dumps(merge_json(old, part, result), indent=2) + "\n")
    md_path.write_text(merge_markdown(md_path.read_text() if md_path.exists() else "", part, text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("predictions", "serve"), default="predictions",
                        help="predictions: a training worker with serve.predictions off/on; serve: edgestream serve "
                             "against a plain loop, its latency and hot swap")
    parser.add_argument("--pairs", type=int, default=3, help="interleaved pairs (off/on; serve/plain)")
    parser.add_argument("--window", type=float, default=12.0,
                        help="seconds of measurement per run (serve: of each paced run)")
    parser.add_argument("--rate", type=float, default=12000.0,
                        help="predictions: records/s the device streams (above capacity)")
    parser.add_argument("--records", type=int, default=500_000,
                        help="serve: records pre-filled for the throughput pairs")
    parser.add_argument("--paced-rate", type=float, default=1000.0,
                        help="records/s of the latency runs (below capacity; 0: no such run)")
    args = parser.parse_args()
    if args.pairs < 1 or args.window <= 0 or args.rate <= 0 or args.paced_rate < 0 or args.records < 1:
        parser.error("--pairs and --records must be at least 1, --window and --rate positive, --paced-rate at "
                     "least 0")
    result, text = (serve_part if args.part == "serve" else predictions_part)(args)
    print(text)
    write_results(args.part, result, text)


if __name__ == "__main__":
    main()
