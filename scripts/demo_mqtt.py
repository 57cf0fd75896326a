"""`make demo-mqtt`: online training on real smartwatch readings that arrive over MQTT.

Everything of examples/basicmotions-mqtt.toml on this machine, each part as it would run
at the edge:

1. the data: BasicMotions converted once (scripts/fetch_basicmotions.py; skipped when the
   file is there);
2. a local Kafka broker (as `edgestream run` starts one) and a local Mosquitto MQTT broker
   (`edgestream.deploy.mqtt`), unless --bootstrap / --mqtt name running ones;
3. `edgestream bridge mqtt` (its own process): MQTT watches/+/motion -> Kafka
   watches.<id>.motion;
4. `edgestream run` on the job (devices.external: no simulators), with its live view; once
   its workers are ready, the watches (python -m edgestream.pipeline.watches, their own
   process) publish for --publish seconds; when they are done and the bridge has forwarded
   every reading, the run drains and prints its accounting and the held-out accuracy;
5. one line on the chain: published over MQTT = acknowledged by Mosquitto = forwarded by
   the bridge = produced in Kafka = trained + dropped + dead-lettered + pending.

    scripts/with-venv.sh python scripts/demo_mqtt.py [--publish 75] [--set section.key=value ...]

Exit code: 0 when every reading is accounted for along the chain, 4 when the run's
accounting does not balance or the counts along the chain differ, 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a file from the checkout (scripts/with-venv.sh sets it too)
    sys.path.insert(0, str(REPO))

from edgestream.cli.run import run_console  # noqa: E402
from edgestream.job.config import load_config  # noqa: E402
from edgestream.monitoring.scrape import scrape  # noqa: E402
from edgestream.pipeline.exits import EXIT_UNBALANCED  # noqa: E402

DEFAULT_JOB = REPO / "examples" / "basicmotions-mqtt.toml"


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, *args]


def start(argv: list[str], log: Path) -> subprocess.Popen:
    """A process of the demo in its own session, its output appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        return subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop(proc: subprocess.Popen, timeout_s: float = 20.0) -> int | None:
    """SIGTERM ``proc`` (one process: it stops its own threads) and wait; SIGKILL after ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    return proc.returncode


def wait_for(predicate, timeout_s: float, what: str, log: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            tail = f"; its log ({log}):\n{log.read_text()[-2000:]}" if log and log.exists() else ""
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}{tail}")
        time.sleep(0.2)  # poll interval of a deadline wait
    return value


def bridge_metrics(log: Path) -> str | None:
    lines = [line.split()[-1] for line in log.read_text().splitlines() if line.startswith("bridge /metrics:")]
    return lines[-1] if lines else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Online training on real smartwatch readings over MQTT.")
    parser.add_argument("--job", type=Path, default=DEFAULT_JOB)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a job key (repeatable), as `edgestream run --set`")
    parser.add_argument("--publish", type=float, default=75.0, help="seconds the watches publish (default 75)")
    parser.add_argument("--bootstrap", help="an existing Kafka cluster (default: start a local broker)")
    parser.add_argument("--mqtt", help="an existing MQTT broker HOST:PORT (default: start a local Mosquitto)")
    parser.add_argument("--report", type=Path, help="write the chain's counts and the run's result as JSON here")
    args = parser.parse_args(argv)

    from edgestream.deploy.kafka.broker import LocalBroker, kafka_version
    from edgestream.deploy.mqtt import LocalMosquitto
    from edgestream.pipeline.run import run_job

    console = run_console()
    sets = list(args.set)
    cfg = load_config(args.job, sets)
    data_file = Path(cfg.data.series_file).expanduser()
    if not data_file.is_file():
        console.print(f"[bold]1. the data[/bold]: converting BasicMotions into {data_file}")
        subprocess.run(python_cmd(str(REPO / "scripts" / "fetch_basicmotions.py"), "--out", str(data_file)),
                       cwd=REPO, check=True)
    state = cfg.state_path()
    state.mkdir(parents=True, exist_ok=True)
    logs = state / "logs"
    broker = mosquitto = bridge = None
    watches: dict = {}
    work = Path(tempfile.mkdtemp(prefix="demo-", dir=str(state)))
    try:
        bootstrap = args.bootstrap
        if not bootstrap:
            with console.status(f"starting a local Kafka {kafka_version()} broker"):
                broker = LocalBroker(work / "kafka").start()
            bootstrap = broker.bootstrap
        address = args.mqtt
        if not address:
            mosquitto = LocalMosquitto(work / "mosquitto").start()
            address = mosquitto.address
        console.print(f"[bold]2. brokers[/bold]: Kafka {bootstrap}, MQTT {address}")
        sets += [f"mqtt.broker={address}", f"run.duration_s={args.publish + 60:g}"]
        cfg = load_config(args.job, sets)
        job_args = [arg for s in sets for arg in ("--set", s)]
        bridge_log = logs / "bridge.log"
        bridge_log.unlink(missing_ok=True)
        bridge = start(python_cmd("-m", "edgestream", "bridge", "mqtt", "--job", str(args.job), "--bootstrap",
                                  bootstrap, "--report", str(state / "bridge.json"), *job_args), bridge_log)
        url = wait_for(lambda: bridge_metrics(bridge_log) or (bridge.poll() is not None and "exited"), 60,
                       "the bridge to start", bridge_log)
        if url == "exited":
            raise RuntimeError(f"the bridge exited: {bridge_log.read_text()[-2000:]}")
        console.print(f"[bold]3. bridge[/bold]: MQTT {cfg.mqtt.topics[0]} -> Kafka {cfg.input.topic} "
                      f"(log {bridge_log})")

        def watches_publish(ctx) -> None:
            """The run's hook, once its workers are ready: the watches publish, then the run ends."""
            log = logs / "watches.log"
            log.unlink(missing_ok=True)
            proc = start(python_cmd("-m", "edgestream.pipeline.watches", "--job", str(args.job), "--mqtt", address,
                                    "--duration", f"{args.publish:g}", "--report", str(state / "watches.json"),
                                    *job_args), log)
            watches["proc"], watches["log"] = proc, log
            try:
                while proc.poll() is None and not ctx.stop.is_set():
                    time.sleep(0.5)  # poll interval: the watches' end, or the run's
            finally:
                if proc.poll() is None:
                    stop(proc)
            published = sum(json.loads((state / "watches.json").read_text())["published"].values()) \
                if (state / "watches.json").exists() else 0

            def forwarded_all() -> bool:
                sample = scrape(url)
                return sample is not None and sample.get("edgestream_bridge_forwarded_messages_total") >= published \
                    and sample.get("edgestream_bridge_in_flight_messages") == 0

            wait_for(forwarded_all, 60, f"the bridge to forward the {published} readings", bridge_log)
            ctx.stop_streaming()  # the watches are done: the run counts what arrived and drains

        console.print(f"[bold]4. edgestream run[/bold] --job {args.job.relative_to(REPO) if args.job.is_relative_to(REPO) else args.job}: "
                      f"the {cfg.devices.count} watches publish for {args.publish:g} s once the workers are ready",
                      soft_wrap=True)
        result = run_job(cfg, bootstrap, console=console, on_streaming=watches_publish)
    finally:
        if "proc" in watches and watches["proc"].poll() is None:
            stop(watches["proc"])
        if bridge is not None:
            stop(bridge)
        if mosquitto is not None:
            mosquitto.stop()
        if broker is not None:
            broker.stop()
        shutil.rmtree(work, ignore_errors=True)

    watches_report = json.loads((state / "watches.json").read_text())
    bridge_report = json.loads((state / "bridge.json").read_text())
    chain = {
        "published": sum(watches_report["published"].values()),
        "acknowledged_by_mqtt": sum(watches_report["acknowledged"].values()),
        "forwarded_by_bridge": sum(bridge_report["forwarded"].get(d, 0) for d in cfg.devices.device_ids()),
        "produced_in_kafka": sum(result.produced.values()),
        "trained": sum(a["consumed"] for a in result.accounting.values()),
        "dropped": sum(a["dropped"] for a in result.accounting.values()),
        "dead_lettered": sum(a["dead_records"] for a in result.accounting.values()),
        "pending": sum(a["buffered"] + a["in_sink"] for a in result.accounting.values()),
    }
    from edgestream.job.sources import job_fleet_data
    from edgestream.streams.series_file import load_series_file

    data = job_fleet_data(cfg)
    accuracy = {w: t["accuracy"] for w, t in sorted(result.training.items()) if t.get("evaluates_model", True)}
    chained = len({chain["published"], chain["acknowledged_by_mqtt"], chain["forwarded_by_bridge"],
                   chain["produced_in_kafka"]}) == 1
    console.print(f"[bold]5. the chain[/bold]: {chain['published']} readings published over MQTT, "
                  f"{chain['acknowledged_by_mqtt']} acknowledged by the MQTT broker, {chain['forwarded_by_bridge']} "
                  f"forwarded by the bridge, {chain['produced_in_kafka']} in Kafka = {chain['trained']} trained + "
                  f"{chain['dropped']} dropped + {chain['dead_lettered']} dead-lettered + {chain['pending']} pending"
                  + ("" if chained else " [red](the counts differ)[/red]"), soft_wrap=True)
    # Each watch stamps a reading with the time it publishes it: a trained record's age is the
    # time from MQTT publish to the step that trained it (bridge, Kafka, batching, the step).
    latency = {w: t.get("record_age_s", {}) for w, t in sorted(result.training.items())}
    if any(s.get("kept") for s in latency.values()):
        console.print("publish over MQTT to trained, per worker: " + "; ".join(
            f"{w} p50 {s['p50']:.2f} s, p99 {s['p99']:.2f} s" for w, s in latency.items() if s.get("kept")),
            soft_wrap=True)
    best = max(accuracy.values()) if accuracy else float("nan")
    test_series = len(load_series_file(data_file).test_series)
    console.print(f"held-out accuracy {best:.3f} on {len(data.heldout)} windows of the archive's "
                  f"{test_series} test series, never published "
                  f"(chance {1 / data.num_classes:.2f}; per worker: "
                  + ", ".join(f"{w} {a:.3f}" for w, a in accuracy.items()) + ")", soft_wrap=True)
    if args.report:
        args.report.write_text(json.dumps({"chain": chain, "accuracy": accuracy, "heldout_rows": len(data.heldout),
                                           "num_classes": data.num_classes, "balanced": result.balanced,
                                           "outcome": result.outcome, "duration_s": result.duration_s,
                                           "steps": {w: t["steps"] for w, t in result.training.items()},
                                           "publish_to_trained_s": latency},
                                          indent=2))
    return 0 if result.balanced and chained else EXIT_UNBALANCED


if __name__ == "__main__":
    sys.exit(main())
