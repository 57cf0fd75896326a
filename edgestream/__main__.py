"""`python -m edgestream` is the `edgestream` command."""

import sys

from edgestream.cli.main import main

sys.exit(main())
