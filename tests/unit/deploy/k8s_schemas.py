"""Parses rendered Kubernetes manifests and validates every document against the
Kubernetes JSON schemas of kubernetes-validate, offline.

Runs with the deployment tools' Python (scripts/deploy-tools.sh), which has PyYAML and
kubernetes-validate; the main virtualenv has neither. Prints one JSON object:
``{"documents": [{"file": ..., "doc": {...}, "results": {version: result}}]}`` where a
result is ``"ok"``, ``"no-schema"`` (a kind the schemas do not know: a CRD) or
``"invalid: <message>"``.

Usage: python k8s_schemas.py --kube-version 1.30.0 [--kube-version ...] FILE...
"""

from __future__ import annotations

import argparse
import json
import sys

import kubernetes_validate
import yaml


def check(doc: dict, version: str) -> str:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return "no-schema"
    except kubernetes_validate.ValidationError as exc:
        # kubernetes-validate copies the jsonschema error's attributes onto its own.
        where = "/".join(str(p) for p in exc.path)
        return f"invalid: {where}: {exc.message}"
    return "ok"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kube-version", action="append", required=True)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    out = []
    for path in args.files:
        with open(path, encoding="utf-8") as fh:
            for doc in yaml.safe_load_all(fh):
                if doc is None:
                    continue
                results = {v: check(doc, v) for v in args.kube_version}
                out.append({"file": path, "doc": doc, "results": results})
    json.dump({"documents": out}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
