"""`edgestream import` on messy tables: each refusal is exit 2, one line naming the row,
column or byte, and nothing is written; a BOM is dropped instead of refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgestream.cli.main import main
from edgestream.job.importer import IMPORT_INFO, TRAIN_FILE, TableImportError, _check_stats
from edgestream.pipeline.exits import EXIT_CONFIG


def table_lines(rows: int = 24) -> list[str]:
    """A clean two-class table: header ``x,y,label`` and ``rows`` rows."""
    return ["x,y,label"] + [f"{i * 0.5:.1f},{i % 7},{'ab'[i % 2]}" for i in range(rows)]


def write(path, lines: list[str], *, prefix: bytes = b"") -> str:
    path.write_bytes(prefix + ("\n".join(lines) + "\n").encode())
    return str(path)


def run_import(tmp_path, file: str, label: str = "label") -> int:
    return main(["import", "--file", file, "--label-column", label, "--out", str(tmp_path / "rec"),
                 "--devices", "2", "--rates", "20,10", "--duration", "1"])


def error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one error line, got {lines!r} (stdout {captured.out!r})"
    (line,) = lines
    assert line.startswith("edgestream import: ")
    return line


def with_row(lines: list[str], row: int, text: str) -> list[str]:
    """``lines`` with data row ``row`` (1-based, after the header) replaced by ``text``."""
    out = list(lines)
    out[row] = text
    return out


@pytest.mark.parametrize("value", ["1e39", "-3.5e38", "1e308"])
def test_a_value_that_overflows_float32_is_refused_naming_row_and_column(tmp_path, capsys, value):
    src = write(tmp_path / "t.csv", with_row(table_lines(), 7, f"1.0,{value},a"))

    code = run_import(tmp_path, src)

    line = error_line(capsys)
    assert code == EXIT_CONFIG
    assert "data row 7, column 'y'" in line and "overflows float32" in line
    assert not (tmp_path / "rec").exists()  # nothing written: no train.npz holding inf


def test_the_largest_float32_value_still_imports_with_finite_statistics(tmp_path, capsys):
    src = write(tmp_path / "t.csv", with_row(table_lines(), 3, f"1.0,{float(np.finfo(np.float32).max)!r},b"))

    assert run_import(tmp_path, src) == 0

    info = json.loads((tmp_path / "rec" / IMPORT_INFO).read_text())  # strict JSON: no Infinity/NaN
    assert all(np.isfinite(v).all() for v in info["data"]["stats"].values())
    with np.load(tmp_path / "rec" / TRAIN_FILE, allow_pickle=False) as z:
        assert np.isfinite(z["features"]).all()


def test_blank_lines_do_not_shift_the_row_named(tmp_path, capsys):
    lines = table_lines()
    src = write(tmp_path / "t.csv", [*lines[:3], "", *with_row(lines, 5, "1.0,1e39,a")[3:]])

    assert run_import(tmp_path, src) == EXIT_CONFIG

    # The blank line is data row 3; the bad row is the sixth data row of the file.
    assert "data row 6, column 'y'" in error_line(capsys)


def test_a_missing_label_column_lists_at_most_20_columns(tmp_path, capsys):
    names = [f"feature_{i:03d}" for i in range(600)] + ["target"]
    src = write(tmp_path / "wide.csv", [",".join(names), ",".join(["1"] * 600 + ["a"])])

    code = run_import(tmp_path, src, label="label")

    line = error_line(capsys)
    assert code == EXIT_CONFIG
    assert "no label column 'label'" in line and "601 columns" in line
    assert "feature_019, ... and 581 more" in line
    assert "feature_020" not in line and "target" not in line
    assert len(line) < 600


def test_a_utf8_bom_is_stripped_from_the_first_column_name(tmp_path, capsys):
    lines = table_lines()
    lines[0] = "label,x,y"
    lines[1:] = [f"{'ab'[i % 2]},{i * 0.5:.1f},{i % 7}" for i in range(24)]
    src = write(tmp_path / "bom.csv", lines, prefix=b"\xef\xbb\xbf")

    assert run_import(tmp_path, src, label="label") == 0

    info = json.loads((tmp_path / "rec" / IMPORT_INFO).read_text())
    assert info["data"]["feature_names"] == ["x", "y"]
    assert info["data"]["label_names"] == ["a", "b"]


@pytest.mark.parametrize("content, says", [
    (bytes(range(256)) * 8, "binary file (NUL bytes)"),
    (b"x,label\n" + b"1,a\n" * 5000 + b"1,\xff\xfe\x80\n", "not UTF-8 text (byte 0xff at offset 20010, line 5002)"),
], ids=["nul-bytes", "not-utf8"])
def test_binary_input_is_refused_with_exit_2(tmp_path, capsys, content, says):
    (tmp_path / "blob.csv").write_bytes(content)

    code = run_import(tmp_path, str(tmp_path / "blob.csv"))

    line = error_line(capsys)
    assert code == EXIT_CONFIG
    assert says in line and "UnicodeDecodeError" not in line
    assert not (tmp_path / "rec").exists()


def test_duplicate_header_names_are_refused_naming_both_columns(tmp_path, capsys):
    src = write(tmp_path / "dup.csv", ["x,y,x,label"] + [f"{i},{i},{i},{'ab'[i % 2]}" for i in range(24)])

    code = run_import(tmp_path, src)

    line = error_line(capsys)
    assert code == EXIT_CONFIG
    assert "duplicate column name 'x' (columns 1 and 3)" in line
    assert not (tmp_path / "rec").exists()


@pytest.mark.parametrize("label, says", [
    ("nan", "label 'nan' (not a class) in data row 5"),
    ("NaN", "label 'NaN' (not a class) in data row 5"),
    ("", "empty label in data row 5"),
    ("  ", "empty label in data row 5"),
    ("inf", "label 'inf' (not a class) in data row 5"),
])
def test_nan_and_empty_labels_are_refused_naming_the_row(tmp_path, capsys, label, says):
    src = write(tmp_path / "t.csv", with_row(table_lines(), 5, f"1.0,2.0,{label}"))

    code = run_import(tmp_path, src)

    line = error_line(capsys)
    assert code == EXIT_CONFIG
    assert says in line
    assert not (tmp_path / "rec").exists()


def test_a_nan_label_in_a_numeric_npz_is_refused_too(tmp_path, capsys):
    labels = np.array([0.0, 1.0] * 12)
    labels[9] = np.nan
    np.savez(tmp_path / "t.npz", features=np.ones((24, 3), np.float32), label=labels)

    assert run_import(tmp_path, str(tmp_path / "t.npz")) == EXIT_CONFIG

    assert "label 'nan' (not a class) in data row 10" in error_line(capsys)


def test_a_value_that_overflows_float32_in_an_npz_is_refused(tmp_path, capsys):
    features = np.ones((24, 3))
    features[4, 2] = -1e300
    np.savez(tmp_path / "t.npz", features=features, label=np.array([0, 1] * 12))

    assert run_import(tmp_path, str(tmp_path / "t.npz")) == EXIT_CONFIG

    assert "data row 5, column 'features[2]'" in error_line(capsys)


def test_a_column_whose_span_overflows_float32_is_refused(tmp_path, capsys):
    big = float(np.finfo(np.float32).max)
    lines = with_row(with_row(table_lines(), 3, f"1.0,{big!r},b"), 9, f"1.0,{-big!r},b")
    src = write(tmp_path / "t.csv", lines)

    code = run_import(tmp_path, src)

    line = error_line(capsys)
    assert code == EXIT_CONFIG
    assert "column 'y' spans 6.806e+38 (min -3.403e+38, max 3.403e+38), beyond float32's" in line
    assert not (tmp_path / "rec").exists()


def test_a_non_finite_statistic_is_refused_naming_the_column():
    stats = {"min": [0.0, 1.0], "max": [1.0, 2.0], "mean": [0.5, 1.5], "std": [0.1, float("inf")]}

    with pytest.raises(TableImportError, match=r"the std of column 'y' is inf"):
        _check_stats("t.csv", stats, ["x", "y"])
    _check_stats("t.csv", {**stats, "std": [0.1, 0.2]}, ["x", "y"])  # finite: no error


def test_a_declared_range_from_data_at_the_float32_limit_stays_finite_without_a_warning():
    import warnings

    from edgestream.job.config import load_config
    from edgestream.job.sources import declared_value_range

    big = float(np.finfo(np.float32).max)
    cfg = load_config(overrides=["data.value_range=auto", "data.value_margin=0.5"], env={})

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow in the float32 cast would raise here
        lo, hi = declared_value_range(cfg, (np.array([0.0, -1.0]), np.array([big, 1.0])), from_data=True)

    assert lo.dtype == hi.dtype == np.float32
    assert np.isfinite(lo).all() and np.isfinite(hi).all()
    assert hi[0] == np.float32(big) and lo[0] < 0  # widened, then clipped to what float32 holds
    assert lo[1] == np.float32(-2.0) and hi[1] == np.float32(2.0)  # an ordinary column as before
