#!/usr/bin/env bash
# Ensures the cached virtualenv for this dependency spec exists and prints its path.
# The venv lives outside the clone, keyed by a hash of requirements/runtime.txt, the
# Python version and the architecture, so fresh clones (CI) and reruns reuse it.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
spec="$here/requirements/runtime.txt"
python="${EDGESTREAM_PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
  echo "edgestream needs Python >= 3.11 as '$python' (set EDGESTREAM_PYTHON to another interpreter)" >&2
  exit 1
fi
key=$( { cat "$spec"; "$python" -c 'import sys, platform; print(sys.version, platform.machine())'; } | sha256sum | cut -c1-16)
cache="${EDGESTREAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edgestream}"
venv="$cache/venv-$key"
mkdir -p "$cache"
exec 9>"$cache/venv-$key.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  echo "edgestream: creating virtualenv $venv (first run downloads torch, several GB; later runs reuse it)" >&2
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --disable-pip-version-check -q --upgrade pip >&2
  "$venv/bin/pip" install --disable-pip-version-check --progress-bar off -r "$spec" >&2
  touch "$venv/.complete"
fi
echo "$venv"
