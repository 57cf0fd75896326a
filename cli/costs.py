"""``edgestream costs``: the simulated clock's cost models (``trainers/costmodels.py``).

Without a spec: one line per preset (its numbers and what it models). With a spec (a
preset, a ``.toml`` file, either with ``:KEY=VALUE,...`` overrides, as ``--cost-model``
of the simulated benchmarks takes it): the resolved cost model as a cost model file, to
save and edit; ``--workers N`` applies its fill rule for N workers first (a list too
short under ``fill = "error"`` is refused, exit 2, as a run would refuse it).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict


def cmd_costs(args: argparse.Namespace) -> int:
    from edgestream.trainers import costmodels

    if args.spec is None:
        presets = costmodels.PRESETS
        if args.json:
            print(json.dumps({name: {"description": p.description, **costmodels.to_table(p.model)}
                              for name, p in presets.items()}, indent=2))
            return 0
        width = max(map(len, presets))
        for name, preset in presets.items():
            print(f"{name:<{width}}  {costmodels.describe(preset.model)}")
            print(f"{'':<{width}}  {preset.description}")
        print("\n`edgestream costs NAME` prints one as a cost model file (docs/simclock.md, \"Cost models\"); "
              "`--cost-model NAME|FILE.toml[:KEY=VALUE,...]` of the simulated benchmarks takes it.")
        return 0
    named = costmodels.resolve(args.spec)
    if args.workers is not None:
        named = costmodels.NamedCostModel(named.name, costmodels.fit(named, args.workers), named.description,
                                          named.source)
    if args.json:
        print(json.dumps({"name": named.name, "description": named.description, "source": named.source,
                          "cost_model": asdict(named.model)}, indent=2))
        return 0
    print(costmodels.to_toml(named), end="")
    return 0


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers takes a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--workers takes a whole number >= 1, got {text!r}")
    return value


def register(sub: argparse._SubParsersAction, add_job_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `costs` subcommand."""
    p = sub.add_parser("costs", help="list the simulated clock's cost model presets, or print one resolved as a file",
                       description="The simulated clock's cost models: without SPEC the presets; with SPEC (NAME, "
                                   "FILE.toml, either followed by :KEY=VALUE,... overrides, lists written a/b/c) "
                                   "the resolved cost model as a cost model file.")
    p.add_argument("spec", nargs="?", help="a preset, a .toml file, optionally :KEY=VALUE,... (none: list presets)")
    p.add_argument("--workers", type=_workers, metavar="N",
                   help="apply the fill rule for N workers (refused if a list is too short under fill = \"error\")")
    p.add_argument("--json", action="store_true", help="print JSON (the CostModel's own fields) instead")
    p.set_defaults(func=cmd_costs)
