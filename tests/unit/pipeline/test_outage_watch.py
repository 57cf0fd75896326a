"""One line when Kafka has been unreachable longer than the bound, one when it is back."""

from __future__ import annotations

import socket

from edgestream.pipeline.outage import OutageWatch, reachable


def test_a_long_outage_is_said_once_and_its_end_once():
    watch = OutageWatch("127.0.0.1:40409", "run", after_s=5)
    said = [watch.observe(ok, t) for t, ok in [(0, True), (1, False), (3, False), (6, False), (7, False),
                                               (20, False), (37, True), (38, True)]]
    lines = [line for line in said if line]
    assert len(lines) == 2
    assert lines[0].startswith("run: Kafka at 127.0.0.1:40409 unreachable for 5s;")
    assert "`edgestream broker start`" in lines[0]
    assert lines[1] == "run: Kafka at 127.0.0.1:40409 is reachable again after 36s; carrying on"
    assert watch.outages == 1 and not watch.down


def test_a_blip_shorter_than_the_bound_says_nothing():
    watch = OutageWatch("h:1", "simulator", after_s=5)
    assert [watch.observe(ok, t) for t, ok in [(0, False), (4.9, False), (5.5, True)]] == [None, None, None]
    assert watch.outages == 0


def test_every_outage_is_said_again():
    watch = OutageWatch("h:1", "worker w0", after_s=2)
    pattern = [(0, False), (3, False), (4, True), (10, False), (13, False), (14, True)]
    lines = [line for t, ok in pattern if (line := watch.observe(ok, t))]
    assert [line.split(" ")[5] for line in lines] == ["unreachable", "is", "unreachable", "is"]
    assert watch.outages == 2


def test_reachable_is_a_plain_tcp_connect():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert reachable(f"127.0.0.1:1,127.0.0.1:{port}")
    assert not reachable(f"127.0.0.1:{port}", timeout_s=0.5)
