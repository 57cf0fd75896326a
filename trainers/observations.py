"""What a strategy observes of itself (``Observations``), each field declared once with its metric.

A field of :class:`Observations` is declared with :func:`observed`, which names its Prometheus
metric (name, type, help, labels). ``monitoring/metrics.py`` builds the metric objects and
the field -> metric map from these declarations, so a new strategy number is one field here.
This module imports nothing heavier than the standard library: the ingest process and the CLI
load ``monitoring.metrics`` without torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import Field, dataclass, field, fields
from typing import Any, Literal

MetricKind = Literal["gauge", "counter"]

__all__ = [
    "LOSS_FIT_PARAMS",
    "OBSERVATIONS",
    "ObservationMetric",
    "Observations",
    "metric_of",
    "observation_metrics",
    "observed",
]

#: ``param`` values of ``edgestream_loss_curve_fit``: ``l(t) = 1 / (a2 t + b) + c0`` and the fit's RMSE.
LOSS_FIT_PARAMS = ("a2", "b", "c0", "rmse")


@dataclass(frozen=True)
class ObservationMetric:
    """The Prometheus metric an observation is exported as.

    Its labels are ``worker`` (the process), then ``labels``. A *keyed* observation (a mapping
    per peer, a sequence per index) fills the last label from each key or index; ``fixed`` gives
    the values of the labels before it (several fields may share one metric that way: the
    loss-curve fit, ``param``). A ``counter`` exports a total's growth, a ``gauge`` a level.
    """

    kind: MetricKind
    name: str
    help: str
    labels: tuple[str, ...] = ()
    fixed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.startswith("edgestream_"):
            raise ValueError(f"observation metric {self.name!r}: names start with 'edgestream_'")
        if self.kind == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"observation metric {self.name!r}: a counter's name ends with '_total'")
        if len(self.fixed) > len(self.labels):
            raise ValueError(f"observation metric {self.name!r}: more fixed values than labels")

    @property
    def keyed(self) -> bool:
        """True when the observation's keys (or indices) fill the last label."""
        return len(self.labels) > len(self.fixed)


_METRIC = "edgestream_metric"


def observed(kind: MetricKind, name: str, help: str, labels: Sequence[str] = (),
             fixed: Sequence[str] = ()) -> Any:
    """An :class:`Observations` field (default None: not observed) exported as metric ``name``."""
    return field(default=None, metadata={_METRIC: ObservationMetric(kind, name, help, tuple(labels), tuple(fixed))})


def _loss_fit(param: str) -> Any:
    return observed(
        "gauge", "edgestream_loss_curve_fit",
        "Last fitted loss curve l(t) = 1 / (a2 t + b) + c0 of the ADSP server's search for C: "
        "param a2, b, c0, and the fit's rmse (loss units)",
        ("param",), (param,))


@dataclass(frozen=True)
class Observations:
    """A strategy's own numbers for the live runtime's metrics (:meth:`SyncStrategy.observations`).

    A fixed vocabulary: each field declares the metric it is exported as (:func:`observed`), so
    the runtime exports them without knowing which strategy it runs. None: the strategy has no
    such number (nothing is exported for it).

    *Levels* are the current value (gauges). *Totals* only grow; they count since the
    strategy's state began and continue across restarts (they live in its checkpointed
    state); the runtime exports the growth it sees as counters.
    """

    commit_target: int | None = observed(
        "gauge", "edgestream_target_commits",
        "Commits per check period the worker aims for (ADSP's C; on the server: the C its search chose)")
    """Level: commits per check period each worker aims for (ADSP's ``C``; on the server, its search's ``C``)."""
    committed_local_steps: int | None = observed(
        "counter", "edgestream_committed_local_steps_total",
        "Local steps contained in the updates the worker committed (ADSP, local SGD); "
        "local steps per commit = rate(this) / rate(edgestream_commits_total)")
    """Total: local steps contained in the updates this worker committed (ADSP, local SGD)."""
    steps_awaiting_commit: int | None = observed(
        "gauge", "edgestream_awaiting_commit_steps",
        "Local steps the worker took since its last commit that a commit falling due without further "
        "training will carry (ADSP: its next timed commit); absent where a commit needs more steps")
    """Level: local steps since the last commit that a timed commit will carry without further
    training (ADSP). Not reported where a commit needs more steps first (local SGD's partial
    round at the end of a stream is never committed), so the end-of-run check does not wait on it."""
    blocked_seconds: float | None = observed(
        "counter", "edgestream_blocked_seconds_total",
        "Seconds the sync rule kept the worker from training although it had a model (SSP: more "
        "than s clocks ahead of the slowest worker; gossip: a neighbour more than max_lag iterations "
        "behind); rate = fraction of time blocked")
    """Total: seconds the sync rule kept this worker from training although it had a model (SSP)."""
    clock_gap_steps: int | None = observed(
        "gauge", "edgestream_clock_gap_steps",
        "Fastest minus slowest live worker's clock, in local steps (SSP server; at most s + 1)")
    """Level: fastest minus slowest live worker's clock, in local steps (SSP server)."""
    fit_a2: float | None = _loss_fit("a2")
    """Level: ``a^2`` of the last fitted loss curve ``l(t) = 1 / (a^2 t + b) + c0`` (ADSP server)."""
    fit_b: float | None = _loss_fit("b")
    """Level: ``b`` of the last fitted loss curve."""
    fit_c0: float | None = _loss_fit("c0")
    """Level: ``c0`` (the loss floor) of the last fitted loss curve."""
    fit_rmse: float | None = _loss_fit("rmse")
    """Level: root mean square error of the last fit, in loss units."""
    idle_fraction: float | None = observed(
        "gauge", "edgestream_idle_ratio",
        "Share of the worker's time in which it ran no local step (waiting for data or peers; gossip)")
    """Level: share of this worker's time in which it ran no local step (waiting for data or peers; gossip)."""
    iteration_time_s: float | None = observed(
        "gauge", "edgestream_iteration_seconds", "Mean time between the worker's recent local steps (gossip)")
    """Level: mean time between this worker's recent local steps, in seconds (gossip)."""
    iteration_time_cv: float | None = observed(
        "gauge", "edgestream_iteration_cv_ratio",
        "Coefficient of variation (std / mean) of the worker's recent iteration times (gossip)")
    """Level: coefficient of variation (std / mean) of those iteration times (gossip)."""
    neighbour_lag: Mapping[str, int] | None = observed(
        "gauge", "edgestream_neighbour_lag_steps",
        "Local steps by which the model the worker holds of neighbour `peer` is behind its own (gossip)",
        ("peer",))
    """Level per neighbour: how many iterations the model held of it is behind this worker's (gossip)."""
    mixing_weights: Mapping[str, float] | None = observed(
        "gauge", "edgestream_mixing_weight_ratio",
        "The worker's current mixing weight of process `peer` (itself included; they sum to 1; gossip)",
        ("peer",))
    """Level per process (itself included): this worker's current mixing weights, summing to 1 (gossip)."""
    model_sketch: Sequence[float] | None = observed(
        "gauge", "edgestream_model_sketch",
        "Component `index` of a fixed random projection of the worker's model, the same in every "
        "process (trainers/consensus.py); sqrt(sum(stdvar by (index) (this))) estimates the RMS "
        "distance of the workers' models to their average (consensus distance)",
        ("index",))
    """Level per index: a fixed random projection of this worker's own model
    (``trainers.consensus.ModelSketch``), the same projection in every process, so the
    spread of the sketches across workers estimates the consensus distance."""
    link_bandwidth: Mapping[str, float] | None = observed(
        "gauge", "edgestream_link_bandwidth_bytes_per_second",
        "The worker's estimate of the bandwidth of its link to `peer`, bytes/s (DLion)", ("peer",))
    """Level per peer: this worker's estimate of the bandwidth of its link to that peer, in bytes/s (DLion)."""
    link_ratio: Mapping[str, float] | None = observed(
        "gauge", "edgestream_link_ratio",
        "Share of the gradient's entries (0..1) the worker's last message to `peer` carried (DLion)", ("peer",))
    """Level per peer: share of the gradient's entries (0..1) the last message on that link carried (DLion)."""
    link_bytes: Mapping[str, float] | None = observed(
        "counter", "edgestream_link_bytes_total", "Bytes the worker sent to `peer` (DLion)", ("peer",))
    """Total per peer: bytes this worker sent to that peer (DLion)."""
    batch_size: int | None = observed(
        "gauge", "edgestream_step_batch_records",
        "Records the worker's next local step takes (dynamic batching; DLion)")
    """Level: records the next local step takes (dynamic batching; DLion)."""
    capacity: float | None = observed(
        "gauge", "edgestream_capacity_samples_per_second", "Measured samples per second the worker can train (DLion)")
    """Level: measured samples per second this worker can train (DLion)."""
    knowledge_transfers: Mapping[str, float] | None = observed(
        "counter", "edgestream_knowledge_transfers_total",
        "Models of sender `peer` merged into the worker's model (direct knowledge transfer; DLion)", ("peer",))
    """Total per sender: models merged into this worker's from that peer (direct knowledge transfer; DLion)."""
    stage: int | None = observed(
        "gauge", "edgestream_worker_stage", "Which stage of the split model the worker holds (0 reads the streams)")
    """Level: which stage of a split model this worker holds (0 reads the streams; synthetic gradients)."""
    stage_samples: int | None = observed(
        "counter", "edgestream_stage_samples_total",
        "Samples the worker's stage trained on (stage 0: stream records; later stages: received activations)")
    """Total: samples this stage trained on (forward and update), whoever fed them (synthetic gradients)."""
    synthesizer_loss: float | None = observed(
        "gauge", "edgestream_synthesizer_loss",
        "MSE of the stage's synthetic gradient against the last true gradient, per-sample scale (DNI)")
    """Level: MSE of this stage's synthetic gradient against the last true gradient, per-sample scale (DNI)."""
    boundary_in_flight: int | None = observed(
        "gauge", "edgestream_boundary_in_flight_messages",
        "Activations the stage sent on that still wait for their true gradient (its output boundary)")
    """Level: this stage's activations sent on and still waiting for their true gradient (synthetic gradients)."""
    queued_inputs: int | None = observed(
        "gauge", "edgestream_stage_queue_messages",
        "Activations and gradients received and waiting for the stage's step (its input boundary)")
    """Level: activations (and gradients) received and waiting for this stage's step (synthetic gradients)."""
    updates_clipped: Mapping[str, float] | None = observed(
        "counter", "edgestream_clipped_updates_total",
        "Updates of sender `peer` the norm bound scaled down to max_update_norm (robust aggregation)", ("peer",))
    """Total per sender: updates scaled down to ``max_update_norm`` (robust aggregation)."""
    updates_norm_rejected: Mapping[str, float] | None = observed(
        "counter", "edgestream_norm_rejected_updates_total",
        "Updates of sender `peer` left out of aggregation for a norm above max_update_norm (robust aggregation)",
        ("peer",))
    """Total per sender: updates left out for a norm above ``max_update_norm`` (robust aggregation)."""


def metric_of(declared: Field[Any]) -> ObservationMetric:
    """The metric a field of :class:`Observations` is declared with."""
    try:
        return declared.metadata[_METRIC]
    except KeyError:
        raise TypeError(f"Observations.{declared.name} is not declared with observed(...)") from None


def observation_metrics() -> dict[str, ObservationMetric]:
    """Each :class:`Observations` field's metric, in field order.

    Fields sharing a metric name must declare the same kind, help and labels (they differ
    only in ``fixed``), so one metric object serves them all."""
    out = {f.name: metric_of(f) for f in fields(Observations)}
    by_name: dict[str, ObservationMetric] = {}
    for key, metric in out.items():
        first = by_name.setdefault(metric.name, metric)
        if (first.kind, first.help, first.labels) != (metric.kind, metric.help, metric.labels):
            raise TypeError(f"Observations.{key}: metric {metric.name!r} is declared differently by another field")
    return out


#: The fields of :class:`Observations`, in order (the keys of ``dataclasses.asdict(obs)``).
OBSERVATIONS: tuple[str, ...] = tuple(f.name for f in fields(Observations))
