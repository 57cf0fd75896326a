"""``edgestream examples``: the example job files shipped with edgestream.

Without a name: one line per example (its name and what it runs). With a name: the file
on stdout, or written to ``-o FILE`` (an existing file is kept unless ``--force``), to
edit and run with ``edgestream run --job FILE``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from edgestream.cli.errors import CommandError
from edgestream.pipeline.exits import EXIT_CONFIG


def cmd_examples(args: argparse.Namespace) -> int:
    from edgestream.job.examples import EXAMPLES_DIR, describe, example_names, example_path

    if args.name is None:
        names = example_names()
        if not names:
            raise CommandError(f"no example jobs in {EXAMPLES_DIR} (a broken installation: reinstall edgestream)")
        width = max(len(n) for n in names)
        for name in names:
            print(f"{name:<{width}}  {describe(example_path(name))}")
        print("\n`edgestream examples NAME -o FILE` writes one; `edgestream run --job FILE` runs it.")
        return 0
    text = example_path(args.name).read_text(encoding="utf-8")
    if args.output is None:
        sys.stdout.write(text)
        return 0
    out: Path = args.output
    if out.exists() and not args.force:
        raise CommandError(f"{out} exists; pass --force to replace it", EXIT_CONFIG)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"cannot write {out}: {exc.strerror or exc}") from exc
    print(f"wrote {out}: run it with `edgestream run --job {out}`")
    return 0


def register(sub: argparse._SubParsersAction, add_job_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `examples` subcommand."""
    p = sub.add_parser("examples", help="list the example job files, print one or write it out (-o FILE)")
    p.add_argument("name", nargs="?", help="an example's name (e.g. bsp); none: list them")
    p.add_argument("-o", "--output", type=Path, help="write the example to this file instead of stdout")
    p.add_argument("--force", action="store_true", help="replace an existing --output file")
    p.set_defaults(func=cmd_examples)
