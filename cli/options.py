"""What the commands share on their command lines: argument types, the job and service options,
the job's configuration and the cluster a command uses."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from edgestream.cli.errors import CommandError
from edgestream.job.config import LOG_FORMATS, JobConfig, load_config

DEFAULT_BROKER_STATE = Path(".edgestream/broker")


# --- argument types: a bad value is refused by argparse, before anything starts ----------
def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0 (got {text})")
    return value


def positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be an integer > 0 (got {text})")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (got {text})")
    return value


def port(text: str) -> int:
    """A TCP port, or 0 for "a free one"."""
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535, 0 for a free one (got {text})")
    return value


def bootstrap_address(text: str) -> str:
    """``HOST:PORT[,HOST:PORT...]`` with ports in 1..65535."""
    from edgestream.deploy.kafka.broker import host_port

    try:
        for address in text.split(","):
            host_port(address)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (e.g. 127.0.0.1:9092)") from None
    return text


def heap_size(text: str) -> str:
    """A JVM heap size as ``-Xmx`` takes it: digits with an optional k/m/g suffix."""
    if not re.fullmatch(r"[1-9][0-9]*[kKmMgG]?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a heap size like 512m or 2g")
    return text


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def broker_nodes(text: str) -> int:
    """``--brokers``: how many Kafka nodes to start (1 = a single broker)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be 1 (a single broker) or more (e.g. 3: a cluster that survives one node down), got {text}")
    return value


def job_config(args: argparse.Namespace) -> JobConfig:
    """The job's configuration; its ``kafka.*`` security settings become this process's
    (every Kafka client it makes uses them: ``pipeline.security``)."""
    from edgestream.pipeline import security

    cfg = load_config(getattr(args, "job", None), getattr(args, "set", None) or [])
    security.use(security.ClientSecurity.from_config(cfg.kafka))
    return cfg


def add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", type=Path, help="job file (TOML); defaults built in")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable), e.g. --set buffer.policy=truncate")
    p.add_argument("--bootstrap", metavar="HOST:PORT", type=bootstrap_address,
                   help="use this Kafka cluster instead of the local broker")


def add_stream_args(p: argparse.ArgumentParser, duration_help: str, garbage_help: str) -> None:
    """``--duration`` (seconds of streaming, default ``run.duration_s``) and ``--garbage N``
    (malformed messages per device), as ``run`` and ``simulate`` take them."""
    p.add_argument("--duration", type=positive_float, help=duration_help)
    p.add_argument("--garbage", type=non_negative_int, default=0, metavar="N", help=garbage_help)


def local_broker_bootstrap(state_dir: Path) -> str | None:
    from edgestream.deploy.kafka.broker import BrokerInfo, is_broker_pid

    info_file = state_dir / "broker.json"
    if info_file.exists():
        info = BrokerInfo.load(info_file)
        # A cluster is usable while any of its nodes runs (one may be down for a test).
        if any(is_broker_pid(pid) for pid in info.pids):
            return info.bootstrap
    return None


def cluster_bootstrap(args: argparse.Namespace, cfg: JobConfig | None) -> str | None:
    return (
        getattr(args, "bootstrap", None)
        or (cfg.kafka.bootstrap if cfg else None)
        or local_broker_bootstrap(DEFAULT_BROKER_STATE)
    )


def need_bootstrap(args: argparse.Namespace, cfg: JobConfig | None) -> str:
    """The cluster this command uses, checked to answer (``KafkaUnreachable`` within seconds)."""
    from edgestream.pipeline.kafka_io import check_reachable

    bootstrap = cluster_bootstrap(args, cfg)
    if not bootstrap:
        raise CommandError(
            "no Kafka broker. Start the local one with `edgestream broker start`, "
            "or pass --bootstrap HOST:PORT (or set kafka.bootstrap in the job file)"
        )
    args.resolved_bootstrap = bootstrap  # named by main if Kafka fails later
    check_reachable(bootstrap)
    return bootstrap


def use_log_format(args: argparse.Namespace, cfg: JobConfig) -> None:
    """``--log-format`` (else ``service.log_format``) for this process's log lines; the
    choice is written back to ``cfg`` (a Faust process keeps its own handlers for JSON)."""
    from edgestream.pipeline.service import use_json_logs

    fmt = getattr(args, "log_format", None) or cfg.service.log_format
    cfg.service.log_format = fmt
    if fmt == "json":
        use_json_logs()


def add_service_args(p: argparse.ArgumentParser) -> None:
    """Flags of the long-running commands (worker, server, simulate, replay)."""
    p.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                   help="log lines as text or one JSON object a line (default: service.log_format, text)")

