"""Every dashboard panel query and alert rule, against a real Prometheus scraping a real run.

A short run (real broker, 2 worker processes training with EdgeGossip, simulators with
garbage, window truncation so drops happen) is scraped by Debian's ``prometheus`` through
file-based service discovery. Then, for every panel query of every dashboard and every alert rule, the
Prometheus HTTP API must parse it; panels whose metrics the run emits must return at
least one series: every ``ingest`` and ``simulator`` panel always, any other panel
automatically once its metrics appear in the scrape (e.g. a training worker). Which
panels were series-checked and which only parsed is printed and written to
``dashboard-check.json`` in the test's tmp dir. The gossip workers' own numbers are
checked through Prometheus too: mixing weights summing to 1, a lag per neighbour, and the
consensus-distance panel's query equal to ``sketch_spread`` of the sketches it reads.

A second test runs ``edgestream run``'s ``run_job`` with training (a server and 2 workers;
once with SSP, whose worker and server are ASP's plus clocks, once with ADSP; 2 DLion
workers without a server; and ``conv8`` cut into 3 stages on 3 workers trained with
``cdni``, examples/dni.toml's settings) and checks every panel while it streams, so the
training, sync and compression panels whose metrics the training runtime records are
series-checked too, including each strategy's own numbers (ADSP: commits from its timer,
local steps per commit, C, the loss-curve fit; SSP: blocked time, clock gap; DLion:
per-link shares, bandwidth estimates and bytes, batch sizes, capacities, knowledge
transfers; synthetic gradients: samples, synthesiser loss, activations in flight and
queued, and the staleness of the true gradients, per stage).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rich.console import Console

from edgestream.job.config import load_config
from edgestream.job.topics import sensor_topics_for
from edgestream.monitoring.dashboards import all_dashboards, expand, training
from edgestream.monitoring.metrics import serve_process
from edgestream.monitoring.prometheus import (
    RULES_FILE,
    LocalPrometheus,
    PrometheusError,
    file_sd_path,
    run_targets,
    write_file_sd,
)
from edgestream.monitoring.render import KEY_PANELS, render_fleet
from edgestream.monitoring.scrape import scrape
from edgestream.pipeline.app import sensor_group
from edgestream.pipeline.kafka_io import ensure_topics, start_groups_at_end
from edgestream.pipeline.run import run_job, start_worker_process, stop_process
from edgestream.pipeline.simulate import simulate
from edgestream.streams import topics
from edgestream.streams.garbage import KINDS
from edgestream.trainers.consensus import sketch_spread
from edgestream.trainers.strategies import roles

pytestmark = pytest.mark.integration

ALWAYS_SERIES = {"ingest", "simulator"}  # what this run emits by construction
GARBAGE = len(KINDS)
#: Seconds of streaming; longer by hand for the committed picture (see _docs_png_target).
STREAM_S = float(os.environ.get("EDGESTREAM_DASHBOARD_RUN_S", "8"))


def wait_until(predicate, timeout_s: float, what: str, detail=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}{detail()}")
        time.sleep(0.2)  # poll interval of a deadline wait


def scalar(prom: LocalPrometheus, expr: str) -> float | None:
    result = prom.api.query(expr).result
    return float(result[0]["value"][1]) if result else None


@pytest.fixture
def run_cfg(unique, tmp_path):
    return load_config(overrides=[
        f"job.name=dash-{unique}", f"run.state_dir={tmp_path / 'state'}",
        f"devices.ids=a{unique},b{unique},c{unique}", "devices.count=3", "devices.rates_hz=90,30,10",
        "devices.time_scale=2", "workers.count=2",
        # window truncation: drops happen, so the drop panels have series too
        "batcher.mode=window", "batcher.window_s=0.5", "batcher.max_batch=8", "batcher.window_overflow=truncate",
        # serverless EdgeGossip training on the same workers (no server, messages on their
        # inboxes): the gossip panels are checked against this run, at no extra run's cost
        "train.enabled=true", "train.model=mlp", "train.strategy=edgegossip",
        "train.strategy_params=batch_size=16,min_batch=4,max_batch=64", "train.lr=0.05", "train.momentum=0.5",
        "train.eval_every_s=1", "train.checkpoint_every_steps=5",
    ], env={})


#: What the EdgeGossip run must have scraped before its panels are checked: both workers'
#: sketches, mixing weights, a neighbour model each, iteration statistics, a held-out score.
GOSSIP_READY = (
    'count(count by (worker) (edgestream_model_sketch{job="worker"})) == 2',
    'count(count by (worker) (edgestream_mixing_weight_ratio{job="worker"})) == 2',
    'count(count by (worker) (edgestream_neighbour_lag_steps{job="worker"})) == 2',
    'count(edgestream_iteration_cv_ratio{job="worker"}) == 2',
    'count(edgestream_accuracy_ratio{job="worker", split="heldout"}) == 2',
    'min(count_over_time(edgestream_model_sketch{job="worker"}[1m])) >= 3',
)
#: Training-dashboard panels the EdgeGossip run must fill (beyond TRAINING_PANELS).
GOSSIP_PANELS = ("Idle fraction (gossip)", "Iteration time (gossip)", "Iteration time CV (gossip)",
                 "Neighbour lag (gossip)", "Mixing weights (gossip)", "Consensus distance (gossip)",
                 "Held-out accuracy per worker")


def test_every_panel_query_and_alert_rule_against_real_prometheus(kafka_bootstrap, run_cfg, tmp_path):
    cfg = run_cfg
    state = cfg.state_path()
    state.mkdir(parents=True)
    cfg_path = state / "job.json"
    cfg_path.write_text(json.dumps(cfg.to_dict()))
    devices = cfg.devices.device_ids()
    ensure_topics(kafka_bootstrap, sensor_topics_for(devices))
    start_groups_at_end(kafka_bootstrap, {
        sensor_group(cfg, w): [topics.sensor_topic(d) for d in cfg.devices_of(w)] for w in cfg.worker_names()})
    procs = {}
    prom = LocalPrometheus(tmp_path / "prometheus", tmp_path / "sd", scrape_interval="1s")
    try:
        # --- a short real run: 2 workers, a simulator that serves /metrics ----------------------
        for w in cfg.worker_names():
            procs[w] = start_worker_process(cfg_path, w, kafka_bootstrap, 0, state / "logs" / f"{w}.log")
        # Prometheus starts while the workers do (it picks the targets file up when written)
        (tmp_path / "sd").mkdir()
        prom.start()
        urls = {}
        for w, proc in procs.items():
            endpoint = state / "workers" / w / "endpoint.json"

            def log_tail(w=w) -> str:
                path = state / "logs" / f"{w}.log"
                return "\n" + path.read_text(errors="replace")[-3000:] if path.exists() else ""

            def ready(w=w, proc=proc, endpoint=endpoint):
                assert proc.poll() is None, f"worker {w} exited {proc.returncode}{log_tail()}"
                if not endpoint.exists():
                    return None
                url = json.loads(endpoint.read_text())["metrics"]
                s = scrape(url)
                return url if s is not None and s.get("edgestream_worker_ready", worker=w) == 1 else None

            urls[w] = wait_until(ready, 90, f"worker {w} to join its topics", log_tail)
        sim_metrics, sim_url = serve_process()
        # the call `edgestream run` makes once its workers are up
        write_file_sd(file_sd_path(cfg.job.name, tmp_path / "sd"),
                      run_targets(urls, simulator_url=sim_url))
        wait_until(lambda: len(t := prom.api.targets()) == 3 and all(x["health"] == "up" for x in t),
                   30, "Prometheus to scrape 2 workers and the simulator", lambda: f": {prom.api.targets()}")

        report = simulate(cfg, kafka_bootstrap, STREAM_S, garbage_per_device=GARBAGE, metrics=sim_metrics)
        produced = sum(report.records.values())

        def drained() -> bool:
            scrapes = [scrape(u) for u in urls.values()]
            return all(s is not None for s in scrapes) and sum(
                s.get("edgestream_records_in_total") for s in scrapes) == produced and sum(
                s.get("edgestream_dead_letter_messages_total") for s in scrapes) == GARBAGE * len(devices)

        wait_until(drained, 60, "the workers to read every produced record")
        # ...and Prometheus to have scraped the final counts
        wait_until(lambda: scalar(prom, "sum(edgestream_records_in_total)") == produced, 20,
                   "Prometheus to see every record")

        # --- values seen through Prometheus are the run's values -------------------------------
        # the simulator's last scrape may come after the workers' (both on a 1 s interval)
        wait_until(lambda: scalar(prom, "sum(edgestream_records_produced_total)") == produced, 20,
                   "Prometheus to see every produced record")
        assert scalar(prom, "sum(edgestream_dead_letter_messages_total)") == GARBAGE * len(devices)
        for device in devices:
            assert scalar(prom, f'sum(edgestream_records_in_total{{device="{device}"}})') == report.records[device]
        assert scalar(prom, "sum(edgestream_buffer_dropped_records_total)") > 0
        assert scalar(prom, 'count(up{job="worker"} == 1)') == 2
        assert scalar(prom, 'count(up{job="simulator"} == 1)') == 1

        # --- the EdgeGossip workers' own numbers, through Prometheus --------------------------
        for expr in GOSSIP_READY:
            wait_until(lambda expr=expr: prom.api.query(expr).result, 40, expr)
        gossip = check_gossip_values(prom)

        # --- every panel query of every dashboard, every alert rule -----------------------
        checked, failures = check_dashboards_and_rules(prom, ALWAYS_SERIES)

        # --- the picture: the fleet dashboard's key series as a PNG ---------------------------
        png = tmp_path / "fleet.png"
        end = time.time()
        drawn = render_fleet(prom.api, png, start=end - STREAM_S - 30, end=end, step_s=1.0, rate_interval="5s")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert all(drawn[title] > 0 for title in KEY_PANELS), drawn
        docs_png = _docs_png_target()
        if docs_png is not None:
            render_fleet(prom.api, docs_png, start=end - STREAM_S - 30, end=end, step_s=1.0, rate_interval="5s")
    finally:
        prom.stop()
        for proc in procs.values():
            stop_process(proc)

    report_checks(checked, tmp_path / "dashboard-check.json")
    print(f"edgegossip observed through Prometheus: {json.dumps(gossip, sort_keys=True)}")
    assert not failures, "\n".join(failures)
    assert series_checked(checked) >= sum(1 for d in all_dashboards() for p in d.panels
                                          for _ in p.queries if p.requires in ALWAYS_SERIES)
    by_panel = {(c["dashboard"], c["panel"]): c for c in checked if "panel" in c}
    # what the gossip workers record must be series-checked, not skipped
    for title in (*TRAINING_PANELS, *GOSSIP_PANELS):
        assert by_panel[("edgestream-training", title)]["check"] == "parse+series", title


def check_gossip_values(prom: LocalPrometheus) -> dict:
    """The gossip series hold what they mean: each worker's mixing weights sum to 1 over
    itself and its neighbour, each holds the other's model, and the consensus-distance
    panel's query equals ``sketch_spread`` of the sketches Prometheus holds at that instant."""
    at = time.time()

    def by(expr: str, *labels: str) -> dict[str, float]:
        return {" ".join(r["metric"].get(label, "") for label in labels): float(r["value"][1])
                for r in prom.api.query(expr, at).result}

    consensus = next(p for p in training().panels if p.title == "Consensus distance (gossip)")
    distance = by(expand(consensus.queries[0].expr))
    sketches: dict[str, dict[int, float]] = {}
    for r in prom.api.query('edgestream_model_sketch{job="worker"}', at).result:
        sketches.setdefault(r["metric"]["worker"], {})[int(r["metric"]["index"])] = float(r["value"][1])
    rows = [[s[i] for i in sorted(s)] for _, s in sorted(sketches.items())]
    observed = {
        "mixing weights": by('edgestream_mixing_weight_ratio{job="worker"}', "worker", "peer"),
        "neighbour lag": by('edgestream_neighbour_lag_steps{job="worker"}', "worker", "peer"),
        "idle fraction": by('edgestream_idle_ratio{job="worker"}', "worker"),
        "iteration s": by('edgestream_iteration_seconds{job="worker"}', "worker"),
        "iteration cv": by('edgestream_iteration_cv_ratio{job="worker"}', "worker"),
        "heldout accuracy": by('edgestream_accuracy_ratio{job="worker", split="heldout"}', "worker"),
        "consensus distance": distance,
        "sketch dims": {w: len(s) for w, s in sketches.items()},
    }
    sums = by('sum by (worker) (edgestream_mixing_weight_ratio{job="worker"})', "worker")
    assert set(sums) == {"w0", "w1"} and all(abs(v - 1) < 1e-6 for v in sums.values()), observed
    assert set(observed["mixing weights"]) == {"w0 w0", "w0 w1", "w1 w0", "w1 w1"}, observed
    assert set(observed["neighbour lag"]) == {"w0 w1", "w1 w0"}, observed
    assert all(v >= 0 for v in observed["neighbour lag"].values()), observed
    assert all(0 <= v <= 1 for v in observed["idle fraction"].values()), observed
    assert all(v > 0 for v in observed["iteration s"].values()), observed
    assert len(rows) == 2 and len(rows[0]) == len(rows[1]) == 32, observed
    assert list(distance) == [""], observed  # one series: the selected workers together
    assert math.isfinite(distance[""]) and distance[""] == pytest.approx(sketch_spread(rows), rel=1e-9), observed
    return observed


def check_dashboards_and_rules(prom: LocalPrometheus, always_series: set[str],
                               unfilled: tuple[str, ...] = ()) -> tuple[list[dict], list[str]]:
    """Send every panel query and alert rule to Prometheus; return (what was checked, failures).

    Panels whose ``requires`` is in ``always_series`` must return series; any other
    panel must too once every metric it uses is in the scrape, unless its title is in
    ``unfilled`` (the run's strategy does not fill it); the rest only parse.
    """
    present = prom.api.metric_names()
    checked: list[dict] = []
    failures: list[str] = []
    for dash in all_dashboards():
        for panel in dash.panels:
            emitted = panel.metric_names() <= present
            exempt = panel.title in unfilled and panel.requires not in always_series
            want_series = panel.requires in always_series or (emitted and not exempt)
            if panel.requires in always_series and not emitted:
                failures.append(f"{dash.uid} / {panel.title}: metrics not scraped: "
                                f"{sorted(panel.metric_names() - present)}")
            for query in panel.queries:
                expr = expand(query.expr, "1m")
                try:
                    series = len(prom.api.query(expr).result)
                except PrometheusError as exc:
                    failures.append(f"{dash.uid} / {panel.title}: does not parse: {exc}")
                    continue
                if want_series and series == 0:
                    failures.append(f"{dash.uid} / {panel.title}: no series for {expr}")
                checked.append({"dashboard": dash.uid, "panel": panel.title, "requires": panel.requires,
                                "expr": expr, "series": series,
                                "check": "parse+series" if want_series else
                                "parse only (not filled by this strategy)" if exempt else
                                "parse only (metrics not emitted)"})
    rule_names = re.findall(r"^\s*- alert:\s*(\S+)", RULES_FILE.read_text(), re.M)

    def rules_evaluated():
        rules = prom.api.rules()
        done = len(rules) == len(rule_names) and all(
            not r.get("lastEvaluation", "0001").startswith("0001") for r in rules)
        return rules if done else None

    rules = wait_until(rules_evaluated, 20, "every alert rule to be evaluated once", lambda: f": {prom.api.rules()}")
    if sorted(r["name"] for r in rules) != sorted(rule_names):
        failures.append(f"Prometheus loaded rules {sorted(r['name'] for r in rules)}, file has {rule_names}")
    for rule in rules:
        if rule["health"] != "ok":
            failures.append(f"alert {rule['name']}: health {rule['health']}: {rule.get('lastError')}")
        try:
            series = len(prom.api.query(rule["query"]).result)
        except PrometheusError as exc:
            failures.append(f"alert {rule['name']}: does not parse: {exc}")
            continue
        checked.append({"alert": rule["name"], "expr": rule["query"], "series": series,
                        "state": rule["state"], "check": "parse+evaluated"})
    return checked, failures


def series_checked(checked: list[dict]) -> int:
    return sum(1 for c in checked if c["check"] == "parse+series")


def report_checks(checked: list[dict], path: Path) -> None:
    path.write_text(json.dumps(checked, indent=2))
    print(f"\n{'check':34} {'series':>6}  panel / alert")
    for c in checked:
        print(f"{c['check']:34} {c['series']:>6}  {c.get('dashboard', 'alert')} / {c.get('panel', c.get('alert'))}")
    print(f"{series_checked(checked)} panel queries series-checked, "
          f"{sum(1 for c in checked if c['check'].startswith('parse only'))} parse-only, "
          f"{sum(1 for c in checked if 'alert' in c)} alert rules evaluated")


#: Panels every training run below must give series (what the training runtime records).
TRAINING_PANELS = ("Step time p50 / p95", "Steps / s", "Records trained / s", "Model version", "Loss", "Accuracy",
                   "Time since last checkpoint", "Commits / s per worker")


@dataclass(frozen=True)
class TrainingRun:
    """One strategy's short run: its settings, what to wait for, the panels it must fill."""

    settings: tuple[str, ...]
    ready: tuple[str, ...] = ()  # PromQL that must return a series before the panels are checked
    panels: tuple[str, ...] = ()  # training-dashboard panels beyond TRAINING_PANELS
    observed: dict[str, str] = field(default_factory=dict)  # name -> PromQL, printed and reported
    devices: int = 2  # streams at 160, 120 (, 80) Hz
    #: Training-dashboard panels whose metrics the run emits but that this strategy leaves empty.
    unfilled: tuple[str, ...] = ()


#: SSP stands for ASP here: its worker and server are ASP's (plus clocks), so its run fills
#: every panel an ASP run does, and its own two; one run each keeps the test short.
TRAINING_RUNS = {
    # ADSP with its server: C starts at 2 and the search moves it after each 4 s check period
    "adsp": TrainingRun(
        ("train.strategy=adsp",
         "train.strategy_params=period_s=4,commit_rate=2,max_commit_rate=4,min_interval_s=0.5"),
        ready=('min(increase(edgestream_commits_total{job="worker"}[1m])) > 0',
               'count(edgestream_loss_curve_fit{job="server"}) == 4',
               'min(count_over_time(edgestream_committed_local_steps_total[1m])) >= 3',
               # the search moved C, the broadcast reached both workers over Kafka, all agree
               'changes(edgestream_target_commits{job="server"}[2m]) >= 1',
               'min(changes(edgestream_target_commits{job="worker"}[2m])) >= 1',
               'count(count_values("c", edgestream_target_commits)) == 1'),
        panels=("Local steps per commit", "Commit target C (ADSP)", "Loss-curve fit of the C search (ADSP)",
                "Staleness (versions) p50 / p95"),
        observed={"C": "edgestream_target_commits", "commits": "edgestream_commits_total",
                  "local steps per commit": 'edgestream_committed_local_steps_total / edgestream_commits_total',
                  "fit": "edgestream_loss_curve_fit"}),
    # SSP with s = 0 and w1 four times slower: w0 keeps waiting for it
    "ssp": TrainingRun(
        ("train.strategy=ssp", "train.strategy_params=staleness=0", "workers.slowdown=1,4"),
        ready=('sum(increase(edgestream_blocked_seconds_total{job="worker"}[1m])) > 0',
               'min(count_over_time(edgestream_clock_gap_steps[1m])) >= 3'),
        panels=("Time blocked by the sync rule (SSP, gossip)", "Clock gap (SSP)"),
        observed={"blocked seconds": "edgestream_blocked_seconds_total", "commits": "edgestream_commits_total",
                  "clock gap": "edgestream_clock_gap_steps"}),
    # DLion with 2 workers (no server): per-link shares, batches, capacities, and knowledge
    # transfers every 5 iterations to any worker scoring below the other
    "dlion": TrainingRun(
        ("train.strategy=dlion", "train.strategy_params=batch_size=16,min_batch=4,max_batch=64,transfer_every=5,"
         "transfer_gap=0,rebalance_every=5", "workers.slowdown=1,2"),
        ready=('count(edgestream_link_ratio{job="worker"}) == 2',
               'count(edgestream_link_bandwidth_bytes_per_second{job="worker"}) == 2',
               'count(edgestream_capacity_samples_per_second{job="worker"}) == 2',
               'count(edgestream_step_batch_records{job="worker"}) == 2',
               'min(count_over_time(edgestream_link_bytes_total[1m])) >= 3',
               'sum(edgestream_knowledge_transfers_total{job="worker"}) > 0'),
        panels=("Link bandwidth estimate (DLion)", "Link ratio sent (DLion)", "Bytes per link / s (DLion)",
                "Step batch size (DLion)", "Training capacity (DLion)", "Knowledge transfers (DLion)"),
        observed={"ratio": "edgestream_link_ratio", "batch": "edgestream_step_batch_records",
                  "capacity": "edgestream_capacity_samples_per_second",
                  "transfers": "edgestream_knowledge_transfers_total"}),
    # Synthetic gradients (examples/dni.toml): conv8 with BatchNorm cut after block1 and
    # block3 into 3 stages on 3 workers, cdni; w0 reads both devices, activations go forward
    # to w1 and w2 and true gradients come back on the inboxes
    "dni": TrainingRun(
        ("data.source=digits", "workers.count=3", "train.model=conv8", "train.model_params=norm=batch",
         "train.stages=block1,block3", "train.strategy=cdni", "train.strategy_params=max_in_flight=4",
         "batcher.mode=fixed", "batcher.batch_size=32", "train.max_step_batch=32", "train.lr=0.05",
         "train.momentum=0.9", "train.checkpoint_every_steps=20"),
        # 3 devices: the config wants a device per worker, although stage 0 reads them all
        devices=3,
        # a stage alone has no model to evaluate: the held-out score is the assembled
        # model's, once, at the end of the run (its summary)
        unfilled=("Held-out accuracy per worker",),
        ready=('count(edgestream_worker_stage{job="worker"}) == 3',
               'min(count_over_time(edgestream_stage_samples_total{job="worker"}[1m])) >= 3',
               'count(edgestream_stage_samples_total{job="worker"} > 0) == 3',
               'count(edgestream_synthesizer_loss{job="worker"}) == 2',
               'count(edgestream_boundary_in_flight_messages{job="worker"}) == 2',
               'count(edgestream_stage_queue_messages{job="worker"}) == 3',
               # both lower stages got true gradients back (their staleness was recorded)
               'count(sum by (worker) (edgestream_staleness_versions_count{job="worker"}) > 0) == 2'),
        panels=("Samples / s per stage", "Synthesiser loss per stage", "Activations in flight and queued per stage",
                "True-gradient staleness (versions) per stage"),
        observed={"stage": "edgestream_worker_stage", "samples": "edgestream_stage_samples_total",
                  "synthesizer loss": "edgestream_synthesizer_loss",
                  "in flight": "edgestream_boundary_in_flight_messages",
                  "queued": "edgestream_stage_queue_messages",
                  "true gradients": "sum by (worker) (edgestream_staleness_versions_count)"}),
}


@pytest.mark.parametrize("strategy", list(TRAINING_RUNS))
def test_training_panels_have_series_in_a_training_run(kafka_bootstrap, unique, tmp_path, strategy):
    """`edgestream run` with a server and 2 workers: every panel is checked while the run
    streams, and the panels of the strategy's own numbers must have series."""
    run = TRAINING_RUNS[strategy]
    cfg = load_config(overrides=[
        f"job.name=dasht-{strategy}-{unique}", f"run.state_dir={tmp_path / 'state'}",
        f"devices.ids={','.join(f'{c}{unique}' for c in 'abc'[:run.devices])}", f"devices.count={run.devices}",
        f"devices.rates_hz={','.join(map(str, (160, 120, 80)[:run.devices]))}",
        "devices.message_interval_s=0.05", "batcher.window_s=0.25", "batcher.max_batch=64",
        "workers.count=2", "train.enabled=true", "train.model=mlp",
        "train.lr=0.03", "train.momentum=0.5", *run.settings,
        "train.eval_every_s=1", "train.checkpoint_every_steps=5",
        "run.duration_s=12", "run.drain_timeout_s=60",
    ], env={})
    prom = LocalPrometheus(tmp_path / "prometheus", tmp_path / "sd", scrape_interval="1s")
    box: dict = {}

    def while_streaming(ctx) -> None:
        urls = {w.name: w.metrics_url or "" for w in ctx.workers}
        write_file_sd(file_sd_path(cfg.job.name, tmp_path / "sd"), run_targets(urls))
        prom.start()
        wait_until(lambda: len(t := prom.api.targets()) == len(urls) and all(x["health"] == "up" for x in t),
                   30, "Prometheus to scrape the server and workers", lambda: f": {prom.api.targets()}")
        # three scrapes of steps and model versions: every rate() has two samples to work with
        wait_until(lambda: (r := prom.api.query(
            "min(count_over_time(edgestream_steps_total[1m])) >= 3 "
            "and min(count_over_time(edgestream_model_version[1m])) >= 3").result) and r,
            60, "training metrics to be scraped three times")
        for expr in run.ready:
            wait_until(lambda expr=expr: prom.api.query(expr).result, 40, expr)
        # ingest panels are demanded by the test above; here every panel whose metrics appear
        box["checks"] = check_dashboards_and_rules(prom, set(), run.unfilled)
        box["server_up"] = prom.api.query('up{job="server"} == 1').result
        box["observed"] = {name: {_series_name(r["metric"]): float(r["value"][1])
                                  for r in prom.api.query(expr).result}
                           for name, expr in run.observed.items()}
        # the label each series of the training dashboard's panels carries (e.g. its stage)
        box["panel_labels"] = {(p.title, i): [r["metric"] for r in prom.api.query(expand(q.expr, "1m")).result]
                               for p in run_panels(run) for i, q in enumerate(p.queries)}
        ctx.stop_streaming()  # everything is checked: the run drains now (12 s at most)

    try:
        run_job(cfg, kafka_bootstrap, console=Console(file=io.StringIO(), width=160), live=False,
                on_streaming=while_streaming)
    finally:
        prom.stop()

    checked, failures = box["checks"]
    report_checks(checked, tmp_path / "dashboard-check.json")
    print(f"{strategy} observed through Prometheus: {json.dumps(box['observed'], sort_keys=True)}")
    assert not failures, "\n".join(failures)
    if "server" in roles(cfg.train.strategy):
        assert box["server_up"], "the server is scraped as job=server"
    by_panel = {(c["dashboard"], c["panel"]): c for c in checked if "panel" in c}
    # what the training runtime records for this strategy must be series-checked, not skipped
    for title in (*TRAINING_PANELS, *run.panels):
        assert by_panel[("edgestream-training", title)]["check"] == "parse+series", title
    assert by_panel[("edgestream-compression", "Gradient bytes sent / s by codec")]["check"] == "parse+series"
    observed = box["observed"]
    if strategy == "adsp":
        # commits come from poll: each worker's are counted; the search's C reached the workers
        assert all(observed["commits"][w] > 0 for w in ("w0", "w1")), observed
        assert {observed["C"][w] for w in ("server", "w0", "w1")} <= set(range(2, 5)), observed
        assert observed["fit"], observed
    if strategy == "dlion":
        assert all(0 < v <= 1 for v in observed["ratio"].values()) and len(observed["ratio"]) == 2, observed
        assert sum(observed["transfers"].values()) > 0, observed
    if strategy == "ssp":
        assert observed["blocked seconds"]["w0"] + observed["blocked seconds"]["w1"] > 0, observed
        assert 0 <= observed["clock gap"]["server"] <= 1, observed  # s + 1
    if strategy == "dni":
        stages = {"w0": 0, "w1": 1, "w2": 2}
        assert observed["stage"] == stages, observed
        assert all(observed["samples"][w] > 0 for w in stages), observed
        # the top stage has no synthesiser and no output boundary
        assert set(observed["synthesizer loss"]) == {"w0", "w1"}, observed
        assert all(math.isfinite(v) and v >= 0 for v in observed["synthesizer loss"].values()), observed
        assert set(observed["in flight"]) == {"w0", "w1"}, observed
        assert all(0 <= v <= 4 for v in observed["in flight"].values()), observed  # max_in_flight
        assert set(observed["queued"]) == set(stages), observed
        assert set(observed["true gradients"]) >= {"w0", "w1"}, observed
        # each series of the row is labelled with its worker's stage
        labels = box["panel_labels"]
        samples = {m["worker"]: int(m["stage"]) for m in labels[("Samples / s per stage", 0)]}
        assert samples == stages, labels
        assert {m["worker"]: int(m["stage"]) for m in labels[("Synthesiser loss per stage", 0)]} == \
            {"w0": 0, "w1": 1}, labels
        assert {m["worker"] for m in labels[("True-gradient staleness (versions) per stage", 1)]} >= {"w0", "w1"}, \
            labels


def run_panels(run: TrainingRun) -> list:
    """The training-dashboard panels a run must fill beyond TRAINING_PANELS."""
    return [p for p in training().panels if p.title in run.panels]


def _series_name(labels: dict[str, str]) -> str:
    """``w0``, or ``server a2`` for a series with a ``param``."""
    return " ".join(v for v in (labels.get("worker", ""), labels.get("param", "")) if v)


def _docs_png_target() -> Path | None:
    """``EDGESTREAM_FLEET_PNG=docs/img/fleet.png`` also writes the committed picture
    (made with ``EDGESTREAM_DASHBOARD_RUN_S=30``)."""
    target = os.environ.get("EDGESTREAM_FLEET_PNG")
    return Path(target) if target else None
