"""`edgestream bench NAME [ARGS...]`: run a registered benchmark (``benchmarks.BENCHMARKS``)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from edgestream.cli.errors import CommandError
from edgestream.pipeline.exits import EXIT_CONFIG

#: Why `bench` cannot run here: the benchmarks package is the repository's, not the wheel's.
NOT_INSTALLED = ("the benchmarks are not part of this installation: run `python -m edgestream bench` "
                 "from a clone of the repository (its root on PYTHONPATH, as scripts/with-venv.sh sets it)")


def registry() -> dict:
    """``benchmarks.BENCHMARKS``, or a refusal (exit 2) where that package cannot be imported."""
    try:
        from edgestream.benchmarks import BENCHMARKS
    except ImportError:
        raise CommandError(NOT_INSTALLED, EXIT_CONFIG) from None
    return BENCHMARKS


def listing() -> str:
    """One line per registered benchmark: name and what it measures."""
    try:
        benchmarks = registry()
    except CommandError as exc:
        return str(exc)
    width = max(map(len, benchmarks))
    return "\n".join(f"  {name:<{width}}  {benchmarks[name].description}" for name in sorted(benchmarks))


def cmd_bench(args: argparse.Namespace) -> int:
    benchmarks = registry()
    if args.list:
        print(listing())
        return 0
    if args.name is None:
        raise CommandError("name a benchmark (`edgestream bench --list` shows them)", EXIT_CONFIG)
    if args.name not in benchmarks:
        raise CommandError(f"no benchmark {args.name!r}; available: {', '.join(sorted(benchmarks))}", EXIT_CONFIG)
    # Its ``main`` parses sys.argv, as under `python -m`; the program name its --help and
    # usage errors show is the command that ran it.
    sys.argv = [f"edgestream bench {args.name}", *args.args]
    code = importlib.import_module(benchmarks[args.name].module).main()
    return code if isinstance(code, int) else 0


def register(sub: argparse._SubParsersAction, add_job_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `bench` subcommand; its help lists the registered benchmarks."""
    p = sub.add_parser("bench", help="run a registered benchmark (table + JSON in benchmarks/results/)",
                       description="Run a registered benchmark: it prints a table and writes "
                                   "benchmarks/results/NAME.json.",
                       epilog="benchmarks:\n" + listing(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", help="benchmark name, e.g. ingest (--list shows them)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    p.add_argument("--list", action="store_true", help="list the registered benchmarks and exit")
    p.set_defaults(func=cmd_bench)
