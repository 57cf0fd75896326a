"""The name and codec-id registry of compressors: how config picks one and how bytes find their decoder."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from edgestream import plugins
from edgestream.compression import errors
from edgestream.compression.base import Compressor
from edgestream.compression.errors import CompressorConfigError, PayloadDecodeError

C = TypeVar("C", bound=type[Compressor])

_BY_NAME: dict[str, type[Compressor]] = {}
_BY_CODEC: dict[int, type[Compressor]] = {}
# Decoding is stateless (a Compressor invariant), so one default instance per
# codec serves every receiver.
_DECODERS: dict[int, Compressor] = {}


def register(name: str) -> Callable[[C], C]:
    """Class decorator: make a compressor creatable by ``name`` and decodable by its ``codec_id``.

    Names and codec ids are unique; a clash is a programming error and raises
    ``CompressorConfigError`` at import time rather than misrouting bytes later.
    """

    def decorate(cls: C) -> C:
        codec_id = cls.codec_id
        if not 0 < codec_id <= 0xFFFF:
            raise CompressorConfigError(f"{cls.__name__}.codec_id={codec_id} must be in 1..65535")
        if name in _BY_NAME and _BY_NAME[name] is not cls:
            raise CompressorConfigError(f"compressor name {name!r} registered twice")
        if codec_id in _BY_CODEC and _BY_CODEC[codec_id] is not cls:
            raise CompressorConfigError(
                f"codec id {codec_id} used by {_BY_CODEC[codec_id].__name__} and {cls.__name__}"
            )
        cls.name = name
        _BY_NAME[name] = cls
        _BY_CODEC[codec_id] = cls
        return cls

    return decorate


def names() -> list[str]:
    """Registered compressor names (installed plugins' included, ``edgestream.codecs``), sorted."""
    plugins.load_group(plugins.CODECS)
    return sorted(_BY_NAME)


def compressor_class(name: str) -> type[Compressor]:
    """The class registered under ``name`` (looked up in the installed plugins when not registered yet)."""
    if name not in _BY_NAME:
        plugins.load_group(plugins.CODECS)
    try:
        return _BY_NAME[name]
    except KeyError:
        raise CompressorConfigError(
            f"unknown compressor {name!r}; known: {', '.join(names())}{plugins.failure_note(plugins.CODECS)}",
            reason=errors.UNKNOWN_COMPRESSOR,
        ) from None


def create(name: str, **params: Any) -> Compressor:
    """A new compressor ``name`` configured with ``params`` (each compressor validates its own)."""
    cls = compressor_class(name)
    try:
        return cls(**params)
    except TypeError as err:
        raise CompressorConfigError(f"bad parameters for {name!r}: {err}") from None


def name_of_codec(codec_id: int) -> str:
    """The registered name for a wire codec id."""
    return decoder_for(codec_id).name


def decoder_for(codec_id: int) -> Compressor:
    """A shared default instance able to decompress payloads of ``codec_id``."""
    decoder = _DECODERS.get(codec_id)
    if decoder is None:
        if codec_id not in _BY_CODEC:  # a peer's plugin codec, perhaps
            plugins.load_group(plugins.CODECS)
        cls = _BY_CODEC.get(codec_id)
        if cls is None:
            raise PayloadDecodeError(
                errors.UNKNOWN_CODEC, f"no compressor registered for codec id {codec_id}"
            )
        decoder = _DECODERS[codec_id] = cls()
    return decoder
