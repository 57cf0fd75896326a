#!/usr/bin/env bash
# The program libFuzzer runs (and re-runs, for -merge and -minimize_crash): the target
# named by EDGESTREAM_FUZZ_TARGET under atheris, libFuzzer's flags as arguments. Set up
# by tests/fuzz/run.py; not meant to be called by hand.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${EDGESTREAM_FUZZ_PYTHON:-python3}" -m tests.fuzz.run "$EDGESTREAM_FUZZ_TARGET" --child -- "$@"
