"""Ingest throughput: decode + buffer + batch in an edgestream worker vs plain consumers.

One device topic is pre-filled with N messages of 32 records each (digits-shaped,
64 float32 features). Then, A E B C D A E B C D ..., a fresh consumer group reads the
whole topic:
  A = an edgestream worker process with the direct source (``kafka.ingest_source =
      "direct"``: aiokafka consumer -> IngestCore -> counting sink);
  E = the same without the duplicate and event-time checks (``UNCHECKED``): what they cost;
  B = the same worker with the Faust source (Faust agent -> IngestCore -> counting sink);
      A and B are timed from the first decoded record to the last record batched (read
      from the worker's /metrics, polled every 20 ms for just those two series);
  C = a plain aiokafka consumer in a subprocess that only reads and counts messages,
      timed from its first message to the last;
  D = a bare Faust agent that only iterates and counts events (the framework's ceiling).
Prints a markdown table (medians over the repeats) and writes
benchmarks/results/ingest.json and ingest.md. Never asserts.

With ``--format json`` the topic holds the same records as JSON readings (a message is an
array of 32 ``{"pixels": [64 numbers], "digit": d, "ts": ms, "n": seq}``), and A (the
worker with ``input.format = "json"`` and that mapping) runs against
  J = a plain aiokafka consumer that parses each message with the same library (orjson)
      and builds the same feature and label arrays (numpy), timed as C;
results in ingest_json.json and ingest_json.md.

With ``--format avro`` the topic holds the same readings as plain Avro (each message one
datum of ``AVRO_SCHEMA``, an array of reading records, written without a schema id), and A
(the worker with ``input.format = "avro"``, the same mapping and ``input.schema_file``)
runs against
  V = a plain aiokafka consumer that decodes each message with fastavro alone
      (``schemaless_reader`` with the same parsed schema) and builds the same arrays, timed
      as C;
results in ingest_avro.json and ingest_avro.md.

    python -m edgestream bench ingest [--messages 150000] [--repeats 3] [--format json|avro] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from edgestream.job.config import load_config
from edgestream.job.topics import sensor_topics_for
from edgestream.monitoring.scrape import scrape
from edgestream.pipeline.kafka_io import ensure_topics, producer
from edgestream.pipeline.run import start_worker_process, stop_process
from edgestream.streams import codec, topics
from edgestream.streams.records import RecordBatch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RECORDS_PER_MESSAGE = 32
#: Every consumer measured, in run order, with its table label.
CONSUMERS = {
    "edgestream_direct": "edgestream, direct source (decode + buffer + batch)",
    "edgestream_direct_unchecked": "edgestream, direct source without the duplicate and event-time checks",
    "edgestream_faust": "edgestream, Faust source (decode + buffer + batch)",
    "plain_aiokafka": "plain aiokafka (read + count)",
    "bare_faust": "bare Faust agent (iterate + count)",
}

#: ``--format json``: the consumers measured, in run order.
JSON_CONSUMERS = {
    "edgestream_direct": "edgestream, direct source, JSON input (parse + map + check + buffer + batch)",
    "plain_aiokafka_json": "plain aiokafka + orjson (parse + build the feature, label, time and seq arrays)",
}
#: ``--format avro``: the consumers measured, in run order.
AVRO_CONSUMERS = {
    "edgestream_direct": "edgestream, direct source, Avro input (decode + map + check + buffer + batch)",
    "plain_aiokafka_avro": "plain aiokafka + fastavro (decode + build the feature, label, time and seq arrays)",
}

PLAIN_CONSUMER = r"""
import asyncio, json, sys, time
from aiokafka import AIOKafkaConsumer

def parsed(message):
    # ``json`` / ``avro``: read the readings with orjson / fastavro and build the arrays
    # edgestream's batch holds.
    readings = load(message.value)
    features = np.asarray([r["pixels"] for r in readings], dtype=np.float32)
    labels = np.asarray([r["digit"] for r in readings], dtype=np.int32)
    times = np.asarray([r["ts"] for r in readings], dtype=np.float64) / 1e3
    seq = np.asarray([r["n"] for r in readings], dtype=np.uint64)
    assert len(labels) == len(times) == len(seq) == len(features)

async def main(bootstrap, topic, expected, parse):
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=sys.argv[4],
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                max_partition_fetch_bytes=16 * 1024 * 1024)
    await consumer.start()
    seen, first = 0, None
    try:
        while seen < expected:
            batch = await consumer.getmany(timeout_ms=1000, max_records=10000)
            for records in batch.values():
                if records and first is None:
                    first = time.monotonic()
                if parse:
                    for record in records:
                        parsed(record)
                seen += len(records)
        last = time.monotonic()
    finally:
        await consumer.stop()
    print(json.dumps({"messages": seen, "seconds": last - first}))

parse = sys.argv[5] if len(sys.argv) > 5 else ""
if parse:
    import numpy as np
if parse == "json":
    from orjson import loads as load
elif parse == "avro":
    import io
    import fastavro
    with open(sys.argv[6], encoding="utf-8") as schema_file:
        schema = fastavro.parse_schema(json.load(schema_file))
    reader = fastavro.schemaless_reader

    def load(value):
        return reader(io.BytesIO(value), schema)
asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), bool(parse)))
"""
BARE_FAUST = r"""
import os, sys, tempfile, time, uuid
import faust

bootstrap, topic, expected, result_fd, work = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
app = faust.App("bare-" + uuid.uuid4().hex[:6], broker="kafka://" + bootstrap, store="memory://",
                datadir=tempfile.mkdtemp(prefix="bare-faust-", dir=work), web_enabled=False, topic_disable_leader=True, consumer_auto_offset_reset="earliest",
                autodiscover=False, consumer_max_fetch_size=16 * 1024 * 1024)
source = app.topic(topic, key_serializer="raw", value_serializer="raw")
state = {"n": 0, "first": None}

@app.agent(source)
async def count(stream):
    async for _event in stream.events():
        if state["first"] is None:
            state["first"] = time.monotonic()
        state["n"] += 1
        if state["n"] >= expected:
            os.write(result_fd, ("%d %.6f\n" % (state["n"], time.monotonic() - state["first"])).encode())
            os._exit(0)

faust.Worker(app, loglevel="error", quiet=True).execute_from_commandline()
"""


#: The JSON mapping of the readings ``prefill`` writes with ``fmt="json"``.
JSON_MAPPING = ("input.format=json", "input.features_array=pixels", "input.label=digit", "input.event_time=ts",
                "input.time_unit=ms", "input.record_id=n")


def json_message(features: np.ndarray, labels: np.ndarray, seq: np.ndarray, t_ms: int) -> bytes:
    """One message of ``--format json``: an array of readings."""
    import orjson

    return orjson.dumps(_readings(features, labels, seq, t_ms))


def _readings(features: np.ndarray, labels: np.ndarray, seq: np.ndarray, t_ms: int) -> list[dict]:
    return [{"pixels": f.tolist(), "digit": int(d), "ts": t_ms, "n": int(n)}
            for f, d, n in zip(features, labels, seq, strict=True)]


#: ``--format avro``: a message is one datum of this schema, the JSON mode's readings as
#: Avro records (the pixels as Avro floats, which hold float32 values exactly).
AVRO_SCHEMA = {"type": "array", "items": {"type": "record", "name": "Reading", "namespace": "bench", "fields": [
    {"name": "pixels", "type": {"type": "array", "items": "float"}},
    {"name": "digit", "type": "int"},
    {"name": "ts", "type": "long"},
    {"name": "n", "type": "long"},
]}}


def avro_mapping(schema_file: Path) -> tuple[str, ...]:
    """The job settings of ``--format avro``: the JSON mapping, Avro read with ``schema_file``."""
    return ("input.format=avro", *JSON_MAPPING[1:], f"input.schema_file={schema_file}")


def avro_message(features: np.ndarray, labels: np.ndarray, seq: np.ndarray, t_ms: int,
                 parsed_schema: object | None = None) -> bytes:
    """One message of ``--format avro``: the readings of ``json_message`` as one datum of
    ``AVRO_SCHEMA`` (``parsed_schema``: that schema parsed by fastavro, to parse it once)."""
    import io

    import fastavro

    out = io.BytesIO()
    schema = parsed_schema if parsed_schema is not None else fastavro.parse_schema(AVRO_SCHEMA)
    fastavro.schemaless_writer(out, schema, _readings(features, labels, seq, t_ms))
    return out.getvalue()


def prefill(bootstrap: str, device: str, messages: int, fmt: str = "edgestream") -> int:
    ensure_topics(bootstrap, sensor_topics_for([device]))
    rng = np.random.default_rng(0)
    prod = producer(bootstrap, linger_ms=20, batch_size=1 << 20, acks=1, enable_idempotence=False)
    # A pool of 64 feature/label blocks reused round-robin, each message with its own
    # sequence numbers: a resent (device, seq) is a duplicate the worker drops
    # (``data.duplicate_window``), so reusing whole messages would time the drop path.
    pool = [(rng.random((RECORDS_PER_MESSAGE, 64), dtype=np.float32),
             rng.integers(0, 10, RECORDS_PER_MESSAGE).astype(np.int32)) for _ in range(64)]
    size = 0
    if fmt == "avro":
        import fastavro

        schema = fastavro.parse_schema(AVRO_SCHEMA)
    for i in range(messages):
        features, labels = pool[i % len(pool)]
        seq = np.arange(i * RECORDS_PER_MESSAGE, (i + 1) * RECORDS_PER_MESSAGE, dtype=np.uint64)
        if fmt == "json":
            payload = json_message(features, labels, seq, int(time.time() * 1000))
        elif fmt == "avro":
            payload = avro_message(features, labels, seq, int(time.time() * 1000), schema)
        else:
            payload = codec.encode(RecordBatch(
                device=device, seq=seq, event_time=np.full(RECORDS_PER_MESSAGE, time.time()),
                features=features, labels=labels,
            ))
        size = len(payload)
        prod.send(topics.sensor_topic(device), value=payload, key=device.encode())
    prod.flush()
    prod.close()
    return size


#: The job settings that turn off the two per-record checks of ``data`` (a sequence number
#: seen before, an event time off the broker's clock): the ingest work as it was before
#: they existed, beside the default that has them.
UNCHECKED = ("data.duplicate_window=0", "data.max_timestamp_skew_s=none")


def run_edgestream(bootstrap: str, device: str, messages: int, work: Path, source: str,
                   extra: tuple[str, ...] = ()) -> dict:
    job = f"bench{uuid.uuid4().hex[:6]}"
    cfg = load_config(overrides=[
        f"job.name={job}", f"run.state_dir={work / job}", "devices.count=1", f"devices.ids={device}",
        "batcher.mode=window", "batcher.window_s=0.05", "batcher.max_batch=100000",
        "buffer.policy=persist", "buffer.capacity=1000000", f"kafka.ingest_source={source}", *extra,
    ], env={})
    cfg_path = work / f"{job}.json"
    cfg_path.write_text(json.dumps(cfg.to_dict()))
    log = work / f"{job}.log"
    proc = start_worker_process(cfg_path, "w0", bootstrap, 0, log)
    expected = messages * RECORDS_PER_MESSAGE
    try:
        endpoint = cfg.state_path() / "workers" / "w0" / "endpoint.json"
        deadline = time.monotonic() + 120
        while not endpoint.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker failed to start; see {log}")
            time.sleep(0.05)
        # Only the two series the timing needs: a full exposition every 20 ms would cost the
        # worker's event loop about 5% (it is rendered in a thread of the same process).
        url = json.loads(endpoint.read_text())["metrics"] + (
            "?name[]=edgestream_records_in_total&name[]=edgestream_batched_records_total"
        )
        first = None
        while True:
            s = scrape(url)
            now = time.monotonic()
            if s is not None:
                got = s.get("edgestream_records_in_total", device=device)
                done = s.get("edgestream_batched_records_total", device=device)
                if got > 0 and first is None:
                    # the first poll that sees records: back-date by what was already read
                    first = now - 0.02
                if done >= expected:
                    return {"records": int(done), "seconds": now - first}
            if proc.poll() is not None or now > deadline + 600:
                raise RuntimeError(f"worker stopped or stalled; see {log}")
            time.sleep(0.02)  # metrics poll interval
    finally:
        stop_process(proc)


def run_plain(bootstrap: str, device: str, messages: int, parse: str = "", schema_file: Path | None = None) -> dict:
    """A plain aiokafka consumer reading the topic: counting its messages, or with ``parse =
    "json"`` / ``"avro"`` also decoding each as ``--format json`` / ``avro`` writes them (Avro
    with the schema in ``schema_file``)."""
    out = subprocess.run(
        [sys.executable, "-c", PLAIN_CONSUMER, bootstrap, topics.sensor_topic(device), str(messages),
         f"plain-{uuid.uuid4().hex[:6]}", parse, *([str(schema_file)] if schema_file is not None else [])],
        capture_output=True, text=True, check=True, timeout=900,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"records": result["messages"] * RECORDS_PER_MESSAGE, "seconds": result["seconds"]}


def run_bare_faust(bootstrap: str, device: str, messages: int, work: Path) -> dict:
    """A Faust agent that only iterates and counts events: the framework's own ceiling."""
    import os

    read_fd, write_fd = os.pipe()
    log = tempfile.NamedTemporaryFile(prefix="bare-faust-", suffix=".log", dir=work, delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-c", BARE_FAUST, bootstrap, topics.sensor_topic(device), str(messages), str(write_fd), str(work)],
        pass_fds=(write_fd,), stdout=log, stderr=subprocess.STDOUT,
    )
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        line = pipe.readline()  # the child writes one line when done (or closes: it died)
    proc.wait(timeout=60)
    if not line:
        raise RuntimeError(f"bare Faust consumer exited without a result; see {log.name}")
    count, seconds = line.split()
    return {"records": int(count) * RECORDS_PER_MESSAGE, "seconds": float(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=150_000,
                        help="messages of 32 records in the topic (4.8M records: each timed read lasts about "
                             "5 s at a million records/s, so the fixed ends of a read (the 20 ms metrics "
                             "poll, the 50 ms window the last batch waits for, the first fetch) stay within "
                             "a few per cent of it)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of A E B C D, interleaved")
    parser.add_argument("--bootstrap", help="existing cluster (default: start a local broker)")
    parser.add_argument("--format", choices=("edgestream", "json", "avro"), default="edgestream",
                        help="the messages' format: edgestream's binary one (A E B C D), JSON readings "
                             "(A against J; results in ingest_json.*) or Avro readings (A against V; results "
                             "in ingest_avro.*)")
    args = parser.parse_args()
    if args.messages < 1 or args.repeats < 1:
        parser.error("--messages and --repeats must be at least 1")

    from edgestream.deploy.kafka.broker import LocalBroker, kafka_version

    work = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    broker = None
    bootstrap = args.bootstrap
    if not bootstrap:
        broker = LocalBroker(work / "kafka").start()
        bootstrap = broker.bootstrap
    try:
        device = f"bench{uuid.uuid4().hex[:6]}"
        print(f"pre-filling {args.messages} messages x {RECORDS_PER_MESSAGE} records ...", flush=True)
        message_bytes = prefill(bootstrap, device, args.messages, args.format)
        consumers = {"json": JSON_CONSUMERS, "avro": AVRO_CONSUMERS}.get(args.format, CONSUMERS)
        schema_file = work / "readings.avsc"
        if args.format == "avro":
            schema_file.write_text(json.dumps(AVRO_SCHEMA))
        plan = (
            ("edgestream_direct", lambda: run_edgestream(bootstrap, device, args.messages, work, "direct",
                                                         JSON_MAPPING)),
            ("plain_aiokafka_json", lambda: run_plain(bootstrap, device, args.messages, "json")),
        ) if args.format == "json" else (
            ("edgestream_direct", lambda: run_edgestream(bootstrap, device, args.messages, work, "direct",
                                                         avro_mapping(schema_file))),
            ("plain_aiokafka_avro", lambda: run_plain(bootstrap, device, args.messages, "avro", schema_file)),
        ) if args.format == "avro" else (
            ("edgestream_direct", lambda: run_edgestream(bootstrap, device, args.messages, work, "direct")),
            ("edgestream_direct_unchecked",
             lambda: run_edgestream(bootstrap, device, args.messages, work, "direct", UNCHECKED)),
            ("edgestream_faust", lambda: run_edgestream(bootstrap, device, args.messages, work, "faust")),
            ("plain_aiokafka", lambda: run_plain(bootstrap, device, args.messages)),
            ("bare_faust", lambda: run_bare_faust(bootstrap, device, args.messages, work)),
        )
        runs: dict[str, list[dict]] = {name: [] for name in consumers}
        for r in range(args.repeats):
            for name, fn in plan:
                res = fn()
                res["records_per_s"] = res["records"] / res["seconds"]
                runs[name].append(res)
                print(f"repeat {r + 1}/{args.repeats} {name}: {res['records_per_s']:,.0f} records/s", flush=True)
    finally:
        if broker is not None:
            broker.stop()
    shutil.rmtree(work, ignore_errors=True)  # its broker's log and the processes' logs; a run that failed keeps them (it raised above)

    def summary(name: str) -> dict:
        rates = [x["records_per_s"] for x in runs[name]]
        return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}

    def ratios(a: str, b: str) -> list[float]:
        """Per repeat: consumer ``a``'s rate over ``b``'s from the same repeat."""
        return [x["records_per_s"] / y["records_per_s"] for x, y in zip(runs[a], runs[b], strict=True)]

    spread = {name: summary(name) for name in consumers}
    ratio_rows = {
        "edgestream_direct / plain_aiokafka_json": ratios("edgestream_direct", "plain_aiokafka_json"),
    } if args.format == "json" else {
        "edgestream_direct / plain_aiokafka_avro": ratios("edgestream_direct", "plain_aiokafka_avro"),
    } if args.format == "avro" else {
        "edgestream_direct / plain_aiokafka": ratios("edgestream_direct", "plain_aiokafka"),
        "edgestream_direct_unchecked / plain_aiokafka": ratios("edgestream_direct_unchecked", "plain_aiokafka"),
        "edgestream_faust / plain_aiokafka": ratios("edgestream_faust", "plain_aiokafka"),
        "edgestream_direct / bare_faust": ratios("edgestream_direct", "bare_faust"),
        "edgestream_faust / bare_faust": ratios("edgestream_faust", "bare_faust"),
    }
    import aiokafka
    import fastavro
    import faust

    out_name = f"ingest_{args.format}" if args.format in ("json", "avro") else "ingest"
    result = {
        "benchmark": out_name,
        "format": args.format,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": __import__("os").cpu_count()},
        "versions": {"kafka": kafka_version(), "faust": faust.__version__, "aiokafka": aiokafka.__version__,
                     "fastavro": fastavro.__version__},
        "config": {"messages": args.messages, "records_per_message": RECORDS_PER_MESSAGE,
                   "message_bytes": message_bytes, "repeats": args.repeats, "features": 64,
                   "batcher": "window 0.05 s, max_batch 100000", "buffer": "persist",
                   "unchecked": list(UNCHECKED), "json_mapping": list(JSON_MAPPING) if args.format == "json" else None,
                   "avro_mapping": list(avro_mapping(Path("readings.avsc"))) if args.format == "avro" else None,
                   "avro_schema": AVRO_SCHEMA if args.format == "avro" else None},
        "runs": runs,
        "median_records_per_s": {name: spread[name]["median"] for name in consumers},
        "spread": spread,
        "ratios_per_repeat": ratio_rows,
        "ratio_medians": {name: statistics.median(values) for name, values in ratio_rows.items()},
        "targets": {"ratio_vs_plain_aiokafka": 0.8, "records_per_s": 100_000},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{out_name}.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"{args.messages} messages x {RECORDS_PER_MESSAGE} records ({args.format}, {message_bytes} bytes each), "
        f"{args.repeats} repeats ({' '.join(n for n, _ in plan)} interleaved); records/s",
        "",
        "| consumer | median | min | max |",
        "|---|---:|---:|---:|",
    ]
    for consumer in consumers:
        row = spread[consumer]
        lines.append(f"| {consumers[consumer]} | {row['median']:,.0f} | {row['min']:,.0f} | {row['max']:,.0f} |")
    lines += ["", "| ratio (same repeat) | median | min | max |", "|---|---:|---:|---:|"]
    for row_name, values in ratio_rows.items():
        lines.append(f"| {row_name} | {statistics.median(values):.2f}x | {min(values):.2f}x | {max(values):.2f}x |")
    table = "\n".join(lines)
    (RESULTS / f"{out_name}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
