"""``edgestream serve``: an inference-only stream processor beside a training job.

It reads the job's device topics with the ingest of the training workers (``IngestCore``
through ``IngestDriver``, so every input format and topic layout they read works, and bad
input is dead-lettered to ``sensors.dlq`` with its reason), in a consumer group of its own
(``serve.group``): instances of one group share the device partitions. Instead of a
trainer, a ``PredictingSink`` takes the batches: micro-batches of at most ``serve.max_batch``
records -> one forward pass -> one prediction per record on ``predictions.<job>`` (the schema
of ``streams.predictions``, ``at = "serve"``) -> the records settled only once the broker
acknowledged their predictions, so committed offsets never pass a record not predicted.

The model comes from ``models.<job>`` (a server's snapshots), a process's checkpoints or an
export directory (``ModelSource``), each candidate loaded and checked off the event loop
(``trainers.serving``) and swapped in between two micro-batches: every micro-batch is
predicted by one model, named in each of its predictions. Before the first model, nothing is
read and the instance is not ready.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition

from edgestream.job.config import JobConfig
from edgestream.job.plan import training_plan
from edgestream.job.sources import job_fleet_data
from edgestream.job.topics import channel_topic, sensor_partitions, sensor_topics_for
from edgestream.monitoring.health import Health
from edgestream.monitoring.metrics import Metrics, observe_many, serve
from edgestream.pipeline import security
from edgestream.pipeline.app import (
    LAG_INTERVAL_S,
    DirectSensorSource,
    IngestDriver,
    _Partition,
    cancel_and_wait,
    dead_letter_message,
    send_keyed,
)
from edgestream.pipeline.exits import ENDPOINT_FILE, worker_state_dir
from edgestream.pipeline.ingest import DeadLetter, IngestCore
from edgestream.pipeline.kafka_io import ensure_topics
from edgestream.pipeline.service import ProcessService
from edgestream.pipeline.worker import write_json_atomic
from edgestream.streams import topics
from edgestream.streams.batching import Batch
from edgestream.streams.offsets import OffsetTracker
from edgestream.streams.predictions import AT_SERVE, Scored, encode_scored
from edgestream.streams.topics import SERVER_NAME
from edgestream.trainers.checkpoint import CheckpointStore
from edgestream.trainers.export import CARD_FILE
from edgestream.trainers.local import limit_torch_threads
from edgestream.trainers.serving import SAME, ModelLoader, ModelRefused, ServingModel, swap_decision
from edgestream.trainers.strategies import roles

log = logging.getLogger(__name__)

#: Where the model comes from (``--model-from``).
MODEL_SOURCES = ("models", "checkpoints", "export")
#: Torch threads of the forward pass (the process shares its machine with the broker and workers).
TORCH_THREADS = 1
#: Micro-batches' worth of records that may wait for the forward pass before ingest waits.
QUEUED_BATCHES = 4
#: The widest a device's window batch may grow while it has a backlog, in micro-batches.
WIDEN_BATCHES = 64
#: Seconds between reads of ``models.<job>`` when nothing came.
MODELS_POLL_MS = 500
#: Largest record batch of predictions the producer builds (at most ``kafka.max_message_bytes``).
#: aiokafka's default, 16 KiB, holds about 35 predictions: a produce request each, which halved
#: the throughput on a backlog (``edgestream bench serving --part serve``).
PRODUCER_BATCH_BYTES = 1 << 20
#: Consumer group timeouts: a crashed instance's partitions move to the others within this.
SESSION_TIMEOUT_MS = 10_000
HEARTBEAT_INTERVAL_MS = 2_000
#: A serve instance's name: what its predictions' ``worker`` field and its state dir say.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")

Send = Callable[[str, list[tuple[bytes, bytes]]], Awaitable[list[Awaitable[Any]]]]
Predict = Callable[[ServingModel, np.ndarray], Awaitable[tuple[np.ndarray, np.ndarray]]]


class ServeRefused(Exception):
    """``edgestream serve`` cannot start with these settings (one line; the CLI exits 2)."""


def default_name() -> str:
    """``serve-<host>`` (the host name's characters a topic-safe name allows)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()) or "host"
    return f"serve-{host}"[:100]


def default_model_source(cfg: JobConfig) -> str:
    """``models`` for a strategy with a server role (its server publishes snapshots), else ``checkpoints``."""
    return "models" if "server" in roles(cfg.train.strategy) else "checkpoints"


def check_serve_args(cfg: JobConfig, name: str, model_from: str, worker: str | None,
                     export_dir: Path | None) -> tuple[str, str | None]:
    """The model source and the process whose checkpoints it reads (``checkpoints``), checked
    against the job; ``ServeRefused`` with what to do otherwise."""
    if not _NAME.fullmatch(name):
        raise ServeRefused(f"--name {name!r}: use letters, digits, '.', '_' and '-' (at most 100, first a letter "
                           "or digit)")
    if name in cfg.worker_names() or name == SERVER_NAME:
        raise ServeRefused(f"--name {name!r} is a process of the training job: give the serve instance its own "
                           "name (e.g. serve-0)")
    if model_from not in MODEL_SOURCES:
        raise ServeRefused(f"--model-from {model_from!r}: choose one of {', '.join(MODEL_SOURCES)}")
    if cfg.train.stages:
        raise ServeRefused("train.stages splits the model over several workers: no process holds the whole "
                           "model; serve an export instead (edgestream export puts the stages together) "
                           "with a job file without train.stages")
    if model_from == "models" and "server" not in roles(cfg.train.strategy):
        raise ServeRefused(f"--model-from models reads the server's snapshots, and train.strategy="
                           f"{cfg.train.strategy!r} has no server: use --model-from checkpoints (or export)")
    if model_from == "export" and export_dir is None:
        raise ServeRefused("--model-from export needs --export-dir DIR (an edgestream export directory)")
    if model_from != "export" and export_dir is not None:
        raise ServeRefused("--export-dir is read with --model-from export only")
    process = None
    if model_from == "checkpoints":
        names = [*cfg.worker_names(), *([SERVER_NAME] if "server" in roles(cfg.train.strategy) else [])]
        process = worker or (SERVER_NAME if SERVER_NAME in names else cfg.worker_names()[0])
        if process not in names:
            raise ServeRefused(f"--worker {process!r}: the job's processes with checkpoints are {', '.join(names)}")
    elif worker is not None:
        raise ServeRefused("--worker names the process whose checkpoints are read: with --model-from checkpoints "
                           "only")
    return model_from, process


def serve_ingest_config(cfg: JobConfig) -> JobConfig:
    """The job's configuration as serve's ingest uses it: every record kept (no truncating
    buffer or window: a record is predicted, or dead-lettered for bad input), batches of at
    most ``serve.max_batch`` every ``serve.max_wait_s`` (widening under a backlog), no label
    topic (nothing is trained), each record stamped with its source message (``origin``)."""
    widen = min(cfg.serve.max_batch * WIDEN_BATCHES, 65536)
    return replace(
        cfg,
        buffer=replace(cfg.buffer, policy="backpressure" if cfg.buffer.policy == "truncate" else cfg.buffer.policy,
                       capacity=max(cfg.buffer.capacity, 2 * widen)),
        batcher=replace(cfg.batcher, mode="window", window_s=cfg.serve.max_wait_s, max_batch=cfg.serve.max_batch,
                        window_overflow="persist", max_batch_widen=max(widen, cfg.serve.max_batch)),
        labels=replace(cfg.labels, topic=""),
        serve=replace(cfg.serve, predictions=True),
    )


class PredictingSink:
    """The sink of serve's ingest: predicts the batches it is given, publishes one prediction
    per record, and settles the batches once the broker acknowledged them.

    Invariants: a micro-batch (the batches taken together, at most ``max_batch`` records
    unless one batch is larger) is predicted in one call of ``predict`` (the server's runs a
    forward pass per ``max_batch`` rows) by one model, the one in use when it was taken; a
    newer model (``offer``) is swapped in only between micro-batches, and each record is
    taken into exactly one micro-batch. A batch is settled (``settle``: its offsets may be
    committed) only after every acknowledgement of its predictions arrived, and batches are
    sent and settled in the order they were submitted. At most two micro-batches are taken
    and not settled: one being published, the next in its forward pass (``run``).
    """

    defer_acks = True

    def __init__(self, *, predict: Predict, send: Send, topic: str, job: str, worker: str, top_k: int,
                 max_batch: int, topic_of: Callable[[str], str], metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.predict = predict
        self.send = send
        self.topic = topic
        self.job = job
        self.worker = worker
        self.top_k = top_k
        self.max_batch = max_batch
        self.topic_of = topic_of
        self.metrics = metrics
        self.clock = clock
        #: Set by ``IngestDriver`` (``defer_acks``): the batch is done, its records consumed.
        self.settle: Callable[[Batch], Awaitable[None]] | None = None
        self.model: ServingModel | None = None
        self._next: ServingModel | None = None
        self._queue: list[Batch] = []
        self._queued_records = 0
        #: Micro-batches taken from the queue and not yet settled (at most two: one predicted or
        #: being published, the next in its forward pass).
        self._taken = 0
        self._changed = asyncio.Event()
        self.published: dict[str, int] = {}
        self.micro_batches = 0
        self.swaps = 0
        #: ``(version before, version after, clock at the swap)`` of each swap.
        self.swap_log: list[tuple[int | None, int, float]] = []

    # --- the model -------------------------------------------------------------------------
    @property
    def newest(self) -> ServingModel | None:
        """The newest model accepted: waiting to be swapped in, else in use."""
        return self._next or self.model

    def offer(self, model: ServingModel) -> None:
        """Use ``model`` from the next micro-batch on (the caller checked it is newer: ``swap_decision``)."""
        self._next = model
        self._changed.set()

    def _swap(self) -> None:
        model, self._next = self._next, None
        assert model is not None
        before = self.model
        self.model = model
        self.swap_log.append((before.ident.version if before else None, model.ident.version, self.clock()))
        if before is not None:
            self.swaps += 1
        if self.metrics is not None:
            self.metrics.serve_model_version.set(model.ident.version)
            if before is not None:
                self.metrics.serve_swaps.inc()
        log.warning("%s: predicting with model %s%s", self.worker, model.ident,
                    f" (was version {before.ident.version})" if before is not None else "")

    # --- BatchSink -------------------------------------------------------------------------
    @property
    def queued_records(self) -> int:
        return self._queued_records

    def room(self) -> bool:
        return not self._queue or self._queued_records < QUEUED_BATCHES * self.max_batch

    async def submit(self, batch: Batch) -> None:
        """Queue ``batch`` for prediction (waits while ``QUEUED_BATCHES`` micro-batches' worth wait)."""
        while not self.room():
            self._changed.clear()
            await self._changed.wait()
        self._queue.append(batch)
        self._queued_records += batch.size
        self._changed.set()

    async def drain(self) -> None:
        """Wait until every batch submitted so far is predicted, published and settled."""
        while self._queue or self._busy:
            self._changed.clear()
            await self._changed.wait()

    @property
    def _busy(self) -> bool:
        return self._taken > 0

    # --- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """Predict, publish and settle micro-batches until cancelled; a failed write raises (the
        process stops; its records since the last commit are read again by the group).

        Pipelined, one micro-batch deep: while a predicted micro-batch is published and waits
        for its acknowledgements, the next one (taken after it, with the model in use then) is
        in its forward pass; it is published only once the first is settled, so predictions
        are sent and batches settled in the order they were submitted."""
        ready: _Predicted | None = None
        while True:
            if ready is None:
                if self._next is not None:
                    self._swap()  # idle, so between two micro-batches: the gauges say so at once
                if not self._queue or self.model is None:
                    self._changed.clear()
                    await self._changed.wait()
                    continue
                ready = await self._forward(*self._take())
            following = None
            if self._queue:
                if self._next is not None:
                    self._swap()  # between the micro-batch predicted and the next
                following = asyncio.ensure_future(self._forward(*self._take()))
            try:
                await self._publish(ready)
            except BaseException:
                if following is not None:
                    following.cancel()
                raise
            ready = await following if following is not None else None

    async def step(self) -> int:
        """One micro-batch, not pipelined: swap in a newer model if one waits, take batches,
        predict, publish, wait for the acknowledgements, settle. Returns the records predicted."""
        if self._next is not None:
            self._swap()
        if self.model is None or not self._queue:
            return 0
        predicted = await self._forward(*self._take())
        await self._publish(predicted)
        return predicted.records

    def _take(self) -> tuple[ServingModel, list[Batch], int]:
        """The next micro-batch: whole batches in order, up to ``max_batch`` records (a larger
        batch alone), with the model in use now."""
        model = self.model
        assert model is not None and self._queue
        taken: list[Batch] = []
        records = 0
        while self._queue and (not taken or records + self._queue[0].size <= self.max_batch):
            batch = self._queue.pop(0)
            taken.append(batch)
            records += batch.size
        self._taken += 1
        return model, taken, records

    async def _forward(self, model: ServingModel, batches: list[Batch], records: int) -> _Predicted:
        """The micro-batch's forward pass: one call of ``predict`` for all its rows."""
        try:
            features = np.concatenate([b.records.features for b in batches]) if len(batches) > 1 \
                else batches[0].records.features
            classes, probabilities = await self.predict(model, features)
        except BaseException:
            self._release()
            raise
        return _Predicted(model, batches, records, classes, probabilities, self.clock())

    def _release(self) -> None:
        self._taken -= 1
        self._changed.set()

    async def _publish(self, predicted: _Predicted) -> None:
        """Encode, send, wait for every acknowledgement, then settle the micro-batch's batches."""
        try:
            ident = predicted.model.ident
            scored, start = [], 0
            for batch in predicted.batches:
                stop = start + batch.size
                scored.append(replace(Scored.of(
                    batch.records, self.topic_of(batch.device), version=ident.version, digest=ident.digest,
                    classes=predicted.classes[start:stop], probabilities=predicted.probabilities[start:stop],
                    predicted_at=predicted.at), at=AT_SERVE))
                start = stop
            published_at = self.clock()
            messages: list[tuple[bytes, bytes]] = []
            for part in scored:
                messages += encode_scored(part, job=self.job, worker=self.worker, published_at=published_at)
            await asyncio.gather(*await self.send(self.topic, messages))
            acked = self.clock()
            for part in scored:
                self.published[part.device] = self.published.get(part.device, 0) + part.size
                if self.metrics is not None:
                    self.metrics.serve_predictions.labels(part.device).inc(part.size)
            if self.metrics is not None:
                stamps = np.concatenate([part.kafka_timestamp for part in scored])
                observe_many(self.metrics.serve_latency, np.maximum(0.0, acked - stamps[np.isfinite(stamps)]))
            self._queued_records -= predicted.records
            for batch in predicted.batches:
                assert self.settle is not None
                await self.settle(batch)
        finally:
            self._release()
        self.micro_batches += 1


class _Predicted(NamedTuple):
    """A micro-batch predicted, not yet published: its model, batches, records, the top-k rows
    of all its records and when they were made."""

    model: ServingModel
    batches: list[Batch]
    records: int
    classes: np.ndarray
    probabilities: np.ndarray
    at: float


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, source: GroupSensorSource) -> None:
        self.source = source

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.source.on_revoked(list(revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self.source.on_assigned(list(assigned))


class GroupSensorSource(DirectSensorSource):
    """``DirectSensorSource`` as a member of a consumer group: the device partitions are
    assigned by the group (instances of one group share them), not named.

    Invariant: before its partitions are revoked (a rebalance, or the stop), every record read
    from them is predicted, published, acknowledged and settled, and the watermarks committed
    (``drain``), and nothing is fetched until the next assignment (the group's next owner of a
    partition starts at the committed offset). So a rebalance neither loses nor repeats a
    record.
    """

    def __init__(self, *, topics: list[str], drain: Callable[[], Awaitable[None]],
                 on_assigned: Callable[[int], None], session_timeout_ms: int = SESSION_TIMEOUT_MS,
                 **kwargs: Any) -> None:
        """``topics``: the device topics to read (the job's devices' topics, or its shared one)."""
        super().__init__(devices=[], shared_partitions=[], **kwargs)
        self.topics = topics
        self.drain = drain
        self.assigned_callback = on_assigned
        self.session_timeout_ms = session_timeout_ms
        self.rebalances = 0
        #: Held while a fetched chunk is handled, and while partitions are revoked.
        self.intake = asyncio.Lock()
        #: Revocations so far: a chunk fetched before one is not handled after it.
        self.generation = 0

    async def on_start(self) -> None:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, group_id=self.group_id, client_id=f"{self.group_id}-serve",
            enable_auto_commit=False, auto_offset_reset="earliest",
            max_partition_fetch_bytes=self.max_message_bytes,
            fetch_max_bytes=max(self.max_message_bytes, 52_428_800),
            session_timeout_ms=self.session_timeout_ms, heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS,
            **security.current().aiokafka(),
        )
        await consumer.start()
        self.consumer = consumer
        consumer.subscribe(topics=self.topics, listener=_Rebalance(self))
        self.running = True
        self._loops = [asyncio.ensure_future(self._fetch_loop()), asyncio.ensure_future(self._commit_loop())]

    def on_assigned(self, assigned: list[TopicPartition]) -> None:
        for tp in assigned:
            self._part(tp)
        self.rebalances += 1
        log.warning("%s: %d device partition(s) assigned: %s", self.group_id, len(assigned),
                    ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(assigned)) or "none")
        self.assigned_callback(len(assigned))

    async def on_revoked(self, revoked: list[TopicPartition]) -> None:
        """Finish every record read, commit, and forget the revoked partitions."""
        async with self.intake:
            self.generation += 1
            if self.running:
                await self.drain()
                await self.commit()
            for tp in revoked:
                self.parts.pop(tp, None)

    async def _fetch_loop(self) -> None:
        assert self.consumer is not None
        getmany = self.consumer.getmany
        try:
            while True:
                # aiokafka's getmany waits while the group reassigns partitions, and then returns
                # records of the new assignment only (possibly before on_assigned ran).
                fetched = await getmany(timeout_ms=200, max_records=10_000)
                if not fetched:
                    continue
                generation = self.generation
                async with self.intake:
                    if generation != self.generation:
                        continue  # revoked meanwhile: the partitions' next owner reads them again
                    now, wall_now = self.clock(), time.time()
                    for tp, records in fetched.items():
                        await self._handle(self._part(tp), records, now, wall_now)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("serve's sensor source failed")
            raise

    def _part(self, tp: TopicPartition) -> _Partition:
        """The state of an assigned partition (new when it was not held)."""
        part = self.parts.get(tp)
        if part is None:
            device = None if self.layout.keyed else self.layout.device_of(tp.topic)
            part = self.parts[tp] = _Partition(tp, device, OffsetTracker.key(tp.topic, tp.partition))
            # Held before and given away: the tracker still ends where this instance left it,
            # below where the group is now. Commit nothing until reading moves the mark.
            part.committed = self.tracker.watermark(part.key)
        return part

    async def close(self) -> None:
        """Stop reading (between two fetched chunks), finish every record read, commit, leave."""
        async with self.intake:
            await cancel_and_wait(self._loops)
            self._loops = []
            if self.consumer is not None:
                await self.drain()
                await self.commit()
                self.running = False
        if self.consumer is not None:
            await self.consumer.stop()
            self.consumer = None



# --- where the model comes from ------------------------------------------------------------
class ModelSource:
    """Finds candidate models and hands each, loaded and checked off the event loop, to
    ``accept`` (which applies the swap rule); refusals are counted and logged once each."""

    def __init__(self, loader: ModelLoader, executor: concurrent.futures.Executor,
                 accept: Callable[[ServingModel], None], refuse: Callable[[ModelRefused], None]) -> None:
        self.loader = loader
        self.executor = executor
        self.accept = accept
        self.refuse = refuse
        self.loaded = 0

    async def _load(self, fn: Callable[..., ServingModel], *args: Any) -> bool:
        try:
            model = await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        except ModelRefused as exc:
            self.refuse(exc)
            return False
        self.loaded += 1
        self.accept(model)
        return True

    async def run(self) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class TopicModels(ModelSource):
    """The server's snapshots on ``models.<job>`` (compacted: its newest survives), read from the
    beginning; of what one read returns only the newest is loaded."""

    def __init__(self, bootstrap: str, topic: str, max_bytes: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bootstrap = bootstrap
        self.topic = topic
        self.max_bytes = max_bytes

    def describe(self) -> str:
        return f"{self.topic} (the server's snapshots)"

    async def run(self) -> None:
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
                                    auto_offset_reset="earliest", max_partition_fetch_bytes=self.max_bytes,
                                    fetch_max_bytes=max(self.max_bytes, 52_428_800),
                                    client_id=f"edgestream-serve-{self.topic}", **security.current().aiokafka())
        await consumer.start()
        try:
            await consumer.topics()
            partitions = consumer.partitions_for_topic(self.topic) or {0}
            tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            while True:
                fetched = await consumer.getmany(timeout_ms=MODELS_POLL_MS)
                newest = None
                for records in fetched.values():
                    for record in records:
                        if record.key == SERVER_NAME.encode():
                            newest = record
                if newest is not None:
                    await self._load(self.loader.from_message, newest.value,
                                     f"{self.topic}[{newest.partition}]@{newest.offset}")
        finally:
            await consumer.stop()


class CheckpointModels(ModelSource):
    """The newest good checkpoint of one process, looked for every ``poll_s``; a newer file
    that is refused is not tried again, and until a first model is found older files are."""

    def __init__(self, directory: Path, poll_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.directory = directory
        self.poll_s = poll_s
        self.tried: set[Path] = set()

    def describe(self) -> str:
        return f"the checkpoints of {self.loader.process} in {self.directory}"

    async def run(self) -> None:
        while True:
            for path in CheckpointStore(self.directory).candidates():
                if path in self.tried:
                    break
                self.tried.add(path)
                if await self._load(self.loader.from_checkpoint, path):
                    break
            await asyncio.sleep(self.poll_s)  # the polling interval (serve.poll_s)


class ExportModels(ModelSource):
    """An export directory, its card looked at every ``poll_s``; a new card is loaded (every
    file's digest checked against it)."""

    def __init__(self, directory: Path, poll_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.directory = directory
        self.poll_s = poll_s
        self.seen: tuple[int, int, int] | None = None

    def describe(self) -> str:
        return f"the export in {self.directory}"

    async def run(self) -> None:
        card = self.directory / CARD_FILE
        while True:
            try:
                st = card.stat()
                stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            except OSError:
                stamp = None
            if stamp is not None and stamp != self.seen:
                self.seen = stamp
                await self._load(self.loader.from_export, self.directory)
            await asyncio.sleep(self.poll_s)  # the polling interval (serve.poll_s)


# --- the process ---------------------------------------------------------------------------
class Server:
    """One serve instance's parts, wired together (``run_serve`` runs it)."""

    def __init__(self, cfg: JobConfig, name: str, bootstrap: str, metrics: Metrics, model_from: str,
                 process: str | None, export_dir: Path | None) -> None:
        self.cfg = cfg
        self.name = name
        self.bootstrap = bootstrap
        self.metrics = metrics
        self.health: Health = metrics.health
        self.ingest_cfg = serve_ingest_config(cfg)
        self.data = job_fleet_data(cfg)
        self.predict_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="serve-predict")
        self.load_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="serve-load")
        self.predict_pool.submit(limit_torch_threads, TORCH_THREADS).result()
        # Whose model: the process whose checkpoints are read, else the job's model holder.
        holder = process or (SERVER_NAME if "server" in roles(cfg.train.strategy) else cfg.worker_names()[0])
        loader = ModelLoader(training_plan(cfg), self.data, holder,
                             role="server" if holder == SERVER_NAME else "worker")
        common = {"loader": loader, "executor": self.load_pool, "accept": self.accept, "refuse": self.refuse}
        self.source: ModelSource
        if model_from == "models":
            self.source = TopicModels(bootstrap, channel_topic(cfg.job.name, "models"), cfg.kafka.max_message_bytes,
                                      **common)
        elif model_from == "checkpoints":
            assert process is not None
            self.source = CheckpointModels(worker_state_dir(cfg, process) / "checkpoints", cfg.serve.poll_s, **common)
        else:
            assert export_dir is not None
            self.source = ExportModels(export_dir, cfg.serve.poll_s, **common)
        self.layout = cfg.input.layout()
        self.producer: AIOKafkaProducer | None = None
        self.sink = PredictingSink(
            predict=self._predict, send=self._send, topic=topics.predictions_topic(cfg.job.name), job=cfg.job.name,
            worker=name, top_k=cfg.serve.top_k, max_batch=cfg.serve.max_batch, topic_of=self.layout.topic,
            metrics=metrics)
        self.first_model = asyncio.Event()

    # --- the model -----------------------------------------------------------------------
    def accept(self, model: ServingModel) -> None:
        """A loaded candidate: swapped in (between micro-batches) if the swap rule says so."""
        try:
            decision = swap_decision(self.sink.newest.ident if self.sink.newest else None, model.ident)
        except ModelRefused as exc:
            self.refuse(exc, model)
            return
        if decision == SAME:
            return
        self.sink.offer(model)
        self.health.set("model", True, f"model version {model.ident.version}")
        self.first_model.set()

    def refuse(self, exc: ModelRefused, model: ServingModel | None = None) -> None:
        self.metrics.serve_refused.labels(exc.reason).inc()
        what = f" {model.ident}" if model is not None else ""
        log.warning("%s: refused model%s (%s): %s; keeps serving %s", self.name, what, exc.reason, exc.detail,
                    self.sink.newest.ident if self.sink.newest else "nothing (waiting for a first model)")

    async def _predict(self, model: ServingModel, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return await asyncio.get_running_loop().run_in_executor(self.predict_pool, model.predict, features,
                                                                self.cfg.serve.top_k, self.cfg.serve.max_batch)

    async def _send(self, topic: str, messages: list[tuple[bytes, bytes]]) -> list[Any]:
        assert self.producer is not None
        return await send_keyed(self.producer, topic, messages)

    async def _dead_letter(self, letter: DeadLetter) -> None:
        assert self.producer is not None
        value, headers = dead_letter_message(letter, self.name, self.cfg.kafka.max_message_bytes)
        fut = await self.producer.send(topics.SENSOR_DLQ, key=letter.key, value=value,
                                       headers=list(headers.items()))
        await fut  # the record is settled only once its dead letter is durable

    # --- the run -------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Wait for the first model, then read, predict and publish until ``stop`` is set."""
        tasks = [asyncio.ensure_future(self.source.run()), asyncio.ensure_future(self._beat())]
        source: GroupSensorSource | None = None
        try:
            log.warning("%s: waiting for a first model from %s; no record is read before it (not ready)",
                        self.name, self.source.describe())
            waiting = [asyncio.ensure_future(self.first_model.wait()), asyncio.ensure_future(stop.wait())]
            await asyncio.wait([*waiting, tasks[0]], return_when=asyncio.FIRST_COMPLETED)
            for task in waiting:
                task.cancel()
            if tasks[0].done():
                tasks[0].result()  # raises what stopped it
            if stop.is_set():
                return
            self.producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=True,
                                             max_request_size=self.cfg.kafka.max_message_bytes,
                                             max_batch_size=min(PRODUCER_BATCH_BYTES, self.cfg.kafka.max_message_bytes),
                                             linger_ms=2, client_id=f"edgestream-serve-{self.name}",
                                             **security.current().aiokafka())
            await self.producer.start()
            tracker = OffsetTracker()
            clock = time.monotonic
            devices = self.cfg.devices.device_ids()
            core = IngestCore(self.ingest_cfg, devices, self.metrics, start=clock(),
                              expected_shape=self.data.feature_shape, num_classes=self.data.num_classes,
                              value_range=self.data.value_range)
            core.stamp_origin = True
            driver = IngestDriver(core, self.sink, tracker, self._dead_letter)

            async def drain() -> None:
                await driver.perform(core.flush(clock()))
                await self.sink.drain()

            source = GroupSensorSource(
                topics=sorted({self.layout.topic(d) for d in devices}), bootstrap=self.bootstrap, group_id=self.cfg.serve.group_of(self.cfg), driver=driver,
                tracker=tracker, max_message_bytes=self.cfg.kafka.max_message_bytes, clock=clock, drain=drain,
                on_assigned=lambda n: self.health.set("assigned", True, f"{n} device partition(s)"))
            driver.source = source
            tasks.append(asyncio.ensure_future(self.sink.run()))
            await source.start()
            tasks.append(asyncio.ensure_future(self._tick(driver, core, source, clock)))
            stopped = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait([stopped, *tasks, *source._loops], return_when=asyncio.FIRST_COMPLETED)
            if stopped not in done:
                stopped.cancel()
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                raise RuntimeError("a task of serve ended on its own")
            log.warning("%s: stopping: finishing the records read, committing, leaving the group", self.name)
            await source.close()
            source = None
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if source is not None and source.consumer is not None:
                with contextlib.suppress(Exception):
                    await source.consumer.stop()
            if self.producer is not None:
                await self.producer.stop()
            self.predict_pool.shutdown(wait=False, cancel_futures=True)
            self.load_pool.shutdown(wait=False, cancel_futures=True)

    async def _tick(self, driver: IngestDriver, core: IngestCore, source: GroupSensorSource,
                    clock: Callable[[], float]) -> None:
        """Close elapsed batch windows (``serve.max_wait_s``), update the lag gauges."""
        tick_s = max(0.005, min(0.1, self.cfg.serve.max_wait_s / 2))
        lag_at = 0.0
        while True:
            await asyncio.sleep(tick_s)  # the batch window's timer
            await driver.perform(core.on_tick(clock()))
            now = clock()
            if now - lag_at >= LAG_INTERVAL_S:
                lag_at = now
                self.metrics.record_consumer_lag(source.consumer_lag())

    async def _beat(self) -> None:
        while True:
            self.health.beat()
            await asyncio.sleep(1.0)  # the liveness beat


def run_serve(cfg: JobConfig, name: str, bootstrap: str, *, model_from: str, process: str | None,
              export_dir: Path | None, metrics_port: int = 0) -> dict[str, Any]:
    """Run one serve instance until SIGTERM/SIGINT; returns what it did (also in its state dir's
    ``serve.json``). Creates the topics it reads and writes first."""
    wanted = {**sensor_topics_for(cfg.devices.device_ids(), cfg.input.layout()),
              topics.predictions_topic(cfg.job.name): "predictions"}
    if model_from == "models":
        wanted[channel_topic(cfg.job.name, "models")] = "models"
    ensure_topics(bootstrap, wanted, sized=sensor_partitions(cfg))
    state = worker_state_dir(cfg, name)
    state.mkdir(parents=True, exist_ok=True)
    metrics = Metrics(health=Health(cfg.service.liveness_timeout_s))
    metrics.health.require("kafka", "model", "assigned")
    metrics.health.set("kafka", True, "topics created")
    metrics.serve_model_version.set(-1)
    port = serve(metrics, metrics_port, cfg.workers.metrics_host)
    host = cfg.workers.metrics_host
    write_json_atomic(state / ENDPOINT_FILE, {
        "worker": name, "pid": os.getpid(), "metrics": f"http://{host}:{port}/metrics",
        "health": f"http://{host}:{port}/healthz", "ready": f"http://{host}:{port}/readyz", "devices": []})
    service = ProcessService(name, cfg.job.name, metrics.health, cfg.service.shutdown_grace_s)
    server = Server(cfg, name, bootstrap, metrics, model_from, process, export_dir)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        service.signals.on_stop = lambda signum: stop.set()
        for signum in (2, 15):  # SIGINT, SIGTERM: through the service's stop signals (grace timer)
            loop.add_signal_handler(signum, service.signals, signum)
        await server.run(stop)

    try:
        asyncio.run(main())
    finally:
        service.close()
    summary = {"name": name, "job": cfg.job.name, "group": cfg.serve.group_of(cfg), "model_from": model_from,
               "published": dict(server.sink.published), "micro_batches": server.sink.micro_batches,
               "swaps": server.sink.swaps,
               "model_version": server.sink.model.ident.version if server.sink.model else None,
               "swap_log": [list(s) for s in server.sink.swap_log]}
    write_json_atomic(state / "serve.json", summary)
    return summary


__all__ = ["GroupSensorSource", "ModelSource", "PredictingSink", "ServeRefused", "run_serve"]
