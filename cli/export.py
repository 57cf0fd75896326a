"""``edgestream export``: a job's trained model as ONNX, TorchScript and safetensors files with a
model card (``pipeline.export``), and ``--verify DIR``: an export's files against its card.

Exit status: 0 written and checked; 2 it cannot start (no checkpoint, unknown worker, a
checkpoint of another model, an unwritable ``--out``, a bad flag); 1 a check failed (ONNX
Runtime differs from torch beyond 1e-5, a file of ``--verify DIR`` does not match its card).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from edgestream.cli.errors import CommandError
from edgestream.cli.options import job_config
from edgestream.pipeline.exits import EXIT_CONFIG, EXIT_RUNTIME

#: The formats, as ``trainers.export.FORMATS`` names them (kept here so `--help` needs no torch).
FORMAT_NAMES = "onnx,torchscript,safetensors"


def _say(line: str) -> None:
    print(f"export: {line}", flush=True)


def cmd_export(args: argparse.Namespace) -> int:
    if args.verify is not None:
        return _verify(args.verify)
    if args.out is None:
        raise CommandError("edgestream export needs --out DIR (where to write the files), or --verify DIR",
                           EXIT_CONFIG)
    from edgestream.pipeline.export import ExportRefused, export_job
    from edgestream.trainers.export import ExportCheckFailed, ExportError, parse_formats
    from edgestream.trainers.local import limit_torch_threads

    try:
        formats = parse_formats(args.formats)
    except ValueError as exc:
        raise CommandError(f"--formats {args.formats}: {exc}", EXIT_CONFIG) from None
    if args.state_dir is not None:
        args.set = [*(args.set or []), f"run.state_dir={args.state_dir}"]
    cfg = job_config(args)
    limit_torch_threads(1)  # the cores are shared with the broker and the workers
    started = time.perf_counter()
    try:
        report = export_job(cfg, args.out, worker=args.worker, checkpoint=args.checkpoint, formats=formats, say=_say)
    except ExportRefused as exc:
        raise CommandError(str(exc), EXIT_CONFIG) from None
    except ExportCheckFailed as exc:
        raise CommandError(f"check failed: {exc}", EXIT_RUNTIME) from None
    except ExportError as exc:
        raise CommandError(str(exc), EXIT_RUNTIME) from None
    card = report.card
    for name, entry in card["files"].items():
        _say(f"wrote {report.directory / name} ({entry['bytes']} bytes, sha256 {entry['sha256'][:16]}...)")
    ort = card["checks"].get("onnxruntime")
    if ort is not None:
        _say(f"ONNX Runtime (fresh process) vs torch on {ort['samples']} held-out samples: max abs diff "
             f"{ort['max_abs_diff']:.3g} (tolerance {ort['tolerance']:.3g}; torch float32 vs float64 "
             f"{ort['torch_float32_vs_float64']:.3g}), same predictions {ort['same_predictions']:.4f}")
    held = card["evaluation"]["heldout"]
    preq = card["evaluation"]["prequential"]
    shown = f"{preq['accuracy']:.4f}" if preq.get("accuracy") is not None else f"- ({preq['reason']})"
    _say(f"{held['split']} accuracy {held['accuracy']:.4f}, prequential {shown}")
    _say(f"done in {time.perf_counter() - started:.1f} s; card: {report.directory / 'model-card.json'}")
    return 0


def _verify(directory: Path) -> int:
    from edgestream.trainers.export import ExportTampered, verify_export

    try:
        card = verify_export(directory)
    except ExportTampered as exc:
        raise CommandError(f"refused: {exc}", EXIT_RUNTIME) from None
    for name, entry in sorted(card["files"].items()):
        print(f"ok {name} sha256 {entry['sha256']}", flush=True)
    print(f"export {directory}: {len(card['files'])} file(s) match the card (model {card.get('model', {}).get('name')}"
          f", version {card.get('version', {}).get('model_version')})", file=sys.stdout, flush=True)
    return 0


def register(sub: argparse._SubParsersAction, add_job_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `export` subcommand."""
    p = sub.add_parser("export", help="write a job's trained model as ONNX / TorchScript / safetensors with a "
                                      "model card; --verify DIR checks an export's files")
    add_job_args(p)
    p.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="the run's state directory (default: run.state_dir of the job)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--worker", metavar="NAME",
                       help="export this process's model (default: the server where the strategy has one, "
                            "else the first worker; a stage-split job is always assembled from every stage)")
    which.add_argument("--checkpoint", type=Path, metavar="PATH", help="export the model in this checkpoint file")
    p.add_argument("--out", type=Path, metavar="DIR", help="directory to write model.onnx, model.ts, "
                                                            "model.safetensors and model-card.json into")
    p.add_argument("--formats", default=FORMAT_NAMES, metavar="LIST",
                   help=f"comma-separated subset of {FORMAT_NAMES} (default: all)")
    p.add_argument("--verify", type=Path, metavar="DIR",
                   help="check every file of the export in DIR against its card's sha256 and exit")
    p.set_defaults(func=cmd_export)
