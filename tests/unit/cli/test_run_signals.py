"""`edgestream run` stops on SIGINT and SIGTERM whatever its parent left it with: a shell without
job control starts background commands with SIGINT ignored, and a parent may start it with SIGINT
blocked (a run started so once streamed its whole duration after a Ctrl-C)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

SUBJECT = """
import sys, time
from edgestream.cli.run import _stop_signals_interrupt
if sys.argv[1] == "install":
    _stop_signals_interrupt()
try:
    print("ready", flush=True)  # inside: a signal right after it is still caught here
    time.sleep(30)
except KeyboardInterrupt:
    sys.exit(130)
sys.exit(0)
"""


def _ignored_and_blocked() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_interrupts_even_if_sigint_was_ignored_and_blocked(sig: int) -> None:
    proc = subprocess.Popen([sys.executable, "-c", SUBJECT, "install"], stdout=subprocess.PIPE, text=True,
                            preexec_fn=_ignored_and_blocked)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 130
    finally:
        proc.kill()
        proc.wait()


def test_without_it_such_a_process_sleeps_through_sigint() -> None:
    """The situation the call mends: the inherited SIGINT does nothing (the run then ends by itself)."""
    proc = subprocess.Popen([sys.executable, "-c", SUBJECT.replace("time.sleep(30)", "time.sleep(2)"), "plain"],
                            stdout=subprocess.PIPE, text=True, preexec_fn=_ignored_and_blocked)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0  # slept on to its end: the SIGINT was never acted on
    finally:
        proc.kill()
        proc.wait()
