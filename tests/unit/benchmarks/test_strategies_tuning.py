"""`edgestream bench strategies --tune-lr`: a tiny matrix records every cell's tuning (grid,
tuning seed, every grid point, the chosen multiplier and LR), its reported runs ran at the
chosen multiplier, and a tuning seed among the reporting seeds is refused before any run."""

from __future__ import annotations

import json
import signal
import sys

import pytest

from edgestream.cli.main import main

TINY = ["--regimes", "rates", "--partitions", "iid", "--rows", "bsp,asp", "--repeats", "1", "--budget", "1",
        "--acc-budget", "1", "--costs", "default", "--jobs", "1"]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One tiny tuned matrix (grid x1, x2) for the module: its output path and what it printed."""
    import contextlib
    import io

    argv, handler = list(sys.argv), signal.getsignal(signal.SIGTERM)
    out = tmp_path_factory.mktemp("tuned") / "s"
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            main(["bench", "strategies", *TINY, "--tune-lr", "--lr-grid", "1,2", "--out", str(out)])
    finally:
        sys.argv[:] = argv
        signal.signal(signal.SIGTERM, handler)
    return out, printed.getvalue()


def test_tune_lr_records_every_cell_s_tuning_and_reports_at_the_chosen_lr(tuned):
    out, printed = tuned

    result = json.loads(out.with_suffix(".json").read_text())
    tune = result["tuning"]
    assert tune["grid"] == [1.0, 2.0] and tune["seeds"] == [1000] and result["seeds"] == [0]
    assert {r["seed"] for r in tune["runs"]} == {1000}
    assert {r["split"] for r in tune["runs"]} == {"tuning"} and {r["split"] for r in result["runs"]} == {"fixed"}
    assert sorted((r["row"], r["lr_mult"]) for r in tune["runs"]) == [
        ("asp", 1.0), ("asp", 2.0), ("bsp", 1.0), ("bsp", 2.0), ("oracle", 1.0), ("oracle", 2.0)]
    assert set(tune["choices"]) == {"zero/rates/iid/oracle", "default/rates/iid/bsp", "default/rates/iid/asp"}
    for row in ("oracle", "bsp", "asp"):
        cell = result["cells"][f"default/rates/iid/{row}"]
        rec = cell["tuning"]
        assert rec["grid"] == [1.0, 2.0] and rec["tune_seeds"] == [1000]
        assert [p["lr_mult"] for p in rec["points"]] == [1.0, 2.0]
        assert all("tta_s" in p and p["acc"] is not None for p in rec["points"])
        assert rec["chosen_mult"] in (1.0, 2.0) and rec["lr"] == pytest.approx(rec["base_lr"] * rec["chosen_mult"])
        # the reported run (seed 0) ran at the chosen multiplier and LR
        (run,) = [r for r in result["runs"] if r["row"] == row]
        assert run["seed"] == 0 and run["lr_mult"] == rec["chosen_mult"] and run["lr"] == pytest.approx(rec["lr"])
        assert cell["lr_mult"] == rec["chosen_mult"]
    # ASP's own per-update LR rule (lr * 64 / (64 N)) keeps its shape: a tenth of BSP's at every multiplier
    asp = result["cells"]["default/rates/iid/asp"]["tuning"]
    assert asp["base_lr"] == pytest.approx(result["settings"]["lr"] / 10)
    md = out.with_suffix(".md").read_text()
    assert "learning rate chosen on the tuning seed" in md and "TTA / tuned BSP's TTA" in md
    assert "tuning [1/6] zero rates/iid seed 1000 oracle lr x1 (0.3)" in printed


def test_reuse_matrix_of_a_tuned_file_keeps_its_choices_and_reruns_a_row_s_grid(bench_process, tuned, tmp_path,
                                                                                 capsys):
    out, _ = tuned
    before = json.loads(out.with_suffix(".json").read_text())
    again = tmp_path / "again"

    main(["bench", "strategies", *TINY, "--tune-lr", "--lr-grid", "1,2", "--reuse-matrix", str(out.with_suffix(".json")),
          "--rerun", "asp", "--out", str(again)])

    printed = capsys.readouterr().out
    after = json.loads(again.with_suffix(".json").read_text())
    assert "tuning the learning rate: 2 simulated runs" in printed and "reusing 2 simulated runs" in printed
    assert after["tuning"]["choices"] == before["tuning"]["choices"]  # deterministic: the same runs, the same choice
    assert [r["lr"] for r in after["runs"]] == pytest.approx([r["lr"] for r in before["runs"]])


@pytest.mark.parametrize(("flags", "problem"), [
    ([], "was tuned (--tune-lr --lr-grid 1,2 --tune-seed 1000): give the same flags to reuse it"),
    (["--tune-lr"], "was tuned on grid 1,2 and seeds 1000, not 0.5,1,2 and 1000"),
])
def test_reuse_matrix_of_a_tuned_file_needs_the_same_tuning(bench_process, tuned, tmp_path, capsys, flags, problem):
    out, _ = tuned

    with pytest.raises(SystemExit) as exited:
        main(["bench", "strategies", *TINY, *flags, "--reuse-matrix", str(out.with_suffix(".json")),
              "--out", str(tmp_path / "never")])

    assert exited.value.code == 2 and problem in capsys.readouterr().err


def test_a_plain_run_is_untuned(bench_process, tmp_path):
    out = tmp_path / "s"

    main(["bench", "strategies", *TINY, "--rows", "bsp", "--out", str(out)])

    result = json.loads(out.with_suffix(".json").read_text())
    assert result["tuning"] is None and all(r["lr_mult"] == 1.0 for r in result["runs"])
    assert {r["split"] for r in result["runs"]} == {"seed"}  # each seed's own test split, as before tuning
    assert "tuned" not in out.with_suffix(".md").read_text()


@pytest.mark.parametrize(("flags", "problem"), [
    (["--tune-lr", "--tune-seed", "0"], "--tune-seed 0 is also a reporting seed"),
    (["--tune-lr", "--lr-grid", "0,1"], "--lr-grid multipliers must be finite and > 0"),
    (["--tune-seed", "1000"], "only mean something with --tune-lr"),
    (["--tune-lr", "--real", "rates/iid:bsp"], "--tune-lr tunes the simulated matrix only"),
])
def test_bad_tuning_flags_are_refused_before_any_run(bench_process, tmp_path, capsys, flags, problem):
    with pytest.raises(SystemExit) as exited:
        main(["bench", "strategies", *TINY, *flags, "--out", str(tmp_path / "never")])

    out, err = capsys.readouterr()
    assert exited.value.code == 2 and problem in err
    assert "simulated runs" not in out and not list(tmp_path.glob("never*"))
