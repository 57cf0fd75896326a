"""benchmarks/parallel.py: ``--jobs`` of the simulated benchmarks keeps the order of the tasks."""

from __future__ import annotations

import pytest

from edgestream.benchmarks import parallel


def _square_after(task: tuple[int, float]) -> int:
    """Later tasks finish first: the pool's completion order is not the task order."""
    import time

    value, delay = task
    time.sleep(delay)
    return value * value


def _fails_on_three(value: int) -> int:
    if value == 3:
        raise ValueError("task 3 failed")
    return value


@pytest.mark.parametrize("jobs", [1, 2])
def test_results_come_back_in_task_order_with_a_progress_call_per_run(jobs: int) -> None:
    tasks = [(1, 0.6), (2, 0.3), (3, 0.0), (4, 0.0)]
    seen: list[tuple[int, int]] = []
    results = parallel.map_in_order(_square_after, tasks, jobs, lambda i, r: seen.append((i, r)))
    assert results == [1, 4, 9, 16]
    assert sorted(i for i, _ in seen) == [1, 2, 3, 4]  # counts runs as they end
    assert sorted(r for _, r in seen) == [1, 4, 9, 16]


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failing_run_ends_the_sweep_with_its_error(jobs: int) -> None:
    with pytest.raises(ValueError, match="task 3 failed"):
        parallel.map_in_order(_fails_on_three, [1, 2, 3, 4], jobs)
