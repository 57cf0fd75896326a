"""Exceptions of the streams package: what went wrong with a record or a topic, and where."""

from __future__ import annotations


class StreamsError(Exception):
    """Base class of every error raised by ``streams``."""


class RecordDecodeError(StreamsError):
    """A sensor message could not be decoded or failed validation.

    ``reason`` is a short stable slug (it becomes the dead-letter header and the metric
    label: keep the set small); ``detail`` says exactly what was wrong. ``topic``,
    ``partition`` and ``offset`` are filled in by whoever knows where the bytes came from.
    """

    REASONS = (
        "truncated", "bad_magic", "bad_version", "bad_dtype", "bad_shape", "bad_count",
        "bad_device", "length_mismatch", "too_large", "non_finite", "bad_label",
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


class TopicNameError(StreamsError, ValueError):
    """A device id or job name cannot be used in a Kafka topic name."""
