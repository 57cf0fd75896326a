#!/usr/bin/env bash
# Ensures the tools that check the Kubernetes deployment exist, cached outside the clone
# like the virtualenv (scripts/venv.sh), and prints where they are as export-able lines:
#   EDGESTREAM_HELM=<cache>/helm-<version>/bin/helm
#   EDGESTREAM_DEPLOY_TOOLS=<cache>/deploy-tools-<hash>    (a virtualenv: bin/checkov, bin/kubernetes-validate)
# so `eval "$(bash scripts/deploy-tools.sh)"` sets both. helm is built from source with
# `go install` (only the Go module proxy is needed); the virtualenv is keyed by a hash of
# requirements/deploy-tools.txt, the Python version and the architecture.
# `--check` installs nothing: it prints the lines if both are there, else exits 1.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
helm_version="v3.21.4"
# Kubernetes version helm reports as .Capabilities.KubeVersion and lints against: the
# minor of the k8s.io/client-go that helm release builds with (v0.36 -> 1.36), as helm's
# own Makefile sets it.
helm_kube_minor="36"
spec="$here/requirements/deploy-tools.txt"
python="${EDGESTREAM_PYTHON:-python3}"
go="${EDGESTREAM_GO:-$(command -v go || echo /usr/local/go/bin/go)}"
cache="${EDGESTREAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edgestream}"
check_only=0
[ "${1:-}" = "--check" ] && check_only=1

key=$( { cat "$spec"; "$python" -c 'import sys, platform; print(sys.version, platform.machine())'; } | sha256sum | cut -c1-16)
helm_dir="$cache/helm-$helm_version"
tools="$cache/deploy-tools-$key"

if [ "$check_only" = 1 ]; then
  if [ ! -f "$helm_dir/.complete" ] || [ ! -f "$tools/.complete" ]; then
    echo "edgestream: the deployment tools are not installed: run 'bash scripts/deploy-tools.sh' (make test does)" >&2
    exit 1
  fi
else
  mkdir -p "$cache"
  exec 8>"$helm_dir.lock"
  flock 8
  if [ ! -f "$helm_dir/.complete" ]; then
    if [ ! -x "$go" ]; then
      echo "edgestream: building helm needs Go (not found as 'go' nor /usr/local/go/bin/go; set EDGESTREAM_GO)" >&2
      exit 1
    fi
    rm -rf "$helm_dir"
    echo "edgestream: building helm $helm_version with go install into $helm_dir (once, a few minutes)" >&2
    ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$helm_version"
    for pkg in pkg/chartutil pkg/lint/rules; do
      ldflags="$ldflags -X helm.sh/helm/v3/$pkg.k8sVersionMajor=1 -X helm.sh/helm/v3/$pkg.k8sVersionMinor=$helm_kube_minor"
    done
    GOBIN="$helm_dir/bin" CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -trimpath" \
      "$go" install -ldflags "$ldflags" "helm.sh/helm/v3/cmd/helm@$helm_version" >&2
    touch "$helm_dir/.complete"
  fi
  exec 8>&-

  exec 9>"$tools.lock"
  flock 9
  if [ ! -f "$tools/.complete" ]; then
    rm -rf "$tools"
    echo "edgestream: creating the deployment tools virtualenv $tools (once)" >&2
    "$python" -m venv "$tools"
    "$tools/bin/pip" install --disable-pip-version-check -q --upgrade pip >&2
    "$tools/bin/pip" install --disable-pip-version-check --progress-bar off -q -r "$spec" >&2
    touch "$tools/.complete"
  fi
  exec 9>&-
fi
echo "EDGESTREAM_HELM=$helm_dir/bin/helm"
echo "EDGESTREAM_DEPLOY_TOOLS=$tools"
