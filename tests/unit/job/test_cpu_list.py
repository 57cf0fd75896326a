"""workers.cpus: the CPU-list syntax, cycling over workers, and refusal of bad lists."""

from __future__ import annotations

import re

import pytest

from edgestream.job.config import ConfigError, load_config, parse_cpu_list


@pytest.mark.parametrize(("text", "cpus"), [
    ("0", {0}), ("3", {3}), ("1-3", {1, 2, 3}), ("0+2", {0, 2}), ("0,2", {0, 2}),
    ("0-1+4", {0, 1, 4}), (" 1 , 2 ", {1, 2}), ("2-2", {2}),
])
def test_cpu_lists_parse_to_the_named_cpus(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "-1", "1-", "3-1", "1..2", "0+", "1.5"])
def test_malformed_cpu_lists_are_refused_with_the_expected_form(text):
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_cpu_list(text)


def test_workers_cycle_over_the_lists_and_none_means_unpinned():
    cfg = load_config(overrides=["workers.count=3", "workers.cpus=0,1-2"], env={})
    assert [cfg.workers.cpus_of(i) for i in range(3)] == [{0}, {1, 2}, {0}]
    assert load_config(env={}).workers.cpus_of(0) is None


def test_a_bad_list_in_the_job_is_a_configuration_error():
    with pytest.raises(ConfigError, match="workers.cpus"):
        load_config(overrides=["workers.cpus=0,x"], env={})
