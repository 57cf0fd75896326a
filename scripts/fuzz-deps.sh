#!/usr/bin/env bash
# Ensures the fuzzing dependencies (requirements/fuzz.txt: atheris) are installed in the
# cached runtime virtualenv (scripts/venv.sh). Idempotent: a marker in the virtualenv,
# keyed by a hash of requirements/fuzz.txt, says they are there, so later runs cost a
# hash and a file test. Wheels only (no compiler needed); prints nothing on success.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
spec="$here/requirements/fuzz.txt"
venv="$(bash "$here/scripts/venv.sh")"
key=$(sha256sum "$spec" | cut -c1-16)
marker="$venv/.fuzz-deps-$key"
[ -f "$marker" ] && exit 0
exec 9>"$venv.fuzz-deps.lock"
flock 9
if [ ! -f "$marker" ]; then
  echo "edgestream: installing the fuzzing dependencies ($spec) into $venv (once)" >&2
  if ! "$venv/bin/pip" install --disable-pip-version-check --progress-bar off -q \
      --only-binary=:all: -r "$spec" >&2; then
    echo "edgestream: no installable wheel of $(grep -v '^#' "$spec" | xargs) for this Python/platform;" \
         "building atheris from source needs clang with libFuzzer (see tests/fuzz/README.md)" >&2
    exit 1
  fi
  rm -f "$venv"/.fuzz-deps-*
  touch "$marker"
fi
