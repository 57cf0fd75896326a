"""`edgestream bench NAME [ARGS...]`: run a benchmark from benchmarks/."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from cli.errors import CommandError
from pipeline.exits import EXIT_CONFIG


def cmd_bench(args: argparse.Namespace) -> int:
    import runpy

    root = Path(__file__).resolve().parent.parent / "benchmarks"
    script = root / f"{args.name}.py"
    if not script.exists():
        names = sorted(p.stem for p in root.glob("*.py") if not p.stem.startswith("_"))
        raise CommandError(f"no benchmark {args.name!r}; available: {', '.join(names)}", EXIT_CONFIG)
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def register(sub: argparse._SubParsersAction, add_job_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `bench` subcommand."""
    p = sub.add_parser("bench", help="run a benchmark from benchmarks/ (table + JSON)")
    p.add_argument("name", help="benchmark name, e.g. ingest")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    p.set_defaults(func=cmd_bench)
