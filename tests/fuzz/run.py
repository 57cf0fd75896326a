"""Run the fuzz targets under atheris (libFuzzer), replay inputs, maintain the corpus.

Usage (from the repository root, in the virtualenv: ``scripts/with-venv.sh python -m ...``)::

    python -m tests.fuzz.run TARGET|all --seconds S [--jobs N] [--fresh] [--seed N]
    python -m tests.fuzz.run TARGET --reproduce FILE...   # replay without atheris, show tracebacks
    python -m tests.fuzz.run TARGET --minimize FILE       # smallest input with the same crash
    python -m tests.fuzz.run TARGET --merge               # add the work corpus's new coverage to the committed corpus
    python -m tests.fuzz.run --write-seeds [TARGET...]    # regenerate the committed seed inputs

A fuzz run starts one child process per job (``--jobs``) that imports the target
with the decoders instrumented and hands it to libFuzzer with ``-max_total_time``,
``-max_len``, ``-rss_limit_mb`` and ``-timeout``; the corpus directories are the work
corpus (``.edgestream/fuzz/TARGET/corpus``, or a temporary one with ``--fresh``),
then the committed ``tests/fuzz/corpus/TARGET`` and ``tests/fuzz/regressions/TARGET``.
The parent parses libFuzzer's final statistics and prints one line per target::

    fuzz sensor_codec: ok, 123456 executions in 300 s (411/s), cov 812, ft 2301, corpus 96

A crash (a Python exception other than the target's documented ones, a libFuzzer
timeout or out-of-memory) is saved under ``.edgestream/fuzz/TARGET/crashes/``, its
path and the commands to reproduce and minimise it are printed, and the exit status
is 1.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from tests.fuzz.targets import (
    CORPUS_DIR,
    FUZZ_DIR,
    INSTRUMENTED,
    REGRESSIONS_DIR,
    REPO,
    SCRATCH_ENV,
    TARGETS,
    WORK_DIR,
    load,
    memory_tmp,
)

DEFAULT_RSS_MB = 3072
DEFAULT_TIMEOUT_S = 30


@dataclass
class Result:
    """What one fuzz run of a target did, from libFuzzer's output."""

    target: str
    seconds: float
    executions: int = 0
    cov: int = 0
    features: int = 0
    corpus: int = 0
    new_units: int = 0
    peak_rss_mb: int = 0
    crashes: list[str] = field(default_factory=list)
    ok: bool = True
    log: str = ""

    def line(self) -> str:
        verdict = "ok" if self.ok else f"CRASH ({len(self.crashes)} saved)" if self.crashes else "FAILED"
        rate = self.executions / self.seconds if self.seconds else 0.0
        return (
            f"fuzz {self.target}: {verdict}, {self.executions} executions in {self.seconds:.0f} s "
            f"({rate:.0f}/s), cov {self.cov}, ft {self.features}, corpus {self.corpus}, "
            f"new units {self.new_units}, peak rss {self.peak_rss_mb} MB"
        )


_STATUS = re.compile(r"^#(\d+)\s+(\w+)\s+cov: (\d+) ft: (\d+) corp: (\d+)/")
_STAT = re.compile(r"^stat::(\w+):\s+(\d+)")
_ARTIFACT = re.compile(r"Test unit written to (\S+)")


def parse(log: str, result: Result) -> Result:
    """Fold libFuzzer's output of one process into ``result`` (sums across jobs)."""
    status = None
    stats: dict[str, int] = {}
    for line in log.splitlines():
        if m := _STATUS.match(line):
            status = m
        elif m := _STAT.match(line):
            stats[m.group(1)] = int(m.group(2))
        elif m := _ARTIFACT.search(line):
            result.crashes.append(m.group(1))
    if status is not None:
        result.cov = max(result.cov, int(status.group(3)))
        result.features = max(result.features, int(status.group(4)))
        result.corpus = max(result.corpus, int(status.group(5)))
    executions = stats.get("number_of_executed_units", int(status.group(1)) if status else 0)
    result.executions += executions
    result.new_units += stats.get("new_units_added", 0)
    result.peak_rss_mb = max(result.peak_rss_mb, stats.get("peak_rss_mb", 0))
    return result


def libfuzzer_args(name: str, args: argparse.Namespace, work: Path, job: int, seconds: int) -> list[str]:
    crashes = WORK_DIR / name / "crashes"
    crashes.mkdir(parents=True, exist_ok=True)
    module_max_len = load_max_len(name)
    flags = [
        f"-max_total_time={seconds}",
        f"-max_len={args.max_len or module_max_len}",
        f"-rss_limit_mb={args.rss_limit_mb}",
        f"-timeout={args.timeout}",
        f"-artifact_prefix={crashes}/",
        "-print_final_stats=1",
        "-reload=1",
    ]
    if args.seed is not None:
        flags.append(f"-seed={args.seed + job}")
    dirs = [work, CORPUS_DIR / name, REGRESSIONS_DIR / name]
    return flags + [str(d) for d in dirs if d.is_dir()]


def load_max_len(name: str) -> int:
    """The target's ``MAX_LEN`` without importing it (the parent stays light)."""
    source = (FUZZ_DIR / f"{TARGETS[name].rsplit('.', 1)[1]}.py").read_text()
    m = re.search(r"^MAX_LEN = (\d+)", source, re.M)
    return int(m.group(1)) if m else 4096


#: libFuzzer re-runs its own command line (for -merge, -minimize_crash), so the child's
#: argv[0] is this wrapper; it finds the target and the interpreter in the environment.
CHILD = FUZZ_DIR / "libfuzzer-child.sh"


def child_command(name: str, flags: list[str]) -> list[str]:
    return [str(CHILD), *flags]


def child_env(name: str, scratch: str) -> dict[str, str]:
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": pythonpath, "EDGESTREAM_FUZZ_TARGET": name,
            "EDGESTREAM_FUZZ_PYTHON": sys.executable, SCRATCH_ENV: scratch}


def call_child(name: str, flags: list[str]) -> int:
    """Run the child once in the foreground (merge, minimise), with its own scratch space."""
    with tempfile.TemporaryDirectory(prefix=f"edgestream-fuzz-{name}-", dir=memory_tmp()) as scratch:
        return subprocess.call(child_command(name, flags), cwd=REPO, env=child_env(name, scratch))


def fuzz(name: str, args: argparse.Namespace) -> Result:
    """Fuzz one target for ``args.seconds`` with ``args.jobs`` processes; the parsed result.

    A long run is cut into segments of at most ``args.segment_seconds``, each in fresh
    processes sharing the work corpus: atheris leaks about 160 bytes per instrumented
    comparison whose operands are numpy arrays (``streams.codec``'s value-range check
    does one per message), which over ten minutes would exceed ``-rss_limit_mb``.
    """
    result = Result(name, float(args.seconds))
    with tempfile.TemporaryDirectory(prefix=f"edgestream-fuzz-{name}-", dir=memory_tmp()) as tmp:
        work = Path(tmp) / "corpus" if args.fresh else WORK_DIR / name / "corpus"
        work.mkdir(parents=True, exist_ok=True)
        left = args.seconds
        segment = 0
        while left > 0 and result.ok:
            seconds = min(left, args.segment_seconds)
            _segment(name, args, work, Path(tmp) / f"segment{segment}", seconds, segment, result)
            left -= seconds
            segment += 1
        (WORK_DIR / name).mkdir(parents=True, exist_ok=True)
        (WORK_DIR / name / "last.log").write_text(result.log)
    if not result.ok and args.save_regressions:
        for crash in result.crashes:
            dest = REGRESSIONS_DIR / name
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy(crash, dest / Path(crash).name)
    return result


def _segment(
    name: str, args: argparse.Namespace, work: Path, logs: Path, seconds: int, index: int, result: Result
) -> None:
    """One segment: ``args.jobs`` libFuzzer processes for ``seconds``, folded into ``result``."""
    logs.mkdir()
    (logs / "scratch").mkdir()
    env = child_env(name, str(logs / "scratch"))
    procs = []
    for job in range(args.jobs):
        log = open(logs / f"job{job}.log", "w+")  # noqa: SIM115 - closed below
        # With --seed, each job and segment gets its own (reproducible) seed.
        cmd = child_command(name, libfuzzer_args(name, args, work, job + 1000 * index, seconds))
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    # libFuzzer stops itself after -max_total_time; the wait bound covers start-up
    # (torch import, the corpus replay) on a loaded machine, and a hung process.
    deadline = time.monotonic() + seconds + args.startup_grace
    for proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            result.ok = False
            log.write(f"\n[run.py] killed: no exit within {seconds + args.startup_grace:.0f} s\n")
        log.seek(0)
        text = log.read()
        log.close()
        parse(text, result)
        result.log += text
        if proc.returncode != 0:
            result.ok = False


def report(result: Result, verbose: bool) -> None:
    if verbose or not result.ok:
        tail = [line for line in result.log.splitlines() if not line.startswith(("#", "INFO:"))]
        if not result.ok:
            print("\n".join(tail[-60:]), file=sys.stderr)
    print(result.line(), flush=True)
    for crash in result.crashes:
        print(
            f"  crasher: {crash}\n"
            f"  reproduce: python -m tests.fuzz.run {result.target} --reproduce {crash}\n"
            f"  minimise:  python -m tests.fuzz.run {result.target} --minimize {crash}\n"
            f"  once fixed, commit the (minimised) input to tests/fuzz/regressions/{result.target}/",
            flush=True,
        )


def run_child(name: str, flags: list[str]) -> None:
    """In the child: instrument the decoders, import the target, hand it to libFuzzer."""
    import atheris

    # Comparisons with str constants guide the mutations; atheris's RegEx hook is not
    # enabled: it breaks re.Pattern.match(string, pos), which json and tokenize call.
    atheris.enabled_hooks.add("str")
    with atheris.instrument_imports(include=list(INSTRUMENTED)):
        module = load(name)
    if hasattr(module, "fuzzing_setup"):
        module.fuzzing_setup()
    tokens = getattr(module, "dictionary", None)
    if tokens is not None and not any(f.startswith("-dict=") for f in flags):
        # libFuzzer's dictionary (tokens it inserts), written from the target's own
        # constants each run, so it follows the code.
        path = WORK_DIR / name / "dictionary"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"dictionary.{os.getpid()}")  # parallel jobs write it too
        tmp.write_text("".join(f'"{_escape(t)}"\n' for t in tokens()))
        os.replace(tmp, path)
        flags = [f"-dict={path}", *flags]
    atheris.Setup([str(CHILD), *flags], module.test_one_input)
    atheris.Fuzz()


def _escape(token: bytes) -> str:
    return "".join(chr(b) if 32 <= b < 127 and b not in (34, 92) else f"\\x{b:02x}" for b in token)


def reproduce(name: str, files: list[str]) -> int:
    module = load(name)
    failed = 0
    for file in files:
        data = Path(file).read_bytes()
        try:
            module.test_one_input(data)
        except Exception:
            failed += 1
            print(f"{file}: FAILS", file=sys.stderr)
            traceback.print_exc()
        else:
            print(f"{file}: ok")
    return 1 if failed else 0


def minimize(name: str, file: str, args: argparse.Namespace) -> int:
    out = WORK_DIR / name / "minimized"
    out.mkdir(parents=True, exist_ok=True)
    flags = ["-minimize_crash=1", f"-runs={args.runs}", f"-timeout={args.timeout}",
             f"-exact_artifact_path={out / Path(file).name}", file]
    code = call_child(name, flags)
    print(f"minimised input: {out / Path(file).name}")
    return code


def merge(name: str, args: argparse.Namespace) -> int:
    """Add the work corpus's inputs that bring new coverage to the committed corpus."""
    work = WORK_DIR / name / "corpus"
    if not work.is_dir():
        print(f"no work corpus at {work}: run the target first", file=sys.stderr)
        return 1
    (CORPUS_DIR / name).mkdir(parents=True, exist_ok=True)
    flags = ["-merge=1", f"-max_len={args.max_len or load_max_len(name)}", f"-timeout={args.timeout}",
             f"-rss_limit_mb={args.rss_limit_mb}", str(CORPUS_DIR / name), str(work)]
    return call_child(name, flags)


def write_seeds(names: list[str]) -> int:
    for name in names or list(TARGETS):
        directory = CORPUS_DIR / name
        directory.mkdir(parents=True, exist_ok=True)
        seeds = load(name).seeds()
        for seed, data in seeds.items():
            (directory / f"seed-{seed}").write_bytes(data)
        print(f"{name}: {len(seeds)} seeds in {directory.relative_to(REPO)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--child" in argv:
        name = argv[0]
        run_child(name, argv[argv.index("--") + 1 :])
        return 0
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", nargs="*", help=f"one of {', '.join(TARGETS)}, or all")
    parser.add_argument("--seconds", type=int, default=60, help="fuzzing time per target (default 60)")
    parser.add_argument("--jobs", type=int, default=1, help="parallel fuzzing processes per target")
    parser.add_argument("--segment-seconds", type=int, default=120,
                        help="restart the fuzzing processes this often (bounds atheris's memory growth)")
    parser.add_argument("--fresh", action="store_true", help="a temporary work corpus (committed inputs only)")
    parser.add_argument("--seed", type=int, help="libFuzzer's random seed (default: random)")
    parser.add_argument("--max-len", type=int, default=0, help="longest input (default: the target's MAX_LEN)")
    parser.add_argument("--rss-limit-mb", type=int, default=DEFAULT_RSS_MB)
    parser.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT_S, help="seconds one input may take")
    parser.add_argument("--startup-grace", type=float, default=120.0,
                        help="seconds allowed beyond --seconds before a run is killed (imports, seeds)")
    parser.add_argument("--save-regressions", action="store_true",
                        help="copy crashers to tests/fuzz/regressions/TARGET/")
    parser.add_argument("--verbose", action="store_true", help="show libFuzzer's messages")
    parser.add_argument("--runs", type=int, default=20000, help="attempts of --minimize")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--reproduce", nargs="+", metavar="FILE")
    mode.add_argument("--minimize", metavar="FILE")
    mode.add_argument("--merge", action="store_true")
    mode.add_argument("--write-seeds", action="store_true")
    args = parser.parse_args(argv)

    names = list(TARGETS) if args.target in ([], ["all"]) else args.target
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {unknown}; targets: {', '.join(TARGETS)}, all")
    if args.write_seeds:
        return write_seeds(names)
    if args.reproduce or args.minimize or args.merge:
        if len(names) != 1:
            parser.error("--reproduce, --minimize and --merge take exactly one target")
        if args.reproduce:
            return reproduce(names[0], args.reproduce)
        if args.minimize:
            return minimize(names[0], args.minimize, args)
        return merge(names[0], args)
    if not args.target:
        parser.error("name a target or all")
    failed = 0
    for name in names:
        result = fuzz(name, args)
        report(result, args.verbose)
        failed += not result.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
