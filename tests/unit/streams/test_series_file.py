"""The ``.ts`` parser, the converted ``.npz`` and the BasicMotions conversion script, on
planted files (no network): what is read, what is refused with the line named, what a
wheel holds and what the script writes."""

from __future__ import annotations

import hashlib
import importlib.util
import zipfile
from pathlib import Path

import numpy as np
import pytest

from edgestream.streams.series_file import (
    SeriesFile,
    SeriesFormatError,
    convert_ts,
    load_series_file,
    parse_ts,
    windows,
    windows_per_series,
)

REPO = Path(__file__).resolve().parents[3]

TS = """#A planted dataset: two channels,
#two classes.
@problemName Planted
@timeStamps false
@missing false
@univariate false
@dimensions 2
@equalLength true
@seriesLength 4
@classLabel true Still Moving
@data
0.5,1,1.5,2:-1,-2,-3,-4:Still
3,2,1,0:0.25,0.25,0.25,0.25:Moving
1e-3,-2.5e1,7,8:9,10,11,12:Still
"""


def planted(series: int = 3, classes: tuple[str, ...] = ("Still", "Moving"), length: int = 4) -> str:
    rng = np.random.default_rng(series)
    rows = [":".join(",".join(f"{v:.6f}" for v in rng.normal(size=length)) for _ in range(2))
            + f":{classes[i % len(classes)]}" for i in range(series)]
    return (f"@problemName P\n@dimensions 2\n@seriesLength {length}\n@classLabel true {' '.join(classes)}\n"
            "@data\n" + "\n".join(rows) + "\n")


def test_parse_reads_series_labels_classes_and_comments():
    data = parse_ts(TS, "planted.ts")
    assert data.problem == "Planted"
    assert data.series.dtype == np.float32 and data.series.shape == (3, 2, 4)
    np.testing.assert_array_equal(data.series[0], [[0.5, 1, 1.5, 2], [-1, -2, -3, -4]])
    np.testing.assert_allclose(data.series[2, 0], [1e-3, -25, 7, 8])
    assert data.labels == ("Still", "Moving", "Still")
    assert data.class_names == ("Still", "Moving")
    assert data.comments == ("A planted dataset: two channels,", "two classes.")


@pytest.mark.parametrize("change, message", [
    (lambda t: t.replace("3,2,1,0:", "3,?,1,0:"), r"planted.ts:13: a missing value \('\?'\)"),
    (lambda t: t.replace("3,2,1,0:", "3,2,x,0:"), r"planted.ts:13: 'x', not a number"),
    (lambda t: t.replace("3,2,1,0:", "3,2,1:"), r"planted.ts:13: dimensions of unequal length \[3, 4\]"),
    (lambda t: t.replace("1e-3,-2.5e1,7,8:", ""), r"planted.ts:14: 1 dimensions of length 4, but the series before"),
    (lambda t: t.replace(":Moving\n", ":Jumping\n"), r"class label\(s\) \['Jumping'\] not in @classLabel"),
    (lambda t: t.replace("@data\n", ""), r"planted.ts:11: expected a #comment or an @header line before @data"),
    (lambda t: t.split("@data")[0], r"planted.ts: no @data line"),
    (lambda t: t.replace("@timeStamps false", "@timeStamps true"), r"@timeStamps true is not supported"),
    (lambda t: t.replace("@classLabel true Still Moving", "@classLabel false"), r"needs '@classLabel true NAME"),
    (lambda t: t.replace("@seriesLength 4", "@seriesLength 5"), r"@serieslength says 5 but the series have 4"),
    (lambda t: t.replace("3,2,1,0:", "3,2,1e39,0:"), r"planted.ts:13: a value is not finite or does not fit float32"),
    (lambda t: t.split("@data")[0] + "@data\n", r"no series after @data"),
])
def test_parse_refuses_what_it_cannot_use_naming_the_line(change, message):
    with pytest.raises(SeriesFormatError, match=message):
        parse_ts(change(TS), "planted.ts")


def test_convert_save_and_load_round_trip(tmp_path):
    train, test = parse_ts(planted(6), "train"), parse_ts(planted(4), "test")
    data = convert_ts(train, test, channel_names=("a", "b"), sample_rate_hz=10.0, meta={"dataset": "P", "x": [1]})
    np.testing.assert_array_equal(data.train_labels, [0, 1, 0, 1, 0, 1])
    assert data.meta["problem"] == "P" and data.meta["x"] == [1]
    path = data.save(tmp_path / "sub" / "p.npz")
    assert sorted(p.name for p in path.parent.iterdir()) == ["p.npz"]  # no temporary file left
    back = load_series_file(path)
    for key in ("train_series", "train_labels", "test_series", "test_labels"):
        np.testing.assert_array_equal(getattr(back, key), getattr(data, key))
    assert (back.class_names, back.channel_names, back.sample_rate_hz) == (("Still", "Moving"), ("a", "b"), 10.0)
    assert back.meta == data.meta


def test_convert_refuses_files_that_disagree(tmp_path):
    with pytest.raises(SeriesFormatError, match="declare different classes"):
        convert_ts(parse_ts(planted(4)), parse_ts(planted(4, ("Still", "Other"))), channel_names=("a", "b"),
                   sample_rate_hz=10)
    with pytest.raises(SeriesFormatError, match="differ in channels or length"):
        convert_ts(parse_ts(planted(4)), parse_ts(planted(4, length=5)), channel_names=("a", "b"), sample_rate_hz=10)
    with pytest.raises(SeriesFormatError, match="1 channel names for 2 channels"):
        convert_ts(parse_ts(planted(4)), parse_ts(planted(4)), channel_names=("a",), sample_rate_hz=10)


def test_load_refuses_other_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_series_file(tmp_path / "none.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(SeriesFormatError, match="not a converted series file"):
        load_series_file(tmp_path / "other.npz")
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(SeriesFormatError, match="cannot be read"):
        load_series_file(tmp_path / "text.npz")
    data = convert_ts(parse_ts(planted(4)), parse_ts(planted(2)), channel_names=("a", "b"), sample_rate_hz=10)
    path = data.save(tmp_path / "v.npz")
    with np.load(path) as z:
        arrays = dict(z)
    arrays["version"] = np.int64(99)
    np.savez(tmp_path / "v99.npz", **arrays)
    with pytest.raises(SeriesFormatError, match="version 99"):
        load_series_file(tmp_path / "v99.npz")


def test_windows_cut_every_series_in_time_order():
    series = np.arange(2 * 3 * 10, dtype=np.float32).reshape(2, 3, 10)
    cut = windows(series, 4, 3)
    assert windows_per_series(10, 4, 3) == 3
    assert cut.shape == (6, 3, 4) and cut.dtype == np.float32
    np.testing.assert_array_equal(cut[0], series[0, :, 0:4])
    np.testing.assert_array_equal(cut[2], series[0, :, 6:10])
    np.testing.assert_array_equal(cut[3], series[1, :, 0:4])
    assert windows(series, 10, 1).shape == (2, 3, 10)
    with pytest.raises(ValueError, match="longer than the series"):
        windows(series, 11, 1)


def test_series_file_checks_its_arrays():
    ok = dict(train_series=np.zeros((2, 1, 3), np.float32), train_labels=np.array([0, 1]),
              test_series=np.zeros((1, 1, 3), np.float32), test_labels=np.array([1]), class_names=("a", "b"),
              channel_names=("c",), sample_rate_hz=1.0)
    SeriesFile(**ok)
    for change, message in [({"train_labels": np.array([0, 2])}, r"lie in \[0, 2\)"),
                             ({"test_series": np.full((1, 1, 3), np.nan, np.float32)}, "not finite"),
                             ({"train_series": np.zeros((2, 1, 3))}, "float32"),
                             ({"sample_rate_hz": 0.0}, "sample_rate_hz")]:
        with pytest.raises(SeriesFormatError, match=message):
            SeriesFile(**{**ok, **change})


def fetch_script():
    spec = importlib.util.spec_from_file_location("fetch_basicmotions", REPO / "scripts" / "fetch_basicmotions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_converts_the_wheels_ts_files_and_checks_the_wheel(tmp_path, monkeypatch, capsys):
    script = fetch_script()
    six = planted(8).replace("@dimensions 2", "@dimensions 6")
    six = "\n".join(line if ":" not in line else ":".join([line.split(":")[0]] * 6 + [line.split(":")[-1]])
                    for line in six.splitlines())
    cache = tmp_path / "cache"
    cache.mkdir()
    with zipfile.ZipFile(cache / script.WHEEL, "w") as z:
        for member in script.MEMBERS:
            z.writestr(member, six)
        z.writestr("sktime/__init__.py", "")
    # A wheel that is not the pinned one is refused, naming the fix.
    with pytest.raises(SystemExit, match="SHA-256 .* expected .*; delete it and run again"):
        script.main(["--cache", str(cache), "--out", str(tmp_path / "x.npz")])
    digest = hashlib.sha256((cache / script.WHEEL).read_bytes()).hexdigest()
    monkeypatch.setattr(script, "WHEEL_SHA256", digest)
    assert script.main(["--cache", str(cache), "--out", str(tmp_path / "bm.npz")]) == 0
    out = capsys.readouterr().out
    assert f"using the cached {cache / script.WHEEL}" in out and "8 train + 8 test series, 6 channels" in out
    data = load_series_file(tmp_path / "bm.npz")
    assert data.channel_names == script.CHANNELS and data.sample_rate_hz == 10.0
    assert data.meta["dataset"] == "BasicMotions" and data.meta["citation"] == script.CITATION
    assert set(data.meta["files_sha256"]) == set(script.MEMBERS)
    # Run again: the file is there and is described, not rewritten.
    mtime = (tmp_path / "bm.npz").stat().st_mtime_ns
    assert script.main(["--cache", str(cache), "--out", str(tmp_path / "bm.npz")]) == 0
    assert "exists: BasicMotions: 8 train" in capsys.readouterr().out
    assert (tmp_path / "bm.npz").stat().st_mtime_ns == mtime
