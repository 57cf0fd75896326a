"""`edgestream testbed up|down|status|fault`: the edge testbed (see docs/testbed.md).

The testbed of a job (``--job``) is ``deploy.testbed.Testbed.for_job``: its id is the job
name, its state ``.edgestream/testbed/<job name>/testbed.json``. Root only: every action
fails with exit status 2 otherwise; a testbed that cannot be built is exit status 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from edgestream.cli.errors import CommandError
from edgestream.cli.options import job_config
from edgestream.pipeline.exits import EXIT_CONFIG, EXIT_RUNTIME


def register(sub, add_job_args) -> None:
    p = sub.add_parser("testbed", help="network-namespace hosts with shaped links and faults (root only)",
                       description="Hosts as Linux network namespaces on a bridge, one per worker, the server, "
                                   "the devices and each broker, with per-host link shaping from [testbed] "
                                   "(docs/testbed.md).")
    actions = p.add_subparsers(dest="testbed_action", required=True, metavar="ACTION")

    def action(name: str, help: str) -> argparse.ArgumentParser:
        a = actions.add_parser(name, help=help, description=help)
        add_job_args(a)
        a.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="print the traceback if the command fails")
        a.set_defaults(func=cmd_testbed)
        return a

    action("up", "create the job's hosts, links and shaping; prints the hosts")
    a = action("down", "remove the job's testbed (namespaces, links, qdiscs, proxies), also after a crash")
    a.add_argument("--all", action="store_true", help="remove every edgestream testbed on this machine")
    a = action("status", "the job's hosts, links as tc reports them, faults, and leftovers on the machine")
    a.add_argument("--json", action="store_true", help="print the status as JSON")
    a = action("fault", "cut (partition), restore (heal) or re-shape (degrade) one host's link")
    a.add_argument("host", help="a host of the testbed: w0.., server, devices, b0..")
    a.add_argument("fault", choices=("partition", "heal", "degrade"))
    a.add_argument("link", nargs="?", default=None,
                   help='for degrade: "RATE [DELAY [JITTER]]", e.g. "1mbit 80ms"')


def _errors(exc: Exception):
    from edgestream.deploy.testbed import NeedsRoot

    code = EXIT_CONFIG if isinstance(exc, (NeedsRoot, ValueError)) else EXIT_RUNTIME
    return CommandError(str(exc), code)


def cmd_testbed(args: argparse.Namespace) -> int:
    from edgestream.deploy.testbed import TestbedError

    try:
        return _ACTIONS[args.testbed_action](args)
    except (TestbedError, ValueError) as exc:
        if type(exc).__name__ == "ConfigError":  # the CLI's own handling (exit 2)
            raise
        raise _errors(exc) from exc


def _need_job(args: argparse.Namespace, what: str):
    if args.job is None:
        raise CommandError(f"`edgestream testbed {what}` needs --job JOB.toml (the job whose testbed it is)"
                           + (", or --all" if what == "down" else ""), EXIT_CONFIG)
    return job_config(args)


def _state_dir(cfg) -> Path:
    from edgestream.deploy.testbed.testbed import default_state_dir

    return default_state_dir(cfg.job.name)


def _up(args: argparse.Namespace) -> int:
    from edgestream.deploy.testbed import Testbed

    cfg = _need_job(args, "up")
    console = Console()
    bed = Testbed.for_job(cfg)
    with console.status(f"building testbed {bed.testbed_id} ({len(bed.hosts)} hosts; a delay builds "
                        "Toxiproxy once, about a minute)"):
        bed.up()
    console.print(hosts_table(bed.status()))
    console.print(f"testbed {bed.testbed_id} up: bridge {bed.plan.bridge}, controller {bed.controller_address}; "
                  f"run in a host with `ip netns exec <netns> ...`; remove with "
                  f"`edgestream testbed down --job {args.job}`", soft_wrap=True)
    return 0


def _down(args: argparse.Namespace) -> int:
    from edgestream.deploy.testbed import down_all, down_by_id
    from edgestream.deploy.testbed.system import need_root

    console = Console()
    need_root()
    if args.all:
        removed = down_all()
        console.print(f"removed {len(removed)} testbed objects: {', '.join(removed) or 'nothing was left'}",
                      soft_wrap=True)
        return 0
    cfg = _need_job(args, "down")
    removed = down_by_id(cfg.job.name, _state_dir(cfg))
    console.print(f"testbed {cfg.job.name}: removed {', '.join(removed) or 'nothing (it was not up)'}",
                  soft_wrap=True)
    return 0


def _status(args: argparse.Namespace) -> int:
    from edgestream.deploy.testbed import Testbed, leftovers
    from edgestream.deploy.testbed.system import need_root
    from edgestream.deploy.testbed.testbed import DEFAULT_STATE_ROOT, STATE_FILE

    need_root()
    console = Console()
    if args.job is None:
        beds = [Testbed.load(p.parent) for p in sorted(DEFAULT_STATE_ROOT.glob(f"*/{STATE_FILE}"))]
        statuses = [b.status() for b in beds]
        found = leftovers()
        own = set()
        for bed in beds:
            own |= bed._own_entries()
        strays = [e for e in found if e not in own]
        if args.json:
            print(json.dumps({"testbeds": statuses, "leftovers": strays}, indent=2))
            return 0
        for status in statuses:
            console.print(hosts_table(status))
        if not statuses:
            console.print(f"no testbed state under {DEFAULT_STATE_ROOT}")
        _print_leftovers(console, strays)
        return 0
    cfg = _need_job(args, "status")
    state_dir = _state_dir(cfg)
    bed = Testbed.load(state_dir) if (state_dir / STATE_FILE).exists() else Testbed.for_job(cfg)
    status = bed.status()
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    console.print(hosts_table(status))
    if not status["up"]:
        console.print(f"testbed {bed.testbed_id} is not up (`edgestream testbed up --job {args.job}`)")
    _print_leftovers(console, status["leftovers"])
    return 0 if status["up"] else 1


def _print_leftovers(console: Console, entries: list[str]) -> None:
    if entries:
        console.print(f"[yellow]leftovers not belonging to a recorded testbed[/yellow]: {', '.join(entries)} "
                      "(remove with `edgestream testbed down --all`)", soft_wrap=True)


def _fault(args: argparse.Namespace) -> int:
    from edgestream.deploy.testbed import Testbed, parse_link
    from edgestream.deploy.testbed.system import need_root
    from edgestream.deploy.testbed.testbed import STATE_FILE

    cfg = _need_job(args, "fault")
    need_root()
    spec = None
    if args.fault == "degrade":
        if not args.link:
            raise CommandError('degrade needs a link: edgestream testbed fault HOST degrade "1mbit 80ms" --job ...',
                               EXIT_CONFIG)
        spec = parse_link(args.link)
    elif args.link:
        raise CommandError(f"{args.fault} takes no link (only degrade does)", EXIT_CONFIG)
    state_dir = _state_dir(cfg)
    if not (state_dir / STATE_FILE).exists():
        raise CommandError(f"testbed {cfg.job.name} is not up: `edgestream testbed up --job {args.job}` first")
    bed = Testbed.load(state_dir)
    if args.host not in bed.hosts:
        raise CommandError(f"no host {args.host!r} in testbed {bed.testbed_id}; hosts: {', '.join(bed.hosts)}",
                           EXIT_CONFIG)
    bed.fault(args.host, args.fault, spec)
    Console().print(hosts_table(bed.status()))
    return 0


def hosts_table(status: dict) -> Table:
    """The hosts of ``Testbed.status()``: address, links configured and in force, the tbf
    rates read back from tc (upload: host side, download: bridge side), faults, proxy."""
    table = Table(title=f"testbed {status['id']} ({status['subnet']}, controller {status['controller_address']}, "
                        f"bridge {status['bridge']}{'' if status['up'] else ', NOT UP'})")
    for col in ("host", "kind", "netns", "address", "link", "in force", "up / down (tc)", "fault", "proxy"):
        table.add_column(col)
    for h in status["hosts"]:
        tc = f"{_qdisc(h.get('upload'))} / {_qdisc(h.get('download'))}" if h.get("up") else "-"
        proxy = h.get("proxy")
        proxy_text = "-"
        if proxy:
            first = next(iter((proxy.get("proxies") or {}).values()), {"toxics": []})
            toxics = first["toxics"]  # every broker's proxy has the same toxics
            latency = sum(t["attributes"]["latency"] for t in toxics)
            proxy_text = (f"pid {proxy['pid']}" + ("" if proxy["alive"] else " (gone)")
                          + (f", +{latency} ms" if toxics else ""))
        address = h["address"] + (f" (+{h['alias']})" if h.get("alias") else "")
        table.add_row(h["name"], h["kind"], h["netns"], address, h["link"] or "unshaped",
                      h["in_force"] or "unshaped", tc, "partitioned" if h["partitioned"] else "-", proxy_text)
    return table


def _qdisc(q: dict | None) -> str:
    if not q:
        return "?"
    if q["kind"] == "tbf":
        from edgestream.deploy.testbed.links import format_rate

        return f"tbf {format_rate(q['rate_bps'])}"
    return "none" if q["kind"] in ("noqueue", "none") else q["kind"]


_ACTIONS = {"up": _up, "down": _down, "status": _status, "fault": _fault}
