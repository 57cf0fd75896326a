"""The preloaded launcher (pipeline/launcher.py) forks a command as a process of its own: its
own session, its log, the environment given, and the command's exit code, as
``subprocess.Popen`` would give it."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from edgestream.pipeline import launcher as launch
from edgestream.pipeline.launcher import PreloadedLauncher

TARGETS = "tests.unit.pipeline.launch_targets"


def launcher(function: str) -> PreloadedLauncher:
    return PreloadedLauncher(preload=(), entry=f"{TARGETS}:{function}")


def test_a_forked_command_has_its_own_session_log_environment_and_exit_code(tmp_path):
    log = tmp_path / "logs" / "w0.log"
    log.parent.mkdir()
    log.write_text("an earlier incarnation\n")
    proc = launcher("report").start(["3", "--flag"], log, env={"LAUNCH_TEST_VAR": "given", "PATH": os.environ["PATH"]})

    assert proc.wait(timeout=60) == 3 and proc.returncode == 3 and proc.poll() == 3
    lines = log.read_text().splitlines()
    assert lines[0] == "an earlier incarnation"  # appended, as the exec'd command's log is
    seen = json.loads(lines[1])
    assert seen["pid"] == proc.pid == seen["pgid"] == seen["sid"] != os.getpid()
    assert seen["var"] == "given" and seen["argv"] == ["3", "--flag"]
    assert seen["sys_argv"] == ["edgestream", "3", "--flag"] == proc.args
    assert seen["stdin"] == ""  # /dev/null
    assert seen["frozen"] > 0  # what the fork server imported is out of the collector's reach
    assert lines[2] == "to stderr"


def test_an_exception_exits_1_with_its_traceback_in_the_log(tmp_path):
    log = tmp_path / "w0.log"
    proc = launcher("fail").start(["x"], log)
    assert proc.wait(timeout=60) == 1
    text = log.read_text()
    assert "Traceback" in text and "RuntimeError: the command failed: x" in text


def test_a_command_that_returns_ends_its_process_even_with_a_thread_still_running(tmp_path):
    # Found by hand: a worker whose broker was gone left a service thread running, and the
    # forked process waited for it at exit (multiprocessing joins non-daemon threads) forever.
    log = tmp_path / "w0.log"
    proc = launcher("linger").start(["4"], log)
    assert proc.wait(timeout=60) == 4 and "returning" in log.read_text()


def test_a_process_group_signal_ends_it_with_the_signal_as_popen_reports_it(tmp_path):
    log = tmp_path / "w0.log"
    proc = launcher("block").start([], log)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)  # what the run's supervisor does to a stuck process
    assert proc.wait(timeout=60) == -signal.SIGKILL


def test_exec_is_chosen_by_the_environment(monkeypatch):
    monkeypatch.setenv(launch.LAUNCH_ENV, "exec")
    assert not launch.preloaded()
    monkeypatch.setenv(launch.LAUNCH_ENV, "")
    assert launch.preloaded()
