"""The run summary's balanced / backlog logic and the live view's backlog column."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from edgestream.job.config import load_config
from edgestream.pipeline.run import (
    NOTHING_READ,
    RunResult,
    backlog_of,
    balance_status,
    ended_as,
    render,
    summary_table,
)


def row(*, produced: int, trained: int, buffered: int = 0, in_sink: int = 0, window: int = 64,
        capacity_hz: float | None = 128.0) -> dict:
    """A worker's accounting of one device (``IngestCore.accounting()``), as ``run`` reads it."""
    return {**NOTHING_READ, "records_in": produced, "consumed": trained, "buffered": buffered,
            "in_sink": in_sink, "pending": buffered + in_sink, "window_records": window,
            "capacity_hz": capacity_hz, "running": True}


def text(renderable) -> str:
    console = Console(file=io.StringIO(), width=400, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


@pytest.mark.parametrize(("buffered", "in_sink", "expected"), [
    (0, 0, 0), (40, 24, 0), (60, 20, 16), (14_000, 386, 14_386 - 64),
])
def test_backlog_is_what_is_pending_beyond_one_window(buffered, in_sink, expected):
    a = row(produced=20_000, trained=20_000 - buffered - in_sink, buffered=buffered, in_sink=in_sink)
    assert backlog_of(a) == expected


def test_balanced_only_when_nothing_is_pending_beyond_one_window():
    kept_up = row(produced=1000, trained=950, buffered=50)
    runaway = row(produced=21_863, trained=7477, buffered=14_386)
    behind_trainer = row(produced=2487, trained=2062, buffered=51, in_sink=374)  # batches wait for steps
    lost = row(produced=1000, trained=900)  # 100 records unaccounted for

    assert balance_status(1000, 0, kept_up) == "yes"
    status = balance_status(21_863, 0, runaway)
    assert status == "[yellow]pending 14386 (rate above capacity: batcher 128/s)[/yellow]"
    assert balance_status(2487, 0, behind_trainer) == (
        "[yellow]pending 425 (rate above capacity: its worker's training)[/yellow]")
    assert "NO" in balance_status(1000, 0, lost)


def test_run_result_lists_the_devices_that_fell_behind():
    accounting = {"fast": row(produced=21_863, trained=7477, buffered=14_386),
                  "slow": row(produced=900, trained=880, in_sink=20)}
    result = RunResult({"fast": 21_863, "slow": 900}, {"fast": 0, "slow": 0}, accounting, True, 40.0)

    assert result.backlog == {"fast": 14_386 - 64}
    assert result.to_dict()["backlog"] == {"fast": 14_322}  # what summary.json carries
    shown = text(summary_table(result))
    cells = {c[1].strip(): c[-2].strip() for line in shown.splitlines() if len(c := line.split("│")) > 3}
    assert cells["fast"] == "pending 14386 (rate above capacity: batcher 128/s)"
    assert cells["slow"] == "yes"


def test_a_run_with_a_backlog_does_not_end_as_balanced():
    produced = {"fast": 21_863, "slow": 900}
    behind = RunResult(produced, {"fast": 0, "slow": 0},
                       {"fast": row(produced=21_863, trained=7477, buffered=14_386),
                        "slow": row(produced=900, trained=900)}, True, 40.0)
    kept_up = RunResult(produced, {"fast": 0, "slow": 0},
                        {"fast": row(produced=21_863, trained=21_863), "slow": row(produced=900, trained=900)},
                        True, 40.0)
    lost = RunResult(produced, {"fast": 0, "slow": 0},
                     {"fast": row(produced=21_863, trained=21_000), "slow": row(produced=900, trained=900)},
                     False, 40.0)

    assert ended_as(behind) == ("backlog", "rate above capacity: fast has 14322 records pending beyond one window")
    assert ended_as(kept_up) == ("balanced", "")
    assert ended_as(lost)[0] == "unbalanced"


def test_live_view_shows_the_backlog_and_the_widened_cap():
    cfg = load_config(overrides=["devices.count=2", "batcher.max_batch=64", "batcher.max_batch_widen=256"], env={})
    base = {"target_hz": 100, "produced": 0, "rate_hz": 0.0, "depth": 0, "batches": 0, "read": 0, "trained": 0,
            "dropped": 0, "dead_records": 0, "pending": 0, "dlq": 0}
    rows = {"dev00": {**base, "backlog": 5000, "batch_cap": 256}, "dev01": {**base, "backlog": 0, "batch_cap": 64}}

    shown = text(render(cfg, rows, "live"))

    assert "backlog" in shown and "batch cap" in shown
    assert "5000" in next(line for line in shown.splitlines() if "dev00" in line)
    assert " 256 " in next(line for line in shown.splitlines() if "dev00" in line)
    plain = load_config(overrides=["devices.count=2"], env={})
    assert "batch cap" not in text(render(plain, rows, "live"))  # no widening: no cap column
