"""The last module the launcher's fork server imports (``pipeline/launcher.py``): importing
it moves everything the preload created (torch, faust, the training code) out of the
garbage collector's reach, in the fork server itself.

Every forked worker then starts with those objects frozen. Its own collection at start-up
(``memory.freeze_startup_objects``) walks only what it created since the fork, instead of
the whole preloaded heap (about half a second of one core per process, measured with
py-spy on a worker of the ingest benchmark), and never writes to the preloaded objects'
pages, which stay shared with the fork server instead of being copied into each process.

Import it only as the fork server's last preload module: the import has that effect.
When the fork server exits, the objects are handed back to the collector first: frozen,
they would outlive the interpreter's teardown, and native extensions that count their
live objects at exit (triton's, under ``torch._dynamo``) print pages of leak warnings.
"""

from __future__ import annotations

import atexit
import gc

from edgestream.pipeline.memory import freeze_startup_objects

FROZEN = freeze_startup_objects()
atexit.register(gc.unfreeze)
