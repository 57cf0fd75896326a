"""What publishing predictions costs a training worker, and how fresh they are.

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

Prints a markdown table and writes benchmarks/results/serving.{json,md}. Never asserts.

    python -m edgestream bench serving [--pairs 3] [--window 12] [--rate 12000] [--paced-rate 1000]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path

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
    from kafka import KafkaConsumer, TopicPartition

    from edgestream.streams.predictions import decode

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=5000)
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        ends = consumer.end_offsets(parts)
        out = []
        while any(consumer.position(tp) < ends[tp] for tp in parts):
            for records in consumer.poll(timeout_ms=2000).values():
                out += [decode(r.value) for r in records]
        return out
    finally:
        consumer.close()


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("predictions",), default="predictions")
    parser.add_argument("--pairs", type=int, default=3, help="off/on pairs, interleaved")
    parser.add_argument("--window", type=float, default=12.0, help="seconds of measurement per run")
    parser.add_argument("--rate", type=float, default=12000.0, help="records/s the device streams (above capacity)")
    parser.add_argument("--paced-rate", type=float, default=1000.0,
                        help="records/s of the latency run (below capacity; 0: no such run)")
    args = parser.parse_args()
    if args.pairs < 1 or args.window <= 0 or args.rate <= 0 or args.paced_rate < 0:
        parser.error("--pairs must be at least 1, --window and --rate positive, --paced-rate at least 0")
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
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "serving.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "serving.md").write_text(text)


if __name__ == "__main__":
    main()
