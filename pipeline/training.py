"""Online training inside a worker (or the server): where Kafka meets torch.

``TrainingRuntime`` owns a ``LocalTrainer`` and a ``SyncStrategy`` and runs every
torch and strategy call on one single-thread executor, so the Faust event loop stays
responsive. It is the batch sink of the ingest agent (``defer_acks``: a batch's
messages are acknowledged only after it was trained), consumes the job's update
topics (``gradients.<job>``, ``models.<job>``, ``control.<job>``), publishes what the
strategy returns, evaluates on the held-out set, and checkpoints model + optimizer +
strategy state + resume offsets + the ingest ledger atomically.

Every local step passes the ``StepGuard`` before the strategy sees it: a step whose
loss or gradient is non-finite, or whose gradient norm is above its bound, is neither
applied nor published; its records go to ``sensors.dlq`` with the reason, are settled
as dead-lettered (neither trained nor lost) and the worker takes its next batch.

Delivery guarantee: on restart the worker restores its newest usable checkpoint and
seeks every topic to the checkpoint's offsets, so the sensor records trained after the
last checkpoint are trained again (at most ``train.checkpoint_every_steps`` steps' worth
per worker), messages settled above those offsets before the checkpoint are skipped,
and the update log is replayed from the same point, which brings the strategy back to
where its peers are.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faust
import numpy as np

from compression import registry as compressors
from compression.controllers.scadles import link_signal
from compression.memory import ErrorFeedback, NoMemory
from compression.pipeline import GradientCodec
from monitoring.metrics import Metrics
from pipeline.config import ConfigError, JobConfig
from pipeline.ingest import CONSUMED, DEAD
from streams import codec, topics
from streams.batching import Batch
from streams.buffering import concat
from streams.offsets import OffsetTracker
from streams.simulator import FleetData
from trainers import LocalTrainer, build_model, evaluate, limit_torch_threads
from trainers.checkpoint import CheckpointStore
from trainers.errors import BatchError, CheckpointNotFound, CheckpointRefused
from trainers.guard import StepGuard, StepRejection
from trainers.injection import DataInjector, shared_pool
from trainers.messages import Outgoing, UpdateMessage
from trainers.strategies import StrategyContext, create
from trainers.validation import TensorSpec
from trainers.wire import HEADER_CODEC, HEADER_TO, MessageRejected, decode_update, encode_update

log = logging.getLogger(__name__)

def channel_topic(job: str, channel: str) -> str:
    """The Kafka topic of a strategy channel: ``gradients.<job>``, ``models.<job>``, ``control.<job>``."""
    if channel == "gradients":
        return topics.gradients_topic(job)
    if channel == "models":
        return topics.models_topic(job)
    if channel == "control":
        return "control." + job
    raise ValueError(f"unknown channel {channel!r}")


def training_topics(job: str) -> dict[str, str]:
    """Topics a training job needs, name -> kind (for ``ensure_topics``)."""
    return {
        channel_topic(job, "gradients"): "gradients",
        channel_topic(job, "models"): "models",
        channel_topic(job, "control"): "gradients",
        topics.gradients_dlq_topic(job): "dlq",
    }


def parse_params(items: list[str]) -> dict[str, Any]:
    """``["ratio=0.01", "rank=4"]`` -> ``{"ratio": 0.01, "rank": 4}`` (JSON values, else strings)."""
    out: dict[str, Any] = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw.strip()
    return out


@dataclass
class TrainingStats:
    steps: int = 0
    trained_records: int = 0
    injected_records: int = 0
    bytes_sent: int = 0
    compressed_steps: int = 0
    updates_in: int = 0
    updates_rejected: int = 0
    accuracy: float = 0.0
    loss: float = 0.0
    last_checkpoint_step: int = -1
    rejected_steps: int = 0
    dead_lettered_records: int = 0
    rejected_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)


class TrainingRuntime:
    """Trainer + strategy of one process, driven from asyncio through one executor thread.

    Invariant: the trainer and the strategy are only touched on ``self.executor``'s
    single thread, one call at a time, in the order the train loop issues them.
    """

    defer_acks = True

    def __init__(
        self,
        cfg: JobConfig,
        name: str,
        data: FleetData,
        metrics: Metrics,
        state_dir: Path,
        *,
        role: str = "worker",
    ) -> None:
        self.cfg = cfg
        self.name = name
        self.role = role
        self.data = data
        self.metrics = metrics
        self.state_dir = state_dir
        self.checkpoints = CheckpointStore(state_dir / "checkpoints", keep=cfg.train.checkpoint_keep,
                                           max_abs=cfg.train.max_abs_weight or None,
                                           legacy_path=state_dir / "checkpoint.bin")
        self.evaluations_path = state_dir / "evaluations.jsonl"
        self.guard = StepGuard(cfg.train.max_grad_norm, cfg.train.grad_norm_spike)
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"train-{name}")
        self.executor.submit(limit_torch_threads, cfg.train.torch_threads).result()
        model = build_model(cfg.train.model, data.feature_shape, data.num_classes, seed=cfg.job.seed,
                            standardize=data.input_stats)
        self.trainer = LocalTrainer(model, lr=cfg.train.lr, momentum=cfg.train.momentum)
        self.spec = TensorSpec.from_trainer(self.trainer)
        try:
            self.strategy = create(
                cfg.train.strategy,
                StrategyContext(name, self.trainer, role=role, members=tuple(cfg.worker_names())),  # type: ignore[arg-type]
                **parse_params(cfg.train.strategy_params),
            )
        except Exception as exc:
            raise ConfigError(f"train.strategy={cfg.train.strategy!r}: {exc}") from exc
        try:
            compressor = compressors.create(cfg.train.codec, **parse_params(cfg.train.codec_params))
        except Exception as exc:
            raise ConfigError(f"train.codec={cfg.train.codec!r}: {exc}") from exc
        memory = ErrorFeedback() if cfg.train.error_feedback and cfg.train.codec != "dense" else NoMemory()
        self.codec = GradientCodec(compressor, memory, max_bytes=cfg.kafka.max_message_bytes)
        # ScaDLES's vote needs the signal of every gradient, computed against this codec's residuals.
        self.votes = bool(getattr(self.strategy, "adaptive_compression", False))
        if self.votes and cfg.train.codec == "dense":
            raise ConfigError(
                f"train.strategy={cfg.train.strategy!r} with adaptive_compression needs a compressing "
                "train.codec (e.g. train.codec=topk, train.codec_params=[\"ratio=0.1\"])"
            )
        if cfg.train.strategy == "scadles" and cfg.batcher.mode != "window":
            log.warning("scadles expects batcher.mode=window (time windows); this job uses %r", cfg.batcher.mode)
        self.injector: DataInjector | None = None
        if role == "worker" and cfg.train.injection_alpha > 0 and cfg.train.injection_beta > 0:
            pool = shared_pool(data.train.features, data.train.labels, cfg.train.injection_pool_per_class,
                               seed=cfg.job.seed)
            self.injector = DataInjector(pool, data.num_classes, alpha=cfg.train.injection_alpha,
                                         beta=cfg.train.injection_beta, seed=cfg.job.seed * 7919 + _index(name))
        names = cfg.worker_names()
        self.slowdown = cfg.workers.slowdown_of(names.index(name)) if name in names else 1.0
        self._ready_since: float | None = None
        #: (model version, decision) each time the replicated compression vote switched.
        self.vote_log: collections.deque[tuple[int, bool]] = collections.deque(maxlen=1000)
        self.sensor_offsets = OffsetTracker()
        self.update_offsets: dict[str, int] = {}  # "topic:partition" -> next offset to handle
        self.resume_offsets: dict[str, int] = {}
        #: The ingest ledger of the restored checkpoint (``IngestCore(restored=...)``).
        self.restored_ledger: dict[str, dict[str, Any]] = {}
        self.batches: asyncio.Queue[Batch] | None = None
        self.inbox: asyncio.Queue[tuple[str, int, int, bytes, dict[str, bytes]]] | None = None
        self.wakeup: asyncio.Event | None = None
        self.publish: Callable[[str, bytes, dict[str, bytes], bytes], Awaitable[None]] | None = None
        self.dead_letter: Callable[[bytes, dict[str, bytes]], Awaitable[None]] | None = None
        self.sensor_dead_letter: Callable[[bytes, dict[str, bytes]], Awaitable[None]] | None = None
        #: Set by the ingest driver (``IngestDriver.settle``): the sink is done with a batch.
        self.settle: Callable[..., Awaitable[None]] | None = None
        #: Set by the ingest driver (``IngestDriver.snapshot``): what a checkpoint stores of ingest.
        self.ingest_snapshot: Callable[[], dict[str, Any]] | None = None
        self.stats = TrainingStats()
        metrics.init_worker(name)
        self._last_eval = 0.0
        self._steps_since_checkpoint = 0
        self.heldout_x = data.heldout.features
        self.heldout_y = data.heldout.labels
        self.restored_from: int | None = None
        self.restored_skipped: list[str] = []
        self._restore()

    # --- checkpoint --------------------------------------------------------------------
    def _restore(self) -> None:
        """Load the newest usable checkpoint (older ones if the newest are bad) and take
        its offsets, ingest ledger and counters; a fresh start if there is none."""
        try:
            restored = self.executor.submit(self.checkpoints.restore, self.trainer, self.strategy).result()
        except CheckpointNotFound:
            return
        checkpoint = restored.checkpoint  # the store logged a warning for each file it skipped
        offsets = checkpoint.offsets
        sensors = {k: int(v) for k, v in offsets.get("sensors", {}).items()}
        self.sensor_offsets = OffsetTracker(start=sensors, done=offsets.get("sensors_done", {}))
        self.update_offsets = {k: int(v) for k, v in offsets.get("updates", {}).items()}
        self.resume_offsets = {**sensors, **self.update_offsets}
        self.restored_ledger = dict(checkpoint.meta.get("ledger", {}))
        self.stats.steps = int(checkpoint.meta.get("steps", 0))
        self.stats.trained_records = int(checkpoint.meta.get("trained_records", 0))
        self.restored_from = self.trainer.version
        self.restored_skipped = [str(path) for path, _ in restored.skipped]
        log.warning("%s restored checkpoint %s at model version %d (step %d)", self.name,
                    checkpoint.path.name, self.trainer.version, self.stats.steps)

    def start_fresh(self, sensors: dict[str, int], updates: dict[str, int]) -> None:
        """No checkpoint was restored: write checkpoint 0 (the initial model at the positions
        this process starts reading from: ``"topic:partition" -> offset``), so that a restart
        before the first periodic checkpoint replays the update log from where this one
        started instead of from wherever its consumer group has committed to by then (a
        fresh model on a log read half-way would never rejoin its BSP peers)."""
        self.sensor_offsets = OffsetTracker(start=sensors)
        self.update_offsets = dict(updates)
        self.resume_offsets = {**sensors, **updates}
        offsets = {"sensors": dict(sensors), "sensors_done": {}, "updates": dict(updates)}
        meta = {"steps": 0, "trained_records": 0, "worker": self.name, "saved_at": time.time(), "ledger": {}}
        self.executor.submit(self.checkpoints.save, self.trainer, self.strategy, offsets, meta).result()

    def _checkpoint_payload(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Offsets and meta of a checkpoint, taken on the event loop at one instant (the
        ingest ledger and the sensor watermarks must agree)."""
        ingest = self.ingest_snapshot() if self.ingest_snapshot is not None else {}
        offsets = {"sensors": ingest.get("sensors", {}), "sensors_done": ingest.get("sensors_done", {}),
                   "updates": dict(self.update_offsets)}
        meta = {"steps": self.stats.steps, "trained_records": self.stats.trained_records,
                "worker": self.name, "saved_at": time.time(), "ledger": ingest.get("ledger", {})}
        return offsets, meta

    async def _checkpoint(self) -> None:
        """Save a checkpoint. Raises ``CheckpointRefused`` if the model state is unsound
        (non-finite): the worker must not go on training on it, so the train loop crashes
        and a restart restores the last good checkpoint."""
        offsets, meta = self._checkpoint_payload()
        await self._call(self.checkpoints.save, self.trainer, self.strategy, offsets, meta)
        self.stats.last_checkpoint_step = self.stats.steps
        self.metrics.last_checkpoint.labels(self.name).set(time.time())

    # --- sink protocol (ingest -> training) ---------------------------------------------
    async def submit(self, batch: Batch) -> None:
        assert self.batches is not None and self.wakeup is not None
        await self.batches.put(batch)  # bounded: a slow trainer backpressures ingest
        self.wakeup.set()

    # --- wiring into a Faust app ---------------------------------------------------------
    def attach(self, app: faust.App) -> None:
        """Register the update-topic agent and the train loop on ``app``."""
        job = self.cfg.job.name
        subscribed = [channel_topic(job, ch) for ch in self.strategy.subscribes]
        publish_topics = {ch: app.topic(channel_topic(job, ch), key_serializer="raw", value_serializer="raw")
                          for ch in ("gradients", "models", "control")}
        dlq = app.topic(topics.gradients_dlq_topic(job), key_serializer="raw", value_serializer="raw")
        sensor_dlq = app.topic(topics.SENSOR_DLQ, key_serializer="raw", value_serializer="raw")
        source = app.topic(*subscribed, key_serializer="raw", value_serializer="raw")

        async def publish(channel: str, value: bytes, headers: dict[str, bytes], key: bytes) -> None:
            fut = await publish_topics[channel].send(key=key, value=value, headers=headers)
            await fut

        async def dead_letter(value: bytes, headers: dict[str, bytes]) -> None:
            fut = await dlq.send(value=value[:1 << 20], headers=headers)
            await fut

        async def sensor_dead_letter(value: bytes, headers: dict[str, bytes]) -> None:
            fut = await sensor_dlq.send(value=value, headers=headers)
            await fut

        self.publish = publish
        self.dead_letter = dead_letter
        self.sensor_dead_letter = sensor_dead_letter

        @app.agent(source, concurrency=1)
        async def updates(stream: faust.Stream) -> None:
            async for event in stream.events():
                msg = event.message
                headers = {k: (v if isinstance(v, bytes) else bytes(v)) for k, v in (event.headers or {}).items()}
                assert self.inbox is not None and self.wakeup is not None
                await self.inbox.put((msg.topic, msg.partition, msg.offset, event.value or b"", headers))
                self.wakeup.set()

        @app.task
        async def train_loop() -> None:
            await self.run()

        @app.timer(interval=1.0)
        async def gauges() -> None:
            self.metrics.model_version.labels(self.name).set(self.trainer.version)

        _ = (updates, train_loop, gauges)

    # --- the loop ------------------------------------------------------------------------
    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def run(self) -> None:
        self.batches = asyncio.Queue(maxsize=16)
        self.inbox = asyncio.Queue()
        self.wakeup = asyncio.Event()
        try:
            while True:
                await self._drain_inbox()
                await self._send(await self._call(self.strategy.poll, time.monotonic()))
                trained = False
                if self.role == "worker" and await self._call(self.strategy.can_train):
                    if self.batches.empty():
                        if self._ready_since is None:
                            self._ready_since = time.monotonic()  # allowed to train, no data yet
                    else:
                        await self._step()
                        trained = True
                now = time.monotonic()
                if now - self._last_eval >= self.cfg.train.eval_every_s:
                    self._last_eval = now
                    await self._evaluate()
                if not trained and self.inbox.empty():
                    self.wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.wakeup.wait(), timeout=0.05)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: training loop failed", self.name)
            raise

    async def _drain_inbox(self) -> None:
        assert self.inbox is not None
        while not self.inbox.empty():
            topic, partition, offset, value, headers = self.inbox.get_nowait()
            key = OffsetTracker.key(topic, partition)
            if offset < self.update_offsets.get(key, 0):
                continue  # already handled before the checkpoint we restored
            self.update_offsets[key] = offset + 1
            to = headers.get(HEADER_TO)
            if to and to.decode() != self.name:
                continue
            self.stats.updates_in += 1
            try:
                msg: UpdateMessage = await self._call(self._decode, value)
            except MessageRejected as exc:
                self.stats.updates_rejected += 1
                self.metrics.updates_rejected.labels(self.name, exc.reason).inc()
                log.warning("%s: rejected update at %s[%d]@%d: %s", self.name, topic, partition, offset, exc)
                assert self.dead_letter is not None
                await self.dead_letter(value, {
                    topics.DLQ_HEADER_REASON: exc.reason.encode(),
                    topics.DLQ_HEADER_DETAIL: str(exc.detail).encode()[:1024],
                    topics.DLQ_HEADER_TOPIC: topic.encode(),
                    topics.DLQ_HEADER_PARTITION: str(partition).encode(),
                    topics.DLQ_HEADER_OFFSET: str(offset).encode(),
                    topics.DLQ_HEADER_WORKER: self.name.encode(),
                })
                continue
            codec = headers.get(HEADER_CODEC, b"dense").decode(errors="replace")[:32]
            self.metrics.gradient_bytes_received.labels(self.name, codec).inc(len(value))
            version_before = self.trainer.version
            decision_before = self._decision()
            out = await self._call(self.strategy.on_message, msg)
            if self.votes and self._decision() != decision_before:
                self.vote_log.append((self.trainer.version, self._decision()))
                log.info("%s: the compression vote switches to %s from model version %d", self.name,
                         "compressed (top-k)" if self._decision() else "dense", self.trainer.version)
            if msg.kind in ("gradient", "delta") and self.trainer.version > version_before:
                self.metrics.staleness_versions.labels(self.name).observe(max(0, version_before - msg.base_version))
            await self._send(out)

    def _decode(self, value: bytes) -> UpdateMessage:
        return decode_update(value, expected_shapes=self.spec, max_bytes=self.cfg.kafka.max_message_bytes,
                             job=self.cfg.job.name, max_norm=self.cfg.train.max_grad_norm or None)

    async def _step(self) -> None:
        assert self.batches is not None
        parts: list[Batch] = []
        size = 0
        # fixed mode (the BSP baseline): exactly one batch per step; window mode (ScaDLES):
        # every window batch waiting, up to max_step_batch records.
        limit = 1 if self.cfg.batcher.mode == "fixed" else None
        while not self.batches.empty() and size < self.cfg.train.max_step_batch:
            batch = self.batches.get_nowait()
            parts.append(batch)
            size += batch.size
            if limit is not None and len(parts) >= limit:
                break
        records = concat([b.records for b in parts]) if len(parts) > 1 else parts[0].records
        started = time.monotonic()
        wait_s = started - self._ready_since if self._ready_since is not None else 0.0
        self._ready_since = None
        if records.labels is None:  # ingest dead-letters unlabelled messages of a training job
            await self._reject(parts, StepRejection("bad_batch", "records carry no labels"))
            return
        x = np.ascontiguousarray(records.features, dtype=np.float32)
        y = np.asarray(records.labels, dtype=np.int64)
        injected = 0
        if self.injector is not None:
            x, y, injection = self.injector.augment(x, y)
            injected = injection.samples
        try:
            result, compute_s = await self._call(self._compute, x, y)
        except BatchError as exc:
            await self._reject(parts, self.guard.reject_batch(exc))
            return
        rejection = await self._call(self.guard.check, result)
        if rejection is not None:
            await self._reject(parts, rejection)
            return
        if injected:
            self.stats.injected_records += injected
            self.metrics.injected_records.labels(self.name).inc(injected)
        if self.votes:
            await self._call(self._observe_signal, result.gradients)
        out = await self._call(self.strategy.on_local_step, result)
        if self.slowdown > 1.0:
            # emulated compute heterogeneity (a slower device), not synchronisation
            await asyncio.sleep((self.slowdown - 1.0) * compute_s)
        compressed = self._compressed(out)
        self.stats.steps += 1
        self.stats.trained_records += size
        self.stats.compressed_steps += int(compressed)
        self.stats.loss = float(result.loss)
        self.metrics.record_step(self.name, step_s=time.monotonic() - started, wait_s=wait_s, records=size,
                                 loss=self.stats.loss, compressed=compressed)
        await self._send(out)
        # The batch is trained (its gradient is published): now its records are settled.
        assert self.settle is not None
        for batch in parts:
            await self.settle(batch, CONSUMED)
        self._steps_since_checkpoint += 1
        if self._steps_since_checkpoint >= self.cfg.train.checkpoint_every_steps:
            self._steps_since_checkpoint = 0
            await self._checkpoint()

    async def _reject(self, parts: list[Batch], rejection: StepRejection) -> None:
        """A step the guard refused: nothing applied or published; each batch's records go to
        ``sensors.dlq`` (re-encoded, with the reason), then are settled as dead-lettered."""
        records = sum(b.size for b in parts)
        self.stats.rejected_steps += 1
        self.stats.dead_lettered_records += records
        self.stats.rejected_by_reason[rejection.reason] = self.stats.rejected_by_reason.get(rejection.reason, 0) + 1
        self.metrics.rejected_steps.labels(self.name, rejection.reason).inc()
        log.warning("%s: step rejected (%s): %s; %d records dead-lettered", self.name, rejection.reason,
                    rejection.detail, records)
        assert self.sensor_dead_letter is not None and self.settle is not None
        for batch in parts:
            headers = {
                topics.DLQ_HEADER_REASON: rejection.reason.encode(),
                topics.DLQ_HEADER_DETAIL: rejection.detail.encode()[:1024],
                topics.DLQ_HEADER_TOPIC: topics.sensor_topic(batch.device).encode(),
                topics.DLQ_HEADER_WORKER: self.name.encode(),
                topics.DLQ_HEADER_RECORDS: str(batch.size).encode(),
            }
            offsets = self._source_offsets(batch)
            if offsets is not None:
                headers[topics.DLQ_HEADER_PARTITION] = str(offsets[0]).encode()
                headers[topics.DLQ_HEADER_OFFSET] = str(offsets[1]).encode()
                headers[topics.DLQ_HEADER_OFFSETS] = f"{offsets[1]}-{offsets[2]}".encode()
            await self.sensor_dead_letter(codec.encode(batch.records), headers)  # durable first
            await self.settle(batch, DEAD, rejection.reason)

    @staticmethod
    def _source_offsets(batch: Batch) -> tuple[int, int, int] | None:
        """(partition, first, last) offsets of the messages ``batch`` came from, when known."""
        spans = [(t.partition, t.offset, t.last) for t, _ in batch.sources if hasattr(t, "last")]
        if not spans:
            return None
        return spans[0][0], min(s[1] for s in spans), max(s[2] for s in spans)

    def _decision(self) -> bool:
        """The replicated ScaDLES decision for the pending step (False without the vote)."""
        return bool(getattr(self.strategy, "compress_next", False)) if self.votes else False

    def _compute(self, x: np.ndarray, y: np.ndarray) -> tuple[Any, float]:
        """The local step, and how long the forward/backward pass itself took (on this thread)."""
        started = time.monotonic()
        result = self.trainer.compute_gradient(x, y)
        return result, time.monotonic() - started

    def _observe_signal(self, gradients: dict[str, Any]) -> None:
        """The ScaDLES compression signal of a new gradient, against this link's residuals."""
        signal = link_signal(self.codec.memory, gradients, self.strategy.ratio)  # type: ignore[attr-defined]
        self.strategy.observe_signal(signal)  # type: ignore[attr-defined]
        self.metrics.compression_vote.labels(self.name).set(1.0 if signal <= self.strategy.delta else 0.0)  # type: ignore[attr-defined]

    def _compressed(self, outgoing: list[Outgoing]) -> bool:
        """True if this step's gradient goes out compressed (a compressing codec, not a dense step)."""
        return any(
            item.message.kind in ("gradient", "delta") and self.cfg.train.codec != "dense"
            and item.message.meta.get("compress", True) is not False
            for item in outgoing
        )

    async def _send(self, outgoing: list[Outgoing]) -> None:
        assert self.publish is not None
        for item in outgoing:
            value, headers = await self._call(self._encode, item)
            await self.publish(item.channel, value, headers, self.name.encode())
            self.stats.bytes_sent += len(value)
            codec = headers.get(HEADER_CODEC, b"dense").decode()
            if item.message.kind in ("gradient", "delta"):
                dense = 4 * sum(int(t.numel()) for t in item.message.tensors.values())
                self.metrics.record_sent(self.name, codec, len(value), dense)
            else:
                self.metrics.gradient_bytes_sent.labels(self.name, codec).inc(len(value))

    def _encode(self, item: Outgoing) -> tuple[bytes, dict[str, bytes]]:
        codec = self.codec if item.message.kind in ("gradient", "delta") else None
        compress = item.message.meta.get("compress", True) is not False
        return encode_update(item.message, job=self.cfg.job.name, codec=codec, compress=compress, to=item.to)

    async def _evaluate(self) -> None:
        if self.role == "server" and self.strategy.name != "asp":
            return
        result = await self._call(evaluate, self.trainer.model, self.heldout_x, self.heldout_y)
        self.stats.accuracy = float(result.accuracy)
        with open(self.evaluations_path, "a") as out:  # the accuracy timeline (TTA benchmarks, plots)
            out.write(json.dumps({"t": time.time(), "accuracy": self.stats.accuracy, "loss": float(result.loss),
                                  "version": self.trainer.version, "steps": self.stats.steps}) + "\n")
        self.metrics.accuracy.labels(self.name, "heldout").set(self.stats.accuracy)
        self.metrics.loss.labels(self.name, "heldout").set(float(result.loss))
        self.metrics.model_version.labels(self.name).set(self.trainer.version)

    async def shutdown(self) -> dict[str, Any]:
        """Final evaluation and checkpoint; the summary a run prints."""
        await self._evaluate()
        try:
            await self._checkpoint()
        except CheckpointRefused as exc:  # keep the last good ones; say so
            log.error("%s: final checkpoint refused, the last good one stays: %s", self.name, exc)
        stats = await self._call(self.strategy.stats)
        digest = await self._call(self.trainer.parameter_digest)
        return {
            "worker": self.name, "role": self.role, "strategy": self.strategy.name,
            "version": self.trainer.version, "digest": digest, "steps": self.stats.steps,
            "trained_records": self.stats.trained_records, "accuracy": self.stats.accuracy,
            "injected_records": self.stats.injected_records, "bytes_sent": self.stats.bytes_sent,
            "vote_log": [{"version": v, "compress": c} for v, c in self.vote_log], "compressed_steps": self.stats.compressed_steps,
            "loss": self.stats.loss, "updates_in": self.stats.updates_in,
            "updates_rejected": self.stats.updates_rejected, "restored_from": self.restored_from,
            "staleness": stats.get("staleness", {}), "counters": stats.get("counters", {}),
            "sensor_offsets": {key: {"watermark": mark, "open": self.sensor_offsets.open_count(key)}
                               for key, mark in self.sensor_offsets.watermarks().items()},
            "queued_batches": self.batches.qsize() if self.batches is not None else 0,
            "rejected_steps": self.stats.rejected_steps, "rejected_by_reason": dict(self.stats.rejected_by_reason),
            "dead_lettered_records": self.stats.dead_lettered_records,
            "restored_skipped": self.restored_skipped,
        }


def _index(name: str) -> int:
    """A stable small integer from a process name (seeds per-worker randomness)."""
    return sum((i + 1) * ord(ch) for i, ch in enumerate(name))
