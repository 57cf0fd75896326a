"""A device faster than its worker batches, on the real broker: reported as a backlog
(metric during the run, summary at the end), not as balanced; a moderately fast one is
kept up with by the widened window batch."""

from __future__ import annotations

import pytest

from edgestream.monitoring.scrape import scrape
from edgestream.pipeline.run import RunContext, balance_status, run_job
from tests.integration.jobs import quiet, show, train_job, wait_until

pytestmark = pytest.mark.integration

WINDOW_S, MAX_BATCH, WIDEN = 0.25, 8, 64  # 32 records/s per device, widened up to 256/s


def test_runaway_device_is_reported_pending_and_a_moderate_one_is_kept_up_with(kafka_bootstrap, unique,
                                                                               state_dir):
    # w0 reads the runaway device (600/s, above even the widened 256/s), w1 the moderate
    # one (120/s: above the plain 32/s, within the widened cap). BSP: once the streams end,
    # w1 has nothing left and the runaway device's backlog stays pending.
    runaway, moderate = f"fast{unique}", f"mod{unique}"
    cfg = train_job(unique, state_dir, f"devices.ids={runaway},{moderate}", "devices.count=2",
                    "devices.rates_hz=600,120", "workers.count=2", "train.strategy=bsp",
                    f"batcher.window_s={WINDOW_S}", f"batcher.max_batch={MAX_BATCH}",
                    f"batcher.max_batch_widen={WIDEN}", "run.duration_s=8")
    seen = {"backlog": 0.0, "moderate_cap": 0.0}

    def watch(ctx: RunContext) -> None:
        def sample() -> bool:
            s0, s1 = (scrape(ctx.worker(w).metrics_url) for w in ("w0", "w1"))
            if s0 is not None:
                seen["backlog"] = max(seen["backlog"], s0.get("edgestream_device_backlog_records", device=runaway))
            if s1 is not None:
                seen["moderate_cap"] = max(seen["moderate_cap"],
                                           s1.get("edgestream_batch_cap_records", device=moderate))
            return seen["backlog"] > 0 and seen["moderate_cap"] > MAX_BATCH

        wait_until(lambda: sample() or ctx.stop.is_set(), 60, "the runaway device's backlog metric")

    result = run_job(cfg, kafka_bootstrap, console=quiet(), live=False, on_streaming=watch)
    show(result)

    # During the run: the worker exported the runaway device's backlog, and widened the
    # moderate device's window batch.
    assert seen["backlog"] > 0
    assert seen["moderate_cap"] > MAX_BATCH
    # At the end: the rows still add up (nothing lost) ...
    assert result.balanced
    fast, mod = result.accounting[runaway], result.accounting[moderate]
    # ... but the runaway device is reported as behind, with its figure, not as balanced.
    pending = fast["buffered"] + fast["in_sink"]
    assert pending > WIDEN and result.backlog == {runaway: pending - WIDEN}
    status = balance_status(result.produced[runaway], result.garbage[runaway], fast)
    assert status == f"[yellow]pending {pending} (rate above capacity: batcher {WIDEN / WINDOW_S:.0f}/s)[/yellow]"
    # The moderate device arrived faster than an unwidened window takes, and was kept up with.
    assert result.produced[moderate] / cfg.run.duration_s > 1.5 * MAX_BATCH / WINDOW_S
    assert mod["buffered"] + mod["in_sink"] <= WIDEN and moderate not in result.backlog
    assert balance_status(result.produced[moderate], result.garbage[moderate], mod) == "yes"
