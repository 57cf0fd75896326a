"""The exit statuses every edgestream command and process uses (one list, below the CLI),
and how a process writes out what it has before it ends."""

import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgestream.job.config import JobConfig

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


#: How a worker/server process ended, in its state dir: ``{"code": int, "reason": str | None}``.
EXIT_FILE = "exit.json"
#: Where a running worker/server is reached, in its state dir (``pid``, ``metrics`` ...):
#: written once it set up its signals and endpoints.
ENDPOINT_FILE = "endpoint.json"

#: What `edgestream run` sends every training process before SIGTERM at the end of a run:
#: freeze (no more steps, messages or membership changes) and say so by writing
#: ``FROZEN_FILE`` in its state dir. Only once all are frozen does any of them leave, so
#: none reacts to another's leave by training on alone (BSP replicas stay identical).
FREEZE_SIGNAL = signal.SIGUSR2
FROZEN_FILE = "frozen"


def worker_state_dir(cfg: "JobConfig", worker: str) -> Path:
    """Where process ``worker`` (or the server) of the job keeps its state: checkpoints,
    endpoint, ``EXIT_FILE``."""
    return cfg.state_path() / "workers" / worker
