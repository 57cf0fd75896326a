"""Worker memory settings: applied where glibc is present, harmless everywhere."""

from __future__ import annotations

import gc

from edgestream.pipeline import memory


def test_allocator_thresholds_apply_exactly_on_glibc_and_twice_is_fine():
    import platform

    on_glibc = platform.libc_ver()[0] == "glibc"
    assert memory.tune_allocator() == on_glibc
    assert memory.tune_allocator() == on_glibc


def test_freeze_takes_existing_objects_out_of_the_collected_generations():
    gc.unfreeze()
    kept = [[i] for i in range(10)]  # containers: tracked by the collector
    assert any(o is kept for o in gc.get_objects())
    try:
        frozen = memory.freeze_startup_objects()
        assert frozen > 1000  # the interpreter, the imports, the test session
        assert not any(o is kept for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())
