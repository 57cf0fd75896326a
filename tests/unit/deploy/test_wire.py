"""The hand-spoken Kafka framing (deploy/kafka/wire.py) over a socketpair, and the messages
its two users (the metadata probe, the SCRAM preflight) make of its errors."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from edgestream.deploy.kafka import wire
from edgestream.deploy.kafka.broker import broker_count
from edgestream.pipeline import security


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    client, server = socket.socketpair()
    client.settimeout(5.0)
    server.settimeout(5.0)
    with client, server:
        yield client, server


def reply(correlation: int, body: bytes) -> bytes:
    return struct.pack(">ii", len(body) + 4, correlation) + body


def read_request(sock: socket.socket) -> tuple[int, int, int, bytes, bytes]:
    """(api_key, version, correlation, client_id, body) of one request frame."""
    (size,) = struct.unpack(">i", wire.read_exact(sock, 4))
    frame = wire.read_exact(sock, size)
    api_key, version, correlation, n = struct.unpack(">hhih", frame[:10])
    return api_key, version, correlation, frame[10:10 + n], frame[10 + n:]


def test_a_request_and_its_reply_round_trip(pair):
    client, server = pair
    seen = []

    def serve() -> None:
        api_key, version, correlation, client_id, body = read_request(server)
        seen.append((api_key, version, correlation, client_id, body))
        server.sendall(reply(correlation, b"answer to " + body))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    body = wire.exchange(client, 17, 1, 7, b"question", client_id=b"test-client", max_size=1024,
                         deadline=time.monotonic() + 5.0)
    thread.join(5.0)
    assert body == b"answer to question"
    assert seen == [(17, 1, 7, b"test-client", b"question")]


def test_the_request_frame_is_size_prefixed_header_v1_then_body():
    frame = wire.request(3, 4, 0x01020304, b"\x00\x00\x00\x00\x00", b"id")
    assert frame == (struct.pack(">i", 2 + 2 + 4 + 2 + 2 + 5) + struct.pack(">hhih", 3, 4, 0x01020304, 2)
                     + b"id" + b"\x00" * 5)


def test_a_reply_larger_than_one_chunk_is_read_whole(pair):
    client, server = pair
    payload = bytes(range(256)) * 1200  # 300 KiB: several recv calls
    thread = threading.Thread(target=server.sendall, args=(reply(9, payload),), daemon=True)
    thread.start()
    assert wire.read_reply(client, 9, max_size=1 << 20, deadline=time.monotonic() + 5.0) == payload
    thread.join(5.0)


def test_a_short_reply_is_a_closed_connection(pair):
    client, server = pair
    server.sendall(struct.pack(">ii", 20, 9) + b"12345")
    server.shutdown(socket.SHUT_WR)
    with pytest.raises(wire.ConnectionClosed, match="connection closed before a complete reply") as caught:
        wire.read_reply(client, 9, max_size=1024, deadline=time.monotonic() + 5.0)
    assert (caught.value.got, caught.value.wanted) == (9, 20)
    assert isinstance(caught.value, ConnectionError)


def test_eof_before_the_size_is_a_closed_connection(pair):
    client, server = pair
    server.shutdown(socket.SHUT_WR)
    with pytest.raises(wire.ConnectionClosed):
        wire.read_reply(client, 9, max_size=1024)


@pytest.mark.parametrize("size", [1025, -1, 3, 2**31 - 1])
def test_a_size_out_of_bounds_is_refused_before_reading_more(pair, size):
    client, server = pair
    server.sendall(struct.pack(">i", size) + b"rest")
    with pytest.raises(wire.BadReplySize, match=f"reply of {size} bytes") as caught:
        wire.read_reply(client, 9, max_size=1024)
    assert caught.value.size == size and not caught.value.tls_record
    assert client.recv(16) == b"rest"  # nothing past the size was read


def test_a_tls_record_reads_as_an_oversized_reply_and_says_so(pair):
    client, server = pair
    server.sendall(b"\x15\x03\x03\x00\x02\x02\x50")  # a TLS alert
    with pytest.raises(wire.BadReplySize) as caught:
        wire.read_reply(client, 9, max_size=wire.MAX_REPLY)
    assert caught.value.tls_record


def test_a_reply_to_another_request_is_refused(pair):
    client, server = pair
    server.sendall(reply(8, b"x"))
    with pytest.raises(wire.OtherCorrelation, match="reply to another request"):
        wire.read_reply(client, 9, max_size=1024)


def test_the_bounds_themselves_are_bounded(pair):
    client, _server = pair
    with pytest.raises(ValueError):
        wire.read_reply(client, 9, max_size=wire.MAX_REPLY + 1)
    with pytest.raises(ValueError):
        wire.read_reply(client, 9, min_size=2, max_size=1024)


def test_a_silent_peer_ends_at_the_deadline(pair):
    client, server = pair
    server.sendall(b"\x00\x00")  # half a size, then nothing
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="2 of 4 bytes"):
        wire.read_reply(client, 9, max_size=1024, deadline=started + 0.2)
    assert 0.15 < time.monotonic() - started < 2.0


def test_without_a_deadline_the_sockets_own_timeout_applies(pair):
    client, _server = pair
    client.settimeout(0.1)
    with pytest.raises(TimeoutError):
        wire.read_exact(client, 4)
    assert client.gettimeout() == 0.1


# --- what the two users make of these errors (messages users see) ----------------------------
@pytest.mark.parametrize(("sent", "message"), [
    (b"", "the broker closed the connection"),
    (struct.pack(">i", (1 << 20) + 1), f"reply of {(1 << 20) + 1} bytes"),
    (reply(2, b"\x00\x00"), "reply to another request"),
])
def test_the_scram_client_reports_a_broken_reply_as_a_protocol_error(pair, sent, message):
    client, server = pair
    server.sendall(sent)
    server.shutdown(socket.SHUT_WR)
    with pytest.raises(security.ProtocolError, match=message):
        security.scram_login(client, "SCRAM-SHA-256", "w", "pw")


class OneShotServer:
    """Accepts one connection, reads one request and sends ``answer``."""

    def __init__(self, answer: bytes) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.answer = answer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            read_request(conn)
            conn.sendall(self.answer)

    def __enter__(self) -> OneShotServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(5.0)
        self.sock.close()


@pytest.mark.parametrize(("answer", "words"), [
    (b"\x15\x03\x03\x00\x02\x02\x50", "speaks TLS, not plaintext: set kafka.security_protocol"),
    (struct.pack(">i", 8) + b"\x45\x53\x30\x31\x00\x00\x00\x00", "is not a Kafka broker (reply of 8 bytes)"),
    (reply(1, struct.pack(">ii", 0, 1)), "is not a Kafka broker (unexpected reply)"),
    (reply(0x45533031, struct.pack(">ii", 0, 3)), None),
])
def test_the_metadata_probe_reports_each_broken_reply(answer, words):
    with OneShotServer(answer) as server:
        count, problem = broker_count(server.address, timeout_s=5.0)
    if words is None:
        assert (count, problem) == (3, None)
    else:
        assert count == 0 and problem is not None and words in problem
