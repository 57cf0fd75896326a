"""Exceptions of the streams package: what went wrong with a record or a topic, and where."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from edgestream.streams.records import RecordBatch


class StreamsError(Exception):
    """Base class of every error raised by ``streams``."""


class LookupUnavailable(StreamsError):
    """A service decoding needs (a schema registry) did not answer: not the message's fault.
    The ingest edge waits for it and tries again (``InputFormat.lookups``); nothing is
    dead-lettered for it."""


class RecordDecodeError(StreamsError):
    """A sensor message could not be decoded or failed validation.

    ``reason`` is a short stable slug (it becomes the dead-letter header and the metric
    label: keep the set small); ``detail`` says exactly what was wrong. ``topic``,
    ``partition`` and ``offset`` are filled in by whoever knows where the bytes came from.
    """

    REASONS = (
        "truncated", "bad_magic", "bad_version", "bad_dtype", "bad_shape", "bad_count",
        "bad_device", "length_mismatch", "too_large", "non_finite", "bad_label",
        "bad_checksum", "out_of_range",
        # JSON input (streams/formats/json_records.py)
        "bad_json", "missing_field", "bad_type", "extra_field", "bad_time",
        # Avro input (streams/formats/avro_records.py)
        "bad_avro", "unknown_schema",
    )

    def __init__(
        self,
        reason: str,
        detail: str,
        *,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
    ) -> None:
        assert reason in self.REASONS, reason
        self.reason = reason
        self.detail = detail
        self.topic = topic
        self.partition = partition
        self.offset = offset
        super().__init__(self._message())

    def _message(self) -> str:
        where = ""
        if self.topic is not None:
            where = f" at {self.topic}[{self.partition}]@{self.offset}"
        return f"record rejected ({self.reason}){where}: {self.detail}"

    def located(self, topic: str, partition: int, offset: int) -> RecordDecodeError:
        """The same error, annotated with where the message was read from."""
        return RecordDecodeError(
            self.reason, self.detail, topic=topic, partition=partition, offset=offset
        )


class OutOfRange(RecordDecodeError):
    """Finite feature values outside the declared value range, in some records of a message.

    Unlike every other reason this one condemns records, not the message: the message
    passed every other check, so ``batch`` is the whole decoded message (all records) and
    ``bad`` is a bool mask over its records, True where a record has a value outside the
    range. Whoever catches it keeps ``batch`` minus ``bad`` and dead-letters the rest.
    Invariant: ``len(bad) == batch.count`` and ``bad.any()``.
    """

    def __init__(
        self,
        detail: str,
        *,
        batch: RecordBatch,
        bad: np.ndarray,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
    ) -> None:
        super().__init__("out_of_range", detail, topic=topic, partition=partition, offset=offset)
        self.batch = batch
        self.bad = bad

    def located(self, topic: str, partition: int, offset: int) -> OutOfRange:
        """The same error (batch and mask included), annotated with where the message was read from."""
        return OutOfRange(
            self.detail, batch=self.batch, bad=self.bad, topic=topic, partition=partition, offset=offset
        )


class TopicNameError(StreamsError, ValueError):
    """A device id or job name cannot be used in a Kafka topic name."""


class PredictionRejected(StreamsError):
    """A message of ``predictions.<job>`` that does not follow the schema of
    ``streams.predictions``: ``reason`` is a short stable slug, ``detail`` names the field
    and what was wrong with it."""

    REASONS = ("bad_json", "bad_version", "missing_field", "bad_type", "bad_value")

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in self.REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
