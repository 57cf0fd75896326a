"""The Kafka wire protocol's framing, spoken by hand (https://kafka.apache.org/protocol).

A request is ``int32 size`` + header v1 (``int16 api_key``, ``int16 api_version``,
``int32 correlation_id``, ``string client_id``) + body; a response is ``int32 size`` +
``int32 correlation_id`` + body. Two raw clients share this: the metadata probe of
``deploy.kafka.broker`` (a plain socket, or one its caller wrapped in TLS) and the SCRAM
preflight of ``pipeline.security`` (pipeline/ may import deploy/, never the reverse).

A reply is read exactly, and only when its size is within the bounds the caller names
(at most ``MAX_REPLY``), in chunks as the bytes arrive: a server that is not Kafka (or is
hostile) never makes us allocate what its first four bytes claim.
"""

from __future__ import annotations

import socket
import struct
import time

#: The largest reply anyone may ask to read: Kafka's own default request limit
#: (``socket.request.max.bytes``, 100 MiB).
MAX_REPLY = 100 * 1024 * 1024

#: The most read by one ``recv`` call, so memory grows with what arrives, not with
#: what the size field promised.
_CHUNK = 64 * 1024


class ProtocolError(Exception):
    """The server's reply is not what the Kafka protocol says."""


class BadReplySize(ProtocolError):
    """The size field of a reply is outside the bounds the caller accepts."""

    def __init__(self, size: int, head: bytes) -> None:
        super().__init__(f"reply of {size} bytes")
        self.size = size
        self.head = head  # the four bytes read as the size

    @property
    def tls_record(self) -> bool:
        """The four bytes start a TLS record (an alert or a handshake): a TLS listener
        answering plaintext. Read as a size they are >= 0x15030000 (336 MiB), beyond
        ``MAX_REPLY``, so they always land here."""
        return self.head[0] in (0x15, 0x16) and self.head[1] == 0x03


class OtherCorrelation(ProtocolError):
    """The reply carries another request's correlation id."""

    def __init__(self, expected: int, got: int) -> None:
        super().__init__("reply to another request")
        self.expected, self.got = expected, got


class ConnectionClosed(ConnectionError):
    """The server closed the connection before the whole reply arrived."""

    def __init__(self, got: int, wanted: int) -> None:
        super().__init__("connection closed before a complete reply")
        self.got, self.wanted = got, wanted


def request(api_key: int, api_version: int, correlation: int, body: bytes, client_id: bytes) -> bytes:
    """One size-prefixed request frame: header v1 then ``body``."""
    header = struct.pack(">hhih", api_key, api_version, correlation, len(client_id)) + client_id
    return struct.pack(">i", len(header) + len(body)) + header + body


def _time_left(deadline: float) -> float:
    return max(0.01, deadline - time.monotonic())


def read_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Exactly ``n`` bytes from ``sock``. With a ``deadline`` (``time.monotonic()``), each
    wait is cut to the time left and TimeoutError says how far it got; without one, the
    socket's own timeout applies. ConnectionClosed on EOF before ``n`` bytes."""
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            sock.settimeout(_time_left(deadline))
        try:
            chunk = sock.recv(min(n - len(out), _CHUNK))
        except TimeoutError:
            if deadline is None:
                raise
            raise TimeoutError(f"{len(out)} of {n} bytes of the reply before the deadline") from None
        if not chunk:
            raise ConnectionClosed(len(out), n)
        out += chunk
    return bytes(out)


def read_reply(sock: socket.socket, correlation: int, *, deadline: float | None = None,
               min_size: int = 4, max_size: int) -> bytes:
    """The body of one size-prefixed reply to request ``correlation`` (its correlation id
    checked and cut off). ``min_size``/``max_size`` bound the size field (which counts
    the correlation id): BadReplySize outside them, before anything more is read."""
    if not 4 <= min_size <= max_size <= MAX_REPLY:
        raise ValueError(f"reply bounds {min_size}..{max_size} not within 4..{MAX_REPLY}")
    head = read_exact(sock, 4, deadline)
    (size,) = struct.unpack(">i", head)
    if not min_size <= size <= max_size:
        raise BadReplySize(size, head)
    reply = read_exact(sock, size, deadline)
    (echoed,) = struct.unpack(">i", reply[:4])
    if echoed != correlation:
        raise OtherCorrelation(correlation, echoed)
    return reply[4:]


def exchange(sock: socket.socket, api_key: int, api_version: int, correlation: int, body: bytes, *,
             client_id: bytes, max_size: int, min_size: int = 4, deadline: float | None = None) -> bytes:
    """Send one request on ``sock`` and return the body of its reply (``read_reply``)."""
    if deadline is not None:
        sock.settimeout(_time_left(deadline))
    sock.sendall(request(api_key, api_version, correlation, body, client_id))
    return read_reply(sock, correlation, deadline=deadline, min_size=min_size, max_size=max_size)
