"""A stream without a declared range (``data.value_range=none``), bad values on one device,
on the real broker: only that device's bad records are dead-lettered, named by device and
reason; every other record of every device is trained and the accounting balances.

Two layers: the culprit search of a refused step (records that make the step unsound),
and the per-feature bounds learned from the stream (records far outside its observed
scale, which need not make a step unsound at all).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from edgestream.job.sources import job_fleet_data
from edgestream.pipeline.run import RunContext, run_job
from edgestream.streams import codec, topics
from edgestream.streams.records import RecordBatch
from edgestream.trainers.guard import REASONS as STEP_REASONS
from edgestream.trainers.observed import REASON as OUTSIDE
from edgestream.trainers.observed import ObservedRange
from tests.integration.jobs import (
    newest_checkpoint,
    quiet,
    show,
    steps_of,
    train_job,
    wait_until,
    workers_of,
)
from tests.integration.test_bad_input import dead_letters

pytestmark = pytest.mark.integration

#: Six devices, two per worker, windows of 1/16 s: each step mixes a worker's two devices.
SIX_DEVICES = ("devices.count=6", "devices.rates_hz=240,240,160,160,120,120", "batcher.window_s=0.0625")


def six_device_job(unique: str, state_dir, *overrides: str):
    ids = ",".join(f"{letter}{unique}" for letter in "abcdef")
    return train_job(unique, state_dir, "train.strategy=bsp", "train.target_accuracy=0.92", "data.value_range=none",
                     f"devices.ids={ids}", *SIX_DEVICES, *overrides)


def message(cfg, device: str, n: int, seed: int, bad: dict[int, float]) -> RecordBatch:
    """``n`` of the job's own records as ``device`` would send them (fresh sequence numbers,
    event times of now), record ``i`` of ``bad`` with every feature multiplied by ``bad[i]``
    (or set to it, for a scale above 1e30)."""
    data = job_fleet_data(cfg)
    rng = np.random.default_rng(seed)
    rows = rng.choice(len(data.train), n, replace=False)
    features = data.train.features[rows].copy()
    for i, scale in bad.items():
        features[i] = scale if scale > 1e30 else features[i] * scale + scale * (features[i] == 0)
    first = 10**9 + 1000 * seed
    return RecordBatch(device=device, seq=np.arange(first, first + n, dtype=np.uint64),
                       event_time=np.full(n, time.time()), features=features,
                       labels=data.train.labels[rows].astype(np.int32))


def assert_only_culprits_dead(result, cfg, bad_device: str, expected: range, reasons: set[str]) -> None:
    assert result.balanced, result.accounting
    bad = result.accounting[bad_device]
    assert bad["dead_records"] in expected, bad
    assert set(bad["dead_records_by_reason"]) <= reasons, bad
    for device in cfg.devices.device_ids():
        if device != bad_device:  # innocent: every record trained, none dead-lettered
            assert result.accounting[device]["dead_records"] == 0, (device, result.accounting[device])
    trained = workers_of(result)
    assert len({t["digest"] for t in trained.values()}) == 1  # replicas still identical
    assert min(t["accuracy"] for t in trained.values()) >= 0.88  # the target holds on the validation split; held-out lands within a few points


def test_a_refused_step_dead_letters_only_the_records_that_make_it_unsound(kafka_bootstrap, unique, state_dir):
    # The learned bounds are off: the guard's culprit search alone must find the records.
    cfg = six_device_job(unique, state_dir, "data.observed_warmup=0")
    bad_device, neighbour = cfg.devices_of("w0")
    assert neighbour  # w0's steps mix the bad device's records with an innocent one's
    poisoned = {3: 1e38, 17: 1e38}  # every feature at 1e38: the loss overflows

    def inject(ctx: RunContext) -> None:
        wait_until(lambda: steps_of(ctx, "w0") >= 5, 60, "w0 to train")
        values = [codec.encode(message(cfg, bad_device, 32, seed, poisoned)) for seed in range(3)]
        ctx.inject(bad_device, values, records=3 * 32)

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=inject)
    show(result)

    w0 = workers_of(result)["w0"]
    assert w0["rejected_steps"] >= 1 and set(w0["rejected_by_reason"]) <= set(STEP_REASONS)
    # A poisoned record alone need not be unsound (its class may win outright: loss 0, gradient
    # 0); such a one is trained, harmlessly. Every dead-lettered record is a poisoned one.
    dead = w0["dead_lettered_records"]
    assert_only_culprits_dead(result, cfg, bad_device, range(1, 7), set(STEP_REASONS))
    assert result.accounting[bad_device]["dead_records"] == dead
    letters = dead_letters(kafka_bootstrap, bad_device)
    assert sum(int(h[topics.DLQ_HEADER_RECORDS]) for h, _ in letters) == dead
    for headers, value in letters:  # each letter names the device's topic, the reason and the worker
        assert headers[topics.DLQ_HEADER_TOPIC] == topics.sensor_topic(bad_device)
        assert headers[topics.DLQ_HEADER_REASON] in STEP_REASONS and headers[topics.DLQ_HEADER_WORKER] == "w0"
        assert (codec.decode(value).features.min(axis=1) == np.float32(1e38)).all()  # culprits only
    assert dead_letters(kafka_bootstrap, neighbour) == []


def test_records_far_outside_the_observed_range_are_refused_before_the_step(kafka_bootstrap, unique, state_dir):
    cfg = six_device_job(unique, state_dir)
    bad_device = cfg.devices_of("w1")[0]
    scales = [300.0, 1000.0, 3000.0, 10_000.0, 30_000.0, 100_000.0]

    def inject(ctx: RunContext) -> None:
        # past the warm-up (512 records): about 40 records a step on w1
        wait_until(lambda: steps_of(ctx, "w1") >= 30, 90, "w1 to learn the stream's range")
        values = [codec.encode(message(cfg, bad_device, 32, seed, {i: scales[(i + seed) % 6] for i in range(0, 24, 4)}))
                  for seed in range(6)]
        ctx.inject(bad_device, values, records=6 * 32)

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=inject)
    show(result)

    assert_only_culprits_dead(result, cfg, bad_device, range(36, 37), {OUTSIDE})
    assert all(t["rejected_steps"] == 0 for t in workers_of(result).values())  # caught before any step
    letters = dead_letters(kafka_bootstrap, bad_device)
    assert {h[topics.DLQ_HEADER_REASON] for h, _ in letters} == {OUTSIDE}
    assert sum(int(h[topics.DLQ_HEADER_RECORDS]) for h, _ in letters) == 36
    assert all((codec.decode(v).features.max(axis=1) >= 300).all() for _, v in letters)
    # The bounds are in the worker's checkpoint: a restart starts from them, not from scratch.
    checkpoint = newest_checkpoint(state_dir, "w1")
    restored = ObservedRange(cfg.data.value_margin, cfg.data.observed_warmup)
    restored.load_state_dict(checkpoint.meta["observed_range"])
    assert restored.active and restored.observed >= cfg.data.observed_warmup
    assert restored.outside(codec.decode(letters[0][1]).features).all()
