"""Replay throughput at max speed vs Kafka's own ProducerPerformance, and timing fidelity at 1x.

Throughput: for each record size the simulators emit (a digits message of 32 records and
a small one of 4 records, encoded by streams.codec), a recording of N messages is written
once; then, A B A B ..., (A) `pipeline.replay.replay(speed=max)` produces it into a fresh
topic, and (B) `org.apache.kafka.tools.ProducerPerformance` from the broker's own jars
sends N records of the same size into another fresh topic. Both use the same producer
settings (acks=1, no idempotence, linger 5 ms, 1 MiB batches, no compression). A's time
runs from its first send to the end of its flush; B's figure is the tool's own report.
Topics are deleted after each run.

Timing fidelity: a 10-device fleet recording (ScaDLES rates, one message per device per
100 ms, as `edgestream simulate` sends) replayed at 1x; inter-arrival error p50/p99.

Prints a markdown table and writes benchmarks/results/replay.json / .md. Never asserts.

    python -m edgestream bench replay [--repeats 3] [--messages-large 20000] [--messages-small 60000]
                                [--fidelity-seconds 10] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from edgestream.pipeline.replay import replay
from edgestream.streams import codec, topics
from edgestream.streams.profiles import SCADLES_RATES
from edgestream.streams.recording import RecordedMessage, RecordingWriter
from edgestream.streams.records import RecordBatch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PRODUCER_PROPS = {"acks": "1", "enable.idempotence": "false", "linger.ms": "5",
                  "batch.size": str(1 << 20), "compression.type": "none",
                  "max.request.size": str(topics.MAX_MESSAGE_BYTES)}
AIOKAFKA_OPTIONS = {"acks": 1, "enable_idempotence": False, "linger_ms": 5,
                    "max_batch_size": 1 << 20, "compression_type": None}
RUNNERS = {"replay_max": "edgestream replay --speed max",
           "perf_record_size": "ProducerPerformance --record-size",
           "perf_payload_file": "ProducerPerformance --payload-file"}
_PERF_LINE = re.compile(r"(\d+) records sent, ([\d.]+) records/sec \(([\d.]+) MB/sec\)")


def digits_message(device: str, records: int, seed: int) -> bytes:
    """A sensor message of ``records`` digits-shaped records (64 float32 features + label)."""
    rng = np.random.default_rng(seed)
    return codec.encode(RecordBatch(
        device=device, seq=np.arange(records, dtype=np.uint64),
        event_time=np.full(records, time.time()),
        features=rng.random((records, 64), dtype=np.float32),
        labels=rng.integers(0, 10, records).astype(np.int32),
    ))


def write_recording(directory: Path, topic: str, messages: int, records_per_message: int) -> int:
    """N messages (a pool of 64 distinct payloads, round-robin), 1 ms apart; returns the size."""
    device = topics.device_of(topic)
    pool = [digits_message(device, records_per_message, s) for s in range(64)]
    t0 = int(time.time() * 1000)
    with RecordingWriter(directory, topics=[topic]) as w:
        for i in range(messages):
            w.write(RecordedMessage(topic, 0, i, t0 + i, device.encode(), pool[i % len(pool)]))
    return len(pool[0])


def fleet_recording(directory: Path, seconds: float) -> int:
    """Ten devices at the ScaDLES rates, one message per device per 100 ms (like simulate)."""
    devices = [f"fid{i:02d}" for i in range(10)]
    t0 = int(time.time() * 1000)
    n = 0
    with RecordingWriter(directory, topics=[topics.sensor_topic(d) for d in devices]) as w:
        for tick in range(int(seconds / 0.1)):
            for i, d in enumerate(devices):
                count = max(1, round(SCADLES_RATES[i] * 0.1))
                w.write(RecordedMessage(topics.sensor_topic(d), 0, tick, t0 + (tick + 1) * 100,
                                        d.encode(), digits_message(d, count, tick)))
                n += 1
    return n


def delete_topics(bootstrap: str, names: list[str]) -> None:
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="bench-replay-admin")
    try:
        admin.delete_topics(names)
    except Exception as exc:  # cleanup only; the figures are already taken
        print(f"  (could not delete {names}: {exc!r})", flush=True)
    finally:
        admin.close()


def run_replay(bootstrap: str, recording: Path, topic: str, message_bytes: int) -> dict:
    dest = f"sensors.bench{uuid.uuid4().hex[:8]}"
    report = replay(recording, bootstrap, speed=float("inf"), rename=[f"{topic}:{dest}"],
                    producer_options=AIOKAFKA_OPTIONS)
    delete_topics(bootstrap, [dest])
    return {"records": report.messages, "seconds": report.duration_s,
            "records_per_s": report.messages_per_s,
            "mb_per_s": report.messages * message_bytes / 1e6 / report.duration_s}


def payload_file(path: Path, message_bytes: int) -> Path:
    """64 ASCII payloads of exactly ``message_bytes`` bytes, one per line (``--payload-file``)."""
    rng = np.random.default_rng(0)
    with open(path, "w") as fh:
        for _ in range(64):
            fh.write("".join(chr(65 + c) for c in rng.integers(0, 26, message_bytes)) + "\n")
    return path


def run_producer_perf(bootstrap: str, jar_dir: Path, messages: int, message_bytes: int,
                      payloads: Path | None = None) -> dict:
    """ProducerPerformance with ``--record-size`` (it fills every record with fresh random
    bytes, which costs it time per record) or, with ``payloads``, ``--payload-file``."""
    from edgestream.pipeline.kafka_io import ensure_topics

    dest = f"sensors.perf{uuid.uuid4().hex[:8]}"
    ensure_topics(bootstrap, {dest: "sensors"})
    props = [f"bootstrap.servers={bootstrap}", *(f"{k}={v}" for k, v in PRODUCER_PROPS.items())]
    cmd = ["java", "-Xmx512m", f"-Dlog4j2.configurationFile={ROOT / 'deploy/kafka/log4j2.yaml'}",
           "-cp", f"{jar_dir}/*", "org.apache.kafka.tools.ProducerPerformance",
           "--topic", dest, "--num-records", str(messages),
           *(["--payload-file", str(payloads)] if payloads else ["--record-size", str(message_bytes)]),
           "--throughput", "-1", "--producer-props", *props]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    delete_topics(bootstrap, [dest])
    lines = [m for m in _PERF_LINE.finditer(out.stdout) if int(m.group(1)) == messages]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"ProducerPerformance failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    final = lines[-1]
    rate = float(final.group(2))
    return {"records": messages, "seconds": messages / rate, "records_per_s": rate,
            "mb_per_s": rate * message_bytes / 1e6, "tool_mb_per_s": float(final.group(3)),
            "summary_line": final.group(0)}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--messages-large", type=int, default=20000, help="messages of 32 records")
    parser.add_argument("--messages-small", type=int, default=60000, help="messages of 4 records")
    parser.add_argument("--fidelity-seconds", type=float, default=10.0)
    parser.add_argument("--fidelity-repeats", type=int, default=3)
    parser.add_argument("--bootstrap", help="existing cluster (default: start a local broker)")
    args = parser.parse_args()

    import aiokafka

    from edgestream.deploy.kafka.broker import LocalBroker, kafka_version, resolve_jars

    work = Path(tempfile.mkdtemp(prefix="bench-replay-"))
    jar_dir = resolve_jars()
    broker = None
    bootstrap = args.bootstrap
    if not bootstrap:
        broker = LocalBroker(work / "kafka").start()
        bootstrap = broker.bootstrap
    sizes = {"digits_32_records": (32, args.messages_large), "digits_4_records": (4, args.messages_small)}
    throughput: dict[str, dict] = {}
    fidelity_runs: list[dict] = []
    try:
        for name, (records, messages) in sizes.items():
            topic = f"sensors.src{uuid.uuid4().hex[:6]}"
            rec = work / f"rec-{name}"
            message_bytes = write_recording(rec, topic, messages, records)
            payloads = payload_file(work / f"payloads-{name}.txt", message_bytes)
            runs: dict[str, list] = {k: [] for k in RUNNERS}
            print(f"{name}: {messages} messages of {message_bytes} bytes", flush=True)
            for r in range(args.repeats):
                for key, label in RUNNERS.items():
                    if key == "replay_max":
                        res = run_replay(bootstrap, rec, topic, message_bytes)
                    else:
                        res = run_producer_perf(bootstrap, jar_dir, messages, message_bytes,
                                                payloads if key == "perf_payload_file" else None)
                    runs[key].append(res)
                    print(f"  repeat {r + 1} {label:<42} {res['records_per_s']:>9,.0f} msgs/s "
                          f"{res['mb_per_s']:7.1f} MB/s", flush=True)
            entry = {"records_per_message": records, "message_bytes": message_bytes, "messages": messages,
                     "runs": runs}
            for key in RUNNERS:
                entry[f"{key}_records_per_s"] = spread([x["records_per_s"] for x in runs[key]])
                entry[f"{key}_mb_per_s"] = spread([x["mb_per_s"] for x in runs[key]])
            for key in ("perf_record_size", "perf_payload_file"):
                ratios = [a["records_per_s"] / b["records_per_s"]
                          for a, b in zip(runs["replay_max"], runs[key], strict=True)]
                entry[f"ratio_vs_{key}_per_repeat"] = ratios
                entry[f"ratio_vs_{key}"] = spread(ratios)
            throughput[name] = entry
        fid_rec = work / "rec-fleet"
        fid_messages = fleet_recording(fid_rec, args.fidelity_seconds)
        print(f"fidelity: {fid_messages} messages over {args.fidelity_seconds:g}s at 1x", flush=True)
        for r in range(args.fidelity_repeats):
            suffix = uuid.uuid4().hex[:6]
            report = replay(fid_rec, bootstrap, speed=1.0, rename=[f"sensors.fid*:sensors.f{suffix}*"])
            delete_topics(bootstrap, list(report.destination.values()))
            t = report.timing
            fidelity_runs.append(t)
            print(f"  repeat {r + 1}: p50 {t['inter_arrival_error_p50_ms']:.2f} ms  "
                  f"p99 {t['inter_arrival_error_p99_ms']:.2f} ms  span {t['achieved_s']:.3f}/{t['requested_s']:.3f} s",
                  flush=True)
    finally:
        if broker is not None:
            broker.stop()
    shutil.rmtree(work, ignore_errors=True)  # its broker's log and the processes' logs; a run that failed keeps them (it raised above)

    java = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr.splitlines()[0]
    fid = {k: spread([run[k] for run in fidelity_runs])
           for k in ("inter_arrival_error_p50_ms", "inter_arrival_error_p99_ms", "lateness_p99_ms")}
    result = {
        "benchmark": "replay",
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "java": java},
        "versions": {"kafka": kafka_version(), "aiokafka": aiokafka.__version__},
        "config": {"repeats": args.repeats, "producer_props": PRODUCER_PROPS,
                   "aiokafka_options": {k: v for k, v in AIOKAFKA_OPTIONS.items()},
                   "sizes": {k: {"records_per_message": v[0], "messages": v[1]} for k, v in sizes.items()},
                   "fidelity": {"devices": 10, "rates_hz": list(SCADLES_RATES), "message_interval_s": 0.1,
                                "seconds": args.fidelity_seconds, "messages": fid_messages,
                                "repeats": args.fidelity_repeats},
                   "broker": "own LocalBroker" if broker is not None else args.bootstrap,
                   "notes": "replay messages carry an 8-byte-ish key (device id); ProducerPerformance "
                            "sends unkeyed random payloads of the same value size"},
        "throughput": throughput,
        "fidelity_1x": {"runs": fidelity_runs, **fid},
        "targets": {"replay_vs_producer_perf": 0.5},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "replay.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = ["| record size | " + " | ".join(f"{label} msgs/s (MB/s)" for label in RUNNERS.values())
            + " | replay / --record-size | replay / --payload-file |",
            "|---|" + "---:|" * (len(RUNNERS) + 2)]
    for name, t in throughput.items():
        cells = []
        for key in RUNNERS:
            r, mb = t[f"{key}_records_per_s"], t[f"{key}_mb_per_s"]
            cells.append(f"{r['median']:,.0f} ({r['min']:,.0f}-{r['max']:,.0f}) ({mb['median']:.1f})")
        for key in ("perf_record_size", "perf_payload_file"):
            q = t[f"ratio_vs_{key}"]
            cells.append(f"{q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f})")
        rows.append(f"| {name} ({t['message_bytes']:,} B) | " + " | ".join(cells) + " |")
    p50, p99 = fid["inter_arrival_error_p50_ms"], fid["inter_arrival_error_p99_ms"]
    rows += ["", "| 1x timing fidelity (10 devices, 100 ms ticks) | median | min | max |", "|---|---:|---:|---:|",
             f"| inter-arrival error p50 (ms) | {p50['median']:.2f} | {p50['min']:.2f} | {p50['max']:.2f} |",
             f"| inter-arrival error p99 (ms) | {p99['median']:.2f} | {p99['min']:.2f} | {p99['max']:.2f} |"]
    table = "\n".join(rows)
    (RESULTS / "replay.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
