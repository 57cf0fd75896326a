"""Grafana dashboards as code: panels built from the metric objects of ``monitoring.metrics``.

``edgestream generate`` (also ``edgestream dashboards``) writes
``deploy/grafana/dashboards/*.json`` and ``deploy/prometheus/prometheus.yml``; a unit
test asserts the committed files equal a fresh generation, and the dashboard
integration test runs every panel query against a real Prometheus.

Each panel says what it ``requires`` to have data: ``ingest`` (any worker), ``simulator``
(a simulator serving /metrics), ``training`` (a training worker), ``consumer_lag`` (the
worker's lag probe). The integration test demands series for what its run emits.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgestream.monitoring.metrics import Metrics, name_of
from edgestream.monitoring.prometheus import DEPLOY_DIR, REPO_ROOT, prometheus_config

DASHBOARD_DIR = REPO_ROOT / "deploy" / "grafana" / "dashboards"
PROMETHEUS_YML = DEPLOY_DIR / "prometheus.yml"
DATASOURCE_UID = "edgestream-prometheus"
SCHEMA_VERSION = 39
REQUIREMENTS = ("ingest", "simulator", "training", "consumer_lag")
RATE = "$__rate_interval"
METRIC_NAME_RE = re.compile(r"\bedgestream_[a-z0-9_]+")

_M = Metrics()  # only for names: never served


def n(metric: Any, suffix: str = "") -> str:
    return name_of(metric, suffix)


DEV = 'device=~"$device"'
WRK = 'worker=~"$worker"'


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    requires: str
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat
    description: str = ""
    width: int = 12
    height: int = 8
    stack: bool = False
    max_value: float | None = None
    #: A Grafana row the panel sits under: a row header is drawn, on a line of its own,
    #: before the first panel of each run of panels with the same row (None: no row).
    row: str | None = None

    def __post_init__(self) -> None:
        if self.requires not in REQUIREMENTS:
            raise ValueError(f"panel {self.title!r}: requires={self.requires!r} not in {REQUIREMENTS}")

    def metric_names(self) -> set[str]:
        """Every ``edgestream_*`` sample name the panel's queries use."""
        return {name for q in self.queries for name in METRIC_NAME_RE.findall(q.expr)}


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    variables: tuple[str, ...] = ("device", "worker")
    tags: tuple[str, ...] = field(default=("edgestream",))


def _rate(metric: Any, by: str, sel: str) -> str:
    return f"sum by ({by}) (rate({n(metric)}{{{sel}}}[{RATE}]))"


def _quantile(q: float, metric: Any, by: str, sel: str) -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({n(metric, '_bucket')}{{{sel}}}[{RATE}])))"


def _stat(title: str, expr: str, requires: str, unit: str = "short", description: str = "") -> Panel:
    return Panel(title, (Query(expr),), requires, unit=unit, kind="stat", width=6, height=4,
                 description=description)


# --- the four dashboards -------------------------------------------------------------------
def fleet() -> Dashboard:
    m = _M
    return Dashboard(
        "edgestream-fleet", "edgestream / fleet overview",
        "Every device and worker at a glance: throughput, buffers, drops, dead letters, training.",
        (
            _stat("Workers up", f"sum({n(m.worker_up)}{{{WRK}}})", "ingest",
                  description="Workers reporting edgestream_worker_up = 1"),
            _stat("Records in / s", f"sum(rate({n(m.records_in)}{{{DEV}}}[{RATE}]))", "ingest", "rps"),
            _stat("Dead letters (last 5m)", f"sum(increase({n(m.dead_letters)}{{{DEV}}}[5m]))", "ingest"),
            _stat("Fullest buffer", f"max({n(m.buffer_depth)}{{{DEV}}} / {n(m.buffer_capacity)}{{{DEV}}})",
                  "ingest", "percentunit"),
            Panel("Records in per device", (Query(_rate(m.records_in, "device", DEV), "{{device}}"),),
                  "ingest", "rps", description="Records decoded from each device topic"),
            Panel("Produced vs consumed", (
                Query(f"sum(rate({n(m.records_produced)}{{{DEV}}}[{RATE}]))", "produced"),
                Query(f"sum(rate({n(m.records_in)}{{{DEV}}}[{RATE}]))", "consumed"),
            ), "simulator", "rps", description="Simulators' output against what the workers decode"),
            Panel("Buffer fill", (Query(
                f"max by (device) ({n(m.buffer_depth)}{{{DEV}}} / {n(m.buffer_capacity)}{{{DEV}}})",
                "{{device}}"),), "ingest", "percentunit", max_value=1.0,
                description="Depth / capacity of each device buffer; the alert fires above 90%"),
            Panel("Bytes in per device", (Query(_rate(m.bytes_in, "device", DEV), "{{device}}"),),
                  "ingest", "Bps"),
            Panel("Buffer drops by reason", (Query(_rate(m.buffer_dropped, "reason", DEV), "{{reason}}"),),
                  "ingest", "rps", stack=True, description="Records dropped by an explicit policy"),
            Panel("Dead letters by reason", (Query(
                f"sum by (reason) ({n(m.dead_letters)}{{{DEV}}})", "{{reason}}"),), "ingest", "short",
                stack=True, description="Messages routed to sensors.dlq since the workers started"),
            Panel("Training steps / s", (Query(_rate(m.steps, "worker", WRK), "{{worker}}"),), "training", "ops"),
            Panel("Loss", (Query(f"max by (worker, split) ({n(m.loss)}{{{WRK}}})", "{{worker}} {{split}}"),),
                  "training"),
        ),
    )


def devices() -> Dashboard:
    m = _M
    return Dashboard(
        "edgestream-devices", "edgestream / per-device streams",
        "One row of figures per device stream: rates, lags, buffers, batches, losses.",
        (
            Panel("Arrival rate (EWMA)", (Query(f"max by (device) ({n(m.arrival_rate)}{{{DEV}}})", "{{device}}"),),
                  "ingest", "hertz"),
            Panel("Records in / s", (Query(_rate(m.records_in, "device", DEV), "{{device}}"),), "ingest", "rps"),
            Panel("Records produced / s", (Query(_rate(m.records_produced, "device", DEV), "{{device}}"),),
                  "simulator", "rps"),
            Panel("Event-time lag", (Query(f"max by (device) ({n(m.event_time_lag)}{{{DEV}}})", "{{device}}"),),
                  "ingest", "s", description="Wall clock minus event time of the newest record read"),
            Panel("Consumer lag", (Query(f"max by (device) ({n(m.consumer_lag)}{{{DEV}}})", "{{device}}"),),
                  "consumer_lag", "short", description="Records in the topic not yet read by the worker"),
            Panel("Buffer depth", (
                Query(f"max by (device) ({n(m.buffer_depth)}{{{DEV}}})", "{{device}}"),
                Query(f"max({n(m.buffer_capacity)}{{{DEV}}})", "capacity"),
            ), "ingest"),
            Panel("Batch size p50 / p95", (
                Query(_quantile(0.5, m.batch_size, "device", DEV), "{{device}} p50"),
                Query(_quantile(0.95, m.batch_size, "device", DEV), "{{device}} p95"),
            ), "ingest", description="Records per batch chosen by the adaptive batcher"),
            Panel("Batches / s", (Query(_rate(m.batches, "device", DEV), "{{device}}"),), "ingest", "ops"),
            Panel("Drops by device and reason", (
                Query(f"sum by (device, reason) (rate({n(m.buffer_dropped)}{{{DEV}}}[{RATE}]))",
                      "{{device}} {{reason}}"),), "ingest", "rps"),
            Panel("Dead letters by device and reason", (
                Query(f"sum by (device, reason) (rate({n(m.dead_letters)}{{{DEV}}}[{RATE}]))",
                      "{{device}} {{reason}}"),), "ingest", "rps"),
            Panel("Partition paused (backpressure)", (
                Query(f"max by (device) ({n(m.partition_paused)}{{{DEV}}})", "{{device}}"),), "ingest",
                max_value=1.0),
            Panel("Records to the sink / s", (Query(_rate(m.sink_records, "device", DEV), "{{device}}"),),
                  "ingest", "rps", description="Records handed to the trainer (or counted in ingest-only runs)"),
        ),
    )


def training() -> Dashboard:
    m = _M
    return Dashboard(
        "edgestream-training", "edgestream / training and sync",
        "Local steps, waiting for data, model versions, staleness, commits, loss and accuracy.",
        (
            Panel("Step time p50 / p95", (
                Query(_quantile(0.5, m.step_seconds, "worker", WRK), "{{worker}} p50"),
                Query(_quantile(0.95, m.step_seconds, "worker", WRK), "{{worker}} p95"),
            ), "training", "s"),
            Panel("Wait for data p50 / p95", (
                Query(_quantile(0.5, m.wait_for_data_seconds, "worker", WRK), "{{worker}} p50"),
                Query(_quantile(0.95, m.wait_for_data_seconds, "worker", WRK), "{{worker}} p95"),
            ), "training", "s"),
            Panel("Steps / s", (Query(_rate(m.steps, "worker", WRK), "{{worker}}"),), "training", "ops"),
            Panel("Records trained / s", (Query(_rate(m.trained_records, "worker", WRK), "{{worker}}"),),
                  "training", "rps"),
            Panel("Model version", (Query(f"max by (worker) ({n(m.model_version)}{{{WRK}}})", "{{worker}}"),),
                  "training"),
            Panel("Staleness (versions) p50 / p95", (
                Query(_quantile(0.5, m.staleness_versions, "worker", WRK), "{{worker}} p50"),
                Query(_quantile(0.95, m.staleness_versions, "worker", WRK), "{{worker}} p95"),
            ), "training", description="Versions between computing a gradient and applying it"),
            Panel("Staleness (seconds) p95", (
                Query(_quantile(0.95, m.staleness_seconds, "worker", WRK), "{{worker}}"),), "training", "s"),
            Panel("Commits / s per worker", (Query(_rate(m.commits, "worker", WRK), "{{worker}}"),), "training",
                  "ops", description="Updates (gradients, deltas) each worker published to the shared model"),
            Panel("Local steps per commit", (Query(
                f"{_rate(m.observed['committed_local_steps'], 'worker', WRK)} / {_rate(m.commits, 'worker', WRK)}",
                "{{worker}}"),), "training",
                description="Local steps in each committed update (ADSP: fast workers put more in; "
                            "local SGD: its period)"),
            Panel("Commit target C (ADSP)", (
                Query(f"max by (worker) ({n(m.observed['commit_target'])}{{{WRK}}})", "{{worker}}"),), "training",
                description="Commits per check period: the server's search (server) and what each worker "
                            "commits by (workers)"),
            Panel("Loss-curve fit of the C search (ADSP)", (
                Query(f"max by (worker, param) ({n(m.observed['fit_a2'])}{{{WRK}}})", "{{worker}} {{param}}"),),
                "training", description="Last fit of l(t) = 1 / (a2 t + b) + c0 over a check period, "
                                        "and its RMSE (loss units)"),
            Panel("Time blocked by the sync rule (SSP, gossip)", (
                Query(_rate(m.observed["blocked_seconds"], "worker", WRK), "{{worker}}"),), "training", "percentunit",
                max_value=1.0, description="Fraction of time each worker could not train because it was "
                                           "more than s clocks ahead of the slowest (SSP), or waited for a "
                                           "neighbour more than max_lag iterations behind (gossip)"),
            Panel("Clock gap (SSP)", (
                Query(f"max by (worker) ({n(m.observed['clock_gap_steps'])}{{{WRK}}})", "{{worker}}"),), "training",
                description="Fastest minus slowest live worker's clock at the server (at most s + 1)"),
            Panel("Idle fraction (gossip)", (
                Query(f"max by (worker) ({n(m.observed['idle_fraction'])}{{{WRK}}})", "{{worker}}"),), "training", "percentunit",
                max_value=1.0, description="Share of each worker's time without a local step: waiting for "
                                           "data or for its neighbours"),
            Panel("Iteration time (gossip)", (
                Query(f"max by (worker) ({n(m.observed['iteration_time_s'])}{{{WRK}}})", "{{worker}}"),), "training", "s",
                description="Mean time between each worker's recent local steps"),
            Panel("Iteration time CV (gossip)", (
                Query(f"max by (worker) ({n(m.observed['iteration_time_cv'])}{{{WRK}}})", "{{worker}}"),), "training",
                description="Coefficient of variation (std / mean) of each worker's recent iteration times: "
                            "how irregular its pace is"),
            Panel("Neighbour lag (gossip)", (
                Query(f"max by (worker, peer) ({n(m.observed['neighbour_lag'])}{{{WRK}}})", "{{worker}} <- {{peer}}"),),
                "training", description="Local steps by which the model a worker holds of each neighbour is "
                                        "behind its own"),
            Panel("Mixing weights (gossip)", (
                Query(f"max by (worker, peer) ({n(m.observed['mixing_weights'])}{{{WRK}}})", "{{worker}} <- {{peer}}"),),
                "training", max_value=1.0,
                description="Weight each worker gives each process's model when it mixes (its own included; "
                            "a worker's weights sum to 1)"),
            Panel("Consensus distance (gossip)", (
                Query(f"sqrt(sum(stdvar by (index) ({n(m.observed['model_sketch'])}{{{WRK}}})))", "RMS distance to the mean"),),
                "training",
                description="Root-mean-square distance of the selected workers' models to their average, "
                            "estimated from their model sketches (random projections, relative error about "
                            "sqrt(2 / dim), 25 % at dim 32); 0 for a single worker"),
            Panel("Held-out accuracy per worker", (
                Query(f'max by (worker) ({n(m.accuracy)}{{{WRK}, split="heldout"}})', "{{worker}}"),), "training",
                "percentunit", max_value=1.0,
                description="Each worker's own model on the held-out set (gossip: the models differ)"),
            Panel("Loss", (Query(f"max by (worker, split) ({n(m.loss)}{{{WRK}}})", "{{worker}} {{split}}"),),
                  "training"),
            Panel("Accuracy", (Query(f"max by (worker, split) ({n(m.accuracy)}{{{WRK}}})",
                                     "{{worker}} {{split}}"),), "training", "percentunit", max_value=1.0),
            Panel("Updates rejected by reason", (
                Query(f"sum by (worker, reason) (rate({n(m.updates_rejected)}{{{WRK}}}[{RATE}]))",
                      "{{worker}} {{reason}}"),), "training", "ops"),
            Panel("Time since last checkpoint", (
                Query(f"time() - max by (worker) ({n(m.last_checkpoint)}{{{WRK}}})", "{{worker}}"),),
                "training", "s"),
            Panel("Sync strategy", (
                Query(f"max by (worker, strategy) ({n(m.strategy_info)}{{{WRK}}})", "{{worker}} {{strategy}}"),),
                "training", kind="stat", width=12, height=4),
            Panel("Workers ready", (Query(f"max by (worker) ({n(m.worker_ready)}{{{WRK}}})", "{{worker}}"),),
                  "ingest", kind="stat", width=12, height=4),
            *_dlion_panels(),
            *_synthetic_gradient_panels(),
        ),
    )


def _dlion_panels() -> tuple[Panel, ...]:
    """The DLion row: per-link bandwidth estimates, ratios and bytes, dynamic batching,
    capacity, direct knowledge transfers (``Observations`` of the DLion strategy)."""
    m = _M
    row = "DLion"
    return (
        Panel("Link bandwidth estimate (DLion)", (
            Query(f"max by (worker, peer) ({n(m.observed['link_bandwidth'])}{{{WRK}}})", "{{worker}} -> {{peer}}"),),
            "training", "Bps", row=row,
            description="Each worker's estimate of the bandwidth of its link to each peer"),
        Panel("Link ratio sent (DLion)", (
            Query(f"max by (worker, peer) ({n(m.observed['link_ratio'])}{{{WRK}}})", "{{worker}} -> {{peer}}"),),
            "training", "percentunit", max_value=1.0, row=row,
            description="Share of the gradient's entries the last message on each link carried"),
        Panel("Bytes per link / s (DLion)", (
            Query(f"sum by (worker, peer) (rate({n(m.observed['link_bytes'])}{{{WRK}}}[{RATE}]))", "{{worker}} -> {{peer}}"),),
            "training", "Bps", row=row, description="Bytes each worker sends to each peer"),
        Panel("Step batch size (DLion)", (
            Query(f"max by (worker) ({n(m.observed['batch_size'])}{{{WRK}}})", "{{worker}}"),),
            "training", row=row, description="Records each worker's next local step takes (dynamic batching)"),
        Panel("Training capacity (DLion)", (
            Query(f"max by (worker) ({n(m.observed['capacity'])}{{{WRK}}})", "{{worker}}"),),
            "training", row=row, description="Measured samples per second each worker can train"),
        Panel("Knowledge transfers (DLion)", (
            Query(f"sum by (worker, peer) (increase({n(m.observed['knowledge_transfers'])}{{{WRK}}}[{RATE}]))",
                  "{{worker}} <- {{peer}}"),),
            "training", row=row,
            description="Models of each sender (peer) merged into each worker's model (direct knowledge "
                        "transfer), over the rate interval"),
    )


def _per_stage(expr: str) -> str:
    """``expr`` (one series per ``worker``) with the worker's ``stage`` label added from
    ``edgestream_worker_stage`` (its value made a label): only stage-split workers remain."""
    stage = f'group by (worker, stage) (count_values by (worker) ("stage", {n(_M.observed["stage"])}{{{WRK}}}))'
    return f"{expr} * on (worker) group_left (stage) {stage}"


def _synthetic_gradient_panels() -> tuple[Panel, ...]:
    """The synthetic gradients row (stage-split strategies pipeline_bp, dni, cdni): samples,
    synthesiser loss, activations in flight and queued, staleness of the true gradients,
    each series labelled with its stage (``Observations`` of the stage strategies)."""
    m = _M
    row = "Synthetic gradients"
    legend = "stage {{stage}} ({{worker}})"
    return (
        Panel("Samples / s per stage", (
            Query(_per_stage(_rate(m.observed["stage_samples"], "worker", WRK)), legend),),
            "training", "rps", row=row,
            description="Samples each stage trains on: stage 0 from the streams, later stages from the "
                        "activations they receive"),
        Panel("Synthesiser loss per stage", (
            Query(_per_stage(f"max by (worker) ({n(m.observed['synthesizer_loss'])}{{{WRK}}})"), legend),),
            "training", row=row,
            description="MSE of the stage's synthetic gradient against the last true gradient that came "
                        "back, per-sample scale (dni, cdni; none for the top stage)"),
        Panel("Activations in flight and queued per stage", (
            Query(_per_stage(f"max by (worker) ({n(m.observed['boundary_in_flight'])}{{{WRK}}})"),
                  "stage {{stage}} ({{worker}}) in flight"),
            Query(_per_stage(f"max by (worker) ({n(m.observed['queued_inputs'])}{{{WRK}}})"),
                  "stage {{stage}} ({{worker}}) queued")),
            "training", row=row,
            description="In flight: activations a stage sent on that still wait for their true gradient "
                        "(its output boundary, at most max_in_flight). Queued: activations (pipeline_bp: "
                        "and gradients) received and waiting for the stage's step"),
        Panel("True-gradient staleness (versions) per stage", (
            Query(_per_stage(_quantile(0.5, m.staleness_versions, "worker", WRK)), f"{legend} p50"),
            Query(_per_stage(_quantile(0.95, m.staleness_versions, "worker", WRK)), f"{legend} p95")),
            "training", row=row,
            description="Versions a stage moved on between its forward and the true gradient of that "
                        "activation (dni, cdni: how far behind the synthesiser's target is; pipeline_bp: 0)"),
    )


def compression() -> Dashboard:
    m = _M
    return Dashboard(
        "edgestream-compression", "edgestream / compression",
        "Bytes on the wire per codec, compression ratio, and how often steps are compressed.",
        (
            Panel("Gradient bytes sent / s by codec", (
                Query(f"sum by (worker, codec) (rate({n(m.gradient_bytes_sent)}{{{WRK}}}[{RATE}]))",
                      "{{worker}} {{codec}}"),), "training", "Bps"),
            Panel("Gradient bytes received / s by codec", (
                Query(f"sum by (worker, codec) (rate({n(m.gradient_bytes_received)}{{{WRK}}}[{RATE}]))",
                      "{{worker}} {{codec}}"),), "training", "Bps"),
            Panel("Compression ratio (dense / wire)", (
                Query(f"max by (worker) ({n(m.compression_ratio)}{{{WRK}}})", "{{worker}}"),), "training"),
            Panel("Compressed-step fraction", (Query(
                f"{_rate(m.compressed_steps, 'worker', WRK)} / {_rate(m.steps, 'worker', WRK)}", "{{worker}}"),),
                "training", "percentunit", max_value=1.0),
            Panel("Compression vote", (
                Query(f"max by (worker) ({n(m.compression_vote)}{{{WRK}}})", "{{worker}}"),), "training",
                max_value=1.0),
            Panel("Wire bytes per step", (Query(
                f"sum by (worker) (rate({n(m.gradient_bytes_sent)}{{{WRK}}}[{RATE}])) / "
                f"{_rate(m.steps, 'worker', WRK)}", "{{worker}}"),), "training", "bytes"),
        ),
    )


def all_dashboards() -> list[Dashboard]:
    return [fleet(), devices(), training(), compression()]


def expand(expr: str, rate_interval: str = "1m") -> str:
    """A panel query as Grafana would send it with every device and worker selected."""
    return (expr.replace(RATE, rate_interval)
            .replace('"$device"', '".*"').replace('"$worker"', '".*"'))


def panels_of(dash: Dashboard, titles: tuple[str, ...]) -> list[Panel]:
    by_title = {p.title: p for p in dash.panels}
    missing = [t for t in titles if t not in by_title]
    if missing:
        raise KeyError(f"dashboard {dash.uid} has no panel(s) {missing}")
    return [by_title[t] for t in titles]


# --- Grafana JSON -----------------------------------------------------------------------------
def _datasource() -> dict[str, str]:
    return {"type": "prometheus", "uid": "${datasource}"}


def _variable(name: str) -> dict[str, Any]:
    source = {"device": n(_M.records_in), "worker": n(_M.worker_up)}[name]
    query = f"label_values({source}, {name})"
    return {
        "name": name, "label": name, "type": "query", "datasource": _datasource(),
        "query": {"query": query, "refId": f"{name}-values"}, "definition": query,
        "refresh": 2, "sort": 1, "multi": True, "includeAll": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [], "hide": 0,
    }


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit}
    if panel.max_value is not None:
        defaults["max"] = panel.max_value
        defaults["min"] = 0
    if panel.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if panel.stack else 0,
                              "showPoints": "never", "spanNulls": False,
                              "stacking": {"mode": "normal" if panel.stack else "none", "group": "A"}}
        options: dict[str, Any] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                                   "tooltip": {"mode": "multi", "sort": "desc"}}
    else:
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "colorMode": "value", "graphMode": "area", "textMode": "auto", "justifyMode": "auto",
                   "orientation": "auto"}
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": _datasource(),
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": _datasource(), "expr": q.expr,
             "legendFormat": q.legend or "__auto", "range": True, "editorMode": "code"}
            for i, q in enumerate(panel.queries)
        ],
        # not read by Grafana: what the dashboard test demands series for
        "edgestream": {"requires": panel.requires},
    }


def _row_json(title: str, panel_id: int, y: int) -> dict[str, Any]:
    return {"id": panel_id, "type": "row", "title": title, "collapsed": False, "panels": [],
            "datasource": _datasource(), "targets": [], "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}}


def to_grafana(dash: Dashboard) -> dict[str, Any]:
    panels = []
    x = y = row_h = 0
    row = None
    panel_id = 0
    for panel in dash.panels:
        if panel.row is not None and panel.row != row:
            y, row_h = y + row_h, 0
            panel_id += 1
            panels.append(_row_json(panel.row, panel_id, y))
            x, y = 0, y + 1
        row = panel.row
        if x + panel.width > 24:
            x, y, row_h = 0, y + row_h, 0
        panel_id += 1
        panels.append(_panel_json(panel, panel_id, x, y))
        x += panel.width
        row_h = max(row_h, panel.height)
    templating = [{
        "name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
        "current": {"selected": True, "text": "edgestream Prometheus", "value": DATASOURCE_UID},
        "hide": 0, "refresh": 1, "options": [], "regex": "",
    }] + [_variable(v) for v in dash.variables]
    return {
        "uid": dash.uid, "title": dash.title, "description": dash.description, "tags": list(dash.tags),
        "schemaVersion": SCHEMA_VERSION, "version": 1, "editable": True, "graphTooltip": 1,
        "time": {"from": "now-15m", "to": "now"}, "refresh": "10s", "timezone": "",
        "templating": {"list": templating}, "annotations": {"list": []}, "links": [],
        "panels": panels,
    }


def render_files() -> dict[Path, str]:
    """Every generated file and its content (dashboards JSON and the Prometheus config)."""
    out = {DASHBOARD_DIR / f"{d.uid}.json": json.dumps(to_grafana(d), indent=2, sort_keys=True) + "\n"
           for d in all_dashboards()}
    out[PROMETHEUS_YML] = prometheus_config("../../.edgestream/prometheus/targets", "5s")
    return out


def write_all(check: bool = False) -> list[Path]:
    """Write the generated files; with ``check``, write nothing and return the stale ones."""
    stale = []
    for path, text in render_files().items():
        if not path.exists() or path.read_text() != text:
            stale.append(path)
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    return stale
