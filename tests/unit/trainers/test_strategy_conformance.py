"""Checks every registered sync strategy must pass; a newly registered one gets them automatically.

Each strategy runs with its default parameters on the test bus (``fakes.FakeBus``, real
wire bytes, every process behind a ``TrainingDriver``): three workers of different
speeds and batch sizes, plus a server when the strategy has that role, on a seeded
toy problem (three Gaussian classes in 8 dimensions, a small MLP). Nothing here names
a strategy: what a strategy promises beyond the interface is read from its class
(``replicas_identical``, ``evaluates_model``).
"""

from __future__ import annotations

import ast
import copy
import inspect
import io
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from edgestream.trainers.checkpoint import CheckpointStore
from edgestream.trainers.evaluation import evaluate
from edgestream.trainers.local import LocalTrainer
from edgestream.trainers.messages import UpdateMessage
from edgestream.trainers.models import build_model
from edgestream.trainers.stages import compose, stage_trainer
from edgestream.trainers.strategies import StrategyContext, create, names, roles, stage_split_names
from edgestream.trainers.wire import encode_update
from tests.unit.trainers.fakes import JOB, BatchStream, FakeBus, Node, build_node, drive

NAMES = names()


def _promises_identical_replicas(name: str) -> bool:
    """Read from a worker of the strategy (class attribute ``replicas_identical``)."""
    if name in stage_split_names():
        return False  # each worker holds a different stage: there are no replicas
    probe = LocalTrainer(build_model("mlp", (FEATURES,), CLASSES, 0))
    return create(name, StrategyContext("probe", probe, members=("probe",))).replicas_identical


FEATURES, CLASSES = 8, 3
#: The strategies whose workers promise bitwise-identical replicas (BSP-like).
IDENTICAL = [name for name in NAMES if _promises_identical_replicas(name)]
WORKERS = ("w0", "w1", "w2")
PERIODS = {"w0": 1, "w1": 2, "w2": 3}  # rounds per local step: heterogeneous compute
BATCH_SIZES = {"w0": 8, "w1": 16, "w2": 32}
STEPS = 20  # local steps per worker
MIN_ACCURACY = 0.8  # chance is 1/3
CHECKPOINT_ROUND = 9


# -- the toy problem and the cluster -----------------------------------------------------


@dataclass(frozen=True)
class Toy:
    """Three Gaussian classes in 8-D; worker shards of the training part; a held-out part."""

    shards: dict[str, tuple[np.ndarray, np.ndarray]]
    x_test: np.ndarray
    y_test: np.ndarray


@pytest.fixture(scope="module")
def toy() -> Toy:
    rng = np.random.default_rng(0)
    centers = 2.0 * rng.normal(size=(CLASSES, FEATURES))

    def sample(count: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.integers(0, CLASSES, count)
        features = centers[labels] + rng.normal(size=(count, FEATURES))
        return features.astype(np.float32), labels.astype(np.int64)

    x_train, y_train = sample(600)
    x_test, y_test = sample(300)
    parts = np.array_split(np.arange(len(y_train)), len(WORKERS))
    shards = {w: (x_train[idx], y_train[idx]) for w, idx in zip(WORKERS, parts, strict=True)}
    return Toy(shards, x_test, y_test)


#: Strategies whose workers each hold one stage of a split model (class attribute ``stage_split``):
#: worker i holds stage i of an MLP cut in three; w0 reads every shard (the streams).
SPLIT = set(stage_split_names())
SPLIT_HIDDEN, SPLIT_BOUNDARIES = (16, 16), ("2", "4")


def _trainer(seed: int = 0, strategy: str | None = None, worker: str = WORKERS[0]) -> LocalTrainer:
    if strategy in SPLIT:
        model = build_model("mlp", (FEATURES,), CLASSES, seed=seed, hidden=SPLIT_HIDDEN)
        # One reader of every record, a deeper model: a larger step than the replicas' 0.05.
        return stage_trainer(model, SPLIT_BOUNDARIES, WORKERS.index(worker), (FEATURES,), CLASSES,
                             lr=0.1, momentum=0.9)
    return LocalTrainer(build_model("mlp", (FEATURES,), CLASSES, seed=seed), lr=0.05, momentum=0.5)


def _node(bus: FakeBus | None, name: str, strategy: str, toy: Toy | None, *, seed: int = 0) -> Node:
    """A worker (with its shard) or, named ``server``, the strategy's server."""
    if name == "server":
        return build_node(bus, name, strategy, _trainer(seed), role="server", members=WORKERS)
    batches = None
    if toy is not None and strategy in SPLIT:
        if name == WORKERS[0]:  # the first stage reads every device
            features = np.concatenate([toy.shards[w][0] for w in WORKERS])
            labels = np.concatenate([toy.shards[w][1] for w in WORKERS])
            batches = BatchStream(features, labels, BATCH_SIZES["w2"], seed=0)
    elif toy is not None:
        features, labels = toy.shards[name]
        batches = BatchStream(features, labels, BATCH_SIZES[name], seed=WORKERS.index(name))
    return build_node(bus, name, strategy, _trainer(seed, strategy, name), members=WORKERS, batches=batches)


def _cluster(bus: FakeBus, strategy: str, toy: Toy | None) -> list[Node]:
    servers = ["server"] if "server" in roles(strategy) else []
    return [_node(bus, name, strategy, toy) for name in (*servers, *WORKERS)]


def _run(bus: FakeBus, nodes: list[Node], seed: int, **kwargs: object) -> int:
    return drive(bus, nodes, steps=STEPS, periods=PERIODS, rng=np.random.default_rng(seed), **kwargs)


@dataclass
class Run:
    """A finished run's nodes, and each strategy's ``state_dict()`` as it was midway."""

    nodes: list[Node]
    midway: dict[str, dict]


@pytest.fixture(scope="module")
def clean_run(toy: Toy) -> Callable[[str], Run]:
    """``clean_run(name)``: a run without jitter, duplicates or garbage (cached per strategy;
    tests only read it)."""
    runs: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in runs:
            bus = FakeBus()
            run = Run(_cluster(bus, name, toy), {})

            def keep_state(round_index: int) -> None:
                if round_index == CHECKPOINT_ROUND:
                    run.midway.update({n.name: copy.deepcopy(n.strategy.state_dict()) for n in run.nodes})

            _run(bus, run.nodes, seed=1, on_round=keep_state)
            runs[name] = run
        return runs[name]

    return get


# -- shared assertions ---------------------------------------------------------------------


def _assert_same_tree(left: object, right: object, where: str = "state") -> None:
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor) and torch.equal(left, right), where
    elif isinstance(left, dict):
        assert isinstance(right, dict) and left.keys() == right.keys(), where
        for key in left:
            _assert_same_tree(left[key], right[key], f"{where}[{key!r}]")
    elif isinstance(left, list | tuple):
        assert isinstance(right, list | tuple) and len(left) == len(right), where
        for index, (a, b) in enumerate(zip(left, right, strict=True)):
            _assert_same_tree(a, b, f"{where}[{index}]")
    else:
        assert left == right, f"{where}: {left!r} != {right!r}"


def _assert_converged(nodes: list[Node], toy: Toy) -> None:
    for node in nodes:
        if node.strategy.evaluates_model:
            accuracy = evaluate(node.trainer.model, toy.x_test, toy.y_test).accuracy
            assert accuracy >= MIN_ACCURACY, (node.name, accuracy)
    stages = [n for n in nodes if n.strategy.stage_split]
    if stages:  # the stages assembled in order are the model
        accuracy = evaluate(compose([n.trainer.model for n in stages]), toy.x_test, toy.y_test).accuracy
        assert accuracy >= MIN_ACCURACY, ("stages", accuracy)


def _promised_replicas(nodes: list[Node]) -> list[Node]:
    return [n for n in nodes if n.strategy.replicas_identical]


def _assert_staleness_accounted(node: Node) -> None:
    """Every update the node applied has exactly one staleness record, and the driver
    reported each one: ``Handled.staleness`` holds every value the strategy recorded
    while handling the record (a BSP step applies every member's gradient when the last
    one arrives), and only a record that moved the model records any."""
    split = node.strategy.stage_split
    for receipt in node.receipts:
        assert sorted(receipt.staleness) == list(receipt.recorded), (node.name, receipt)
        if receipt.recorded and not split:  # a stage's true gradient may train its synthesiser only
            assert receipt.version_after > receipt.version_before, (node.name, receipt)
    if split:
        # The updates a stage takes from peers: the true gradients of its activations, one
        # per activation, from the next stage (a queued step may apply it: step_staleness).
        following = WORKERS[WORKERS.index(node.name) + 1:][:1]
        updates = {(r.sender, r.step) for r in node.receipts if r.kind == "activation" and r.sender in following}
    else:
        updates = {(r.sender, r.step) for r in node.receipts if r.kind in ("gradient", "delta")}
    reported = sum(len(r.staleness) for r in node.receipts) + len(node.step_staleness)
    assert node.strategy.staleness.summary()["count"] == len(updates) == reported, node.name


# -- convergence, replicas, staleness, state ---------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_converges_on_a_toy_problem_with_heterogeneous_workers(name, clean_run, toy):
    nodes = clean_run(name).nodes

    assert all(n.steps_trained == STEPS for n in nodes if n.batches is not None)
    _assert_converged(nodes, toy)


@pytest.mark.parametrize("name", IDENTICAL)
def test_replicas_are_identical_where_promised(name, clean_run):
    replicas = _promised_replicas(clean_run(name).nodes)

    assert len(replicas) == len(WORKERS)
    assert len({n.trainer.version for n in replicas}) == 1
    assert len({n.trainer.parameter_digest() for n in replicas}) == 1


@pytest.mark.parametrize("name", NAMES)
def test_staleness_is_recorded_for_every_applied_update(name, clean_run):
    nodes = clean_run(name).nodes

    for node in nodes:
        _assert_staleness_accounted(node)
    assert sum(n.strategy.staleness.summary()["count"] for n in nodes) > 0


@pytest.mark.parametrize("when", ["midway", "end"])
@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trips_into_a_fresh_instance(name, when, clean_run):
    run = clean_run(name)
    for node in run.nodes:
        state = run.midway[node.name] if when == "midway" else node.strategy.state_dict()
        buffer = io.BytesIO()
        torch.save(state, buffer)  # what a checkpoint does: tensors and primitives only
        loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        ctx = StrategyContext(worker_id=node.name, trainer=_trainer(1, name, node.name), role=node.strategy.role,
                              members=WORKERS)
        fresh = create(name, ctx)

        fresh.load_state_dict(loaded)

        _assert_same_tree(fresh.state_dict(), state, f"{node.name}.state_dict()")


# -- delivery: duplicates, reordering, garbage --------------------------------------------------

GARBAGE_ROUNDS = range(0, 24, 4)


@pytest.mark.parametrize("name", NAMES)
def test_duplicates_reordering_and_garbage_leave_the_outcome_unchanged(name, clean_run, toy):
    bus = FakeBus(jitter=2.5, duplicate=True, seed=3)
    nodes = _cluster(bus, name, toy)
    channels = sorted({ch for n in nodes for ch in n.strategy.subscribes})
    for node in nodes:
        node.strict = False
    garbage = np.random.default_rng(4).bytes(64)

    def inject(round_index: int) -> None:
        if round_index in GARBAGE_ROUNDS:
            for channel in channels:
                bus.publish_raw("intruder", channel, garbage, now=float(round_index))

    _run(bus, nodes, seed=5, on_round=inject)

    for node in nodes:
        # Every record lands twice: each garbage record is refused twice, nothing else is.
        assert len(node.rejections) == 2 * len(GARBAGE_ROUNDS) * len(node.strategy.subscribes), node.name
        assert not node.step_rejections
        _assert_staleness_accounted(node)
    _assert_converged(nodes, toy)
    clean = {n.name: n.trainer.parameter_digest() for n in _promised_replicas(clean_run(name).nodes)}
    assert {n.name: n.trainer.parameter_digest() for n in _promised_replicas(nodes)} == clean


# -- checkpoints --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_a_mid_run_checkpoint_continues_exactly_like_the_original(name, toy, tmp_path):
    bus = FakeBus(jitter=1.5, duplicate=True, seed=6)
    nodes = _cluster(bus, name, toy)
    saved: dict[str, str] = {}

    def checkpoint(round_index: int) -> None:
        if round_index == CHECKPOINT_ROUND:
            for node in nodes:
                CheckpointStore(tmp_path / node.name).save(node.trainer, node.strategy, offsets={})
                saved[node.name] = node.trainer.parameter_digest()
                node.journal = []  # the log each node reads from here on

    _run(bus, nodes, seed=7, on_round=checkpoint)

    assert saved, "the run ended before the checkpoint"
    for node in nodes:
        assert node.journal, f"{node.name} did nothing after the checkpoint"
        fresh = _node(None, node.name, name, None, seed=1)
        CheckpointStore(tmp_path / node.name).restore(fresh.trainer, fresh.strategy)
        assert fresh.trainer.parameter_digest() == saved[node.name]

        for index, event in enumerate(node.journal):
            assert event.call(fresh.driver) == event.published, f"{node.name}: call {index} ({event.op})"

        assert fresh.trainer.version == node.trainer.version
        assert fresh.trainer.parameter_digest() == node.trainer.parameter_digest()
        _assert_same_tree(fresh.strategy.state_dict(), node.strategy.state_dict(), node.name)


# -- malformed and non-finite records -----------------------------------------------------------

MARKER = 1.2345  # appears exactly once in a forged record, where the forgery overwrites it


def _update(node: Node, kind: str, *, extra_row: bool = False) -> UpdateMessage:
    """A well-formed update of ``kind`` from ``w1`` that ``node`` would accept."""
    tensors = {n: torch.full_like(p, 1e-3) for n, p in node.trainer.get_parameters().items()}
    first = next(iter(tensors))
    tensors[first].view(-1)[0] = MARKER
    if extra_row:
        tensors[first] = torch.cat([tensors[first], tensors[first][-1:]])
    if kind == "model":  # newer than the node's model: a worker would adopt it
        version = node.trainer.version + 5
        return UpdateMessage(kind="model", sender="w1", step=version, base_version=version, tensors=tensors,
                             buffers=node.trainer.get_buffers())
    return UpdateMessage(kind=kind, sender="w1", step=0, base_version=0, batch_size=8, tensors=tensors)  # type: ignore[arg-type]


def _encoded(msg: UpdateMessage, job: str = JOB) -> bytes:
    return encode_update(msg, job=job)[0]


def _overwrite_marker(value: bytes, number: float) -> bytes:
    packed = struct.pack("<f", MARKER)
    assert value.count(packed) == 1
    return value.replace(packed, struct.pack("<f", number))


Forgery = Callable[[Node], tuple[bytes, bytes]]  # node -> (malformed record, the well-formed one)


def _garbage(node: Node) -> tuple[bytes, bytes]:
    return np.random.default_rng(8).bytes(300), _encoded(_update(node, "gradient"))


def _truncated(node: Node) -> tuple[bytes, bytes]:
    value = _encoded(_update(node, "gradient"))
    return value[: len(value) // 2], value


def _poisoned(kind: str, number: float) -> Forgery:
    def forge(node: Node) -> tuple[bytes, bytes]:
        value = _encoded(_update(node, kind))
        return _overwrite_marker(value, number), value

    return forge


def _wrong_shape(kind: str) -> Forgery:
    def forge(node: Node) -> tuple[bytes, bytes]:
        return _encoded(_update(node, kind, extra_row=True)), _encoded(_update(node, kind))

    return forge


def _wrong_job(node: Node) -> tuple[bytes, bytes]:
    msg = _update(node, "gradient")
    return _encoded(msg, job="other"), _encoded(msg)


MALFORMED: dict[str, tuple[Forgery, set[str]]] = {
    "garbage_bytes": (_garbage, {"truncated", "bad_magic", "too_large"}),
    "truncated": (_truncated, {"truncated"}),
    "wrong_job": (_wrong_job, {"wrong_job"}),
    "nan_gradient": (_poisoned("gradient", math.nan), {"non_finite"}),
    "inf_delta": (_poisoned("delta", math.inf), {"non_finite"}),
    "nan_model": (_poisoned("model", math.nan), {"non_finite"}),
    "wrong_shape_gradient": (_wrong_shape("gradient"), {"shape_mismatch"}),
    "wrong_shape_model": (_wrong_shape("model"), {"shape_mismatch"}),
    "gradient_norm_above_bound": (_poisoned("gradient", 1e6), {"out_of_range"}),
    "delta_norm_above_bound": (_poisoned("delta", 1e6), {"out_of_range"}),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("name", NAMES)
def test_malformed_and_non_finite_records_never_reach_the_model(name, case):
    forge, reasons = MALFORMED[case]
    for node in _cluster(FakeBus(), name, None):
        bad, good = forge(node)
        digest, version = node.trainer.parameter_digest(), node.trainer.version
        state = copy.deepcopy(node.strategy.state_dict())

        handled = node.driver.handle(bad)

        assert handled.rejection is not None and handled.rejection.reason in reasons, (node.name, handled)
        assert handled.outbound == [] and handled.message is None
        assert (node.trainer.parameter_digest(), node.trainer.version) == (digest, version)
        _assert_same_tree(node.strategy.state_dict(), state, f"{node.name}.state_dict()")
        # The same record unharmed passes: the rejection is the forgery's doing.
        assert node.driver.handle(good).rejection is None


# -- no clock, sleep, thread or Kafka inside a strategy ----------------------------------------

FORBIDDEN_MODULES = frozenset({
    "time", "threading", "asyncio", "kafka", "aiokafka", "faust", "confluent_kafka",
    "multiprocessing", "concurrent", "sched", "selectors", "socket", "subprocess",
})
CLOCK_CALLS = frozenset({
    "sleep", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "process_time",
    "time_ns", "now", "utcnow", "today",
})


def forbidden_uses(source: str) -> list[str]:
    """Imports of clock, thread, event-loop or Kafka modules, and clock or sleep calls, in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "time":
            found.append(f"line {node.lineno}: time.{node.attr}")
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if called in CLOCK_CALLS:
                found.append(f"line {node.lineno}: {called}()")
            first = node.args[0] if node.args else None
            if (called in ("__import__", "import_module") and isinstance(first, ast.Constant)
                    and str(first.value).split(".")[0] in FORBIDDEN_MODULES):
                found.append(f"line {node.lineno}: {called}({first.value!r})")
    return found


def _strategy_sources(name: str) -> list[Path]:
    """The module files of every project class a role of ``name`` is built from (its MRO)."""
    files: set[Path] = set()
    for role in roles(name):
        strategy = create(name, StrategyContext(worker_id=WORKERS[0], trainer=_trainer(0, name), role=role,
                                                members=WORKERS))
        for cls in type(strategy).__mro__:
            if cls.__module__.startswith("edgestream.trainers."):
                files.add(Path(inspect.getfile(cls)))
    return sorted(files)


@pytest.mark.parametrize("name", NAMES)
def test_strategy_modules_use_no_clock_sleep_thread_or_kafka(name):
    sources = _strategy_sources(name)

    assert sources
    assert {str(path): forbidden_uses(path.read_text()) for path in sources} == {str(p): [] for p in sources}


@pytest.mark.parametrize(
    "source",
    [
        "import time",
        "import threading as th",
        "from asyncio import sleep",
        "from aiokafka import AIOKafkaProducer",
        "import kafka.errors",
        "import faust",
        "from concurrent.futures import ThreadPoolExecutor",
        "started = time.monotonic()",
        "sleep(0.1)",
        "stamp = datetime.datetime.now()",
        "clock = __import__('time')",
        "clock = importlib.import_module('time')",
    ],
)
def test_the_static_check_flags_clock_sleep_thread_and_kafka_use(source):
    assert forbidden_uses(source)


def test_the_static_check_accepts_time_handed_in():
    source = "def poll(self, now):\n    return now - self.started >= self.period_s\n"

    assert forbidden_uses(source) == []
