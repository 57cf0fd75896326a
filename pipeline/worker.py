"""One worker (or server) process: creates the topics it needs, serves /metrics, runs its
Faust app until stopped, and says how it ended (``exit.json``: code and crash reason).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import faust

from edgestream.job.config import ConfigError, JobConfig
from edgestream.job.sources import job_fleet_data
from edgestream.job.topics import (
    channel_topic,
    label_topics,
    prediction_topics,
    sensor_partitions,
    sensor_topics_for,
    training_topics,
)
from edgestream.monitoring.health import Health
from edgestream.monitoring.metrics import Metrics, serve
from edgestream.pipeline import memory
from edgestream.pipeline.app import (
    CountingSink,
    app_id,
    create_app,
    new_faust_app,
    offsets_by_group,
    sensor_group,
)
from edgestream.pipeline.exits import ENDPOINT_FILE, FREEZE_SIGNAL, FROZEN_FILE, worker_state_dir
from edgestream.pipeline.kafka_io import (
    adopt_group_offsets,
    end_offsets,
    ensure_topics,
    group_positions,
    set_group_offsets,
)
from edgestream.pipeline.outage import BrokerWatch
from edgestream.pipeline.service import CONTEXT, ProcessService, StopSignals
from edgestream.streams.topics import SERVER_NAME

log = logging.getLogger(__name__)



class ProcessCrashed(RuntimeError):
    """The Faust app of a worker or server stopped on an error; ``reason`` is that error."""

    def __init__(self, reason: BaseException | None, code: object) -> None:
        self.reason = reason
        self.code = code
        super().__init__(f"{type(reason).__name__}: {reason}" if reason is not None
                         else f"the Faust worker stopped with exit code {code} and no crash reason")


def write_json_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
    tmp.replace(path)


def _start(cfg: JobConfig, name: str, metrics_port: int, devices: list[str],
           ready_when: tuple[str, ...]) -> tuple[Path, Metrics]:
    """State dir, metrics and health endpoints of process ``name``; readiness waits for
    ``ready_when`` (Kafka was reached before this: that one holds already)."""
    state = worker_state_dir(cfg, name)
    state.mkdir(parents=True, exist_ok=True)
    (state / FROZEN_FILE).unlink(missing_ok=True)  # an earlier run's: this one is not frozen
    metrics = Metrics(health=Health(cfg.service.liveness_timeout_s))
    metrics.health.require("kafka", *ready_when)
    metrics.health.set("kafka", True, "topics created")
    port = serve(metrics, metrics_port, cfg.workers.metrics_host)
    metrics.worker_up.labels(name).set(1)
    metrics.worker_ready.labels(name).set(0)
    write_json_atomic(
        state / ENDPOINT_FILE,
        {"worker": name, "pid": os.getpid(), "metrics": f"http://{cfg.workers.metrics_host}:{port}/metrics",
         "health": f"http://{cfg.workers.metrics_host}:{port}/healthz",
         "ready": f"http://{cfg.workers.metrics_host}:{port}/readyz", "devices": devices},
    )
    return state, metrics


def worker_cpus(cfg: JobConfig, worker: str) -> set[int] | None:
    """The CPUs ``worker`` is pinned to (``workers.cpus``), checked against the CPUs this
    process may use; None: not pinned. Raises ``ConfigError`` naming the key."""
    names = cfg.worker_names()
    cpus = cfg.workers.cpus_of(names.index(worker)) if worker in names else None
    if cpus is None:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("workers.cpus needs Linux (os.sched_setaffinity); leave it empty here")
    usable = os.sched_getaffinity(0)
    if not cpus <= usable:
        raise ConfigError(f"workers.cpus pins {worker} to CPUs {sorted(cpus)}, but only {sorted(usable)} "
                          "are available here")
    return cpus


def process_topics(cfg: JobConfig, name: str, subscribes: tuple[str, ...] = ()) -> dict[str, str]:
    """Topics process ``name`` (a worker or the server) reads or writes, name -> kind:
    a worker's device topics and ``sensors.dlq``, and the job's training topics (a worker's
    with ``predictions.<job>`` if it publishes predictions); with
    ``inbox`` among its strategy's channels (``subscribes``), its own ``inbox.<job>.<name>``."""
    wanted = {} if name == SERVER_NAME else {**sensor_topics_for(cfg.devices_of(name), cfg.input.layout()),
                                             **label_topics(cfg)}
    if cfg.train.enabled:
        wanted.update(training_topics(cfg.job.name, [name] if "inbox" in subscribes else []))
        if name != SERVER_NAME:
            wanted.update(prediction_topics(cfg))
    return wanted


def update_topics(cfg: JobConfig, name: str | None = None, subscribes: tuple[str, ...] = ()) -> list[str]:
    """The job's update topics (gradients, models, control), plus process ``name``'s own
    inbox when its strategy subscribes to ``inbox``: what a training process's Faust app
    may read, in its own consumer group."""
    inboxes = [name] if name is not None and "inbox" in subscribes else []
    return [topic for topic, kind in training_topics(cfg.job.name, inboxes).items() if kind != "dlq"]


def warn_byzantine(cfg: JobConfig) -> None:
    """Warn, if the job has Byzantine workers (``workers.byzantine``), that they corrupt what
    they send on purpose. ``edgestream run`` calls it once, before it starts any process."""
    if cfg.workers.byzantine:
        log.warning("fault injection (workers.byzantine): every gradient and delta sent by %s is corrupted on "
                    "purpose with %s (workers.attack), for robustness evaluation; not a setting for a real job",
                    ", ".join(cfg.workers.byzantine), cfg.workers.attack)


def check_training_config(cfg: JobConfig) -> tuple[str, ...]:
    """Build what the training processes of ``cfg`` build from ``train.*`` - the strategy for
    every role the job runs, the codec, the driver and with it the model, checked on the job's
    data (``trainers.assembly.build_trainer``: a user's ``"package.module:factory"`` imports,
    builds and returns one finite score per class) - and raise ``ConfigError`` naming the key
    if one cannot be built. Returns the channels a worker's strategy reads (``subscribes``;
    empty without training). No side effects (no Kafka, no files); imports torch."""
    if not cfg.train.enabled:
        return ()
    from edgestream.compression import registry as compressors
    from edgestream.job.plan import parse_params
    from edgestream.pipeline.training import build_driver
    from edgestream.trainers.strategies import roles

    data = job_fleet_data(cfg)
    try:
        compressors.create(cfg.train.codec, **parse_params(cfg.train.codec_params))
    except Exception as exc:
        given = f" with train.codec_params={cfg.train.codec_params}" if cfg.train.codec_params else ""
        raise ConfigError(f"train.codec={cfg.train.codec!r}{given}: {exc}") from exc
    try:
        job_roles = ("worker", "server") if "server" in roles(cfg.train.strategy) else ("worker",)
    except Exception as exc:
        raise ConfigError(f"train.strategy={cfg.train.strategy!r}: {exc}") from exc
    subscribes: tuple[str, ...] = ()
    for role in job_roles:
        name = SERVER_NAME if role == "server" else cfg.worker_names()[0]
        try:
            driver = build_driver(cfg, name, data, role=role)
        except ConfigError as exc:
            if cfg.train.strategy_params and "train.strategy=" in str(exc):
                raise ConfigError(f"{exc} (train.strategy_params={cfg.train.strategy_params})") from exc
            raise
        if role == "worker":
            subscribes = tuple(driver.strategy.subscribes)
    return subscribes


class _NoConsoleTracebacks(logging.Filter):
    """Above debug level a handler shows log records without their tracebacks: a crash is
    reported on one line by the CLI, and ``--loglevel debug`` shows every traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        return True


def quiet_tracebacks(logger: logging.Logger, level: int) -> None:
    """Hide tracebacks from ``logger``'s handlers unless ``level`` is debug."""
    if level <= logging.DEBUG:
        return
    for handler in logger.handlers:
        if not any(isinstance(f, _NoConsoleTracebacks) for f in handler.filters):
            handler.addFilter(_NoConsoleTracebacks())


class _FaustWorker(faust.Worker):
    """``faust.Worker`` whose log handlers (set up by Faust) hide tracebacks above debug,
    and whose SIGTERM/SIGINT go to ``stop_signals``: the first calls ``on_signal`` at once
    (before Faust's shutdown hooks run: a training process freezes there) and starts
    Faust's shutdown under the grace timer; a second exits at once."""

    on_signal: Callable[[], None] | None = None
    stop_signals: StopSignals | None = None
    #: ``FREEZE_SIGNAL`` (SIGUSR2; mode would start a debugger): freeze, without stopping.
    on_freeze: Callable[[], None] | None = None

    def _on_sigusr2(self) -> None:
        if self.on_freeze is not None:
            self.on_freeze()

    def on_setup_root_logger(self, logger: logging.Logger, level: int) -> None:
        super().on_setup_root_logger(logger, level)
        quiet_tracebacks(logger, level)

    def _stop(self, signum: int) -> None:
        if self.on_signal is not None:
            self.on_signal()
        if signum == signal.SIGINT:
            super()._on_sigint()
        else:
            super()._on_sigterm()

    def _on_sigterm(self) -> None:
        self._signalled(signal.SIGTERM)

    def _on_sigint(self) -> None:
        self._signalled(signal.SIGINT)

    def _signalled(self, signum: int) -> None:
        if self.stop_signals is None:
            self._stop(signum)
            return
        self.stop_signals.on_stop = self._stop
        self.stop_signals(signum)


def freezer(state: Path, begin_stop: Callable[[], None] | None) -> Callable[[], None]:
    """What ``FREEZE_SIGNAL`` does in the process whose state dir is ``state``: freeze its
    training (``begin_stop``; none for an ingest-only worker) and write ``FROZEN_FILE``
    (``_start`` removed the marker an earlier run of the process left)."""
    marker = state / FROZEN_FILE

    def freeze() -> None:
        if begin_stop is not None:
            begin_stop()
        try:
            marker.write_text("frozen\n")
        except OSError as exc:  # the run then waits out its freeze timeout, nothing worse
            log.warning("could not write %s: %s", marker, exc)

    return freeze


def ignore_freeze_until_ready() -> None:
    """Ignore ``FREEZE_SIGNAL`` until the event loop handles it (its default action ends the
    process); only the main thread may set a handler."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(FREEZE_SIGNAL, signal.SIG_IGN)


def _execute(app: faust.App, loglevel: str, on_signal: Callable[[], None] | None = None,
             stop_signals: StopSignals | None = None, own_logging: bool = False,
             on_freeze: Callable[[], None] | None = None) -> None:
    """Run ``app`` until it stops; raise ``ProcessCrashed`` if it stopped on an error.

    ``own_logging``: keep the process's log handlers (JSON lines) instead of Faust's.

    ``Worker.execute_from_commandline`` always ends in ``SystemExit``: code 1 after a
    crash (mode re-raises the crash reason, or the start-up error, inside its
    ``exiting()`` guard, so it is the exit's ``__context__``), 0 after a signal.
    """
    memory.freeze_startup_objects()
    runner = _FaustWorker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False,
                          override_logging=not own_logging)
    runner.on_signal = on_signal
    runner.stop_signals = stop_signals
    runner.on_freeze = on_freeze
    code: object = 0
    cause: BaseException | None = None
    try:
        runner.execute_from_commandline()
    except SystemExit as exc:
        code = exc.code
        cause = exc.__context__
    crash = runner.crash_reason or app.crash_reason
    if code not in (0, None) or crash is not None:
        reason = cause if isinstance(cause, Exception) else crash
        raise ProcessCrashed(reason, code) from reason  # the CLI logs the chain at debug level


#: Records at the end of the gradients log a worker without a checkpoint looks at to tell
#: whether the job is already running (records of other workers there: it joins).
JOIN_PROBE_RECORDS = 64


def records_of_others(bootstrap: str, cfg: JobConfig, worker: str) -> int:
    """How many of the last ``JOIN_PROBE_RECORDS`` records of the job's gradients log, at or
    after where ``worker`` would start reading it (its group's committed offset, else the
    beginning), other workers published (the key of every update record is its sender)."""
    from kafka.structs import TopicPartition

    from edgestream.pipeline.kafka_io import read_range

    topic = channel_topic(cfg.job.name, "gradients")
    start = group_positions(bootstrap, app_id(cfg, worker), [topic]).get(f"{topic}:0", 0)
    tp = TopicPartition(topic, 0)
    end = end_offsets(bootstrap, [topic]).get(tp, 0)
    first = max(start, end - JOIN_PROBE_RECORDS)
    if first >= end:
        return 0
    return sum((record.key or b"").decode(errors="replace") != worker
               for record in read_range(bootstrap, tp, first, end, timeout_s=30.0,
                                        max_message_bytes=cfg.kafka.max_message_bytes,
                                        client_id="edgestream-join-probe"))


def join_decision(cfg: JobConfig, worker: str, bootstrap: str, state: Path, join: bool) -> tuple[bool, str]:
    """Whether ``worker`` enters the job as a joiner, and why (for its log).

    A worker with a checkpoint resumes from it (``--join`` or not). Without one it joins
    when told (``--join``) or when the job's gradients log already holds records of other
    workers where it would start reading: the job runs, and a fresh model replaying the
    log from there would never match its peers.
    """
    from edgestream.pipeline.training import has_checkpoint

    if has_checkpoint(cfg, state):
        return False, "resumes from its checkpoint" + (" (--join does not apply)" if join else "")
    if join:
        return True, "--join"
    others = records_of_others(bootstrap, cfg, worker)
    if others:
        return True, f"no checkpoint, and the gradients log holds {others} record(s) of other workers"
    return False, "no checkpoint and nothing of other workers in the gradients log: a founding member"


def run_worker(
    cfg: JobConfig, worker: str, bootstrap: str, metrics_port: int = 0, loglevel: str = "warning",
    join: bool = False,
) -> None:
    """Run the worker until SIGINT/SIGTERM; writes its endpoint, accounting and training summary.

    Creates its topics first (Faust only warns about a missing topic and then barely
    consumes). ``join``: enter a running job (see ``join_decision``): the update topics
    are read from their current end and the strategy waits for the model. A stop by
    SIGTERM/SIGINT is a graceful leave (``op: leave`` on the control topic).
    Raises ``ProcessCrashed`` if the Faust app stopped on an error.
    """
    ignore_freeze_until_ready()
    memory.tune_allocator()
    cpus = worker_cpus(cfg, worker)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # before torch or Faust start their threads: they inherit it
        log.info("%s pinned to CPUs %s", worker, sorted(cpus))
    devices = cfg.devices_of(worker)
    attack = cfg.workers.attack_of(worker)
    if attack is not None:
        log.warning("%s is a DELIBERATELY CORRUPTED (Byzantine) worker (workers.byzantine): it trains "
                    "honestly, then corrupts every gradient and delta it sends with %s (workers.attack_seed "
                    "= %d); its summary counts them (byzantine.corrupted). For robustness evaluation only",
                    worker, attack, cfg.workers.attack_seed)
    ensure_topics(bootstrap, process_topics(cfg, worker), sized=sensor_partitions(cfg))
    state, metrics = _start(cfg, worker, metrics_port, devices,
                            ("restored", "assigned") if cfg.train.enabled else ("assigned",))
    service = ProcessService(worker, cfg.job.name, metrics.health, cfg.service.shutdown_grace_s)
    data = job_fleet_data(cfg)
    runtime = None
    if cfg.train.enabled:
        from edgestream.pipeline.training import TrainingRuntime

        joining, why = join_decision(cfg, worker, bootstrap, state, join)
        runtime = TrainingRuntime(cfg, worker, data, metrics, state, joining=joining)
        CONTEXT.step = lambda: runtime.stats.steps
        subscribes = tuple(runtime.strategy.subscribes)
        if runtime.own_topics():  # its inbox, if its strategy reads one
            ensure_topics(bootstrap, runtime.own_topics())
        runtime.ensure_topics = lambda wanted: ensure_topics(bootstrap, wanted)
        if joining:
            # From the current end: the joiner's position in the log is fixed before it
            # announces itself (its first heartbeat), as BSP's joining protocol requires.
            ends = end_offsets(bootstrap, update_topics(cfg, worker, subscribes))
            set_group_offsets(bootstrap, app_id(cfg, worker), {f"{tp.topic}:{tp.partition}": off
                                                               for tp, off in ends.items()})
            log.warning("%s joins the running job (%s): reads the update topics from their end "
                        "and waits for the model", worker, why)
        elif join:
            log.warning("%s %s", worker, why)
        # Resume exactly at the checkpoint: commit its offsets, before any consumer starts,
        # for the groups that read each topic (device topics: the ingest source's group).
        for group, offsets in offsets_by_group(cfg, worker, runtime.resume_offsets).items():
            set_group_offsets(bootstrap, group, offsets)
        sink = runtime
        metrics.strategy_info.labels(worker, cfg.train.strategy).set(1)
    else:
        sink = CountingSink(metrics)
    layout = cfg.input.layout()
    sensor_topics = sorted({layout.topic(d) for d in devices})
    if sensor_group(cfg, worker) != app_id(cfg, worker):
        # Device-topic partitions the direct source's group has no offset for start where
        # the Faust group is (a switch of kafka.ingest_source, or a caller that positioned it).
        adopted = adopt_group_offsets(bootstrap, app_id(cfg, worker), sensor_group(cfg, worker), sensor_topics)
        if adopted:
            log.info("%s: sensor offsets taken from the Faust group: %s", worker, adopted)
    if runtime is not None and runtime.restored_from is None:
        runtime.start_fresh(group_positions(bootstrap, sensor_group(cfg, worker), sensor_topics),
                            group_positions(bootstrap, app_id(cfg, worker),
                                            update_topics(cfg, worker, tuple(runtime.strategy.subscribes))))
    if runtime is not None:
        metrics.health.set("restored", True, restored_detail(runtime))
    app, core = create_app(
        cfg, worker, bootstrap, sink, metrics,
        datadir=state / "faust", devices=devices,
        expected_shape=data.feature_shape, num_classes=data.num_classes,
        value_range=data.value_range,
        restored_ledger=runtime.restored_ledger if runtime else None,
        require_labels=runtime is not None,
        on_ready=lambda: _assigned(metrics, worker),
        tracker=runtime.sensor_offsets if runtime else None,
        extend=runtime.attach if runtime else None,
    )
    summary: dict = {}
    if runtime is not None:
        @app.on_before_shutdown.connect
        async def final(app_: faust.App, **kwargs) -> None:
            summary.update(await runtime.shutdown())

    _beat(app, metrics.health)
    watch = BrokerWatch(bootstrap, f"worker {worker}", log.warning).start()  # says an outage once, and its end
    try:
        begin_stop = runtime.begin_stop if runtime is not None else None
        _execute(app, loglevel, on_signal=begin_stop, stop_signals=service.signals,
                 own_logging=cfg.service.log_format == "json", on_freeze=freezer(state, begin_stop))
    finally:
        watch.stop()
        metrics.worker_up.labels(worker).set(0)
        write_json_atomic(state / "accounting.json", {"worker": worker, "devices": core.accounting(),
                                                      "labels": core.label_counts if core.label_join else {}})
        if summary:
            write_json_atomic(state / "training.json", summary)
        service.close()


def run_server(cfg: JobConfig, bootstrap: str, metrics_port: int = 0, loglevel: str = "warning") -> None:
    """The parameter server of strategies with a server role (ASP, SSP, ADSP).

    Creates the training topics first; raises ``ProcessCrashed`` if its Faust app stopped on an error.
    """
    ignore_freeze_until_ready()
    memory.tune_allocator()
    from edgestream.pipeline.training import TrainingRuntime

    ensure_topics(bootstrap, process_topics(cfg, SERVER_NAME))
    state, metrics = _start(cfg, SERVER_NAME, metrics_port, [], ("restored", "assigned"))
    service = ProcessService(SERVER_NAME, cfg.job.name, metrics.health, cfg.service.shutdown_grace_s)
    data = job_fleet_data(cfg)
    runtime = TrainingRuntime(cfg, SERVER_NAME, data, metrics, state, role="server")
    CONTEXT.step = lambda: runtime.stats.steps
    if runtime.own_topics():
        ensure_topics(bootstrap, runtime.own_topics())
    runtime.ensure_topics = lambda wanted: ensure_topics(bootstrap, wanted)
    set_group_offsets(bootstrap, app_id(cfg, SERVER_NAME), runtime.resume_offsets)
    if runtime.restored_from is None:
        runtime.start_fresh({}, group_positions(bootstrap, app_id(cfg, SERVER_NAME),
                                                update_topics(cfg, SERVER_NAME, tuple(runtime.strategy.subscribes))))
    metrics.health.set("restored", True, restored_detail(runtime))
    app = new_faust_app(cfg, SERVER_NAME, bootstrap, state / "faust")

    @app.on_partitions_assigned.connect
    async def assigned(app_: faust.App, assigned, **kwargs) -> None:
        _assigned(metrics, SERVER_NAME)

    runtime.attach(app)

    summary: dict = {}

    @app.on_before_shutdown.connect
    async def final(app_: faust.App, **kwargs) -> None:
        summary.update(await runtime.shutdown())

    _ = assigned  # registered by its decorator
    _beat(app, metrics.health)
    try:
        _execute(app, loglevel, on_signal=runtime.begin_stop, stop_signals=service.signals,
                 own_logging=cfg.service.log_format == "json", on_freeze=freezer(state, runtime.begin_stop))
    finally:
        metrics.worker_up.labels(SERVER_NAME).set(0)
        if summary:
            write_json_atomic(state / "training.json", summary)
        service.close()


def _assigned(metrics: Metrics, name: str) -> None:
    """The process's partitions are assigned (and its agents started): ready, as far as Kafka goes."""
    metrics.worker_ready.labels(name).set(1)
    metrics.health.set("assigned", True, "partitions assigned")


def restored_detail(runtime) -> str:
    """What ``/readyz`` says of the model: restored from a checkpoint, fresh, or joining."""
    if runtime.restored_from is not None:
        return f"restored checkpoint at model version {runtime.restored_from}"
    return "joining: waits for the model from its peers" if runtime.joining else "fresh start (checkpoint 0)"


#: Seconds between beats of a process's event loop (``Health.beat``: liveness).
BEAT_INTERVAL_S = 1.0


def _beat(app: faust.App, health: Health) -> None:
    """Beat ``health`` from ``app``'s event loop: a loop that stops turning stops the beats."""

    async def beat() -> None:
        health.beat()

    app.timer(BEAT_INTERVAL_S, name="edgestream.health_beat")(beat)
