"""`python -m pipeline` was the command before the `edgestream` namespace: say what replaced it."""

import sys

print("edgestream: `python -m pipeline` is now `python -m edgestream` (or the installed `edgestream` command)",
      file=sys.stderr)
sys.exit(2)
