"""A recording replayed through a job's worker processes (``replay_through_workers``).

It starts the workers as ``edgestream run`` does (``pipeline.run``), replays the recording
into their device topics (``pipeline.replay.replay``), drains and stops them, and returns
their final accounting, so a recorded run can be compared with the live one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from edgestream.job.config import JobConfig
from edgestream.job.sources import job_fleet_data
from edgestream.job.topics import job_topics, sensor_partitions
from edgestream.pipeline.exits import ENDPOINT_FILE
from edgestream.pipeline.replay import ReplayReport, TopicRenamer, expected_from_recording, replay
from edgestream.streams import codec, topics
from edgestream.streams.recording import RecordingReader, ReplayError


def replay_through_workers(
    cfg: JobConfig,
    bootstrap: str,
    directory: str | Path,
    *,
    rename: Iterable[str],
    speed: float = 1.0,
    ready_timeout_s: float = 90.0,
) -> tuple[ReplayReport, dict[str, dict[str, int]]]:
    """Start ``cfg``'s workers, replay ``directory`` into their device topics, drain, stop.

    The recording's ``sensors.<old>`` topics must be renamed (``rename``) onto
    ``sensors.<device>`` for ``cfg``'s device ids; device ids inside the messages are
    rewritten to match. Returns the replay report and the workers' final per-device
    accounting (``accounting.json``, as in ``RunResult.accounting``).
    """
    from edgestream.monitoring.scrape import scrape
    from edgestream.pipeline.app import sensor_group
    from edgestream.pipeline.kafka_io import ensure_topics, start_groups_at_end
    from edgestream.pipeline.run import (
        RunError,
        WorkerProc,
        device_view,
        drained,
        prepare_state,
        scrape_all,
        start_worker_process,
        stop_process,
        wait_for,
    )
    from edgestream.pipeline.simulate import SimulationReport

    state, cfg_path = prepare_state(cfg)
    devices = cfg.devices.device_ids()
    renamer = TopicRenamer(rename)
    reader = RecordingReader(directory)
    layout = cfg.input.layout()  # input.topic: the job's device topics
    if layout.keyed:
        raise ReplayError(f"input.topic={cfg.input.topic!r} is a topic shared by every device, and a recording "
                          "replays one topic per device: run the replay with a pattern holding {device}")
    rules = list(rename)
    mapping = {}
    for t in reader.topics:
        dest = renamer(t)
        if layout.matches(dest):
            device = layout.device_of(dest)
        elif dest == t and topics.DEFAULT_LAYOUT.matches(t):
            # Recorded as sensors.<device>: into that device's topic of the job's layout.
            device = topics.device_of(t)
            if device in devices:
                rules.append(f"{t}:{layout.topic(device)}")
        else:
            continue
        if device in devices:
            mapping[t] = device
    missing = sorted(set(devices) - set(mapping.values()))
    if missing:
        raise ReplayError(f"no recorded topic is renamed onto the devices {missing}")
    data = job_fleet_data(cfg)
    limits = codec.DecodeLimits(cfg.limits.max_record_message_bytes, cfg.limits.max_records_per_message)
    records, garbage = expected_from_recording(directory, mapping, data.num_classes, data.feature_shape,
                                               limits)
    expected = SimulationReport(records=records, garbage={d: {"replayed": n} for d, n in garbage.items()})
    ensure_topics(bootstrap, job_topics(cfg), sized=sensor_partitions(cfg))
    start_groups_at_end(
        bootstrap,
        {sensor_group(cfg, w): [layout.topic(d) for d in cfg.devices_of(w)] for w in cfg.worker_names()},
    )
    workers: list[WorkerProc] = []

    def alive() -> None:
        for w in workers:
            if w.proc.poll() is not None:
                raise RunError(f"worker {w.name} exited with code {w.proc.returncode}; see {w.log_path}")

    def endpoint(w: WorkerProc) -> str | None:
        alive()
        path = state / "workers" / w.name / ENDPOINT_FILE
        return json.loads(path.read_text())["metrics"] if path.exists() else None

    try:
        for name in cfg.worker_names():
            log_path = state / "logs" / f"{name}.log"
            proc = start_worker_process(cfg_path, name, bootstrap, 0, log_path)
            workers.append(WorkerProc(name, proc, cfg.devices_of(name), log_path=log_path))
        for w in workers:
            w.metrics_url = wait_for(lambda w=w: endpoint(w), ready_timeout_s, f"worker {w.name} to start")
            wait_for(lambda w=w: (s := scrape(w.metrics_url)) is not None
                     and s.get("edgestream_worker_ready", worker=w.name) == 1,
                     ready_timeout_s, f"worker {w.name} to join its device topics")
        report = replay(directory, bootstrap, speed=speed, rename=rules, rewrite_devices=True,
                        topics_filter=sorted(mapping), create_topics=False, layout=layout)

        def check() -> bool:
            alive()
            return drained(cfg, device_view(cfg, scrape_all(workers), expected), expected)

        wait_for(check, cfg.run.drain_timeout_s, "every replayed record to be accounted for",
                 on_fail=lambda: "; per device: " + json.dumps(device_view(cfg, scrape_all(workers), expected)))
    finally:
        codes = {w.name: stop_process(w.proc) for w in workers}
    accounting: dict[str, dict[str, int]] = {}
    for w in workers:
        path = state / "workers" / w.name / "accounting.json"
        if not path.exists():
            raise RunError(f"worker {w.name} exited ({codes.get(w.name)}) without writing {path}")
        accounting.update(json.loads(path.read_text())["devices"])
    return report, accounting
