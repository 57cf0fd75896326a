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
