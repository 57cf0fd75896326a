#!/usr/bin/env bash
# Runs a command from the cached virtualenv with this checkout on PYTHONPATH.
# Usage: scripts/with-venv.sh python -m pytest ...
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$here/scripts/venv.sh")"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$venv/bin:$PATH"
export VIRTUAL_ENV="$venv"
cmd="$1"; shift
exec "$venv/bin/$cmd" "$@"
