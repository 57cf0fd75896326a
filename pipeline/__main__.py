"""`python -m pipeline` is the `edgestream` command."""

import sys

from pipeline.cli import main

sys.exit(main())
