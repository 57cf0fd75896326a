"""A local broker's address is part of its data: a restart on the same data reuses it, or
says in one line who holds it."""

from __future__ import annotations

import os
import socket

import pytest

from edgestream.deploy.kafka.broker import (
    ADDRESS_FILE,
    BrokerError,
    LocalBroker,
    PortClash,
    port_owner,
    save_address,
    saved_address,
)


def test_a_new_data_dir_takes_free_ports_and_a_saved_one_reuses_them(tmp_path):
    first = LocalBroker(tmp_path)
    assert saved_address(tmp_path) == {}
    save_address(tmp_path, first.host, first.port, first.controller_port)
    again = LocalBroker(tmp_path)
    assert (again.port, again.controller_port) == (first.port, first.controller_port)
    assert again.bootstrap == first.bootstrap


def test_an_explicit_port_wins_over_the_saved_one(tmp_path):
    save_address(tmp_path, "127.0.0.1", 40409, 40410)
    broker = LocalBroker(tmp_path, port=41000)
    assert (broker.port, broker.controller_port) == (41000, 40410)


def test_a_saved_address_of_another_host_or_an_unreadable_file_is_ignored(tmp_path):
    save_address(tmp_path, "10.0.0.7", 40409, 40410)
    assert LocalBroker(tmp_path).port != 40409 or LocalBroker(tmp_path).controller_port != 40410
    (tmp_path / ADDRESS_FILE).write_text("{not json")
    assert saved_address(tmp_path) == {}


def test_a_taken_port_is_refused_naming_the_process(tmp_path):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        save_address(tmp_path, "127.0.0.1", port, port + 1 if port < 65535 else port - 1)
        broker = LocalBroker(tmp_path)
        with pytest.raises(BrokerError) as raised:
            broker._check_ports_free()
    message = str(raised.value)
    assert "\n" not in message
    assert f"client port 127.0.0.1:{port}" in message and f"pid {os.getpid()} (" in message
    assert "--port PORT" in message and "--fresh" in message


def test_port_owner_of_a_port_nobody_holds():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening
    assert port_owner(port) == "another process"


class _Exited:
    """A launched JVM that has already exited with code 1."""
    returncode = 1

    def poll(self) -> int:
        return 1


def _exited_with(tmp_path, *lines: str) -> LocalBroker:
    broker = LocalBroker(tmp_path)
    broker.log_file.write_text("a line of an earlier launch: java.net.BindException: Address already in use\n")
    broker._log_offset = broker.log_file.stat().st_size
    with open(broker.log_file, "a") as log:
        log.write("".join(line + "\n" for line in lines))
    broker.proc = _Exited()
    return broker


def test_a_jvm_that_exits_at_start_up_says_why_in_the_first_line(tmp_path):
    broker = _exited_with(
        tmp_path,
        "[2026-11-29 16:40:01,000] INFO Registered kafka:type=kafka.Log4jController MBean",
        "[2026-11-29 16:40:02,000] ERROR Exiting Kafka due to fatal exception during startup. (kafka.Kafka$)",
        "org.apache.kafka.common.config.ConfigException: Invalid value -3 for configuration num.io.threads",
        "\tat org.apache.kafka.common.config.ConfigDef.parseValue(ConfigDef.java:1)")
    with pytest.raises(BrokerError) as raised:
        broker.check_running()
    assert not isinstance(raised.value, PortClash)  # the earlier launch's bind error is not this one's
    first = str(raised.value).splitlines()[0]
    assert first.startswith("Kafka node 1 exited with code 1 during start-up: "
                            "org.apache.kafka.common.config.ConfigException: Invalid value -3")
    assert str(broker.log_file) in first


def test_a_port_taken_between_the_pick_and_the_jvms_bind_is_a_port_clash(tmp_path):
    broker = _exited_with(
        tmp_path, "org.apache.kafka.common.KafkaException: Socket server failed to bind to "
                  "127.0.0.1:40411: Address already in use.")
    with pytest.raises(PortClash, match="Socket server failed to bind"):
        broker.check_running()
    (tmp_path / "quiet").mkdir()
    quiet = _exited_with(tmp_path / "quiet")
    quiet.log_file.write_text("")
    with pytest.raises(BrokerError, match="during start-up: no log lines;"):
        quiet.check_running()


def _clashing_start(broker: LocalBroker, clashes: int) -> list[tuple[int, int, str]]:
    """Replace the broker's JVM by one that meets a port clash ``clashes`` times."""
    tried: list[tuple[int, int, str]] = []

    def launch() -> None:
        tried.append((broker.port, broker.controller_port, broker.quorum_voters))

    def wait_ready(timeout_s: float) -> None:
        if len(tried) <= clashes:
            raise PortClash("Socket server failed to bind: Address already in use")

    broker.launch, broker._wait_ready = launch, wait_ready
    return tried


def test_a_node_that_picked_its_ports_starts_again_on_new_ones_after_a_clash(tmp_path):
    broker = LocalBroker(tmp_path)
    assert broker.ports_picked
    tried = _clashing_start(broker, clashes=2)
    assert broker.start() is broker
    assert len(tried) == 3 and len({(port, controller) for port, controller, _ in tried}) == 3
    assert tried[-1][2] == f"1@127.0.0.1:{broker.controller_port}"  # the voter follows the port

    stubborn = LocalBroker(tmp_path / "stubborn")
    _clashing_start(stubborn, clashes=LocalBroker.PORT_RETRIES + 1)
    with pytest.raises(PortClash):
        stubborn.start()


@pytest.mark.parametrize("given", [{"port": 41000}, {"controller_port": 41001}, {"saved": True},
                                   {"quorum_voters": "1@127.0.0.1:41001"}])
def test_a_port_given_or_saved_is_never_changed_after_a_clash(tmp_path, given):
    if given.pop("saved", False):
        save_address(tmp_path, "127.0.0.1", 40409, 40410)
    broker = LocalBroker(tmp_path, **given)
    assert not broker.ports_picked
    tried = _clashing_start(broker, clashes=1)
    with pytest.raises(PortClash):
        broker.start()
    assert len(tried) == 1
