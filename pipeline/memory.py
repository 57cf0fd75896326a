"""Memory settings of a long-running worker process, applied once at start-up.

``tune_allocator()`` keeps the C allocator from returning and re-mapping memory on
every large buffer. The ingest hot path allocates buffers of a few hundred KB to a
few MB many times a second (a run of messages joined, its columns, the batches). With
glibc's defaults each such buffer is mmap'd fresh or the heap top is trimmed after it
is freed, so every allocation page-faults its memory in again: measured on this
project's ingest benchmark, that made decoding a 64-message run about 6x slower. It
raises the mmap and trim thresholds so those buffers are reused from the heap; the
process keeps at most ``keep_bytes`` of freed memory for reuse. A no-op where glibc's ``mallopt`` is
not available (musl, macOS).

``freeze_startup_objects()`` moves everything allocated so far (imported modules, the
dataset, the model) out of the garbage collector's reach: full collections then walk
only what the stream creates, instead of stalling the event loop for a tenth of a
second now and then (seen in profiles of the ingest benchmark).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)

#: glibc's mallopt parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Freed heap memory kept for reuse, and the size from which allocations are mmap'd.
DEFAULT_KEEP_BYTES = 64 * 1024 * 1024


def tune_allocator(keep_bytes: int = DEFAULT_KEEP_BYTES) -> bool:
    """Raise glibc's mmap and trim thresholds to ``keep_bytes``; True if applied."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    applied = bool(mallopt(M_MMAP_THRESHOLD, keep_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, keep_bytes))
    if not applied:
        log.debug("mallopt refused the thresholds; keeping the allocator defaults")
    return applied


def freeze_startup_objects() -> int:
    """Collect once, then exempt every surviving object from later collections; how many."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
