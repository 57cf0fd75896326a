"""The end of a run freezes every training process before any of them leaves: the freeze
signal reaches each, each says so with a marker in its state dir, and the run waits for
the markers (or the process's exit), never past its deadline."""

from __future__ import annotations

import subprocess
import sys

from edgestream.pipeline.exits import ENDPOINT_FILE, FREEZE_SIGNAL, FROZEN_FILE
from edgestream.pipeline.run import freeze_processes
from edgestream.pipeline.worker import _FaustWorker, freezer

#: A process that, once its handler is in place (it prints "ready"), writes the marker on
#: the freeze signal, or ignores the signal ("ignore"), then waits to be killed.
CHILD = r"""
import json, os, signal, sys, time
from pathlib import Path
marker = Path(sys.argv[1]) / sys.argv[2]
if sys.argv[3] == "ignore":
    signal.signal(int(sys.argv[4]), signal.SIG_IGN)
else:
    signal.signal(int(sys.argv[4]), lambda *_: marker.write_text("frozen\n"))
if sys.argv[3] != "starting":  # a worker writes its endpoint once its signals are set up
    (Path(sys.argv[1]) / sys.argv[5]).write_text(json.dumps({"pid": os.getpid()}))
print("ready", flush=True)
while True:
    time.sleep(1)  # until killed: the test ends it
"""


def child(state, mode: str) -> subprocess.Popen:
    state.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(state), FROZEN_FILE, mode, str(int(FREEZE_SIGNAL)),
                             ENDPOINT_FILE], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"  # its handler is in place
    return proc


def test_every_process_is_signalled_and_the_run_waits_for_each_marker(tmp_path):
    procs = [(child(tmp_path / name, "freeze"), tmp_path / name) for name in ("w0", "w1", "server")]
    try:
        assert freeze_processes(procs, timeout_s=30.0) == [True, True, True]
        assert all((state / FROZEN_FILE).read_text() == "frozen\n" for _, state in procs)
        assert all(proc.poll() is None for proc, _ in procs)  # frozen, not stopped
    finally:
        for proc, _ in procs:
            proc.kill()
            proc.wait()


def test_an_exited_process_does_not_hold_the_run_and_a_silent_one_only_until_the_deadline(tmp_path, caplog):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "gone").mkdir()
    silent = child(tmp_path / "silent", "ignore")
    try:
        frozen = freeze_processes([(gone, tmp_path / "gone"), (silent, tmp_path / "silent")], timeout_s=0.3)
        assert frozen == [False, False]
        assert "silent did not confirm freezing within 0.3 s" in caplog.text
        assert silent.poll() is None
    finally:
        silent.kill()
        silent.wait()


def test_the_freeze_stops_training_and_writes_the_marker_and_never_starts_a_debugger(tmp_path):
    stopped: list[bool] = []
    freeze = freezer(tmp_path, lambda: stopped.append(True))
    worker = object.__new__(_FaustWorker)  # only the signal handler is under test
    worker.on_freeze = freeze

    worker._on_sigusr2()

    assert stopped == [True] and (tmp_path / FROZEN_FILE).read_text() == "frozen\n"
    ingest_only = freezer(tmp_path / "ingest", None)  # no training runtime: only the marker
    (tmp_path / "ingest").mkdir()
    ingest_only()
    assert (tmp_path / "ingest" / FROZEN_FILE).exists()


def test_a_process_still_starting_is_not_signalled(tmp_path, caplog):
    """Before its endpoint (of its own pid) exists a process may not handle the signal yet,
    whose default action would end it: it is left alone, and nobody waits for it."""
    starting = child(tmp_path / "w0", "starting")  # the signal would kill it: it has no endpoint
    (tmp_path / "w1").mkdir()
    (tmp_path / "w1" / ENDPOINT_FILE).write_text('{"pid": 1}')  # an earlier incarnation's
    older = child(tmp_path / "w1", "starting")
    try:
        assert freeze_processes([(starting, tmp_path / "w0"), (older, tmp_path / "w1")], timeout_s=30.0) == [False, False]
        assert starting.poll() is None and older.poll() is None  # not signalled: still running
        assert "did not confirm" not in caplog.text
    finally:
        for proc in (starting, older):
            proc.kill()
            proc.wait()
