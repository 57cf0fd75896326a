"""The end-of-run settle check: equal worker versions, or versions that stopped moving."""

from __future__ import annotations

from monitoring.scrape import Sample, Scrape
from pipeline.run import VersionsQuiet


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
