"""DLion on the real broker in the edge testbed (root): three workers, each on its own host.

One run: the workers train with ``dlion`` (per-link prioritised exchange, weighted batching,
knowledge transfer) on label-skewed digits; once each took some steps, ``w2``'s host link
is degraded from unshaped to 1 Mbit/s (``Testbed.fault("w2", "degrade", ...)``). The share
of the gradient every link to and from ``w2`` carries (``edgestream_link_ratio``, scraped
from each worker) must drop within a bounded number of ``w2``'s iterations, while the link
between the two others stays whole. Then ``w1`` is killed (SIGKILL); the supervisor
restarts it from its checkpoint; it asks a peer for its model, adopts it, and trains again.
The run must learn and account for every record.

Part of ``make chaos``, not ``make test``: the shaped links and the 4 s membership timeout
are sensitive to whatever else runs on the machine (beside another test file, the workers'
heartbeats timed out and the run never reached its first sample in 3 of 6 full runs).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from edgestream.deploy.testbed.links import parse_link
from edgestream.monitoring.scrape import scrape
from edgestream.pipeline.run import RunContext, run_job
from edgestream.pipeline.testbed_run import open_testbed
from tests.integration.jobs import quiet, show, train_job, wait_until, workers_of

pytestmark = pytest.mark.integration

WORKERS = ("w0", "w1", "w2")
SLOW = "w2"
#: Links whose share must drop once SLOW's host is degraded, and the one that must not.
SLOW_LINKS = (("w0", "w2"), ("w1", "w2"), ("w2", "w0"), ("w2", "w1"))
FAST_LINK = ("w0", "w1")
#: Iterations of the degraded worker within which the per-link shares must follow the new
#: link (seen on this 2-core machine: 10-66, depending on the load). The bound is counted on
#: the worker, not in wall time: a loaded machine slows the iterations, not the estimate.
FOLLOW_ITERATIONS = 120
#: Seconds without a single iteration of the degraded worker before the wait gives up.
STALL_S = 60
#: The share a degraded link must fall to (from 1.0). A link's share is what fits
#: ``0.9 x bandwidth x compute time``: 3-24 % of the gradient at 1 Mbit/s with this model on
#: an idle machine, more when the load stretches every iteration; half still shows the
#: exchange followed the link.
FOLLOWED_SHARE = 0.5

DLION_JOB = (
    "train.strategy=dlion",
    "train.strategy_params=batch_size=32,min_batch=8,max_batch=128,transfer_every=10",
    "train.max_step_batch=128",
    "train.momentum=0.5",
    "train.heartbeat_s=0.5",
    "train.member_timeout_s=4",
    "data.partition=dirichlet",
    "run.duration_s=400",  # a cap: the hook ends streaming once every event happened
    "run.drain_timeout_s=60",
    "run.restart_backoff_s=0.5",
    "testbed.enabled=true",
    "testbed.brokers=1",
)


def _sample(ctx: RunContext) -> dict:
    row: dict = {"t": time.monotonic()}
    for name in WORKERS:
        w = ctx.worker(name)
        s = scrape(w.metrics_url, timeout_s=1.0) if w.metrics_url else None
        row[name] = None if s is None else {
            "steps": int(s.get("edgestream_steps_total", worker=name)),
            "ratio": {peer: s.get("edgestream_link_ratio", -1.0, worker=name, peer=peer)
                      for peer in WORKERS if peer != name},
            "bandwidth": {peer: s.get("edgestream_link_bandwidth_bytes_per_second", -1.0, worker=name, peer=peer)
                          for peer in WORKERS if peer != name},
        }
    return row


def _ratio(row: dict, link: tuple[str, str]) -> float:
    sender, peer = link
    return -1.0 if row[sender] is None else row[sender]["ratio"][peer]


def wait_within_iterations(sample, holds, start: int, what: str) -> dict:
    """Sample until ``holds(row)``; fail once ``SLOW`` took ``FOLLOW_ITERATIONS`` steps since
    ``start`` without it, or took none for ``STALL_S`` seconds."""
    last_steps, last_progress = start, time.monotonic()
    while True:
        row = sample()
        if holds(row):
            return row
        steps = row[SLOW]["steps"] if row[SLOW] is not None else last_steps
        if steps > last_steps:
            last_steps, last_progress = steps, time.monotonic()
        if steps - start > FOLLOW_ITERATIONS:
            raise AssertionError(f"{SLOW} took {steps - start} iterations without {what}; last sample: {row}")
        if time.monotonic() - last_progress > STALL_S:
            raise AssertionError(f"{SLOW} took no iteration for {STALL_S} s while waiting for {what}; "
                                 f"last sample: {row}")
        time.sleep(0.2)  # poll interval of a bounded wait


def degrade_then_kill(ctx: RunContext, seen: dict) -> None:
    timeline: list[dict] = []
    seen["timeline"] = timeline

    def sample() -> dict:
        timeline.append(_sample(ctx))
        return timeline[-1]

    def reported(row: dict) -> bool:
        return all(row[n] is not None and row[n]["steps"] >= 15 for n in WORKERS) and all(
            _ratio(row, link) >= 0 for link in (*SLOW_LINKS, FAST_LINK))

    def undegraded(row: dict) -> bool:
        # Before the degradation the slow links carry most of their gradient. Under load (a
        # test file on the other core) the bandwidth estimates can dip for a while: wait for
        # them rather than degrade a link that already looks degraded.
        shares = [_ratio(row, link) for link in SLOW_LINKS]
        return reported(row) and sum(shares) / len(shares) > 0.5

    def ready() -> dict | None:
        row = sample()
        return row if undegraded(row) else None

    try:
        before = wait_until(ready, 180, "every worker to take 15 steps and its links to carry most of their gradient")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last sample: {timeline[-1] if timeline else None}") from None
    seen["before"] = {f"{a}->{b}": _ratio(before, (a, b)) for a, b in (*SLOW_LINKS, FAST_LINK)}
    ctx.testbed.fault(SLOW, "degrade", parse_link("1mbit"))
    degraded_at = before[SLOW]["steps"]
    degraded_t = time.monotonic()

    def followed(row: dict) -> bool:
        # The slow links dropped while the fast pair carries most of its gradient, in one
        # sample (under load the fast link's estimate can dip for a while too: wait for it).
        return (all(0 <= _ratio(row, link) <= FOLLOWED_SHARE for link in SLOW_LINKS)
                and _ratio(row, FAST_LINK) > 0.5)

    after = wait_within_iterations(sample, followed, degraded_at,
                                   f"the shares of {SLOW}'s links to drop to {FOLLOWED_SHARE} while "
                                   f"{FAST_LINK[0]}->{FAST_LINK[1]} keeps most of its gradient")
    seen["followed_after_s"] = round(time.monotonic() - degraded_t, 1)
    seen["after"] = {f"{a}->{b}": _ratio(after, (a, b)) for a, b in (*SLOW_LINKS, FAST_LINK)}
    seen["followed_after_iterations"] = after[SLOW]["steps"] - degraded_at
    # The fast pair keeps most of its gradient (in the sample where the slow links dropped).
    seen["fast_link_after"] = _ratio(after, FAST_LINK)

    ctx.kill("w1")
    def trains_again() -> bool:
        row = sample()
        return row["w1"] is not None and row["w1"]["steps"] >= 5

    wait_until(trains_again, 90, "w1 to be restarted and to train 5 steps")
    ctx.stop_streaming()


def test_dlion_in_the_testbed_follows_a_degraded_link_survives_a_kill_and_balances(unique, state_dir):
    subnet = f"10.78.{2 * random.randrange(10, 120)}.0/24"  # its own block, beside other testbeds
    cfg = train_job(unique, state_dir, *DLION_JOB, f"testbed.subnet={subnet}")
    seen: dict = {}
    with open_testbed(cfg, console=quiet()) as session:
        result = run_job(cfg, session.bootstrap, console=quiet(), live=False, testbed=session.testbed,
                         on_streaming=lambda ctx: degrade_then_kill(ctx, seen))
    show(result)
    evidence = {k: v for k, v in seen.items() if k != "timeline"}
    print("dlion evidence:", json.dumps(evidence))
    if os.environ.get("EDGESTREAM_EVIDENCE_DIR"):
        out = Path(os.environ["EDGESTREAM_EVIDENCE_DIR"]) / "dlion_testbed.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        t0 = seen["timeline"][0]["t"] if seen.get("timeline") else 0.0
        out.write_text(json.dumps({**evidence, "timeline": [{**r, "t": round(r["t"] - t0, 2)}
                                                            for r in seen.get("timeline", [])]}, indent=1))

    assert result.balanced
    assert [d["process"] for d in result.deaths] == ["w1"] and result.restarted == ["w1"]
    # The shares followed the degraded link within a bounded number of iterations (before
    # it, a link may dip for a moment when its window fills under the machine's load).
    slow_before = [seen["before"][f"{a}->{b}"] for a, b in SLOW_LINKS]
    assert sum(slow_before) / len(slow_before) > 0.5, seen["before"]
    assert seen["fast_link_after"] > 0.5, seen
    trained = workers_of(result)
    stats = {name: t["strategy_stats"] for name, t in trained.items()}
    # The restarted worker adopted a peer's model (hello -> adopt) and trained on.
    assert stats["w1"]["counters"].get("adopted_models", 0) >= 1, stats["w1"]["counters"]
    assert stats["w1"]["incarnation"] >= 1
    # It learned, on label-skewed streams (chance is 0.1): the degraded node gets little of
    # its peers' gradients and trails (knowledge transfer pulls it back every 10 iterations).
    accuracies = [t["accuracy"] for t in trained.values()]
    assert min(accuracies) >= 0.2 and sum(accuracies) / len(accuracies) >= 0.5, accuracies
