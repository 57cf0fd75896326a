"""`python -m edgestream` is the `edgestream` command.

Importing this module only imports the command (``main``): the preloaded launcher
(``pipeline/launcher.py``) imports it once and calls ``main`` in each forked process.
"""

import sys

from edgestream.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
