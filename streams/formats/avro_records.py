"""Input format ``"avro"``: sensor readings as Avro records, mapped onto a ``RecordBatch``.

A message is one Avro datum: a record (one reading) or an array of records (readings),
decoded with fastavro and then mapped exactly as JSON readings are (the same keys,
``features``, ``label``, ``event_time`` ...; ``streams/formats/json_records.py``), so a
field has the same meaning and the same checks in both formats. Two framings:

* **Schema registry** (``schema_registry`` = the base URL of a Confluent-compatible REST
  API, e.g. Apicurio's ``http://host:8080/apis/ccompat/v7``): the Confluent wire format,
  a zero magic byte, the writer schema's id (4 bytes, big-endian) and the Avro body. The
  writer schema is fetched by id once (``SchemaRegistry``) and cached. With
  ``schema_file`` too, that file is the **reader** schema: records written with an older
  or newer schema are resolved to it (Avro schema resolution: a field added with a
  default, a field removed), so producers can evolve their schema mid-stream.
* **Schema file only**: the message is the bare Avro body, written with that schema.

Logical types are read as their underlying type (a ``timestamp-millis`` is a number of
milliseconds: ``time_unit = "ms"``). A bad message raises ``RecordDecodeError``:
``too_large`` (before anything else), ``bad_magic`` (no zero magic byte or no schema id),
``unknown_schema`` (the registry has no schema of that id, or answered with something
that is not an Avro schema; the message is dead-lettered and can be replayed), ``bad_avro`` (bytes that are not a datum
of the writer schema, bytes left after it, or a writer schema the reader schema cannot
resolve), then the mapping's own reasons as for JSON.

A registry that does not answer (refused, timed out, HTTP 5xx) is no fault of the
messages: the ingest edge fetches every schema id it has not seen before it decodes a
fetch's messages (``AvroFormat.lookups``), off the event loop, and while the registry is
down it waits and tries again, so ingest stalls (the partitions' consumers stay in their
group) and nothing is dead-lettered for the outage. An id the registry says it does not
have is remembered for ``MISSING_TTL_S`` (its messages are dead-lettered without a request
each), then asked again.
"""

from __future__ import annotations

import functools
import io
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro
import numpy as np

from edgestream.streams import codec
from edgestream.streams.errors import LookupUnavailable, RecordDecodeError
from edgestream.streams.formats.base import InputFormat, register
from edgestream.streams.formats.json_records import KEYS as MAPPING_KEYS
from edgestream.streams.formats.json_records import JsonDecoder, JsonMapping, readings_of
from edgestream.streams.records import RecordBatch

#: The avro format's own keys (beside the mapping's).
AVRO_KEYS = ("schema_file", "schema_registry", "subject")
#: Seconds a registry request may take.
REGISTRY_TIMEOUT_S = 5.0
#: Seconds an id the registry has no schema of is remembered as missing.
MISSING_TTL_S = 30.0
#: Subject the simulated devices register their schema under (``subject`` overrides).
DEFAULT_SUBJECT = "edgestream-readings-value"
MAGIC = 0


def _plain(schema: Any) -> Any:
    """``schema`` without logical types (read as their underlying type)."""
    if isinstance(schema, dict):
        return {k: _plain(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [_plain(s) for s in schema]
    return schema


def parse_schema(text: str, where: str) -> Any:
    """A parsed Avro schema from its JSON text; ``ValueError`` naming ``where`` it came from.

    A schema with an array of items that take no bytes (``null``, an empty record) is
    refused: a few bytes of such an array could claim 2**63 items, which a reader would
    build one by one."""
    try:
        parsed = fastavro.parse_schema(_plain(json.loads(text)))
    except (ValueError, TypeError, KeyError, RecursionError, fastavro.schema.SchemaParseException) as exc:
        raise ValueError(f"{where} is not an Avro schema: {exc}") from None
    bad = _empty_items(parsed, {})
    if bad is not None:
        raise ValueError(f"{where} has an array of {bad}, whose items take no bytes: a tiny message could "
                         "claim billions of them; give the items a field")
    return parsed


def _named(schema: Any, names: dict[str, Any]) -> Any:
    """``schema`` with a reference to a named type replaced by its definition (seen so far)."""
    return names.get(schema, schema) if isinstance(schema, str) else schema


def _zero_size(schema: Any, names: dict[str, Any], seen: frozenset = frozenset()) -> bool:
    """Whether a datum of ``schema`` can take no bytes at all."""
    schema = _named(schema, names)
    if schema == "null":
        return True
    if isinstance(schema, dict):
        kind = schema.get("type")
        if kind == "record" or kind == "error":
            name = schema.get("name", "")
            if name in seen:
                return False  # a recursive record holds at least a union index to end it
            return all(_zero_size(f["type"], names, seen | {name}) for f in schema.get("fields", []))
        if kind == "fixed":
            return schema.get("size", 1) == 0
        return kind == "null" or isinstance(kind, dict) and _zero_size(kind, names, seen)
    return False


def _empty_items(schema: Any, names: dict[str, Any]) -> str | None:
    """The items type of an array in ``schema`` whose items take no bytes; None if none.
    A reference to a named type is not followed: its definition is walked where it stands."""
    if isinstance(schema, list):
        for branch in schema:
            found = _empty_items(branch, names)
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    if "name" in schema and schema.get("type") in ("record", "error", "enum", "fixed"):
        names.setdefault(schema["name"], schema)
    kind = schema.get("type")
    if kind == "array":
        if _zero_size(schema.get("items"), names):
            return json.dumps(schema.get("items"))[:80]
        return _empty_items(schema.get("items"), names)
    if kind == "map":
        return _empty_items(schema.get("values"), names)
    if kind in ("record", "error"):
        for f in schema.get("fields", []):
            found = _empty_items(f["type"], names)
            if found:
                return found
    if isinstance(kind, (dict, list)):
        return _empty_items(kind, names)
    return None


class SchemaRegistry:
    """A client of a Confluent-compatible schema registry's REST API (``url`` is its base,
    e.g. ``http://host:8080/apis/ccompat/v7``): schemas by id, cached, and registration."""

    def __init__(self, url: str, timeout_s: float = REGISTRY_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._schemas: dict[int, Any] = {}
        self._ids: dict[tuple[str, str], int] = {}
        #: Ids the registry has no (Avro) schema of: when it said so, and the error their messages get.
        self._missing: dict[int, tuple[float, RecordDecodeError]] = {}
        self._lock = threading.Lock()

    def _request(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST",
                                         headers={"Content-Type": "application/vnd.schemaregistry.v1+json",
                                                  "Accept": "application/vnd.schemaregistry.v1+json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return json.loads(response.read())

    def cached(self, schema_id: int) -> bool:
        """Whether ``schema`` answers ``schema_id`` without a request (a schema, or an id
        known to be missing within ``MISSING_TTL_S``)."""
        with self._lock:
            if schema_id in self._schemas:
                return True
            missing = self._missing.get(schema_id)
            return missing is not None and time.monotonic() - missing[0] < MISSING_TTL_S

    def fetch(self, schema_id: int) -> None:
        """Ask the registry for ``schema_id`` and cache the answer: the parsed schema, or
        the ``RecordDecodeError`` its messages get (no such id, not an Avro schema).
        ``LookupUnavailable`` if the registry does not answer (nothing cached). Blocking:
        the ingest edge calls it off the event loop."""
        try:
            reply = self._request(f"/schemas/ids/{schema_id}")
        except urllib.error.HTTPError as exc:
            if exc.code >= 500:
                raise LookupUnavailable(f"the schema registry at {self.url} answered HTTP {exc.code} for "
                                        f"schema {schema_id}") from None
            self._remember_missing(schema_id, RecordDecodeError(
                "unknown_schema", f"the schema registry at {self.url} has no schema {schema_id} (HTTP {exc.code})"))
            return
        except (OSError, ValueError) as exc:
            raise LookupUnavailable(f"the schema registry at {self.url} did not answer for schema {schema_id}: "
                                    f"{exc}") from None
        if reply.get("schemaType", "AVRO") != "AVRO" or not isinstance(reply.get("schema"), str):
            self._remember_missing(schema_id, RecordDecodeError("unknown_schema",
                                                                f"schema {schema_id} is not an Avro schema"))
            return
        try:
            parsed = parse_schema(reply["schema"], f"schema {schema_id} of {self.url}")
        except ValueError as exc:
            self._remember_missing(schema_id, RecordDecodeError("unknown_schema", str(exc)))
            return
        with self._lock:
            self._schemas[schema_id] = parsed
            self._missing.pop(schema_id, None)

    def _remember_missing(self, schema_id: int, error: RecordDecodeError) -> None:
        with self._lock:
            self._missing[schema_id] = (time.monotonic(), error)

    def schema(self, schema_id: int) -> Any:
        """The parsed writer schema of ``schema_id``; ``RecordDecodeError("unknown_schema")``
        if the registry has none, or does not answer (a caller that cannot wait; the ingest
        edge fetches first, ``fetch``)."""
        if not self.cached(schema_id):
            try:
                self.fetch(schema_id)
            except LookupUnavailable as exc:
                raise RecordDecodeError("unknown_schema", str(exc)) from None
        with self._lock:
            found = self._schemas.get(schema_id)
            missing = self._missing.get(schema_id)
        if found is not None:
            return found
        assert missing is not None
        raise missing[1]

    def register(self, subject: str, schema_text: str) -> int:
        """The id of ``schema_text`` under ``subject`` (registered if new; cached)."""
        key = (subject, schema_text)
        with self._lock:
            if key in self._ids:
                return self._ids[key]
        reply = self._request(f"/subjects/{subject}/versions", {"schema": schema_text})
        with self._lock:
            self._ids[key] = int(reply["id"])
        return int(reply["id"])


#: One client per registry URL in a process (its cache serves every stream).
_REGISTRIES: dict[str, SchemaRegistry] = {}
_REGISTRIES_LOCK = threading.Lock()


def registry_at(url: str) -> SchemaRegistry:
    with _REGISTRIES_LOCK:
        if url not in _REGISTRIES:
            _REGISTRIES[url] = SchemaRegistry(url)
        return _REGISTRIES[url]


@dataclass(frozen=True)
class AvroParams:
    """The mapping and the schema sources (validated by ``AvroFormat.parse_params``)."""

    mapping: JsonMapping
    schema_file: str | None = None
    schema_text: str | None = None  # the file's text
    schema: Any = None  # the file's schema, parsed
    schema_registry: str | None = None
    subject: str = DEFAULT_SUBJECT


@register("avro")
class AvroFormat(InputFormat):
    """Avro readings (this module's docstring); parameters: the json mapping's keys plus
    ``schema_file``, ``schema_registry`` and ``subject``."""

    def parse_params(self, params: Mapping[str, Any]) -> AvroParams:
        if not isinstance(params, Mapping):
            raise ValueError(f"the avro format's parameters are a mapping, not {type(params).__name__}")
        own = {k: params[k] for k in AVRO_KEYS if k in params}
        unknown = [k for k in params if k not in AVRO_KEYS and k not in MAPPING_KEYS]
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))} for the avro format; the keys are "
                             f"{', '.join((*MAPPING_KEYS, *AVRO_KEYS))}")
        for key, value in own.items():
            if not isinstance(value, str) or not value:
                raise ValueError(f"{key} = {value!r}: a non-empty string")
        mapping = JsonMapping.from_params({k: v for k, v in params.items() if k in MAPPING_KEYS})
        registry = own.get("schema_registry")
        if registry is not None and not registry.startswith(("http://", "https://")):
            raise ValueError(f"schema_registry = {registry!r}: the registry's base URL, e.g. "
                             "'http://localhost:8080/apis/ccompat/v7'")
        path = own.get("schema_file")
        if path is None and registry is None:
            raise ValueError("give schema_file (the readings' Avro schema, .avsc) or schema_registry (a "
                             "Confluent-compatible registry's URL), or both (the file is then the reader schema)")
        text = schema = None
        if path is not None:
            try:
                text = Path(path).read_text(encoding="utf-8")
            except OSError as exc:
                raise ValueError(f"schema_file = {path!r}: cannot read it: {exc.strerror or exc}") from None
            schema = parse_schema(text, f"schema_file {path!r}")
        return AvroParams(mapping, path, text, schema, registry, own.get("subject", DEFAULT_SUBJECT))

    def decoder(
        self,
        params: object,
        limits: codec.DecodeLimits = codec.DEFAULT_LIMITS,
        *,
        expected_device: str | None = None,
        expected_shape: tuple[int, ...] | None = None,
        value_range: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> AvroDecoder:
        parsed = params if isinstance(params, AvroParams) else self.parse_params(params)  # type: ignore[arg-type]
        registry = registry_at(parsed.schema_registry) if parsed.schema_registry else None
        return AvroDecoder(parsed, registry, limits, expected_device=expected_device,
                           expected_shape=expected_shape, value_range=value_range)

    def lookups(self, params: object, values: Sequence[bytes | None]) -> list[Callable[[], None]]:
        """A registry fetch of each schema id among ``values`` the registry client has not
        cached (none without a registry; a message too short for an id has none)."""
        parsed = params if isinstance(params, AvroParams) else self.parse_params(params)  # type: ignore[arg-type]
        if not parsed.schema_registry:
            return []
        registry = registry_at(parsed.schema_registry)
        ids = {int.from_bytes(value[1:5], "big") for value in values
               if value is not None and len(value) >= 5 and value[0] == MAGIC}
        return [functools.partial(registry.fetch, i) for i in sorted(ids) if not registry.cached(i)]

    def encode(self, params: object, batch: RecordBatch) -> bytes:
        """``batch`` as one message (a simulated device): the schema file's schema must be an
        array of reading records (or a record, for a batch of one). With a registry, the
        schema is registered under ``subject`` and the message carries its id."""
        parsed = params if isinstance(params, AvroParams) else self.parse_params(params)  # type: ignore[arg-type]
        if parsed.schema is None:
            raise ValueError("the avro format writes with schema_file's schema: give schema_file")
        readings = readings_of(parsed.mapping, batch)
        kind = parsed.schema.get("type") if isinstance(parsed.schema, dict) else None
        if kind == "array":
            datum: Any = readings
        elif len(readings) == 1:
            datum = readings[0]
        else:
            raise ValueError(f"schema_file {parsed.schema_file!r} holds one reading a message, and a batch of "
                             f"{len(readings)} was to be sent: give an array schema to send several")
        out = io.BytesIO()
        if parsed.schema_registry:
            schema_id = registry_at(parsed.schema_registry).register(parsed.subject, parsed.schema_text or "")
            out.write(bytes([MAGIC]) + schema_id.to_bytes(4, "big"))
        fastavro.schemaless_writer(out, parsed.schema, datum)
        return out.getvalue()


class AvroDecoder(JsonDecoder):
    """Decodes the Avro messages of one stream: the datum by its schemas, then the mapping."""

    def __init__(self, params: AvroParams, registry: SchemaRegistry | None, limits: codec.DecodeLimits,
                 **kwargs: Any) -> None:
        super().__init__(params.mapping, limits, **kwargs)
        self.params = params
        self.registry = registry

    def _parse(self, data: bytes | bytearray | memoryview) -> Any:
        body = memoryview(data)
        writer = reader = self.params.schema
        if self.registry is not None:
            if len(body) < 5 or body[0] != MAGIC:
                raise RecordDecodeError(
                    "bad_magic", "not the schema registry's wire format: a zero byte and a 4-byte schema id first")
            writer = self.registry.schema(int.from_bytes(body[1:5], "big"))
            body = body[5:]
        stream = io.BytesIO(body)
        try:
            datum = fastavro.schemaless_reader(stream, writer, reader if reader is not writer else None)
        except Exception as exc:  # noqa: BLE001 - fastavro raises many types on bad bytes: all are bad_avro
            raise RecordDecodeError("bad_avro", f"not an Avro datum of its schema: {type(exc).__name__}: {exc}"[:500]) \
                from None
        if stream.tell() != len(body):
            raise RecordDecodeError("bad_avro", f"{len(body) - stream.tell()} bytes after the Avro datum")
        return datum
