"""Test doubles for the trainers suite: an in-process bus of encoded update records, a
fake clock, batch streams, and nodes that are thin adapters of the training driver.

Everything that happens to a model goes through ``trainers.driver.TrainingDriver``,
exactly as in the live runtime: the bus carries ``trainers.wire`` bytes, ``pump``
hands them to ``driver.handle`` and publishes what it answers, ``train_once`` calls
``driver.step`` and publishes. Only bytes and fake time move here.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgestream.trainers import assembly
from edgestream.trainers.driver import Handled, Outbound, Stepped, TrainingDriver
from edgestream.trainers.guard import StepRejection
from edgestream.trainers.local import LocalTrainer
from edgestream.trainers.messages import Outgoing, UpdateMessage
from edgestream.trainers.plan import TrainingPlan
from edgestream.trainers.strategies import SyncStrategy
from edgestream.trainers.validation import TensorSpec
from edgestream.trainers.wire import MessageRejected, decode_update, encode_update

#: The job name of every record on the test bus (the wire format checks it on receipt).
JOB = "test"


class FakeClock:
    """Monotonic time that moves only when a test says so."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@dataclass(frozen=True)
class Record:
    """One record of a channel's log as a consumer reads it: the encoded update
    (``trainers.wire``), who produced it and whom it is addressed to (None: everyone)."""

    seq: int  # publication order on the bus
    channel: str
    sender: str
    to: str | None
    value: bytes


class FakeBus:
    """Stand-in for the job's Kafka topics: one append-only, totally ordered log per channel.

    Like a single-partition topic, each subscriber reads each channel in log order
    from where it subscribed, at its own pace (``limit``); records addressed ``to``
    someone else are read too and dropped by the reader's driver. A record published
    with ``delay`` is in flight until ``now + delay`` and is appended to its log when
    the bus first sees a later time, so the log order is arrival order at the
    "broker". Channels are independent logs; reads interleave them by arrival.

    Perturbations (off by default), within those rules:

    - ``jitter``: every record lands up to ``jitter`` seconds later than asked, but
      never before an earlier record of the same sender on the same channel (one
      producer's records keep their order), so records of different senders overtake
      each other.
    - ``duplicate``: every record lands a second time, up to ``jitter + 1`` seconds
      after the first (at-least-once delivery); the copy may come after later records
      of its sender.
    """

    def __init__(self, *, jitter: float = 0.0, duplicate: bool = False, seed: int = 0) -> None:
        self.jitter = jitter
        self.duplicate = duplicate
        self._rng = random.Random(seed)
        self._logs: dict[str, list[tuple[int, Record]]] = defaultdict(list)  # (arrival, record)
        self._positions: dict[str, dict[str, int]] = {}
        self._specs: dict[str, TensorSpec] = {}
        self._in_flight: list[tuple[float, int, Record]] = []
        self._last_due: dict[tuple[str, str], float] = {}
        self._seq = 0
        self._arrivals = 0
        self.published: Counter[str] = Counter()

    def subscribe(self, name: str, channels: Iterable[str], *, spec: TensorSpec | None = None) -> None:
        """Start reading ``channels`` from their current end (a consumer started now).

        ``spec`` lets :meth:`deliver` decode records for ``name`` (tests that hand
        messages to a strategy themselves); a driver decodes with its own.
        """
        self._positions[name] = {channel: len(self._logs[channel]) for channel in channels}
        if spec is not None:
            self._specs[name] = spec

    def unsubscribe(self, name: str) -> None:
        self._positions.pop(name, None)

    def publish(
        self,
        sender: str,
        outgoing: Iterable[Outbound | Outgoing],
        *,
        now: float = 0.0,
        delay: float = 0.0,
    ) -> None:
        """Send what a driver encoded (``Outbound``), or a strategy's own ``Outgoing``
        (encoded here, dense, as a driver with the dense codec would); with ``delay``
        > 0 it lands in the log at ``now + delay``."""
        for item in outgoing:
            if isinstance(item, Outgoing):
                value, _ = encode_update(item.message, job=JOB, to=item.to)
            else:
                value = item.value
            self.publish_raw(sender, item.channel, value, to=item.to, now=now, delay=delay)

    def publish_raw(
        self,
        sender: str,
        channel: str,
        value: bytes,
        *,
        to: str | None = None,
        now: float = 0.0,
        delay: float = 0.0,
    ) -> None:
        """Put any bytes on ``channel`` (a forged or garbled record, say)."""
        self.published[channel] += 1
        due = now + delay + (self._rng.uniform(0.0, self.jitter) if self.jitter else 0.0)
        key = (sender, channel)
        due = max(due, self._last_due.get(key, -math.inf))
        self._last_due[key] = due
        self._schedule(Record(self._next_seq(), channel, sender, to, value), due, now)
        if self.duplicate:
            copy_due = due + self._rng.uniform(0.0, self.jitter + 1.0)
            self._schedule(Record(self._next_seq(), channel, sender, to, value), copy_due, now)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _schedule(self, record: Record, due: float, now: float) -> None:
        if due > now:
            heapq.heappush(self._in_flight, (due, record.seq, record))
        else:
            self._append(record)

    def _append(self, record: Record) -> None:
        self._arrivals += 1
        self._logs[record.channel].append((self._arrivals, record))

    def land(self, now: float) -> None:
        """Append every in-flight record due by ``now`` to its log, earliest first."""
        while self._in_flight and self._in_flight[0][0] <= now:
            _, _, record = heapq.heappop(self._in_flight)
            self._append(record)

    def fetch(
        self,
        name: str,
        *,
        now: float = math.inf,
        channel: str | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """Next records of ``name``'s channels (all, or one) at time ``now``, in arrival order."""
        self.land(now)
        positions = self._positions.get(name, {})
        channels = [channel] if channel is not None else list(positions)
        fetched: list[Record] = []
        while limit is None or len(fetched) < limit:
            best: tuple[int, str] | None = None
            for ch in channels:
                if ch not in positions:
                    continue
                log, pos = self._logs[ch], positions[ch]
                if pos < len(log) and (best is None or log[pos][0] < best[0]):
                    best = (log[pos][0], ch)
            if best is None:
                break
            ch = best[1]
            fetched.append(self._logs[ch][positions[ch]][1])
            positions[ch] += 1
        return fetched

    def deliver(
        self,
        name: str,
        *,
        now: float = math.inf,
        channel: str | None = None,
        limit: int | None = None,
    ) -> list[UpdateMessage]:
        """Next messages for ``name``, decoded with the spec it subscribed with; records
        addressed to someone else are skipped. For tests that bypass the driver."""
        spec = self._specs.get(name)
        if spec is None:
            raise ValueError(f"deliver decodes with {name}'s TensorSpec: subscribe({name!r}, channels, spec=...)")
        return [
            decode_update(record.value, expected_shapes=spec, max_bytes=16 * 1024 * 1024, job=JOB)
            for record in self.fetch(name, now=now, channel=channel, limit=limit)
            if record.to in (None, name)
        ]

    def backlog(self, name: str) -> int:
        """How many landed records for ``name`` (addressed to it or to all) it has not read yet."""
        positions = self._positions.get(name, {})
        return sum(
            1 for ch, pos in positions.items() for _, record in self._logs[ch][pos:] if record.to in (None, name)
        )

    def in_flight(self) -> int:
        """Records published with a delay that have not landed yet."""
        return len(self._in_flight)


class BatchStream(Iterator[tuple[np.ndarray, np.ndarray]]):
    """Endless seeded mini-batches over one worker's shard, reshuffled each epoch."""

    def __init__(self, features: np.ndarray, labels: np.ndarray, batch_size: int, seed: int) -> None:
        self._features = features
        self._labels = labels
        self._batch_size = batch_size
        self._rng = np.random.default_rng(seed)
        self._order = self._rng.permutation(len(labels))
        self._cursor = 0

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        if self._cursor + self._batch_size > len(self._order):
            self._order = self._rng.permutation(len(self._labels))
            self._cursor = 0
        index = self._order[self._cursor : self._cursor + self._batch_size]
        self._cursor += self._batch_size
        return self._features[index], self._labels[index]


@dataclass(frozen=True)
class Event:
    """One driver call of a node and the encoded values it published (see ``Node.journal``)."""

    op: str  # "handle" | "step" | "poll" | "membership"
    args: tuple[Any, ...]
    published: tuple[bytes, ...]

    def call(self, driver: TrainingDriver) -> tuple[bytes, ...]:
        """Make the same call on ``driver``; return the values it published."""
        if self.op == "handle":
            out = driver.handle(*self.args).outbound
        elif self.op == "step":
            out = driver.step(*self.args).outbound
        elif self.op == "step_queued":
            out = driver.step_queued().outbound
        elif self.op == "poll":
            out = driver.poll(*self.args)
        elif self.op == "membership":
            out = driver.membership(*self.args)
        else:
            raise ValueError(f"unknown driver call {self.op!r}")
        return tuple(item.value for item in out)


@dataclass(frozen=True)
class Receipt:
    """What one accepted update record did to a node: the driver's report (``staleness``)
    and what the node observed (staleness values the strategy recorded, version moves)."""

    kind: str
    sender: str
    step: int
    staleness: tuple[int, ...]
    recorded: tuple[int, ...]
    version_before: int
    version_after: int


@dataclass
class Node:
    """One simulated process: a training driver (trainer + strategy) and, for workers, its data.

    The node is the adapter: it hands its driver what the bus delivered, and a batch
    when the driver allows a step, and keeps what the driver reported. ``strict``: a
    record the driver rejects fails the test (False to feed it garbage on purpose).
    ``journal`` (None: off) records every driver call once set, with what the call
    published: the log a copy restored from a checkpoint taken then must reproduce.
    """

    name: str
    driver: TrainingDriver
    batches: BatchStream | None = None
    strict: bool = True
    steps_trained: int = 0
    rejections: list[MessageRejected] = field(default_factory=list)
    step_rejections: list[StepRejection] = field(default_factory=list)
    receipts: list[Receipt] = field(default_factory=list)
    journal: list[Event] | None = None
    #: Staleness values the driver reported for queued steps (a stage applying a true gradient).
    step_staleness: list[int] = field(default_factory=list)

    @property
    def trainer(self) -> LocalTrainer:
        return self.driver.trainer

    @property
    def strategy(self) -> SyncStrategy:
        return self.driver.strategy

    @property
    def spec(self) -> TensorSpec:
        return self.driver.spec

    def handle(self, record: Record) -> Handled:
        """``driver.handle`` one record; keep its receipt or rejection."""
        histogram = Counter(self.strategy.staleness.state_dict())
        version = self.trainer.version
        handled = self.driver.handle(record.value, record.to)
        self._log("handle", (record.value, record.to), handled.outbound)
        if handled.rejection is not None:
            if self.strict:
                raise AssertionError(f"{self.name} rejected a record from {record.sender}: {handled.rejection}")
            self.rejections.append(handled.rejection)
        elif handled.message is not None:
            added = Counter(self.strategy.staleness.state_dict()) - histogram
            msg = handled.message
            self.receipts.append(Receipt(
                msg.kind, msg.sender, msg.step, handled.staleness,
                tuple(sorted(int(v) for v in added.elements())), version, self.trainer.version,
            ))
        return handled

    def step(self, features: np.ndarray, labels: np.ndarray) -> Stepped:
        """``driver.step`` one batch; count it if accepted."""
        stepped = self.driver.step(features, labels)
        self._log("step", (features, labels), stepped.outbound)
        if stepped.rejection is not None:
            self.step_rejections.append(stepped.rejection)
        else:
            self.steps_trained += 1
        return stepped

    def step_queued(self) -> Stepped:
        """``driver.step_queued``: a step on an input the strategy received (a later stage)."""
        stepped = self.driver.step_queued()
        self._log("step_queued", (), stepped.outbound)
        if stepped.rejection is not None:
            self.step_rejections.append(stepped.rejection)
        self.step_staleness.extend(stepped.staleness)
        return stepped

    def poll(self, now: float) -> list[Outbound]:
        out = self.driver.poll(now)
        self._log("poll", (now,), out)
        return out

    def membership(self, workers: Sequence[str]) -> list[Outbound]:
        out = self.driver.membership(list(workers))
        self._log("membership", (list(workers),), out)
        return out

    def _log(self, op: str, args: tuple[Any, ...], out: list[Outbound]) -> None:
        if self.journal is not None:
            self.journal.append(Event(op, args, tuple(item.value for item in out)))


def build_node(
    bus: FakeBus | None,
    name: str,
    strategy: str,
    trainer: LocalTrainer,
    *,
    role: str = "worker",
    members: tuple[str, ...] = (),
    joining: bool = False,
    batches: BatchStream | None = None,
    codec: str = "dense",
    codec_params: Mapping[str, Any] | None = None,
    **params: Any,
) -> Node:
    """Strategy ``strategy`` on ``trainer`` behind a driver of job ``JOB``; subscribed to
    ``bus`` (unless None) for the channels the strategy reads."""
    plan = TrainingPlan(job=JOB, workers=members or (name,), initial_workers=members, strategy=strategy,
                        strategy_params=params, codec=codec, codec_params=dict(codec_params or {}))
    try:
        driver = assembly.build_driver(plan, name, None, role=role, joining=joining, members=members,
                                       trainer=trainer)
    except assembly.AssemblyError as exc:
        raise (exc.__cause__ or exc) from None  # what the strategy or codec raised, as tests expect
    if bus is not None:
        bus.subscribe(name, driver.strategy.subscribes, spec=driver.spec)
    return Node(name=name, driver=driver, batches=batches)


def pump(
    bus: FakeBus,
    node: Node,
    *,
    now: float = math.inf,
    limit: int | None = None,
    channel: str | None = None,
) -> int:
    """Read ``node``'s next records (at most ``limit``) the way the pipeline does:
    ``driver.handle`` each, publish what it answers. Returns how many were for ``node``."""
    at = 0.0 if math.isinf(now) else now
    handed = 0
    for record in bus.fetch(node.name, now=now, limit=limit, channel=channel):
        handled = node.handle(record)
        if handled.skipped:
            continue
        handed += 1
        bus.publish(node.name, handled.outbound, now=at)
    return handed


def run_queued(bus: FakeBus, node: Node, *, now: float = 0.0, delay: float = 0.0) -> int:
    """Run every step the node's strategy can take on inputs it received (a later stage of a
    split model); publish what they return. Returns how many ran."""
    ran = 0
    while node.driver.queued_steps():
        stepped = node.step_queued()
        ran += 1
        if stepped.rejection is None:
            bus.publish(node.name, stepped.outbound, now=now, delay=delay)
    return ran


def train_once(bus: FakeBus, node: Node, *, now: float = 0.0, delay: float = 0.0) -> bool:
    """Run one local step if the driver allows it; publish what it returns. False if no
    step ran (not allowed, no data, or the step guard rejected the batch)."""
    if node.batches is None or not node.driver.can_train():
        return False
    features, labels = next(node.batches)
    limit = node.driver.batch_limit()
    stepped = node.step(features[:limit], labels[:limit])
    if stepped.rejection is not None:
        return False
    bus.publish(node.name, stepped.outbound, now=now, delay=delay)
    return True


def poll(bus: FakeBus, node: Node, now: float) -> None:
    """Run ``node``'s timers at ``now``; publish what they send."""
    bus.publish(node.name, node.poll(now), now=now)


def drive_ticks(
    bus: FakeBus, server: Node, workers: Sequence[Node], seconds: int, clock: FakeClock,
    compute_ticks: dict[str, int],
) -> None:
    """A server and timer-driven workers (ADSP-like), one tick per second: the server reads
    and polls; each worker polls (its timers may publish), reads, and takes a local step
    when its compute period (``compute_ticks[name]`` seconds) divides the tick. Then every
    process reads what is left."""
    for tick in range(seconds):
        now = clock.now
        pump(bus, server, now=now)
        poll(bus, server, now)
        for worker in workers:
            poll(bus, worker, now)
            pump(bus, worker, now=now)
            if tick % compute_ticks[worker.name] == 0:
                train_once(bus, worker, now=now)
        clock.advance(1.0)
    pump(bus, server)
    for worker in workers:
        pump(bus, worker)


def announce(bus: FakeBus, node: Node, workers: Sequence[str], *, now: float = 0.0) -> None:
    """Tell ``node`` the live workers changed; publish what it answers."""
    bus.publish(node.name, node.membership(workers), now=now)


def drive_bsp(
    bus: FakeBus,
    nodes: list[Node],
    target_version: int,
    *,
    rng: np.random.Generator | None = None,
    on_round: Callable[[int], None] | None = None,
    max_idle_rounds: int = 50,
    max_rounds: int = 100_000,
) -> int:
    """Run BSP workers until every active trainer reaches ``target_version``; return rounds used.

    Each round is one second of fake time: the nodes are visited (in random order
    with ``rng``), each polled, handed a slice of its backlog (1-3 records with
    ``rng``, everything otherwise) and allowed to train. ``max_idle_rounds`` rounds
    in a row in which nobody trains and no model version moves is a deadlock and fails.
    ``on_round(round)`` runs before each round (membership changes, crashes, ...).
    """
    idle = 0
    for round_index in range(max_rounds):
        if on_round is not None:
            on_round(round_index)
        active = [n for n in nodes if n.strategy.active]  # BSP workers (and ScaDLES, built on them)
        if all(n.trainer.version >= target_version for n in active):
            return round_index
        order = list(active) if rng is None else [active[i] for i in rng.permutation(len(active))]
        moved = 0
        for node in order:
            version_before = node.trainer.version
            poll(bus, node, float(round_index))
            pump(bus, node, limit=None if rng is None else int(rng.integers(1, 4)))
            if node.trainer.version < target_version:
                moved += train_once(bus, node)
            moved += node.trainer.version - version_before
        idle = 0 if moved else idle + 1
        if idle >= max_idle_rounds:
            stats = {n.name: n.strategy.stats() for n in nodes}
            raise AssertionError(f"deadlock in round {round_index}: {stats}")
    raise AssertionError(f"no convergence to version {target_version} in {max_rounds} rounds")


def drive_async(
    bus: FakeBus,
    server: Node,
    workers: list[Node],
    compute_ticks: list[int],
    *,
    clock: FakeClock,
    target_updates: int,
    max_ticks: int = 10_000,
) -> int:
    """Run a server and workers of different speeds on a fake clock; return ticks used.

    Worker ``i`` starts a step every ``compute_ticks[i]`` ticks on the model it has
    then, and its gradient lands ``compute_ticks[i]`` ticks later (compute time),
    so slow workers send staler gradients. The server reads and polls every tick.
    """
    for tick in range(max_ticks):
        if server.trainer.version >= target_updates:
            return tick
        now = clock.now
        pump(bus, server, now=now)
        poll(bus, server, now)
        for worker, period in zip(workers, compute_ticks, strict=True):
            if tick % period == 0:
                pump(bus, worker, now=now)
                train_once(bus, worker, now=now, delay=float(period))
        clock.advance(1.0)
    raise AssertionError(f"server reached only version {server.trainer.version} in {max_ticks} ticks")


def drive(
    bus: FakeBus,
    nodes: Sequence[Node],
    *,
    steps: int,
    periods: Mapping[str, int] | None = None,
    rng: np.random.Generator | None = None,
    on_round: Callable[[int], None] | None = None,
    max_idle_rounds: int = 50,
    max_rounds: int = 10_000,
) -> int:
    """Run the nodes of any strategy until every worker (a node with batches) trained
    ``steps`` local steps and the bus is quiet; return the rounds used.

    Round ``r`` is fake time ``r`` seconds. The nodes are visited (in random order
    with ``rng``); each is polled, reads its landed records (1-3 with ``rng``, all
    otherwise) and, if it is a worker whose period (``periods``, default 1) divides
    ``r`` and it has steps left, trains when its driver allows it; its update lands
    one period later (compute time), so slow workers send staler updates. Quiet:
    nothing in flight and nobody has unread records. ``max_idle_rounds`` rounds in a
    row without a step, a read or a version move is a deadlock and fails.
    ``on_round(r)`` runs before round ``r`` (checkpoints, injected records, ...).
    """
    periods = periods or {}
    workers = [n for n in nodes if n.batches is not None]
    idle = 0
    for round_index in range(max_rounds):
        if on_round is not None:
            on_round(round_index)
        if (
            all(n.steps_trained >= steps for n in workers)
            and bus.in_flight() == 0
            and all(bus.backlog(n.name) == 0 and n.driver.queued_steps() == 0 for n in nodes)
        ):
            return round_index
        now = float(round_index)
        order = list(nodes) if rng is None else [nodes[i] for i in rng.permutation(len(nodes))]
        moved = 0
        for node in order:
            version_before = node.trainer.version
            poll(bus, node, now)
            moved += pump(bus, node, now=now, limit=None if rng is None else int(rng.integers(1, 4)))
            period = periods.get(node.name, 1)
            if round_index % period == 0:
                moved += run_queued(bus, node, now=now, delay=float(period))
            if node.steps_trained < steps and round_index % period == 0:
                moved += train_once(bus, node, now=now, delay=float(period))
            moved += node.trainer.version != version_before
        idle = 0 if moved else idle + 1
        if idle >= max_idle_rounds:
            stats = {n.name: n.strategy.stats() for n in nodes}
            raise AssertionError(f"deadlock in round {round_index}: {stats}")
    raise AssertionError(f"not quiet after {max_rounds} rounds")

