"""`edgestream run`'s exit status per outcome, its output into a file, and `bench`'s refusal
of an unknown name: the exit statuses of pipeline/exits.py as a user meets them."""

from __future__ import annotations

import signal

import pytest

import edgestream.pipeline.kafka_io  # noqa: F401
import edgestream.pipeline.run  # noqa: F401
from edgestream import pipeline
from edgestream.cli import run as run_command
from edgestream.cli.main import main
from edgestream.pipeline.exits import EXIT_CONFIG, EXIT_NO_CHECKPOINT, EXIT_RUNTIME, EXIT_UNBALANCED
from edgestream.pipeline.run import NOTHING_READ, RunResult, summary_table


def row(*, produced: int, trained: int) -> dict:
    """A worker's accounting of one device, as ``run`` reads it."""
    return {**NOTHING_READ, "records_in": produced, "consumed": trained, "buffered": 0, "in_sink": 0,
            "pending": 0, "window_records": 64, "capacity_hz": 128.0, "running": True}


def test_every_exit_status_is_distinct():
    codes = [EXIT_RUNTIME, EXIT_CONFIG, EXIT_NO_CHECKPOINT, EXIT_UNBALANCED]
    assert len(set(codes)) == len(codes) and 0 not in codes and 130 not in codes


@pytest.fixture
def run_ending_with(monkeypatch, tmp_path):
    """``edgestream run`` against a fake cluster whose ``run_job`` prints the real final
    accounting table with long device names and ends with the given accounting."""
    monkeypatch.setattr(pipeline.kafka_io, "check_reachable", lambda bootstrap: None)
    handler = signal.getsignal(signal.SIGTERM)  # cmd_run turns SIGTERM into Ctrl-C: put it back after
    ran = []

    def run(accounting: dict[str, dict], produced: int) -> int:
        def run_job(cfg, bootstrap, *, garbage_per_device=0, console=None, **_):
            devices = sorted(accounting)
            result = RunResult({d: produced for d in devices}, {d: 0 for d in devices}, accounting,
                               all(a["consumed"] == produced for a in accounting.values()), 20.0)
            result.outcome, result.reason = pipeline.run.ended_as(result)
            console.print(summary_table(result))
            ran.append(bootstrap)
            return result

        monkeypatch.setattr(pipeline.run, "run_job", run_job)
        try:
            return main(["run", "--bootstrap", "127.0.0.1:9", "--set", f"run.state_dir={tmp_path}",
                             "--set", f"devices.ids={','.join(sorted(accounting))}",
                             "--set", f"devices.count={len(accounting)}"])
        finally:
            signal.signal(signal.SIGTERM, handler)

    run.ran = ran
    return run


LONG = "a-device-with-a-long-name-from-the-sensor-cabinet-"  # 52 characters with its number


def test_an_unbalanced_run_has_its_own_exit_status_and_its_log_keeps_every_cell(run_ending_with, capsys):
    accounting = {f"{LONG}{i:02d}": row(produced=1000, trained=1000 if i else 900) for i in range(2)}

    code = run_ending_with(accounting, 1000)

    out = capsys.readouterr().out
    assert run_ending_with.ran == ["127.0.0.1:9"]
    assert code == EXIT_UNBALANCED == 4
    assert "accounting does not balance" in out
    assert "…" not in out  # piped: no cell cut with an ellipsis
    table_rows = [line for line in out.splitlines() if LONG in line]
    assert len(table_rows) == 2  # each device's row on one line, its whole name in it
    assert all(f"{LONG}{i:02d}" in line for i, line in enumerate(table_rows))


def test_a_balanced_run_exits_0(run_ending_with, capsys):
    accounting = {f"{LONG}{i:02d}": row(produced=1000, trained=1000) for i in range(2)}

    assert run_ending_with(accounting, 1000) == 0
    assert "every record accounted for" in capsys.readouterr().out


def test_piped_console_is_wider_than_any_table_it_prints(monkeypatch):
    monkeypatch.setattr(run_command.sys.stdout, "isatty", lambda: False, raising=False)
    assert run_command.run_console().width == run_command.PIPED_WIDTH >= 1000


def test_an_unknown_benchmark_is_a_usage_error_listing_the_names(capsys):
    code = main(["bench", "nosuch"])

    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_CONFIG == 2
    assert len(err) == 1 and err[0].startswith("edgestream bench: no benchmark 'nosuch'; available: ")
    assert "ingest" in err[0] and "strategies" in err[0]
