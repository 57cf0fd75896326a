"""Simulated-clock runs in worker processes: ``--jobs N`` of the comparison benchmarks.

A simulated run's figures do not depend on the wall clock, so running several at once on the
machine's cores changes only how long the sweep takes. Each process limits torch to one thread
(two cores: more would only contend).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def one_torch_thread() -> None:
    """Initializer of every pool process (and of the calling one when ``jobs`` is 1)."""
    from edgestream.trainers.local import limit_torch_threads

    limit_torch_threads(1)


def map_in_order(fn: Callable[[T], R], tasks: Sequence[T], jobs: int,
                 on_result: Callable[[int, R], Any] | None = None) -> list[R]:
    """``fn(task)`` for every task, in ``jobs`` spawned processes (here when ``jobs <= 1``).

    ``on_result(i, result)`` is called in this process as each run ends (``i`` counts from 1 in
    completion order: progress lines); the list returned is in the order of ``tasks``. ``fn`` and
    the tasks must pickle when ``jobs > 1`` (a module-level function or a ``functools.partial``
    of one). A run that raises ends the sweep with its exception.
    """
    results: list[Any] = [None] * len(tasks)
    if jobs <= 1:
        one_torch_thread()
        for i, task in enumerate(tasks):
            results[i] = fn(task)
            if on_result is not None:
                on_result(i + 1, results[i])
        return results
    import multiprocessing

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=one_torch_thread) as pool:
        index = {pool.submit(fn, task): i for i, task in enumerate(tasks)}
        for done, future in enumerate(as_completed(index), 1):
            results[index[future]] = future.result()
            if on_result is not None:
                on_result(done, results[index[future]])
    return results
