"""The typed job configuration: one object per job, from TOML, overridable by flags and env.

Precedence (later wins): dataclass defaults < TOML file < ``EDGESTREAM__SECTION__KEY``
environment variables < ``--set section.key=value`` flags.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from edgestream.job.errors import ConfigError
from edgestream.job.examples import missing_job_hint
from edgestream.job.sources import parse_value_range, source_named
from edgestream.streams.errors import TopicNameError
from edgestream.streams.formats import InputFormat, format_named
from edgestream.streams.profiles import SCADLES_RATES
from edgestream.streams.topics import SENSOR_DLQ, TopicLayout

SCADLES_RATES_HZ = [float(r) for r in SCADLES_RATES]
#: Most partitions ``input.partitions`` may give a shared device topic.
MAX_SHARED_PARTITIONS = 10_000
#: Values of ``kafka.ingest_source``.
INGEST_SOURCES = ("direct", "faust")
#: Values of ``kafka.security_protocol`` and ``kafka.sasl_mechanism``.
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_SSL")
SASL_MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256")
#: Values of ``service.log_format`` and ``--log-format``.
LOG_FORMATS = ("text", "json")
#: Values of ``workers.attack``: the attacks of ``trainers/byzantine.py`` (``ATTACKS``; a unit
#: test keeps the two equal; this module does not import torch).
BYZANTINE_ATTACKS = ("sign_flip", "scale100", "noise")
#: Highest ``workers.attack_seed`` (the attack's generator is seeded from it and the worker id).
MAX_ATTACK_SEED = 2**32 - 1
#: Most devices (and workers) a job may have: each device is a topic; a larger count would
#: only exhaust memory listing them.
MAX_DEVICES = 100_000


@dataclass
class JobSection:
    name: str = "demo"
    seed: int = 0


@dataclass
class KafkaSection:
    #: HOST:PORT of an existing cluster; empty means "start (or reuse) the local broker".
    bootstrap: str = ""
    #: Producer/consumer message size limit (bytes); the local broker allows 16 MiB.
    max_message_bytes: int = 16 * 1024 * 1024
    #: Who reads the device topics: ``direct`` (an aiokafka consumer owned by the worker,
    #: explicit partitions, offsets committed by group ``<app id>-sensors``) or ``faust``
    #: (a Faust agent in the app's own group). docs/ingest.md has the measured difference.
    ingest_source: str = "direct"
    #: How clients talk to the cluster: ``PLAINTEXT``, ``SSL`` (TLS) or ``SASL_SSL`` (TLS +
    #: SCRAM login). docs/security.md.
    security_protocol: str = "PLAINTEXT"
    #: PEM file of the CA that signed the brokers' certificates (SSL, SASL_SSL).
    ssl_cafile: str = ""
    #: PEM client certificate and key, for a cluster that asks for them (mutual TLS).
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    #: SCRAM-SHA-512 or SCRAM-SHA-256 (SASL_SSL).
    sasl_mechanism: str = "SCRAM-SHA-512"
    sasl_username: str = ""
    #: File holding the SASL password (one line). Without it, the environment variable
    #: EDGESTREAM_KAFKA_PASSWORD. The password itself is never part of the configuration:
    #: it is read when a client is made, and never printed or logged.
    sasl_password_file: str = ""


@dataclass
class DataSection:
    #: a registered source (``job.sources.names()``): digits | synthetic | recording (an
    #: `edgestream import` recording: ``data.recording``)
    source: str = "digits"
    #: Directory of the recording when ``source = "recording"``; its manifest gives the
    #: devices, their rates, the feature shape, the classes and the held-out split.
    recording: str = ""
    #: Speed of streaming a recording source: 1 (as recorded), k (k times faster) or "max".
    replay_speed: str = "1"
    partition: str = "iid"  # iid | dirichlet | classes
    dirichlet_alpha: float = 0.3
    classes_per_device: int = 2
    heldout_fraction: float = 0.2
    #: Seed of the held-out test split's draw: ``job`` (the job's seed) or an integer >= 0.
    #: Fixed while ``job.seed`` varies, every seed is tested on the same rows and trains on
    #: none of them (how a benchmark that tunes keeps its test split out of reach).
    heldout_seed: str = "job"
    #: What the job's reported accuracy is measured on: ``heldout`` (the test split) or
    #: ``validation`` (a tuning run: every evaluation, summary and accuracy metric then
    #: reads the validation split, and the test split is not loaded into the job at all).
    evaluate_on: str = "heldout"
    #: Share of the streamed part (stratified, seeded) kept back as the validation split:
    #: never streamed, the only data a strategy's decisions are scored on (EdgeGossip's
    #: mixing and plateau decay, DLion's knowledge transfer); 0: none (they get no score).
    validation_fraction: float = 0.1
    synthetic_samples: int = 6000
    #: ``source = "series"``: the converted time-series file (``.npz``, e.g. written by
    #: scripts/fetch_basicmotions.py; ``~`` is expanded). Its test series are held out.
    series_file: str = ""
    #: ``source = "series"``: steps per record (a window of every channel) and steps between
    #: the starts of consecutive windows of a series.
    series_window: int = 20
    series_hop: int = 2
    #: Declared range of every feature value; records outside are dead-lettered as
    #: ``out_of_range``. ``auto``: the source's own declaration (digits: [0, 1]; synthetic
    #: and recordings: per-feature min/max of the data, widened by ``value_margin``);
    #: ``none``: no range check; ``"LO,HI"``: every feature in [LO, HI].
    value_range: str = "auto"
    #: For ranges derived from data: widen [min, max] by this fraction of (max - min) on each side.
    #: Also the margin of the bounds learned from the stream with ``value_range = "none"``.
    value_margin: float = 1.0
    #: With ``value_range = "none"``: each worker learns per-feature bounds from the records
    #: it trains; after this many records, records outside them (widened by ``value_margin``)
    #: are dead-lettered as ``outside_observed_range`` before the step. 0: no learned bounds.
    observed_warmup: int = 512
    #: Records whose event time lies further than this from their message's Kafka timestamp,
    #: or further back than this from the device's newest event time, are dead-lettered as
    #: ``bad_timestamp``. ``auto``: 3600 for digits and synthetic, none for a recording (its
    #: replay keeps the recorded event times, Kafka stamps the send time); ``none``: no
    #: check; or seconds.
    max_timestamp_skew_s: str = "auto"
    #: Per device, how many sequence numbers at or below the highest one seen are remembered:
    #: a record whose number is among them is dropped as ``duplicate``. 0: no check.
    duplicate_window: int = 4096

    def heldout_split_seed(self, job_seed: int) -> int:
        """``heldout_seed`` resolved: the seed the held-out test split is drawn with."""
        text = str(self.heldout_seed).strip().lower()
        if text == "job":
            return job_seed
        try:
            seed = int(text)
        except ValueError:
            seed = -1
        if seed < 0:
            raise ConfigError(f"data.heldout_seed={self.heldout_seed!r}: use job (the job's seed) or an integer >= 0, "
                              "e.g. --set data.heldout_seed=0 to test every seed on seed 0's split")
        return seed

    def timestamp_skew_s(self) -> float | None:
        """``max_timestamp_skew_s`` resolved: seconds, or None for no check."""
        text = str(self.max_timestamp_skew_s).strip().lower()
        if text == "none":
            return None
        if text == "auto":
            return source_named(self.source).auto_timestamp_skew_s
        try:
            seconds = float(text)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise ConfigError(f"data.max_timestamp_skew_s={self.max_timestamp_skew_s!r}: use auto, none, or "
                              "seconds > 0 (e.g. 600)")
        return seconds


@dataclass
class InputSection:
    """How the devices' messages are written (``streams/formats``): the format and, for
    JSON, where each column of a record is in a reading (dotted field paths)."""

    #: ``edgestream`` (the binary format, the default), ``json`` or ``avro``.
    format: str = "edgestream"
    #: Each device's topic: a pattern holding ``{device}`` once (``plant1.{device}.imu``), or
    #: one name without it (``readings``): one topic shared by every device, keyed by device.
    topic: str = "sensors.{device}"
    #: A shared topic: its partition count (created so; an existing topic must have it).
    partitions: int = 12
    #: A shared topic: seconds a device may send nothing, with nothing pending, before its
    #: worker forgets its state (counted; it comes back fresh).
    device_idle_s: float = 600.0
    #: A shared topic: most devices a worker keeps state for; beyond it, the longest idle
    #: devices with nothing pending are forgotten first (counted).
    max_devices: int = 10_000
    #: json, avro: the feature fields, each a number (the record's features in this order) ...
    features: list[str] = field(default_factory=list)
    #: ... or one field holding an array of numbers (nested lists for an image).
    features_array: str = ""
    label: str = ""
    #: json, avro: the event-time field and its unit (s, ms, us, ns, iso8601); none: the Kafka timestamp.
    event_time: str = ""
    time_unit: str = "s"
    #: json, avro: the device id's field (none: the topic's device).
    device: str = ""
    #: json, avro: the record number's field (none: numbered from the Kafka offset).
    record_id: str = ""
    #: json, avro: ``ignore`` or ``reject`` (dead-letter) fields the mapping does not name.
    extra: str = "ignore"
    #: avro: the readings' Avro schema (.avsc): the writer schema, or with a registry the reader schema.
    schema_file: str = ""
    #: avro: a Confluent-compatible schema registry's base URL (messages in its wire format).
    schema_registry: str = ""
    #: avro: the subject the simulated devices register their schema under ("": the default).
    subject: str = ""

    def params(self) -> dict[str, Any]:
        """The format's parameters: every key set away from its default (a format that takes
        none refuses any)."""
        out: dict[str, Any] = {}
        if self.features:
            out["features"] = list(self.features)
        if self.features_array:
            if self.features:
                raise ConfigError("input.features and input.features_array are two ways to name the features: "
                                  "give one")
            out["features"] = self.features_array
        for key in ("label", "event_time", "device", "record_id", "schema_file", "schema_registry", "subject"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if self.time_unit != "s":
            out["time_unit"] = self.time_unit
        if self.extra != "ignore":
            out["extra"] = self.extra
        return out

    def layout(self) -> TopicLayout:
        """The device topics' layout (``input.topic``); ``ConfigError`` saying what to write."""
        try:
            return TopicLayout(self.topic)
        except TopicNameError as exc:
            raise ConfigError(f"input.topic: {exc}") from None

    def resolved(self) -> tuple[InputFormat, object]:
        """The format and its parsed parameters; ``ConfigError`` saying what to write."""
        try:
            fmt = format_named(self.format)
            return fmt, fmt.parse_params(self.params())
        except ValueError as exc:
            raise ConfigError(f"input: {exc}") from None


@dataclass
class DevicesSection:
    count: int = 10
    #: Per-device base rates in records/s (cycled if shorter than ``count``).
    rates_hz: list[float] = field(default_factory=lambda: list(SCADLES_RATES_HZ))
    #: constant | poisson | bursty[:on=..,off=..,factor=..] | ramp:from=..,to=..,over=..
    profile: str = "constant"
    #: Multiplies every rate (e.g. 10 streams 10x faster).
    time_scale: float = 1.0
    #: A simulator sends one micro-batch message per device every interval.
    message_interval_s: float = 0.1
    #: Explicit device ids; default dev00, dev01, ...
    ids: list[str] = field(default_factory=list)
    #: The devices publish themselves (e.g. over MQTT through `edgestream bridge mqtt`):
    #: `edgestream run` starts no simulators and counts what they write to their topics.
    external: bool = False

    def device_ids(self) -> list[str]:
        if self.ids:
            return list(self.ids)
        return [f"dev{i:02d}" for i in range(self.count)]

    def rate_of(self, index: int) -> float:
        return float(self.rates_hz[index % len(self.rates_hz)]) * self.time_scale


@dataclass
class BufferSection:
    #: persist (keep all; pause only at hard_limit_factor * capacity) |
    #: truncate (drop oldest beyond capacity, counted) | backpressure (pause at capacity)
    policy: str = "persist"
    capacity: int = 4096
    hard_limit_factor: int = 16


@dataclass
class BatcherSection:
    mode: str = "window"  # window (ScaDLES) | fixed (wait for exactly batch_size)
    window_s: float = 1.0
    max_batch: int = 64
    batch_size: int = 64
    #: In window mode, what happens to records beyond max_batch: persist | truncate.
    window_overflow: str = "persist"
    #: In window mode, the most records a window batch may widen to while a device's
    #: arrivals outpace max_batch / window_s (a memory bound); 0: no widening.
    max_batch_widen: int = 0


@dataclass
class WorkersSection:
    count: int = 1
    #: First port of the workers' /metrics endpoints; 0 picks free ports.
    metrics_port_base: int = 0
    metrics_host: str = "127.0.0.1"
    #: Compute heterogeneity emulated by waiting: after a step that took t seconds, worker i
    #: waits (slowdown[i] - 1) * t (cycled if shorter than the worker count; [] = none).
    slowdown: list[float] = field(default_factory=list)

    #: Emulated device compute cost (seconds): a local step on n records takes at least
    #: (step_base_s + step_per_record_s * n) * slowdown[i] in total, the measured compute
    #: included (see ``emulated_wait_s``). 0 and 0: off (only the slowdown rule above).
    step_base_s: float = 0.0
    step_per_record_s: float = 0.0

    #: CPU affinity per worker (Linux ``sched_setaffinity``), for real compute heterogeneity:
    #: CPU lists such as "0", "1-3" or "0+2" (cycled like slowdown; [] = no pinning).
    #: Workers pinned to one shared CPU get a share of it; the others run on their own.
    cpus: list[str] = field(default_factory=list)

    #: Fault injection, for robustness evaluation only: the workers listed here are made
    #: Byzantine on purpose. Each trains honestly, then corrupts every gradient and delta it
    #: sends with ``attack`` (``trainers/byzantine.py``; values stay finite, so only the
    #: aggregation rule of ``train.strategy_params`` stands between them and the model).
    #: Worker ids (w0, w1, ...), never the server. [] = no Byzantine worker.
    byzantine: list[str] = field(default_factory=list)
    #: What the ``byzantine`` workers do to their updates: ``sign_flip`` (-g), ``scale100``
    #: (100 g) or ``noise`` (Gaussian noise with the L2 norm of g).
    attack: str = "sign_flip"
    #: Seed of the ``noise`` attack's generator (combined with each attacker's id).
    attack_seed: int = 0

    def attack_of(self, worker: str) -> str | None:
        """The attack ``worker`` makes (``workers.byzantine``), None for an honest process."""
        return self.attack if worker in self.byzantine else None

    def slowdown_of(self, index: int) -> float:
        return float(self.slowdown[index % len(self.slowdown)]) if self.slowdown else 1.0

    def wait_after_step_s(self, index: int, measured_s: float, records: int) -> float:
        """Seconds worker ``index`` waits after a local step (``emulated_wait_s``)."""
        return emulated_wait_s(measured_s, records, self.step_base_s, self.step_per_record_s, self.slowdown_of(index))

    def cpus_of(self, index: int) -> set[int] | None:
        """The CPUs worker ``index`` is pinned to (None: not pinned)."""
        return parse_cpu_list(self.cpus[index % len(self.cpus)]) if self.cpus else None


def emulated_wait_s(measured_s: float, records: int, base_s: float, per_record_s: float, slowdown: float) -> float:
    """How long a worker waits after a local step of ``records`` records whose compute took
    ``measured_s`` seconds, emulating a device ``slowdown`` times slower than the reference.

    The step is made to last ``max(slowdown * measured_s, (base_s + per_record_s * records)
    * slowdown)`` in total, so the wait is that minus ``measured_s`` (never negative): the
    slowdown rule alone (wait ``(slowdown - 1) * measured_s``) when the emulated cost is 0 or
    shorter, else the emulated device cost, the measured compute counting towards it."""
    emulated_s = (base_s + per_record_s * records) * slowdown
    return max(0.0, max(slowdown * measured_s, emulated_s) - measured_s)


#: Highest CPU number ``workers.cpus`` accepts (Linux supports at most 8192 CPUs); it also
#: keeps a range such as "0-99999999999" from filling memory.
MAX_CPU = 8191


def parse_cpu_list(text: str) -> set[int]:
    """``"0"``, ``"1-3"``, ``"0+2"`` or ``"0,2"`` -> a non-empty set of CPU numbers
    (ValueError otherwise)."""
    cpus: set[int] = set()
    for part in text.replace("+", ",").split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list like 0, 1-3 or 0+2")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"{text!r}: range {low}-{high} is empty")
        if high > MAX_CPU:
            raise ValueError(f"{text!r}: CPU {high} is above {MAX_CPU}, the highest Linux supports")
        cpus.update(range(low, high + 1))
    return cpus


@dataclass
class TrainSection:
    #: false: ingest only (batches are counted); true: workers train online.
    enabled: bool = False
    #: A registered model (mlp | cnn1d | digits_cnn | conv8 | conv8_1d, a plugin's: `edgestream models`) or
    #: the user's own factory, "package.module:factory" (docs/training.md, "Your own model").
    model: str = "mlp"
    #: Options of the model, e.g. ["hidden=[128, 64]"] (mlp) or ["norm=batch", "width=8"] (conv8).
    model_params: list[str] = field(default_factory=list)
    strategy: str = "bsp"  # a registered strategy (trainers.strategies.names())
    lr: float = 0.1
    momentum: float = 0.9
    #: One local step trains on the batches waiting, concatenated, up to this many records.
    max_step_batch: int = 256
    #: Gradient compressor for gradient/delta messages (compression.registry.names()).
    codec: str = "dense"
    #: Compressor parameters, e.g. ["ratio=0.01"].
    codec_params: list[str] = field(default_factory=list)
    error_feedback: bool = True
    #: Per-link compression policy over the codec: none (the codec's own setting) |
    #: accordion (gentle in critical phases, aggressive otherwise) | budget (the largest
    #: setting that fits the link's observed bandwidth); needs topk, randomk or powersgd.
    compression_controller: str = "none"
    #: Its parameters, e.g. ["interval=10", "gentle=0.1", "aggressive=0.01"] (accordion) or
    #: ["interval_s=0.5"] (budget).
    controller_params: list[str] = field(default_factory=list)
    #: Strategy parameters, e.g. ["max_staleness=4"] for ASP's server.
    strategy_params: list[str] = field(default_factory=list)
    eval_every_s: float = 2.0
    checkpoint_every_steps: int = 20
    #: Checkpoints kept (newest first); a restore that finds the newest unusable falls back
    #: to the next one, with a warning.
    checkpoint_keep: int = 3
    #: A checkpoint whose model, optimizer or strategy state holds a value above this (in
    #: absolute value) is refused when saved and skipped when restored, like a non-finite
    #: one. 0: only non-finite values are refused.
    max_abs_weight: float = 1.0e6
    #: A local step whose gradient L2 norm exceeds this is not applied nor published; its
    #: records are dead-lettered (``gradient_norm``). Gradient messages from peers above it
    #: are rejected too. 0: no absolute bound.
    max_grad_norm: float = 1.0e4
    #: Also reject a local step whose gradient norm exceeds this many times the median of
    #: the last accepted steps' norms (after a warm-up). 0: off.
    grad_norm_spike: float = 100.0
    #: A refused step's culprit search judges at most this many sub-steps (per device, then
    #: halves down to single records) to dead-letter only the records that make it unsound;
    #: a suspect group left beyond it is dead-lettered whole. 0: no search (the whole batch).
    culprit_max_probes: int = 128
    #: `run` stops streaming early once every worker's held-out accuracy reached this (0: off).
    target_accuracy: float = 0.0
    #: torch threads per training process (the machine's cores are shared).
    torch_threads: int = 1
    #: ScaDLES data injection (non-IID): each step adds ceil(beta * b_i) samples of each of
    #: ceil(alpha * classes) classes the device has not seen, from a shared pool. 0: off.
    injection_alpha: float = 0.0
    injection_beta: float = 0.0
    #: Size of the shared pool per class, drawn from the streamed (never held-out) data.
    injection_pool_per_class: int = 20
    #: Every training process publishes a heartbeat on ``control.<job>`` this often (seconds).
    heartbeat_s: float = 1.0
    #: A worker not heard from for this long (seconds) is no longer live: the strategy is
    #: told (``on_membership``) and, in BSP, a view without it is proposed.
    member_timeout_s: float = 6.0
    #: The workers a job starts with (the strategy's initial members); others enter with
    #: ``edgestream worker --join``. [] = every configured worker.
    initial_workers: list[str] = field(default_factory=list)
    #: Cut the model into stages after these of its top-level blocks (``edgestream models``
    #: lists them), one worker per stage: w0 holds stage 0 and reads every device, w1 the next
    #: stage, ... Needs a stage-split strategy (pipeline_bp, dni, cdni). [] = not split.
    stages: list[str] = field(default_factory=list)


@dataclass
class RunSection:
    duration_s: float = 20.0
    #: After the simulators stop, how long the drain waits without progress (records read,
    #: trained or pending, steps, versions, lag: none moved) before it ends as a timeout.
    drain_timeout_s: float = 30.0
    #: The most the drain waits in all, even while it makes progress.
    drain_max_s: float = 600.0
    #: Directory for run state (worker data dirs, summaries); default .edgestream/runs/<job>.
    state_dir: str = ""
    #: A worker process that dies during `edgestream run` is restarted up to this many
    #: times (0: the run stops at the first death).
    max_restarts: int = 3
    #: Wait before the first restart of a worker; doubles with each further restart.
    restart_backoff_s: float = 1.0
    #: With SASL_SSL: the password file of the job's workers principal (``<job>-workers``,
    #: what `edgestream acl apply` wrote). `edgestream run` then starts the workers and the
    #: server as that principal, with only its ACLs; the run itself (simulated devices,
    #: accounting) keeps the ``kafka.*`` principal. "": every process uses ``kafka.*``.
    workers_password_file: str = ""


@dataclass
class ServiceSection:
    """How a long-running process (worker, server, simulate, replay) behaves as a managed
    service (docs/deploy.md)."""

    #: After SIGTERM/SIGINT the process checkpoints, commits, leaves its group and exits 0
    #: within this many seconds; past it, it exits 1 at once. Below Kubernetes' default 30 s.
    shutdown_grace_s: float = 20.0
    #: ``/healthz`` fails (and the systemd watchdog is no longer fed) when the process's
    #: main loop has not turned for this many seconds.
    liveness_timeout_s: float = 30.0
    #: Log lines: ``text`` or ``json`` (one object a line: ts, level, logger, msg, job,
    #: process, step); ``--log-format`` overrides.
    log_format: str = "text"


@dataclass
class LimitsSection:
    max_record_message_bytes: int = 1 << 20
    max_records_per_message: int = 65_536


@dataclass
class TestbedSection:
    """The edge testbed (docs/testbed.md): hosts as network namespaces with shaped links."""

    #: Run the job's processes in the testbed. True when the job file has a [testbed] table
    #: (unless it says ``enabled = false``).
    enabled: bool = False
    #: Kafka nodes, one host each (b0, b1, ...): 1 or 3.
    brokers: int = 1
    #: Private IPv4 block for the hosts (the controller takes .1); the next block of the same
    #: size holds the brokers' alias addresses (delay proxies forward to them).
    subnet: str = "10.77.0.0/24"
    #: Link of every worker, server and devices host not in ``links`` ("" = unshaped):
    #: "RATE [DELAY [JITTER]]", e.g. "10mbit" or "1mbit 80ms". Broker hosts are unshaped
    #: unless listed in ``links``.
    default_link: str = ""
    #: Per-host links: ``[testbed.links] w0 = "10mbit"``, ``w7 = "1mbit 80ms"``; hosts are the
    #: workers (w0, ...), server, devices and the brokers (b0, ...).
    links: dict[str, str] = field(default_factory=dict)

    def host_names(self, workers: list[str]) -> list[str]:
        return [*workers, "server", "devices", *(f"b{i}" for i in range(self.brokers))]


@dataclass
class MqttSection:
    """The MQTT edge bridge (`edgestream bridge mqtt`, docs/devices.md): which MQTT broker and
    topics it forwards into the job's device topics (``input.topic``)."""

    #: The MQTT broker, ``host:port``.
    broker: str = "localhost:1883"
    #: MQTT topic patterns, each with ``{device}`` as one whole level (the device's id);
    #: other levels literal, ``+`` or, last, ``#``.
    topics: list[str] = field(default_factory=lambda: ["sensors/{device}/readings"])
    #: 1: each message is acknowledged to MQTT only once Kafka has it (at least once);
    #: 0: MQTT sends each message at most once (a message in flight when the bridge stops is lost).
    qos: int = 1
    #: The MQTT client id of the bridge's persistent session ("": ``edgestream-bridge-<job>``).
    #: Keep it fixed: the MQTT broker keeps the session's messages for that id while the bridge is away.
    client_id: str = ""
    #: Seconds the MQTT broker keeps the session (and queues its messages) while the bridge is away.
    session_expiry_s: int = 86_400
    #: Most messages received and not yet acknowledged by Kafka (MQTT 5 Receive Maximum;
    #: beyond it the bridge stops reading from MQTT: backpressure).
    max_in_flight: int = 1000
    keepalive_s: int = 30
    #: MQTT login ("" : none); the password is read from ``password_file``.
    username: str = ""
    password_file: str = ""
    #: TLS to the MQTT broker: the PEM file of its CA ("" : plain TCP).
    cafile: str = ""

    def address(self) -> tuple[str, int]:
        host, sep, port = self.broker.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"mqtt.broker must be host:port (got {self.broker!r})")
        return host.strip("[]"), int(port)

    def validate(self) -> None:
        from edgestream.streams.errors import TopicNameError
        from edgestream.streams.mqtt import MqttTopics

        self.address()
        try:
            MqttTopics(list(self.topics))
        except TopicNameError as exc:
            raise ConfigError(f"mqtt.topics: {exc}") from None
        if self.qos not in (0, 1) or isinstance(self.qos, bool):
            raise ConfigError(f"mqtt.qos must be 0 or 1 (got {self.qos!r})")
        _positive("mqtt.session_expiry_s", self.session_expiry_s)
        if not 1 <= self.max_in_flight <= 65_535:
            raise ConfigError(f"mqtt.max_in_flight must lie in [1, 65535] (MQTT's Receive Maximum; got "
                              f"{self.max_in_flight})")
        if not 5 <= self.keepalive_s <= 65_535:
            raise ConfigError(f"mqtt.keepalive_s must lie in [5, 65535] (got {self.keepalive_s})")
        if bool(self.username) != bool(self.password_file):
            raise ConfigError("mqtt.username and mqtt.password_file go together (the login and the file "
                              "holding its password)")


@dataclass
class LabelsSection:
    """Delayed labels (docs/ingest.md "Delayed labels"): with ``topic`` set, readings that
    arrive without a label wait up to ``max_delay_s`` for it from that topic."""

    #: The label topic ("": labels come inside the readings, as they always did).
    topic: str = ""
    #: How a label names its reading: ``record_id`` (the reading's record id: its sequence
    #: number, or the field ``input.record_id``) or ``event_time`` (to the millisecond).
    match: str = "record_id"
    #: Seconds a reading waits for its label (and a label for its reading); then it leaves,
    #: counted: the reading as dropped ``unlabeled``, the label as late.
    max_delay_s: float = 30.0
    #: Most readings one worker keeps waiting (and most labels); past it the oldest leave early, counted.
    max_pending: int = 200_000
    #: The label messages' JSON fields (a message is one object or an array of them). Without
    #: a ``device`` field, the message's Kafka key is the device.
    device: str = "device"
    record_id: str = "record_id"
    event_time: str = "event_time"
    time_unit: str = "s"
    label: str = "label"
    #: Simulated devices (`edgestream run`, `simulate`): each label is sent this many seconds
    #: after its reading, drawn uniformly from [low, high] ...
    simulate_delay_s: list[float] = field(default_factory=lambda: [0.0, 5.0])
    #: ... or, with this probability, never.
    simulate_missing: float = 0.0

    @property
    def delayed(self) -> bool:
        return bool(self.topic)

    def fields(self) -> Any:
        from edgestream.streams.labels import LabelFields

        return LabelFields(device=self.device, record_id=self.record_id, event_time=self.event_time,
                           time_unit=self.time_unit, label=self.label, match=self.match)

    def validate(self, cfg: JobConfig) -> None:
        from edgestream.streams.labels import MATCHES, TIME_UNITS

        if not self.topic:
            return
        try:
            named = TopicLayout(self.topic)  # one literal name: the checks of a shared topic's
        except TopicNameError as exc:
            raise ConfigError(f"labels.topic: {str(exc).replace('the shared device topic', 'the label topic')}") from None
        layout = cfg.input.layout()
        device_topics = {cfg.input.topic} if layout.keyed else {layout.topic(d) for d in cfg.devices.device_ids()}
        if not named.keyed or self.topic == SENSOR_DLQ or self.topic in device_topics:
            raise ConfigError(f"labels.topic={self.topic!r} is not a topic of its own (a device topic of "
                              f"input.topic={cfg.input.topic!r}, the dead-letter topic, or a pattern): name one "
                              "topic for the labels, e.g. labels.<job>")
        _choice("labels.match", self.match, MATCHES)
        _choice("labels.time_unit", self.time_unit, tuple(TIME_UNITS))
        _positive("labels.max_delay_s", self.max_delay_s)
        _positive("labels.max_pending", self.max_pending)
        if len(self.simulate_delay_s) != 2 or not all(map(math.isfinite, self.simulate_delay_s)) or \
                not 0 <= self.simulate_delay_s[0] <= self.simulate_delay_s[1]:
            raise ConfigError(f"labels.simulate_delay_s must be [low, high] seconds with 0 <= low <= high "
                              f"(got {self.simulate_delay_s})")
        if not 0 <= self.simulate_missing < 1:
            raise ConfigError(f"labels.simulate_missing must lie in [0, 1) (got {self.simulate_missing})")
        if cfg.kafka.ingest_source != "direct":
            raise ConfigError("labels.topic is read by assignment beside the device topics: use "
                              "kafka.ingest_source=direct")
        if cfg.train.stages:
            raise ConfigError("labels.topic cannot be used with train.stages (a stage-split model is trained "
                              "on inline labels only)")
        if self.match == "record_id" and cfg.input.format != "edgestream" and not cfg.input.record_id:
            raise ConfigError(f"labels.match=record_id with input.format={cfg.input.format!r} needs input.record_id "
                              "(the field a label names its reading by); or use labels.match=event_time")
        if self.match == "event_time" and cfg.input.format != "edgestream" and not cfg.input.event_time:
            raise ConfigError(f"labels.match=event_time with input.format={cfg.input.format!r} needs "
                              "input.event_time (without it a reading's time is the Kafka timestamp, which the "
                              "label's sender cannot know)")


@dataclass
class ServeSection:
    """Serving on the stream (docs/serving.md "Predictions"): each trained record's prediction,
    published by its worker on ``predictions.<job>``; and ``edgestream serve`` (docs/serving.md
    "Serve"), which predicts every record with the job's newest model."""

    #: Publish the prediction of every record a worker trains on, made before it trains on it.
    predictions: bool = False
    #: Classes (with their probabilities) each prediction lists, most probable first.
    top_k: int = 3
    #: ``edgestream serve``: the consumer group its instances share the device partitions in
    #: ("" = ``edgestream-<job>-serve``, inside the job's ``edgestream-<job>-`` group ACL).
    group: str = ""
    #: ``edgestream serve``: most records one forward pass predicts (a micro-batch).
    max_batch: int = 256
    #: ``edgestream serve``: longest a record waits for its micro-batch to fill, seconds.
    max_wait_s: float = 0.05
    #: ``edgestream serve``: seconds between looks for a newer checkpoint or export.
    poll_s: float = 2.0

    def group_of(self, cfg: JobConfig) -> str:
        """The consumer group of ``edgestream serve`` (``serve.group``, else ``edgestream-<job>-serve``)."""
        return self.group or f"edgestream-{cfg.job.name}-serve"

    def validate(self, cfg: JobConfig) -> None:
        if isinstance(self.top_k, bool) or not 1 <= self.top_k <= MAX_TOP_K:
            raise ConfigError(f"serve.top_k must be an integer in [1, {MAX_TOP_K}] (got {self.top_k!r})")
        if isinstance(self.max_batch, bool) or not 1 <= self.max_batch <= MAX_SERVE_BATCH:
            raise ConfigError(f"serve.max_batch must be an integer in [1, {MAX_SERVE_BATCH}] (got {self.max_batch!r})")
        _positive("serve.max_wait_s", self.max_wait_s)
        _positive("serve.poll_s", self.poll_s)
        if not self.predictions:
            return
        if not cfg.train.enabled:
            raise ConfigError("serve.predictions publishes what the training workers predict: it needs "
                              "train.enabled = true")
        if cfg.train.stages:
            raise ConfigError("serve.predictions cannot be used with train.stages (no stage of a split model "
                              "holds the whole model: the first reads the records, the last holds the classes); "
                              "turn one of them off")


#: Most classes a prediction message lists (``serve.top_k``).
MAX_TOP_K = 100
#: Most records one forward pass of ``edgestream serve`` predicts (``serve.max_batch``).
MAX_SERVE_BATCH = 65536


@dataclass
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    kafka: KafkaSection = field(default_factory=KafkaSection)
    data: DataSection = field(default_factory=DataSection)
    input: InputSection = field(default_factory=InputSection)
    devices: DevicesSection = field(default_factory=DevicesSection)
    buffer: BufferSection = field(default_factory=BufferSection)
    batcher: BatcherSection = field(default_factory=BatcherSection)
    workers: WorkersSection = field(default_factory=WorkersSection)
    run: RunSection = field(default_factory=RunSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    service: ServiceSection = field(default_factory=ServiceSection)
    train: TrainSection = field(default_factory=TrainSection)
    testbed: TestbedSection = field(default_factory=TestbedSection)
    mqtt: MqttSection = field(default_factory=MqttSection)
    labels: LabelsSection = field(default_factory=LabelsSection)
    serve: ServeSection = field(default_factory=ServeSection)

    def validate(self) -> JobConfig:
        _choice("kafka.ingest_source", self.kafka.ingest_source, INGEST_SOURCES)
        _choice("kafka.security_protocol", self.kafka.security_protocol, SECURITY_PROTOCOLS)
        _choice("kafka.sasl_mechanism", self.kafka.sasl_mechanism, SASL_MECHANISMS)
        if self.kafka.security_protocol != "PLAINTEXT" and not self.kafka.ssl_cafile:
            raise ConfigError(f"kafka.security_protocol={self.kafka.security_protocol!r} needs kafka.ssl_cafile "
                              "(the PEM file of the CA that signed the brokers' certificates)")
        if bool(self.kafka.ssl_certfile) != bool(self.kafka.ssl_keyfile):
            raise ConfigError("kafka.ssl_certfile and kafka.ssl_keyfile go together (a client certificate and its key)")
        if self.kafka.security_protocol == "SASL_SSL" and not self.kafka.sasl_username:
            raise ConfigError("kafka.security_protocol='SASL_SSL' needs kafka.sasl_username (and the password in "
                              "kafka.sasl_password_file or EDGESTREAM_KAFKA_PASSWORD)")
        source_named(self.data.source).validate(self)
        input_format, _ = self.input.resolved()
        if not input_format.reads_recordings and source_named(self.data.source).replay_directory(self) is not None:
            raise ConfigError(f"data.source={self.data.source!r} replays a recording's messages as recorded (edgestream's "
                              f"binary format), which input.format={self.input.format!r} does not read: use "
                              "input.format=edgestream for a recording")
        self._validate_layout()
        self.mqtt.validate()
        self.labels.validate(self)
        self.serve.validate(self)
        parse_value_range(self.data.value_range)
        _non_negative("data.value_margin", self.data.value_margin)
        _non_negative("data.observed_warmup", self.data.observed_warmup)
        self.data.timestamp_skew_s()
        _non_negative("data.duplicate_window", self.data.duplicate_window)
        if not 0 < self.data.heldout_fraction < 1:
            raise ConfigError(f"data.heldout_fraction must lie in (0, 1) (got {self.data.heldout_fraction})")
        self.data.heldout_split_seed(self.job.seed)
        _choice("data.evaluate_on", self.data.evaluate_on, ("heldout", "validation"))
        if self.data.evaluate_on == "validation" and self.data.validation_fraction == 0:
            raise ConfigError("data.evaluate_on=validation needs a validation split: set data.validation_fraction "
                              "above 0 (default 0.1)")
        if not 0 <= self.data.validation_fraction < 1:
            raise ConfigError(f"data.validation_fraction must lie in [0, 1) (got {self.data.validation_fraction}; "
                              "0 keeps no validation split)")
        _choice("data.partition", self.data.partition, ("iid", "dirichlet", "classes"))
        _choice("buffer.policy", self.buffer.policy, ("persist", "truncate", "backpressure"))
        _choice("batcher.mode", self.batcher.mode, ("window", "fixed"))
        _choice("batcher.window_overflow", self.batcher.window_overflow, ("persist", "truncate"))
        _positive("buffer.capacity", self.buffer.capacity)
        _positive("batcher.window_s", self.batcher.window_s)
        _positive("batcher.max_batch", self.batcher.max_batch)
        _positive("batcher.batch_size", self.batcher.batch_size)
        if self.batcher.max_batch_widen and self.batcher.max_batch_widen < self.batcher.max_batch:
            raise ConfigError(f"batcher.max_batch_widen ({self.batcher.max_batch_widen}) must be 0 (no widening) "
                              f"or at least batcher.max_batch ({self.batcher.max_batch})")
        _positive("devices.count", self.devices.count)
        for key, count in (("devices.count", self.devices.count), ("workers.count", self.workers.count)):
            if count > MAX_DEVICES:  # before anything lists the devices or workers
                raise ConfigError(f"{key}={count} is above the limit of {MAX_DEVICES}")
        _positive("devices.time_scale", self.devices.time_scale)
        _positive("devices.message_interval_s", self.devices.message_interval_s)
        _positive("workers.count", self.workers.count)
        _positive("service.shutdown_grace_s", self.service.shutdown_grace_s)
        _positive("service.liveness_timeout_s", self.service.liveness_timeout_s)
        _choice("service.log_format", self.service.log_format, LOG_FORMATS)
        if self.devices.ids and len(self.devices.ids) != self.devices.count:
            raise ConfigError(
                f"devices.ids lists {len(self.devices.ids)} ids but devices.count is {self.devices.count}"
            )
        if not self.devices.rates_hz or not all(0 < r < float("inf") for r in self.devices.rates_hz):
            raise ConfigError("devices.rates_hz must be a non-empty list of positive rates")
        from edgestream.streams.profiles import parse_profile

        try:
            parse_profile(self.devices.profile, 1.0)
        except ValueError as exc:
            raise ConfigError(f"devices.profile: {exc}") from None
        if self.workers.count > self.devices.count and not self.train.stages:  # a split model: w0 reads all
            raise ConfigError(
                f"workers.count={self.workers.count} exceeds devices.count={self.devices.count}: "
                "every worker needs at least one device stream"
            )
        _positive("train.max_step_batch", self.train.max_step_batch)
        _positive("train.lr", self.train.lr)
        _positive("train.eval_every_s", self.train.eval_every_s)
        _positive("train.checkpoint_every_steps", self.train.checkpoint_every_steps)
        _positive("train.checkpoint_keep", self.train.checkpoint_keep)
        _non_negative("train.max_grad_norm", self.train.max_grad_norm)
        _non_negative("train.max_abs_weight", self.train.max_abs_weight)
        _non_negative("train.culprit_max_probes", self.train.culprit_max_probes)
        if self.train.grad_norm_spike != 0 and self.train.grad_norm_spike <= 1:
            raise ConfigError(f"train.grad_norm_spike must be > 1, or 0 for off (got {self.train.grad_norm_spike})")
        _positive("train.torch_threads", self.train.torch_threads)
        _non_negative("train.momentum", self.train.momentum)
        _non_negative("train.target_accuracy", self.train.target_accuracy)
        _positive("run.duration_s", self.run.duration_s)
        _positive("run.drain_timeout_s", self.run.drain_timeout_s)
        _positive("run.drain_max_s", self.run.drain_max_s)
        _non_negative("run.max_restarts", self.run.max_restarts)
        _non_negative("run.restart_backoff_s", self.run.restart_backoff_s)
        if self.run.workers_password_file and self.kafka.security_protocol != "SASL_SSL":
            raise ConfigError("run.workers_password_file logs the workers in with SCRAM: it needs "
                              f"kafka.security_protocol='SASL_SSL', not {self.kafka.security_protocol!r}")
        _positive("limits.max_record_message_bytes", self.limits.max_record_message_bytes)
        _positive("limits.max_records_per_message", self.limits.max_records_per_message)
        _positive("kafka.max_message_bytes", self.kafka.max_message_bytes)
        if any(f < 1 for f in self.workers.slowdown):
            raise ConfigError(f"workers.slowdown factors must be >= 1 (got {self.workers.slowdown})")
        _non_negative("workers.step_base_s", self.workers.step_base_s)
        _non_negative("workers.step_per_record_s", self.workers.step_per_record_s)
        for entry in self.workers.cpus:
            try:
                parse_cpu_list(entry)
            except ValueError as exc:
                raise ConfigError(f"workers.cpus: {exc}") from None
        if not 0 <= self.train.injection_alpha <= 1 or self.train.injection_beta < 0:
            raise ConfigError("train.injection_alpha must be in [0, 1] and train.injection_beta >= 0")
        _positive("train.injection_pool_per_class", self.train.injection_pool_per_class)
        _positive("train.heartbeat_s", self.train.heartbeat_s)
        _positive("train.member_timeout_s", self.train.member_timeout_s)
        if self.train.member_timeout_s < 2 * self.train.heartbeat_s:
            raise ConfigError(
                f"train.member_timeout_s={self.train.member_timeout_s} must be at least twice "
                f"train.heartbeat_s={self.train.heartbeat_s} (one late heartbeat must not drop a worker)"
            )
        unknown = [w for w in self.train.initial_workers if w not in self.worker_names()]
        if unknown:
            raise ConfigError(
                f"train.initial_workers names {unknown}, not workers of this job ({self.worker_names()})"
            )
        self._validate_byzantine()
        _choice("train.compression_controller", self.train.compression_controller, ("none", "accordion", "budget"))
        if self.train.stages:
            if len(self.train.stages) + 1 != self.workers.count:
                raise ConfigError(
                    f"train.stages = {self.train.stages} cuts the model into {len(self.train.stages) + 1} stages, "
                    f"one worker each: set workers.count = {len(self.train.stages) + 1} (it is {self.workers.count})")
            if self.train.initial_workers:
                raise ConfigError("train.initial_workers cannot be used with train.stages (every stage is needed)")
        for key in ("codec_params", "strategy_params", "controller_params", "model_params"):
            for item in getattr(self.train, key):
                if "=" not in item:
                    raise ConfigError(f"train.{key} entries look like name=value (got {item!r})")
        layout = self.input.layout()
        for device in self.devices.device_ids():
            try:
                layout.topic(device)
            except TopicNameError as exc:
                raise ConfigError(f"devices: {exc}") from None
        self._validate_testbed()
        return self

    def _validate_layout(self) -> None:
        """``input.topic`` and, for a shared topic, ``input.partitions``, ``input.device_idle_s``,
        ``input.max_devices`` and what a shared topic cannot be read with."""
        if not self.input.layout().keyed:
            return
        if not 1 <= self.input.partitions <= MAX_SHARED_PARTITIONS:
            raise ConfigError(f"input.partitions must lie in [1, {MAX_SHARED_PARTITIONS}] "
                              f"(got {self.input.partitions})")
        if self.input.partitions < self.workers.count and not self.train.stages:
            raise ConfigError(f"input.partitions={self.input.partitions} is fewer than workers.count="
                              f"{self.workers.count}: a worker reads whole partitions, so some would read "
                              "nothing; give the shared topic at least one partition per worker")
        _positive("input.device_idle_s", self.input.device_idle_s)
        if self.input.max_devices < 1:
            raise ConfigError(f"input.max_devices must be at least 1 (got {self.input.max_devices})")
        if self.kafka.ingest_source != "direct":
            raise ConfigError(f"input.topic={self.input.topic!r} is a topic shared by every device, whose "
                              "partitions each worker reads by assignment: use kafka.ingest_source=direct")
        if source_named(self.data.source).replay_directory(self) is not None:
            raise ConfigError(f"input.topic={self.input.topic!r} is a shared topic, and a recording replays "
                              "one topic per device: use a pattern with {device} for a recording")
        if not self.train.stages:
            for worker in self.worker_names():
                if not self.devices_of(worker):
                    raise ConfigError(
                        f"input.topic={self.input.topic!r} is a shared topic, and {worker} reads its partitions "
                        f"{self.partitions_of(worker)}, where no device of the job falls (a device's partition "
                        "follows from its id): every worker needs at least one device stream; add devices, "
                        "or use fewer workers")

    def _validate_byzantine(self) -> None:
        """``workers.byzantine``, ``workers.attack`` and ``workers.attack_seed``."""
        w = self.workers
        _choice("workers.attack", w.attack, BYZANTINE_ATTACKS)
        if not 0 <= w.attack_seed <= MAX_ATTACK_SEED:
            raise ConfigError(f"workers.attack_seed must lie in [0, {MAX_ATTACK_SEED}] (got {w.attack_seed})")
        if not w.byzantine:
            return
        names = self.worker_names()
        if "server" in w.byzantine:
            raise ConfigError("workers.byzantine names 'server': only workers can be made Byzantine (the server "
                              "is what aggregates; its robust options are train.strategy_params)")
        unknown = [name for name in w.byzantine if name not in names]
        if unknown:
            shown = names if len(names) <= 10 else [*names[:10], "..."]
            raise ConfigError(f"workers.byzantine names {unknown}, not workers of this job ({', '.join(shown)})")
        twice = sorted({name for name in w.byzantine if w.byzantine.count(name) > 1})
        if twice:
            raise ConfigError(f"workers.byzantine lists {twice} more than once")
        if not self.train.enabled:
            raise ConfigError("workers.byzantine needs train.enabled = true (a Byzantine worker corrupts the "
                              "updates it sends; without training it sends none)")
        if self.train.stages:
            raise ConfigError("workers.byzantine cannot be used with train.stages (it corrupts the updates "
                              "that robust aggregation combines; stage-split jobs aggregate none)")

    def _validate_testbed(self) -> None:
        from edgestream.deploy.testbed.links import parse_link
        from edgestream.deploy.testbed.plan import check_subnet

        tb = self.testbed
        if tb.brokers not in (1, 3):
            raise ConfigError(f"testbed.brokers must be 1 or 3 (got {tb.brokers})")
        try:
            check_subnet(tb.subnet)
        except ValueError as exc:
            raise ConfigError(f"testbed.subnet: {exc}") from None
        hosts = tb.host_names(self.worker_names())
        unknown = sorted(set(tb.links) - set(hosts))
        if unknown:
            raise ConfigError(f"testbed.links names {', '.join(unknown)}, not hosts of this job; "
                              f"hosts: {', '.join(hosts)}")
        for key, text in [("testbed.default_link", tb.default_link),
                          *((f"testbed.links.{h}", t) for h, t in tb.links.items())]:
            try:
                link = parse_link(text)
            except ValueError as exc:
                raise ConfigError(f"{key}: {exc}") from None
            if key.startswith("testbed.links.b") and link.delayed:
                raise ConfigError(f"{key}={text!r}: a broker host's link cannot have a delay (the delay is added "
                                  "in front of the brokers, in the delayed client hosts); give it a rate only")

    def worker_names(self) -> list[str]:
        return [f"w{i}" for i in range(self.workers.count)]

    def devices_of(self, worker: str) -> list[str]:
        """Devices assigned to ``worker``: round-robin over the device list; with a shared
        topic, the configured devices whose partition (``TopicLayout.partition_of``) it reads."""
        names = self.worker_names()
        if worker not in names:
            raise ConfigError(f"unknown worker {worker!r}; this job has {names}")
        index = names.index(worker)
        if self.train.stages:  # a split model: its first stage reads every device
            return self.devices.device_ids() if index == 0 else []
        layout = self.input.layout()
        if layout.keyed:  # the devices in its partitions of the shared topic
            mine = set(self.partitions_of(worker))
            return [d for d, p in self.device_partitions().items() if p in mine]
        return self.devices.device_ids()[index :: self.workers.count]

    def device_partitions(self) -> dict[str, int]:
        """With a shared device topic, each configured device's partition of it
        (``TopicLayout.partition_of``, computed once per device list; read-only); else empty."""
        if not self.input.layout().keyed:
            return {}
        return _partitions(tuple(self.devices.device_ids()), self.input.partitions)

    def partitions_of(self, worker: str) -> list[int]:
        """A shared device topic's partitions that ``worker`` reads: ``p`` with ``p mod
        workers.count`` its index (a split model's first stage: all). Empty for a layout
        of one topic per device."""
        if not self.input.layout().keyed:
            return []
        names = self.worker_names()
        if worker not in names:
            raise ConfigError(f"unknown worker {worker!r}; this job has {names}")
        index = names.index(worker)
        if self.train.stages:
            return list(range(self.input.partitions)) if index == 0 else []
        return list(range(index, self.input.partitions, self.workers.count))

    def state_path(self) -> Path:
        return Path(self.run.state_dir or f".edgestream/runs/{self.job.name}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@functools.lru_cache(maxsize=8)
def _partitions(devices: tuple[str, ...], partitions: int) -> dict[str, int]:
    """Each device's partition of a shared topic (computed once per device list)."""
    return {d: TopicLayout.partition_of(d, partitions) for d in devices}


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")


def _positive(key: str, value: float) -> None:
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigError(f"{key} must be a finite number > 0 (got {value})")


def _non_negative(key: str, value: float) -> None:
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"{key} must be a finite number >= 0 (got {value})")


def _coerce(key: str, raw: Any, typ: Any) -> Any:
    """Convert a TOML value or an override string to the field's declared type."""
    origin = get_origin(typ)
    if origin is dict:
        _, inner = get_args(typ)
        if not isinstance(raw, dict):
            raise ConfigError(f"{key} must be a table of name = value (got {raw!r}); one entry: "
                              f"--set {key}.NAME=VALUE")
        return {str(k): _coerce(f"{key}.{k}", v, inner) for k, v in raw.items()}
    if origin is list:
        (inner,) = get_args(typ)
        if isinstance(raw, str):
            raw = [item for item in (part.strip() for part in raw.split(",")) if item]
        if not isinstance(raw, list):
            raise ConfigError(f"{key} must be a list (got {raw!r})")
        return [_coerce(key, item, inner) for item in raw]
    try:
        if typ is bool:
            if isinstance(raw, str):
                if raw.lower() in ("1", "true", "yes", "on"):
                    return True
                if raw.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(raw)
            return bool(raw)
        if typ is int:
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError(raw)
            return int(raw)
        if typ is float:
            return float(raw)
        if typ is str:
            return str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={raw!r} is not a valid {getattr(typ, '__name__', typ)}") from None
    return raw


def _set(cfg: JobConfig, dotted: str, raw: Any) -> None:
    parts = dotted.split(".")
    if len(parts) == 3:  # one entry of a table key: testbed.links.w1=1mbit
        _set_entry(cfg, parts, raw)
        return
    if len(parts) != 2:
        raise ConfigError(f"config key {dotted!r} must look like section.key (e.g. buffer.policy)")
    section_name, key = parts
    section = getattr(cfg, section_name, None)
    if section is None or not dataclasses.is_dataclass(section):
        sections = [f.name for f in dataclasses.fields(cfg)]
        raise ConfigError(f"unknown config section {section_name!r}; sections: {', '.join(sections)}")
    hints = _hints(type(section))
    if key not in hints:
        keys = [f.name for f in dataclasses.fields(section)]
        raise ConfigError(f"unknown key {dotted!r}; {section_name} has: {', '.join(keys)}")
    setattr(section, key, _coerce(dotted, raw, hints[key]))


@functools.cache
def _hints(section_type: type) -> dict[str, Any]:
    """The resolved field types of a config section (resolving them is most of a key's cost)."""
    return get_type_hints(section_type)


def _set_entry(cfg: JobConfig, parts: list[str], raw: Any) -> None:
    section_name, key, entry = parts
    section = getattr(cfg, section_name, None)
    hints = _hints(type(section)) if dataclasses.is_dataclass(section) else {}
    if get_origin(hints.get(key)) is not dict:
        raise ConfigError(f"config key {'.'.join(parts)!r} must look like section.key (e.g. buffer.policy); "
                          "only table keys (such as testbed.links) take section.key.name")
    _, inner = get_args(hints[key])
    getattr(section, key)[entry] = _coerce(".".join(parts), raw, inner)


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> JobConfig:
    """Build a validated ``JobConfig`` from a TOML file, environment and overrides."""
    cfg = JobConfig()
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"job file {path} does not exist{missing_job_hint(path)}")
        try:
            text = path.read_text(encoding="utf-8")
            if path.suffix == ".json":  # the effective config `edgestream run` hands to workers
                data = json.loads(text)
            else:
                data = tomllib.loads(text)
        except OSError as exc:
            raise ConfigError(f"job file {path} cannot be read: {exc}") from None
        except (ValueError, RecursionError) as exc:
            # ValueError: TOMLDecodeError, JSONDecodeError, UnicodeDecodeError (not UTF-8),
            # an integer of over 4300 digits; RecursionError: nesting too deep.
            raise ConfigError(f"{path}: invalid {path.suffix[1:].upper() or 'TOML'}: {str(exc)[:200]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: must hold an object of [section] tables")
        for section_name, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: top-level key {section_name!r} must be a [section]")
            if section_name == "testbed" and "enabled" not in values:
                cfg.testbed.enabled = True  # a [testbed] table turns it on
            for key, value in values.items():
                _set(cfg, f"{section_name}.{key}", value)
    env = os.environ if env is None else env
    for name, value in sorted(env.items()):
        if name.startswith("EDGESTREAM__"):
            dotted = name[len("EDGESTREAM__") :].lower().replace("__", ".")
            try:
                _set(cfg, dotted, value)
            except ConfigError as exc:  # name the variable: nothing on the command line shows it
                raise ConfigError(f"environment variable {name}: {exc} (fix or unset {name})") from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        dotted, value = item.split("=", 1)
        _set(cfg, dotted.strip(), value.strip())
    source_named(cfg.data.source).configure(cfg)
    return cfg.validate()


def dump_config(cfg: JobConfig) -> str:
    """The effective configuration as JSON (for logs and run summaries)."""
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True)
