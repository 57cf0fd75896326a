"""Simulated-clock runner: the real training driver, buffers and batchers on modelled time.

One run is a discrete-event simulation of N devices, each feeding its own worker
(one worker per device), with no Kafka, no asyncio and no wall clock. Everything
that happens to a worker's model goes through its ``trainers.driver.TrainingDriver``
(the same object the live runtime drives); this module only moves bytes and time:

- **Arrivals**: every ``message_interval_s`` each device emits the records of the
  elapsed interval (a Poisson count at rate ``r_i`` by default, from
  ``streams.simulator``), which go into the worker's ``StreamBuffer`` and
  ``AdaptiveBatcher`` exactly as the ingest path does, fed the simulated time; the
  batches wait in a ``streams.batching.BatchQueue`` (the one take rule).
- **Compute**: an idle worker whose ``driver.can_train()`` and that has a batch takes
  ``driver.batch_limit()`` records and runs ``driver.step`` at once (score, local
  step, step guard, compression signal, ``on_local_step``, encoding); the step
  "finishes" after ``(c0 + c1 * batch) * slowdown_i`` seconds, and only then do its
  messages leave. A step on an input the strategy received (``driver.queued_steps()``: a
  later stage of a split model) is taken first, as on the live runtime, and costs the
  same on its samples.
- **Membership**: ``RunConfig.leaves`` stops workers on purpose at given times,
  ``joins`` starts workers later (built as joiners: the model reaches them through the
  log), ``crashes`` kills them (the others notice ``member_timeout_s`` later, the live
  heartbeat table's timeout) and ``restarts`` brings a crashed worker back from its last
  in-memory checkpoint (trainer and strategy state every ``checkpoint_every_steps``
  steps; the update log and the records since then are read again). Every running
  process is told each new live set (``driver.membership``), as live; nothing here names
  a strategy, the driver's hooks (``leave``, ``restored``, ``membership``) do it all.
- **Assembly**: every process is built by ``trainers.assembly`` from one
  ``trainers.plan.TrainingPlan`` (``simulation_plan``: ``RunConfig.plan`` with the mode's
  strategy, batching, codec and lr), as the live runtime builds its own.
- **Transfer**: the driver encodes every outgoing message (one codec per link and
  kind); ``len(bytes)`` leaves the worker's uplink at ``bandwidth`` after
  ``latency`` and is appended to ONE totally ordered log (a single-partition
  topic) and handed, as bytes, in log order to every subscriber (the sender
  included; a record of a point-to-point channel, ``inbox``, to its recipient alone),
  whose ``driver.handle`` decodes and validates it. With per-host links
  (``CostModel.link_bandwidths_bytes_per_s``) each subscriber also downloads every
  record of its channels one at a time at its host's rate. Bytes and messages produced
  and consumed are counted per process and channel (``RunReport.processes``).
- **Time per worker**: busy (computing), blocked (a batch ready, ``can_train()`` false)
  or starved (no batch), and the start of every step (iteration times).
- **Consensus**: at every evaluation, the exact consensus distance of the workers'
  models (``trainers.consensus.consensus_distance``).
- **Server**: a strategy whose ``trainers.strategies.roles`` include ``server`` gets
  one more process, ``server`` (no device, no backlog, never trains), with its own
  driver: it reads the log like the workers, is polled, and its messages take the
  same transfer path.
- **Evaluation**: the job's model (the server's when there is one, else worker 0's)
  is evaluated with ``driver.evaluate`` on the held-out set every
  ``eval_every_s``; time to accuracy (TTA) is the first of ``hold_evals``
  consecutive evaluations at or above the target.

Everything is seeded: the same inputs give the same report, bit for bit. See
docs/simclock.md for the model and its assumptions.
"""

from __future__ import annotations

import contextlib
import copy
import heapq
import importlib
import json
import math
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from edgestream.streams.batching import AdaptiveBatcher, Batch, BatchQueue
from edgestream.streams.buffering import StreamBuffer, concat
from edgestream.streams.datasets import Dataset
from edgestream.streams.profiles import SCADLES_RATES
from edgestream.streams.records import RecordBatch
from edgestream.streams.simulator import DeviceSimulator, FleetData, build_simulators, fleet_data
from edgestream.streams.topics import SERVER_NAME
from edgestream.trainers import assembly, strategies
from edgestream.trainers.consensus import consensus_distance
from edgestream.trainers.driver import DecodeMemo, Outbound, Stepped, TrainingDriver
from edgestream.trainers.evaluation import EvalResult, evaluate, time_to_target
from edgestream.trainers.local import limit_torch_threads
from edgestream.trainers.plan import TrainingPlan
from edgestream.trainers.stages import compose

__all__ = [
    "HETEROGENEOUS_SLOWDOWNS",
    "POINT_TO_POINT_CHANNELS",
    "interval_stats",
    "ProcessReport",
    "CostModel",
    "CostModelError",
    "FILLS",
    "DEFAULT_CHECKPOINT_EVERY_STEPS",
    "DEFAULT_MEMBER_TIMEOUT_S",
    "DeviceBacklog",
    "DeviceReport",
    "InjectHook",
    "Mode",
    "RestoreReport",
    "RunConfig",
    "RunReport",
    "SERVER_NAME",
    "StreamInjection",
    "StreamSet",
    "benchmark_comparison",
    "compare",
    "default_modes",
    "markdown_table",
    "oracle",
    "oracle_mode",
    "processes",
    "run",
    "simulation_plan",
    "scadles_rates",
]

InjectHook = Callable[[int, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
"""``inject(worker_index, x, y) -> (x, y)``: applied to every batch before the local step."""

HETEROGENEOUS_SLOWDOWNS: tuple[float, ...] = (1, 1, 1, 2, 2, 2, 4, 4, 8, 8)
"""Per-device compute slowdowns of the time-to-accuracy benchmark (BENCHMARKS.md)."""

POINT_TO_POINT_CHANNELS: frozenset[str] = frozenset({"inbox"})
"""Channels whose records only their recipient reads (``trainers.messages``: ``inbox`` maps
to one topic per process, ``inbox.<job>.<to>``): nobody else fetches or pays for them."""


def interval_stats(starts: Sequence[float]) -> tuple[float, float]:
    """(mean, coefficient of variation) of the intervals between consecutive ``starts``:
    (0, 0) with fewer than two; CV 0 with fewer than three (population std / mean)."""
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    mean = math.fsum(gaps) / len(gaps) if gaps else 0.0
    if len(gaps) < 2 or mean <= 0:
        return mean, 0.0
    return mean, math.sqrt(math.fsum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean


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
    registered compressor for gradient messages (``None`` / ``"dense"``: no codec);
    it, ``codec_params`` and ``error_feedback`` go to each worker's ``DriverConfig``,
    as does ``max_step_batch`` (the most records a window-mode step takes unless the
    strategy's ``batch_size_wanted()`` says otherwise; None: ``max_batch``). ``lr``, when
    set, replaces ``RunConfig.lr`` for every process of this mode (e.g. a parameter
    server that applies each worker's small-batch gradient on its own).
    ``window_overflow`` (window mode: what happens to records beyond ``max_batch`` at a
    window, ``persist`` or ``truncate``; None: as ``buffer_policy``) and
    ``max_batch_widen`` are the live batcher's (``batcher.window_overflow``,
    ``batcher.max_batch_widen``).
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
    lr: float | None = None
    max_step_batch: int | None = None
    window_overflow: str | None = None
    max_batch_widen: int = 0

    def __post_init__(self) -> None:
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"mode {self.name!r}: lr must be > 0, got {self.lr}")
        if self.batcher not in ("fixed", "window"):
            raise ValueError(
                f"mode {self.name!r}: batcher must be 'fixed' or 'window', got {self.batcher!r}"
            )
        if self.buffer_policy not in ("persist", "truncate"):
            raise ValueError(
                f"mode {self.name!r}: buffer_policy must be 'persist' or 'truncate', got {self.buffer_policy!r}"
            )
        if self.window_overflow not in (None, "persist", "truncate"):
            raise ValueError(
                f"mode {self.name!r}: window_overflow must be 'persist' or 'truncate', got {self.window_overflow!r}"
            )
        if self.max_step_batch is not None and self.max_step_batch < 1:
            raise ValueError(f"mode {self.name!r}: max_step_batch must be positive, got {self.max_step_batch}")
        if self.batch_size < 1 or self.max_batch < 1 or not self.window_s > 0:
            raise ValueError(
                f"mode {self.name!r}: batch_size, max_batch and window_s must be positive"
            )
        if self.batcher == "fixed" and self.buffer_capacity < self.batch_size:
            raise ValueError(
                f"mode {self.name!r}: buffer_capacity {self.buffer_capacity} < batch_size {self.batch_size} "
                "would never fill a fixed batch"
            )


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

    def scored_on_validation(self) -> StreamSet:
        """The same streams, every evaluation on the validation split instead of the held-out
        test split (``FleetData.validation_as_test``): a tuning run's view, which cannot
        read the test split."""
        return replace(self, data=self.data.validation_as_test())

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
        validation: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> StreamSet:
        """Explicit per-device ``(x, y)`` shares (device i streams shard i, replayed endlessly);
        ``validation``: the split a strategy's decisions are scored on (None: none)."""
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
            validation=None if validation is None else Dataset(
                np.asarray(validation[0], dtype=np.float32), np.asarray(validation[1], dtype=np.int64), classes,
                "validation"),
        )
        return cls(data, tuple(float(r) for r in rates_hz), profile, message_interval_s, seed)


FILLS = ("error", "cycle", "ones")
"""``CostModel.fill``: what a per-worker list shorter than the run's workers means."""


class CostModelError(ValueError):
    """A cost model that cannot be used as given: a bad value, or (``CostModel.for_workers``)
    a per-worker list shorter than the run's workers under ``fill = "error"``;
    ``trainers/costmodels.py`` raises it for bad presets, files and overrides too."""


@dataclass(frozen=True)
class CostModel:
    """Modelled time of the two things the simulation does not measure: compute and transfer.

    A local step on ``b`` records takes ``(compute_base_s + compute_per_record_s * b)
    * slowdown_i`` seconds (``slowdowns[i]``); a message of ``n``
    bytes is appended to the log ``n / bandwidth + latency_s`` after the sender's
    uplink is free (one message at a time per process).

    ``slowdowns`` and ``link_bandwidths_bytes_per_s`` are per worker. Empty: every worker
    at 1 (at ``bandwidth_bytes_per_s``, downlinks free). Otherwise a run needs one entry
    per worker, and ``fill`` says what a shorter list means (:meth:`for_workers`, which
    :func:`run` applies): ``"error"`` (the default) refuses it, ``"cycle"`` repeats the
    list, ``"ones"`` gives the rest a slowdown of 1 and the server's
    ``bandwidth_bytes_per_s`` (what every shorter list silently meant before). A longer
    list's extra entries are left out.

    ``link_bandwidths_bytes_per_s`` (optional, one per worker: the host's link, e.g. the
    BENCHMARKS.md network regime) sets worker i's uplink to its entry and also models
    every process's downlink: each record of a subscribed channel (also those
    addressed to another process, which a Kafka consumer fetches too) reaches it one at a
    time, in log order, ``n / bandwidth`` after both the append and the previous record.
    Workers beyond the list and the server use ``bandwidth_bytes_per_s`` both ways.
    Without the list only uplinks cost time (downlinks are free), as before.

    ``link_changes`` (optional): a schedule of ``(time_s, worker_index, bytes_per_s)``:
    from simulated time ``time_s`` on, that worker's host link (up and down) has the new
    bandwidth (e.g. a link degrading mid-run). A transfer takes the bandwidth in force
    when it starts, to its end (one message is not split across a change).
    """

    compute_base_s: float = 0.01
    compute_per_record_s: float = 0.002
    slowdowns: tuple[float, ...] = ()
    latency_s: float = 0.002
    bandwidth_bytes_per_s: float = 12.5e6  # 100 Mbit/s
    link_bandwidths_bytes_per_s: tuple[float, ...] = ()
    link_changes: tuple[tuple[float, int, float], ...] = ()
    fill: str = "error"
    #: An evaluation's cost as a share of a training step's on as many records (a forward
    #: pass without the backward one, which takes about twice the forward's work): what
    #: scoring a model on the validation split costs the node (``eval_s``).
    eval_fraction: float = 1 / 3

    def __post_init__(self) -> None:
        values = (self.compute_base_s, self.compute_per_record_s, self.latency_s, self.eval_fraction, *self.slowdowns)
        links = (self.bandwidth_bytes_per_s, *self.link_bandwidths_bytes_per_s, *(c[2] for c in self.link_changes))
        if any(not v >= 0 or math.isnan(v) for v in values) or any(not b > 0 for b in links):
            raise CostModelError(f"cost model values must be >= 0 and bandwidths > 0: {self}")
        if any(len(c) != 3 or not c[0] >= 0 or not isinstance(c[1], int) or c[1] < 0 for c in self.link_changes):
            raise CostModelError(f"link_changes entries are (time_s >= 0, worker_index >= 0, bytes_per_s > 0): {self}")
        if self.fill not in FILLS:
            raise CostModelError(f"fill must be one of {', '.join(FILLS)}, got {self.fill!r}")

    def for_workers(self, workers: int) -> CostModel:
        """This cost model for a run of ``workers`` workers: each non-empty per-worker list
        (``slowdowns``, ``link_bandwidths_bytes_per_s``) with exactly ``workers`` entries,
        by ``fill`` when it is shorter (a longer one is cut); empty lists stay empty (every
        worker at 1, at ``bandwidth_bytes_per_s``). Raises :class:`CostModelError` for a
        shorter list under ``fill = "error"`` and for ``link_changes`` naming a worker
        the run does not have."""
        if workers < 1:
            raise CostModelError(f"a run needs at least one worker, got {workers}")
        slowdowns = self._fit(self.slowdowns, workers, 1.0, "slowdowns", "1")
        links = self._fit(self.link_bandwidths_bytes_per_s, workers, self.bandwidth_bytes_per_s,
                          "link bandwidths", "the server's bandwidth_bytes_per_s")
        beyond = sorted({index for _, index, _ in self.link_changes if index >= workers})
        if beyond:
            raise CostModelError(f"cost model has link_changes for worker index {', '.join(map(str, beyond))}, "
                                 f"but the run has {workers} workers (indices 0 to {workers - 1})")
        if slowdowns == self.slowdowns and links == self.link_bandwidths_bytes_per_s:
            return self
        return replace(self, slowdowns=slowdowns, link_bandwidths_bytes_per_s=links)

    def _fit(self, values: tuple[float, ...], workers: int, one: float, what: str, rest: str) -> tuple[float, ...]:
        if not values or len(values) == workers:
            return values
        if len(values) > workers:
            return tuple(values[:workers])
        if self.fill == "cycle":
            return tuple(values[i % len(values)] for i in range(workers))
        if self.fill == "ones":
            return (*values, *(one,) * (workers - len(values)))
        raise CostModelError(f"cost model gives {len(values)} {what} for {workers} workers: give {workers}, or set "
                             f'fill = "cycle" (repeat the list) or fill = "ones" (the rest at {rest})')

    @classmethod
    def zero(cls) -> CostModel:
        """No compute time, no latency, infinite bandwidth: the oracle's costs."""
        return cls(0.0, 0.0, (), 0.0, math.inf)

    @property
    def models_downlinks(self) -> bool:
        """True when per-host links are given: downloads take time too."""
        return bool(self.link_bandwidths_bytes_per_s)

    def compute_s(self, worker_index: int, batch_size: int) -> float:
        slowdown = self.slowdowns[worker_index] if worker_index < len(self.slowdowns) else 1.0
        return (self.compute_base_s + self.compute_per_record_s * batch_size) * slowdown

    def eval_s(self, worker_index: int, records: int) -> float:
        """Seconds worker ``worker_index`` takes to score its model on ``records`` records."""
        return self.compute_s(worker_index, records) * self.eval_fraction

    def link_bandwidth(self, worker_index: int | None, at: float | None = None) -> float:
        """Bytes/s of worker ``worker_index``'s host link (None: the server's), at simulated
        time ``at`` (the newest ``link_changes`` entry of that worker at or before it; None:
        the schedule is ignored)."""
        links = self.link_bandwidths_bytes_per_s
        bandwidth = self.bandwidth_bytes_per_s
        if worker_index is not None and worker_index < len(links):
            bandwidth = links[worker_index]
        if at is not None and worker_index is not None:
            changed = -math.inf
            for when, index, value in self.link_changes:
                if index == worker_index and changed <= when <= at:
                    changed, bandwidth = when, value
        return bandwidth

    def transfer_s(self, nbytes: int, worker_index: int | None = None, at: float | None = None) -> float:
        """Seconds ``nbytes`` take on a link (default: the common ``bandwidth_bytes_per_s``;
        with ``worker_index``, that worker's host link; None for the server) for a transfer
        starting at ``at`` (``link_changes``)."""
        return nbytes / self.link_bandwidth(worker_index, at)


DEFAULT_MEMBER_TIMEOUT_S = 6.0
"""The job config's default ``train.member_timeout_s`` (``job/config.py``; ``trainers/`` does
not import ``job/``, a unit test keeps the two equal)."""
DEFAULT_CHECKPOINT_EVERY_STEPS = 20
"""The job config's default ``train.checkpoint_every_steps`` (as ``TrainingPlan``'s)."""

_MEMBERSHIP_FIELDS = ("leaves", "joins", "crashes", "restarts")
"""``RunConfig`` fields holding ``(time_s, worker)`` schedules."""


def _check_schedule(name: str, pairs: Sequence[Any]) -> None:
    """``RunConfig.<name>`` holds ``(time_s, worker)`` pairs, each time finite and >= 0."""
    for pair in pairs:
        valid = (
            isinstance(pair, tuple | list) and len(pair) == 2
            and isinstance(pair[0], int | float) and not isinstance(pair[0], bool)
            and math.isfinite(pair[0]) and pair[0] >= 0
            and isinstance(pair[1], str) and bool(pair[1])
        )
        if not valid:
            raise ValueError(f"RunConfig.{name}: entries are (time_s >= 0, worker name) pairs with a finite "
                             f"time, got {pairs!r}")


def _check_lifecycles(config: RunConfig) -> None:
    """Every worker's schedule is one a process can live: it joins at most once, and nothing
    else happens to it until then; its crashes and restarts alternate, a crash first, each
    restart strictly after the crash before it. (Worker names are checked by the run, which
    knows its workers.)"""
    joined: dict[str, float] = {}
    for at, worker in config.joins:
        if worker in joined:
            raise ValueError(f"RunConfig.joins names {worker!r} twice")
        joined[worker] = at
    for name in ("leaves", "crashes", "restarts"):
        for at, worker in getattr(config, name):
            if worker in joined and at <= joined[worker]:
                raise ValueError(f"RunConfig.{name}: {worker!r} at {at} s, not after it joins at "
                                 f"{joined[worker]} s (RunConfig.joins)")
    down_since: dict[str, float] = {}
    # At equal times a crash sorts first, so a restart at its crash's very time is refused.
    for at, kind, worker in sorted([(at, 0, w) for at, w in config.crashes]
                                   + [(at, 1, w) for at, w in config.restarts]):
        if kind == 0:
            if worker in down_since:
                raise ValueError(f"RunConfig.crashes: {worker!r} crashes at {at} s while down since its crash "
                                 f"at {down_since[worker]} s (RunConfig.restarts must bring it back between)")
            down_since[worker] = at
            continue
        crashed_at = down_since.pop(worker, None)
        if crashed_at is None or crashed_at >= at:
            raise ValueError(f"RunConfig.restarts: {worker!r} restarts at {at} s without an earlier crash "
                             "(RunConfig.crashes)")


def _check_names(config: RunConfig, workers: Sequence[str], stages: Sequence[str]) -> None:
    """Every worker a membership schedule names is one of ``workers``, and one at least starts."""
    for name in _MEMBERSHIP_FIELDS:
        for _, worker in getattr(config, name):
            if worker not in workers:
                raise ValueError(f"RunConfig.{name} names {worker!r}, not a worker of this run ({', '.join(workers)})")
    joiners = {worker for _, worker in config.joins}
    if workers and joiners >= set(workers):
        raise ValueError(f"RunConfig.joins names every worker ({', '.join(workers)}); one at least must start the job")
    if joiners and stages:
        raise ValueError("RunConfig.joins cannot be used with train.stages (every stage is needed from the start)")


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
    min_time_s: float = 0.0
    """With ``stop_at_target``, run at least this long (simulated seconds), so that the
    accuracy at a fixed time can be read from the timeline of every run."""
    depth_sample_s: float = 0.1
    job: str = "simclock"
    max_message_bytes: int = 16 * 1024 * 1024
    torch_threads: int = 1
    max_grad_norm: float = 1.0e4
    """The step guard's bounds (``train.max_grad_norm`` / ``train.grad_norm_spike``)."""
    grad_norm_spike: float = 100.0
    evaluate_workers: bool = False
    """Evaluate every worker's model at each evaluation (each strategy's ``on_evaluation``
    gets its own score, as on the live runtime, where every worker evaluates itself);
    ``RunReport.worker_timelines`` holds them. Without a server whose model is evaluated,
    the job's accuracy (``timeline``, TTA) is then the mean of the workers' held-out
    accuracies (and ``loss_timeline`` the mean of their losses), ``evaluated`` is
    ``"workers"``. Off: only the job's model (the server's, else worker 0's) is evaluated."""
    plan: TrainingPlan | None = None
    """The job's training plan (``job.plan.training_plan``, as
    ``pipeline.simjob.run_config_from_job`` sets it): every setting it holds that this
    config and the mode do not (``max_abs_weight``, the culprit search, the compression
    controller, the observed range, data injection, Byzantine workers, the stage split,
    and the job's codec when the mode names none) reaches every process, built as the live
    runtime builds it (``trainers.assembly``). None: the defaults of a plan."""
    leaves: tuple[tuple[float, str], ...] = ()
    """``(time_s, worker)``: the worker stops on purpose at that simulated time, as a live
    worker stopped by SIGTERM does: once its step in progress is done it publishes what
    ``driver.leave()`` returns and its ``op: leave``, then takes no more steps or messages
    (its device's records wait, as in Kafka); every other process is told the new live set
    (``driver.membership``) at once, as the live runtime's heartbeat table does on a leave."""
    joins: tuple[tuple[float, str], ...] = ()
    """``(time_s, worker)``: the worker is not a member at the start (``edgestream worker
    --join``): it is built as a joiner (``joining=True``, its members the initial workers),
    nobody counts it, its device's records wait in its backlog (as in Kafka) and it takes no
    step and reads or sends nothing until ``time_s``; then it reads the log from its end on
    and every running process, itself included, is told the new live set."""
    crashes: tuple[tuple[float, str], ...] = ()
    """``(time_s, worker)``: the worker dies at that simulated time: no farewell, its step in
    progress is lost (its messages never leave), what it had on its uplink never reaches the
    log and nothing reaches it any more. The others are told the live set without it
    ``member_timeout_s`` later (the heartbeat table's timeout), unless it restarted first."""
    restarts: tuple[tuple[float, str], ...] = ()
    """``(time_s, worker)``: a crashed worker comes back at that time as a new process from
    its last checkpoint (every ``checkpoint_every_steps`` accepted local steps, and the
    checkpoint 0 of its start): the checkpoint's trainer and strategy state, ``driver.restored()``
    published, the update log read again from the checkpoint's position, the records trained
    since the checkpoint put back at the head of its queue; then it is live again."""
    member_timeout_s: float = DEFAULT_MEMBER_TIMEOUT_S
    """A crashed worker is dropped from the live set this long after its crash
    (``train.member_timeout_s``)."""
    checkpoint_every_steps: int = DEFAULT_CHECKPOINT_EVERY_STEPS
    """A worker named in ``restarts`` saves its state (in memory) every this many accepted
    local steps (``train.checkpoint_every_steps``); no other worker is ever restored, so no
    other saves."""

    def __post_init__(self) -> None:
        if not (self.eval_every_s > 0 and self.time_budget_s > 0 and self.depth_sample_s > 0):
            raise ValueError("eval_every_s, time_budget_s and depth_sample_s must be > 0")
        if not 0 <= self.min_time_s <= self.time_budget_s:
            raise ValueError(f"min_time_s must be in [0, time_budget_s], got {self.min_time_s}")
        if self.hold_evals < 1:
            raise ValueError(f"hold_evals must be >= 1, got {self.hold_evals}")
        for name in _MEMBERSHIP_FIELDS:
            _check_schedule(name, getattr(self, name))
        if not (isinstance(self.member_timeout_s, int | float) and math.isfinite(self.member_timeout_s)
                and self.member_timeout_s > 0):
            raise ValueError(f"RunConfig.member_timeout_s must be a finite number > 0, got {self.member_timeout_s}")
        if isinstance(self.checkpoint_every_steps, bool) or not isinstance(self.checkpoint_every_steps, int) \
                or self.checkpoint_every_steps < 1:
            raise ValueError(f"RunConfig.checkpoint_every_steps must be an integer >= 1, got {self.checkpoint_every_steps}")
        _check_lifecycles(self)


# -- reports ---------------------------------------------------------------------------------


@dataclass
class DeviceReport:
    """One device's stream and backlog.

    Invariant: ``arrived == trained + dropped + dead_lettered + waiting``
    (``dead_lettered``: records of steps the step guard rejected).
    ``prequential_accuracy``: the share of this device's trained records that the model
    predicted right just before training on them (0 before any).
    ``replayed``: records handed back to the head of the queue to be trained again
    (``RunConfig.crashes`` / ``restarts``): those of the step a crash lost, and at a restart
    those trained (or dead-lettered) after the checkpoint it restored; they leave
    ``trained`` (``dead_lettered``) for ``waiting`` then, so the invariant holds and a record
    is counted trained once however often it was trained.
    """

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
    dead_lettered: int = 0
    prequential_accuracy: float = 0.0
    replayed: int = 0


@dataclass
class RestoreReport:
    """One restart of a crashed worker from its last checkpoint (``RunConfig.restarts``)."""

    at_s: float
    """When it came back."""
    checkpoint_at_s: float
    """When the checkpoint it restored was taken (its start, or its join, for checkpoint 0)."""
    model_version: int
    """``trainer.version`` in the checkpoint: the version it resumed from."""
    local_steps: int
    """Its accepted local steps in the checkpoint: its count goes on from there."""
    lost_steps: int
    """Accepted local steps it took after the checkpoint, undone by the restore."""
    replayed_records: int
    """Records trained (or dead-lettered) after the checkpoint, put back at the head of its queue."""
    replayed_messages: int
    """Log records handed to its driver again: every record of its channels from the
    checkpoint's position to the end of the log."""


@dataclass
class ProcessReport:
    """One process's traffic and time (a worker, or the server).

    Bytes are the encoded record values. ``produced_bytes`` / ``produced_messages``: what
    the process appended to the log, per channel. ``consumed_bytes`` /
    ``consumed_messages``: what it fetched, per channel: every record of a broadcast
    channel it subscribes to (its own and those addressed ``to`` another process
    included, as a Kafka consumer of the topic fetches them), and only the records
    addressed to it on a point-to-point channel (:data:`POINT_TO_POINT_CHANNELS`).

    Time (workers; zero for the server), over ``[0, sim_time_s]``:
    ``busy_s + blocked_s + starved_s + absent_s == sim_time_s``. ``busy_s``: computing local
    steps; ``blocked_s``: idle with a batch ready but ``can_train()`` false (waiting for
    peers); ``starved_s``: idle without a batch (waiting for data); ``absent_s``: not running
    (before its join, after its leave, while crashed). ``step_starts``: the simulated
    time of every local step's start (also rejected ones, and those a crash lost);
    ``iteration_time_mean_s`` / ``iteration_time_cv``: mean and coefficient of variation
    (population std / mean) of the intervals between consecutive starts (0 with fewer than
    two; CV 0 with fewer than three starts). ``observations``: the strategy's
    ``observations()`` at the end (only the fields it set).

    Membership: ``membership_log`` holds ``(time_s, live workers)`` each time the process was
    told a live set (``driver.membership``); ``checkpoints``: checkpoints it saved (only
    workers named in ``RunConfig.restarts`` save); ``restores``: its restarts;
    ``lost_messages``: messages it had put on its uplink that its crash kept from the log
    (counted in ``produced_*`` and ``bytes_sent`` all the same).
    """

    name: str
    local_steps: int = 0
    produced_bytes: dict[str, int] = field(default_factory=dict)
    produced_messages: dict[str, int] = field(default_factory=dict)
    consumed_bytes: dict[str, int] = field(default_factory=dict)
    consumed_messages: dict[str, int] = field(default_factory=dict)
    busy_s: float = 0.0
    blocked_s: float = 0.0
    starved_s: float = 0.0
    step_starts: list[float] = field(default_factory=list)
    iteration_time_mean_s: float = 0.0
    iteration_time_cv: float = 0.0
    observations: dict[str, Any] = field(default_factory=dict)
    absent_s: float = 0.0
    membership_log: list[tuple[float, list[str]]] = field(default_factory=list)
    checkpoints: int = 0
    restores: list[RestoreReport] = field(default_factory=list)
    lost_messages: int = 0
    scorings: int = 0
    scoring_s: float = 0.0

    @property
    def idle_fraction(self) -> float:
        """Share of the run in which the worker computed nothing (blocked or starved)."""
        total = self.busy_s + self.blocked_s + self.starved_s
        return (self.blocked_s + self.starved_s) / total if total > 0 else 0.0


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
    """Version of the job's model at the end (``evaluated``: the server's when the strategy
    has one, else worker 0's; completed global steps for BSP-like strategies, applied
    updates for a parameter server)."""
    local_steps: int
    sim_time_s: float
    stopped: str
    timeline: list[tuple[float, float, int]]
    """``(time_s, held-out accuracy, model version)`` of the job's model at every evaluation."""
    bytes_sent: int
    gradient_messages: int
    compressed_messages: int
    compressed_fraction: float
    """From the strategies' ``compressed_steps`` / ``steps`` counters (0 without them)."""
    mean_staleness: float
    """Over every update applied by any process (the strategies' staleness trackers)."""
    devices: list[DeviceReport]
    rejected_steps: int = 0
    """Local steps the step guard rejected (all workers): neither applied nor published."""
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    rejected_messages: int = 0
    """Deliveries of log messages a worker's driver refused (decoding or validation)."""
    prequential_accuracy: float = 0.0
    """Worker 0's test-then-train accuracy since the start (each batch scored before training)."""
    prequential_recent_accuracy: float = 0.0
    """The same over worker 0's last ``DriverConfig.prequential_window`` scored batches."""
    evaluated: str = "w0"
    """Whose accuracy is the job's: ``server`` or ``w0`` (that process's model; ``steps`` is its
    version), or ``workers`` (``RunConfig.evaluate_workers`` without an evaluated server: the
    mean of the workers' held-out accuracies; ``steps`` is worker 0's version)."""
    max_staleness: int = 0
    """Largest staleness of an applied update (any process)."""
    server: dict[str, Any] | None = None
    """The server's ``counters`` and ``staleness`` summary, when the strategy has a server."""
    loss_timeline: list[tuple[float, float]] = field(default_factory=list)
    """``(time_s, held-out mean cross-entropy)`` of the job's model at every evaluation
    (the same evaluations as ``timeline``: time to a target loss)."""
    consensus_timeline: list[tuple[float, float]] = field(default_factory=list)
    """``(time_s, consensus distance)`` at every evaluation: the exact root-mean-square
    distance of the workers' trainer parameters to their average
    (``trainers.consensus.consensus_distance``; 0 for identical replicas)."""
    worker_timelines: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    """With ``RunConfig.evaluate_workers``: ``{worker: [(time_s, held-out accuracy)]}``."""
    processes: list[ProcessReport] = field(default_factory=list)
    """Every process (workers in order, then the server): traffic per channel and time."""
    membership: list[tuple[float, str, str]] = field(default_factory=list)
    """``(time_s, event, worker)`` in time order: ``join``, ``leave`` (its farewell is out),
    ``crash``, ``detected`` (the others drop the crashed worker: ``member_timeout_s`` after
    its crash) and ``restart`` (``RunConfig.joins`` / ``leaves`` / ``crashes`` / ``restarts``)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


# -- one device's backlog ------------------------------------------------------------------


class DeviceBacklog:
    """One device's records from arrival to a step: ``StreamBuffer`` -> ``AdaptiveBatcher`` -> ``BatchQueue``.

    Batches the batcher emits wait in ``ready`` (a ``streams.batching.BatchQueue``,
    whose ``take(limit)`` is the one rule for what a step takes) until the worker takes
    them, so the depth that matters (records arrived and not yet trained) is
    ``buffer.depth + ready.records``. Under ``truncate`` that depth never exceeds the
    capacity: the buffer drops on push, and the oldest ready batches are dropped next.
    Taken records are ``in_step`` until :meth:`settle` says whether the step trained
    on them or the step guard rejected it (dead-lettered).

    Invariant: ``arrived == trained + dropped + dead_lettered + waiting`` at every
    moment (``waiting`` includes ``in_step``). Settled records :meth:`requeue` hands back
    (a crash, a restart) count as waiting again, and as ``replayed``.
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
            window_overflow=mode.window_overflow or mode.buffer_policy,
            max_batch_widen=mode.max_batch_widen,
        )
        self.ready = BatchQueue(mode.batcher)
        self.ready_dropped = 0
        self.in_step = 0
        self.trained = 0
        self.dead_lettered = 0
        self.replayed = 0
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
        return self.buffer.depth + self.ready.records + self.in_step

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
        return self.ready.records > 0

    def take(self, limit: int) -> list[Batch]:
        """The next step's batches (``BatchQueue.take``: one fixed batch, or the oldest
        ready records up to ``limit``); they are ``in_step`` until :meth:`settle`."""
        if not self.has_batch():
            raise RuntimeError("take() without a ready batch")
        batches = self.ready.take(limit)
        self.in_step += sum(b.size for b in batches)
        return batches

    def settle(self, batches: Sequence[Batch], *, dead_lettered: bool = False) -> None:
        """The step on ``batches`` is done: their records were trained on, or (the step
        was rejected) dead-lettered."""
        records = sum(b.size for b in batches)
        if records > self.in_step:
            raise RuntimeError(f"settle() of {records} records, {self.in_step} in step")
        self.in_step -= records
        if dead_lettered:
            self.dead_lettered += records
        else:
            self.trained += records

    def requeue(self, steps: Sequence[tuple[Sequence[Batch], bool]]) -> int:
        """Hand the batches of settled steps (``(batches, dead_lettered)``, oldest first) back
        to the head of the queue, ahead of every waiting batch and in their own order, to be
        trained again (a live worker re-reads from its committed offsets what it had not
        committed: Kafka re-delivers them in offset order). Their settlement is undone; they
        count as ``replayed``. Under ``truncate`` the capacity rule applies at once (oldest
        first). Returns the records handed back."""
        back: list[Batch] = []
        for batches, dead_lettered in steps:
            records = sum(b.size for b in batches)
            if dead_lettered:
                self.dead_lettered -= records
            else:
                self.trained -= records
            self.replayed += records
            back.extend(batches)
        waiting: list[Batch] = []
        while len(self.ready):
            waiting.append(self.ready.drop_oldest())  # emptied in order, refilled behind ``back``
        for batch in back + waiting:
            self.ready.put(batch)
        self._queue(())
        self.max_depth = max(self.max_depth, self.waiting)
        return sum(b.size for b in back)

    def _queue(self, emitted: Sequence[Batch]) -> None:
        for batch in emitted:
            self.ready.put(batch)
        if self.mode.buffer_policy == "truncate":
            while len(self.ready) and self.waiting > self.mode.buffer_capacity:
                self.ready_dropped += self.ready.drop_oldest().size


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
        from edgestream.trainers.injection import DataInjector

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
        from edgestream.trainers.injection import shared_pool

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
# then messages, then finished steps; observers (depth samples, evaluation) last; then
# membership: leaves, joins, crashes, their detection, restarts.
(_ARRIVALS, _WINDOW, _APPEND, _DELIVER, _STEP_DONE, _SCORE_DONE, _SAMPLE, _EVAL, _LEAVE,
 _JOIN, _CRASH, _DETECT, _RESTART) = range(13)


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
    """One record of the update log: the encoded value, its channel and optional recipient,
    and ``produced_at``: the simulated time its sender produced it (when the step or
    message that made it was done, before its uplink transfer). ``sender`` and its
    ``incarnation`` when it produced it (a crash in between keeps it from the log);
    ``seq``: its position in the log, given at the append (-1 before)."""

    channel: str
    to: str | None
    value: bytes
    produced_at: float = 0.0
    sender: str = ""
    incarnation: int = 0
    seq: int = -1


@dataclass(frozen=True)
class _Checkpoint:
    """What a live checkpoint holds of one worker, in memory: deep copies of the trainer's
    and the strategy's ``state_dict()`` (as ``trainers.checkpoint.save_training_checkpoint``
    stores them) and of the learned observed range (its ``meta``), its accepted step count
    (``meta["steps"]``) and its position in the update log (its update offsets: the next
    ``_LogEntry.seq`` it had not handled)."""

    at: float
    trainer: dict[str, Any]
    strategy: dict[str, Any]
    observed: dict[str, Any] | None
    local_steps: int
    log_position: int


def _snapshot(driver: TrainingDriver) -> tuple[dict[str, torch.Tensor], int]:
    """The model's state and version before a step (what others see until the step ends)."""
    trainer = driver.trainer
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, trainer.version


@contextlib.contextmanager
def _visible_models(processes: Sequence[_Worker]) -> Iterator[None]:
    """Within: every busy process's model as it was when its step started
    (``_Worker.visible``); after: exactly as it was (copied back in place)."""
    swapped = []
    for process in processes:
        if process.busy and process.visible is not None:
            model = process.driver.trainer.model
            swapped.append((model, {k: v.detach().clone() for k, v in model.state_dict().items()}))
            with torch.no_grad():
                model.load_state_dict(process.visible[0])
    try:
        yield
    finally:
        for model, state in swapped:
            with torch.no_grad():
                model.load_state_dict(state)


def _visible_version(process: _Worker) -> int:
    """The model version an evaluation sees now (a step in progress counts at its end)."""
    if process.busy and process.visible is not None:
        return process.visible[1]
    return process.driver.trainer.version


class _Worker:
    """One process: a worker (its device backlog and its training driver) or the server
    (``backlog`` None, ``index`` None: no device, never trains).

    Invariant: while ``busy`` (a step is computing) the driver is not called. The
    step's effect on the model side happened when it started (``driver.step``); its
    ``Stepped`` is held in ``stepped`` and its messages leave at ``_STEP_DONE``.
    Log records delivered meanwhile wait in ``pending`` and are handed to the driver, in
    log order, right after that publication (as the live runtime's single training
    thread does). ``visible``: the model's state when the step in progress started (and its
    version): what an evaluation during the step's compute sees, since its result exists
    only at the step's end. Scoring the model on the validation split (a strategy with
    ``uses_validation``) also keeps a worker busy, ``CostModel.eval_s``; one due while a
    step computes (``score_due``) is taken after it, one due while a scoring runs after
    the next step (or at once if no step can start: the live loop steps, then scores if
    due), and its messages wait in ``held`` until the scoring's end. The server is never busy.

    ``state`` (``busy`` / ``blocked`` / ``starved`` / ``absent``) is what a worker has been
    doing since ``state_since``; :meth:`enter` charges that interval to ``time_in`` and switches.

    ``status``: ``live`` (running), ``joining`` (built, not yet joined), ``left`` or
    ``crashed``; only a live process is ``gone`` false, and only it is called, delivered to
    or serviced. ``incarnation`` goes up at every crash and restart: a step end or an
    uplink message of an older incarnation is void. ``next_seq`` is its position in the
    log (the next record it would hand to its driver; older ones are skipped, so a record
    is handled once per incarnation). ``told``: the live set its driver was last told (None:
    nothing yet, a restarted process).
    """

    def __init__(
        self, index: int | None, name: str, backlog: DeviceBacklog | None, driver: TrainingDriver
    ) -> None:
        self.index = index
        self.name = name
        self.backlog = backlog
        self.driver = driver
        self.busy = False
        self.stepped: Stepped | None = None
        self.held: list[Outbound] = []
        self.visible: tuple[dict[str, torch.Tensor], int] | None = None
        self.score_due = False
        self.scorings = 0
        self.scoring_s = 0.0
        self.pending: deque[_LogEntry] = deque()
        self.uplink_free_at = 0.0
        self.downlink_free_at = 0.0
        self.local_steps = 0
        self.rejected_steps: Counter[str] = Counter()
        self.rejected_messages = 0
        self.injected = 0
        self.scored = 0
        self.correct = 0
        self.depth_samples: list[int] = []
        self.produced_bytes: Counter[str] = Counter()
        self.produced_messages: Counter[str] = Counter()
        self.consumed_bytes: Counter[str] = Counter()
        self.consumed_messages: Counter[str] = Counter()
        self.state = "starved"
        self.state_since = 0.0
        self.time_in: Counter[str] = Counter()
        self.step_starts: list[float] = []
        #: Stopping (``RunConfig.leaves``): leaves once its step in progress is done.
        self.leaving = False
        self.status = "live"
        self.incarnation = 0
        self.next_seq = 0
        self.told: tuple[str, ...] | None = None
        self.membership_log: list[tuple[float, list[str]]] = []
        #: The batches of the stream step in progress and whether they were dead-lettered.
        self.step_batches: tuple[list[Batch], bool] | None = None
        #: Workers that may restart: the last checkpoint, and the steps settled since it.
        self.checkpoint: _Checkpoint | None = None
        self.since_checkpoint: list[tuple[list[Batch], bool]] = []
        self.steps_since_checkpoint = 0
        self.checkpoints = 0
        self.restores: list[RestoreReport] = []
        self.lost_messages = 0

    @property
    def gone(self) -> bool:
        """Not running: takes no steps and sends or receives nothing."""
        return self.status != "live"

    def enter(self, state: str, now: float) -> None:
        """Charge ``[state_since, now]`` to the current state, then switch to ``state``."""
        if now > self.state_since:
            self.time_in[self.state] += now - self.state_since
            self.state_since = now
        self.state = state

    def report(self) -> ProcessReport:
        starts = self.step_starts
        mean, cv = interval_stats(starts)
        observed = asdict(self.driver.strategy.observations())
        return ProcessReport(
            name=self.name,
            local_steps=self.local_steps,
            produced_bytes=dict(sorted(self.produced_bytes.items())),
            produced_messages=dict(sorted(self.produced_messages.items())),
            consumed_bytes=dict(sorted(self.consumed_bytes.items())),
            consumed_messages=dict(sorted(self.consumed_messages.items())),
            busy_s=self.time_in["busy"],
            blocked_s=self.time_in["blocked"],
            starved_s=self.time_in["starved"],
            step_starts=list(starts),
            iteration_time_mean_s=mean,
            iteration_time_cv=cv,
            observations={k: _plain(v) for k, v in observed.items() if v is not None},
            absent_s=self.time_in["absent"],
            membership_log=[(at, list(live)) for at, live in self.membership_log],
            checkpoints=self.checkpoints,
            restores=list(self.restores),
            lost_messages=self.lost_messages,
            scorings=self.scorings,
            scoring_s=self.scoring_s,
        )


def _injector(hook: InjectHook, index: int) -> Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, int]]:
    """A mode's ``inject(worker_index, x, y)`` as worker ``index``'s driver injector."""

    def inject(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        x_out, y_out = hook(index, x, y)
        return x_out, y_out, len(y_out) - len(y)

    return inject


def simulation_plan(mode: Mode, config: RunConfig, workers: Sequence[str]) -> TrainingPlan:
    """The plan every process of a simulated run is built from: ``config.plan`` (the job's,
    or a default one) with the mode's strategy, batch cap, codec (when it names one) and lr,
    this config's model, optimiser, seed, message cap and step-guard bounds, and one
    worker per device (``workers``), members from the start unless ``config.joins`` names them."""
    base = config.plan if config.plan is not None else TrainingPlan()
    codec_set = mode.codec is not None
    joiners = {worker for _, worker in config.joins}
    return replace(
        base,
        job=config.job,
        seed=config.seed,
        workers=tuple(workers),
        initial_workers=tuple(w for w in workers if w not in joiners),
        strategy=mode.strategy,
        strategy_params=dict(mode.strategy_params),
        model=config.model,
        model_params=dict(config.model_options),
        lr=config.lr if mode.lr is None else mode.lr,
        momentum=config.momentum,
        max_message_bytes=config.max_message_bytes,
        max_step_batch=mode.max_step_batch or mode.max_batch,
        codec=mode.codec if mode.codec is not None else base.codec,
        codec_params=dict(mode.codec_params) if codec_set else dict(base.codec_params),
        error_feedback=mode.error_feedback if codec_set else base.error_feedback,
        max_grad_norm=config.max_grad_norm,
        grad_norm_spike=config.grad_norm_spike,
    )



class _Simulation:
    """One run of one mode on one stream set; build, then call :meth:`run` once."""

    def __init__(self, mode: Mode, streams: StreamSet, costs: CostModel, config: RunConfig) -> None:
        self.mode = mode
        self.streams = streams
        # One entry per worker in every per-worker list, by the cost model's fill rule
        # (a shorter list under fill = "error" is refused here, before anything runs).
        self.costs = costs.for_workers(len(streams.devices))
        self.config = config
        self.inject = copy.deepcopy(mode.inject)
        self.events = _EventQueue()
        self.simulators = streams.simulators()
        names = [f"w{i}" for i in range(len(streams.devices))]
        self.plan = simulation_plan(mode, config, names)
        if self.plan.stages and len(names) != len(self.plan.stages) + 1:
            raise ValueError(f"train.stages = {list(self.plan.stages)} makes {len(self.plan.stages) + 1} stages, one "
                             f"worker each; the simulated clock runs one worker per device: give it "
                             f"{len(self.plan.stages) + 1} devices (it has {len(names)})")
        _check_names(config, names, self.plan.stages)
        self.workers: list[_Worker] = []
        # Every worker runs the same model and strategy, so a log record decodes the same
        # for all: decode it once (the drivers still validate and judge it themselves).
        # A stage-split model's stages differ, so each of them decodes for itself.
        self.decodes = DecodeMemo() if not self.plan.stages else None
        joiners = {worker for _, worker in config.joins}
        initial = tuple(self.plan.initial_workers)
        for index, (name, device) in enumerate(zip(names, streams.devices, strict=True)):
            # A joiner is built as the live runtime builds one (its members: the initial workers).
            worker = _Worker(index, name, DeviceBacklog(device, mode), self._build_driver(index, name, name in joiners))
            worker.told = initial
            if name in joiners:
                worker.status, worker.state = "joining", "absent"
            self.workers.append(worker)
        # The server role, if the strategy has one: same initial weights and optimiser
        # settings, its own driver (its own decodes: its strategy may read other kinds).
        self.server: _Worker | None = None
        if "server" in strategies.roles(mode.strategy):
            self.server = _Worker(None, SERVER_NAME, None, assembly.build_driver(
                self.plan, SERVER_NAME, streams.data, role="server", members=initial))
            self.server.told = initial
        self.processes: list[_Worker] = self.workers + ([self.server] if self.server is not None else [])
        self.by_name = {process.name: process for process in self.processes}
        # Membership: the heartbeat table's live set (a crashed worker stays in it until its
        # crash is detected), what happened, and the update log kept for restarts to re-read.
        self.view: set[str] = set(initial)
        self.membership_events: list[tuple[float, str, str]] = []
        self.restarts_due: Counter[str] = Counter(worker for _, worker in config.restarts)
        self.log_seq = 0
        self.history: deque[_LogEntry] = deque()
        # The job's model: the server's, unless it says it holds none worth evaluating.
        self.evaluated = (
            self.server
            if self.server is not None and self.server.driver.strategy.evaluates_model
            else self.workers[0]
        )
        # With evaluate_workers every worker (and an evaluated server) is evaluated; the job's
        # accuracy is then the server's, or without one the mean of the workers'.
        server_evaluated = self.evaluated is self.server
        if config.evaluate_workers:
            self.evaluated_processes = self.workers + ([self.server] if server_evaluated else [])
            self.evaluated_name = SERVER_NAME if server_evaluated else "workers"
        else:
            self.evaluated_processes = [self.evaluated]
            self.evaluated_name = self.evaluated.name
        self.timeline: list[tuple[float, float, int]] = []
        self.loss_timeline: list[tuple[float, float]] = []
        self.consensus_timeline: list[tuple[float, float]] = []
        self.worker_timelines: dict[str, list[tuple[float, float]]] = (
            {w.name: [] for w in self.workers} if config.evaluate_workers else {}
        )
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
        for kind, schedule in ((_LEAVE, self.config.leaves), (_JOIN, self.config.joins),
                               (_CRASH, self.config.crashes), (_RESTART, self.config.restarts)):
            for at, name in schedule:
                self.events.push(at, kind, self.by_name[name])
        for worker in self.workers:
            if not worker.gone:
                self._checkpoint(worker)  # checkpoint 0: its start (a joiner's is its join)
        # What each kind of event does with its payload (``_EVAL`` may end the run).
        handlers: dict[int, Callable[[Any], Any]] = {
            _ARRIVALS: self._on_arrivals, _WINDOW: self._on_window, _APPEND: self._on_append,
            _DELIVER: lambda p: self._on_deliver(*p), _STEP_DONE: lambda p: self._on_step_done(*p),
            _SCORE_DONE: lambda p: self._on_score_done(*p),
            _SAMPLE: self._on_sample, _LEAVE: self._on_leave, _JOIN: self._on_join, _CRASH: self._on_crash,
            _DETECT: lambda p: self._on_detect(*p), _RESTART: self._on_restart,
        }
        stopped = "budget"
        while self.events.next_time() <= self.config.time_budget_s:
            self.now, kind, payload = self.events.pop()
            if kind == _EVAL:
                if self._on_eval(payload):
                    stopped = "target"
                    break
                continue
            handlers[kind](payload)
        if stopped == "budget":
            self.now = self.config.time_budget_s
        for worker in self.workers:
            worker.enter(worker.state, self.now)  # close the last interval
        return self._report(stopped)

    def _on_arrivals(self, tick: int) -> None:
        interval = self.streams.message_interval_s
        start, end = (tick - 1) * interval, tick * interval
        for worker, simulator in zip(self.workers, self.simulators, strict=True):
            # A split model's first stage reads every device (as w0 does live).
            reader = self.workers[0] if self.plan.stages else worker
            reader.backlog.arrive(simulator.step(start, end, 0.0), self.now)
        self.events.push((tick + 1) * interval, _ARRIVALS, tick + 1)
        for process in self.processes:
            self._service(process)

    def _on_window(self, worker: _Worker) -> None:
        worker.backlog.close_windows(self.now)
        self.events.push(worker.backlog.batcher.next_window_at, _WINDOW, worker)
        self._service(worker)

    def _service(self, worker: _Worker) -> None:
        """Give an idle process its timers, then start a step if it may and has data."""
        if worker.busy or worker.gone:
            return
        driver = worker.driver
        self._publish(worker, driver.poll(self.now))
        if worker.backlog is None:
            return
        if driver.queued_steps():
            # A step on an input the strategy received (a later stage of a split model),
            # taken before any stream step, as the live runtime's ``next_step()`` orders them.
            worker.enter("busy", self.now)
            worker.step_starts.append(self.now)
            worker.visible = _snapshot(driver)
            stepped = driver.step_queued()
            if stepped.rejection is not None:
                worker.rejected_steps[stepped.rejection.reason] += 1
            self._compute(worker, stepped, stepped.samples)
            return
        if not worker.backlog.has_batch():
            worker.enter("starved", self.now)
            return
        if not driver.can_train():
            worker.enter("blocked", self.now)
            return
        worker.enter("busy", self.now)
        worker.step_starts.append(self.now)
        batches = worker.backlog.take(driver.batch_limit())
        records = concat([b.records for b in batches]) if len(batches) > 1 else batches[0].records
        worker.visible = _snapshot(driver)
        stepped = driver.step(records.features, records.labels)
        worker.backlog.settle(batches, dead_lettered=stepped.rejection is not None)
        worker.step_batches = (batches, stepped.rejection is not None)
        if stepped.rejection is not None:
            worker.rejected_steps[stepped.rejection.reason] += 1
        worker.injected += stepped.injected
        if stepped.correct_mask is not None:
            worker.scored += len(stepped.correct_mask)
            worker.correct += int(stepped.correct_mask.sum())
        self._compute(worker, stepped, stepped.records + stepped.injected)

    def _compute(self, worker: _Worker, stepped: Stepped, samples: int) -> None:
        """Hold a started step's messages until its modelled compute time on ``samples`` has passed."""
        worker.stepped = stepped
        worker.busy = True
        assert worker.index is not None  # only workers have a backlog
        compute_s = self.costs.compute_s(worker.index, samples)
        self.events.push(self.now + compute_s, _STEP_DONE, (worker, worker.incarnation))

    def _on_step_done(self, worker: _Worker, incarnation: int) -> None:
        if incarnation != worker.incarnation:
            return  # the step of a process that crashed meanwhile: lost with it
        stepped = worker.stepped
        assert stepped is not None
        worker.stepped = None
        worker.busy = False
        worker.visible = None  # the step's result is the model now
        if worker.step_batches is not None and worker.checkpoint is not None:
            worker.since_checkpoint.append(worker.step_batches)  # re-read if it restarts
        worker.step_batches = None
        self._publish(worker, stepped.outbound)  # none for a rejected step
        if stepped.rejection is None:
            worker.local_steps += 1
            self._count_towards_checkpoint(worker)
        self._resume(worker)

    def _resume(self, worker: _Worker, after_scoring: bool = False) -> None:
        """A worker's busy spell (a step or a scoring) just ended: what it held back goes out,
        then it leaves if it is leaving, else handles the deliveries that waited, takes a
        scoring that fell due meanwhile, and looks for its next step. After a scoring the
        next step comes first, as in the live loop (a step, then an evaluation if one is
        due): a node whose scoring lasts longer than the evaluation interval alternates
        steps and scorings instead of scoring on and on."""
        held, worker.held = worker.held, []
        self._publish(worker, held)
        if worker.leaving:
            self._leave(worker)
            return
        while worker.pending:
            self._deliver(worker, worker.pending.popleft())
        if worker.score_due and not after_scoring:
            worker.score_due = False
            if self._score(worker):
                return
        self._service(worker)
        if worker.score_due and not worker.busy and not worker.gone:
            worker.score_due = False  # no step could start: the due scoring now
            if not self._score(worker):
                self._service(worker)

    def _score(self, process: _Worker) -> bool:
        """Score ``process``'s model on the validation split and hand it to its strategy;
        True when that keeps it busy (``CostModel.eval_s`` of its node; the server's is free)
        until ``_SCORE_DONE``, which publishes what the strategy answered."""
        validation = self.streams.data.validation
        assert validation is not None
        _, outbound = process.driver.validate(validation.features, validation.labels)
        process.scorings += 1
        seconds = 0.0 if process.index is None else self.costs.eval_s(process.index, len(validation))
        if seconds <= 0:
            self._publish(process, outbound)
            return False
        process.enter("busy", self.now)
        process.busy = True
        process.scoring_s += seconds
        process.held.extend(outbound)
        self.events.push(self.now + seconds, _SCORE_DONE, (process, process.incarnation))
        return True

    def _on_score_done(self, worker: _Worker, incarnation: int) -> None:
        if incarnation != worker.incarnation:
            return  # the scoring of a process that crashed meanwhile
        worker.busy = False
        self._resume(worker, after_scoring=True)

    def _publish(self, worker: _Worker, outbound: list[Outbound]) -> None:
        """Put the driver's encoded messages on the process's uplink, one at a time."""
        for item in outbound:
            size = len(item.value)
            self.bytes_sent += size
            worker.produced_bytes[item.channel] += size
            worker.produced_messages[item.channel] += 1
            if item.kind == "gradient":
                self.gradient_messages += 1
                self.compressed_messages += int(item.compressed)
            starts = max(self.now, worker.uplink_free_at)
            sent_at = starts + self.costs.transfer_s(size, worker.index, starts)
            worker.uplink_free_at = sent_at
            appended_at = sent_at + self.costs.latency_s
            # The modelled transfer time, known at once (the live runtime measures it).
            worker.driver.transferred(item, appended_at - self.now)
            entry = _LogEntry(item.channel, item.to, item.value, self.now, worker.name, worker.incarnation)
            self.events.push(appended_at, _APPEND, entry)

    # -- membership -----------------------------------------------------------------------

    def _live(self) -> tuple[str, ...]:
        """The live set every process is told: the heartbeat table's view, in worker order."""
        return tuple(w.name for w in self.workers if w.name in self.view)

    def _announce(self) -> None:
        """Tell every running process whose last-told live set differs the current one
        (``driver.membership``), as the live runtime does when its table's report changes; a
        busy process holds what it answers until its step's own messages are out."""
        live = self._live()
        for process in self.processes:
            if process.gone or process.told == live:
                continue
            process.told = live
            process.membership_log.append((self.now, list(live)))
            outbound = process.driver.membership(list(live))
            if process.busy:
                process.held.extend(outbound)  # after the step's own messages
            else:
                self._publish(process, outbound)
                self._service(process)

    def _on_leave(self, worker: _Worker) -> None:
        """``RunConfig.leaves``: the worker stops now, or once its step in progress is done
        (nothing happens to a worker that is not running)."""
        if worker.gone:
            return
        worker.leaving = True
        if not worker.busy:
            self._leave(worker)

    def _leave(self, worker: _Worker) -> None:
        """The worker publishes its farewell and stops; every other process learns the live set."""
        self._publish(worker, worker.driver.leave())
        worker.leaving, worker.status = False, "left"
        worker.enter("absent", self.now)
        self.membership_events.append((self.now, "leave", worker.name))
        self.view.discard(worker.name)
        self._announce()

    def _on_join(self, worker: _Worker) -> None:
        """``RunConfig.joins``: the joiner starts now. It reads the update log from its end on
        (as a live joiner's consumers start at the topics' end), saves its checkpoint 0, and
        every running process, itself included, is told the live set with it; what its
        strategy needs first (the model) then comes through the log like any message."""
        worker.status = "live"
        worker.next_seq = self.log_seq
        worker.enter("starved", self.now)
        self._checkpoint(worker)
        self.membership_events.append((self.now, "join", worker.name))
        self.view.add(worker.name)
        self._announce()
        self._service(worker)

    def _on_crash(self, worker: _Worker) -> None:
        """``RunConfig.crashes``: the process dies at once, with no farewell. Its step in
        progress is lost (its messages never leave; its records go back to the head of its
        queue: a live worker had not committed them), so are the messages it held and those
        still on its uplink (a new incarnation voids them); nothing reaches it any more. The
        others learn it ``member_timeout_s`` later."""
        if worker.gone:
            return  # already stopped: nothing left to crash
        assert worker.backlog is not None
        if worker.step_batches is not None:
            worker.backlog.requeue([worker.step_batches])
            worker.step_batches = None
        worker.busy, worker.stepped, worker.leaving = False, None, False
        worker.visible, worker.score_due = None, False
        worker.held, worker.pending = [], deque()
        worker.incarnation += 1
        worker.status = "crashed"
        worker.uplink_free_at = worker.downlink_free_at = self.now
        worker.enter("absent", self.now)
        self.membership_events.append((self.now, "crash", worker.name))
        self.events.push(self.now + self.config.member_timeout_s, _DETECT, (worker, worker.incarnation))

    def _on_detect(self, worker: _Worker, incarnation: int) -> None:
        """The crashed worker was not heard from for ``member_timeout_s``: every running
        process is told the live set without it (unless it restarted meanwhile)."""
        if worker.status != "crashed" or worker.incarnation != incarnation:
            return
        self.membership_events.append((self.now, "detected", worker.name))
        self.view.discard(worker.name)
        self._announce()

    def _on_restart(self, worker: _Worker) -> None:
        """``RunConfig.restarts``: a new process of the crashed worker, as a live restart runs:
        built afresh, its checkpoint's trainer and strategy state loaded (the driver's own
        state, codec residuals and scores, starts anew), ``driver.restored()`` published, the
        update log read from the checkpoint's position to its end (instantly), the records
        settled after the checkpoint handed back to its queue; then it is live again and the
        live set is told to whoever's view changed, itself first of all."""
        self.restarts_due[worker.name] -= 1
        if worker.status != "crashed":
            return  # it left for good, and a left worker does not come back
        checkpoint = worker.checkpoint
        assert checkpoint is not None and worker.index is not None and worker.backlog is not None
        worker.driver = self._build_driver(worker.index, worker.name)
        self._load_checkpoint(worker.driver, checkpoint)
        lost_steps = worker.local_steps - checkpoint.local_steps
        worker.local_steps = checkpoint.local_steps
        worker.steps_since_checkpoint = 0
        replayed_records = worker.backlog.requeue(worker.since_checkpoint)
        worker.since_checkpoint = []
        worker.incarnation += 1
        worker.status, worker.told = "live", None
        worker.enter("starved", self.now)
        self.membership_events.append((self.now, "restart", worker.name))
        self._publish(worker, worker.driver.restored())
        replayed_messages = self._replay(worker, checkpoint.log_position)
        worker.restores.append(RestoreReport(
            at_s=self.now, checkpoint_at_s=checkpoint.at, model_version=int(checkpoint.trainer["version"]),
            local_steps=checkpoint.local_steps, lost_steps=lost_steps, replayed_records=replayed_records,
            replayed_messages=replayed_messages,
        ))
        if self.restarts_due[worker.name] <= 0:
            worker.checkpoint = None  # never restored again: stop saving
        self._trim_history()
        self.view.add(worker.name)
        self._announce()
        self._service(worker)

    def _build_driver(self, index: int, name: str, joining: bool = False) -> TrainingDriver:
        """Worker ``name``'s driver, built through ``trainers.assembly`` as the live runtime
        builds it: a joiner with ``joining`` (its members: the plan's initial workers); a
        restarted worker as one that resumes a checkpoint (not joining)."""
        injector = None if self.inject is None else _injector(self.inject, index)
        return assembly.build_driver(self.plan, name, self.streams.data, joining=joining, injector=injector,
                                     shared_decodes=self.decodes)

    # -- checkpoints --------------------------------------------------------------------------

    def _count_towards_checkpoint(self, worker: _Worker) -> None:
        """One more accepted local step; a worker that may restart checkpoints every
        ``checkpoint_every_steps`` of them (after the step's messages are out, as live)."""
        if worker.checkpoint is None:
            return  # it never restarts: nothing to save
        worker.steps_since_checkpoint += 1
        if worker.steps_since_checkpoint >= self.config.checkpoint_every_steps:
            self._checkpoint(worker)

    def _checkpoint(self, worker: _Worker) -> None:
        """Save ``worker``'s state as a live checkpoint holds it (deep copies), if a restart
        is still due for it; its log position is the next record it has not handled."""
        if self.restarts_due[worker.name] <= 0:
            return
        driver = worker.driver
        worker.checkpoint = _Checkpoint(
            at=self.now,
            trainer=copy.deepcopy(driver.trainer.state_dict()),
            strategy=copy.deepcopy(driver.strategy.state_dict()),
            observed=copy.deepcopy(driver.observed.state_dict()) if driver.observed is not None else None,
            local_steps=worker.local_steps,
            log_position=worker.next_seq,
        )
        worker.checkpoints += 1
        worker.since_checkpoint = []
        worker.steps_since_checkpoint = 0
        self._trim_history()

    @staticmethod
    def _load_checkpoint(driver: TrainingDriver, checkpoint: _Checkpoint) -> None:
        """Load a checkpoint into a fresh driver's trainer and strategy (and observed range),
        from copies, so the checkpoint itself stays as it was saved."""
        driver.trainer.load_state_dict(copy.deepcopy(checkpoint.trainer))
        driver.strategy.load_state_dict(copy.deepcopy(checkpoint.strategy))
        if checkpoint.observed is not None and driver.observed is not None:
            driver.observed.load_state_dict(copy.deepcopy(checkpoint.observed))

    def _replay(self, worker: _Worker, position: int) -> int:
        """Hand ``worker``'s driver every logged record of its channels from ``position``
        to the end of the log, in log order (fetched again: counted consumed), as a live
        restart re-reads the update topics from its checkpoint's offsets; returns how many."""
        replayed = 0
        worker.next_seq = position
        for entry in list(self.history):
            if entry.seq < position or not self._reads(worker, entry):
                continue
            worker.consumed_bytes[entry.channel] += len(entry.value)
            worker.consumed_messages[entry.channel] += 1
            self._deliver(worker, entry)
            replayed += 1
        worker.next_seq = self.log_seq
        return replayed

    def _keeps_history(self) -> bool:
        """Whether a worker with a restart still due has a checkpoint to re-read the log from
        (a later checkpoint starts at the end of the log: nothing older is needed for it)."""
        if not self.restarts_due:
            return False
        return any(self.restarts_due[w.name] > 0 and w.checkpoint is not None for w in self.workers)

    def _trim_history(self) -> None:
        """Keep the log only from the oldest position a restart still due may re-read from."""
        positions = [w.checkpoint.log_position for w in self.workers
                     if self.restarts_due[w.name] > 0 and w.checkpoint is not None]
        keep_from = min(positions, default=self.log_seq)
        while self.history and self.history[0].seq < keep_from:
            self.history.popleft()

    # -- the log ------------------------------------------------------------------------------

    def _reads(self, process: _Worker, entry: _LogEntry) -> bool:
        """Whether ``process`` fetches ``entry``: a record of a channel it subscribes to (on
        a point-to-point channel, only one addressed to it)."""
        if entry.channel not in process.driver.strategy.subscribes:
            return False
        return entry.channel not in POINT_TO_POINT_CHANNELS or entry.to == process.name

    def _on_append(self, entry: _LogEntry) -> None:
        sender = self.by_name.get(entry.sender)
        if sender is not None and sender.incarnation != entry.incarnation:
            sender.lost_messages += 1  # on the uplink of a process that crashed meanwhile
            return
        entry = replace(entry, seq=self.log_seq)
        self.log_seq += 1
        if self._keeps_history():
            self.history.append(entry)
        # Who fetches it: the running subscribers of its channel (of a point-to-point one, the
        # recipient alone: it reads its own topic).
        subscribers = [p for p in self.processes if not p.gone and self._reads(p, entry)]
        for process in subscribers:
            process.consumed_bytes[entry.channel] += len(entry.value)
            process.consumed_messages[entry.channel] += 1
        if self.costs.models_downlinks:
            # Every subscriber fetches the record over its own link, in log order; only the
            # addressees hand it to their driver when it has arrived.
            for process in subscribers:
                starts = max(self.now, process.downlink_free_at)
                arrives = starts + self.costs.transfer_s(len(entry.value), process.index, starts)
                process.downlink_free_at = arrives
                if entry.to is None or entry.to == process.name:
                    self.events.push(arrives, _DELIVER, (process, entry))
            return
        recipients = [p for p in subscribers if entry.to is None or entry.to == p.name]
        for worker in recipients:
            if worker.busy:
                worker.pending.append(entry)
            else:
                self._deliver(worker, entry)
        for worker in recipients:
            self._service(worker)

    def _on_deliver(self, worker: _Worker, entry: _LogEntry) -> None:
        """A record that reached one process over its downlink."""
        if worker.gone:
            return
        if worker.busy:
            worker.pending.append(entry)
            return
        self._deliver(worker, entry)
        self._service(worker)

    def _deliver(self, worker: _Worker, entry: _LogEntry) -> None:
        """One log record to an idle process's driver (it decodes and validates for itself),
        with its produce-to-consume transit (for ``strategy.on_arrival``). A record before
        the process's log position was handled already (a restart re-read it): skipped."""
        if entry.seq < worker.next_seq:
            return
        worker.next_seq = entry.seq + 1
        handled = worker.driver.handle(entry.value, entry.to, transit_s=self.now - entry.produced_at)
        if handled.rejection is not None:
            worker.rejected_messages += 1
            return
        self._publish(worker, handled.outbound)

    def _on_sample(self, tick: int) -> None:
        for worker in self.workers:
            worker.depth_samples.append(worker.backlog.waiting)
        self.events.push((tick + 1) * self.config.depth_sample_s, _SAMPLE, tick + 1)

    def _on_eval(self, tick: int) -> bool:
        """Evaluate the job's model; True when the run should stop (TTA known and stop_at_target)."""
        heldout = self.streams.data.heldout
        if self.plan.stages:
            return self._on_eval_stages(tick)
        # Every model as it is at this instant: the spread first, then the evaluations,
        # then what they make the processes do. The job's models are the running workers'
        # (one that has not joined, left or crashed is no part of it; all, if none runs).
        running = [w for w in self.workers if not w.gone] or self.workers
        evaluated = self.evaluated_processes
        # Every model as it is visible now: a step in progress shows its result at its end.
        with _visible_models(self.processes):
            self.consensus_timeline.append(
                (self.now, consensus_distance([w.driver.trainer.get_parameters() for w in running]))
            )
            # The reported accuracy: the held-out test split, which reaches no strategy.
            results = {p.name: p.driver.evaluate(heldout.features, heldout.labels) for p in evaluated}
            version = _visible_version(self.evaluated)
        # What strategies decide from: each running process's score on the validation split,
        # taken by its training thread (after the step in progress, if one is), at its cost.
        if self.streams.data.validation is not None:
            for process in self.processes:
                if process.gone or not process.driver.strategy.uses_validation:
                    continue
                if process.busy:
                    process.score_due = True
                elif not self._score(process):
                    self._service(process)
        if self.config.evaluate_workers:
            for worker in self.workers:
                self.worker_timelines[worker.name].append((self.now, results[worker.name].accuracy))
        if self.evaluated.name in results and self.evaluated_name != "workers":
            job = results[self.evaluated.name]
            accuracy, loss = job.accuracy, job.loss
        else:  # the mean of the running workers' own models
            accuracy = math.fsum(results[w.name].accuracy for w in running) / len(running)
            loss = math.fsum(results[w.name].loss for w in running) / len(running)
        self.timeline.append((self.now, accuracy, version))
        self.loss_timeline.append((self.now, loss))
        return self._after_eval(tick)

    def _after_eval(self, tick: int) -> bool:
        """TTA once known, the next evaluation; True when the run should stop."""
        target = self.config.target_accuracy
        if target is not None and self.tta_s is None:
            self.tta_s = time_to_target([(t, a) for t, a, _ in self.timeline], target, self.config.hold_evals)
        self.events.push((tick + 1) * self.config.eval_every_s, _EVAL, tick + 1)
        return self.tta_s is not None and self.config.stop_at_target and self.now >= self.config.min_time_s

    def _on_eval_stages(self, tick: int) -> bool:
        """A split model's evaluation: its stages put together (``trainers.stages.compose``),
        as ``edgestream run`` evaluates a stage-split job; no stage evaluates alone."""
        heldout = self.streams.data.heldout
        with _visible_models(self.workers):
            result: EvalResult = evaluate(compose([w.driver.trainer.model for w in self.workers]),
                                          heldout.features, heldout.labels)
            version = _visible_version(self.workers[0])
        self.timeline.append((self.now, result.accuracy, version))
        self.loss_timeline.append((self.now, result.loss))
        return self._after_eval(tick)

    # -- the report -----------------------------------------------------------------------

    def _report(self, stopped: str) -> RunReport:
        stats = [w.driver.stats() for w in self.workers]
        global_steps = sum(s["counters"].get("steps", 0) for s in stats)
        compressed = sum(s["counters"].get("compressed_steps", 0) for s in stats)
        server_stats = self.server.driver.stats() if self.server is not None else None
        staleness = [s["staleness"] for s in stats + ([server_stats] if server_stats else [])]
        updates = sum(s["count"] for s in staleness)
        rejected: Counter[str] = Counter()
        for w in self.workers:
            rejected.update(w.rejected_steps)
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
                dead_lettered=w.backlog.dead_lettered,
                prequential_accuracy=w.correct / w.scored if w.scored else 0.0,
                replayed=w.backlog.replayed,
            )
            for w in self.workers
        ]
        prequential = stats[0]["prequential"]
        return RunReport(
            mode=self.mode.name,
            strategy=self.mode.strategy,
            batcher=self.mode.batcher,
            target_accuracy=self.config.target_accuracy,
            tta_s=self.tta_s,
            final_accuracy=self.timeline[-1][1] if self.timeline else 0.0,
            steps=self.evaluated.driver.trainer.version,
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
            rejected_steps=sum(rejected.values()),
            rejected_by_reason=dict(sorted(rejected.items())),
            rejected_messages=sum(w.rejected_messages for w in self.processes),
            prequential_accuracy=float(prequential["accuracy"]),
            prequential_recent_accuracy=float(prequential["window_accuracy"]),
            evaluated=self.evaluated_name,
            max_staleness=max((int(s["max"]) for s in staleness), default=0),
            server=None
            if server_stats is None
            else {
                "counters": dict(sorted(server_stats["counters"].items())),
                "staleness": server_stats["staleness"],
            },
            loss_timeline=list(self.loss_timeline),
            consensus_timeline=list(self.consensus_timeline),
            worker_timelines={name: list(t) for name, t in self.worker_timelines.items()},
            processes=[p.report() for p in self.processes],
            membership=list(self.membership_events),
        )


def _plain(value: Any) -> Any:
    """A JSON-able copy of an observation (mappings to dicts, sequences to lists)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _nearest_rank(values: Sequence[int], q: float) -> int:
    if not values:
        return 0
    ordered = sorted(values)
    return int(ordered[max(1, math.ceil(q * len(ordered))) - 1])


# -- public API ------------------------------------------------------------------------------


def _ensure_registered(name: str) -> None:
    """Import ``trainers.strategies.<name>`` if that strategy is not registered yet."""
    if name in strategies.names():
        return
    try:
        importlib.import_module(f"edgestream.trainers.strategies.{name}")
    except ModuleNotFoundError:
        pass  # strategies.create reports the unknown name with the registered ones


def run(
    mode: Mode, streams: StreamSet, costs: CostModel | None = None, config: RunConfig | None = None
) -> RunReport:
    """Simulate ``mode`` on ``streams`` under ``costs``; deterministic for equal inputs.

    A strategy whose ``trainers.strategies.roles`` include ``server`` runs with one more
    process, the server, whose model is the one evaluated."""
    costs = CostModel() if costs is None else costs
    config = RunConfig() if config is None else config
    _ensure_registered(mode.strategy)
    limit_torch_threads(config.torch_threads)
    return _Simulation(mode, streams, costs, config).run()


def processes(mode: Mode, streams: StreamSet, config: RunConfig | None = None) -> dict[str, TrainingDriver]:
    """The drivers a run of ``mode`` on ``streams`` would start with, by process name (built
    through ``trainers.assembly`` as :func:`run` builds them; nothing is simulated)."""
    config = RunConfig() if config is None else config
    _ensure_registered(mode.strategy)
    simulation = _Simulation(mode, streams, CostModel(), config)
    return {process.name: process.driver for process in simulation.processes}


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
    with_oracle: bool = True,
    heldout_seed: int | None = None,
    on_validation: bool = False,
) -> list[dict[str, Any]]:
    """BENCHMARKS.md's time-to-accuracy comparison on the simulated clock, as JSON-able dicts.

    Digits (held-out 20 %), ``partition`` ("iid", "dirichlet" with alpha 0.3, or
    "classes"), the ten ScaDLES rates (or ``rates``, one per device) times ``scale``,
    :func:`default_modes` (those named in ``modes``; names the runner cannot simulate,
    such as ``ddp``, are skipped) and the oracle first (unless ``with_oracle`` is false). ``costs`` defaults to ``CostModel(slowdowns=slowdown)``.
    ``heldout_seed``: the held-out split's own seed (``fleet_data``; None: ``seed``);
    ``on_validation``: measure on the validation split (a tuning run, ``StreamSet.scored_on_validation``).
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
        heldout_seed=heldout_seed,
    )
    if on_validation:
        streams = streams.scored_on_validation()
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
    for report in compare(wanted, streams, costs, config, with_oracle=with_oracle, oracle_base=base):
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
