"""`edgestream testbed up|down|status|fault`: the edge testbed (see docs/testbed.md)."""

from __future__ import annotations


def register(sub, add_job_args) -> None:
    p = sub.add_parser("testbed", help="network-namespace hosts with shaped links (root only)")
    add_job_args(p)
    p.set_defaults(func=lambda args: 2)
