"""promtool: the committed and generated configs, the alert rules, and their unit tests."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from edgestream.monitoring.prometheus import (
    DEPLOY_DIR,
    RULES_FILE,
    prometheus_config,
    write_file_sd,
)


def promtool(*args: str, cwd=None) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    if exe is None:  # never skip: the suite needs Debian's prometheus (scripts/system-deps.sh)
        pytest.fail("promtool not found: install Debian's prometheus package (make test does it)")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_committed_config_is_valid():
    result = promtool("check", "config", str(DEPLOY_DIR / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_generated_config_with_targets_is_valid(tmp_path):
    sd_dir = tmp_path / "targets"
    write_file_sd(sd_dir / "job.json", [("worker", "127.0.0.1:9100", {"worker": "w0"})])
    (tmp_path / "rules").mkdir()
    shutil.copyfile(RULES_FILE, tmp_path / "rules" / "edgestream.yml")
    config = tmp_path / "prometheus.yml"
    config.write_text(prometheus_config(sd_dir, "2s"))

    result = promtool("check", "config", str(config))

    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stdout + result.stderr


def test_alert_rules_are_valid():
    result = promtool("check", "rules", str(RULES_FILE))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 13 rules found" in result.stdout


def test_alert_rule_unit_tests_pass():
    result = promtool("test", "rules", "edgestream.test.yml", cwd=RULES_FILE.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
