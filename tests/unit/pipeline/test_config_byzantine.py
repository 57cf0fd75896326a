"""Fault injection for robustness evaluation: ``workers.byzantine``, ``workers.attack`` and
``workers.attack_seed`` (docs/configuration.md), their validation and their one effect: the
named workers' strategies are wrapped by ``trainers/byzantine.py``."""

from __future__ import annotations

import logging

import pytest

from edgestream.job.config import BYZANTINE_ATTACKS, ConfigError, load_config
from edgestream.job.sources import job_fleet_data
from edgestream.pipeline.training import build_driver
from edgestream.pipeline.worker import SERVER_NAME, check_training_config, warn_byzantine
from edgestream.trainers.byzantine import ATTACKS, ByzantineStrategy


def job(*overrides: str):
    return load_config(overrides=["devices.count=3", "workers.count=3", "train.enabled=true", *overrides], env={})


def test_the_config_knows_the_attacks_of_the_wrapper():
    assert BYZANTINE_ATTACKS == ATTACKS


def test_default_is_no_byzantine_worker():
    cfg = job()
    assert cfg.workers.byzantine == [] and cfg.workers.attack == "sign_flip" and cfg.workers.attack_seed == 0
    assert [cfg.workers.attack_of(w) for w in [*cfg.worker_names(), SERVER_NAME]] == [None] * 4


def test_keys_from_the_job_file_env_and_flags(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[workers]\ncount = 3\nbyzantine = ["w2"]\nattack = "noise"\nattack_seed = 7\n'
                    "[devices]\ncount = 3\n[train]\nenabled = true\n")
    cfg = load_config(path, env={})
    assert (cfg.workers.byzantine, cfg.workers.attack, cfg.workers.attack_seed) == (["w2"], "noise", 7)
    assert [cfg.workers.attack_of(w) for w in cfg.worker_names()] == [None, None, "noise"]
    cfg = load_config(path, ["workers.attack=scale100"], env={"EDGESTREAM__WORKERS__BYZANTINE": "w0,w1"})
    assert cfg.workers.byzantine == ["w0", "w1"] and cfg.workers.attack == "scale100"
    assert [cfg.workers.attack_of(w) for w in cfg.worker_names()] == ["scale100", "scale100", None]
    assert load_config(path, ["workers.byzantine="], env={}).workers.byzantine == []


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["workers.byzantine=server"], "workers.byzantine names 'server': only workers can be made Byzantine"),
        (["workers.byzantine=w1,w3"], r"workers.byzantine names \['w3'\], not workers of this job \(w0, w1, w2\)"),
        (["workers.byzantine=w1,w1"], r"workers.byzantine lists \['w1'\] more than once"),
        (["workers.byzantine=w1", "workers.attack=flip"],
         "workers.attack='flip' is not one of sign_flip, scale100, noise"),
        (["workers.attack=SCALE100"], "workers.attack='SCALE100' is not one of"),
        (["workers.attack_seed=-1"], r"workers.attack_seed must lie in \[0, 4294967295\] \(got -1\)"),
        (["workers.attack_seed=4294967296"], "workers.attack_seed must lie in"),
        (["workers.attack_seed=1.5"], "workers.attack_seed='1.5' is not a valid int"),
        (["workers.byzantine=w1", "train.enabled=false"], "workers.byzantine needs train.enabled = true"),
        (["workers.byzantine=w1", "workers.count=2", "train.stages=block0", "train.strategy=pipeline_bp"],
         "workers.byzantine cannot be used with train.stages"),
    ],
)
def test_invalid_values_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        job(*overrides)


def test_only_the_named_worker_is_wrapped_and_never_the_server():
    cfg = job("train.strategy=asp", "workers.byzantine=w1", "workers.attack=scale100", "workers.attack_seed=3",
              "train.strategy_params=max_update_norm=5,norm_policy=reject")
    data = job_fleet_data(cfg)
    attacker = build_driver(cfg, "w1", data).strategy
    assert isinstance(attacker, ByzantineStrategy)
    assert (attacker.attack, attacker.name, attacker.role) == ("scale100", "asp", "worker")
    for name in ("w0", "w2"):
        assert not isinstance(build_driver(cfg, name, data).strategy, ByzantineStrategy)
    assert not isinstance(build_driver(cfg, SERVER_NAME, data, role="server").strategy, ByzantineStrategy)


def test_the_attacker_corrupts_what_it_sends_and_counts_it():
    cfg = job("train.strategy=bsp", "workers.byzantine=w0", "workers.attack=sign_flip",
              "batcher.mode=fixed", "batcher.batch_size=8")
    data = job_fleet_data(cfg)
    honest, attacker = build_driver(job("train.strategy=bsp"), "w0", data), build_driver(cfg, "w0", data)
    x, y = data.train.features[:8], data.train.labels[:8]
    sent = {}
    for label, driver in (("honest", honest), ("attacker", attacker)):
        outgoing = driver.strategy.on_local_step(driver.strategy.local_step(driver.trainer, x, y))
        (message,) = [item.message for item in outgoing if item.message.kind == "gradient"]
        sent[label] = message.tensors
    assert sent["honest"].keys() == sent["attacker"].keys()
    for name, tensor in sent["honest"].items():
        assert tensor.abs().sum() > 0 and bool((sent["attacker"][name] == -tensor).all()), name
    assert attacker.strategy.stats()["counters"]["byzantine_corrupted"] == 1
    assert "byzantine_corrupted" not in honest.strategy.stats()["counters"]


def test_a_job_with_byzantine_workers_is_warned_about_and_the_config_check_stays_silent(caplog):
    with caplog.at_level(logging.WARNING, logger="edgestream.pipeline.worker"):
        check_training_config(job("workers.byzantine=w2", "workers.attack=noise"))  # a check, no side effect
        assert not [r for r in caplog.records if "workers.byzantine" in r.getMessage()]
        warn_byzantine(job("workers.byzantine=w2", "workers.attack=noise"))
    (record,) = [r for r in caplog.records if "workers.byzantine" in r.getMessage()]
    assert "sent by w2 is corrupted on purpose with noise" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgestream.pipeline.worker"):
        warn_byzantine(job())
    assert not [r for r in caplog.records if "workers.byzantine" in r.getMessage()]


def test_the_training_summary_marks_the_byzantine_worker_and_the_updates_the_bound_left_out():
    from rich.console import Console

    from edgestream.pipeline.run import RunResult, training_table

    def row(byzantine=None, counters=None):
        return {"steps": 10, "trained_records": 160, "version": 10, "accuracy": 0.9, "staleness": {},
                "updates_rejected": 1, "digest": "ab" * 8, "byzantine": byzantine,
                "strategy_stats": {"counters": counters or {}}}

    result = RunResult(produced={}, garbage={}, accounting={}, balanced=True, duration_s=1.0, training={
        "server": row(counters={"updates_rejected": 7, "updates_clipped": 2}),
        "w2": row(byzantine={"attack": "scale100", "attack_seed": 0, "corrupted": 7})})
    console = Console(width=400, record=True)
    console.print(training_table(result))
    text = console.export_text()

    assert "w2 (byzantine: scale100, 7 sent)" in text
    assert "1 (over the bound 7, clipped 2)" in text


def test_the_live_view_adds_the_updates_the_norm_bound_left_out():
    from edgestream.monitoring.scrape import Sample, Scrape
    from edgestream.pipeline.run import _rejected_live

    scrape = Scrape([Sample("edgestream_updates_rejected_total", (("worker", "server"), ("reason", "bad")), 2.0),
                     Sample("edgestream_norm_rejected_updates_total", (("worker", "server"), ("peer", "w2")), 5.0)])

    assert _rejected_live(scrape, "server") == "2 (+5 bound)"
    assert _rejected_live(scrape, "w0") == "0"
