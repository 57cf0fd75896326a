"""`python -m cli` is the `edgestream` command."""

import sys

from cli.main import main

sys.exit(main())
