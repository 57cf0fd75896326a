"""The messages of ``predictions.<job>``: one schema, its encoder and its checking decoder.

With ``serve.predictions`` every worker publishes, for each record it trains on, what its
model predicted for that record before training on it (docs/serving.md "Predictions").
One message per record, keyed by the device id, a JSON object (UTF-8):

=====================  ==================================================================
field                  meaning
=====================  ==================================================================
``v``                  schema version, ``1``
``job``                the job's name (``job.name``)
``worker``             the worker that trained the record and published this; for
                       ``at = "serve"`` the ``edgestream serve`` instance that predicted it
``device``             the device id the record came from
``topic``              the device topic the record was read from (``input.topic``)
``partition``          its partition (int >= 0; null: unknown)
``offset``             the offset of the message that carried it (int >= 0; null: unknown);
                       a message may carry several records
``record_id``          the record's id: its sequence number (edgestream format), the field
                       ``input.record_id`` (JSON, Avro) or the number made from the offset;
                       an int in [0, 2^64)
``event_time``         the record's event time, seconds since the epoch (null: unknown)
``kafka_timestamp``    the Kafka timestamp of the message that carried it, seconds (null: none)
``model_version``      the worker's model version the prediction was made with (int >= 0)
``model_digest``       sha256 (64 lowercase hex digits) of that model's parameters
``predicted``          the predicted class (int >= 0)
``top_k``              ``[{"class": c, "p": probability}, ...]``: the ``serve.top_k`` most
                       probable classes, most probable first (``top_k[0].class ==
                       predicted``); probabilities in [0, 1], summing to at most 1
``at``                 ``step``: made just before the training step on the record;
                       ``arrival``: made when the record arrived without its label (delayed
                       labels), before the label was known; ``serve``: made by
                       ``edgestream serve`` (inference only, no training), with the model
                       version it was serving
``predicted_at``       when the prediction was made, seconds since the epoch
``published_at``       when the worker handed it to its producer, seconds since the epoch
``latency_event_s``    ``published_at - event_time`` (null when ``event_time`` is)
``latency_append_s``   ``published_at - kafka_timestamp`` (null when ``kafka_timestamp`` is)
=====================  ==================================================================

A reader ignores fields it does not know (later fields do not change ``v``). ``decode``
checks every field above and refuses a message that breaks any rule
(``streams.errors.PredictionRejected``). The rest of the module is the publishing side's
pure part: a batch's scores as columns (``Scored``), the top-k of a probability matrix,
the arrival-time predictions kept until their record is trained (``ArrivalPredictions``)
and the model digest computed once per version (``DigestCache``).
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import orjson

from edgestream.streams.errors import PredictionRejected
from edgestream.streams.records import RecordBatch

SCHEMA_VERSION = 1
#: When a prediction was made: before the training step, when its record arrived
#: without its label, or by ``edgestream serve`` (no training).
AT_STEP, AT_ARRIVAL, AT_SERVE = "step", "arrival", "serve"
AT = (AT_STEP, AT_ARRIVAL, AT_SERVE)
#: Largest record id (ids are unsigned 64-bit, like sequence numbers).
MAX_RECORD_ID = 2**64 - 1
#: How far a latency field may be from the difference of its times (float rounding).
LATENCY_TOLERANCE_S = 1e-3
#: How far above 1 the listed probabilities may sum (float32 softmax rounding).
PROBABILITY_TOLERANCE = 1e-4
_DIGEST = re.compile(r"[0-9a-f]{64}")
#: Fields every message holds (``latency_*`` are derived, and checked against the times).
FIELDS = ("v", "job", "worker", "device", "topic", "partition", "offset", "record_id", "event_time",
          "kafka_timestamp", "model_version", "model_digest", "predicted", "top_k", "at", "predicted_at",
          "published_at", "latency_event_s", "latency_append_s")


@dataclass(frozen=True)
class Prediction:
    """One decoded prediction message (the fields of the table above)."""

    job: str
    worker: str
    device: str
    topic: str
    partition: int | None
    offset: int | None
    record_id: int
    event_time: float | None
    kafka_timestamp: float | None
    model_version: int
    model_digest: str
    predicted: int
    #: ``(class, probability)`` pairs, most probable first.
    top_k: tuple[tuple[int, float], ...]
    at: str
    predicted_at: float
    published_at: float

    @property
    def latency_event_s(self) -> float | None:
        return None if self.event_time is None else self.published_at - self.event_time

    @property
    def latency_append_s(self) -> float | None:
        return None if self.kafka_timestamp is None else self.published_at - self.kafka_timestamp

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": SCHEMA_VERSION, "job": self.job, "worker": self.worker, "device": self.device,
            "topic": self.topic, "partition": self.partition, "offset": self.offset, "record_id": self.record_id,
            "event_time": self.event_time, "kafka_timestamp": self.kafka_timestamp,
            "model_version": self.model_version, "model_digest": self.model_digest, "predicted": self.predicted,
            "top_k": [{"class": c, "p": p} for c, p in self.top_k], "at": self.at,
            "predicted_at": self.predicted_at, "published_at": self.published_at,
            "latency_event_s": self.latency_event_s, "latency_append_s": self.latency_append_s,
        }


def encode(prediction: Prediction) -> bytes:
    """The message value of ``prediction`` (JSON; its key is ``prediction.device``)."""
    return orjson.dumps(prediction.to_dict())


def decode(value: bytes | bytearray | memoryview | str) -> Prediction:
    """The prediction a message holds, every field checked; ``PredictionRejected`` (with
    the field and the rule it breaks) for anything else."""
    try:
        doc = orjson.loads(value)
    except (orjson.JSONDecodeError, TypeError) as exc:
        raise PredictionRejected("bad_json", f"not a JSON document: {exc}") from None
    if not isinstance(doc, dict):
        raise PredictionRejected("bad_json", f"a prediction is a JSON object, not {type(doc).__name__}")
    missing = [name for name in FIELDS if name not in doc]
    if missing:
        raise PredictionRejected("missing_field", f"missing {', '.join(missing)}")
    if _integer(doc, "v") != SCHEMA_VERSION:
        raise PredictionRejected("bad_version", f"v={doc['v']!r}; this reader knows version {SCHEMA_VERSION}")
    top_k = _top_k(doc["top_k"])
    prediction = Prediction(
        job=_text(doc, "job"), worker=_text(doc, "worker"), device=_text(doc, "device"), topic=_text(doc, "topic"),
        partition=_count_or_none(doc, "partition"), offset=_count_or_none(doc, "offset"),
        record_id=_count(doc, "record_id"), event_time=_time_or_none(doc, "event_time"),
        kafka_timestamp=_time_or_none(doc, "kafka_timestamp"), model_version=_count(doc, "model_version"),
        model_digest=_digest(doc), predicted=_count(doc, "predicted"), top_k=top_k, at=_at(doc),
        predicted_at=_time(doc, "predicted_at"), published_at=_time(doc, "published_at"),
    )
    if prediction.record_id > MAX_RECORD_ID:
        raise PredictionRejected("bad_value", f"record_id={prediction.record_id} is not below 2^64")
    if top_k[0][0] != prediction.predicted:
        raise PredictionRejected("bad_value", f"top_k starts with class {top_k[0][0]}, not the predicted "
                                              f"class {prediction.predicted}")
    if prediction.published_at < prediction.predicted_at:
        raise PredictionRejected("bad_value", "published_at is before predicted_at")
    for name, expected in (("latency_event_s", prediction.latency_event_s),
                           ("latency_append_s", prediction.latency_append_s)):
        given = doc[name]
        if expected is None:
            if given is not None:
                raise PredictionRejected("bad_value", f"{name} must be null when its time is")
            continue
        if isinstance(given, bool) or not isinstance(given, (int, float)) or not math.isfinite(given):
            raise PredictionRejected("bad_type", f"{name} must be a finite number (got {given!r})")
        if abs(given - expected) > LATENCY_TOLERANCE_S:
            raise PredictionRejected("bad_value", f"{name}={given} is not published_at minus its time ({expected})")
    return prediction


# --- field checks ---------------------------------------------------------------------------
def _integer(doc: dict[str, Any], name: str) -> int:
    value = doc[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise PredictionRejected("bad_type", f"{name} must be an integer (got {value!r})")
    return value


def _count(doc: dict[str, Any], name: str) -> int:
    value = _integer(doc, name)
    if value < 0:
        raise PredictionRejected("bad_value", f"{name} must be >= 0 (got {value})")
    return value


def _count_or_none(doc: dict[str, Any], name: str) -> int | None:
    return None if doc[name] is None else _count(doc, name)


def _time(doc: dict[str, Any], name: str) -> float:
    value = doc[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PredictionRejected("bad_type", f"{name} must be a finite number of seconds (got {value!r})")
    return float(value)


def _time_or_none(doc: dict[str, Any], name: str) -> float | None:
    return None if doc[name] is None else _time(doc, name)


def _text(doc: dict[str, Any], name: str) -> str:
    value = doc[name]
    if not isinstance(value, str) or not value or len(value) > 255:
        raise PredictionRejected("bad_type", f"{name} must be a non-empty string of at most 255 characters "
                                             f"(got {value!r})")
    return value


def _digest(doc: dict[str, Any]) -> str:
    value = doc["model_digest"]
    if not isinstance(value, str) or not _DIGEST.fullmatch(value):
        raise PredictionRejected("bad_value", f"model_digest must be 64 lowercase hex digits (got {value!r})")
    return value


def _at(doc: dict[str, Any]) -> str:
    value = doc["at"]
    if value not in AT:
        raise PredictionRejected("bad_value", f"at must be one of {', '.join(AT)} (got {value!r})")
    return value


def _top_k(value: Any) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, list) or not value:
        raise PredictionRejected("bad_type", f"top_k must be a non-empty list (got {value!r})")
    pairs = []
    for entry in value:
        if not isinstance(entry, dict) or "class" not in entry or "p" not in entry:
            raise PredictionRejected("bad_type", f"each top_k entry is {{\"class\": c, \"p\": probability}} "
                                                 f"(got {entry!r})")
        cls, p = entry["class"], entry["p"]
        if isinstance(cls, bool) or not isinstance(cls, int) or cls < 0:
            raise PredictionRejected("bad_value", f"top_k class must be an integer >= 0 (got {cls!r})")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise PredictionRejected("bad_value", f"top_k probability must lie in [0, 1] (got {p!r})")
        pairs.append((cls, float(p)))
    if len({c for c, _ in pairs}) != len(pairs):
        raise PredictionRejected("bad_value", "top_k lists a class twice")
    if any(a[1] < b[1] for a, b in zip(pairs, pairs[1:], strict=False)):
        raise PredictionRejected("bad_value", "top_k must list the most probable class first (descending p)")
    if sum(p for _, p in pairs) > 1.0 + PROBABILITY_TOLERANCE:
        raise PredictionRejected("bad_value", f"top_k probabilities sum to {sum(p for _, p in pairs)}, above 1")
    return tuple(pairs)


# --- the publishing side's pure part --------------------------------------------------------
def top_k(probabilities: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most probable classes of each row of ``probabilities`` ``[N, C]`` and their
    probabilities, most probable first (ties: the lower class first, as ``argmax``); ``k``
    is capped at ``C``."""
    k = max(1, min(int(k), probabilities.shape[1]))
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(probabilities, order, axis=1)


@dataclass(frozen=True)
class Scored:
    """The predictions for the trained records of one device batch, not yet published: one
    row per record, in the batch's order. Unknown partitions and offsets are -1, unknown
    times NaN."""

    device: str
    topic: str
    partition: np.ndarray  # int [n]
    offset: np.ndarray  # int [n]
    record_id: np.ndarray  # uint64 [n]
    event_time: np.ndarray  # float64 [n]
    kafka_timestamp: np.ndarray  # float64 [n]
    model_version: np.ndarray  # int64 [n]
    model_digest: list[str]  # [n]
    classes: np.ndarray  # int [n, k], most probable first
    probabilities: np.ndarray  # float [n, k]
    arrival: np.ndarray  # bool [n]: an arrival-time prediction (``at = "arrival"``)
    predicted_at: np.ndarray  # float64 [n]
    #: The ``at`` of every row when set (``AT_SERVE``); None: ``arrival`` decides per row.
    at: str | None = None

    @classmethod
    def of(cls, records: RecordBatch, topic: str, *, version: int, digest: str, classes: np.ndarray,
           probabilities: np.ndarray, predicted_at: float) -> Scored:
        """The step-time predictions of ``records`` (read from ``topic``; their ``origin``
        says where), made with model ``version`` (``digest``) at ``predicted_at``."""
        n = records.count
        origin = records.origin
        unknown = np.full(n, -1, dtype=np.int64)
        return cls(
            device=records.device, topic=topic,
            partition=unknown if origin is None else origin["partition"].astype(np.int64),
            offset=unknown if origin is None else origin["offset"],
            record_id=records.seq, event_time=records.event_time,
            kafka_timestamp=np.full(n, np.nan) if origin is None else origin["timestamp"],
            model_version=np.full(n, version, dtype=np.int64), model_digest=[digest] * n,
            classes=classes, probabilities=probabilities, arrival=np.zeros(n, dtype=bool),
            predicted_at=np.full(n, predicted_at, dtype=np.float64),
        )

    @property
    def size(self) -> int:
        return len(self.record_id)

    def select(self, rows: np.ndarray) -> Scored:
        """The predictions of ``rows`` (positions, ascending)."""
        return Scored(self.device, self.topic, self.partition[rows], self.offset[rows], self.record_id[rows],
                      self.event_time[rows], self.kafka_timestamp[rows], self.model_version[rows],
                      [self.model_digest[i] for i in np.asarray(rows).tolist()], self.classes[rows],
                      self.probabilities[rows], self.arrival[rows], self.predicted_at[rows], self.at)


def scored_parts(parts: Sequence[tuple[RecordBatch, str]], *, version: int, digest: str, classes: np.ndarray,
                 probabilities: np.ndarray, predicted_at: float, trained: np.ndarray | None = None) -> list[Scored]:
    """The predictions of a step's batch, one ``Scored`` per part: ``parts`` are the device
    batches it concatenated (with the topic each was read from), ``classes`` and
    ``probabilities`` the top-k rows of the whole batch, and ``trained`` the positions the
    step trained (None: all); the others (dead-lettered) are left out."""
    out, start = [], 0
    for records, topic in parts:
        stop = start + records.count
        one = Scored.of(records, topic, version=version, digest=digest, classes=classes[start:stop],
                        probabilities=probabilities[start:stop], predicted_at=predicted_at)
        if trained is not None:
            one = one.select(trained[(trained >= start) & (trained < stop)] - start)
        out.append(one)
        start = stop
    return out


def encode_scored(scored: Scored, *, job: str, worker: str, published_at: float) -> list[tuple[bytes, bytes]]:
    """``(key, value)`` of each prediction of ``scored``, published at ``published_at``.

    Column at a time: each column is one ``orjson`` call (floats and ints as orjson writes
    them, NaN as null), its tokens put into one template per row: the bytes are exactly those
    of ``orjson.dumps`` of each prediction's object, its fields in the order of the table above."""
    n = scored.size
    if n == 0:
        return []
    k = scored.classes.shape[1] if scored.classes.ndim == 2 else 1
    event_time = np.asarray(scored.event_time, dtype=np.float64)
    stamp = np.asarray(scored.kafka_timestamp, dtype=np.float64)
    published = float(published_at)
    classes = _tokens(np.asarray(scored.classes).reshape(n, k).tolist(), n * k, flat=True)
    probs = _tokens(np.asarray(scored.probabilities, dtype=np.float64).reshape(n, k).tolist(), n * k, flat=True)
    digests: dict[str, bytes] = {}
    digest = [digests.get(d) or digests.setdefault(d, orjson.dumps(d)) for d in scored.model_digest] \
        if len(set(scored.model_digest)) > 1 else [orjson.dumps(scored.model_digest[0])] * n
    if scored.at is not None:
        at = [orjson.dumps(scored.at)] * n
    else:
        arrival, step = orjson.dumps(AT_ARRIVAL), orjson.dumps(AT_STEP)
        at = [arrival if a else step for a in scored.arrival.tolist()]
    columns = [
        _known(scored.partition, n), _known(scored.offset, n), _tokens(scored.record_id.tolist(), n),
        _tokens(event_time.tolist(), n), _tokens(stamp.tolist(), n), _tokens(scored.model_version.tolist(), n),
        digest, classes[0::k],
        *[column for j in range(k) for column in (classes[j::k], probs[j::k])],
        at, _tokens(np.asarray(scored.predicted_at, dtype=np.float64).tolist(), n),
        _tokens((published - event_time).tolist(), n), _tokens((published - stamp).tolist(), n),
    ]
    head = b"{" + orjson.dumps({"v": SCHEMA_VERSION, "job": job, "worker": worker, "device": scored.device,
                                "topic": scored.topic})[1:-1].replace(b"%", b"%%")
    top = b",".join([b'{"class":%b,"p":%b}'] * k)
    template = (head + b',"partition":%b,"offset":%b,"record_id":%b,"event_time":%b,"kafka_timestamp":%b,'
                b'"model_version":%b,"model_digest":%b,"predicted":%b,"top_k":[' + top + b'],"at":%b,'
                b'"predicted_at":%b,"published_at":' + orjson.dumps(published) + b',"latency_event_s":%b,'
                b'"latency_append_s":%b}')
    key = scored.device.encode()
    return [(key, template % row) for row in zip(*columns, strict=True)]


def _tokens(values: list[Any], n: int, *, flat: bool = False) -> list[bytes]:
    """The JSON of each of ``values`` (numbers; NaN is null), in one ``orjson`` call: numbers
    hold no comma, so the list's JSON splits into them (``flat``: a list of equal lists)."""
    text = orjson.dumps(values)
    if flat:
        text = text.replace(b"],[", b",")[1:-1]
    tokens = text[1:-1].split(b",")
    if len(tokens) != n:
        raise ValueError(f"expected {n} values, the JSON has {len(tokens)}")
    return tokens


def _known(values: np.ndarray, n: int) -> list[bytes]:
    """``_tokens`` of int ``values``, a negative one (unknown) as null."""
    tokens = _tokens(values.tolist(), n)
    for i in np.flatnonzero(np.asarray(values) < 0).tolist():
        tokens[i] = b"null"
    return tokens


@dataclass(frozen=True)
class Made:
    """One arrival-time prediction, kept until its record is trained."""

    version: int
    digest: str
    classes: np.ndarray  # int [k]
    probabilities: np.ndarray  # float [k]
    predicted_at: float


class ArrivalPredictions:
    """Predictions made when readings arrived without their label (delayed labels), by
    ``(device, record id)``, until the reading is trained (``take``); at most ``limit``
    are kept, the oldest forgotten first (a reading that never got its label is never
    trained, so its prediction would otherwise stay)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1 (got {limit})")
        self.limit = limit
        self._made: OrderedDict[tuple[str, int], Made] = OrderedDict()
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._made)

    def put(self, keys: Sequence[tuple[str, int]], made: Sequence[Made]) -> None:
        for key, one in zip(keys, made, strict=True):
            self._made[key] = one
            self._made.move_to_end(key)
        while len(self._made) > self.limit:
            self._made.popitem(last=False)
            self.forgotten += 1

    def take(self, device: str, record_ids: Sequence[int]) -> list[Made | None]:
        """The kept prediction of each of ``device``'s ``record_ids`` (None: none was made),
        each given once."""
        return [self._made.pop((device, int(r)), None) for r in record_ids]

    def apply(self, scored: Scored) -> Scored:
        """``scored`` with the rows whose record has an arrival-time prediction replaced by it."""
        made = self.take(scored.device, scored.record_id.tolist())
        rows = [i for i, m in enumerate(made) if m is not None]
        if not rows:
            return scored
        k = scored.classes.shape[1]
        version, digest = scored.model_version.copy(), list(scored.model_digest)
        classes, probabilities = scored.classes.copy(), scored.probabilities.copy()
        arrival, predicted_at = scored.arrival.copy(), scored.predicted_at.copy()
        for i in rows:
            m = made[i]
            assert m is not None
            version[i], digest[i], predicted_at[i], arrival[i] = m.version, m.digest, m.predicted_at, True
            classes[i], probabilities[i] = m.classes[:k], m.probabilities[:k]
        return replace(scored, model_version=version, model_digest=digest, classes=classes,
                       probabilities=probabilities, arrival=arrival, predicted_at=predicted_at)


class DigestCache:
    """The model digest of each version, computed once per version (``compute`` is the
    costly hash of the parameters, called on the thread that owns the model)."""

    def __init__(self, compute: Callable[[], str]) -> None:
        self.compute = compute
        self.version: int | None = None
        self.digest = ""
        self.computed = 0

    def of(self, version: int) -> str:
        if version != self.version:
            self.digest, self.version = self.compute(), version
            self.computed += 1
        return self.digest
