"""Commands for tests/unit/pipeline/test_launcher.py, run in forked processes."""

from __future__ import annotations

import gc
import json
import os
import sys
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
