"""benchmarks/time_to_accuracy.py: the real runs' learning rates and the simulated medians over seeds."""

from __future__ import annotations

from edgestream.benchmarks import time_to_accuracy as tta


def _run(mode: str, seed: int, t: float | None, mult: float = 1.0) -> dict:
    return {"partition": "iid", "mode": mode, "seed": seed, "tta_s": t, "lr_mult": mult, "lr": 0.3 * mult,
            "final_accuracy": 0.91, "max_backlog": {"d0": 10.0}, "bytes_sent": 1e6, "compressed_fraction": 0.0}


def test_real_runs_take_the_simulated_choice_and_ddp_takes_bsps() -> None:
    s = tta.Settings()
    sim = {"tuning": {"choices": {"iid/bsp": {"chosen_mult": 2.0}, "iid/scadles": {"chosen_mult": 0.5}}}}
    lrs = tta.real_learning_rates(sim, s, ["iid"], ["bsp", "scadles", "ddp"])
    assert lrs == {("iid", "bsp"): 0.6, ("iid", "scadles"): 0.15, ("iid", "ddp"): 0.6}


def test_without_tuning_every_real_run_is_at_the_base_rate() -> None:
    s = tta.Settings()
    for sim in (None, {"tuning": None}):
        assert set(tta.real_learning_rates(sim, s, ["iid", "dirichlet"], ["bsp", "ddp"]).values()) == {s.lr}


def test_ratios_to_bsp_are_per_seed_medians_and_a_miss_stays_a_bound() -> None:
    raw = [_run("bsp", 0, 40.0), _run("bsp", 1, None), _run("bsp", 2, 30.0),
           _run("scadles", 0, 20.0), _run("scadles", 1, 30.0), _run("scadles", 2, 10.0),
           _run("oracle", 0, 10.0), _run("oracle", 1, 15.0), _run("oracle", 2, 10.0)]
    summary = tta.sim_summary(raw, ["iid"], ["oracle", "bsp", "scadles"], [0, 1, 2], budget_s=60.0)
    row = summary["iid/scadles"]
    # per seed: 40/20 = 2, >60/30 = >2, 30/10 = 3: the median is the ">2" bound
    assert row["speedup_vs_bsp"] == {"value": 2.0, "bound": ">", "min": 2.0, "max": 3.0}
    assert row["x_oracle"]["value"] == 2.0 and row["x_oracle"]["bound"] == "="
    assert summary["iid/bsp"]["tta"]["bound"] == "="  # 30, 40, >60: the median 40 is known
    assert summary["iid/bsp"]["tta"]["value"] == 40.0


def test_bsps_own_ratio_is_one_even_when_it_missed() -> None:
    raw = [_run("bsp", 0, None), _run("scadles", 0, 20.0)]
    summary = tta.sim_summary(raw, ["iid"], ["bsp", "scadles"], [0], budget_s=60.0)
    assert summary["iid/bsp"]["speedup_vs_bsp"]["value"] == 1.0
    assert summary["iid/bsp"]["tta"] == {"value": 60.0, "bound": ">", "min": 60.0, "max": 60.0}
    assert summary["iid/scadles"]["speedup_vs_bsp"]["bound"] == ">"  # BSP's miss: at least 60 / 20


def test_the_real_table_pairs_each_mode_with_bsp_on_the_same_seed() -> None:
    runs = [tta.ModeRun("bsp", "iid", 0, seed=0, tta_s=40.0), tta.ModeRun("bsp", "iid", 1, seed=1, tta_s=20.0),
            tta.ModeRun("scadles", "iid", 0, seed=0, tta_s=20.0), tta.ModeRun("scadles", "iid", 1, seed=1, tta_s=20.0),
            tta.ModeRun("ddp", "iid", 0, seed=0, error="broker gone")]
    table = tta.summarise(runs, ["iid"], ["bsp", "scadles", "ddp"], budget_s=60.0)
    # per seed 2.0 and 1.0: median 1.5 (a ratio of medians, 30 / 20, would also say 1.5; seed-paired is the rule)
    assert table["iid/scadles"]["speedup_vs_bsp"]["value"] == 1.5
    assert table["iid/scadles"]["seeds"] == [0, 1]
    assert "iid/ddp" not in table  # its only run failed
    assert "| iid | scadles | 0.3 | 20.0 | 1.50x (1.00-2.00) |" in tta.markdown(table, tta.Settings(), [0, 1])
