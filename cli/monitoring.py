"""`edgestream generate | prometheus | fleet-png`: monitoring subcommands."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from edgestream.cli.options import positive_float
from edgestream.monitoring.prometheus import DEPLOY_DIR, REPO_ROOT


def cmd_generate(args: argparse.Namespace) -> int:
    """Regenerate every file generated from the code: the Grafana dashboards and Prometheus
    config (from the metrics) and the Helm chart's strategy lists (from the registry)."""
    from edgestream.deploy import helm_strategies
    from edgestream.monitoring.dashboards import write_all

    changed = [*write_all(check=args.check), *helm_strategies.write(check=args.check)]
    for path in changed:
        shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
        print(f"{'stale' if args.check else 'wrote'} {shown}")
    if args.check and changed:
        print("run `edgestream generate` and commit the result")
        return 1
    if not changed:
        print("the generated files (dashboards, Prometheus config, Helm strategy lists) are up to date")
    return 0


def cmd_prometheus(args: argparse.Namespace) -> int:
    """Run Debian's prometheus in the foreground with the committed config (Ctrl-C stops it)."""
    exe = shutil.which("prometheus")
    if exe is None:
        raise SystemExit("edgestream: 'prometheus' is not installed (Debian: apt-get install prometheus)")
    args.data_dir.mkdir(parents=True, exist_ok=True)
    cmd = [exe, f"--config.file={DEPLOY_DIR / 'prometheus.yml'}", f"--storage.tsdb.path={args.data_dir}",
           f"--web.listen-address={args.listen}"]
    print("running: " + " ".join(cmd))
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 130


def cmd_fleet_png(args: argparse.Namespace) -> int:
    from edgestream.monitoring.prometheus import PrometheusAPI
    from edgestream.monitoring.render import render_fleet

    end = time.time()
    drawn = render_fleet(PrometheusAPI(args.prometheus), args.out, start=end - args.minutes * 60, end=end,
                         step_s=args.step, rate_interval=args.rate_interval)
    for title, count in drawn.items():
        print(f"{title}: {count} series")
    print(f"wrote {args.out}")
    return 0


def register(sub: argparse._SubParsersAction, add_job_args: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("generate", aliases=["dashboards"],
                       help="regenerate the files generated from the code: Grafana dashboards, Prometheus "
                            "config, the Helm chart's strategy lists")
    p.add_argument("--check", action="store_true", help="only report stale generated files (exit 1)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("prometheus", help="run the local prometheus with deploy/prometheus/prometheus.yml")
    p.add_argument("--listen", default="127.0.0.1:9090", help="listen address (default: %(default)s)")
    p.add_argument("--data-dir", type=Path, default=Path(".edgestream/prometheus/data"))
    p.set_defaults(func=cmd_prometheus)

    p = sub.add_parser("fleet-png", help="render the fleet dashboard's key series to a PNG")
    p.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    p.add_argument("--minutes", type=positive_float, default=15.0, help="how far back (default: %(default)s)")
    p.add_argument("--step", type=positive_float, default=2.0, help="query step in seconds")
    p.add_argument("--rate-interval", default="30s", help="what $__rate_interval becomes")
    p.add_argument("--out", type=Path, default=Path("docs/img/fleet.png"))
    p.set_defaults(func=cmd_fleet_png)
