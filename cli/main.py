"""The `edgestream` command line: the parser of every command group (``COMMANDS``) and ``main``.

``main`` owns how a command fails: every error becomes one line on stderr naming the
problem and the fix, exit status 2 for configuration errors and 1 for runtime errors;
tracebacks go to the debug log (``--debug`` or ``EDGESTREAM_DEBUG=1`` prints them).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import edgestream
from edgestream.cli import (
    acl,
    bench,
    bridge,
    broker,
    costs,
    examples,
    export,
    models,
    monitoring,
    record,
    run,
    serve,
    simulate,
    testbed,
    worker,
)
from edgestream.cli.errors import failure
from edgestream.cli.options import add_job_args
from edgestream.pipeline.exits import EXIT_CONFIG, flush_output

log = logging.getLogger("edgestream")

#: Set to 1 to print the traceback of a failed command (as ``--debug`` does).
DEBUG_ENV = "EDGESTREAM_DEBUG"

#: The command groups, in the order `edgestream --help` lists them: each has
#: ``register(subparsers, add_job_args)``, which adds its parsers with ``set_defaults(func=...)``;
#: ``func(args) -> int``.
COMMANDS = (broker, simulate, bridge, worker, acl, run, bench, costs, monitoring, record, testbed, models, examples,
            export, serve)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (``edgestream simulate: ...``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_CONFIG, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="edgestream",
        description="Online deep learning on edge sensor streams over Kafka.",
    )
    parser.add_argument("--debug", action="store_true",
                        help=f"print the traceback of a failed command (or set {DEBUG_ENV}=1)")
    parser.add_argument("--version", action="version", version=f"edgestream {edgestream.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    for group in COMMANDS:
        group.register(sub, add_job_args)
    unique = {id(command): (name, command) for name, command in reversed(sub.choices.items())}  # aliases once
    for name, command in unique.values():
        if name != "bench":  # bench passes everything after its name to the benchmark
            # SUPPRESS: absent after the command, the top-level value stands.
            command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                 help="print the traceback if the command fails")
    return parser


def _label(args: argparse.Namespace) -> str:
    worker = getattr(args, "worker", None) if args.command == "worker" else None
    return f"edgestream {args.command}" + (f" {worker}" if worker else "")


def _report_exit(args: argparse.Namespace, code: int, reason: str | None) -> None:
    """Write how a worker/server ended where `run` looks (``args.exit_file``, if set)."""
    path: Path | None = getattr(args, "exit_file", None)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"code": code, "reason": reason, "pid": os.getpid()}))
        tmp.replace(path)
    except OSError as exc:  # the state dir itself may be what failed
        log.debug("could not write %s: %s", path, exc)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        _report_exit(args, 130, "interrupted")
        return 130
    except BrokenPipeError:
        # The reader of our output went away (`edgestream bench --list | head`): not a failure
        # of the command. Further writes go nowhere, so the exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:
        code, line, reason = failure(exc, args)
        log.debug("%s failed", _label(args), exc_info=exc)
        if debug:
            traceback.print_exception(exc, file=sys.stderr)
        _report_exit(args, code, reason)
        print(f"{_label(args)}: {line}", file=sys.stderr, flush=True)
        _end_process(args, argv, code)
        return code
    _report_exit(args, code, None)
    _end_process(args, argv, code)
    return code


def _end_process(args: argparse.Namespace, argv: list[str] | None, code: int) -> None:
    """End a worker/server process now, skipping interpreter teardown.

    Everything is written and flushed by now; teardown only adds noise after the
    process's last line: torch's optimizer imports triton, whose bindings print a page
    of "nanobind: leaked ..." at finalisation. Only when ``main`` is the program
    (``argv is None``), never when a caller (a test) passes its own arguments.
    """
    if argv is not None or args.command not in ("worker", "server"):
        return
    flush_output()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
