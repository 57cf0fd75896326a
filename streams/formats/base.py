"""The input-format interface and its registry (``streams.formats`` re-exports both).

A format is a class registered by name with ``register``; ``format_named(name)`` returns
its (one, stateless) instance. It turns the user's parameters into a validated value
(``parse_params``) and builds, for one stream, a decoder with the interface the ingest
core uses (``FormatDecoder``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from edgestream.streams.codec import DEFAULT_LIMITS, DecodeLimits
from edgestream.streams.registry import Registry

if TYPE_CHECKING:
    import numpy as np

    from edgestream.streams.records import RecordBatch


class FormatDecoder(Protocol):
    """What the ingest core calls on the decoder of one stream.

    ``decode`` raises ``RecordDecodeError`` (or its ``OutOfRange``) for a bad message;
    ``timestamp_s`` is the message's Kafka timestamp in seconds and ``offset`` its
    partition offset, for formats whose messages may lack an event time or a sequence
    number. ``decode_run`` decodes consecutive messages as one batch, or returns None (the
    caller then decodes them one by one); ``last_layout`` is what ``decode_run`` expects
    (None: it takes no run now), and its ``count`` the records of each message of a run it
    takes (the ingest sizes a run by it before decoding).
    """

    def decode(
        self, data: bytes | bytearray | memoryview, *, timestamp_s: float | None = None,
        offset: int | None = None,
    ) -> RecordBatch: ...

    def decode_run(self, values: list[bytes]) -> RecordBatch | None: ...

    @property
    def last_layout(self) -> Any: ...


class InputFormat(ABC):
    """One input format, registered by name with ``register``."""

    #: The registry name (set by ``register``).
    name: ClassVar[str] = ""
    #: Whether a recording's messages (edgestream's binary format, replayed as recorded) are
    #: messages of this format.
    reads_recordings: ClassVar[bool] = False

    @abstractmethod
    def parse_params(self, params: Mapping[str, Any]) -> object:
        """The format's parameters from the user's mapping; ``ValueError`` saying what to write."""

    @abstractmethod
    def decoder(
        self,
        params: object,
        limits: DecodeLimits = DEFAULT_LIMITS,
        *,
        expected_device: str | None = None,
        expected_shape: tuple[int, ...] | None = None,
        value_range: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> FormatDecoder:
        """A decoder for one stream; ``params`` is what ``parse_params`` returned."""

    def lookups(self, params: object, values: Sequence[bytes | None]) -> list[Callable[[], None]]:
        """Blocking lookups that decoding ``values`` needs first and that are not cached
        yet (a schema registry's schema of an id): the async ingest edge runs each off the
        event loop before it hands the messages in, and runs it again after a while as long
        as it raises ``LookupUnavailable``, so an outage of that service stalls ingest
        instead of dead-lettering readings. None by default."""
        return []

    @abstractmethod
    def encode(self, params: object, batch: RecordBatch) -> bytes:
        """``batch`` as one message of this format (what a simulated device sends): the
        decoder built from the same ``params`` reads it back as ``batch``."""


_FORMATS: Registry[InputFormat] = Registry("input format")
#: Class decorator: make an ``InputFormat`` available as ``format_named(name)`` (names unique).
register = _FORMATS.register
#: Remove the format registered as ``name`` (for tests that register a toy one).
unregister = _FORMATS.unregister
#: The registered format names, in registration order.
names = _FORMATS.names


def format_named(name: str) -> InputFormat:
    """The format registered as ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return _FORMATS.get(name)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
