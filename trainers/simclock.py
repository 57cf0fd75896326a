"""Simulated-clock runner: the real strategies, buffers, batchers and wire format on modelled time.

One run is a discrete-event simulation of N devices, each feeding its own worker
(one worker per device), with no Kafka, no asyncio and no wall clock:

- **Arrivals**: every ``message_interval_s`` each device emits the records of the
  elapsed interval (a Poisson count at rate ``r_i`` by default, from
  ``streams.simulator``), which go into the worker's ``StreamBuffer`` and
  ``AdaptiveBatcher`` exactly as the ingest path does, fed the simulated time.
- **Compute**: an idle worker whose strategy ``can_train()`` and that has a batch
  computes ``trainer.compute_gradient`` at once; the step "finishes" after
  ``(c0 + c1 * batch) * slowdown_i`` seconds, when ``on_local_step`` runs.
- **Transfer**: every outgoing message is encoded with ``trainers.wire`` (and
  the worker's ``GradientCodec``); ``len(bytes)`` leaves the worker's uplink at
  ``bandwidth`` after ``latency`` and is appended to ONE totally ordered log (a
  single-partition topic), decoded once and handed to every subscriber in log
  order, the sender included.
- **Evaluation**: worker 0's model on the held-out set every ``eval_every_s``;
  time to accuracy (TTA) is the first of ``hold_evals`` consecutive evaluations at
  or above the target.

Everything is seeded: the same inputs give the same report, bit for bit. See
docs/simclock.md for the model and its assumptions.
"""

from __future__ import annotations

import copy
import heapq
import importlib
import json
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from compression import registry as compressors
from compression.controllers.scadles import link_signal
from compression.memory import ErrorFeedback, Memory, NoMemory
from compression.pipeline import GradientCodec
from streams.batching import AdaptiveBatcher, Batch
from streams.buffering import StreamBuffer, concat, slice_records
from streams.datasets import Dataset
from streams.profiles import SCADLES_RATES
from streams.records import RecordBatch
from streams.simulator import DeviceSimulator, FleetData, build_simulators, fleet_data
from trainers import strategies
from trainers.evaluation import evaluate, time_to_target
from trainers.local import LocalTrainer, StepResult, limit_torch_threads
from trainers.messages import Outgoing, UpdateMessage
from trainers.models import build_model
from trainers.strategies.base import StrategyContext, SyncStrategy
from trainers.validation import TensorSpec
from trainers.wire import COMPRESSED_KINDS, decode_update, encode_update

__all__ = [
    "HETEROGENEOUS_SLOWDOWNS",
    "CostModel",
    "DeviceBacklog",
    "DeviceReport",
    "InjectHook",
    "Mode",
    "RunConfig",
    "RunReport",
    "StreamInjection",
    "StreamSet",
    "benchmark_comparison",
    "compare",
    "default_modes",
    "markdown_table",
    "oracle",
    "oracle_mode",
    "run",
    "scadles_rates",
]

InjectHook = Callable[[int, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
"""``inject(worker_index, x, y) -> (x, y)``: applied to every batch before the local step."""

HETEROGENEOUS_SLOWDOWNS: tuple[float, ...] = (1, 1, 1, 2, 2, 2, 4, 4, 8, 8)
"""Per-device compute slowdowns of the time-to-accuracy benchmark (BENCHMARKS.md)."""


def scadles_rates(scale: float = 1.0) -> tuple[float, ...]:
    """The ten ScaDLES stream rates (samples/s), multiplied by one common ``scale``."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    return tuple(float(rate) * scale for rate in SCADLES_RATES)


# -- what a run is made of ---------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """One training configuration to compare: strategy, batching, buffer policy, codec, injection.

    ``batcher="fixed"`` waits for exactly ``batch_size`` records per step (BSP's
    waiting streamer); ``"window"`` closes a batch every ``window_s`` with whatever
    arrived, capped at ``max_batch`` (ScaDLES). ``buffer_policy`` is ``persist``
    (keep every excess record) or ``truncate`` (window mode: drop what exceeds
    ``max_batch`` at each window; both modes: never let more than
    ``buffer_capacity`` records wait, dropping the oldest). ``codec`` names a
    registered compressor for gradient messages (``None`` / ``"dense"``: no codec).
    """

    name: str
    strategy: str = "bsp"
    strategy_params: Mapping[str, Any] = field(default_factory=dict)
    batcher: str = "fixed"
    batch_size: int = 64
    window_s: float = 1.0
    max_batch: int = 256
    buffer_policy: str = "persist"
    buffer_capacity: int = 4096
    codec: str | None = None
    codec_params: Mapping[str, Any] = field(default_factory=dict)
    error_feedback: bool = True
    inject: InjectHook | None = None

    def __post_init__(self) -> None:
        if self.batcher not in ("fixed", "window"):
            raise ValueError(
                f"mode {self.name!r}: batcher must be 'fixed' or 'window', got {self.batcher!r}"
            )
        if self.buffer_policy not in ("persist", "truncate"):
            raise ValueError(
                f"mode {self.name!r}: buffer_policy must be 'persist' or 'truncate', got {self.buffer_policy!r}"
            )
        if self.batch_size < 1 or self.max_batch < 1 or not self.window_s > 0:
            raise ValueError(
                f"mode {self.name!r}: batch_size, max_batch and window_s must be positive"
            )
        if self.batcher == "fixed" and self.buffer_capacity < self.batch_size:
            raise ValueError(
                f"mode {self.name!r}: buffer_capacity {self.buffer_capacity} < batch_size {self.batch_size} "
                "would never fill a fixed batch"
            )

    def build_codec(self) -> GradientCodec | None:
        """A fresh codec for one worker's gradient link (residuals are per link), or None."""
        if self.codec is None or self.codec == "dense":
            return None
        memory: Memory = ErrorFeedback() if self.error_feedback else NoMemory()
        return GradientCodec(compressors.create(self.codec, **dict(self.codec_params)), memory)


@dataclass(frozen=True, eq=False)
class StreamSet:
    """The streams every mode of a comparison sees: data shares, rates, arrival process, seed.

    Invariant: :meth:`simulators` returns fresh simulators that replay exactly the
    same arrivals (counts, times and records) on every call.
    """

    data: FleetData
    rates_hz: tuple[float, ...]
    profile: str = "poisson"
    message_interval_s: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.rates_hz) != len(self.data.shares):
            raise ValueError(f"{len(self.rates_hz)} rates for {len(self.data.shares)} devices")
        if any(not rate > 0 for rate in self.rates_hz):
            raise ValueError(f"rates must be > 0, got {self.rates_hz}")
        if not self.message_interval_s > 0:
            raise ValueError("message_interval_s must be > 0")

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(self.data.shares)

    def simulators(self) -> list[DeviceSimulator]:
        """One simulator per device, in device order, each with its own seeded random stream."""
        rates = dict(zip(self.devices, self.rates_hz, strict=True))
        return build_simulators(self.data, rates, self.profile, seed=self.seed)

    @classmethod
    def from_fleet(
        cls,
        source: str,
        rates_hz: Sequence[float],
        *,
        partition: str = "iid",
        seed: int = 0,
        profile: str = "poisson",
        message_interval_s: float = 0.1,
        **fleet_params: Any,
    ) -> StreamSet:
        """Devices ``dev00, dev01, ...`` over ``streams.simulator.fleet_data(source, ...)``."""
        devices = [f"dev{i:02d}" for i in range(len(rates_hz))]
        data = fleet_data(source, devices, scheme=partition, seed=seed, **fleet_params)
        return cls(data, tuple(float(r) for r in rates_hz), profile, message_interval_s, seed)

    @classmethod
    def from_arrays(
        cls,
        shards: Sequence[tuple[np.ndarray, np.ndarray]],
        heldout: tuple[np.ndarray, np.ndarray],
        rates_hz: Sequence[float],
        *,
        num_classes: int | None = None,
        profile: str = "poisson",
        message_interval_s: float = 0.1,
        seed: int = 0,
    ) -> StreamSet:
        """Explicit per-device ``(x, y)`` shares (device i streams shard i, replayed endlessly)."""
        if len(shards) != len(rates_hz):
            raise ValueError(f"{len(shards)} shards for {len(rates_hz)} rates")
        features = np.concatenate([np.asarray(x, dtype=np.float32) for x, _ in shards])
        labels = np.concatenate([np.asarray(y, dtype=np.int64) for _, y in shards])
        held_x = np.asarray(heldout[0], dtype=np.float32)
        held_y = np.asarray(heldout[1], dtype=np.int64)
        classes = num_classes or int(max(labels.max(), held_y.max())) + 1
        bounds = np.cumsum([0] + [len(y) for _, y in shards])
        shares = {
            f"dev{i:02d}": np.arange(bounds[i], bounds[i + 1], dtype=np.int64)
            for i in range(len(shards))
        }
        data = FleetData(
            Dataset(features, labels, classes, "arrays"),
            Dataset(held_x, held_y, classes, "heldout"),
            shares,
        )
        return cls(data, tuple(float(r) for r in rates_hz), profile, message_interval_s, seed)


@dataclass(frozen=True)
class CostModel:
    """Modelled time of the two things the simulation does not measure: compute and transfer.

    A local step on ``b`` records takes ``(compute_base_s + compute_per_record_s * b)
    * slowdown_i`` seconds (``slowdowns[i]``, 1 where not given); a message of ``n``
    bytes is appended to the log ``n / bandwidth_bytes_per_s + latency_s`` after
    the sender's uplink is free (one message at a time per worker).
    """

    compute_base_s: float = 0.01
    compute_per_record_s: float = 0.002
    slowdowns: tuple[float, ...] = ()
    latency_s: float = 0.002
    bandwidth_bytes_per_s: float = 12.5e6  # 100 Mbit/s

    def __post_init__(self) -> None:
        values = (self.compute_base_s, self.compute_per_record_s, self.latency_s, *self.slowdowns)
        if any(not v >= 0 or math.isnan(v) for v in values) or not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"cost model values must be >= 0 and bandwidth > 0: {self}")

    @classmethod
    def zero(cls) -> CostModel:
        """No compute time, no latency, infinite bandwidth: the oracle's costs."""
        return cls(0.0, 0.0, (), 0.0, math.inf)

    def compute_s(self, worker_index: int, batch_size: int) -> float:
        slowdown = self.slowdowns[worker_index] if worker_index < len(self.slowdowns) else 1.0
        return (self.compute_base_s + self.compute_per_record_s * batch_size) * slowdown

    def transfer_s(self, nbytes: int) -> float:
        return nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class RunConfig:
    """Model, optimiser, evaluation cadence, target and budget of a run (shared by all modes)."""

    model: str = "mlp"
    model_options: Mapping[str, Any] = field(default_factory=dict)
    lr: float = 0.1
    momentum: float = 0.9
    seed: int = 0
    """Seed of the initial weights (identical on every worker and in every mode)."""
    eval_every_s: float = 1.0
    target_accuracy: float | None = 0.9
    hold_evals: int = 3
    stop_at_target: bool = True
    """Stop once TTA is known (the target held for ``hold_evals`` evaluations)."""
    time_budget_s: float = 300.0
    depth_sample_s: float = 0.1
    job: str = "simclock"
    max_message_bytes: int = 16 * 1024 * 1024
    torch_threads: int = 1

    def __post_init__(self) -> None:
        if not (self.eval_every_s > 0 and self.time_budget_s > 0 and self.depth_sample_s > 0):
            raise ValueError("eval_every_s, time_budget_s and depth_sample_s must be > 0")
        if self.hold_evals < 1:
            raise ValueError(f"hold_evals must be >= 1, got {self.hold_evals}")


# -- reports ---------------------------------------------------------------------------------


@dataclass
class DeviceReport:
    """One device's stream and backlog. Invariant: ``arrived == trained + dropped + waiting``."""

    device: str
    worker: str
    rate_hz: float
    arrived: int
    trained: int
    dropped: int
    waiting: int
    injected: int
    max_depth: int
    p99_depth: int


@dataclass
class RunReport:
    """Outcome of one run; ``asdict(report)`` (or :meth:`to_json`) is JSON-able."""

    mode: str
    strategy: str
    batcher: str
    target_accuracy: float | None
    tta_s: float | None
    final_accuracy: float
    steps: int
    """Model version of worker 0 at the end (completed global steps for BSP-like strategies)."""
    local_steps: int
    sim_time_s: float
    stopped: str
    timeline: list[tuple[float, float, int]]
    """``(time_s, held-out accuracy, model version)`` of worker 0 at every evaluation."""
    bytes_sent: int
    gradient_messages: int
    compressed_messages: int
    compressed_fraction: float
    """From the strategies' ``compressed_steps`` / ``steps`` counters (0 without them)."""
    mean_staleness: float
    devices: list[DeviceReport]
    signal: dict[str, float] | None = None
    """Summary (count, mean, p10, p50, p90) of the ScaDLES signals observed, if any."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


# -- one device's backlog ------------------------------------------------------------------


class DeviceBacklog:
    """One device's records from arrival to training: ``StreamBuffer`` -> ``AdaptiveBatcher`` -> ready batches.

    Batches the batcher emits wait in ``ready`` until the worker takes them, so the
    depth that matters (records arrived and not yet trained) is ``buffer.depth +
    ready_records``. Under ``truncate`` that depth never exceeds the capacity: the
    buffer drops on push, and the oldest ready batches are dropped next.

    Invariant: ``arrived == trained + dropped + waiting`` at every moment.
    """

    def __init__(self, device: str, mode: Mode) -> None:
        self.mode = mode
        self.buffer = StreamBuffer(device, mode.buffer_capacity, mode.buffer_policy)
        self.batcher = AdaptiveBatcher(
            self.buffer,
            mode.batcher,
            window_s=mode.window_s,
            max_batch=mode.max_batch,
            batch_size=mode.batch_size,
            window_overflow=mode.buffer_policy,
        )
        self.ready: deque[RecordBatch] = deque()
        self.ready_records = 0
        self.ready_dropped = 0
        self.trained = 0
        self.max_depth = 0

    @property
    def arrived(self) -> int:
        return self.buffer.pushed_total

    @property
    def dropped(self) -> int:
        # The buffer counts both its own overflow and the batcher's window truncation.
        return self.buffer.dropped_total + self.ready_dropped

    @property
    def waiting(self) -> int:
        return self.buffer.depth + self.ready_records

    def arrive(self, batches: Sequence[RecordBatch], now: float) -> None:
        """Push one interval's records; in fixed mode this may complete batches."""
        for batch in batches:
            self.buffer.push(batch)
        self._queue(self.batcher.on_arrival(now))
        self.max_depth = max(self.max_depth, self.waiting)

    def close_windows(self, now: float) -> None:
        """Window mode: emit the batch of every window that ended by ``now``."""
        self._queue(self.batcher.poll(now))
        self.batcher.take_drops()  # already counted in buffer.dropped_total

    def has_batch(self) -> bool:
        return bool(self.ready)

    def take(self) -> RecordBatch:
        """The next step's records: one fixed batch, or every ready record up to ``max_batch``."""
        if not self.ready:
            raise RuntimeError("take() without a ready batch")
        if self.mode.batcher == "fixed":
            records = self.ready.popleft()
        else:
            parts: list[RecordBatch] = []
            room = self.mode.max_batch
            while self.ready and room > 0:
                head = self.ready[0]
                if head.count <= room:
                    parts.append(self.ready.popleft())
                    room -= head.count
                else:
                    parts.append(slice_records(head, 0, room))
                    self.ready[0] = slice_records(head, room, head.count)
                    room = 0
            records = concat(parts)
        self.ready_records -= records.count
        self.trained += records.count
        return records

    def _queue(self, emitted: Sequence[Batch]) -> None:
        for batch in emitted:
            self.ready.append(batch.records)
            self.ready_records += batch.size
        if self.mode.buffer_policy == "truncate":
            while self.ready and self.waiting > self.mode.buffer_capacity:
                oldest = self.ready.popleft()
                self.ready_records -= oldest.count
                self.ready_dropped += oldest.count


# -- data injection as a mode hook -------------------------------------------------------------


class StreamInjection:
    """Mode hook for ScaDLES data injection: one ``trainers.injection.DataInjector`` per worker.

    Stateful (random draws, classes seen); the runner deep-copies the hook at the
    start of every run, so each run replays the same injections.
    """

    def __init__(
        self, pool: Any, num_classes: int, *, alpha: float, beta: float, seed: int = 0
    ) -> None:
        """``pool``: a ``trainers.injection.Pool``; worker i's injector is seeded ``seed * 1000 + i``."""
        # Imported here: the runner itself does not need injection.
        from trainers.injection import DataInjector

        self._injector_class = DataInjector
        self.pool = pool
        self.num_classes = num_classes
        self.alpha = alpha
        self.beta = beta
        self.seed = seed
        self._injectors: dict[int, Any] = {}

    @classmethod
    def from_streams(
        cls,
        streams: StreamSet,
        *,
        alpha: float = 0.25,
        beta: float = 0.25,
        per_class: int = 10,
        seed: int = 0,
    ) -> StreamInjection:
        """A pool of ``per_class`` samples per class from the streamed (never held-out) data."""
        from trainers.injection import shared_pool

        train = streams.data.train
        pool = shared_pool(train.features, train.labels, per_class, seed=seed)
        return cls(pool, train.num_classes, alpha=alpha, beta=beta, seed=seed)

    def __call__(
        self, worker_index: int, x: np.ndarray, y: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        injector = self._injectors.get(worker_index)
        if injector is None:
            injector = self._injectors[worker_index] = self._injector_class(
                self.pool,
                self.num_classes,
                alpha=self.alpha,
                beta=self.beta,
                seed=self.seed * 1000 + worker_index,
            )
        x_out, y_out, _ = injector.augment(x, y)
        return x_out, y_out


# -- the simulation ----------------------------------------------------------------------------

# Order of events at the same simulated time: data first, then what data enables,
# then messages, then finished steps; observers (depth samples, evaluation) last.
_ARRIVALS, _WINDOW, _APPEND, _STEP_DONE, _SAMPLE, _EVAL = range(6)


class _EventQueue:
    """Min-heap of ``(time, kind, seq, payload)``: time order, ties by kind, then by insertion."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0

    def push(self, time: float, kind: int, payload: Any = None) -> None:
        heapq.heappush(self._heap, (time, kind, self._seq, payload))
        self._seq += 1

    def pop(self) -> tuple[float, int, Any]:
        time, kind, _, payload = heapq.heappop(self._heap)
        return time, kind, payload

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else math.inf


@dataclass(frozen=True)
class _LogEntry:
    """One record of the update log: the encoded value, its channel and optional recipient."""

    channel: str
    to: str | None
    value: bytes


class _Worker:
    """One worker: its device backlog, trainer, strategy and gradient link.

    Invariant: while ``busy`` (a step is computing) the trainer and strategy are not
    touched; messages delivered meanwhile wait in ``inbox`` and are handled, in log
    order, right after the step's ``on_local_step`` (as the pipeline's single
    training thread does).
    """

    def __init__(
        self,
        index: int,
        name: str,
        backlog: DeviceBacklog,
        trainer: LocalTrainer,
        strategy: SyncStrategy,
        codec: GradientCodec | None,
    ) -> None:
        self.index = index
        self.name = name
        self.backlog = backlog
        self.trainer = trainer
        self.strategy = strategy
        self.codec = codec
        self.busy = False
        self.pending: StepResult | None = None
        self.inbox: deque[UpdateMessage] = deque()
        self.uplink_free_at = 0.0
        self.local_steps = 0
        self.injected = 0
        self.depth_samples: list[int] = []


class _Simulation:
    """One run of one mode on one stream set; build, then call :meth:`run` once."""

    def __init__(self, mode: Mode, streams: StreamSet, costs: CostModel, config: RunConfig) -> None:
        self.mode = mode
        self.streams = streams
        self.costs = costs
        self.config = config
        self.inject = copy.deepcopy(mode.inject)
        self.events = _EventQueue()
        self.simulators = streams.simulators()
        names = [f"w{i}" for i in range(len(streams.devices))]
        data = streams.data
        self.workers: list[_Worker] = []
        for index, (name, device) in enumerate(zip(names, streams.devices, strict=True)):
            model = build_model(
                config.model,
                data.feature_shape,
                data.num_classes,
                config.seed,
                **dict(config.model_options),
            )
            trainer = LocalTrainer(model, lr=config.lr, momentum=config.momentum)
            ctx = StrategyContext(worker_id=name, trainer=trainer, members=tuple(names))
            strategy = strategies.create(mode.strategy, ctx, **dict(mode.strategy_params))
            self.workers.append(
                _Worker(
                    index, name, DeviceBacklog(device, mode), trainer, strategy, mode.build_codec()
                )
            )
        self.spec = TensorSpec.from_trainer(self.workers[0].trainer)
        self.signal_ratio = float(
            mode.strategy_params.get("ratio", mode.codec_params.get("ratio", 0.1))
        )
        self.signals: list[float] = []
        self.timeline: list[tuple[float, float, int]] = []
        self.tta_s: float | None = None
        self.bytes_sent = 0
        self.gradient_messages = 0
        self.compressed_messages = 0
        self.now = 0.0

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> RunReport:
        interval = self.streams.message_interval_s
        self.events.push(interval, _ARRIVALS, 1)
        if self.mode.batcher == "window":
            for worker in self.workers:
                self.events.push(worker.backlog.batcher.next_window_at, _WINDOW, worker)
        self.events.push(self.config.depth_sample_s, _SAMPLE, 1)
        self.events.push(self.config.eval_every_s, _EVAL, 1)
        stopped = "budget"
        while self.events.next_time() <= self.config.time_budget_s:
            self.now, kind, payload = self.events.pop()
            if kind == _ARRIVALS:
                self._on_arrivals(payload)
            elif kind == _WINDOW:
                self._on_window(payload)
            elif kind == _APPEND:
                self._on_append(payload)
            elif kind == _STEP_DONE:
                self._on_step_done(payload)
            elif kind == _SAMPLE:
                self._on_sample(payload)
            elif kind == _EVAL and self._on_eval(payload):
                stopped = "target"
                break
        if stopped == "budget":
            self.now = self.config.time_budget_s
        return self._report(stopped)

    def _on_arrivals(self, tick: int) -> None:
        interval = self.streams.message_interval_s
        start, end = (tick - 1) * interval, tick * interval
        for worker, simulator in zip(self.workers, self.simulators, strict=True):
            worker.backlog.arrive(simulator.step(start, end, 0.0), self.now)
        self.events.push((tick + 1) * interval, _ARRIVALS, tick + 1)
        for worker in self.workers:
            self._service(worker)

    def _on_window(self, worker: _Worker) -> None:
        worker.backlog.close_windows(self.now)
        self.events.push(worker.backlog.batcher.next_window_at, _WINDOW, worker)
        self._service(worker)

    def _service(self, worker: _Worker) -> None:
        """Give an idle worker its timers, then start a step if it may and has data."""
        if worker.busy:
            return
        self._publish(worker, worker.strategy.poll(self.now))
        if worker.busy or not worker.backlog.has_batch() or not worker.strategy.can_train():
            return
        records = worker.backlog.take()
        x = np.ascontiguousarray(records.features, dtype=np.float32)
        y = np.asarray(records.labels, dtype=np.int64)
        if self.inject is not None:
            x, y = self.inject(worker.index, x, y)
            worker.injected += len(y) - records.count
        worker.pending = worker.trainer.compute_gradient(x, y)
        worker.busy = True
        self.events.push(self.now + self.costs.compute_s(worker.index, len(y)), _STEP_DONE, worker)

    def _on_step_done(self, worker: _Worker) -> None:
        result = worker.pending
        assert result is not None
        worker.pending = None
        worker.busy = False
        worker.local_steps += 1
        if hasattr(worker.strategy, "observe_signal"):
            # Before on_local_step (so this gradient's vote can include it) and before
            # encoding: the codec's residuals are still those this gradient will meet.
            signal = self._signal(worker, result.gradients)
            self.signals.append(signal)
            worker.strategy.observe_signal(signal)
        self._publish(worker, worker.strategy.on_local_step(result))
        while worker.inbox:
            self._publish(worker, worker.strategy.on_message(worker.inbox.popleft()))
        self._service(worker)

    def _signal(self, worker: _Worker, grads: Mapping[str, torch.Tensor]) -> float:
        # Without a codec there is no residual: the signal of g itself (NoMemory is pure too).
        memory = worker.codec.memory if worker.codec is not None else NoMemory()
        return link_signal(memory, grads, self.signal_ratio)

    def _publish(self, worker: _Worker, outgoing: list[Outgoing]) -> None:
        for item in outgoing:
            msg = item.message
            codec = worker.codec if msg.kind in COMPRESSED_KINDS else None
            compress = bool(msg.meta.get("compress", True))
            value, _ = encode_update(
                msg, job=self.config.job, codec=codec, compress=compress, to=item.to
            )
            self.bytes_sent += len(value)
            if msg.kind == "gradient":
                self.gradient_messages += 1
                self.compressed_messages += int(codec is not None and compress)
            sent_at = max(self.now, worker.uplink_free_at) + self.costs.transfer_s(len(value))
            worker.uplink_free_at = sent_at
            self.events.push(
                sent_at + self.costs.latency_s, _APPEND, _LogEntry(item.channel, item.to, value)
            )

    def _on_append(self, entry: _LogEntry) -> None:
        msg = decode_update(
            entry.value,
            expected_shapes=self.spec,
            max_bytes=self.config.max_message_bytes,
            job=self.config.job,
        )
        recipients = [
            w
            for w in self.workers
            if entry.channel in w.strategy.subscribes and (entry.to is None or entry.to == w.name)
        ]
        for worker in recipients:
            if worker.busy:
                worker.inbox.append(msg)
            else:
                self._publish(worker, worker.strategy.on_message(msg))
        for worker in recipients:
            self._service(worker)

    def _on_sample(self, tick: int) -> None:
        for worker in self.workers:
            worker.depth_samples.append(worker.backlog.waiting)
        self.events.push((tick + 1) * self.config.depth_sample_s, _SAMPLE, tick + 1)

    def _on_eval(self, tick: int) -> bool:
        """Evaluate worker 0; True when the run should stop (TTA known and stop_at_target)."""
        trainer = self.workers[0].trainer
        accuracy = evaluate(
            trainer.model, self.streams.data.heldout.features, self.streams.data.heldout.labels
        )
        self.timeline.append((self.now, accuracy.accuracy, trainer.version))
        target = self.config.target_accuracy
        if target is not None and self.tta_s is None:
            self.tta_s = time_to_target([(t, a) for t, a, _ in self.timeline], target, self.config.hold_evals)
        self.events.push((tick + 1) * self.config.eval_every_s, _EVAL, tick + 1)
        return self.tta_s is not None and self.config.stop_at_target

    # -- the report -----------------------------------------------------------------------

    def _report(self, stopped: str) -> RunReport:
        counters = [w.strategy.counters for w in self.workers]
        global_steps = sum(c.get("steps", 0) for c in counters)
        compressed = sum(c.get("compressed_steps", 0) for c in counters)
        staleness = [w.strategy.staleness.summary() for w in self.workers]
        updates = sum(s["count"] for s in staleness)
        devices = [
            DeviceReport(
                device=w.backlog.buffer.device,
                worker=w.name,
                rate_hz=self.streams.rates_hz[w.index],
                arrived=w.backlog.arrived,
                trained=w.backlog.trained,
                dropped=w.backlog.dropped,
                waiting=w.backlog.waiting,
                injected=w.injected,
                max_depth=w.backlog.max_depth,
                p99_depth=_nearest_rank(w.depth_samples, 0.99),
            )
            for w in self.workers
        ]
        return RunReport(
            mode=self.mode.name,
            strategy=self.mode.strategy,
            batcher=self.mode.batcher,
            target_accuracy=self.config.target_accuracy,
            tta_s=self.tta_s,
            final_accuracy=self.timeline[-1][1] if self.timeline else 0.0,
            steps=self.workers[0].trainer.version,
            local_steps=sum(w.local_steps for w in self.workers),
            sim_time_s=self.now,
            stopped=stopped,
            timeline=list(self.timeline),
            bytes_sent=self.bytes_sent,
            gradient_messages=self.gradient_messages,
            compressed_messages=self.compressed_messages,
            compressed_fraction=compressed / global_steps if global_steps else 0.0,
            mean_staleness=sum(s["mean"] * s["count"] for s in staleness) / updates
            if updates
            else 0.0,
            devices=devices,
            signal=_summary(self.signals),
        )


def _nearest_rank(values: Sequence[int], q: float) -> int:
    if not values:
        return 0
    ordered = sorted(values)
    return int(ordered[max(1, math.ceil(q * len(ordered))) - 1])


def _summary(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    quantiles = np.quantile(np.asarray(values, dtype=np.float64), [0.1, 0.5, 0.9])
    return {
        "count": float(len(values)),
        "mean": float(np.mean(values)),
        "p10": float(quantiles[0]),
        "p50": float(quantiles[1]),
        "p90": float(quantiles[2]),
    }


# -- public API ------------------------------------------------------------------------------


def _ensure_registered(name: str) -> None:
    """Import ``trainers.strategies.<name>`` if that strategy is not registered yet."""
    if name in strategies.names():
        return
    try:
        importlib.import_module(f"trainers.strategies.{name}")
    except ModuleNotFoundError:
        pass  # strategies.create reports the unknown name with the registered ones


def run(
    mode: Mode, streams: StreamSet, costs: CostModel | None = None, config: RunConfig | None = None
) -> RunReport:
    """Simulate ``mode`` on ``streams`` under ``costs``; deterministic for equal inputs."""
    costs = CostModel() if costs is None else costs
    config = RunConfig() if config is None else config
    _ensure_registered(mode.strategy)
    if "server" in strategies.roles(mode.strategy):
        raise ValueError(
            f"strategy {mode.strategy!r} needs a server; the simulated clock runs workers only"
        )
    limit_torch_threads(config.torch_threads)
    return _Simulation(mode, streams, costs, config).run()


def oracle_mode(
    streams: StreamSet,
    *,
    window_s: float = 1.0,
    max_batch: int = 256,
    reference_per_worker: int = 64,
) -> Mode:
    """The oracle's mode: BSP on window batches (no waiting for a fixed batch), LR-scaled."""
    return Mode(
        "oracle",
        "bsp",
        {"reference_batch": reference_per_worker * len(streams.devices)},
        batcher="window",
        window_s=window_s,
        max_batch=max_batch,
    )


def oracle(
    streams: StreamSet, config: RunConfig | None = None, mode: Mode | None = None
) -> RunReport:
    """Zero compute and zero transfer time on the same streams: the lower bound on TTA.

    ``mode`` defaults to :func:`oracle_mode` (zero wait: train on whatever arrived).
    """
    chosen = oracle_mode(streams) if mode is None else mode
    return run(replace(chosen, name="oracle"), streams, CostModel.zero(), config)


def compare(
    modes: Sequence[Mode],
    streams: StreamSet,
    costs: CostModel | None = None,
    config: RunConfig | None = None,
    *,
    with_oracle: bool = True,
    oracle_base: Mode | None = None,
) -> list[RunReport]:
    """Run every mode on the same streams, seeds, partitioning and initial weights.

    With ``with_oracle`` the oracle's report comes first; ``oracle_base`` is the mode it
    runs at zero cost (default :func:`oracle_mode`; give it the modes' LR rule).
    """
    reports = [oracle(streams, config, oracle_base)] if with_oracle else []
    reports += [run(mode, streams, costs, config) for mode in modes]
    return reports


def default_modes(
    streams: StreamSet,
    *,
    batch_size: int = 64,
    window_s: float = 1.0,
    max_batch: int = 256,
    ratio: float = 0.1,
    delta: float = 0.2,
    epoch_steps: int = 20,
    alpha: float = 0.25,
    beta: float = 0.25,
) -> list[Mode]:
    """bsp, scadles, scadles+compress, scadles+compress+inject, with ``B_ref = batch_size * N``."""
    reference = batch_size * len(streams.devices)
    bsp = Mode("bsp", "bsp", {"reference_batch": reference}, batcher="fixed", batch_size=batch_size)
    scadles = Mode(
        "scadles",
        "scadles",
        {"reference_batch": reference, "adaptive_compression": False, "ratio": ratio},
        batcher="window",
        window_s=window_s,
        max_batch=max_batch,
    )
    compressed = replace(
        scadles,
        name="scadles+compress",
        strategy_params={
            "reference_batch": reference,
            "adaptive_compression": True,
            "delta": delta,
            "epoch_steps": epoch_steps,
            "ratio": ratio,
        },
        codec="topk",
        codec_params={"ratio": ratio},
        error_feedback=True,
    )
    injected = replace(
        compressed,
        name="scadles+compress+inject",
        inject=StreamInjection.from_streams(streams, alpha=alpha, beta=beta, seed=streams.seed),
    )
    return [bsp, scadles, compressed, injected]


def benchmark_comparison(
    *,
    partition: str = "iid",
    scale: float = 1.0,
    window_s: float = 1.0,
    batch: int = 64,
    target: float = 0.9,
    budget_s: float = 300.0,
    slowdown: Sequence[float] = HETEROGENEOUS_SLOWDOWNS,
    lr: float = 0.1,
    momentum: float = 0.9,
    seed: int = 0,
    delta: float = 0.2,
    modes: Sequence[str] | None = None,
    eval_every_s: float = 1.0,
    model: str = "mlp",
    costs: CostModel | None = None,
    message_interval_s: float = 0.1,
    max_batch: int = 256,
    epoch_steps: int = 20,
    rates: Sequence[float] | None = None,
) -> list[dict[str, Any]]:
    """BENCHMARKS.md's time-to-accuracy comparison on the simulated clock, as JSON-able dicts.

    Digits (held-out 20 %), ``partition`` ("iid", "dirichlet" with alpha 0.3, or
    "classes"), the ten ScaDLES rates (or ``rates``, one per device) times ``scale``,
    :func:`default_modes` (those named in ``modes``; names the runner cannot simulate,
    such as ``ddp``, are skipped) and the oracle first. ``costs`` defaults to ``CostModel(slowdowns=slowdown)``.
    Each dict is ``asdict(RunReport)`` plus ``max_backlog`` / ``p99_backlog`` by device.
    """
    if rates is not None and not (rates and scale > 0 and all(r > 0 for r in rates)):
        raise ValueError(f"rates must be positive samples/s and scale > 0; got {rates} x {scale}")
    streams = StreamSet.from_fleet(
        "digits",
        scadles_rates(scale) if rates is None else tuple(float(r) * scale for r in rates),
        partition=partition,
        seed=seed,
        message_interval_s=message_interval_s,
    )
    wanted = default_modes(streams, batch_size=batch, window_s=window_s, delta=delta, max_batch=max_batch,
                           epoch_steps=epoch_steps)
    if modes is not None:
        wanted = [mode for mode in wanted if mode.name in set(modes)]
    config = RunConfig(
        model=model,
        lr=lr,
        momentum=momentum,
        seed=seed,
        eval_every_s=eval_every_s,
        target_accuracy=target,
        time_budget_s=budget_s,
    )
    costs = CostModel(slowdowns=tuple(slowdown)) if costs is None else costs
    base = oracle_mode(streams, window_s=window_s, max_batch=max_batch, reference_per_worker=batch)
    out = []
    for report in compare(wanted, streams, costs, config, oracle_base=base):
        row = asdict(report)
        row["max_backlog"] = {d.device: d.max_depth for d in report.devices}
        row["p99_backlog"] = {d.device: d.p99_depth for d in report.devices}
        out.append(row)
    return out


def markdown_table(reports: Sequence[RunReport]) -> str:
    """One row per report; TTA also as a multiple of the ``oracle`` report's, when present."""
    oracle_tta = next((r.tta_s for r in reports if r.mode == "oracle"), None)
    lines = [
        "| mode | TTA (s) | x oracle | final acc | steps | MB sent | max depth | p99 depth | dropped "
        "| compressed steps | mean staleness |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in reports:
        tta = f"{r.tta_s:.1f}" if r.tta_s is not None else f"> {r.sim_time_s:.0f}"
        ratio = f"{r.tta_s / oracle_tta:.2f}" if r.tta_s is not None and oracle_tta else "-"
        lines.append(
            f"| {r.mode} | {tta} | {ratio} | {r.final_accuracy:.3f} | {r.steps} "
            f"| {r.bytes_sent / 1e6:.2f} | {max(d.max_depth for d in r.devices)} "
            f"| {max(d.p99_depth for d in r.devices)} | {sum(d.dropped for d in r.devices)} "
            f"| {100 * r.compressed_fraction:.0f} % | {r.mean_staleness:.2f} |"
        )
    return "\n".join(lines)
