"""How `edgestream` commands fail: exit status and one line per kind of error, argparse
refusals, the --debug traceback, and the exit.json verdict of a worker."""

from __future__ import annotations

import argparse
import json

import pytest

from edgestream.cli import errors, options, simulate, worker
from edgestream.cli.main import main
from edgestream.job.config import ConfigError
from edgestream.pipeline.exits import EXIT_CONFIG, EXIT_NO_CHECKPOINT, EXIT_RUNTIME
from edgestream.pipeline.kafka_io import KafkaUnreachable, TopicLayoutError, TopicSetupError
from edgestream.pipeline.run import ProcessFailed
from edgestream.pipeline.worker import ProcessCrashed
from edgestream.streams.errors import TopicNameError


def args_of(command: str, **extra) -> argparse.Namespace:
    return argparse.Namespace(command=command, **extra)


def test_one_line_keeps_the_first_line_and_says_more_exists():
    assert errors.one_line("bad  value\n  for x") == "bad value (more with --debug)"
    assert errors.one_line("\n\nonly\n") == "only"


@pytest.mark.parametrize(("exc", "code", "start"), [
    (ConfigError("buffer.policy must be one of persist"), 2, "configuration error: buffer.policy"),
    (TopicNameError("job name 'a b' cannot be used"), 2, "configuration error: job name"),
    (TopicLayoutError("topic gradients.j has 3 partitions"), 2, "configuration error: topic gradients.j"),
    (TopicSetupError("cannot create topic(s) x: TopicAuthorizationFailedError"), 1, "cannot create topic(s) x"),
    (KafkaUnreachable("h:1", "connection to h:1 refused"), 1, "cannot reach Kafka at h:1: connection"),
    (ProcessFailed("worker w1 crashed (exit 1): X", "w1", []), 1, "worker w1 crashed (exit 1): X"),
    (errors.CommandError("no Kafka broker", 1), 1, "no Kafka broker"),
])
def test_failure_maps_each_kind_of_error_to_its_exit_status(exc, code, start):
    got, line, _ = errors.failure(exc, args_of("simulate"))

    assert got == code and line.startswith(start), line


def test_no_usable_checkpoint_is_its_own_exit_status_with_the_whole_reason_on_one_line(tmp_path):
    from edgestream.trainers.errors import NoUsableCheckpoint

    directory = tmp_path / "checkpoints"
    exc = NoUsableCheckpoint(directory, [(directory / "checkpoint-000000002.bin", "payload digest\nmismatch"),
                                         (directory / "checkpoint-000000001.bin", "bad magic")])

    for raised in (exc, ProcessCrashed(exc, 1)):  # also when the Faust app stopped on it
        code, line, reason = errors.failure(raised, args_of("worker"))

        assert code == EXIT_NO_CHECKPOINT == 3
        assert code not in (EXIT_CONFIG, EXIT_RUNTIME)
        assert line == f"cannot start: {reason}" and reason.startswith("NoUsableCheckpoint: checkpoint ")
        assert "checkpoint-000000002.bin: payload digest mismatch; checkpoint-000000001.bin: bad magic" in line
        assert line.endswith(f"or put a good checkpoint file back into {directory}") and "--debug" not in line


def test_training_name_errors_are_configuration_errors():
    from edgestream.compression.errors import CompressorConfigError
    from edgestream.trainers.errors import ModelConfigError, UnknownStrategyError

    for exc in (ModelConfigError("unknown model"), UnknownStrategyError("x", ["bsp"]),
                CompressorConfigError("unknown compressor")):
        assert errors.failure(exc, args_of("run"))[0] == 2


@pytest.mark.parametrize("make", [
    lambda: __import__("kafka.errors", fromlist=["x"]).KafkaTimeoutError("Unable to bootstrap from h:1"),
    lambda: __import__("aiokafka.errors", fromlist=["x"]).KafkaConnectionError("Unable to bootstrap from h:1"),
])
def test_client_connection_errors_name_the_cluster_and_the_fix(make):
    code, line, reason = errors.failure(make(), args_of("record", bootstrap=None, resolved_bootstrap="h:1"))

    assert code == 1
    assert line.startswith("cannot reach Kafka at h:1: ") and line.endswith("or check --bootstrap")
    assert "edgestream broker start" not in reason


def test_a_worker_that_lost_the_cluster_says_so():
    from aiokafka.errors import KafkaConnectionError

    crash = ProcessCrashed(KafkaConnectionError("Unable to bootstrap from h:1"), 1)

    code, line, _ = errors.failure(crash, args_of("worker", bootstrap="h:1"))

    assert code == 1 and line.startswith("crashed: cannot reach Kafka at h:1: KafkaConnectionError: ")


def test_a_crash_of_a_worker_is_reported_with_its_reason():
    crash = ProcessCrashed(RuntimeError("disk\nfull"), 1)

    code, line, reason = errors.failure(crash, args_of("worker"))

    assert (code, line, reason) == (1, "crashed: RuntimeError: disk (more with --debug)",
                                   "RuntimeError: disk (more with --debug)")
    assert errors.failure(OSError("no space"), args_of("server"))[1] == "crashed: OSError: no space"
    assert errors.failure(OSError("no space"), args_of("simulate"))[1].startswith("failed: OSError: no space")


def test_argparse_refusals_are_one_line_with_exit_2(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["simulate", "--duration", "-5"])

    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("edgestream simulate: argument --duration: must be a finite number > 0 (got -5)")


@pytest.mark.parametrize(("kind", "text", "ok"), [
    (options.positive_float, "0.5", True), (options.positive_float, "0", False), (options.positive_float, "inf", False),
    (options.positive_int, "3", True), (options.positive_int, "0", False), (options.positive_int, "2.5", False),
    (options.non_negative_int, "0", True), (options.non_negative_int, "-1", False),
    (options.port, "0", True), (options.port, "65535", True), (options.port, "65536", False),
    (options.bootstrap_address, "h:9092,[::1]:9093", True), (options.bootstrap_address, "h", False),
    (options.bootstrap_address, "h:0", False), (options.heap_size, "512m", True), (options.heap_size, "lots", False),
])
def test_argument_types(kind, text, ok):
    if ok:
        kind(text)
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            kind(text)


def test_main_prints_one_line_and_the_traceback_only_with_debug(monkeypatch, capsys):
    def broken(args):
        raise ConfigError("devices.count must be > 0")

    monkeypatch.setattr(simulate, "cmd_simulate", broken)

    assert main(["simulate"]) == 2
    assert capsys.readouterr().err == "edgestream simulate: configuration error: devices.count must be > 0\n"
    assert main(["simulate", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith("configuration error: devices.count must be > 0\n")


def test_main_writes_the_verdict_of_a_worker_where_run_reads_it(monkeypatch, tmp_path, capsys):
    exit_file = tmp_path / "workers" / "w0" / "exit.json"

    def crashed(args):
        args.exit_file = exit_file
        raise ProcessCrashed(ValueError("bad state"), 1)

    monkeypatch.setattr(worker, "cmd_worker", crashed)

    assert main(["worker", "--worker", "w0"]) == 1
    assert capsys.readouterr().err == "edgestream worker w0: crashed: ValueError: bad state\n"
    verdict = json.loads(exit_file.read_text())
    assert verdict["code"] == 1 and verdict["reason"] == "ValueError: bad state"
