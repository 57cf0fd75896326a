"""`python -m pipeline` is the `edgestream` command (the CLI lives on the top floor, ``cli``)."""

import sys

from cli.main import main

sys.exit(main())
