"""Generated dashboards: committed JSON is fresh, every name used exists, the layout is sound."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from edgestream.monitoring.dashboards import (
    DASHBOARD_DIR,
    DATASOURCE_UID,
    METRIC_NAME_RE,
    REQUIREMENTS,
    all_dashboards,
    expand,
    render_files,
    to_grafana,
    write_all,
)
from edgestream.monitoring.metrics import Metrics
from edgestream.monitoring.prometheus import REPO_ROOT, RULES_FILE

KNOWN = Metrics().exposition_names()


def test_committed_files_equal_a_fresh_generation():
    stale = write_all(check=True)
    assert stale == [], f"run `edgestream generate`: stale {stale}"
    assert sorted(p.name for p in DASHBOARD_DIR.glob("*.json")) == sorted(
        p.name for p in render_files() if p.suffix == ".json"
    ), "a dashboard JSON is committed that the generator no longer produces"


def test_the_four_dashboards_exist():
    assert {d.uid for d in all_dashboards()} == {
        "edgestream-fleet", "edgestream-devices", "edgestream-training", "edgestream-compression"}


@pytest.mark.parametrize("dash", all_dashboards(), ids=lambda d: d.uid)
def test_every_panel_uses_only_defined_metrics(dash):
    for panel in dash.panels:
        names = panel.metric_names()
        assert names, f"{panel.title}: no edgestream metric"
        assert names <= KNOWN, f"{panel.title}: unknown {names - KNOWN}"
        assert panel.requires in REQUIREMENTS


def test_every_alert_rule_uses_only_defined_metrics():
    names = set(METRIC_NAME_RE.findall(RULES_FILE.read_text()))
    assert names and names <= KNOWN, names - KNOWN


@pytest.mark.parametrize("dash", all_dashboards(), ids=lambda d: d.uid)
def test_grafana_json_is_well_formed(dash):
    doc = to_grafana(dash)
    assert doc["schemaVersion"] >= 39 and doc["uid"] == dash.uid
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == DATASOURCE_UID
    assert {"device", "worker"} <= set(variables)
    boxes = set()
    for p in doc["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & boxes, f"{p['title']} overlaps another panel"
        boxes |= cells
        assert p["datasource"]["uid"] == "${datasource}"
        for t in p["targets"]:
            assert "$__rate_interval" in t["expr"] or "[" not in t["expr"] or "[5m]" in t["expr"]
            assert "$" not in expand(t["expr"]), t["expr"]


def test_provisioning_points_at_the_dashboards_datasource():
    text = (REPO_ROOT / "deploy/grafana/provisioning/datasources/edgestream.yaml").read_text()
    assert re.search(rf"uid:\s*{DATASOURCE_UID}\b", text)
    assert "type: prometheus" in text
    providers = (REPO_ROOT / "deploy/grafana/provisioning/dashboards/edgestream.yaml").read_text()
    assert "type: file" in providers and "path:" in providers


def test_committed_json_parses():
    for path in Path(DASHBOARD_DIR).glob("*.json"):
        assert json.loads(path.read_text())["panels"]


#: The training dashboard's rows, top to bottom: each row's panels and the metrics they use.
TRAINING_ROWS = {
    "DLion": (6, "(DLion)", {"edgestream_link_bandwidth_bytes_per_second", "edgestream_link_ratio",
                             "edgestream_link_bytes_total", "edgestream_step_batch_records",
                             "edgestream_capacity_samples_per_second", "edgestream_knowledge_transfers_total"}),
    "Synthetic gradients": (4, "per stage", {"edgestream_worker_stage", "edgestream_stage_samples_total",
                                             "edgestream_synthesizer_loss",
                                             "edgestream_boundary_in_flight_messages",
                                             "edgestream_stage_queue_messages",
                                             "edgestream_staleness_versions_bucket"}),
}


def test_the_rows_sit_below_every_other_panel_of_the_training_dashboard():
    from edgestream.monitoring.dashboards import training

    dash = training()
    doc = to_grafana(dash)
    rows = [p for p in doc["panels"] if p["type"] == "row"]
    assert [r["title"] for r in rows] == list(TRAINING_ROWS)
    first = doc["panels"].index(rows[0])
    assert all(p["gridPos"]["y"] + p["gridPos"]["h"] <= rows[0]["gridPos"]["y"] for p in doc["panels"][:first])
    for k, row in enumerate(rows):
        count, marker, metrics = TRAINING_ROWS[row["title"]]
        assert row["gridPos"] == {"h": 1, "w": 24, "x": 0, "y": row["gridPos"]["y"]}
        index = doc["panels"].index(row)
        end = doc["panels"].index(rows[k + 1]) if k + 1 < len(rows) else len(doc["panels"])
        below = doc["panels"][index + 1:end]
        assert all(p["gridPos"]["y"] > row["gridPos"]["y"] for p in below)
        if k + 1 < len(rows):
            assert all(p["gridPos"]["y"] + p["gridPos"]["h"] <= rows[k + 1]["gridPos"]["y"] for p in below)
        assert all(marker in p["title"] for p in below) and len(below) == count
        panels = [p for p in dash.panels if p.row == row["title"]]
        assert [p.title for p in panels] == [p["title"] for p in below]
        assert set().union(*(p.metric_names() for p in panels)) == metrics
