"""The training runtime's sync metrics, read back from a served /metrics: every gradient or
delta a worker publishes is one commit of that worker, whether the strategy produced it in a
local step (ASP) or in a timer (ADSP's commits come from ``poll``); the strategy's
observations (``SyncStrategy.observations``) are exported without the runtime naming it.

No broker: the runtime is built as a worker builds it, and its publisher is replaced by a
list (the real-broker path is tests/integration/test_dashboards.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from edgestream.job.config import load_config
from edgestream.job.sources import job_fleet_data
from edgestream.monitoring.metrics import Metrics, serve
from edgestream.monitoring.scrape import scrape
from edgestream.pipeline.training import TrainingRuntime
from edgestream.streams.batching import Batch
from edgestream.streams.records import RecordBatch
from edgestream.trainers.wire import HEADER_KIND

BATCH = 16


@pytest.fixture
def make_runtime(tmp_path):
    """A worker ``w0``'s runtime for ``strategy``, its served metrics URL and what it publishes."""

    def factory(strategy: str, params: str = ""):
        overrides = [f"run.state_dir={tmp_path / 'state'}", "devices.count=2", "workers.count=2",
                     "train.enabled=true", "train.model=mlp", f"train.strategy={strategy}",
                     "train.checkpoint_every_steps=1000"]
        if params:
            overrides.append(f"train.strategy_params={params}")
        cfg = load_config(overrides=overrides, env={})
        metrics = Metrics()
        url = f"http://127.0.0.1:{serve(metrics, 0)}/metrics"
        data = job_fleet_data(cfg)
        runtime = TrainingRuntime(cfg, "w0", data, metrics, tmp_path / "state" / "w0")
        sent: list[tuple[str, str]] = []

        async def publish(channel: str, value: bytes, headers: dict[str, bytes], key: bytes,
                          timestamp: float | None = None) -> None:
            sent.append((channel, headers[HEADER_KIND].decode()))

        async def settle(batch: Batch, state: str, reason: str | None = None) -> None:
            return None

        runtime.publish, runtime.settle = publish, settle
        return runtime, url, sent, data

    yield factory


def _batch(data, start: int) -> Batch:
    x = data.train.features[start:start + BATCH]
    y = data.train.labels[start:start + BATCH].astype(np.int32)
    records = RecordBatch(device="dev00", seq=np.arange(start, start + BATCH, dtype=np.uint64),
                          event_time=np.zeros(BATCH), features=x.astype(np.float32), labels=y)
    return Batch("dev00", records, created_at=0.0)


def _commits(sent: list[tuple[str, str]]) -> int:
    return sum(kind in ("gradient", "delta") for _, kind in sent)


def test_adsp_commits_sent_from_poll_are_counted_and_its_observations_exported(make_runtime):
    runtime, url, sent, data = make_runtime("adsp", "period_s=10,commit_rate=5,min_interval_s=0.5")
    after_start = scrape(url)

    async def scenario() -> None:
        await runtime._send(await runtime._call(runtime.driver.poll, 0.0))  # the commit timer starts
        for commit in range(3):
            for step in range(commit + 2):  # 2, 3, 4 local steps per commit
                runtime.pending.put(_batch(data, BATCH * (3 * commit + step)))
                await runtime._step()
            await runtime._send(await runtime._call(runtime.driver.poll, 2.0 * (commit + 1)))  # the run loop's call
        await runtime._call(runtime._observe)  # what the runtime's 1 s timer does

    asyncio.run(scenario())

    s = scrape(url)
    assert _commits(sent) == 3 and all(ch == "gradients" for ch, kind in sent if kind == "delta")
    assert s.get("edgestream_steps_total", worker="w0") == 9
    assert s.get("edgestream_commits_total", worker="w0") == 3
    assert s.get("edgestream_committed_local_steps_total", worker="w0") == 2 + 3 + 4
    assert s.get("edgestream_target_commits", worker="w0") == 5
    # exported at start (the base of the totals): born at 0, before any step
    assert after_start.get("edgestream_committed_local_steps_total", worker="w0", default=-1) == 0
    assert after_start.get("edgestream_commits_total", worker="w0", default=-1) == 0
    assert s.get("edgestream_blocked_seconds_total", worker="w0", default=-1) == -1  # not ADSP's number


def test_asp_gradients_sent_from_steps_are_one_commit_each(make_runtime):
    runtime, url, sent, data = make_runtime("asp")

    async def scenario() -> None:
        for step in range(4):
            runtime.pending.put(_batch(data, BATCH * step))
            await runtime._step()
        await runtime._call(runtime._observe)

    asyncio.run(scenario())

    s = scrape(url)
    assert _commits(sent) == 4
    assert s.get("edgestream_commits_total", worker="w0") == 4
    names = {x.name for x in s.samples}
    assert "edgestream_target_commits" not in names and "edgestream_committed_local_steps_total" not in names


def test_gossip_observations_are_exported_per_peer_and_per_sketch_index(make_runtime):
    """A gossip worker's own numbers reach /metrics: its mixing row (itself included), its
    iteration statistics, and the sketch of its own model, index by index."""
    from edgestream.trainers.consensus import ModelSketch

    runtime, url, sent, data = make_runtime("gossip", f"batch_size={BATCH}")

    async def scenario() -> None:
        for step in range(4):
            await runtime._send(await runtime._call(runtime.driver.poll, 0.5 * step))
            runtime.pending.put(_batch(data, BATCH * step))
            await runtime._step()
        await runtime._send(await runtime._call(runtime.driver.poll, 2.0))
        await runtime._call(runtime._observe)

    asyncio.run(scenario())

    s = scrape(url)
    strategy = runtime.driver.strategy
    weights = {dict(x.labels)["peer"]: x.value for x in s.samples if x.name == "edgestream_mixing_weight_ratio"}
    assert "w0" in weights and sum(weights.values()) == pytest.approx(1.0)
    assert weights == pytest.approx(strategy.mixing_row())
    sketch = {int(dict(x.labels)["index"]): x.value for x in s.samples if x.name == "edgestream_model_sketch"}
    assert [sketch[i] for i in sorted(sketch)] == pytest.approx(list(ModelSketch(32)(strategy.own_model())))
    assert s.get("edgestream_iteration_seconds", worker="w0") == pytest.approx(0.5)
    assert s.get("edgestream_iteration_cv_ratio", worker="w0") == pytest.approx(0.0)
    assert 0 <= s.get("edgestream_idle_ratio", worker="w0", default=-1) <= 1
    assert s.get("edgestream_steps_total", worker="w0") == 4


def test_background_sends_keep_order_settle_after_publishing_and_checkpoints_wait(tmp_path):
    """A strategy with ``background_sends`` (DLion): its steps do not wait for the uplink, its
    messages leave in order from the sender task, each step's records are settled only after
    its messages are out, a checkpoint waits for the queue, and a failed send fails the loop."""
    cfg = load_config(overrides=[f"run.state_dir={tmp_path / 'state'}", "devices.count=2", "workers.count=2",
                                 "train.enabled=true", "train.model=mlp", "train.strategy=dlion",
                                 f"train.strategy_params=batch_size={BATCH},max_lag=100",
                                 "train.checkpoint_every_steps=1000"], env={})
    data = job_fleet_data(cfg)
    runtime = TrainingRuntime(cfg, "w0", data, Metrics(), tmp_path / "state" / "w0")
    events: list[tuple[str, object]] = []
    gate = asyncio.Event()
    fail = {"now": False}

    async def publish(channel: str, value: bytes, headers: dict[str, bytes], key: bytes,
                      timestamp: float | None = None) -> None:
        await gate.wait()
        if fail["now"]:
            raise ConnectionError("broker gone")
        events.append(("sent", headers[HEADER_KIND].decode()))

    async def settle(batch: Batch, state: str, reason: str | None = None) -> None:
        events.append(("settled", int(batch.records.seq[0])))

    runtime.publish, runtime.settle = publish, settle
    runtime.ensure_topics = None

    async def scenario() -> None:
        for step in range(3):
            runtime.pending.put(_batch(data, BATCH * step))
            await runtime._step()  # returns although nothing could be published yet
        assert events == [] and runtime.stats.steps == 3
        gate.set()
        await runtime._checkpoint()  # waits for the queue
        assert runtime.checkpoints.candidates() and runtime.stats.last_checkpoint_step == 3
        fail["now"] = True
        runtime.pending.put(_batch(data, BATCH * 3))
        await runtime._step()
        with pytest.raises(RuntimeError, match="sending failed"):
            await runtime._flush()

    asyncio.run(scenario())
    assert events == [("sent", "gradient"), ("settled", 0), ("sent", "gradient"), ("settled", BATCH),
                      ("sent", "gradient"), ("settled", 2 * BATCH)]
