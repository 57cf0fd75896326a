"""Input format ``"json"``: sensor readings as JSON objects, mapped onto a ``RecordBatch``.

A message (one Kafka value, UTF-8 JSON) is one reading, a JSON object, or an array of
readings; each reading becomes one record. ``JsonMapping`` (built by ``parse_params``
from the user's mapping) says where each column of the batch is found in a reading, as
dotted paths of object keys (``"imu.ax"`` is ``reading["imu"]["ax"]``):

* ``features`` (required): a list of paths, each naming a number (features of shape
  ``(len(features),)``, in that order), or one path naming an array of numbers, possibly
  nested lists (an 8x8 image: shape ``(8, 8)``); every reading of a message has the same
  shape (the stream's, when the decoder is given ``expected_shape``);
* ``label``: an integer (not a bool, not a float) in ``[0, num_classes)``; either every
  reading of a message has one or none has (an unlabelled message);
* ``event_time`` with ``time_unit``: a number of seconds (``s``, the default),
  milliseconds (``ms``), microseconds (``us``) or nanoseconds (``ns``) since the epoch,
  or an ISO 8601 string with a timezone (``iso8601``: ``Z`` or an offset such as
  ``+02:00``; Python's ``datetime.fromisoformat``, microsecond precision). Without
  ``event_time`` every record takes the message's Kafka timestamp;
* ``device``: the device id in each reading (all of a message the same, the topic's
  when the stream expects one); without it the stream's expected device;
* ``record_id``: an integer in ``[0, 2**64)``, the record's ``seq``; without it
  ``offset * limits.max_records + index`` (the message's partition offset and the
  reading's index in it), or the index when the offset is unknown;
* ``extra``: ``"ignore"`` (default) or ``"reject"`` a field no path names (the content
  of an array feature is not a field).

A bad message raises ``RecordDecodeError`` with a detail naming the field and the
reading's index, checked in this order: the size (``too_large``, before parsing), the
JSON (``bad_json``: not JSON, NaN/Infinity literals, a number beyond a double, invalid
UTF-8, or not an object / array of objects; ``bad_count``: an empty array;
``too_large``: more readings than ``limits.max_records``), then per column: device
(``missing_field``, ``bad_type``, ``bad_device``), features (``missing_field``,
``bad_type`` for a non-number, a number as a string, a bool, ragged lists;
``bad_shape``; ``non_finite`` for a value beyond the float32 range), label
(``missing_field``, ``bad_type``, ``bad_label``), event time (``missing_field``,
``bad_time``), record id (``missing_field``, ``bad_type``), extra fields
(``extra_field``); last, the value range as ``codec.decode`` checks it
(``OutOfRange`` with the decoded batch and the mask of its bad records).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import chain, repeat
from operator import itemgetter
from typing import Any

import numpy as np
import orjson

from edgestream.streams import codec
from edgestream.streams.errors import RecordDecodeError
from edgestream.streams.formats.base import InputFormat, register
from edgestream.streams.records import RecordBatch

#: ``time_unit`` values: how many of the unit make a second (None: an ISO 8601 string).
TIME_UNITS: dict[str, float | None] = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9, "iso8601": None}
#: ``extra`` values.
EXTRA = ("ignore", "reject")
#: The keys of the user's mapping.
KEYS = ("features", "label", "event_time", "time_unit", "device", "record_id", "extra")

_EXAMPLE = ('a list of fields that each hold a number (["imu.ax", "imu.ay"]), or one field holding an array '
            '("pixels"; in a job file: input.features_array = "pixels")')


@dataclass(frozen=True)
class JsonMapping:
    """Where a reading keeps each column of a record (validated on construction).

    ``features``: the dotted paths of the feature fields; ``features_array``: True when
    ``features`` is one path naming an array field (its shape is the record's), False
    when each path names one number. The other paths are optional (None).
    """

    features: tuple[str, ...]
    features_array: bool = False
    label: str | None = None
    event_time: str | None = None
    time_unit: str = "s"
    device: str | None = None
    record_id: str | None = None
    extra: str = "ignore"

    def __post_init__(self) -> None:
        if isinstance(self.features, Sequence) and not isinstance(self.features, str):
            object.__setattr__(self, "features", tuple(self.features))
        if not isinstance(self.features, tuple) or not self.features:
            raise ValueError(f"features: give at least one field path: {_EXAMPLE}")
        if self.features_array and len(self.features) != 1:
            raise ValueError("features: an array feature is one path (features = \"pixels\")")
        for path in self.features:
            _check_path("features", path)
        for key in ("label", "event_time", "device", "record_id"):
            path = getattr(self, key)
            if path is not None:
                _check_path(key, path)
        if self.time_unit not in TIME_UNITS:
            raise ValueError(
                f"time_unit = {self.time_unit!r}: use one of {', '.join(map(repr, TIME_UNITS))}"
            )
        if self.time_unit != "s" and self.event_time is None:
            raise ValueError(
                f"time_unit = {self.time_unit!r} without event_time: name the event time's field "
                "(event_time = \"ts\"), or remove time_unit to use the Kafka timestamp"
            )
        if self.extra not in EXTRA:
            raise ValueError(f"extra = {self.extra!r}: use \"ignore\" or \"reject\"")
        # Every mapped field is its own: none twice, none inside another (a value cannot
        # also be an object holding another field).
        named = [(f"features {path!r}", tuple(path.split("."))) for path in self.features]
        named += [
            (f"{key} {getattr(self, key)!r}", tuple(getattr(self, key).split(".")))
            for key in ("label", "event_time", "device", "record_id")
            if getattr(self, key) is not None
        ]
        for i, (what, parts) in enumerate(named):
            for other, other_parts in named[:i]:
                if parts == other_parts:
                    raise ValueError(f"{what} and {other} name the same field; map each field once")
                short, long_ = sorted((parts, other_parts), key=len)
                if long_[: len(short)] == short:
                    raise ValueError(
                        f"{what} and {other} overlap: {'.'.join(short)!r} cannot be both a value "
                        f"and the object holding {'.'.join(long_)!r}"
                    )

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> JsonMapping:
        """The mapping from the user's keys (``KEYS``); ``ValueError`` saying what to write."""
        if not isinstance(params, Mapping):
            raise ValueError(
                f"the json format's parameters are a mapping of {', '.join(KEYS)}, not {type(params).__name__}"
            )
        unknown = [k for k in params if k not in KEYS]
        if unknown:
            raise ValueError(
                f"unknown key(s) {', '.join(map(repr, unknown))} for the json format; the keys are "
                f"{', '.join(KEYS)}"
            )
        if "features" not in params:
            raise ValueError(f"features is required: {_EXAMPLE}")
        features = params["features"]
        if isinstance(features, str):
            paths, array = (features,), True
        elif isinstance(features, Sequence) and all(isinstance(p, str) for p in features):
            paths, array = tuple(features), False
        else:
            raise ValueError(f"features = {features!r}: {_EXAMPLE}")
        optional = {}
        for key in ("label", "event_time", "device", "record_id"):
            value = params.get(key)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{key} = {value!r}: give the dotted path of a field, e.g. {key} = \"meta.{key}\"")
            optional[key] = value
        for key, default in (("time_unit", "s"), ("extra", "ignore")):
            value = params.get(key, default)
            if not isinstance(value, str):
                raise ValueError(f"{key} = {value!r}: a string (see the json format's {key} values)")
            optional[key] = value
        return cls(features=paths, features_array=array, **optional)


def _check_path(key: str, path: object) -> None:
    if not isinstance(path, str) or not path or "" in path.split("."):
        raise ValueError(
            f"{key}: {path!r} is not a field path: write the object keys joined by dots, e.g. \"imu.ax\""
        )


@register("json")
class JsonFormat(InputFormat):
    """JSON readings (this module's docstring); parameters: ``JsonMapping``'s keys."""

    def parse_params(self, params: Mapping[str, Any]) -> JsonMapping:
        return JsonMapping.from_params(params)

    def encode(self, params: object, batch: RecordBatch) -> bytes:
        """``batch`` as an array of readings laid out as the mapping says (a simulated device):
        features at their paths (an array feature as nested lists), the label, the event
        time in the mapping's unit (none mapped: the decoder takes the Kafka timestamp, so
        the record's own is not sent), the device and the record id (``seq``) where mapped."""
        mapping = params if isinstance(params, JsonMapping) else self.parse_params(params)  # type: ignore[arg-type]
        return orjson.dumps(readings_of(mapping, batch))

    def decoder(
        self,
        params: object,
        limits: codec.DecodeLimits = codec.DEFAULT_LIMITS,
        *,
        expected_device: str | None = None,
        expected_shape: tuple[int, ...] | None = None,
        value_range: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> JsonDecoder:
        mapping = params if isinstance(params, JsonMapping) else self.parse_params(params)  # type: ignore[arg-type]
        return JsonDecoder(
            mapping, limits, expected_device=expected_device, expected_shape=expected_shape,
            value_range=value_range,
        )


def readings_of(mapping: JsonMapping, batch: RecordBatch) -> list[dict[str, Any]]:
    """``batch`` as readings laid out as ``mapping`` says (``JsonFormat.encode`` before the
    JSON text; the Avro format writes the same readings as Avro records)."""
    count = batch.count
    features = batch.features.reshape(count, -1) if not mapping.features_array else batch.features
    if not mapping.features_array and features.shape[1] != len(mapping.features):
        raise ValueError(f"{features.shape[1]} features per record, but the mapping names "
                         f"{len(mapping.features)} feature fields")
    columns: list[tuple[str, list[Any]]] = []
    if mapping.features_array:
        columns.append((mapping.features[0], features.tolist()))
    else:
        columns += [(path, features[:, j].tolist()) for j, path in enumerate(mapping.features)]
    if mapping.label is not None and batch.labels is not None:
        columns.append((mapping.label, batch.labels.tolist()))
    if mapping.event_time is not None:
        scale = TIME_UNITS[mapping.time_unit]
        times = ([_iso_text(t) for t in batch.event_time.tolist()] if scale is None
                 else (batch.event_time * scale).tolist())
        columns.append((mapping.event_time, times))
    if mapping.device is not None:
        columns.append((mapping.device, [batch.device] * count))
    if mapping.record_id is not None:
        columns.append((mapping.record_id, batch.seq.tolist()))
    readings: list[dict[str, Any]] = [{} for _ in range(count)]
    for path, values in columns:
        *parents, leaf = path.split(".")
        for reading, value in zip(readings, values, strict=True):
            node = reading
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = value
    return readings


class _Field:
    """One mapped path, split once: a fast getter and the slow walk that names what is wrong."""

    __slots__ = ("role", "dotted", "parts", "get")

    def __init__(self, role: str, dotted: str) -> None:
        self.role = role
        self.dotted = dotted
        self.parts = tuple(dotted.split("."))
        self.get = _getter(self.parts)

    def name(self) -> str:
        return f"{self.role} {self.dotted!r}"

    def values(self, readings: list[dict]) -> list[Any]:
        """The field of every reading; ``missing_field`` / ``bad_type`` naming the first bad one."""
        try:
            return list(map(self.get, readings))
        except (KeyError, TypeError):
            for i, reading in enumerate(readings):
                if self.find(reading, i) is _MISSING:
                    raise RecordDecodeError("missing_field", f"{self.name()} is missing at reading {i}") from None
            raise  # pragma: no cover  (the getter and the walk agree)

    def find(self, reading: dict, i: int) -> Any:
        """The field of ``reading`` (the ``i``-th), ``_MISSING`` when absent; ``bad_type``
        when a value on the way is not an object."""
        value: Any = reading
        for depth, key in enumerate(self.parts):
            if type(value) is not dict:
                holder = ".".join(self.parts[:depth])
                raise RecordDecodeError(
                    "bad_type", f"{self.name()} at reading {i}: {holder!r} is {_kind(value)}, not an object"
                )
            if key not in value:
                return _MISSING
            value = value[key]
        return value


_MISSING = object()


def _getter(parts: tuple[str, ...]) -> Callable[[Any], Any]:
    """``reading -> reading[p0][p1]...``; KeyError or TypeError when a step fails."""
    if len(parts) == 1:
        return itemgetter(parts[0])
    if len(parts) == 2:
        a, b = parts
        return lambda r: r[a][b]
    steps = tuple(map(itemgetter, parts))

    def get(reading: Any) -> Any:
        for step in steps:
            reading = step(reading)
        return reading

    return get


def _row_getter(fields: list[_Field]) -> Callable[[Any], tuple]:
    """``reading -> tuple of the fields' values``: one C-level lookup per reading when the
    fields share their parent object (all top-level, or all in ``imu``)."""
    parents = {f.parts[:-1] for f in fields}
    if len(parents) == 1 and len(fields) > 1:
        parent = next(iter(parents))
        leaves = itemgetter(*(f.parts[-1] for f in fields))
        if not parent:
            return leaves
        up = _getter(parent)
        return lambda r: leaves(up(r))
    getters = tuple(f.get for f in fields)
    if len(getters) == 1:
        only = getters[0]
        return lambda r: (only(r),)
    return lambda r: tuple([g(r) for g in getters])


def _kind(value: Any) -> str:
    """What a JSON value is, for a detail message."""
    if value is None:
        return "null"
    if value is True or value is False:
        return f"a bool ({'true' if value else 'false'})"
    if isinstance(value, str):
        text = value if len(value) <= 40 else value[:37] + "..."
        return f"a string ({text!r})"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    return f"a number ({value!r})"


_NUMBER = frozenset((int, float))
_LIST = {list}
_INT = {int}
_DICT = {dict}
_F4_MAX = float(np.finfo(np.float32).max)
_U64_END = 1 << 64
_BYTES = {bytes}
#: Messages ``decode_run`` decodes together: a run's parsed documents all alive at once
#: would outgrow the CPU caches (JSON numbers are Python objects) and parse slower.
RUN_PART = 8
_isfinite = np.isfinite
_min = np.minimum.reduce
_max = np.maximum.reduce
_abs = np.abs


@dataclass(frozen=True, slots=True)
class JsonLayout:
    """A good message's layout (``JsonDecoder.last_layout``): its number of readings
    (``count``, which the ingest reads to size a run) and whether they were labelled."""

    count: int
    labelled: bool


class JsonDecoder:
    """Decodes the JSON messages of one stream (fixed mapping, limits and expectations).

    With ``event_time`` and ``record_id`` mapped, a message needs nothing from Kafka (its
    timestamp, its offset), so consecutive messages can be decoded as one batch
    (``decode_run``): ``last_layout`` is then the shape of the last good message (readings
    per message, labelled or not), which a run must repeat. Without them ``last_layout``
    stays None and the ingest decodes message by message.
    """

    def __init__(
        self,
        mapping: JsonMapping,
        limits: codec.DecodeLimits = codec.DEFAULT_LIMITS,
        *,
        expected_device: str | None = None,
        expected_shape: tuple[int, ...] | None = None,
        value_range: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        if expected_device is not None and not codec.DEVICE_RE.fullmatch(expected_device):
            raise ValueError(f"invalid expected device id {expected_device!r}")
        if mapping.device is None and expected_device is None:
            raise ValueError(
                "a JSON stream needs its device: map the device id's field (device = \"...\") "
                "or give expected_device"
            )
        self.mapping = mapping
        self.limits = limits
        self.expected_device = expected_device
        self.expected_shape = tuple(expected_shape) if expected_shape is not None else None
        self.value_range = value_range
        self._bounds = codec.Bounds.of(value_range)
        self._features = [_Field("feature", p) for p in mapping.features]
        self._row = None if mapping.features_array else _row_getter(self._features)
        self._label = _Field("label", mapping.label) if mapping.label is not None else None
        self._time = _Field("event_time", mapping.event_time) if mapping.event_time is not None else None
        self._scale = TIME_UNITS[mapping.time_unit]
        self._device = _Field("device", mapping.device) if mapping.device is not None else None
        self._record_id = _Field("record_id", mapping.record_id) if mapping.record_id is not None else None
        self._levels = _object_levels(
            [f for f in (*self._features, self._label, self._time, self._device, self._record_id) if f]
        ) if mapping.extra == "reject" else None
        self._runs = self._time is not None and self._record_id is not None
        self._last: JsonLayout | None = None
        # ``_bool_free`` reads JSON text: a subclass parsing other bytes (Avro) must not use it.
        self._json_text = type(self)._parse is JsonDecoder._parse

    @property
    def last_layout(self) -> JsonLayout | None:
        """What ``decode_run`` expects of every message: the last good message's layout
        (None before one, and always when the mapping lacks ``event_time`` or ``record_id``)."""
        return self._last

    def decode_run(self, values: list[bytes]) -> RecordBatch | None:
        """All of ``values`` as one batch, in order, or None if they need one by one.

        The batch is the concatenation of what ``decode`` returns for each message, and
        every check of ``decode`` runs, on a few messages' readings at once. None when any
        message would fail on its own, or does not have ``last_layout``'s readings and
        labels: the caller then decodes them one by one, which names each bad one.
        """
        last = self._last
        if last is None or not values or set(map(type, values)) != _BYTES:
            return None
        if max(map(len, values)) > self.limits.max_message_bytes:
            return None
        parts = []
        for start in range(0, len(values), RUN_PART):
            part = self._run_part(values[start : start + RUN_PART], last)
            if part is None:
                return None
            parts.append(part)
        first = parts[0]
        if len(parts) == 1:
            return first
        dims = first.features.shape[1:]
        if any(p.device != first.device or p.features.shape[1:] != dims for p in parts):
            return None
        return RecordBatch(
            device=first.device, seq=np.concatenate([p.seq for p in parts]),
            event_time=np.concatenate([p.event_time for p in parts]),
            features=np.concatenate([p.features for p in parts]),
            labels=np.concatenate([p.labels for p in parts]) if last.labelled else None,
        )

    def _run_part(self, values: list[bytes], last: JsonLayout) -> RecordBatch | None:
        """``decode_run`` of a few messages: their readings decoded together, or None."""
        docs = self._parse_run(values)
        if docs is None:
            return None
        count, kinds = last.count, set(map(type, docs))
        if kinds == _LIST:
            if set(map(len, docs)) != {count}:
                return None
            readings = list(chain.from_iterable(docs))
            if set(map(type, readings)) != _DICT:
                return None
        elif kinds == _DICT and count == 1:
            readings = docs
        else:
            return None
        # No check below depends on which message a reading came from, and each message
        # has ``count`` readings, as many as a message that passed: the readings pass
        # together exactly when every message would pass alone (one device, one feature
        # shape, labels on all of them or none, is only stricter).
        try:
            batch = self._columns(readings, None, None, all(map(self._bool_free, values)))
        except RecordDecodeError:
            return None
        return batch if (batch.labels is not None) == last.labelled else None

    def decode(
        self, data: bytes | bytearray | memoryview, *, timestamp_s: float | None = None,
        offset: int | None = None,
    ) -> RecordBatch:
        """One message as a batch; ``RecordDecodeError`` naming the problem.

        ``timestamp_s``: the message's Kafka timestamp (seconds), every record's event
        time when the mapping has no ``event_time``; ``offset``: its partition offset,
        from which records without a ``record_id`` get their ``seq``.
        """
        limits = self.limits
        size = len(data)
        if size > limits.max_message_bytes:
            raise RecordDecodeError(
                "too_large", f"message is {size} bytes; the limit is {limits.max_message_bytes}"
            )
        batch = self._columns(self._readings(self._parse(data)), timestamp_s, offset, self._bool_free(data))
        if self._runs:
            last, labelled = self._last, batch.labels is not None
            if last is None or last.count != batch.count or last.labelled != labelled:
                self._last = JsonLayout(batch.count, labelled)
        return batch

    def _parse(self, data: bytes | bytearray | memoryview) -> Any:
        """The message's document (a reading or a list of readings), before any check of its shape."""
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise RecordDecodeError("bad_json", f"not valid JSON: {exc}") from None

    def _parse_run(self, values: list[bytes]) -> list[Any] | None:
        """The documents of ``values`` (``_parse`` of each), or None if one does not parse."""
        try:
            return list(map(self._parse, values))
        except RecordDecodeError:
            return None

    def _bool_free(self, data: bytes | bytearray | memoryview) -> bool:
        """True when the document of ``data`` surely holds no bool (so numpy's own type
        inference can check the feature values, ``_inferred``); False when it may."""
        if not self._json_text or (type(data) is not bytes and type(data) is not bytearray):
            return False
        # A bool is the literal true or false outside a string. Searching a digit-heavy text
        # for those words is slow (numpy's inference would then save nothing), while a
        # single letter is found at memchr speed: a text without any "u" has no "true".
        return (data.find(b"u") < 0 or b"true" not in data) and (data.find(b"f") < 0 or b"false" not in data)

    def decode_readings(self, doc: Any, *, timestamp_s: float | None = None, offset: int | None = None,
                        bool_free: bool = False) -> RecordBatch:
        """A parsed message (one reading, a dict, or a list of them) as a batch, by the mapping
        (``decode`` after parsing; another format whose messages parse to the same values,
        such as Avro records, maps them here too). ``bool_free``: the caller knows that no
        value in ``doc`` is a bool (a faster check of the features, same outcome)."""
        return self._columns(self._readings(doc), timestamp_s, offset, bool_free)

    def _readings(self, doc: Any) -> list[dict]:
        """The readings of a parsed message: its shape and count checked."""
        limits = self.limits
        if type(doc) is dict:
            readings = [doc]
        elif type(doc) is list:
            readings = doc
            if set(map(type, readings)) != _DICT:
                if not readings:
                    raise RecordDecodeError("bad_count", "the message is an empty array: no readings")
                i = next(i for i, r in enumerate(readings) if type(r) is not dict)
                raise RecordDecodeError(
                    "bad_json", f"reading {i} is {_kind(readings[i])}, not an object"
                )
        else:
            raise RecordDecodeError(
                "bad_json",
                f"the message is {_kind(doc)}: send one reading (a JSON object) or an array of readings",
            )
        count = len(readings)
        if count > limits.max_records:
            raise RecordDecodeError("too_large", f"{count} readings; the limit is {limits.max_records}")
        return readings

    def _columns(self, readings: list[dict], timestamp_s: float | None, offset: int | None,
                 bool_free: bool) -> RecordBatch:
        """The batch of ``readings`` (a message's, or a run's: nothing here depends on which
        message a reading came from), every column checked."""
        device = self._device_of(readings)
        if self._row is not None:
            features, finite = self._features_of(readings, bool_free)
        else:
            features, finite = self._array_of(readings, bool_free)
        # Values all within the float32 range are finite; only otherwise is the (slower)
        # finiteness check needed, and it then names the first value beyond it.
        if not finite:
            self._check_finite(features, readings)
        bounds = self._bounds
        in_range = bounds is None or bounds.holds(features)
        labels = self._labels_of(readings) if self._label is not None else None
        event_time = self._times_of(readings, timestamp_s)
        seq = self._seq_of(readings, offset)
        if self._levels is not None:
            self._check_extra(readings)
        batch = RecordBatch(device=device, seq=seq, event_time=event_time, features=features, labels=labels)
        if not in_range:
            assert bounds is not None
            raise bounds.violation(batch)
        return batch

    # --- columns ----------------------------------------------------------------------
    def _device_of(self, readings: list[dict]) -> str:
        field = self._device
        if field is None:
            assert self.expected_device is not None
            return self.expected_device
        values = field.values(readings)
        try:
            distinct = set(values)
        except TypeError:  # an object or an array among them
            distinct = set()
        if len(distinct) == 1:
            device = values[0]
            if type(device) is str and codec.DEVICE_RE.fullmatch(device):
                if self.expected_device is not None and device != self.expected_device:
                    raise RecordDecodeError(
                        "bad_device", f"device {device!r} on the stream of {self.expected_device!r}"
                    )
                return device
        for i, value in enumerate(values):
            if type(value) is not str:
                raise RecordDecodeError("bad_type", f"{field.name()} at reading {i} is {_kind(value)}, not a string")
            if not codec.DEVICE_RE.fullmatch(value):
                raise RecordDecodeError(
                    "bad_device", f"device id {value!r} at reading {i} is not [A-Za-z0-9_.-]{{1,64}}"
                )
            if value != values[0]:
                raise RecordDecodeError(
                    "bad_device",
                    f"reading {i} is from device {value!r}, reading 0 from {values[0]!r}: "
                    "a message carries the readings of one device",
                )
        raise AssertionError("unreachable")  # pragma: no cover

    def _features_of(self, readings: list[dict], bool_free: bool) -> tuple[np.ndarray, bool]:
        """Scalar feature fields: shape (count, len(features)), and ``_shaped``'s flag."""
        row = self._row
        assert row is not None
        try:
            rows = list(map(row, readings))
        except (KeyError, TypeError):
            for i, reading in enumerate(readings):
                for field in self._features:
                    if field.find(reading, i) is _MISSING:
                        raise RecordDecodeError(
                            "missing_field", f"{field.name()} is missing at reading {i}"
                        ) from None
            raise  # pragma: no cover
        if bool_free:
            out = self._inferred(rows, 2)
            if out is not None:
                return self._shaped(out)
        if not set(map(type, chain.from_iterable(rows))) <= _NUMBER:
            for i, values in enumerate(rows):
                for field, value in zip(self._features, values, strict=True):
                    if type(value) not in _NUMBER:
                        raise RecordDecodeError(
                            "bad_type", f"{field.name()} at reading {i} is {_kind(value)}, not a number"
                        )
        return self._shaped(np.asarray(rows, dtype=np.float64))

    def _array_of(self, readings: list[dict], bool_free: bool) -> tuple[np.ndarray, bool]:
        """One array feature field: shape (count, *the array's shape), and ``_shaped``'s flag."""
        field = self._features[0]
        values = field.values(readings)
        if bool_free:
            out = self._inferred(values, None)
            if out is not None:
                return self._shaped(out)
        # Level by level through the nested lists with C-level maps: all lists, then all numbers.
        level, depth = values, 0
        while True:
            types = set(map(type, level))
            if types == _LIST and depth < self.limits.max_ndim:
                level = list(chain.from_iterable(level))
                depth += 1
            elif depth > 0 and types <= _NUMBER:
                break
            else:
                self._diagnose_arrays(field, values)
        try:
            out = np.asarray(values, dtype=np.float64)
        except ValueError:  # ragged: lists of different lengths
            self._diagnose_arrays(field, values)
        return self._shaped(out)

    def _inferred(self, values: list[Any], ndim: int | None) -> np.ndarray | None:
        """``values`` as a float64 array when a conversion that refuses what is not a number
        shows them to be what the level-by-level check accepts; None when it cannot tell
        (that check then decides, and names what is wrong).

        Only for values holding no bool, which both conversions take for a number. Flat
        arrays of one length go through ``array("d")``, which refuses anything but a number
        (and is faster than numpy on lists); anything else through numpy's type inference,
        where a value that is not an int or a float makes the dtype a string or object one,
        and lists of different lengths or depths make numpy raise. ``ndim``: the array's
        required dims (scalar features: 2); None, an array feature's: at least one list
        level per reading, at most ``limits.max_ndim``.
        """
        out = _flat_rows(values) if ndim is None else None
        if out is None:
            try:
                out = np.array(values)
            except (ValueError, TypeError, OverflowError, RecursionError):
                return None
            kind = out.dtype.kind
            if kind not in "fiu":
                return None
            if kind != "f":
                # Integers through float64 first, as the check's np.asarray(..., float64)
                # does: the float32 that follows rounds the same double.
                out = out.astype(np.float64)
        if ndim is not None and out.ndim != ndim or not 2 <= out.ndim <= self.limits.max_ndim + 1:
            return None
        return out

    def _diagnose_arrays(self, field: _Field, values: list[Any]) -> None:
        """Raise the error of the first reading whose array is not right, or whose shape
        differs from the first reading's."""
        first: tuple[int, ...] | None = None
        for i, value in enumerate(values):
            shape = _shape_of(value, field, i, self.limits.max_ndim)
            if first is None:
                first = shape
            elif shape != first:
                raise RecordDecodeError(
                    "bad_shape",
                    f"{field.name()} at reading {i} has shape {shape}, at reading 0 {first}: "
                    "the readings of a message have one shape",
                )
        raise AssertionError("unreachable")  # pragma: no cover

    def _shaped(self, values: np.ndarray) -> tuple[np.ndarray, bool]:
        """float64 ``values`` checked for shape, as float32; and True when they are all
        within the float32 range (so finite), False when ``_check_finite`` must name one."""
        limits = self.limits
        dims = values.shape[1:]
        per_record = 1
        for d in dims:
            per_record *= d
        if 0 in dims:
            raise RecordDecodeError("bad_shape", f"features of shape {dims}: an empty array")
        if per_record > limits.max_features_per_record:
            raise RecordDecodeError(
                "bad_shape",
                f"features of shape {dims} hold {per_record} values; the limit is {limits.max_features_per_record}",
            )
        if self.expected_shape is not None and dims != self.expected_shape:
            raise RecordDecodeError("bad_shape", f"feature shape {dims}, the stream's is {self.expected_shape}")
        bounds = self._bounds
        if bounds is not None and bounds.width is not None and per_record != bounds.width:
            raise RecordDecodeError(
                "bad_shape", f"feature shape {dims} has {per_record} values; the value range declares {bounds.width}"
            )
        # Beyond float32 a (finite) double would become infinite: make it infinite here
        # instead of casting blindly (and numpy warning about the overflow); _check_finite
        # names it. Min and max reductions make no temporary array, and fail on NaN too.
        if not (float(_min(values, axis=None)) >= -_F4_MAX and float(_max(values, axis=None)) <= _F4_MAX):
            return np.where(_abs(values) <= _F4_MAX, values, np.inf).astype(np.float32), False
        return values.astype(np.float32), True

    def _check_finite(self, features: np.ndarray, readings: list[dict]) -> None:
        count = len(features)
        flat = features.reshape(count, -1)
        finite = _isfinite(flat)
        if finite.all():
            return
        record, index = (int(i) for i in np.argwhere(~finite)[0])
        bad = int(np.count_nonzero(~finite.all(axis=1)))
        if self._row is not None:
            where = self._features[index].name()
            value = self._features[index].find(readings[record], record)
        else:
            dims = features.shape[1:]
            at = tuple(int(i) for i in np.unravel_index(index, dims))
            where = f"{self._features[0].name()}{list(at)}"
            value = self._features[0].find(readings[record], record)
            for i in at:
                value = value[i]
        raise RecordDecodeError(
            "non_finite",
            f"{where} at reading {record} is {value!r}, beyond the float32 range "
            f"(+-{_F4_MAX:.7g}); {bad} of {count} readings have such values",
        )

    def _labels_of(self, readings: list[dict]) -> np.ndarray | None:
        field = self._label
        assert field is not None
        try:
            labels = list(map(field.get, readings))
        except (KeyError, TypeError):
            found = [field.find(r, i) for i, r in enumerate(readings)]
            missing = [v is _MISSING for v in found]
            if all(missing):
                return None  # an unlabelled message
            i, j = missing.index(True), missing.index(False)
            raise RecordDecodeError(
                "missing_field",
                f"{field.name()} is missing at reading {i} but present at reading {j}: "
                "label every reading of a message or none",
            ) from None
        if set(map(type, labels)) != _INT:
            i = next(i for i, v in enumerate(labels) if type(v) is not int)
            raise RecordDecodeError("bad_type", f"{field.name()} at reading {i} is {_kind(labels[i])}, not an integer")
        bound = self.limits.num_classes if self.limits.num_classes is not None else 1 << 31
        if min(labels) < 0 or max(labels) >= bound:
            i = next(i for i, v in enumerate(labels) if not 0 <= v < bound)
            raise RecordDecodeError("bad_label", f"{field.name()} at reading {i} is {labels[i]}, allowed [0, {bound})")
        return np.asarray(labels, dtype=np.int32)

    def _times_of(self, readings: list[dict], timestamp_s: float | None) -> np.ndarray:
        field = self._time
        count = len(readings)
        if field is None:
            if timestamp_s is None:
                raise RecordDecodeError(
                    "bad_time", "no event_time field is mapped and the message has no Kafka timestamp"
                )
            t = float(timestamp_s)
            if not math.isfinite(t):
                raise RecordDecodeError("bad_time", f"the message's Kafka timestamp is {t}")
            return np.full(count, t, dtype=np.float64)
        values = field.values(readings)
        scale = self._scale
        if scale is None:
            return np.array([_iso_seconds(v, field, i) for i, v in enumerate(values)], dtype=np.float64)
        if not set(map(type, values)) <= _NUMBER:
            i = next(i for i, v in enumerate(values) if type(v) not in _NUMBER)
            raise RecordDecodeError(
                "bad_time",
                f"{field.name()} at reading {i} is {_kind(values[i])}, not a number "
                f"({self.mapping.time_unit} since the epoch)",
            )
        # orjson's numbers are finite, but a format sharing this mapping may not be (an Avro
        # double can be NaN or infinite).
        times = np.asarray(values, dtype=np.float64)
        finite = np.isfinite(times)
        if not finite.all():
            i = int(np.argmin(finite))
            raise RecordDecodeError("bad_time", f"{field.name()} at reading {i} is {values[i]}, not a finite number")
        return times / scale if scale != 1.0 else times

    def _seq_of(self, readings: list[dict], offset: int | None) -> np.ndarray:
        field = self._record_id
        count = len(readings)
        if field is None:
            index = np.arange(count, dtype=np.uint64)
            if offset is None:
                return index
            base = int(offset) * self.limits.max_records
            if base < 0 or base + count > _U64_END:
                raise ValueError(f"offset {offset} gives no sequence numbers in [0, 2**64)")
            return index + np.uint64(base)
        values = field.values(readings)
        if set(map(type, values)) != _INT or min(values) < 0 or max(values) >= _U64_END:
            i = next(i for i, v in enumerate(values) if type(v) is not int or not 0 <= v < _U64_END)
            raise RecordDecodeError(
                "bad_type", f"{field.name()} at reading {i} is {_kind(values[i])}, not an integer in [0, 2**64)"
            )
        return np.asarray(values, dtype=np.uint64)

    def _check_extra(self, readings: list[dict]) -> None:
        assert self._levels is not None
        for holder, get, allowed in self._levels:
            if get is None:
                objects: Iterable[Any] = readings
            else:
                try:
                    objects = list(map(get, readings))
                except (KeyError, TypeError):  # an optional field's object absent somewhere
                    objects = [_find(r, holder) for r in readings]
            if all(type(o) is not dict or allowed.issuperset(o) for o in objects):
                continue
            for i, reading in enumerate(readings):
                obj = reading if get is None else _find(reading, holder)
                if type(obj) is dict:
                    for key in obj:
                        if key not in allowed:
                            dotted = ".".join((*holder, key))
                            raise RecordDecodeError(
                                "extra_field",
                                f"field {dotted!r} at reading {i} is not in the mapping (extra = \"reject\")",
                            )


def _flat_rows(values: list[Any]) -> np.ndarray | None:
    """Lists of numbers (or bools), all of one length, as a float64 array of one row each;
    None for anything else (a value not a list, lists of other lengths, a nested list, a
    string, null, an object)."""
    if set(map(type, values)) != _LIST:
        return None
    widths = set(map(len, values))
    if len(widths) != 1:
        return None
    try:
        rows = list(map(array, repeat("d", len(values)), values))
    except (TypeError, OverflowError):
        return None
    return np.frombuffer(b"".join(rows), np.float64).reshape(len(values), widths.pop())


def _object_levels(fields: list[_Field]) -> list[tuple[tuple[str, ...], Callable[[Any], Any] | None, frozenset]]:
    """For ``extra = "reject"``: every object a mapped path goes through (the reading
    itself first), its getter and the keys it may hold."""
    keys: dict[tuple[str, ...], set[str]] = {}
    for field in fields:
        for depth in range(len(field.parts)):
            keys.setdefault(field.parts[:depth], set()).add(field.parts[depth])
    return [
        (holder, _getter(holder) if holder else None, frozenset(allowed))
        for holder, allowed in sorted(keys.items(), key=lambda item: len(item[0]))
    ]


def _find(reading: Any, parts: tuple[str, ...]) -> Any:
    """The value at ``parts``, or ``_MISSING`` when a step is absent or not an object."""
    for key in parts:
        if type(reading) is not dict or key not in reading:
            return _MISSING
        reading = reading[key]
    return reading


def _shape_of(value: Any, field: _Field, i: int, max_ndim: int) -> tuple[int, ...]:
    """The shape of one reading's array feature; ``bad_type`` for anything but nested
    lists of numbers (ragged included), ``bad_shape`` beyond ``max_ndim`` dims."""
    if type(value) is not list:
        raise RecordDecodeError(
            "bad_type", f"{field.name()} at reading {i} is {_kind(value)}, not an array of numbers"
        )
    shape: list[int] = []
    level = [value]
    while True:
        types = set(map(type, level))
        if types == _LIST:
            if len(shape) == max_ndim:
                raise RecordDecodeError(
                    "bad_shape", f"{field.name()} at reading {i} is nested deeper than {max_ndim} levels"
                )
            lengths = set(map(len, level))
            if len(lengths) > 1:
                raise RecordDecodeError(
                    "bad_type",
                    f"{field.name()} at reading {i} is ragged: lists of lengths {sorted(lengths)} at depth {len(shape)}",
                )
            shape.append(lengths.pop())
            level = list(chain.from_iterable(level))
        elif types <= _NUMBER:
            return tuple(shape)
        elif list in types:
            raise RecordDecodeError(
                "bad_type", f"{field.name()} at reading {i} is ragged: numbers and lists at depth {len(shape)}"
            )
        else:
            bad = next(v for v in level if type(v) not in _NUMBER)
            raise RecordDecodeError(
                "bad_type", f"{field.name()} at reading {i} holds {_kind(bad)}, not a number"
            )


def _iso_seconds(value: Any, field: _Field, i: int) -> float:
    """Seconds since the epoch of an ISO 8601 string with a timezone; ``bad_time`` otherwise."""
    if type(value) is not str:
        raise RecordDecodeError("bad_time", f"{field.name()} at reading {i} is {_kind(value)}, not an ISO 8601 string")
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise RecordDecodeError(
            "bad_time", f"{field.name()} at reading {i} is {_kind(value)}, not an ISO 8601 date and time"
        ) from None
    if moment.tzinfo is None:
        raise RecordDecodeError(
            "bad_time",
            f"{field.name()} at reading {i} is {_kind(value)}, without a timezone: end it with Z or an "
            "offset such as +02:00",
        )
    try:
        return moment.timestamp()
    except (OverflowError, ValueError):  # pragma: no cover  (every aware datetime has one)
        raise RecordDecodeError(
            "bad_time", f"{field.name()} at reading {i} is {_kind(value)}, out of range"
        ) from None


def _iso_text(seconds: float) -> str:
    """Seconds since the epoch as an ISO 8601 UTC time to the microsecond (``...Z``)."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
