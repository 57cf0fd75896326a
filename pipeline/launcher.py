"""Starting worker and server processes without paying their imports each time.

A training process spends its first seconds importing torch, faust and the training code
(about 4 s of one core here, more than its first hundred steps). A run starts several and
restarts them after a crash, on a machine whose cores the broker and the other workers
share. ``PreloadedLauncher`` imports that code once, in a fork server (``multiprocessing``'s
``forkserver`` start method with a preload list), and forks each process from it: the
process is a fresh child with its own pid, session and log, exactly as if it had been
exec'd, only without the import time (and sharing the imported pages copy-on-write).

What the process runs is the command line it would have been exec'd with: the
package's ``main(argv)`` (``edgestream.__main__``) in a new session, stdout and stderr
appended to its log, stdin on ``/dev/null``, the environment given. Its exit code is the
command's (``-N`` when signal N ended it), as with ``subprocess.Popen``; the handle
answers ``poll``, ``wait``, ``pid`` and ``returncode`` the same way.

``EDGESTREAM_LAUNCH=exec`` turns it off (every process is exec'd, as a process under a
command prefix such as the testbed's ``ip netns exec`` always is).
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.process
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from edgestream.pipeline.exits import flush_output

#: Environment variable: ``exec`` starts every process with a new interpreter.
LAUNCH_ENV = "EDGESTREAM_LAUNCH"
#: The package's command entry (what ``python -m edgestream`` runs, there as ``__main__``):
#: importing it imports the command line and nothing else runs. The launcher names the
#: command by the package's entry point, as the exec'd path does, not by the CLI modules
#: below it.
COMMAND_MODULE = "edgestream.__main__"
#: What the fork server imports once: what a worker or server imports before its first step.
PRELOAD = (
    "torch",
    "torch._dynamo",  # imported by the first torch.optim optimizer: about 3 s of one core
    "faust",
    "aiokafka",
    "kafka",
    COMMAND_MODULE,
    "edgestream.pipeline.worker",
    "edgestream.pipeline.training",
    "edgestream.pipeline.app",
    "edgestream.trainers.assembly",
)
#: Imported after the preload, always: freezes what it created (pipeline/forkserver_ready.py).
FREEZE_MODULE = "edgestream.pipeline.forkserver_ready"
#: Seconds a forked process has to become its own session leader before ``start`` fails.
SESSION_TIMEOUT_S = 10.0


#: What a forked process runs: ``module:function``, called with the argument list.
COMMAND = f"{COMMAND_MODULE}:main"


def _run_command(entry: str, argv: list[str], env: dict[str, str], log_path: str) -> None:
    """The forked process: a new session, its log on stdout and stderr, the given environment,
    then the command. It ends as the exec'd ``worker``/``server`` command does:
    ``exits.flush_output``, then ``os._exit`` with the command's code, at once. Returning to
    multiprocessing instead would join every non-daemon thread first (``threading._shutdown``),
    and a library thread that never stopped (a service thread of a client whose broker went
    away) kept such a process alive for good after its command returned."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["edgestream", *argv]
    module, _, function = entry.partition(":")
    main = getattr(importlib.import_module(module), function)
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    flush_output()
    os._exit(code)


class LaunchedProcess:
    """A forked command: the part of ``subprocess.Popen``'s interface a run uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]) -> None:
        self._process = process
        self.args = args
        self.pid: int = process.pid  # type: ignore[assignment]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode  # type: ignore[return-value]


class PreloadedLauncher:
    """Forks commands from the fork server, which imports ``preload`` when it starts (on first
    use), then ``FREEZE_MODULE``, which exempts what the imports created from garbage
    collection. There is one fork server per process (``multiprocessing``'s): the first
    launcher to start it sets what it imports."""

    def __init__(self, preload: Sequence[str] = PRELOAD, entry: str = COMMAND) -> None:
        self._context = multiprocessing.get_context("forkserver")
        self._preload = [*preload, FREEZE_MODULE]
        self._entry = entry
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Start the fork server now, without waiting: it imports the preload in its own
        process while the caller goes on (checks, a broker start); the first ``start``
        waits for what is left of it."""
        with self._lock:
            self._context.set_forkserver_preload(self._preload)
            multiprocessing.forkserver.ensure_running()

    def start(self, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> LaunchedProcess:
        argv = [str(a) for a in argv]
        env = dict(os.environ if env is None else env)
        with self._lock:
            self._context.set_forkserver_preload(self._preload)
            process = self._context.Process(target=_run_command, args=(self._entry, argv, env, str(log_path)),
                                            name=f"edgestream {' '.join(argv[:3])}")
            process.start()
        # The run outlives nothing it starts: it stops every process itself, so the
        # interpreter's exit must not wait for them (multiprocessing joins its children).
        multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]
        handle = LaunchedProcess(process, ["edgestream", *argv])
        self._await_session(handle)
        return handle

    @staticmethod
    def _await_session(handle: LaunchedProcess) -> None:
        """Return once the process leads its own process group (``os.killpg(pid)`` reaches
        it) or has already ended."""
        deadline = time.monotonic() + SESSION_TIMEOUT_S
        while handle.poll() is None:
            try:
                if os.getpgid(handle.pid) == handle.pid:
                    return
            except ProcessLookupError:
                pass
            if time.monotonic() > deadline:
                os.kill(handle.pid, 9)
                handle.wait(5)
                raise RuntimeError(f"process {handle.pid} ({' '.join(handle.args)}) did not start its session "
                                   f"within {SESSION_TIMEOUT_S:.0f} s")
            time.sleep(0.005)  # poll interval of a deadline wait: a fork takes milliseconds


_launcher: PreloadedLauncher | None = None


def preloaded() -> bool:
    """Whether commands are forked from the preloaded server (``EDGESTREAM_LAUNCH`` is not
    ``exec``)."""
    return os.environ.get(LAUNCH_ENV, "").strip().lower() != "exec"


def launcher() -> PreloadedLauncher:
    """The process's one launcher."""
    global _launcher
    if _launcher is None:
        _launcher = PreloadedLauncher()
    return _launcher


def warm_up() -> None:
    """Start the process's fork server in the background, if commands are forked (a run
    calls it first, so the preload's imports overlap its checks and its broker's start)."""
    if preloaded():
        launcher().warm()
