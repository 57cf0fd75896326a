"""Cost models by name, from a file, with overrides (``trainers/costmodels.py``), and the fill
rule where a cost model meets a number of workers (``CostModel.for_workers``, applied by
``simclock.run``): a short per-worker list is refused under ``fill = "error"``, repeated under
``"cycle"``, padded as it silently was before under ``"ones"``."""

from __future__ import annotations

import dataclasses
import math

import pytest

from edgestream.trainers import costmodels
from edgestream.trainers.costmodels import CostModelError, load_file, resolve
from edgestream.trainers.simclock import CostModel, Mode, RunConfig, StreamSet, run

MBIT = 1e6 / 8
GRADIENT_BYTES = 19_710  # a dense MLP gradient message (benchmarks/strategies.py's calibration)


def _write(tmp_path, text: str, name: str = "costs.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# -- presets ---------------------------------------------------------------------------------


def test_the_presets_are_named_and_default_is_todays_cost_model():
    assert {"default", "edge-compute", "edge-network"} <= set(costmodels.preset_names())
    assert resolve("default").model == CostModel()
    for name, preset in costmodels.PRESETS.items():
        assert preset.name == name and preset.description and preset.source == "preset"
        assert resolve(name) is preset


def test_edge_compute_is_compute_dominated_and_edge_network_network_dominated():
    compute, network = resolve("edge-compute").model, resolve("edge-network").model

    def step(m: CostModel) -> float:
        return m.compute_s(0, 64)

    def message(m: CostModel) -> float:
        return m.transfer_s(GRADIENT_BYTES) + m.latency_s

    assert step(compute) > 10 * message(compute)
    assert message(network) > 10 * step(network)
    assert 0.01 <= compute.compute_base_s <= 0.1 and 5e-4 <= compute.compute_per_record_s <= 2e-3
    assert 1 <= network.bandwidth_bytes_per_s / MBIT <= 10 and 0.01 <= network.latency_s <= 0.1


def test_an_unknown_preset_is_refused_with_the_list_of_presets():
    with pytest.raises(CostModelError, match="unknown cost model 'edge-netwrk': the presets are default, "
                                             "edge-compute, edge-network") as raised:
        resolve("edge-netwrk")
    assert isinstance(raised.value, ValueError)
    with pytest.raises(CostModelError, match="empty cost model spec"):
        resolve("  ")


# -- files -----------------------------------------------------------------------------------


def test_a_file_sets_every_key_in_its_units(tmp_path):
    path = _write(tmp_path, 'name = "lab"\ndescription = "four boards"\ncompute_base_s = 0.03\n'
                            "compute_per_record_s = 1e-3\nlatency_s = 0.004\nbandwidth_mbit = 50\n"
                            'slowdowns = [1, 2, 4.5]\nlinks_mbit = [100, 20, 5]\nfill = "cycle"\n')

    named = load_file(path)

    assert (named.name, named.description, named.source) == ("lab", "four boards", str(path))
    assert named.model == CostModel(compute_base_s=0.03, compute_per_record_s=1e-3, latency_s=0.004,
                                    bandwidth_bytes_per_s=50 * MBIT, slowdowns=(1.0, 2.0, 4.5),
                                    link_bandwidths_bytes_per_s=(100 * MBIT, 20 * MBIT, 5 * MBIT), fill="cycle")
    assert resolve(str(path)) == named


def test_a_file_without_keys_is_the_default_named_by_its_stem(tmp_path):
    named = resolve(str(_write(tmp_path, "latency_s = 0.1\n", "slow-lan.toml")))

    assert named.name == "slow-lan"
    assert named.model == dataclasses.replace(CostModel(), latency_s=0.1)


@pytest.mark.parametrize(("text", "message"), [
    ("latency = 0.1\n", "unknown key 'latency'; the keys are compute_base_s"),
    ("latency_s = -0.1\n", "latency_s must be a finite number >= 0"),
    ("latency_s = inf\n", "latency_s must be a finite number >= 0"),
    ("compute_base_s = nan\n", "compute_base_s must be a finite number >= 0"),
    ('compute_base_s = "fast"\n', "compute_base_s must be a number"),
    ("compute_base_s = true\n", "compute_base_s must be a number"),
    ("bandwidth_mbit = 0\n", "bandwidth_mbit must be > 0"),
    ("links_mbit = [100, 0]\n", r"links_mbit\[1\] must be > 0"),
    ("slowdowns = [1, -2]\n", r"slowdowns\[1\] must be a finite number >= 0"),
    ("slowdowns = 2\n", "slowdowns must be a list of numbers"),
    ('fill = "pad"\n', "fill must be one of 'error', 'cycle', 'ones'"),
    ("name = 3\n", "name must be a string"),
    ("[compute]\nbase = 1\n", "unknown key 'compute'"),
])
def test_a_bad_file_is_refused_naming_the_file_and_the_key(tmp_path, text, message):
    path = _write(tmp_path, text)

    with pytest.raises(CostModelError, match=message) as raised:
        resolve(str(path))
    assert str(raised.value).startswith(f"cost model file '{path}'")


def test_a_missing_file_a_folder_and_bad_toml_are_refused(tmp_path):
    with pytest.raises(CostModelError, match=r"cost model file '.*nope\.toml' does not exist"):
        resolve(str(tmp_path / "nope.toml"))
    with pytest.raises(CostModelError, match="is not a file"):
        load_file(tmp_path)
    with pytest.raises(CostModelError, match=r"costs\.toml' is not valid TOML: .*line 1"):
        resolve(str(_write(tmp_path, "latency_s = = 1\n")))


# -- overrides -------------------------------------------------------------------------------


def test_overrides_replace_keys_of_a_preset_and_lists_use_slashes():
    named = resolve("default:latency_s=0.05,slowdowns=1/2/4/8,links_mbit=100/20,fill=ones")

    assert named.name == named.source == "default:latency_s=0.05,slowdowns=1/2/4/8,links_mbit=100/20,fill=ones"
    assert named.model == dataclasses.replace(CostModel(), latency_s=0.05, slowdowns=(1.0, 2.0, 4.0, 8.0),
                                              link_bandwidths_bytes_per_s=(100 * MBIT, 20 * MBIT), fill="ones")
    assert "latency_s=0.05" in named.description


def test_overrides_apply_to_a_file_and_can_name_the_result_or_empty_a_list(tmp_path):
    path = _write(tmp_path, "compute_base_s = 0.03\nslowdowns = [1, 2]\n")

    named = resolve(f"{path}:bandwidth_mbit=5,slowdowns=,name=slow")

    assert named.name == "slow"
    assert named.model == dataclasses.replace(CostModel(), compute_base_s=0.03, bandwidth_bytes_per_s=5 * MBIT)


@pytest.mark.parametrize(("spec", "message"), [
    ("default:latency_s", "override 'latency_s' is not KEY=VALUE"),
    ("default:latency_s=fast", "latency_s must be a number, got 'fast'"),
    ("default:slowdowns=1/x", "slowdowns must be a number, got 'x'"),
    ("default:latency_s=1,latency_s=2", "latency_s is given twice"),
    ("default:speed=2", "unknown key 'speed'"),
    ("default:latency_s=-1", "latency_s must be a finite number >= 0"),
    ("default:bandwidth_mbit=0", "bandwidth_mbit must be > 0"),
    ("default:fill=wrap", "fill must be one of"),
    ("default:", "nothing after ':'"),
    ("nosuch:latency_s=1", "unknown cost model 'nosuch'"),
])
def test_bad_overrides_are_refused_naming_the_spec_and_the_key(spec, message):
    with pytest.raises(CostModelError, match=message) as raised:
        resolve(spec)
    if not spec.startswith("nosuch"):
        assert str(raised.value).startswith(f"cost model {spec!r}: ")


# -- showing one ------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["default", "edge-compute", "edge-network",
                                  "edge-network:slowdowns=1/2.5,links_mbit=100/2,fill=cycle"])
def test_to_toml_reads_back_to_the_same_model(tmp_path, spec):
    named = resolve(spec)
    again = load_file(_write(tmp_path, costmodels.to_toml(named)))

    assert again.name == named.name and again.description == named.description
    assert again.model == named.model


def test_describe_states_the_numbers():
    assert costmodels.describe(CostModel()) == "step 10 ms + 2 ms/record, latency 2 ms, 100 Mbit/s"
    text = costmodels.describe(CostModel(slowdowns=(1, 2), link_bandwidths_bytes_per_s=(MBIT,), fill="cycle"))
    assert text.endswith("slowdowns 1 2, links 1 Mbit/s (fill cycle)")


def test_with_worker_lists_keeps_the_models_own_lists():
    model = CostModel(slowdowns=(3.0,), fill="cycle")

    both = costmodels.with_worker_lists(model, (1, 2), (MBIT, MBIT), ((1.0, 0, MBIT),))
    assert both.slowdowns == (3.0,) and both.link_bandwidths_bytes_per_s == (MBIT, MBIT)
    assert both.link_changes == ((1.0, 0, MBIT),) and both.fill == "cycle"
    assert costmodels.with_worker_lists(CostModel(), (1, 2)) == CostModel(slowdowns=(1.0, 2.0))


# -- the fill rule ---------------------------------------------------------------------------


def test_a_short_list_under_fill_error_is_refused_saying_what_to_do():
    with pytest.raises(CostModelError) as raised:
        CostModel(slowdowns=(1, 2, 4, 8)).for_workers(8)
    assert str(raised.value) == ('cost model gives 4 slowdowns for 8 workers: give 8, or set fill = "cycle" '
                                 '(repeat the list) or fill = "ones" (the rest at 1)')
    with pytest.raises(CostModelError, match="gives 1 link bandwidths for 3 workers: give 3"):
        CostModel(link_bandwidths_bytes_per_s=(MBIT,)).for_workers(3)
    with pytest.raises(CostModelError, match="cost model 'x' gives 4 slowdowns for 8 workers"):
        costmodels.fit(costmodels.NamedCostModel("x", CostModel(slowdowns=(1, 2, 4, 8))), 8)


def test_cycle_repeats_the_list_and_ones_pads_with_one_and_the_servers_bandwidth():
    cycled = CostModel(slowdowns=(1, 2, 4), link_bandwidths_bytes_per_s=(MBIT, 2 * MBIT), fill="cycle").for_workers(5)
    assert cycled.slowdowns == (1, 2, 4, 1, 2)
    assert cycled.link_bandwidths_bytes_per_s == (MBIT, 2 * MBIT, MBIT, 2 * MBIT, MBIT)

    padded = CostModel(slowdowns=(3,), link_bandwidths_bytes_per_s=(MBIT,), bandwidth_bytes_per_s=7e6,
                       fill="ones").for_workers(3)
    assert padded.slowdowns == (3, 1.0, 1.0)
    assert padded.link_bandwidths_bytes_per_s == (MBIT, 7e6, 7e6)
    assert padded.fill == "ones"


def test_full_lists_are_kept_longer_ones_cut_and_empty_ones_stay_empty():
    exact = CostModel(slowdowns=(1, 2))
    assert exact.for_workers(2) is exact
    assert CostModel(slowdowns=(1, 2, 4), link_bandwidths_bytes_per_s=(MBIT,) * 3).for_workers(2) == CostModel(
        slowdowns=(1, 2), link_bandwidths_bytes_per_s=(MBIT,) * 2)
    for n in (1, 7, 64):
        assert CostModel().for_workers(n) == CostModel()
        zero = CostModel.zero().for_workers(n)
        assert zero == CostModel.zero() and zero.compute_s(n - 1, 100) == 0.0
        assert math.isinf(zero.link_bandwidth(n - 1))


def test_link_changes_beyond_the_workers_a_bad_fill_and_no_workers_are_refused():
    with pytest.raises(CostModelError, match="link_changes for worker index 4, but the run has 3 workers"):
        CostModel(link_changes=((1.0, 4, MBIT),)).for_workers(3)
    with pytest.raises(CostModelError, match="fill must be one of error, cycle, ones"):
        CostModel(fill="pad")
    with pytest.raises(CostModelError, match="at least one worker"):
        CostModel().for_workers(0)


# -- the simulated clock applies it --------------------------------------------------------------


@pytest.fixture(scope="module")
def three_streams() -> StreamSet:
    return StreamSet.from_fleet("digits", [60.0, 30.0, 45.0], seed=5)


SHORT = RunConfig(model="mlp", lr=0.5, target_accuracy=None, time_budget_s=3.0)
ASP = Mode("asp", "asp", batcher="fixed", batch_size=16)


def test_run_refuses_a_short_list_under_fill_error(three_streams):
    with pytest.raises(CostModelError, match="gives 2 slowdowns for 3 workers"):
        run(ASP, three_streams, CostModel(slowdowns=(1, 4)), SHORT)
    with pytest.raises(CostModelError, match="gives 1 link bandwidths for 3 workers"):
        run(ASP, three_streams, CostModel(link_bandwidths_bytes_per_s=(MBIT,)), SHORT)


def test_fill_ones_gives_the_same_report_as_the_explicit_full_list(three_streams):
    padded = CostModel(slowdowns=(1, 4), link_bandwidths_bytes_per_s=(2 * MBIT,), fill="ones")
    explicit = CostModel(slowdowns=(1, 4, 1), link_bandwidths_bytes_per_s=(2 * MBIT, 12.5e6, 12.5e6))

    first, second = (run(ASP, three_streams, costs, SHORT) for costs in (padded, explicit))

    assert dataclasses.asdict(first) == dataclasses.asdict(second)
    assert first.local_steps > 0
    # The slowdown reached worker 1 (and only the padding is 1): it stepped less often than w0.
    steps = {p.name: p.local_steps for p in first.processes}
    assert steps["w1"] < steps["w0"]
