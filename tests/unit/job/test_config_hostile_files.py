"""Job files the fuzzer found that escaped as crashes: each is now a one-line ConfigError.

(tests/fuzz/regressions/job_file/ holds the inputs themselves; these name each behaviour.)
"""

from __future__ import annotations

import time

import pytest

from edgestream.job.config import MAX_CPU, MAX_DEVICES, ConfigError, load_config, parse_cpu_list


def write(tmp_path, name: str, content: bytes):
    path = tmp_path / name
    path.write_bytes(content)
    return path


@pytest.mark.parametrize(("name", "content", "match"), [
    ("job.toml", b'[job]\nname = "d\xffmo"\n', "invalid TOML.*utf-8"),
    ("job.json", b'{"job": {"name": "\xff"}}', "invalid JSON.*utf-8"),
    ("job.toml", b"[job]\nseed = " + b"7" * 5000 + b"\n", "invalid TOML.*digits"),
    ("job.json", b'{"job": {"seed": ' + b"7" * 5000 + b"}}", "invalid JSON.*digits"),
    ("job.toml", b"[job]\nname = " + b"[" * 3000 + b"\n", "invalid TOML.*recursion"),
    ("job.json", b"[" * 3000, "invalid JSON.*recursion"),
    ("job.json", b"[1, 2]", "must hold an object of \\[section\\] tables"),
])
def test_undecodable_files_are_configuration_errors(tmp_path, name, content, match):
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, name, content), env={})


def test_a_directory_in_place_of_the_job_file_is_a_configuration_error(tmp_path):
    (tmp_path / "job.toml").mkdir()
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path / "job.toml", env={})


@pytest.mark.parametrize(("content", "match"), [
    (b"[devices]\ncount = 99999999999\n", f"devices.count=99999999999 is above the limit of {MAX_DEVICES}"),
    (b'[workers]\ncount = 99999999999\n[train]\nstages = ["a"]\ninitial_workers = ["x"]\n',
     "workers.count=99999999999 is above the limit"),
    (b'[workers]\ncpus = ["0-99999999999"]\n', f"CPU 99999999999 is above {MAX_CPU}"),
])
def test_huge_counts_are_refused_before_anything_is_listed(tmp_path, content, match):
    start = time.monotonic()
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, "job.toml", content), env={})
    # Listing 1e11 devices, workers or CPUs would take minutes and exhaust memory first.
    assert time.monotonic() - start < 5


def test_the_limits_themselves_are_accepted():
    assert load_config(overrides=[f"devices.count={MAX_DEVICES}"], env={}).devices.count == MAX_DEVICES
    assert max(parse_cpu_list(f"{MAX_CPU - 1}-{MAX_CPU}")) == MAX_CPU
    with pytest.raises(ValueError, match="above"):
        parse_cpu_list(f"{MAX_CPU + 1}")
