"""Test doubles for the trainers suite: an in-process message bus, a fake clock, batch streams."""

from __future__ import annotations

import heapq
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from trainers.local import LocalTrainer
from trainers.messages import Outgoing, UpdateMessage
from trainers.strategies.base import SyncStrategy
from trainers.validation import TensorSpec, validate_update


class FakeClock:
    """Monotonic time that moves only when a test says so."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@dataclass(frozen=True)
class _Envelope:
    seq: int
    channel: str
    to: str | None
    message: UpdateMessage


class FakeBus:
    """Stand-in for the job's Kafka topics: one append-only, totally ordered log per channel.

    Like a single-partition topic, each subscriber reads each channel in log order
    from where it subscribed, at its own pace (``limit``). A message published with
    ``delay`` is in flight until ``now + delay`` and is appended to its log when the
    bus first sees a later time, so the log order is arrival order at the "broker".
    Channels are independent logs; ``deliver`` interleaves them by arrival. Messages
    addressed ``to`` a worker are delivered to that worker only.
    """

    def __init__(self) -> None:
        self._logs: dict[str, list[_Envelope]] = defaultdict(list)
        self._positions: dict[str, dict[str, int]] = {}
        self._in_flight: list[tuple[float, int, _Envelope]] = []
        self._seq = 0
        self.published: Counter[str] = Counter()

    def subscribe(self, name: str, channels: Iterable[str]) -> None:
        """Start reading ``channels`` from their current end (a consumer started now)."""
        self._positions[name] = {channel: len(self._logs[channel]) for channel in channels}

    def unsubscribe(self, name: str) -> None:
        self._positions.pop(name, None)

    def publish(
        self, sender: str, outgoing: Iterable[Outgoing], *, now: float = 0.0, delay: float = 0.0
    ) -> None:
        """Send ``outgoing``; with ``delay`` > 0 it lands in the log at ``now + delay``."""
        for item in outgoing:
            self._seq += 1
            envelope = _Envelope(self._seq, item.channel, item.to, item.message)
            self.published[item.channel] += 1
            if delay > 0:
                heapq.heappush(self._in_flight, (now + delay, self._seq, envelope))
            else:
                self._logs[item.channel].append(envelope)

    def land(self, now: float) -> None:
        """Append every in-flight message due by ``now`` to its log, earliest first."""
        while self._in_flight and self._in_flight[0][0] <= now:
            _, _, envelope = heapq.heappop(self._in_flight)
            self._logs[envelope.channel].append(envelope)

    def deliver(
        self,
        name: str,
        *,
        now: float = math.inf,
        channel: str | None = None,
        limit: int | None = None,
    ) -> list[UpdateMessage]:
        """Next messages for ``name`` (all its channels, or one) at time ``now``, in arrival order."""
        self.land(now)
        positions = self._positions.get(name, {})
        channels = [channel] if channel is not None else list(positions)
        delivered: list[UpdateMessage] = []
        while limit is None or len(delivered) < limit:
            best: _Envelope | None = None
            for ch in channels:
                if ch not in positions:
                    continue
                log, pos = self._logs[ch], positions[ch]
                while pos < len(log) and log[pos].to not in (None, name):
                    pos += 1  # addressed to someone else: the pipeline filters these out
                positions[ch] = pos
                if pos < len(log) and (best is None or log[pos].seq < best.seq):
                    best = log[pos]
            if best is None:
                break
            positions[best.channel] += 1
            delivered.append(best.message)
        return delivered

    def backlog(self, name: str) -> int:
        """How many landed messages ``name`` has not read yet."""
        positions = self._positions.get(name, {})
        return sum(
            1 for ch, pos in positions.items() for env in self._logs[ch][pos:] if env.to in (None, name)
        )

    def in_flight(self) -> int:
        """Messages published with a delay that have not landed yet."""
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


@dataclass
class Node:
    """One simulated process: its trainer, strategy and (for workers) its data."""

    name: str
    trainer: LocalTrainer
    strategy: SyncStrategy
    batches: BatchStream | None = None
    spec: TensorSpec = field(init=False)
    steps_trained: int = 0

    def __post_init__(self) -> None:
        self.spec = TensorSpec.from_trainer(self.trainer)


def pump(
    bus: FakeBus,
    node: Node,
    *,
    now: float = math.inf,
    limit: int | None = None,
    channel: str | None = None,
) -> int:
    """Deliver readable messages to ``node`` the way the pipeline will: validate, hand over, publish."""
    messages = bus.deliver(node.name, now=now, limit=limit, channel=channel)
    for msg in messages:
        validate_update(msg, node.spec)
        bus.publish(node.name, node.strategy.on_message(msg), now=0.0 if math.isinf(now) else now)
    return len(messages)


def train_once(bus: FakeBus, node: Node, *, now: float = 0.0, delay: float = 0.0) -> bool:
    """Run one local step if the strategy allows it; publish what it returns."""
    if node.batches is None or not node.strategy.can_train():
        return False
    features, labels = next(node.batches)
    result = node.trainer.compute_gradient(features, labels)
    bus.publish(node.name, node.strategy.on_local_step(result), now=now, delay=delay)
    node.steps_trained += 1
    return True


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
    with ``rng``), each polled, handed a slice of its backlog (1-3 messages with
    ``rng``, everything otherwise) and allowed to train. ``max_idle_rounds`` rounds
    in a row in which nobody trains and no model version moves is a deadlock and fails.
    ``on_round(round)`` runs before each round (membership changes, crashes, ...).
    """
    idle = 0
    for round_index in range(max_rounds):
        if on_round is not None:
            on_round(round_index)
        active = [n for n in nodes if getattr(n.strategy, "active", True)]
        if all(n.trainer.version >= target_version for n in active):
            return round_index
        order = list(active) if rng is None else [active[i] for i in rng.permutation(len(active))]
        moved = 0
        for node in order:
            version_before = node.trainer.version
            bus.publish(node.name, node.strategy.poll(float(round_index)))
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
        bus.publish(server.name, server.strategy.poll(now), now=now)
        for worker, period in zip(workers, compute_ticks, strict=True):
            if tick % period == 0:
                pump(bus, worker, now=now)
                train_once(bus, worker, now=now, delay=float(period))
        clock.advance(1.0)
    raise AssertionError(f"server reached only version {server.trainer.version} in {max_ticks} ticks")
