"""Online training inside a worker (or the server): the live adapter of the training driver.

Everything that happens to the model is ``trainers.driver.TrainingDriver``'s; this
module only moves bytes and time between it and Kafka. ``TrainingRuntime`` runs every
driver call on one single-thread executor (the Faust event loop stays responsive). It
is the batch sink of the ingest agent (``defer_acks``: a batch's records are settled
only once trained, or dead-lettered), consumes the job's update topics its strategy
subscribes to (``gradients.<job>``, ``models.<job>``, ``control.<job>``, and for the
``inbox`` channel only its own ``inbox.<job>.<name>``), publishes what the driver
encodes (an ``inbox`` message to ``inbox.<job>.<to>``, the recipient's topic, ensured
before the first send to it), evaluates on the held-out set, and checkpoints model +
optimizer + strategy state + resume offsets + the ingest ledger atomically. The
summary (``training.json``) counts value bytes and messages out and in per channel.

Membership: every process publishes a heartbeat (``control`` message, meta ``op:
heartbeat``) on ``control.<job>`` every ``train.heartbeat_s`` and ``op: leave`` when it is
stopped by SIGTERM/SIGINT; every process reads that topic besides its strategy's channels
(heartbeats are not strategy input unless the strategy subscribes to ``control``) and
keeps a ``trainers.membership.Liveness`` table. When the live set of workers changes, the
driver is told (``TrainingDriver.membership``, on the training thread) and what the
strategy answers is published. Once a process is stopping it freezes: no more steps,
messages or membership changes, so the state it checkpoints is the one it left with.

A step the driver rejects (the step guard: non-finite loss or gradient, gradient norm
above its bound) is neither applied nor published; its records go to ``sensors.dlq``
with the reason, are settled as dead-lettered, and the worker takes its next batch.

Predictions (``serve.predictions``, docs/serving.md): a worker predicts every batch with its
model just before the step, on the training thread (``_scored_step``: version, digest once per
version, top-k), and hands the predictions of the records the step trained to a
``PredictionSender``, which publishes them on ``predictions.<job>`` beside the loop; a
checkpoint waits for them (its counts: ``meta["predictions"]``). With delayed labels a
record that waited for its label carries the prediction made when it arrived instead
(``predict`` with keys: ``ArrivalPredictions``).

Delivery guarantee: on restart the worker restores its newest usable checkpoint and
seeks every topic to the checkpoint's offsets, so the sensor records trained after the
last checkpoint are trained again (at most ``train.checkpoint_every_steps`` steps' worth
per worker), messages settled above those offsets before the checkpoint are skipped,
and the update log is replayed from the same point, which brings the strategy back to
where its peers are. A worker without a checkpoint writes checkpoint 0 (its start
positions) before its first step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faust
import numpy as np

from edgestream.job.config import ConfigError, JobConfig, emulated_wait_s
from edgestream.job.plan import training_plan
from edgestream.job.topics import SHARED_CHANNELS, channel_topic, read_topics, topic_channel
from edgestream.monitoring.metrics import Metrics
from edgestream.monitoring.recent import RecentValues
from edgestream.pipeline.ingest import CONSUMED, DEAD
from edgestream.pipeline.predictions import PredictionSender
from edgestream.streams import codec, topics
from edgestream.streams.batching import Batch, BatchQueue
from edgestream.streams.buffering import concat
from edgestream.streams.offsets import OffsetTracker
from edgestream.streams.predictions import (
    ArrivalPredictions,
    DigestCache,
    Made,
    scored_parts,
    top_k,
)
from edgestream.streams.simulator import FleetData
from edgestream.trainers import LocalTrainer, assembly, limit_torch_threads
from edgestream.trainers.checkpoint import SHAPE_MISMATCH, CheckpointStore
from edgestream.trainers.driver import Outbound, Stepped, TrainingDriver
from edgestream.trainers.errors import (
    BatchError,
    CheckpointNotFound,
    CheckpointRefused,
    NoUsableCheckpoint,
)
from edgestream.trainers.evaluation import evaluate
from edgestream.trainers.guard import StepRejection
from edgestream.trainers.membership import HEARTBEAT, LEAVE, OPS, Liveness, is_stale
from edgestream.trainers.messages import UpdateMessage
from edgestream.trainers.stages import compose
from edgestream.trainers.wire import (
    HEADER_CODEC,
    HEADER_KIND,
    HEADER_TO,
    MessageRejected,
    decode_update,
    encode_update,
)

log = logging.getLogger(__name__)

#: Batches the ingest may hand over before the trainer takes one: a slow trainer then
#: backpressures ingest (the buffers fill and the partitions pause). A worker holding many
#: devices (a shared topic) may queue two batches per device (``queued_batches_limit``):
#: a window closes on every device at once, and each is a small batch.
MAX_QUEUED_BATCHES = 16
#: Changes of the live set kept for the process's summary (``training.json``).
MEMBERSHIP_LOG_SIZE = 200
#: Steps' worth of messages a strategy with ``background_sends`` may have queued before
#: the training loop waits for its uplink.
BACKGROUND_SEND_DEPTH = 4




def pick(parts: list[Batch], positions: np.ndarray) -> list[Batch]:
    """The records at ``positions`` (ascending, over ``parts`` concatenated) as batches of
    the parts they belong to, in order (a part with none of them is left out)."""
    picked, start = [], 0
    for batch in parts:
        local = positions[(positions >= start) & (positions < start + batch.size)] - start
        if len(local):
            picked.append(batch.select(local))
        start += batch.size
    return picked


def initial_workers(cfg: JobConfig) -> list[str]:
    """The workers a job starts with (``train.initial_workers``, default every configured
    worker), in order: the strategy's initial members."""
    return list(training_plan(cfg).initial_workers)


def build_driver(cfg: JobConfig, name: str, data: FleetData, *, role: str = "worker",
                 joining: bool = False) -> TrainingDriver:
    """The model, strategy and driver of process ``name`` from the job (no I/O), built by
    ``trainers.assembly`` from the job's ``TrainingPlan``.

    ``joining``: the worker enters a running job and must first receive the model
    (``StrategyContext.joining``; its members are then the others).
    Raises ``ConfigError`` naming the key when the strategy or codec cannot be built.
    """
    try:
        return assembly.build_driver(training_plan(cfg), name, data, role=role, joining=joining)
    except assembly.AssemblyError as exc:
        raise ConfigError(str(exc)) from exc.__cause__


def assembled_evaluation(cfg: JobConfig, data: FleetData, state_dirs: dict[str, Path]) -> dict[str, Any]:
    """A stage-split job's model put together from each stage's newest checkpoint (worker
    ``w<k>`` holds stage k; ``state_dirs``: worker -> its state directory), evaluated on the
    held-out set: ``{"accuracy", "loss", "versions": {worker: version}}``. ``ConfigError``
    if a stage has no usable checkpoint."""
    trainers: list[LocalTrainer] = []
    versions = {}
    for name in cfg.worker_names():
        driver = build_driver(cfg, name, data)
        store = CheckpointStore(state_dirs[name] / "checkpoints", keep=cfg.train.checkpoint_keep,
                                legacy_path=state_dirs[name] / "checkpoint.bin")
        try:
            store.restore(driver.trainer, driver.strategy)
        except (CheckpointNotFound, NoUsableCheckpoint) as exc:
            raise ConfigError(f"stage {name} has no usable checkpoint in {state_dirs[name]}: {exc}") from exc
        trainers.append(driver.trainer)
        versions[name] = driver.trainer.version
    result = evaluate(compose([t.model for t in trainers]), data.heldout.features, data.heldout.labels)
    return {"accuracy": float(result.accuracy), "loss": float(result.loss), "versions": versions}


def has_checkpoint(cfg: JobConfig, state_dir: Path) -> bool:
    """Whether process state ``state_dir`` holds a checkpoint file to restore (usable or not)."""
    store = CheckpointStore(state_dir / "checkpoints", keep=cfg.train.checkpoint_keep,
                            legacy_path=state_dir / "checkpoint.bin")
    return bool(store.candidates())


@dataclass
class TrainingStats:
    steps: int = 0
    trained_records: int = 0
    bytes_sent: int = 0
    updates_in: int = 0
    updates_rejected: int = 0
    accuracy: float = 0.0
    loss: float = 0.0
    last_checkpoint_step: int = -1
    rejected_steps: int = 0
    dead_lettered_records: int = 0
    rejected_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Per channel (``gradients``, ``models``, ``control``, ``inbox``): message value bytes
    #: and messages this process published / consumed (every record read from its topics,
    #: heartbeats included; dead letters not).
    bytes_out: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes_in: dict[str, int] = dataclasses.field(default_factory=dict)
    messages_out: dict[str, int] = dataclasses.field(default_factory=dict)
    messages_in: dict[str, int] = dataclasses.field(default_factory=dict)

    def count_out(self, channel: str, nbytes: int) -> None:
        self.bytes_out[channel] = self.bytes_out.get(channel, 0) + nbytes
        self.messages_out[channel] = self.messages_out.get(channel, 0) + 1

    def count_in(self, channel: str, nbytes: int) -> None:
        self.bytes_in[channel] = self.bytes_in.get(channel, 0) + nbytes
        self.messages_in[channel] = self.messages_in.get(channel, 0) + 1


class TrainingRuntime:
    """The driver of one process, fed from Kafka and asyncio through one executor thread.

    Invariant: the driver (and so the trainer and the strategy) is only touched on
    ``self.executor``'s single thread, one call at a time, in the order the train loop
    issues them.
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
        joining: bool = False,
    ) -> None:
        self.cfg = cfg
        self.name = name
        self.role = role
        #: Started as a joiner (no checkpoint; enters a running job and waits for the model).
        self.joining = joining
        self.data = data
        self.metrics = metrics
        self.state_dir = state_dir
        self.checkpoints = CheckpointStore(state_dir / "checkpoints", keep=cfg.train.checkpoint_keep,
                                           max_abs=cfg.train.max_abs_weight or None,
                                           legacy_path=state_dir / "checkpoint.bin")
        self.evaluations_path = state_dir / "evaluations.jsonl"
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"train-{name}")
        self.executor.submit(limit_torch_threads, cfg.train.torch_threads).result()
        self.driver = self.executor.submit(build_driver, cfg, name, data, role=role, joining=joining).result()
        self.trainer = self.driver.trainer
        self.strategy = self.driver.strategy
        wanted = self.strategy.preferred_batcher
        if wanted is not None and cfg.batcher.mode != wanted:
            log.warning("%s expects batcher.mode=%s; this job uses %r", cfg.train.strategy, wanted, cfg.batcher.mode)
        names = cfg.worker_names()
        self.slowdown = cfg.workers.slowdown_of(names.index(name)) if name in names else 1.0
        self._ready_since: float | None = None
        self.sensor_offsets = OffsetTracker()
        self.update_offsets: dict[str, int] = {}  # "topic:partition" -> next offset to handle
        #: The update topics this process reads (its strategy's subscriptions; not heartbeats).
        self._reads = set(read_topics(cfg.job.name, name, self.strategy.subscribes)) - {
            channel_topic(cfg.job.name, "control")}
        self._handled_gauges: dict[tuple[str, int], Any] = {}  # (topic, partition) -> its labelled gauge
        self.resume_offsets: dict[str, int] = {}
        #: The ingest ledger of the restored checkpoint (``IngestCore(restored=...)``).
        self.restored_ledger: dict[str, dict[str, Any]] = {}
        self.pending = BatchQueue(cfg.batcher.mode)
        self._room: asyncio.Event | None = None
        #: (topic, partition, offset, timestamp_s, value, headers, arrival wall time) of update records.
        self.inbox: asyncio.Queue[tuple[str, int, int, float, bytes, dict[str, bytes], float]] | None = None
        self.wakeup: asyncio.Event | None = None
        self.publish: Callable[[str, bytes, dict[str, bytes], bytes], Awaitable[None]] | None = None
        self.dead_letter: Callable[[bytes, dict[str, bytes]], Awaitable[None]] | None = None
        #: Creates missing topics (name -> kind), idempotently, blocking: set by the process
        #: (``ensure_topics`` on its cluster); None: recipients' inboxes are not ensured.
        self.ensure_topics: Callable[[dict[str, str]], Any] | None = None
        #: Recipients whose inbox topic this process ensured (or is ensuring) -> that call.
        self._inboxes_ready: dict[str, asyncio.Future[Any]] = {}
        self.sensor_dead_letter: Callable[[bytes, dict[str, bytes]], Awaitable[None]] | None = None
        #: Set by the ingest driver (``IngestDriver.settle``): the sink is done with a batch.
        self.settle: Callable[..., Awaitable[None]] | None = None
        #: Set by the ingest driver (``IngestDriver.snapshot``): what a checkpoint stores of ingest.
        self.ingest_snapshot: Callable[[], dict[str, Any]] | None = None
        #: Devices whose batches it takes (set by the ingest: those it holds state for).
        self.devices_held: Callable[[], int] = lambda: 1
        #: Strategies with ``background_sends``: (messages, batches to settle after them) for
        #: the sender task, in order; a bounded queue (a slow uplink backpressures training).
        self._outbox: asyncio.Queue[tuple[list[Outbound], list[Batch], float]] | None = None
        self._sender: asyncio.Task[None] | None = None
        self._sender_error: BaseException | None = None
        self.stats = TrainingStats()
        #: How old the records were when trained (seconds since their event time): the summary's
        #: ``record_age_s`` percentiles.
        self.record_ages = RecentValues()
        #: serve.predictions: each trained record's prediction goes to predictions.<job> (workers only).
        self.predicting = bool(cfg.serve.predictions) and role == "worker"
        self._digests = DigestCache(self.trainer.parameter_digest)
        #: Delayed labels: the predictions made when readings arrived, until they are trained.
        self.arrival_predictions = (ArrivalPredictions(2 * cfg.labels.max_pending)
                                    if self.predicting and cfg.labels.delayed else None)
        #: Set by ``attach``: hands messages to the worker's producer (``PredictionSender.send``).
        self._producer_send: Callable[[str, list[tuple[bytes, bytes]]], Awaitable[list[Any]]] | None = None
        self._restored_predictions: dict[str, int] = {}
        metrics.init_worker(name)
        self._last_eval = 0.0
        self._steps_since_checkpoint = 0
        self.restored_from: int | None = None
        self.restored_skipped: list[str] = []
        # --- membership: heartbeats on control.<job>, the live set, the freeze on stop
        self.liveness = Liveness(name if role == "worker" else None, cfg.train.member_timeout_s)
        #: The live set the strategy was last told (before the first report: the initial members).
        self.live: tuple[str, ...] = tuple(initial_workers(cfg))
        #: Every change of the live set: seconds since start, live set, joined, gone.
        self.membership_log: list[dict[str, Any]] = []
        #: Set when the process is told to stop (signal) or shuts down: the loop freezes.
        self.stopping = False
        self.heartbeats_sent = 0
        self._started_at = time.monotonic()
        self._live_gauge, self._member_gauge = metrics.live_workers, metrics.worker_live
        self._restore()
        self.predictions = PredictionSender(
            self._send_prediction, topic=topics.predictions_topic(cfg.job.name), job=cfg.job.name, worker=name,
            on_published=lambda device, n: metrics.predictions.labels(device).inc(n),
            published=self._restored_predictions) if self.predicting else None
        self.executor.submit(self._observe).result()  # the base of the strategy's totals

    # --- checkpoint --------------------------------------------------------------------
    def _restore(self) -> None:
        """Load the newest usable checkpoint (older ones if the newest are bad) and take
        its offsets, ingest ledger and counters; a fresh start if there is none."""
        try:
            restored = self.executor.submit(self.checkpoints.restore, self.trainer, self.strategy).result()
        except CheckpointNotFound:
            return
        except NoUsableCheckpoint as exc:
            if exc.rejected and all(SHAPE_MISMATCH in reason for _, reason in exc.rejected):
                # An upgrade or a job file that changed the model: a configuration error, not
                # a crash a restart could cure (exit 2; systemd's RestartPreventExitStatus).
                given = f" (train.model_params={self.cfg.train.model_params})" if self.cfg.train.model_params else ""
                raise ConfigError(
                    f"the {len(exc.rejected)} checkpoint(s) in {exc.path} hold a model that does not fit "
                    f"train.model={self.cfg.train.model!r}{given} or train.strategy={self.cfg.train.strategy!r}: "
                    "this version or job file changed the model, so it cannot resume them; go back to the "
                    f"previous settings (or version), or move {exc.path} aside to start this worker from scratch"
                ) from exc
            raise
        checkpoint = restored.checkpoint  # the store logged a warning for each file it skipped
        offsets = checkpoint.offsets
        sensors = {k: int(v) for k, v in offsets.get("sensors", {}).items()}
        self.sensor_offsets = OffsetTracker(start=sensors, done=offsets.get("sensors_done", {}))
        self.update_offsets = {k: int(v) for k, v in offsets.get("updates", {}).items()}
        self.resume_offsets = {**sensors, **self.update_offsets}
        self._show_handled(self.update_offsets)
        self.restored_ledger = dict(checkpoint.meta.get("ledger", {}))
        self.stats.steps = int(checkpoint.meta.get("steps", 0))
        self.stats.trained_records = int(checkpoint.meta.get("trained_records", 0))
        self._restored_predictions = {str(k): int(v) for k, v in checkpoint.meta.get("predictions", {}).items()}
        observed = checkpoint.meta.get("observed_range")
        if observed is not None and self.driver.observed is not None:
            try:
                self.driver.observed.load_state_dict(observed)
            except ValueError as exc:  # the checkpoint is sound otherwise: learn them again
                log.warning("%s: the checkpoint's observed value range is not usable (%s); learning it again",
                            self.name, exc)
        self.restored_from = self.trainer.version
        self.restored_skipped = [str(path) for path, _ in restored.skipped]
        log.warning("%s restored checkpoint %s at model version %d (step %d)", self.name,
                    checkpoint.path.name, self.trainer.version, self.stats.steps)

    def _handled_gauge(self, topic: str, partition: int) -> Any:
        """This process's ``update_log_handled`` gauge of one partition (looked up once)."""
        gauge = self._handled_gauges.get((topic, partition))
        if gauge is None:
            gauge = self._handled_gauges[(topic, partition)] = self.metrics.update_log_handled.labels(
                self.name, topic, str(partition))
        return gauge

    def _show_handled(self, positions: dict[str, int]) -> None:
        """Export where this process reads each update partition from (``"topic:partition" ->
        next offset``; positions of topics it does not read are left out): it is a reader of
        its topics from the start, whether or not a message has come yet."""
        for key, end in positions.items():
            topic, partition = OffsetTracker.split_key(key)
            if topic in self._reads:
                self._handled_gauge(topic, partition).set(end)

    def start_fresh(self, sensors: dict[str, int], updates: dict[str, int]) -> None:
        """No checkpoint was restored: write checkpoint 0 (the initial model at the positions
        this process starts reading from: ``"topic:partition" -> offset``), so that a restart
        before the first periodic checkpoint replays the update log from where this one
        started instead of from wherever its consumer group has committed to by then (a
        fresh model on a log read half-way would never rejoin its BSP peers)."""
        self.sensor_offsets = OffsetTracker(start=sensors)
        self.update_offsets = dict(updates)
        self.resume_offsets = {**sensors, **updates}
        self._show_handled(self.update_offsets)
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
        if self.driver.observed is not None:  # learned bounds: a restart must not forget them
            meta["observed_range"] = self.driver.observed.state_dict()
        if self.predictions is not None:  # flushed: one per record trained up to here
            meta["predictions"] = dict(self.predictions.published)
        return offsets, meta

    async def _checkpoint(self) -> None:
        """Save a checkpoint. Raises ``CheckpointRefused`` if the model state is unsound
        (non-finite): the worker must not go on training on it, so the train loop crashes
        and a restart restores the last good checkpoint."""
        await self._flush()  # every step in it has published its messages and settled its records
        if self.predictions is not None:
            await self.predictions.flush()  # and its records' predictions
        offsets, meta = self._checkpoint_payload()
        await self._call(self.checkpoints.save, self.trainer, self.strategy, offsets, meta)
        self.stats.last_checkpoint_step = self.stats.steps
        self.metrics.last_checkpoint.labels(self.name).set(time.time())

    # --- sink protocol (ingest -> training) ---------------------------------------------
    async def predict(self, features: np.ndarray, keys: list[tuple[str, int]] | None = None) -> np.ndarray:
        """What the model predicts for ``features`` now, between steps (the step executor).

        ``keys``: each reading's ``(device, record id)``; with ``serve.predictions`` the whole
        prediction (version, digest, top-k) is kept under it until the reading is trained,
        and published then as the one made before its label was known."""
        if self.arrival_predictions is None or keys is None:
            return await self._call(self.driver.predict, features)
        classes, made = await self._call(self._arrival_scores, features)
        self.arrival_predictions.put(keys, made)
        return classes

    # --- predictions (serve.predictions) ---------------------------------------------------
    def _scores(self, features: np.ndarray) -> tuple[int, str, np.ndarray, np.ndarray, float]:
        """On the training thread: the model's version, its digest (once per version), the
        top-k classes and their probabilities for ``features``, and when."""
        version = self.trainer.version
        digest = self._digests.of(version)
        classes, probabilities = top_k(self.driver.probabilities(features), self.cfg.serve.top_k)
        return version, digest, classes, probabilities, time.time()

    def _scored_step(self, features: np.ndarray, labels: np.ndarray | None,
                     groups: np.ndarray) -> tuple[Stepped, tuple[int, str, np.ndarray, np.ndarray, float] | None]:
        """On the training thread: the batch's predictions by the model as it is, then the step."""
        try:
            scores = self._scores(features)
        except BatchError as exc:  # the step refuses the batch for the same reason
            log.warning("%s: no predictions for a batch the model cannot score: %s", self.name, exc)
            scores = None
        return self.driver.step(features, labels, groups), scores

    def _arrival_scores(self, features: np.ndarray) -> tuple[np.ndarray, list[Made]]:
        version, digest, classes, probabilities, now = self._scores(features)
        return classes[:, 0], [Made(version, digest, classes[i], probabilities[i], now) for i in range(len(classes))]

    async def _send_prediction(self, topic: str, messages: list[tuple[bytes, bytes]]) -> list[Any]:
        if self._producer_send is None:
            raise RuntimeError("predictions are published by an attached runtime (its app's producer)")
        return await self._producer_send(topic, messages)

    async def _publish_predictions(self, parts: list[Batch], scores: tuple[int, str, np.ndarray, np.ndarray, float],
                                   trained: np.ndarray | None) -> None:
        """Hand the predictions of the records the step trained (``trained``: their positions
        in ``parts`` concatenated; None: all) to the sender, per device batch."""
        assert self.predictions is not None
        version, digest, classes, probabilities, made_at = scores
        layout = self.cfg.input.layout()
        scored = scored_parts([(b.records, layout.topic(b.device)) for b in parts], version=version, digest=digest,
                              classes=classes, probabilities=probabilities, predicted_at=made_at, trained=trained)
        if self.arrival_predictions is not None:
            scored = [self.arrival_predictions.apply(one) for one in scored]
        await self.predictions.put(scored)

    async def submit(self, batch: Batch) -> None:
        assert self._room is not None and self.wakeup is not None
        while len(self.pending) >= self.queued_batches_limit():
            self._room.clear()
            await self._room.wait()  # a slow trainer backpressures ingest
        self.pending.put(batch)
        self.wakeup.set()

    def queued_batches_limit(self) -> int:
        """Batches that may wait for the trainer: ``MAX_QUEUED_BATCHES``, or two per device
        held when that is more."""
        return max(MAX_QUEUED_BATCHES, 2 * self.devices_held())

    # --- topics of this process --------------------------------------------------------
    def own_topics(self) -> dict[str, str]:
        """Topics only this process reads, name -> kind: its inbox if its strategy
        subscribes to ``inbox`` (ensured at start besides the job's training topics)."""
        if "inbox" not in self.strategy.subscribes:
            return {}
        return {channel_topic(self.cfg.job.name, "inbox", self.name): "gradients"}

    async def _inbox_ready(self, to: str) -> None:
        """Before the first message to ``to``: ensure its inbox topic exists (once per
        recipient, off the event loop), so a send to a member that has not started yet
        never waits on topic metadata. A failed attempt is retried by the next send."""
        if self.ensure_topics is None:
            return
        ready = self._inboxes_ready.get(to)
        if ready is None:
            wanted = {channel_topic(self.cfg.job.name, "inbox", to): "gradients"}
            ready = asyncio.get_running_loop().run_in_executor(None, self.ensure_topics, wanted)
            self._inboxes_ready[to] = ready
        try:
            await ready
        except Exception:
            self._inboxes_ready.pop(to, None)
            raise

    # --- wiring into a Faust app ---------------------------------------------------------
    def attach(self, app: faust.App) -> None:
        """Register the update-topic agent and the train loop on ``app``."""
        job = self.cfg.job.name
        read = read_topics(job, self.name, self.strategy.subscribes)
        control = channel_topic(job, "control")
        # The control topic carries the heartbeats: every process reads it, whether or not
        # its strategy takes control messages.
        strategy_reads_control = "control" in self.strategy.subscribes
        channel_of = {topic: topic_channel(job, topic) or topic for topic in read}
        publish_topics = {ch: app.topic(channel_topic(job, ch), key_serializer="raw", value_serializer="raw")
                          for ch in SHARED_CHANNELS}
        #: One topic object per recipient of inbox messages, created on the first send to it.
        inbox_topics: dict[str, faust.types.TopicT] = {}
        dlq = app.topic(topics.gradients_dlq_topic(job), key_serializer="raw", value_serializer="raw")
        sensor_dlq = app.topic(topics.SENSOR_DLQ, key_serializer="raw", value_serializer="raw")
        source = app.topic(*read, key_serializer="raw", value_serializer="raw")

        async def publish(channel: str, value: bytes, headers: dict[str, bytes], key: bytes,
                          timestamp: float | None = None) -> None:
            if channel == "inbox":
                # The recipient is the message's ``to`` (the driver's encoder sets the header).
                to = headers[HEADER_TO].decode()
                target = inbox_topics.get(to)
                if target is None:
                    await self._inbox_ready(to)
                    target = inbox_topics.setdefault(to, app.topic(
                        channel_topic(job, "inbox", to), key_serializer="raw", value_serializer="raw"))
            else:
                target = publish_topics[channel]
            fut = await target.send(key=key, value=value, headers=headers, timestamp=timestamp)
            written = await fut
            self.stats.count_out(channel, len(value))
            if channel != "control" and getattr(written, "offset", None) is not None:
                self.metrics.update_log_written.labels(self.name, written.topic, str(written.partition)).set(
                    written.offset + 1)

        async def dead_letter(value: bytes, headers: dict[str, bytes]) -> None:
            fut = await dlq.send(value=value[:1 << 20], headers=headers)
            await fut

        async def sensor_dead_letter(value: bytes, headers: dict[str, bytes]) -> None:
            fut = await sensor_dlq.send(value=value, headers=headers)
            await fut

        async def send_prediction(topic: str, messages: list[tuple[bytes, bytes]]) -> list[Any]:
            return await app.producer.send_keyed(topic, messages)  # the worker's DurableProducer

        self.publish = publish
        self._producer_send = send_prediction
        self.dead_letter = dead_letter
        self.sensor_dead_letter = sensor_dead_letter
        self.inbox = asyncio.Queue()
        self.wakeup = asyncio.Event()
        self._room = asyncio.Event()

        @app.agent(source, concurrency=1)
        async def updates(stream: faust.Stream) -> None:
            async for event in stream.events():
                arrival = time.time()
                msg = event.message
                headers = {k: (v if isinstance(v, bytes) else bytes(v)) for k, v in (event.headers or {}).items()}
                assert self.inbox is not None and self.wakeup is not None
                self.stats.count_in(channel_of.get(msg.topic, msg.topic), len(event.value or b""))
                if msg.topic == control:
                    # Heartbeats are read at once, on the event loop (never behind a step);
                    # the strategy gets the topic only if it subscribes to it.
                    self._on_control(event.value or b"", headers, float(msg.timestamp or 0.0))
                    if not strategy_reads_control:
                        if not self.stopping:
                            self.update_offsets[OffsetTracker.key(msg.topic, msg.partition)] = msg.offset + 1
                        continue
                await self.inbox.put((msg.topic, msg.partition, msg.offset, float(msg.timestamp or 0.0),
                                      event.value or b"", headers, arrival))
                self.wakeup.set()

        @app.task
        async def train_loop() -> None:
            await self.run()

        @app.task
        async def heartbeats() -> None:
            await self._heartbeats()

        @app.timer(interval=1.0)
        async def gauges() -> None:
            self.metrics.model_version.labels(self.name).set(self.trainer.version)
            await self._call(self._observe)

        _ = (updates, train_loop, heartbeats, gauges)

    def _byzantine_summary(self, stats: dict[str, Any]) -> dict[str, Any] | None:
        """This worker's fault injection (``workers.byzantine``) for the summary: the attack and
        the updates it corrupted; None for an honest process."""
        attack = self.cfg.workers.attack_of(self.name) if self.role == "worker" else None
        if attack is None:
            return None
        return {"attack": attack, "attack_seed": self.cfg.workers.attack_seed,
                "corrupted": int(stats.get("counters", {}).get("byzantine_corrupted", 0))}

    def _observe(self) -> None:
        """Export the strategy's observations (on the training thread: it reads strategy state)."""
        self.metrics.record_observations(self.name, dataclasses.asdict(self.strategy.observations()))

    # --- membership ------------------------------------------------------------------
    def _control_message(self, op: str) -> tuple[bytes, dict[str, bytes]]:
        msg = UpdateMessage(kind="control", sender=self.name, step=0, base_version=0,
                            meta={"op": op, "role": self.role})
        return encode_update(msg, job=self.cfg.job.name)

    async def _heartbeats(self) -> None:
        """Publish ``op: heartbeat`` every ``train.heartbeat_s`` until the process stops."""
        assert self.publish is not None
        value, headers = self._control_message(HEARTBEAT)
        while not self.stopping:
            try:
                await self.publish("control", value, headers, self.name.encode())
                self.heartbeats_sent += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the broker is briefly unavailable: peers tolerate a few misses
                log.warning("%s: heartbeat not sent: %s", self.name, exc)
            await asyncio.sleep(self.cfg.train.heartbeat_s)  # the heartbeat period

    def begin_stop(self) -> None:
        """The process was told to stop (SIGTERM/SIGINT): freeze now, before the shutdown
        hooks run, so nothing that peers do after this changes what it checkpoints."""
        self.stopping = True

    def _on_control(self, value: bytes, headers: dict[str, bytes], timestamp_s: float) -> None:
        """A record of the control topic: a heartbeat or leave goes to the liveness table."""
        if headers.get(HEADER_KIND, b"control") != b"control":
            return
        try:
            msg = decode_update(value, expected_shapes={}, max_bytes=self.cfg.kafka.max_message_bytes,
                                job=self.cfg.job.name)
        except MessageRejected:
            return  # not a heartbeat; a strategy that reads control dead-letters it itself
        op, role = msg.meta.get("op"), msg.meta.get("role")
        if op not in OPS:
            return
        if timestamp_s and is_stale(timestamp_s, time.time(), self.cfg.train.member_timeout_s):
            return  # a replay of the log (after a restart): says nothing about now
        now = time.monotonic()
        if msg.sender == self.name and op == HEARTBEAT:
            self.liveness.start(now)  # our own heartbeat came back: we read the topic live
        if role == "worker":
            self.liveness.observe(msg.sender, now, op)

    async def _membership(self) -> None:
        """Tell the driver when the live set of workers changed; publish what it answers."""
        current = self.liveness.report(time.monotonic())
        if current is None:
            return
        before, self.live = self.live, current
        joined = sorted(set(current) - set(before))
        gone = sorted(set(before) - set(current))
        left = set(self.liveness.left())

        def why(worker: str) -> str:
            if worker in left:
                return "left"
            return "not heard" if self.liveness.last_heard(worker) is None else "timed out"

        self.membership_log.append({"at_s": round(time.monotonic() - self._started_at, 3), "live": list(current),
                                    "joined": joined, "gone": {w: why(w) for w in gone}})
        del self.membership_log[:-MEMBERSHIP_LOG_SIZE]
        log.warning("%s: live workers %s%s%s", self.name, list(current),
                    f"; joined {joined}" if joined else "",
                    "; gone " + ", ".join(f"{w} ({why(w)})" for w in gone) if gone else "")
        self._live_gauge.labels(self.name).set(len(current))
        for worker in current:
            self._member_gauge.labels(self.name, worker).set(1)
        for worker in gone:
            self._member_gauge.labels(self.name, worker).set(0)
        await self._send(await self._call(self.driver.membership, list(current)))

    async def announce_leave(self) -> None:
        """Publish ``op: leave`` (the process stops on purpose): peers drop it at once
        instead of after ``train.member_timeout_s``."""
        if self.publish is None:
            return
        value, headers = self._control_message(LEAVE)
        try:
            await self.publish("control", value, headers, self.name.encode())
        except Exception as exc:  # peers notice by the timeout instead
            log.warning("%s: could not announce that it leaves: %s", self.name, exc)

    # --- the loop: inbox, timers, a step when allowed, evaluation -----------------------
    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def run(self) -> None:
        assert self.inbox is not None and self.wakeup is not None
        try:
            if self.restored_from is not None and not self.stopping:
                # Restarted from a checkpoint: before any message or step of this run, what
                # the strategy sends on that (gossip re-bases its neighbours on its model).
                await self._send(await self._call(self.driver.restored))
            while True:
                if self.stopping:
                    # Frozen: the shutdown hook checkpoints this state; what arrives now is
                    # re-read from the checkpoint's offsets if the worker comes back.
                    self.wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.wakeup.wait(), timeout=0.5)
                    continue
                await self._membership()
                await self._drain_inbox()
                await self._send(await self._call(self.driver.poll, time.monotonic()))
                trained = False
                allowed = await self._call(self.driver.next_step)  # one hop to the training thread
                if allowed == "queued":
                    # A later stage of a split model: a step on a received activation (or gradient).
                    await self._step_queued()
                    trained = True
                elif allowed == "stream":
                    if not self.pending.records:
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
        while not self.inbox.empty() and not self.stopping:
            topic, partition, offset, timestamp_s, value, headers, arrival = self.inbox.get_nowait()
            key = OffsetTracker.key(topic, partition)
            if offset < self.update_offsets.get(key, 0):
                continue  # already handled before the checkpoint we restored
            self.update_offsets[key] = offset + 1
            if topic in self._reads:
                self._handled_gauge(topic, partition).set(offset + 1)
            to = headers.get(HEADER_TO)
            # Produce (the record's CreateTime, seconds) to consume (its arrival here).
            transit_s = arrival - timestamp_s if timestamp_s else None
            handled = await self._call(self.driver.handle, value, to.decode(errors="replace") if to else None,
                                       transit_s)
            if handled.skipped:
                continue
            self.stats.updates_in += 1
            if handled.rejection is not None:
                exc = handled.rejection
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
            codec_name = headers.get(HEADER_CODEC, b"dense").decode(errors="replace")[:32]
            self.metrics.gradient_bytes_received.labels(self.name, codec_name).inc(len(value))
            if handled.staleness:
                # Seconds: the age of the message whose arrival applied the update(s).
                # (Faust's message timestamp is in seconds.)
                age_s = max(0.0, time.time() - timestamp_s) if timestamp_s else 0.0
                for versions in handled.staleness:
                    self.metrics.record_applied(self.name, staleness_versions=versions, staleness_s=age_s)
            self._log_vote(handled.vote_switched_to)
            await self._send(handled.outbound)
            if self.role == "server":
                # A server takes no steps: it checkpoints every checkpoint_every_steps
                # updates it handled, so a restart replays only the log since then.
                await self._count_towards_checkpoint()

    async def _count_towards_checkpoint(self) -> None:
        """One more step (or, on a server, handled update) since the last checkpoint;
        checkpoint every ``train.checkpoint_every_steps``."""
        self._steps_since_checkpoint += 1
        if self._steps_since_checkpoint >= self.cfg.train.checkpoint_every_steps:
            self._steps_since_checkpoint = 0
            await self._checkpoint()

    async def _step(self) -> None:
        parts = self.pending.take(await self._call(self.driver.batch_limit))
        if self._room is not None:
            self._room.set()
        size = sum(b.size for b in parts)
        records = concat([b.records for b in parts]) if len(parts) > 1 else parts[0].records
        started = time.monotonic()
        wait_s = started - self._ready_since if self._ready_since is not None else 0.0
        self._ready_since = None
        # Each record's device: a refused step's culprit search splits the batch by it.
        groups = np.repeat(np.array([b.device for b in parts]), [b.size for b in parts])
        scores = None
        if self.predictions is not None:
            stepped, scores = await self._call(self._scored_step, records.features, records.labels, groups)
        else:
            stepped = await self._call(self.driver.step, records.features, records.labels, groups)
        compute_s = time.monotonic() - started
        if stepped.dead or stepped.rejection is not None:
            await self._reject(parts, stepped)
            if stepped.rejection is not None:
                return
        if scores is not None:  # the trained records' predictions, handed over before the step's messages go
            await self._publish_predictions(parts, scores, stepped.trained)
        if stepped.trained is not None:  # the culprits are dead-lettered; train the others
            parts = pick(parts, stepped.trained)
            size = sum(b.size for b in parts)
        # Emulated compute heterogeneity and device cost (a slower device), not synchronisation:
        # the step lasts max(slowdown x measured, (step_base_s + step_per_record_s x n) x slowdown).
        emulated_s = emulated_wait_s(compute_s, size, self.cfg.workers.step_base_s,
                                     self.cfg.workers.step_per_record_s, self.slowdown)
        if emulated_s > 0.0:
            await asyncio.sleep(emulated_s)
        compressed = any(o.compressed and o.kind in ("gradient", "delta") for o in stepped.outbound)
        self.stats.steps += 1
        self.stats.trained_records += size
        self.stats.loss = float(stepped.loss)
        self.metrics.record_step(self.name, step_s=time.monotonic() - started, wait_s=wait_s, records=size,
                                 loss=self.stats.loss, compressed=compressed)
        if stepped.injected:
            self.metrics.injected_records.labels(self.name).inc(stepped.injected)
        for versions in stepped.staleness:  # updates the strategy applied in the step itself
            self.metrics.record_applied(self.name, staleness_versions=versions, staleness_s=None)
        self._record_prequential(parts, stepped)
        self._record_ages(parts)
        self._log_vote(stepped.vote_switched_to)
        # Once its update is published, the batch's records are settled.
        await self._send(stepped.outbound, settle=parts)
        await self._count_towards_checkpoint()

    async def _step_queued(self) -> None:
        """One step on an input the strategy received in a message: no stream records are
        involved (a rejected one is counted; its input is dropped by the strategy)."""
        started = time.monotonic()
        stepped: Stepped = await self._call(self.driver.step_queued)
        compute_s = time.monotonic() - started
        if stepped.rejection is not None:
            self.stats.rejected_steps += 1
            reason = stepped.rejection.reason
            self.stats.rejected_by_reason[reason] = self.stats.rejected_by_reason.get(reason, 0) + 1
            self.metrics.rejected_steps.labels(self.name, reason).inc()
            log.warning("%s: queued step rejected (%s): %s", self.name, reason, stepped.rejection.detail)
            return
        emulated_s = emulated_wait_s(compute_s, stepped.samples, self.cfg.workers.step_base_s,
                                     self.cfg.workers.step_per_record_s, self.slowdown)
        if emulated_s > 0.0:
            await asyncio.sleep(emulated_s)
        self.stats.steps += 1
        if math.isfinite(stepped.loss):
            self.stats.loss = float(stepped.loss)
        self.metrics.record_step(self.name, step_s=time.monotonic() - started, wait_s=0.0, records=0,
                                 loss=self.stats.loss)
        for versions in stepped.staleness:
            self.metrics.record_applied(self.name, staleness_versions=versions, staleness_s=None)
        self._record_prequential([], stepped)
        await self._send(stepped.outbound)
        await self._count_towards_checkpoint()

    def _record_prequential(self, parts: list[Batch], stepped: Stepped) -> None:
        """Test-then-train scores: per worker (cumulative and recent) and per device."""
        if stepped.correct_mask is None:
            return
        preq = self.driver.prequential
        self.metrics.record_prequential(self.name, accuracy=preq.accuracy, loss=preq.loss,
                                        recent_accuracy=preq.window_accuracy, recent_loss=preq.window_loss)
        start = 0
        for batch in parts:
            hits = int(stepped.correct_mask[start : start + batch.size].sum())
            self.metrics.prequential_records.labels(batch.device).inc(batch.size)
            self.metrics.prequential_correct.labels(batch.device).inc(hits)
            start += batch.size

    def _record_ages(self, parts: list[Batch]) -> None:
        """Each trained record's age: now (wall clock) minus its event time."""
        if not parts:
            return
        ages = time.time() - np.concatenate([b.records.event_time for b in parts])
        self.record_ages.add(ages)
        observe = self.metrics.trained_record_age.labels(self.name).observe
        for age in ages.tolist():
            observe(age)

    async def _reject(self, parts: list[Batch], stepped: Stepped) -> None:
        """A step the driver refused: nothing of it applied or published. Its records (all of
        them, or only the culprits its search found: ``stepped.dead``) go to ``sensors.dlq``
        (re-encoded, per device, with the reason), then are settled as dead-lettered."""
        if stepped.dead:
            letters = [(pick(parts, c.indices), c.rejection) for c in stepped.dead]
            rejection = stepped.dead[0].rejection
        else:
            assert stepped.rejection is not None
            letters = [(parts, stepped.rejection)]
            rejection = stepped.rejection
        records = sum(b.size for batches, _ in letters for b in batches)
        self.stats.dead_lettered_records += records
        if stepped.refused is not None:  # the guard refused the step (not only records outside the range)
            refused = stepped.refused.reason
            self.stats.rejected_steps += 1
            self.stats.rejected_by_reason[refused] = self.stats.rejected_by_reason.get(refused, 0) + 1
            self.metrics.rejected_steps.labels(self.name, refused).inc()
        if stepped.probes:
            self.metrics.culprit_probes.labels(self.name).inc(stepped.probes)
        unresolved = sum(len(c.indices) for c in stepped.dead if not c.resolved)
        if unresolved:
            self.metrics.culprit_unresolved_records.labels(self.name).inc(unresolved)
        devices = ", ".join(sorted({b.device for batches, _ in letters for b in batches}))
        reasons = ", ".join(sorted({why.reason for _, why in letters}))
        head = (f"step rejected ({stepped.refused.reason}): {stepped.refused.detail}; "
                if stepped.refused is not None else "")
        search = f" after {stepped.probes} sub-steps" if stepped.probes else ""
        narrowed = f", {unresolved} of them not narrowed down" if unresolved else ""
        log.warning("%s: %s%d records of %s dead-lettered (%s%s)%s, %d trained; first: %s", self.name, head,
                    records, devices, reasons, narrowed, search, stepped.trained_records, rejection.detail)
        for batches, why in letters:
            for batch in batches:
                await self._dead_letter_batch(batch, why)

    async def _dead_letter_batch(self, batch: Batch, rejection: StepRejection) -> None:
        """``batch``'s records to ``sensors.dlq`` with ``rejection``'s reason, then settled dead."""
        assert self.sensor_dead_letter is not None and self.settle is not None
        headers = {
            topics.DLQ_HEADER_REASON: rejection.reason.encode(),
            topics.DLQ_HEADER_DETAIL: rejection.detail.encode()[:1024],
            topics.DLQ_HEADER_TOPIC: self.cfg.input.layout().topic(batch.device).encode(),
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

    def _log_vote(self, switched_to: bool | None) -> None:
        if switched_to is not None:
            log.info("%s: the compression vote switches to %s from model version %d", self.name,
                     "compressed" if switched_to else "dense", self.trainer.version)

    async def _send(self, outbound: list[Outbound], *, settle: list[Batch] | None = None) -> None:
        """Publish ``outbound`` in order, then settle the records of ``settle`` (consumed).

        With the strategy's ``background_sends`` the sender task does it, so the next step
        does not wait for the uplink (the simulated clock's model: a message leaves while
        the next step computes); order is kept, and checkpoints and shutdown wait for it."""
        if self._sender_error is not None:
            raise RuntimeError(f"{self.name}: sending failed") from self._sender_error
        if not self.strategy.background_sends:
            await self._publish_all(outbound, settle or [], None)
            return
        if self._outbox is None:
            self._outbox = asyncio.Queue(maxsize=BACKGROUND_SEND_DEPTH)
            self._sender = asyncio.get_running_loop().create_task(self._send_in_background())
        if outbound or settle:
            # Stamped now: the record's timestamp (CreateTime) and the transfer time count
            # from when the step produced the message, its wait behind earlier ones included
            # (what a peer's produce-to-consume measure of the link must see).
            await self._outbox.put((outbound, settle or [], time.time()))

    async def _send_in_background(self) -> None:
        assert self._outbox is not None
        while True:
            outbound, settle, queued_at = await self._outbox.get()
            try:
                if self._sender_error is None:
                    await self._publish_all(outbound, settle, queued_at)
            except Exception as exc:  # the train loop raises it at its next send or checkpoint
                log.error("%s: sending failed: %s", self.name, exc)
                self._sender_error = exc
                if self.wakeup is not None:
                    self.wakeup.set()
            finally:
                self._outbox.task_done()

    async def _flush(self) -> None:
        """Wait until every queued message is published and its records settled."""
        if self._outbox is not None:
            await self._outbox.join()
        if self._sender_error is not None:
            raise RuntimeError(f"{self.name}: sending failed") from self._sender_error

    async def _publish_all(self, outbound: list[Outbound], settle: list[Batch], queued_at: float | None) -> None:
        """``queued_at``: wall time the messages were produced (None: now, for each)."""
        assert self.publish is not None
        for item in outbound:
            started = time.time() if queued_at is None else queued_at
            await self.publish(item.channel, item.value, item.headers, self.name.encode(), queued_at)
            await self._call(self.driver.transferred, item, max(0.0, time.time() - started))
            if item.setting is not None:
                self.metrics.compression_setting.labels(self.name).set(item.setting)
            self.stats.bytes_sent += len(item.value)
            if item.kind in ("gradient", "delta"):
                self.metrics.record_sent(self.name, item.codec, len(item.value), item.dense_bytes)
            else:
                self.metrics.gradient_bytes_sent.labels(self.name, item.codec).inc(len(item.value))
        if settle:
            assert self.settle is not None
            for batch in settle:
                await self.settle(batch, CONSUMED)

    async def _evaluate(self) -> None:
        if not self.strategy.evaluates_model:
            # No model of its own to evaluate (a stage of a split model): the timeline still
            # gets its steps, prequential scores (the top stage's) and the strategy's numbers.
            observed = await self._call(lambda: dataclasses.asdict(self.strategy.observations()))
            preq = self.driver.prequential
            with open(self.evaluations_path, "a") as out:
                out.write(json.dumps({"t": time.time(), "version": self.trainer.version, "steps": self.stats.steps,
                                      "prequential_records": preq.records,
                                      "prequential_accuracy": preq.accuracy,
                                      "prequential_recent_accuracy": preq.window_accuracy,
                                      "observations": {k: v for k, v in observed.items() if v is not None}},
                                     default=float) + "\n")
            return
        # The reported accuracy (held-out test split) reaches no strategy; a strategy that
        # decides from a score gets its model's score on the validation split.
        result = await self._call(self.driver.evaluate, self.data.heldout.features, self.data.heldout.labels)
        outbound: list[Outbound] = []
        validation = self.data.validation
        if validation is not None and self.strategy.uses_validation:
            scored, outbound = await self._call(self.driver.validate, validation.features, validation.labels)
            self.metrics.record_evaluation(self.name, float(scored.loss), float(scored.accuracy), split="validation")
        self.stats.accuracy = float(result.accuracy)
        preq = self.driver.prequential
        with open(self.evaluations_path, "a") as out:  # the accuracy timeline (TTA benchmarks, plots)
            out.write(json.dumps({"t": time.time(), "accuracy": self.stats.accuracy, "loss": float(result.loss),
                                  "version": self.trainer.version, "steps": self.stats.steps,
                                  "prequential_accuracy": preq.accuracy,
                                  "prequential_recent_accuracy": preq.window_accuracy}) + "\n")
        self.metrics.record_evaluation(self.name, float(result.loss), self.stats.accuracy)
        self.metrics.model_version.labels(self.name).set(self.trainer.version)
        await self._send(outbound)

    async def shutdown(self) -> dict[str, Any]:
        """Send what the strategy sends on leaving (ADSP: its uncommitted local steps), leave
        the job (``op: leave``), then final evaluation and checkpoint; the summary a run prints."""
        self.stopping = True
        sent = True
        try:
            await self._send(await self._call(self.driver.leave))
        except Exception as exc:
            sent = False
            log.error("%s: what it sends on leaving was not sent (%s): no final checkpoint, the last "
                      "one stays and a restart redoes the steps since", self.name, exc)
        await self.announce_leave()
        await self._evaluate()
        try:
            if sent:
                await self._checkpoint()
        except CheckpointRefused as exc:  # keep the last good ones; say so
            log.error("%s: final checkpoint refused, the last good one stays: %s", self.name, exc)
        if self._sender is not None:  # flushed by the checkpoint
            self._sender.cancel()
        predictions = None
        if self.predictions is not None:
            try:
                await self.predictions.flush()  # done by the checkpoint, unless there was none
            except RuntimeError as exc:
                log.error("%s: %s", self.name, exc)
            await self.predictions.close()
            predictions = {"published": self.predictions.total, "by_device": dict(self.predictions.published),
                           "top_k": self.cfg.serve.top_k, "topic": self.predictions.topic}
        stats = await self._call(self.driver.stats)
        digest = await self._call(self.trainer.parameter_digest)
        return {
            "worker": self.name, "role": self.role, "strategy": self.strategy.name,
            "version": self.trainer.version, "digest": digest, "steps": self.stats.steps,
            "trained_records": self.stats.trained_records, "accuracy": self.stats.accuracy,
            "evaluates_model": self.strategy.evaluates_model,
            "injected_records": self.driver.injected_records, "bytes_sent": self.stats.bytes_sent,
            "vote_log": [{"version": v, "compress": c} for v, c in self.driver.vote_log],
            "compressed_steps": self.driver.compressed_steps,
            "compression_setting": self.driver.policy.setting(),
            "loss": self.stats.loss, "updates_in": self.stats.updates_in,
            "updates_rejected": self.stats.updates_rejected, "restored_from": self.restored_from,
            "staleness": stats.get("staleness", {}), "counters": stats.get("counters", {}),
            "prequential": stats.get("prequential", {}),
            "record_age_s": self.record_ages.summary(),
            "sensor_offsets": {key: {"watermark": mark, "open": self.sensor_offsets.open_count(key)}
                               for key, mark in self.sensor_offsets.watermarks().items()},
            "queued_records": self.pending.records,
            "rejected_steps": self.stats.rejected_steps, "rejected_by_reason": dict(self.stats.rejected_by_reason),
            "dead_lettered_records": self.stats.dead_lettered_records,
            "restored_skipped": self.restored_skipped,
            "joining": self.joining, "live": list(self.live), "membership_log": self.membership_log,
            "heartbeats_sent": self.heartbeats_sent, "strategy_stats": _jsonable(stats),
            "byzantine": self._byzantine_summary(stats),
            "bytes_out": dict(self.stats.bytes_out), "bytes_in": dict(self.stats.bytes_in),
            "messages_out": dict(self.stats.messages_out), "messages_in": dict(self.stats.messages_in),
            "predictions": predictions,
        }


def _jsonable(stats: dict[str, Any]) -> dict[str, Any]:
    """The strategy's stats without what JSON cannot hold (it is JSON-able by contract;
    this only guards the summary file)."""
    try:
        return json.loads(json.dumps(stats, default=str))
    except (TypeError, ValueError):
        return {}
