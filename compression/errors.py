"""Exceptions of the compression package, each carrying a machine-readable reason."""

from __future__ import annotations

# Reason slugs. They are part of the public contract: the pipeline counts rejected
# gradients by reason and copies it into the dead-letter header, so keep them stable.
BAD_MAGIC = "bad_magic"
BAD_VERSION = "bad_version"
BAD_HEADER = "bad_header"
TRUNCATED = "truncated"
TRAILING_BYTES = "trailing_bytes"
TOO_LARGE = "too_large"
SHAPE_MISMATCH = "shape_mismatch"
LENGTH_MISMATCH = "length_mismatch"
DTYPE = "dtype"
UNKNOWN_CODEC = "unknown_codec"
CODEC_MISMATCH = "codec_mismatch"
CODEC_NOT_ALLOWED = "codec_not_allowed"
BAD_NAME = "bad_name"
DUPLICATE_LAYER = "duplicate_layer"
MISSING_LAYER = "missing_layer"
UNEXPECTED_LAYER = "unexpected_layer"
INDEX_OUT_OF_RANGE = "index_out_of_range"
INDEX_ORDER = "index_order"
VALUE_OUT_OF_RANGE = "value_out_of_range"
NON_FINITE = "non_finite"
EMPTY = "empty"
BAD_CONFIG = "bad_config"
UNKNOWN_COMPRESSOR = "unknown_compressor"


class CompressionError(Exception):
    """Base error of the package.

    ``reason`` is a short slug from the constants above; ``layer`` names the
    tensor concerned when one is known. ``str(err)`` reads
    ``"<reason>: <message> (layer '<name>')"``.
    """

    def __init__(self, reason: str, message: str, *, layer: str | None = None) -> None:
        self.reason = reason
        self.message = message
        self.layer = layer
        super().__init__(self._render())

    def _render(self) -> str:
        where = f" (layer {self.layer!r})" if self.layer is not None else ""
        return f"{self.reason}: {self.message}{where}"

    def with_layer(self, layer: str) -> CompressionError:
        """Return this error annotated with ``layer`` (kept if already set)."""
        if self.layer is None:
            self.layer = layer
            self.args = (self._render(),)
        return self


class PayloadDecodeError(CompressionError):
    """Bytes received from the wire were rejected; nothing from them may reach a model."""


class CompressorConfigError(CompressionError, ValueError):
    """A compressor, controller or codec was configured with invalid parameters."""

    def __init__(self, message: str, *, reason: str = BAD_CONFIG) -> None:
        super().__init__(reason, message)
