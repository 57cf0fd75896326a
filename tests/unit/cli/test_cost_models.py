"""Cost models on the command line: `edgestream costs [SPEC]`, and `--cost-model SPEC` of the
simulated benchmarks (a tiny `bench strategies` run records the cost models it used in its
JSON); every bad spec is one line and exit 2."""

from __future__ import annotations

import json
import tomllib

import pytest

from edgestream.cli.main import main
from edgestream.pipeline.exits import EXIT_CONFIG
from edgestream.trainers import costmodels

TINY = ["--regimes", "rates", "--partitions", "iid", "--rows", "bsp", "--repeats", "1", "--budget", "2",
        "--acc-budget", "2", "--jobs", "1"]


def _toml(tmp_path, text: str, name: str = "lan.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- edgestream costs ------------------------------------------------------------------------


def test_costs_lists_every_preset_with_its_numbers(capsys):
    assert main(["costs"]) == 0

    lines = capsys.readouterr().out.splitlines()
    for name, preset in costmodels.PRESETS.items():
        line = next(i for i, text in enumerate(lines) if text.split()[:1] == [name])
        assert lines[line].endswith(costmodels.describe(preset.model))
        assert lines[line + 1].strip() == preset.description


def test_costs_prints_a_spec_as_a_file_that_reads_back(capsys, tmp_path):
    assert main(["costs", "edge-network:slowdowns=1/2,fill=cycle", "--workers", "3"]) == 0

    path = _toml(tmp_path, capsys.readouterr().out, "out.toml")
    table = tomllib.loads(open(path).read())
    assert table["slowdowns"] == [1.0, 2.0, 1.0] and table["latency_s"] == 0.05
    assert costmodels.load_file(path).model.slowdowns == (1.0, 2.0, 1.0)


@pytest.mark.parametrize(("args", "problem"), [
    (["costs", "nosuch"], "unknown cost model 'nosuch': the presets are default, edge-compute, edge-network"),
    (["costs", "default:slowdowns=1/2", "--workers", "4"], "gives 2 slowdowns for 4 workers: give 4"),
    (["costs", "missing.toml"], "cost model file 'missing.toml' does not exist"),
])
def test_costs_refuses_a_bad_spec_with_one_line(capsys, args, problem):
    assert main(args) == EXIT_CONFIG

    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and problem in err and err.startswith("edgestream costs: ")


# -- bench strategies --cost-model -----------------------------------------------------------


def test_bench_strategies_runs_each_cost_model_and_records_it(bench_process, tmp_path, capsys):
    lan = _toml(tmp_path, 'name = "slow-lan"\ncompute_base_s = 0.005\nlatency_s = 0.02\nbandwidth_mbit = 10\n'
                          'slowdowns = [1, 2]\nfill = "cycle"\n')
    out = tmp_path / "strategies"

    main(["bench", "strategies", *TINY, "--cost-model", "edge-network", "--cost-model", lan, "--out", str(out)])

    result = json.loads(out.with_suffix(".json").read_text())
    recorded = result["cost_models"]
    assert recorded["edge-network"]["latency_s"] == 0.05
    assert recorded["edge-network"]["bandwidth_bytes_per_s"] == 5 * 1e6 / 8
    assert recorded["slow-lan"]["slowdowns"] == [1.0, 2.0] and recorded["slow-lan"]["fill"] == "cycle"
    assert "calibrated" not in recorded  # not asked for: no calibration
    assert result["cost_model_sources"] == {"edge-network": "preset", "slow-lan": lan}
    assert {r["cost"] for r in result["runs"]} == {None, "edge-network", "slow-lan"}  # None: the oracle
    assert "edge-network: step 2 ms + 0.02 ms/record, latency 50 ms, 5 Mbit/s" in out.with_suffix(".md").read_text()
    assert "### slow-lan cost model" in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "problem"), [
    (["--cost-model", "edge-netwrk"], "unknown cost model 'edge-netwrk': the presets are default, edge-compute, "
                                      "edge-network"),
    (["--costs", "default,nosuch"], "unknown cost model 'nosuch'"),
    (["--cost-model", "{tmp}/absent.toml"], "absent.toml' does not exist"),
    (["--cost-model", "{tmp}/bad.toml"], "is not valid TOML"),
    (["--cost-model", "{tmp}/keys.toml"], "unknown key 'latency'"),
    (["--cost-model", "default:latency_s=-1"], "latency_s must be a finite number >= 0"),
    (["--cost-model", "default:slowdowns=1/2/4/8"], 'gives 4 slowdowns for 10 workers: give 10, or set fill = '
                                                    '"cycle" (repeat the list) or fill = "ones" (the rest at 1)'),
    (["--cost-model", "calibrated:latency_s=0.1"], "calibrated is measured at the start of the run"),
    (["--cost-model", "default", "--cost-model", "{tmp}/default.toml"], "two cost models are named 'default'"),
])
def test_bench_strategies_refuses_a_bad_cost_model_with_one_line(bench_process, tmp_path, capsys, flags, problem):
    _toml(tmp_path, "latency_s = = 1\n", "bad.toml")
    _toml(tmp_path, "latency = 1\n", "keys.toml")
    _toml(tmp_path, "latency_s = 1\n", "default.toml")
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]

    with pytest.raises(SystemExit) as exited:
        main(["bench", "strategies", *TINY, *flags, "--out", str(tmp_path / "never")])

    out, err = capsys.readouterr()
    assert exited.value.code == EXIT_CONFIG
    assert err.count("\n") == 1 and err.startswith("edgestream bench strategies: --cost-model: ")
    assert problem in err
    assert not list(tmp_path.glob("never*"))


@pytest.mark.parametrize("name", ["adsp", "gossip", "dlion", "byzantine"])
def test_the_single_cost_model_benchmarks_refuse_a_bad_spec_with_one_line(bench_process, capsys, name):
    with pytest.raises(SystemExit) as exited:
        main(["bench", name, "--cost-model", "default:slowdowns=1/2"])

    err = capsys.readouterr().err
    assert exited.value.code == EXIT_CONFIG
    assert err.count("\n") == 1 and err.startswith(f"edgestream bench {name}: --cost-model: ")
    assert "gives 2 slowdowns for" in err


def test_a_single_cost_model_benchmark_runs_with_it_and_records_it(bench_process, tmp_path):
    out = tmp_path / "byzantine"

    main(["bench", "byzantine", "--budget", "1", "--seeds", "0", "--strategies", "bsp", "--attacks", "sign_flip",
          "--byzantine", "1", "--aggregations", "mean", "--cost-model", "edge-compute:latency_s=0.004",
          "--out", str(out)])

    result = json.loads(out.with_suffix(".json").read_text())
    assert result["cost_model_name"] == result["cost_model_source"] == "edge-compute:latency_s=0.004"
    # The preset's compute and the override's latency; the benchmark's own slowdowns stay.
    assert result["cost_model"]["compute_base_s"] == 0.03 and result["cost_model"]["latency_s"] == 0.004
    assert result["cost_model"]["slowdowns"] == [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert "edge-compute:latency_s=0.004 cost model: step (30 ms + 1 ms/record)" in out.with_suffix(".md").read_text()
