"""``edgestream models``: the registered models, their sizes and where each can be cut.

For the job's data (feature shape and classes; ``--job``/``--set`` as elsewhere) every
registered model (installed plugins' included) and the job's own ``"package.module:factory"``
is built as a worker would build it (``train.model_params`` applies to the job's own model)
and listed with its parameter count; a model made of named blocks
(an ``nn.Sequential``) also lists its boundaries, the names ``train.stages`` takes, with
the per-sample activation shape and the parameters of the block that ends there.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from edgestream.cli.options import job_config


def cmd_models(args: argparse.Namespace) -> int:
    from edgestream.job.plan import parse_params
    from edgestream.job.sources import job_fleet_data
    from edgestream.trainers.errors import ModelConfigError
    from edgestream.trainers.models import build_model, is_module_path, model_names
    from edgestream.trainers.stages import boundary_names, boundary_shapes

    cfg = job_config(args)
    data = job_fleet_data(cfg)
    rows = []
    own = [cfg.train.model] if is_module_path(cfg.train.model) else []  # the job's "package.module:factory"
    for name in model_names() + own:
        options = parse_params(cfg.train.model_params) if name == cfg.train.model else {}
        try:
            model = build_model(name, data.feature_shape, data.num_classes, seed=cfg.job.seed, **options)
        except ModelConfigError as exc:
            rows.append({"model": name, "error": str(exc)})
            continue
        row: dict = {"model": name, "parameters": sum(p.numel() for p in model.parameters()), "boundaries": []}
        try:
            names = boundary_names(model)
        except ModelConfigError:
            names = []
        shapes = boundary_shapes(model, names, data.feature_shape) if names else []
        children = dict(model.named_children())
        for boundary, shape in zip(names, shapes, strict=True):
            row["boundaries"].append({"name": boundary, "activation": list(shape),
                                      "block_parameters": sum(p.numel() for p in children[boundary].parameters())})
        rows.append(row)
    if args.json:
        print(json.dumps({"feature_shape": list(data.feature_shape), "classes": data.num_classes, "models": rows},
                         indent=2))
        return 0
    table = Table(title=f"models for the job's data: features {tuple(data.feature_shape)}, "
                        f"{data.num_classes} classes (train.model, train.stages)")
    for col in ("model", "parameters", "boundaries (train.stages): activation per sample"):
        table.add_column(col)
    for row in rows:
        if "error" in row:
            table.add_row(row["model"], "-", f"not for this data: {row['error']}")
            continue
        cuts = ", ".join(f"{b['name']} {tuple(b['activation'])}" for b in row["boundaries"]) or "- (not splittable)"
        table.add_row(row["model"], f"{row['parameters']:,}", cuts)
    Console(width=160).print(table)
    return 0


def register(sub: argparse._SubParsersAction, add_job_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `models` subcommand."""
    p = sub.add_parser("models", help="list the models, their sizes and boundaries (train.stages) for the job's data")
    add_job_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_models)
