"""Input formats of sensor messages: how the bytes of one Kafka message become a ``RecordBatch``.

The registry (``register``, ``names``, ``format_named``) and the ``InputFormat`` /
``FormatDecoder`` interface live in ``streams.formats.base``, re-exported here. Adding a
format is one module in this package, registered with ``register`` and imported below;
nothing outside that module names the format.

A job picks one with ``input.format`` (``job/config.py`` ``InputSection``): its workers
decode with it and its simulated devices write it (``InputFormat.encode``).
"""

# Importing a format's module registers it, in this order.
from edgestream.streams.formats import native  # noqa: F401, I001
from edgestream.streams.formats import json_records  # noqa: F401
from edgestream.streams.formats import avro_records  # noqa: F401
from edgestream.streams.formats.base import (
    FormatDecoder,
    InputFormat,
    format_named,
    names,
    register,
    unregister,
)

__all__ = [
    "FormatDecoder",
    "InputFormat",
    "format_named",
    "names",
    "register",
    "unregister",
]
