"""`--tune-lr` of gossip, dlion, adsp and byzantine: a tiny run of each records every tuned
cell's choice (grid, tuning seed, every grid point) and its reported runs ran at it."""

from __future__ import annotations

import json

import pytest

from edgestream.cli.main import main

TUNE = ["--tune-lr", "--lr-grid", "1,2"]
CASES = {
    # name: (flags, the JSON's choice key of a run, the rows whose runs are reported)
    "gossip": (["--no-traffic", "--partitions", "iid", "--rows", "bsp,gossip", "--lags", "", "--seeds", "0",
                "--budget", "1", "--acc-budget", "1", "--log", "{tmp}/runs.jsonl"],
               lambda r: f"{r['partition']}/{r['row']}"),
    "dlion": (["--nodes", "8", "--ablation-nodes", "", "--partitions", "iid", "--rows", "bsp,gossip,dlion",
               "--seeds", "0", "--budget", "1", "--acc-budget", "1", "--no-degraded", "--log", "{tmp}/runs.jsonl"],
              lambda r: f"{r['partition']}/{r['nodes']}/{r['row']}"),
    "adsp": (["--levels", "2.2", "--rows", "bsp,adsp", "--commit-ablation", "", "--repeats", "1", "--budget", "1",
              "--acc-budget", "1", "--jobs", "1"],
             lambda r: f"{r['h']}/{r['row']}"),
    "byzantine": (["--budget", "1", "--seeds", "0", "--strategies", "bsp", "--attacks", "sign_flip", "--byzantine", "1",
                   "--aggregations", "mean"],
                  lambda r: f"{r['strategy']}/{r['aggregation']}"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tune_lr_records_each_cell_s_choice_and_reports_at_it(bench_process, tmp_path, name):
    flags, choice_of = CASES[name]
    out = tmp_path / name

    main(["bench", name, *[f.replace("{tmp}", str(tmp_path)) for f in flags], *TUNE, "--out", str(out)])

    result = json.loads(out.with_suffix(".json").read_text())
    tune = result["tuning"]
    assert tune["grid"] == [1.0, 2.0] and tune["seeds"] == [1000]
    assert {r["seed"] for r in tune["runs"]} == {1000} and {r["lr_mult"] for r in tune["runs"]} == {1.0, 2.0}
    assert tune["choices"] and set(tune["choices"]) == {choice_of(r) for r in tune["runs"]}
    for rec in tune["choices"].values():
        assert [p["lr_mult"] for p in rec["points"]] == [1.0, 2.0] and rec["tune_seeds"] == [1000]
        assert rec["lr"] == pytest.approx(rec["base_lr"] * rec["chosen_mult"])
    assert result["runs"] and all(r["seed"] != 1000 for r in result["runs"])
    # tuning runs are scored on their validation split; every run is tested on the one fixed split
    assert {r["split"] for r in tune["runs"]} == {"tuning"} and {r["split"] for r in result["runs"]} == {"fixed"}
    for r in result["runs"]:
        rec = tune["choices"][choice_of(r)]
        assert r["lr_mult"] == rec["chosen_mult"] and r["lr"] == pytest.approx(rec["lr"])
    assert "Learning rate chosen on the tuning seed" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_tuning_seed_among_the_reporting_seeds_is_refused(bench_process, tmp_path, capsys, name):
    flags, _ = CASES[name]

    with pytest.raises(SystemExit) as exited:
        main(["bench", name, *[f.replace("{tmp}", str(tmp_path)) for f in flags], *TUNE, "--tune-seed", "0",
              "--out", str(tmp_path / "never")])

    assert exited.value.code == 2 and "--tune-seed 0 is also a reporting seed" in capsys.readouterr().err
    assert not list(tmp_path.glob("never*"))


@pytest.mark.parametrize("name", ["time_to_accuracy", "scadles_rate_sweep"])
def test_simulated_time_to_accuracy_tunes_on_validation_and_reports_on_the_fixed_split(bench_process, tmp_path, name):
    flags = (["--sim-only", "--modes", "bsp,scadles"] if name == "time_to_accuracy" else ["--slowest", "10"])
    out = tmp_path / name

    main(["bench", name, *flags, "--partitions", "iid", "--repeats", "1", "--budget", "2", *TUNE, "--out", str(out)])

    result = json.loads(out.with_suffix(".json").read_text())
    sims = [result["simulated"]] if name == "time_to_accuracy" else result["rows"]
    for sim in sims:
        assert {r["split"] for r in sim["tuning"]["runs"]} == {"tuning"}
        assert {r["seed"] for r in sim["tuning"]["runs"]} == {1000}
        assert sim["runs"] and {r["split"] for r in sim["runs"]} == {"fixed"}
    assert "scored on its validation split" in out.with_suffix(".md").read_text()
