"""The PyTorch DDP (gloo) peer of the time-to-accuracy benchmark: what users would pick instead.

One process per device. Rank ``i`` reads the Kafka topic ``sensors.<device i>`` with a plain
kafka-python consumer (manual assignment, its own group id, nothing committed), decodes the
EDGS records with ``streams.codec`` (malformed messages are counted by reason and skipped;
nothing is unpickled), collects exactly ``batch`` records, and takes a synchronous SGD step
through ``DistributedDataParallel`` over gloo. That is the straggler behaviour of
fixed-batch BSP: every rank waits for its own batch, then the gradient all-reduce waits for
the slowest rank.

Same work as our workers: the model is ``trainers.build_model(cfg.train.model, ...,
seed=cfg.job.seed)`` (identical initial weights), the optimizer is what ``LocalTrainer``
uses (SGD with ``cfg.train.lr`` and ``cfg.train.momentum``, no weight decay, no Nesterov),
the loss is mean cross-entropy, torch runs one thread per process. DDP averages the
gradients over ranks, which is the BSP update of equal batches. With a BatchNorm model
(``digits_cnn``) DDP broadcasts rank 0's running statistics at every forward, as DDP users
get by default.

Compute heterogeneity is emulated by waiting: after its backward pass, rank ``i`` sleeps
``(slowdown_i - 1) * compute`` where ``compute`` is the CPU time its thread spent in
forward + backward (CPU time, so time blocked in the all-reduce is not counted). The sleep
delays this rank's next collective, which the other ranks then wait for.

DDP collectives need every rank to take the same number of steps, so before each step the
ranks all-reduce (MAX) a small stop vector: rank 0 sets "target" once the held-out accuracy
reached the target in 3 consecutive evaluations; every rank sets "duration" once
``origin + duration_s`` passed, "max_steps", "stopped" when the launcher asked (``stop``),
"terminated" on SIGTERM, "parent_gone" when its launcher died. The same all-reduce agrees
on the origin when none was given (the earliest producer timestamp the ranks read). Ranks
also watch a stop file (written by rank 0 on target, by ``stop``, or by any rank on SIGTERM
or when the launcher died), so a stop takes effect even while a rank waits for records.

Rank 0 evaluates on the held-out set every ``eval_every_s`` of wall time and writes
``out_dir/result.json`` (``Rank.write_result`` lists the fields); every rank writes
``out_dir/rank<i>.json``.

API: ``launch`` -> ``wait_ready`` -> start the streams -> wait for the processes (they stop
on their own) or ``stop`` -> ``collect``.

    # one rank (what launch() starts)
    python -m benchmarks.ddp_peer rank --rank 0 --world 3 --job JOB --bootstrap HOST:PORT ...
    # standalone: every rank (and optionally the job's simulators), then the result
    python -m benchmarks.ddp_peer --job JOB --bootstrap HOST:PORT --simulate --target 0.85
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgestream.job.config import JobConfig, load_config
from edgestream.job.topics import sensor_topics_for
from edgestream.pipeline.kafka_io import ensure_topics
from edgestream.streams.errors import RecordDecodeError
from edgestream.streams.topics import sensor_topic
from edgestream.trainers.evaluation import TARGET_HOLD_EVALUATIONS, time_to_target

ROOT = Path(__file__).resolve().parent.parent

#: Why a message was skipped: the codec's reasons plus two the consumer finds itself.
BAD_REASONS: tuple[str, ...] = (*RecordDecodeError.REASONS, "no_labels", "empty")
#: Stop reasons, in the order of the all-reduced stop vector (the first one set wins).
STOP_REASONS: tuple[str, ...] = (
    "target", "max_steps", "duration", "stopped", "terminated", "parent_gone",
)
#: Consecutive evaluations at or above the target that make it "held" (BENCHMARKS.md).
HOLD_EVALUATIONS = TARGET_HOLD_EVALUATIONS
#: Seconds after ``origin + duration_s`` at which a rank stuck anywhere exits hard.
HARD_DEADLINE_GRACE_S = 60.0
#: Seconds a rank may take to stop together after SIGTERM or its launcher's exit.
STOP_GRACE_S = 15.0
PROGRESS_EVERY_S = 5.0
END_OFFSET_REFRESH_S = 0.2
STOP_FILE_CHECK_S = 0.1
POLL_TIMEOUT_MS = 50
RESULT_FILE = "result.json"
STOP_FILE = "stop.json"

BYTES_SENT_NOTE = (
    "estimate: float32 gradient payload each rank contributes to the all-reduce, "
    "numel*4 bytes per step per rank, summed over ranks (gloo's ring all-reduce puts about "
    "2*(N-1)/N times this on the wire per rank; BatchNorm buffer broadcasts and the small "
    "per-step stop-vector all-reduce are not counted)"
)
BACKLOG_NOTE = (
    "records of the device topic not yet trained, sampled once per step after its batch is "
    "taken: records decoded but waiting in the rank's batch buffer (exact) + unread messages "
    "(topic end offset - consumer position) * mean good records per message read so far "
    "(estimate; exact whenever the rank has read up to the end). The end offset comes from "
    f"a side consumer refreshed every {END_OFFSET_REFRESH_S}s and from fetch responses"
)


# --- pure logic -----------------------------------------------------------------------


class FixedBatcher:
    """Collects decoded records of one stream and hands out batches of exactly ``batch_size``.

    Invariant: ``pending`` == records added - records taken, and records leave in the order
    they arrived (a batch may span messages; a message may span batches).
    """

    def __init__(self, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self._features: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self.pending = 0

    def add(self, features: np.ndarray, labels: np.ndarray) -> None:
        if len(features) != len(labels):
            raise ValueError(f"{len(features)} feature rows but {len(labels)} labels")
        if len(labels):
            self._features.append(features)
            self._labels.append(labels)
            self.pending += len(labels)

    def ready(self) -> bool:
        return self.pending >= self.batch_size

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """The oldest ``batch_size`` records as (float32 features, int64 labels)."""
        if not self.ready():
            raise ValueError(f"only {self.pending} of {self.batch_size} records pending")
        features = np.concatenate(self._features) if len(self._features) > 1 else self._features[0]
        labels = np.concatenate(self._labels) if len(self._labels) > 1 else self._labels[0]
        n = self.batch_size
        rest = len(labels) - n
        self._features = [features[n:]] if rest else []
        self._labels = [labels[n:]] if rest else []
        self.pending = rest
        return (np.ascontiguousarray(features[:n], dtype=np.float32),
                np.asarray(labels[:n], dtype=np.int64))


class TargetTracker:
    """The held-out accuracy timeline and the time-to-accuracy rule.

    ``tta_s`` is the time of the first of ``hold`` consecutive evaluations at or above
    ``target`` (None until that happens; a target <= 0 disables it: fixed-budget runs).
    """

    def __init__(self, target: float, hold: int = HOLD_EVALUATIONS) -> None:
        self.target = target
        self.hold = hold
        self.timeline: list[list[float]] = []
        self.tta_s: float | None = None

    @property
    def held(self) -> bool:
        return self.tta_s is not None

    def record(self, t_s: float, accuracy: float, step: int) -> None:
        self.timeline.append([round(t_s, 3), round(accuracy, 4), step])
        if self.held or self.target <= 0:
            return
        self.tta_s = time_to_target([(t, a) for t, a, _ in self.timeline], self.target, self.hold)


def backlog_records(pending: int, unread_messages: int, good_records: int, messages: int) -> float:
    """Records of a stream not yet trained (see ``BACKLOG_NOTE``)."""
    per_message = good_records / messages if messages else 0.0
    return pending + max(0, unread_messages) * per_message


def slowdown_per_rank(slowdown: list[float] | None, world: int) -> list[float]:
    """One factor per rank: None -> all 1, one value -> everyone, else exactly ``world``."""
    if not slowdown:
        return [1.0] * world
    if len(slowdown) == 1:
        slowdown = list(slowdown) * world
    if len(slowdown) != world:
        raise ValueError(f"{len(slowdown)} slowdown factors for {world} devices (give 1 or {world})")
    if any(not (s >= 1.0 and math.isfinite(s)) for s in slowdown):
        raise ValueError(f"slowdown factors must be finite and >= 1, got {slowdown}")
    return [float(s) for s in slowdown]


# --- one rank ---------------------------------------------------------------------------


@dataclass
class RankOptions:
    """What one rank process is told on its command line."""

    rank: int
    world: int
    cfg_path: Path
    bootstrap: str
    out_dir: Path
    batch: int
    slowdown: float
    origin: float | None  # None: the earliest producer timestamp the ranks read
    duration_s: float
    target_accuracy: float
    eval_every_s: float
    max_steps: int | None = None
    start_at: str = "beginning"  # beginning | origin (first message produced at/after origin)
    run_id: str = ""
    parent_pid: int | None = None


@dataclass
class RankStats:
    """One rank's counters; travels to rank 0 as a fixed-layout float64 tensor (no pickle)."""

    steps: int = 0
    records_trained: int = 0
    messages_read: int = 0
    records_read: int = 0
    wait_s: float = 0.0  # waiting for this rank's own batch, after the origin
    compute_s: float = 0.0  # forward + backward CPU time of the training thread
    emulated_sleep_s: float = 0.0
    step_wall_s: float = 0.0  # forward + backward (incl. all-reduce) + sleep + optimizer step
    agree_s: float = 0.0  # in the per-step stop-vector all-reduce (waiting for the slowest rank)
    max_backlog: float = 0.0
    slowdown: float = 1.0
    bad: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BAD_REASONS, 0))

    _SCALARS = ("steps", "records_trained", "messages_read", "records_read", "wait_s",
                "compute_s", "emulated_sleep_s", "step_wall_s", "agree_s", "max_backlog", "slowdown")

    def to_vector(self) -> list[float]:
        return [float(getattr(self, name)) for name in self._SCALARS] + \
            [float(self.bad[r]) for r in BAD_REASONS]

    @classmethod
    def from_vector(cls, values: list[float]) -> RankStats:
        n = len(cls._SCALARS)
        stats = cls(bad={r: int(v) for r, v in zip(BAD_REASONS, values[n:], strict=True)})
        for name, value in zip(cls._SCALARS, values[:n], strict=True):
            default = getattr(stats, name)
            setattr(stats, name, int(value) if isinstance(default, int) else float(value))
        return stats

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in self._SCALARS}
        out["bad_messages"] = {r: n for r, n in self.bad.items() if n}
        return out


class EndOffsetWatcher(threading.Thread):
    """Refreshes the end offsets of one topic's partitions from its own consumer (a daemon).

    Kept off the training thread so the backlog sample never adds a broker round trip
    to a step; kafka-python consumers are not thread-safe, hence a second one.
    """

    def __init__(self, bootstrap: str, partitions: list, interval_s: float = END_OFFSET_REFRESH_S) -> None:
        super().__init__(name="end-offsets", daemon=True)
        self.bootstrap = bootstrap
        self.partitions = partitions
        self.interval_s = interval_s
        self.latest: dict = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        from kafka import KafkaConsumer

        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, client_id="ddp-peer-offsets")
        try:
            while not self.stopped.is_set():
                try:
                    self.latest = dict(consumer.end_offsets(self.partitions))
                except Exception as exc:  # a missed refresh only makes the sample staler
                    _log(f"end offset refresh failed: {exc}")
                self.stopped.wait(self.interval_s)
        finally:
            consumer.close()


class Rank:
    """One DDP rank: its device's consumer, the replica, and the step loop.

    Invariant: every rank calls the same collectives in the same order: one stop-vector
    all-reduce per loop iteration, then (unless stopping) one DDP backward; two
    all-gathers (counters, backlog samples) at the end. So ``steps`` is equal on all ranks.
    """

    def __init__(self, opts: RankOptions) -> None:
        self.opts = opts
        self.origin: float | None = opts.origin
        self.stats = RankStats(slowdown=opts.slowdown)
        self.stop_file = opts.out_dir / STOP_FILE
        self.parent_pid = opts.parent_pid if opts.parent_pid is not None else os.getppid()
        self.terminate_requested = False
        self.parent_gone = False
        self.ready = False
        self.tracker = TargetTracker(opts.target_accuracy)
        self.timeline_wall: list[list[float]] = []
        self.backlog_samples: list[float] = []
        self.first_message_at: float | None = None  # producer timestamp of the first message read
        self.stop_reason: str | None = None
        self.error: str | None = None
        self.watcher: EndOffsetWatcher | None = None
        self.started: float | None = None
        self.stopped: float | None = None
        self.last_loss = float("nan")
        self._last_progress = 0.0
        self._last_eval_step = -1
        self._stop_checked = 0.0
        self._stop_seen: str | None = None

    # -- set-up ----------------------------------------------------------------------
    def setup(self) -> None:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from edgestream.job.sources import job_fleet_data
        from edgestream.streams import codec
        from edgestream.trainers import build_model, limit_torch_threads

        opts = self.opts
        limit_torch_threads(1)
        self.cfg: JobConfig = load_config(opts.cfg_path)
        devices = self.cfg.devices.device_ids()
        if len(devices) != opts.world:
            raise ValueError(f"world size {opts.world} but the job has {len(devices)} devices")
        self.device = devices[opts.rank]
        self.topic = sensor_topic(self.device)
        self.data = job_fleet_data(self.cfg)
        self.limits = codec.DecodeLimits(
            max_message_bytes=self.cfg.limits.max_record_message_bytes,
            max_records=self.cfg.limits.max_records_per_message,
            num_classes=self.data.num_classes,
        )
        self.batcher = FixedBatcher(opts.batch)
        model = build_model(self.cfg.train.model, self.data.feature_shape, self.data.num_classes,
                            seed=self.cfg.job.seed)
        timeout = datetime.timedelta(seconds=max(120.0, opts.duration_s + HARD_DEADLINE_GRACE_S))
        # The ranks of one launch meet in a file of its own (no port to pick: a port found
        # free and then bound by rank 0 could be taken in between by another process, and
        # rank 0 died of EADDRINUSE while the others waited); by hand, MASTER_ADDR/PORT.
        init = f"file://{opts.out_dir.resolve() / f'rendezvous-{opts.run_id}'}" if opts.run_id else "env://"
        dist.init_process_group("gloo", init_method=init, rank=opts.rank, world_size=opts.world, timeout=timeout)
        self.ddp = DistributedDataParallel(model)
        self.model = model  # rank 0 evaluates the bare module: DDP's forward is collective
        # As LocalTrainer: plain SGD with momentum, no weight decay, no Nesterov.
        self.optimizer = torch.optim.SGD(model.parameters(), lr=self.cfg.train.lr,
                                         momentum=self.cfg.train.momentum)
        self.grad_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self._open_consumer()
        self.ready = True
        self._write_json(opts.out_dir / f"ready-{opts.run_id}-{opts.rank}", {"pid": os.getpid()})

    def _open_consumer(self) -> None:
        from kafka.structs import TopicPartition

        from edgestream.pipeline.kafka_io import consumer

        opts = self.opts
        self.consumer = consumer(
            opts.bootstrap, max_message_bytes=self.cfg.kafka.max_message_bytes,
            group_id=f"ddp-peer-{opts.run_id}-{self.device}", client_id=f"ddp-peer-{opts.rank}",
        )
        deadline = time.monotonic() + 60
        while not (partitions := self.consumer.partitions_for_topic(self.topic)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {self.topic} does not exist on {opts.bootstrap}")
            time.sleep(0.2)  # poll interval of a deadline wait for topic metadata
        self.partitions = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        self.consumer.assign(self.partitions)
        if opts.start_at == "origin" and self.origin is not None:
            found = self.consumer.offsets_for_times({tp: int(self.origin * 1000) for tp in self.partitions})
            ends = self.consumer.end_offsets(self.partitions)
            for tp in self.partitions:
                hit = found.get(tp)
                self.consumer.seek(tp, hit.offset if hit is not None else ends[tp])
        else:
            self.consumer.seek_to_beginning(*self.partitions)
        for tp in self.partitions:
            self.consumer.position(tp)  # resolve the start offsets now, not after the origin
        self.watcher = EndOffsetWatcher(opts.bootstrap, self.partitions)
        self.watcher.start()

    def since_origin(self, wall: float | None = None) -> float | None:
        """Seconds from the origin to ``wall`` (default: now); None while the origin is unknown."""
        if self.origin is None:
            return None
        return (time.time() if wall is None else wall) - self.origin

    # -- reading -----------------------------------------------------------------------
    def _ingest(self, value: bytes | None, timestamp_ms: int | None) -> None:
        from edgestream.streams import codec

        if self.first_message_at is None and timestamp_ms is not None and timestamp_ms >= 0:
            self.first_message_at = timestamp_ms / 1000.0
        self.stats.messages_read += 1
        if not value:
            self.stats.bad["empty"] += 1
            return
        try:
            batch = codec.decode(value, self.limits, expected_device=self.device,
                                 expected_shape=self.data.feature_shape)
        except RecordDecodeError as exc:
            self.stats.bad[exc.reason] += 1
            return
        if batch.labels is None:
            self.stats.bad["no_labels"] += 1
            return
        self.stats.records_read += batch.count
        self.batcher.add(batch.features, batch.labels)

    def _fill_batch(self) -> str | None:
        """Read until a full batch is pending; return a stop reason if one comes first."""
        self._fill_started = time.time()
        try:
            while not self.batcher.ready():
                reason = self._local_stop_reason()
                if reason is not None:
                    return reason
                polled = self.consumer.poll(timeout_ms=POLL_TIMEOUT_MS, max_records=500)
                for messages in polled.values():
                    for message in messages:
                        self._ingest(message.value, message.timestamp)
            return None
        finally:
            self._fill_ended = time.time()
            if self.origin is not None:  # waiting before the streams started is not counted
                self.stats.wait_s += max(0.0, self._fill_ended - max(self._fill_started, self.origin))

    def _backlog_now(self) -> float:
        latest = self.watcher.latest if self.watcher is not None else {}
        unread = 0
        for tp in self.partitions:
            end = max(latest.get(tp, 0), self.consumer.highwater(tp) or 0)
            unread += max(0, end - self.consumer.position(tp))
        return backlog_records(self.batcher.pending, unread, self.stats.records_read,
                               self.stats.messages_read)

    # -- stopping ----------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        """Tell every rank, including those waiting for records, to stop at the next step."""
        if not self.stop_file.exists():
            self._write_json(self.stop_file, {"reason": reason, "rank": self.opts.rank,
                                              "step": self.stats.steps})

    def _stop_file_reason(self) -> str | None:
        now = time.monotonic()
        if self._stop_seen is None and now - self._stop_checked >= STOP_FILE_CHECK_S:
            self._stop_checked = now
            with contextlib.suppress(OSError, ValueError, AttributeError):
                reason = json.loads(self.stop_file.read_text()).get("reason")
                self._stop_seen = reason if reason in STOP_REASONS else "stopped"
        return self._stop_seen

    def _local_stop_reason(self) -> str | None:
        opts = self.opts
        if opts.rank == 0 and self.tracker.held:
            return "target"
        if (reason := self._stop_file_reason()) is not None:
            return reason
        if opts.max_steps is not None and self.stats.steps >= opts.max_steps:
            return "max_steps"
        if self.origin is not None and time.time() >= self.origin + opts.duration_s:
            return "duration"
        if self.terminate_requested:
            return "terminated"
        if self.parent_gone or os.getppid() != self.parent_pid:
            self.parent_gone = True
            return "parent_gone"
        return None

    def _agree(self, local: str | None) -> str | None:
        """One all-reduce (MAX) per iteration: the stop vector, and -first producer
        timestamp so that ranks without a given origin agree on the earliest one."""
        import torch
        import torch.distributed as dist

        vector = torch.zeros(len(STOP_REASONS) + 1, dtype=torch.float64)
        if local is not None:
            vector[STOP_REASONS.index(local)] = 1.0
        vector[-1] = -self.first_message_at if self.first_message_at is not None else -math.inf
        started = time.monotonic()
        dist.all_reduce(vector, op=dist.ReduceOp.MAX)
        self.stats.agree_s += time.monotonic() - started
        values = vector.tolist()
        if self.origin is None and math.isfinite(values[-1]):
            self.origin = -values[-1]
            # This first fill began before the origin was known: count its wait from there.
            self.stats.wait_s = max(0.0, self._fill_ended - max(self._fill_started, self.origin))
        for reason, flag in zip(STOP_REASONS, values, strict=False):
            if flag:
                return reason
        return None

    def watchdog(self) -> None:
        """Stop the run if the launcher died; exit hard if stuck past a stop or the deadline."""
        opts = self.opts
        stop_since: float | None = None
        while True:
            time.sleep(0.5)  # watchdog poll interval
            if os.getppid() != self.parent_pid and not self.parent_gone:
                if not self.ready:
                    _log(f"rank {opts.rank}: launcher gone during start-up; exiting")
                    os._exit(3)
                self.parent_gone = True
                self.request_stop("parent_gone")
            if self.parent_gone or self.terminate_requested:
                stop_since = stop_since or time.monotonic()
            if stop_since is not None and time.monotonic() - stop_since > STOP_GRACE_S:
                _log(f"rank {opts.rank}: still running {STOP_GRACE_S:.0f}s after SIGTERM or the "
                     "launcher's exit; exiting")
                os._exit(3)
            if self.origin is not None and \
                    time.time() > self.origin + opts.duration_s + HARD_DEADLINE_GRACE_S:
                _log(f"rank {opts.rank}: past the hard deadline (duration + "
                     f"{HARD_DEADLINE_GRACE_S:.0f}s); exiting")
                os._exit(3)

    # -- the loop ------------------------------------------------------------------------
    def evaluate(self) -> float:
        from edgestream.trainers import evaluate

        accuracy = evaluate(self.model, self.data.heldout.features, self.data.heldout.labels).accuracy
        wall = time.time()
        self.timeline_wall.append([round(wall, 3), round(accuracy, 4), self.stats.steps])
        since = self.since_origin(wall)
        if since is not None:
            self.tracker.record(since, accuracy, self.stats.steps)
        self._last_eval_step = self.stats.steps
        if self.tracker.held:
            self.request_stop("target")
        return accuracy

    def step(self) -> None:
        import torch
        from torch.nn import functional as F

        features, labels = self.batcher.take()
        backlog = self._backlog_now()
        self.backlog_samples.append(round(backlog, 1))
        self.stats.max_backlog = max(self.stats.max_backlog, backlog)
        wall0 = time.monotonic()
        cpu0 = time.thread_time()
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.ddp(torch.from_numpy(features)), torch.from_numpy(labels))
        loss.backward()  # DDP all-reduces (averages) the gradients inside backward
        compute = time.thread_time() - cpu0
        if self.opts.slowdown > 1.0:
            # Emulated heterogeneity (not synchronisation): a device slowdown_i times slower.
            pause = (self.opts.slowdown - 1.0) * compute
            time.sleep(pause)
            self.stats.emulated_sleep_s += pause
        self.optimizer.step()
        self.stats.compute_s += compute
        self.stats.step_wall_s += time.monotonic() - wall0
        self.stats.steps += 1
        self.stats.records_trained += len(labels)
        self.last_loss = float(loss.detach())

    def run(self) -> None:
        opts = self.opts
        last_eval = 0.0
        first = True
        while True:
            local = self._fill_batch()
            if local is None:
                local = self._local_stop_reason()
            self.stop_reason = self._agree(local)
            if first:  # the origin is known now (unless stopping before any record)
                first = False
                self.started = time.time()
                if opts.rank == 0:
                    self.evaluate()  # the initial model: step 0
                last_eval = time.monotonic()
            if self.stop_reason is not None:
                break
            self.step()
            if opts.rank == 0 and time.monotonic() - last_eval >= opts.eval_every_s:
                last_eval = time.monotonic()
                self.evaluate()
            self._progress()
        if opts.rank == 0 and self.stats.steps != self._last_eval_step:
            self.evaluate()
        self.stopped = time.time()
        self._progress(force=True)

    def _progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_progress < PROGRESS_EVERY_S:
            return
        self._last_progress = now
        acc = f" acc={self.timeline_wall[-1][1]:.3f}" if self.timeline_wall else ""
        _log(f"[ddp rank {self.opts.rank} {self.device}] t={self.since_origin() or 0.0:.1f}s "
             f"step={self.stats.steps}{acc} loss={self.last_loss:.3f} pending={self.batcher.pending} "
             f"backlog={self._backlog_now():.0f} max_backlog={self.stats.max_backlog:.0f} "
             f"wait={self.stats.wait_s:.1f}s bad={sum(self.stats.bad.values())}"
             + (f" stop={self.stop_reason}" if self.stop_reason else ""))

    # -- results -------------------------------------------------------------------------
    def gather(self) -> tuple[list[RankStats], list[list[float]]]:
        """Every rank's counters and per-step backlog samples (equal lengths: equal steps)."""
        import torch
        import torch.distributed as dist

        mine = torch.tensor(self.stats.to_vector(), dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(self.opts.world)]
        dist.all_gather(every, mine)
        samples: list[list[float]] = [[] for _ in range(self.opts.world)]
        if self.stats.steps:
            own = torch.tensor(self.backlog_samples, dtype=torch.float64)
            gathered = [torch.zeros_like(own) for _ in range(self.opts.world)]
            dist.all_gather(gathered, own)
            samples = [t.tolist() for t in gathered]
        return [RankStats.from_vector(t.tolist()) for t in every], samples

    def write_rank_file(self) -> None:
        self._write_json(self.opts.out_dir / f"rank{self.opts.rank}.json", {
            "rank": self.opts.rank, "device": getattr(self, "device", None),
            "stop_reason": self.stop_reason, "error": self.error, **self.stats.to_dict(),
        })

    def write_result(self, gathered: tuple[list[RankStats], list[list[float]]] | None) -> None:
        """Rank 0's ``result.json``; ``gathered`` is None if the ranks did not get that far.

        Times in ``timeline`` ([t_since_origin, accuracy, step]) and ``tta_s`` are seconds
        since the origin; ``timeline_wall`` has the same points on the wall clock. Per-device
        figures are keyed by device id (rank i = ``devices[i]``).
        """
        opts = self.opts
        devices = self.cfg.devices.device_ids()
        ranks, samples = gathered if gathered is not None else ([self.stats], [self.backlog_samples])
        named = dict(zip(devices, ranks, strict=False))
        grad_bytes = self.grad_numel * 4 if hasattr(self, "grad_numel") else 0
        result = {
            "mode": "ddp",
            "complete": gathered is not None and self.error is None,
            "error": self.error,
            "stop_reason": self.stop_reason,
            "devices": devices,
            "world_size": opts.world,
            "batch": opts.batch,
            "slowdown": {d: s.slowdown for d, s in named.items()},
            "model": self.cfg.train.model,
            "parameters": getattr(self, "grad_numel", None),
            "lr": self.cfg.train.lr,
            "momentum": self.cfg.train.momentum,
            "target_accuracy": opts.target_accuracy,
            "origin": self.origin,
            "origin_source": "given" if opts.origin is not None else "first producer timestamp read",
            "duration_s": opts.duration_s,
            "eval_every_s": opts.eval_every_s,
            "timeline": self.tracker.timeline,
            "timeline_wall": self.timeline_wall,
            "tta_s": self.tracker.tta_s,
            "final_accuracy": self.timeline_wall[-1][1] if self.timeline_wall else None,
            "steps": self.stats.steps,
            "steps_per_rank": {d: s.steps for d, s in named.items()},
            "records_trained": {d: s.records_trained for d, s in named.items()},
            "bytes_sent": sum(s.steps for s in ranks) * grad_bytes,
            "bytes_sent_per_rank": {d: s.steps * grad_bytes for d, s in named.items()},
            "bytes_sent_note": BYTES_SENT_NOTE,
            "max_backlog": {d: round(s.max_backlog, 1) for d, s in named.items()},
            "p99_backlog": {d: round(float(np.percentile(v, 99)), 1) if v else 0.0
                            for d, v in zip(devices, samples, strict=False)},
            "backlog_samples": dict(zip(devices, samples, strict=False)),
            "backlog_note": BACKLOG_NOTE,
            "bad_messages": {d: {r: n for r, n in s.bad.items() if n} for d, s in named.items()},
            "messages_read": {d: s.messages_read for d, s in named.items()},
            "records_read": {d: s.records_read for d, s in named.items()},
            "wait_s": {d: round(s.wait_s, 3) for d, s in named.items()},
            "compute_s": {d: round(s.compute_s, 3) for d, s in named.items()},
            "emulated_sleep_s": {d: round(s.emulated_sleep_s, 3) for d, s in named.items()},
            "step_wall_s": {d: round(s.step_wall_s, 3) for d, s in named.items()},
            "agree_s": {d: round(s.agree_s, 3) for d, s in named.items()},
            "train_started_s": _rounded(self.since_origin(self.started) if self.started else None),
            "train_stopped_s": _rounded(self.since_origin(self.stopped) if self.stopped else None),
        }
        self._write_json(opts.out_dir / RESULT_FILE, result)

    def write_startup_failure(self, error: str) -> None:
        """A result without training: the ranks never all got through start-up."""
        self._write_json(self.opts.out_dir / RESULT_FILE, {
            "mode": "ddp", "complete": False, "error": error, "stop_reason": "terminated",
            "world_size": self.opts.world, "batch": self.opts.batch, "timeline": [],
            "timeline_wall": [], "tta_s": None, "final_accuracy": None, "steps": 0,
            "steps_per_rank": {}, "records_trained": {}, "bytes_sent": 0, "max_backlog": {},
            "p99_backlog": {}, "backlog_samples": {}, "bad_messages": {},
        })

    @staticmethod
    def _write_json(path: Path, payload: dict[str, Any]) -> None:
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(path)

    def close(self) -> None:
        import torch.distributed as dist

        if self.watcher is not None:
            self.watcher.stopped.set()
        consumer = getattr(self, "consumer", None)
        if consumer is not None:
            consumer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def run_rank(opts: RankOptions) -> int:
    """Run one rank to the agreed stop; 0 on success, 1 if it failed (partial files written)."""
    rank = Rank(opts)
    # SIGTERM is taken by a thread (sigwait), not a handler: a Python handler would only
    # run once the main thread leaves a blocking collective. Blocked before any thread
    # (ours, torch's, gloo's) starts, so every thread inherits the mask.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def on_sigterm() -> None:
        signal.sigwait({signal.SIGTERM})
        rank.terminate_requested = True  # stop together at the next stop-vector all-reduce
        if not rank.ready:  # nothing trained yet: finishing the start-up would only delay
            _log(f"rank {opts.rank}: SIGTERM during start-up; exiting")
            if opts.rank == 0:
                rank.write_startup_failure("terminated during start-up")
            os._exit(128 + signal.SIGTERM)
        rank.request_stop("terminated")
        signal.sigwait({signal.SIGTERM})
        os._exit(128 + signal.SIGTERM)  # a second SIGTERM: leave now

    threading.Thread(target=on_sigterm, name="sigterm", daemon=True).start()
    threading.Thread(target=rank.watchdog, name="watchdog", daemon=True).start()
    gathered = None
    try:
        rank.setup()
        rank.run()
        gathered = rank.gather()
        return 0
    except BaseException as exc:
        rank.error = f"{type(exc).__name__}: {exc}"
        _log(f"rank {opts.rank} failed: {rank.error}")
        if not isinstance(exc, Exception):
            raise
        return 1
    finally:
        if hasattr(rank, "cfg"):
            rank.write_rank_file()
            if opts.rank == 0:
                rank.write_result(gathered)
        rank.close()
        _log(f"rank {opts.rank}: done at t={rank.since_origin() or 0.0:.1f}s "
             f"({rank.stop_reason or rank.error})")


# --- launching ----------------------------------------------------------------------


def launch(
    cfg_path: Path,
    bootstrap: str,
    out_dir: Path,
    *,
    batch: int = 64,
    slowdown: list[float] | None = None,
    origin: float | None = None,
    duration_s: float,
    target_accuracy: float,
    eval_every_s: float = 1.0,
    max_steps: int | None = None,
    start_at: str = "beginning",
    log_to_files: bool = True,
) -> list[subprocess.Popen]:
    """Start one rank process per device of the job at ``cfg_path`` (JSON or TOML).

    ``origin`` is the wall-clock time (``time.time()``) of the first record produced; it
    may lie in the future (ranks wait for records). None: the origin is the earliest
    producer timestamp among the first messages the ranks read, which is the first record
    produced when the topics hold only this run's streams. Ranks stop together when the
    target is held (``target_accuracy`` <= 0: never), ``duration_s`` after the origin,
    after ``max_steps``, on ``stop`` or SIGTERM (rank 0 still writes its result), or when
    this process dies. ``start_at="origin"`` (needs ``origin``) reads only messages
    produced at or after it (topics reused across repeats); by default ranks read from the
    beginning. Each rank leads its own process group; its output goes to
    ``out_dir/rank<i>.log`` unless ``log_to_files`` is False.
    """
    cfg_path = Path(cfg_path).resolve()
    out_dir = Path(out_dir).resolve()
    cfg = load_config(cfg_path)
    devices = cfg.devices.device_ids()
    world = len(devices)
    factors = slowdown_per_rank(slowdown, world)
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if eval_every_s <= 0 or duration_s <= 0:
        raise ValueError(f"eval_every_s and duration_s must be > 0, got {eval_every_s}, {duration_s}")
    if start_at not in ("beginning", "origin"):
        raise ValueError(f"start_at must be 'beginning' or 'origin', got {start_at!r}")
    if start_at == "origin" and origin is None:
        raise ValueError("start_at='origin' needs the origin")
    ensure_topics(bootstrap, sensor_topics_for(devices))
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [out_dir / RESULT_FILE, out_dir / STOP_FILE, *out_dir.glob("rank*.json"),
                  *out_dir.glob("ready-*")]:
        stale.unlink(missing_ok=True)
    run_id = uuid.uuid4().hex[:8]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(OMP_NUM_THREADS="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks talk over loopback only
    procs = []
    for rank in range(world):
        cmd = [
            sys.executable, "-m", "edgestream.benchmarks.ddp_peer", "rank",
            "--rank", str(rank), "--world", str(world), "--job", str(cfg_path),
            "--bootstrap", bootstrap, "--out", str(out_dir), "--batch", str(batch),
            "--slowdown", repr(factors[rank]), "--duration", repr(duration_s),
            "--target", repr(target_accuracy), "--eval-every", repr(eval_every_s),
            "--start-at", start_at, "--run-id", run_id, "--parent-pid", str(os.getpid()),
        ]
        if origin is not None:
            cmd += ["--origin", repr(origin)]
        if max_steps is not None:
            cmd += ["--max-steps", str(max_steps)]
        if log_to_files:
            with open(out_dir / f"rank{rank}.log", "wb") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        else:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        procs.append(proc)
    return procs


def wait_ready(out_dir: Path, procs: list[subprocess.Popen], timeout_s: float = 120.0) -> None:
    """Return once every rank joined the process group and assigned its consumer.

    A rank that exits first ends the start-up: the others, which would wait for it in the
    rendezvous until its timeout, are sent SIGTERM at once (a rank not yet ready exits on
    it), then this raises."""
    out_dir = Path(out_dir)
    deadline = time.monotonic() + timeout_s
    while len(list(out_dir.glob("ready-*"))) < len(procs):
        dead = [i for i, p in enumerate(procs) if p.poll() is not None]
        if dead:
            for proc in procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
            raise RuntimeError(f"rank(s) {dead} exited during start-up (the others were stopped); "
                               f"see {out_dir}/rank<i>.log")
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks not ready after {timeout_s:.0f}s; see {out_dir}/rank<i>.log")
        time.sleep(0.1)  # poll interval of a deadline wait


def stop(out_dir: Path, procs: list[subprocess.Popen], timeout_s: float = 30.0) -> list[int | None]:
    """Ask the ranks to stop together (rank 0 then writes its result); after half of
    ``timeout_s`` SIGTERM their process groups, after ``timeout_s`` SIGKILL them.
    Returns the exit codes."""
    request = Path(out_dir) / STOP_FILE
    if not request.exists():
        tmp = request.with_name(request.name + ".tmp")
        tmp.write_text(json.dumps({"reason": "stopped", "rank": None}))
        tmp.replace(request)
    deadline = time.monotonic() + timeout_s
    for sig, until in ((None, deadline - timeout_s / 2), (signal.SIGTERM, deadline),
                       (signal.SIGKILL, deadline + 10)):
        if sig is not None:
            for proc in procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, sig)
        while any(proc.poll() is None for proc in procs) and time.monotonic() < until:
            time.sleep(0.1)  # poll interval of a deadline wait
    return [proc.poll() for proc in procs]


def collect(out_dir: Path) -> dict:
    """Rank 0's result (``complete`` is False if a rank failed or the gather did not happen)."""
    path = Path(out_dir) / RESULT_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: rank 0 did not finish; see {Path(out_dir)}/rank0.log")
    return json.loads(path.read_text())


# --- command line ---------------------------------------------------------------------


def _log(line: str) -> None:
    sys.stderr.write(line + "\n")  # one write per line: ranks may share the launcher's stderr
    sys.stderr.flush()


def _rank_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ddp_peer rank", description="one DDP rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--job", type=Path, required=True)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--slowdown", type=float, default=1.0)
    parser.add_argument("--origin", type=float, help="default: the first producer timestamp read")
    parser.add_argument("--duration", type=float, required=True)
    parser.add_argument("--target", type=float, required=True)
    parser.add_argument("--eval-every", type=float, default=1.0)
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--start-at", choices=("beginning", "origin"), default="beginning")
    parser.add_argument("--run-id", default="")
    parser.add_argument("--parent-pid", type=int)
    args = parser.parse_args(argv)
    return run_rank(RankOptions(
        rank=args.rank, world=args.world, cfg_path=args.job, bootstrap=args.bootstrap,
        out_dir=args.out, batch=args.batch, slowdown=args.slowdown, origin=args.origin,
        duration_s=args.duration, target_accuracy=args.target, eval_every_s=args.eval_every,
        max_steps=args.max_steps, start_at=args.start_at, run_id=args.run_id,
        parent_pid=args.parent_pid,
    ))


def _standalone_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", type=Path, help="job file (TOML or JSON); defaults built in")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--bootstrap", help="HOST:PORT (default: kafka.bootstrap of the job)")
    parser.add_argument("--out", type=Path, default=Path(".edgestream/ddp-peer"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--slowdown", type=float, nargs="+")
    parser.add_argument("--duration", type=float, help="seconds (default: run.duration_s)")
    parser.add_argument("--target", type=float, default=0.9, help="held-out accuracy; <= 0: none")
    parser.add_argument("--eval-every", type=float, default=1.0)
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--simulate", action="store_true",
                        help="run the job's simulators for the duration once the ranks are up "
                             "(the device topics should hold nothing older)")
    args = parser.parse_args(argv)

    cfg = load_config(args.job, args.set)
    bootstrap = args.bootstrap or cfg.kafka.bootstrap
    if not bootstrap:
        parser.error("--bootstrap HOST:PORT is required (or kafka.bootstrap in the job)")
    duration_s = args.duration or cfg.run.duration_s
    out_dir = args.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = out_dir / "job.json"
    cfg_path.write_text(json.dumps(cfg.to_dict(), indent=2))
    procs = launch(cfg_path, bootstrap, out_dir, batch=args.batch, slowdown=args.slowdown,
                   duration_s=duration_s, target_accuracy=args.target,
                   eval_every_s=args.eval_every, max_steps=args.max_steps, log_to_files=False)
    streaming = threading.Event()
    simulators: threading.Thread | None = None
    try:
        wait_ready(out_dir, procs, timeout_s=300)
        if args.simulate:
            from edgestream.pipeline.simulate import simulate

            simulators = threading.Thread(target=simulate, args=(cfg, bootstrap, duration_s),
                                          kwargs={"stop": streaming}, name="simulators", daemon=True)
            simulators.start()
        deadline = time.monotonic() + duration_s + HARD_DEADLINE_GRACE_S
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        _log("stopping the ranks")
    finally:
        streaming.set()
        stop(out_dir, procs)
        if simulators is not None:
            simulators.join(timeout=60)  # let the producer flush and close
    result = collect(out_dir)
    _print_summary(result)
    return 0 if result["complete"] else 1


def _print_summary(result: dict) -> None:
    tta = "not reached" if result["tta_s"] is None else f"{result['tta_s']:.1f}s"
    print(f"DDP peer: stop={result['stop_reason']} steps={result['steps']} tta={tta} "
          f"final_accuracy={result['final_accuracy']} bytes_sent={result['bytes_sent']}")
    print("| device | records trained | max backlog | p99 backlog | waited s | compute s "
          "| emulated sleep s | bad messages |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for d in result.get("devices", []):
        print(f"| {d} | {result['records_trained'].get(d)} | {result['max_backlog'].get(d)} | "
              f"{result['p99_backlog'].get(d)} | {result['wait_s'].get(d)} | "
              f"{result['compute_s'].get(d)} | {result['emulated_sleep_s'].get(d)} | "
              f"{result['bad_messages'].get(d) or ''} |")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rank":
        return _rank_main(argv[1:])
    return _standalone_main(argv)


if __name__ == "__main__" and sys.argv[1:2] == ["rank"]:
    code = main()
    # Results are on disk and the consumer and process group are closed; skip the
    # interpreter's teardown of torch, which takes seconds on loaded shared cores.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
