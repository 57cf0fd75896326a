"""Commands for tests/unit/pipeline/test_launcher.py, run in forked processes."""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time


def report(argv: list[str]) -> int:
    """Print what the process sees (pid, process group, session, one variable, argv) as JSON
    and exit with ``argv[0]``."""
    print(json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
                      "var": os.environ.get("LAUNCH_TEST_VAR"), "argv": argv, "sys_argv": sys.argv,
                      "stdin": sys.stdin.read(), "frozen": gc.get_freeze_count()}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    return int(argv[0])


def fail(argv: list[str]) -> int:
    raise RuntimeError("the command failed: " + " ".join(argv))


def block(argv: list[str]) -> int:
    """Run until a signal ends the process (the test kills it)."""
    print("blocking", flush=True)
    while True:
        time.sleep(1)  # the process's own work: waiting to be killed


def linger(argv: list[str]) -> int:
    """Leave a non-daemon thread running (as a library's service thread that never stopped
    may) and return ``argv[0]``."""
    threading.Thread(target=time.sleep, args=(3600,), name="lingering", daemon=False).start()
    print("returning", flush=True)
    return int(argv[0])
