"""`edgestream acl apply|list`: the principals and ACLs a job needs on a secure cluster."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from edgestream.cli.options import job_config, need_bootstrap


def cmd_acl(args: argparse.Namespace) -> int:
    from edgestream.pipeline import acl

    cfg = job_config(args)
    console = Console()
    grants = acl.job_grants(cfg)
    if args.action == "list":
        for g in grants:
            console.print(f"User:{g.user}  {'/'.join(g.operations)}  {g.resource} {g.name}"
                          f"{'*' if g.prefixed else ''}", soft_wrap=True, markup=False)
        return 0
    bootstrap = need_bootstrap(args, cfg)
    done = acl.apply(bootstrap, cfg, args.password_dir)
    console.print(f"job {cfg.job.name}: topics created, {done['users']} SCRAM-SHA-512 users "
                  f"(passwords in {args.password_dir}/<user>.password), {done['acls']} ACLs "
                  f"({len(grants)} grants; `edgestream acl list` shows them)", soft_wrap=True)
    return 0


def register(sub: argparse._SubParsersAction, add_job_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `acl` subcommand."""
    p = sub.add_parser("acl", help="the principals and ACLs a job needs on a secure cluster (docs/security.md)")
    p.add_argument("action", choices=("apply", "list"),
                   help="apply: create the job's topics, users and ACLs (run it as the admin); list: print them")
    add_job_args(p)
    p.add_argument("--password-dir", type=Path, default=Path(".edgestream/credentials"),
                   help="apply: where each user's password is kept (made if absent, mode 0600; default: %(default)s)")
    p.set_defaults(func=cmd_acl)
