"""How a command fails: the error that names what to do, and an exception read as an exit status
and one line."""

from __future__ import annotations

import argparse

from edgestream.pipeline.exits import EXIT_CONFIG, EXIT_NO_CHECKPOINT, EXIT_RUNTIME

#: Error classes (by name, anywhere in the exception's MRO: matching by name keeps torch
#: and the Kafka clients out of the import path of a failing command) that mean "the
#: configuration is wrong": exit status 2.
CONFIG_ERRORS = frozenset({
    "ConfigError", "TopicNameError", "ModelConfigError", "UnknownStrategyError",
    "CompressorConfigError", "TopicLayoutError", "ArgumentTypeError", "CostModelError", "AssemblyError",
})
#: Client errors (kafka-python, aiokafka) that mean "the cluster did not answer".
KAFKA_CONNECTION_ERRORS = frozenset({
    "NoBrokersAvailable", "KafkaTimeoutError", "KafkaConnectionError", "NodeNotReadyError",
    "RequestTimedOutError",
})

#: Modules that add subcommands: each has ``register(subparsers, add_job_args)``, which

class CommandError(Exception):
    """A command cannot proceed; the message says what to do, ``code`` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_RUNTIME) -> None:
        super().__init__(message)
        self.code = code


def one_line(text: object) -> str:
    """The first line of ``text``, whitespace collapsed; ' (...)' if lines were left out."""
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    first = " ".join(lines[0].split())
    return first + (" (more with --debug)" if len(lines) > 1 else "")


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def failure(exc: BaseException, args: argparse.Namespace) -> tuple[int, str, str]:
    """How a command that raised ``exc`` ends: exit status, the problem as one line, and
    the reason alone (what `run` shows for a worker: ``CheckpointError: ...``)."""
    names = _names(exc)
    kind = f"{type(exc).__name__}: "
    if "ProcessCrashed" in names:
        cause = getattr(exc, "reason", None)
        if cause is not None and _names(cause) & KAFKA_CONNECTION_ERRORS:  # lost the cluster
            _, line, reason = failure(cause, args)
            return EXIT_RUNTIME, f"crashed: {line}", reason
        if cause is not None and "NoUsableCheckpoint" in _names(cause):
            return failure(cause, args)
        reason = one_line(exc)
        return EXIT_RUNTIME, f"crashed: {reason}", reason
    if names & CONFIG_ERRORS:
        reason = one_line(exc)
        return EXIT_CONFIG, f"configuration error: {reason}", reason
    if "NoUsableCheckpoint" in names:
        reason = kind + one_line(exc)
        return EXIT_NO_CHECKPOINT, f"cannot start: {reason}", reason
    if "KafkaUnreachable" in names or "SecurityError" in names:
        reason = one_line(exc)
        return EXIT_RUNTIME, reason, reason
    if names & KAFKA_CONNECTION_ERRORS:
        from edgestream.pipeline.kafka_io import KAFKA_HINT

        where = getattr(args, "resolved_bootstrap", None) or getattr(args, "bootstrap", None) or "?"
        reason = f"cannot reach Kafka at {where}: {kind}{one_line(exc)}"
        return EXIT_RUNTIME, f"{reason}. {KAFKA_HINT}", reason
    if isinstance(exc, CommandError):
        return exc.code, one_line(exc), one_line(exc)
    if names & {"RunError", "BrokerError", "TopicSetupError", "StreamsError", "PrometheusError"}:
        return EXIT_RUNTIME, one_line(exc), one_line(exc)
    reason = kind + one_line(exc)
    if args.command in ("worker", "server"):
        return EXIT_RUNTIME, f"crashed: {reason}", reason
    return EXIT_RUNTIME, f"failed: {reason} (--debug shows the traceback)", reason

