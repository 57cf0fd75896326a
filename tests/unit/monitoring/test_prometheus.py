"""File-based service discovery and the scrape config."""

from __future__ import annotations

import json

import pytest

from edgestream.monitoring.prometheus import (
    file_sd_path,
    prometheus_config,
    target_of,
    write_file_sd,
)


def test_file_sd_is_one_group_per_target_with_job_label(tmp_path):
    path = file_sd_path("demo", tmp_path)

    write_file_sd(path, [("worker", "127.0.0.1:9100", {"worker": "w0"}), ("simulator", "127.0.0.1:9200", {})])

    assert json.loads(path.read_text()) == [
        {"targets": ["127.0.0.1:9100"], "labels": {"job": "worker", "worker": "w0"}},
        {"targets": ["127.0.0.1:9200"], "labels": {"job": "simulator"}},
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["demo.json"]  # no temporary file left behind


def test_file_sd_rewrite_replaces_the_whole_file(tmp_path):
    path = tmp_path / "job.json"
    write_file_sd(path, [("worker", "127.0.0.1:1", {}), ("worker", "127.0.0.1:2", {})])
    write_file_sd(path, [("worker", "127.0.0.1:3", {})])
    assert [g["targets"] for g in json.loads(path.read_text())] == [["127.0.0.1:3"]]


def test_file_sd_rejects_urls(tmp_path):
    with pytest.raises(ValueError, match="host:port"):
        write_file_sd(tmp_path / "x.json", [("worker", "http://127.0.0.1:9/metrics", {})])


def test_target_of_metrics_url():
    assert target_of("http://127.0.0.1:9102/metrics") == "127.0.0.1:9102"


def test_config_names_sd_glob_interval_and_rules():
    text = prometheus_config("/tmp/sd", "3s", ["r.yml"])
    assert 'files: ["/tmp/sd/*.json"]' in text
    assert "scrape_interval: 3s" in text and '- "r.yml"' in text
    assert "rule_files: []" in prometheus_config("/tmp/sd", "3s", [])


def test_run_targets_name_jobs_by_process_kind():
    from edgestream.monitoring.prometheus import run_targets

    targets = run_targets({"w1": "http://127.0.0.1:2/metrics", "server": "http://127.0.0.1:3/metrics",
                           "w0": "http://127.0.0.1:1/metrics", "w2": ""},
                          simulator_url="http://127.0.0.1:4/metrics")

    assert targets == [("server", "127.0.0.1:3", {}), ("worker", "127.0.0.1:1", {"worker": "w0"}),
                       ("worker", "127.0.0.1:2", {"worker": "w1"}), ("simulator", "127.0.0.1:4", {})]
