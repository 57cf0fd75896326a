"""The exit statuses every edgestream command and process uses (one list, below the CLI),
and how a process writes out what it has before it ends."""

import logging
import sys

#: A runtime error stopped the command (Kafka unreachable, a crash).
EXIT_RUNTIME = 1
#: A configuration error stopped the command (bad flag, key, name, topic layout).
EXIT_CONFIG = 2
#: A worker/server whose checkpoint files are all unusable: a restart meets the same files,
#: so supervisors must not restart it (systemd RestartPreventExitStatus=, ``run``).
EXIT_NO_CHECKPOINT = 3
#: ``edgestream run`` ended and its accounting does not add up (records lost or counted twice):
#: a runtime outcome, not a configuration error; the tables and ``summary.json`` say where.
EXIT_UNBALANCED = 4


def flush_output() -> None:
    """Shut logging down and flush stdout and stderr: what a process does before it ends
    without interpreter teardown (an exec'd worker's ``os._exit``, a forked one's exit)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
