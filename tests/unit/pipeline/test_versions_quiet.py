"""The end of a run: no update in flight, then equal worker versions or versions that stopped moving; a drain that timed out names the workers a staleness bound kept waiting."""

from __future__ import annotations

from edgestream.monitoring.scrape import Sample, Scrape
from edgestream.pipeline.run import BlockedWatch, VersionsQuiet, updates_in_flight


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


def test_local_steps_a_timed_commit_will_carry_keep_the_run_from_settling():
    def worker(versions: dict[str, float], awaiting: float | None) -> dict[str, Scrape]:
        out = {}
        for name, version in versions.items():
            labels = (("worker", name),)
            samples = [Sample("edgestream_model_version", labels, version)]
            if awaiting is not None and name != "server":
                samples.append(Sample("edgestream_awaiting_commit_steps", labels, awaiting))
            out[name] = Scrape(samples)
        return out

    quiet = VersionsQuiet(clock=Clock())
    assert not quiet.settled(worker({"w0": 7, "server": 9}, awaiting=1))  # ADSP: its commit is due within an interval
    assert quiet.settled(worker({"w0": 7, "server": 9}, awaiting=0))
    assert quiet.settled(scrapes(w0=3, w1=3))  # strategies without timed commits are not held back


def test_a_local_sgd_partial_round_does_not_hold_the_run_back():
    # Local SGD at the end of the streams: w0 took 2 steps of a 4-step round that will never
    # be completed; it reports committed steps (8) below its steps (10) but nothing awaiting.
    labels = (("worker", "w0"),)
    scrape = {"w0": Scrape([Sample("edgestream_model_version", labels, 2),
                            Sample("edgestream_steps_total", labels, 10),
                            Sample("edgestream_committed_local_steps_total", labels, 8)]),
              "w1": Scrape([Sample("edgestream_model_version", (("worker", "w1"),), 2)])}
    assert VersionsQuiet(clock=Clock()).settled(scrape)


def offsets(worker: str, version: float, written: dict[tuple[str, int], float] | None = None,
            handled: dict[tuple[str, int], float] | None = None) -> Scrape:
    def samples(name: str, ends: dict[tuple[str, int], float] | None) -> list[Sample]:
        return [Sample(name, (("partition", str(p)), ("topic", t), ("worker", worker)), end)
                for (t, p), end in (ends or {}).items()]

    return Scrape([Sample("edgestream_model_version", (("worker", worker),), version),
                   *samples("edgestream_update_log_written_messages", written),
                   *samples("edgestream_update_log_handled_messages", handled)])


def test_a_gradient_written_and_not_yet_handled_by_its_reader_keeps_the_run_from_settling():
    # SSP: both workers pulled version 12; w1's last gradient (offset 41 of partition 1)
    # is on its way to the server. Equal worker versions alone would settle here.
    quiet = VersionsQuiet(clock=Clock())
    in_flight = {"server": offsets("server", 13, handled={("g", 0): 30, ("g", 1): 41}),
                 "w0": offsets("w0", 12, written={("g", 0): 30}),
                 "w1": offsets("w1", 12, written={("g", 1): 42})}
    assert updates_in_flight(in_flight) == ["g[1] (server at 41 of 42)"]
    assert not quiet.settled(in_flight)

    handled = {**in_flight, "server": offsets("server", 14, handled={("g", 0): 30, ("g", 1): 42})}
    assert updates_in_flight(handled) == []
    assert quiet.settled(handled)


def test_a_reader_is_held_to_every_partition_of_its_topics_and_only_to_those():
    # w0 reads the models topic "m" (from its start positions, nothing handled on partition
    # 1 yet); nobody reads w1's inbox "i-w1" any more (w1 left): it holds nothing back.
    scr = {"server": offsets("server", 5, written={("m", 0): 3, ("m", 1): 2}),
           "w0": offsets("w0", 5, written={("i-w1", 0): 9}, handled={("m", 0): 3, ("m", 1): 0})}
    assert updates_in_flight(scr) == ["m[1] (w0 at 0 of 2)"]
    scr["w0"] = offsets("w0", 5, written={("i-w1", 0): 9}, handled={("m", 0): 3, ("m", 1): 2})
    assert updates_in_flight(scr) == []
