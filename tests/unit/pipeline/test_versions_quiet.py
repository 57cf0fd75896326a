"""The end of a run: equal worker versions or versions that stopped moving; a drain that timed out names the workers a staleness bound kept waiting."""

from __future__ import annotations

from edgestream.monitoring.scrape import Sample, Scrape
from edgestream.pipeline.run import BlockedWatch, VersionsQuiet


def scrapes(**versions: float) -> dict[str, Scrape]:
    return {name: Scrape([Sample("edgestream_model_version", (("worker", name),), v)])
            for name, v in versions.items()}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_equal_worker_versions_settle_at_once_whatever_the_server():
    assert VersionsQuiet(clock=Clock()).settled(scrapes(server=40, w0=12, w1=12))


def test_distinct_versions_settle_once_nothing_moved_for_the_quiet_time():
    clock = Clock()
    quiet = VersionsQuiet(quiet_s=5.0, clock=clock)

    assert not quiet.settled(scrapes(server=40, w0=38, w1=40))
    clock.now = 4.0
    assert not quiet.settled(scrapes(server=41, w0=38, w1=41))  # the server moved: start again
    clock.now = 8.9
    assert not quiet.settled(scrapes(server=41, w0=38, w1=41))
    clock.now = 9.0
    assert quiet.settled(scrapes(server=41, w0=38, w1=41))


def test_a_timed_out_drain_names_the_workers_still_blocked():
    def blocked(**seconds: float) -> dict[str, Scrape]:
        return {name: Scrape([Sample("edgestream_blocked_seconds_total", (("worker", name),), v)])
                for name, v in seconds.items()}

    watch = BlockedWatch(blocked(w0=10.0, w1=10.0, w2=0.0))

    assert watch.hint(blocked(w0=10.5, w1=10.0, w2=0.0)) == ""  # nobody waited during the drain
    hint = watch.hint(blocked(w0=30.0, w1=10.0, w2=0.0))
    assert hint.startswith("; w0 kept waiting for the slowest worker") and "w1" not in hint


def test_local_steps_not_yet_committed_keep_the_run_from_settling():
    def adsp(committed: float, steps: float) -> dict[str, Scrape]:
        labels = (("worker", "w0"),)
        return {"w0": Scrape([Sample("edgestream_model_version", labels, 7),
                              Sample("edgestream_steps_total", labels, steps),
                              Sample("edgestream_committed_local_steps_total", labels, committed)]),
                "server": Scrape([Sample("edgestream_model_version", (("worker", "server"),), 9)])}

    quiet = VersionsQuiet(clock=Clock())
    assert not quiet.settled(adsp(committed=68, steps=69))  # its commit is due within an interval
    assert quiet.settled(adsp(committed=69, steps=69))
    assert quiet.settled(scrapes(w0=3, w1=3))  # strategies without commits are not held back
