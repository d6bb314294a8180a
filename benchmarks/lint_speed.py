"""How much the JX flake8 plugin adds to a flake8 run, on ~1k real files.

Usage::

    python benchmarks/lint_speed.py [CORPUS_DIR] [--max-files 1000] [--repeats 3] [--jobs 1]
                                    [--sample 20] [--out FILE]

CORPUS_DIR is any directory of Python sources you did not write (relative paths are fine). Create
one with::

    pip install --target /path/to/corpus --no-deps flax optax equinox jax

(flax + optax + equinox give ~300 files, jax's own source ~600 more). Without CORPUS_DIR the
script does exactly that into a temporary directory (needs a package index).

Both variants run the same flake8 (all installed plugins, default checks, output discarded) in a
subprocess on the same files, interleaved with their order alternating (``benchmarks/harness.py``),
``--repeats`` times each. The "without" run removes the
plugin before flake8 loads anything: a small driver filters the ``flake8.extension`` entry point
``lint_plugin.plugin:Int8Checker`` out of ``flake8.plugins.finder.find_plugins``, so the plugin's
code is never imported; the "with" run uses the same driver without the filter. Afterwards one
``flake8 --select=JX`` run counts flags per code (``--sample N`` prints N of them for review).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Report, environment, interleaved_samples, table  # noqa: E402

PLUGIN_ENTRY_POINT = "lint_plugin.plugin:Int8Checker"
TARGET_RATIO = 1.5  # flake8 with the plugin, over flake8 without it

DRIVER = f"""
import sys
from flake8.plugins import finder
if sys.argv.pop(1) == "without":
    _find = finder.find_plugins
    def find_plugins(cfg, opts):
        return [p for p in _find(cfg, opts) if p.entry_point.value != {PLUGIN_ENTRY_POINT!r}]
    finder.find_plugins = find_plugins
from flake8.main.cli import main
sys.argv[0] = "flake8"
raise SystemExit(main())
"""


def make_corpus(target: Path) -> Path:
    print(f"creating corpus in {target} (pip install --no-deps flax optax equinox jax) ...", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    "flax", "optax", "equinox", "jax"], check=True)
    return target


def collect_files(corpus: Path, max_files: int) -> List[Path]:
    files = sorted(p for p in corpus.rglob("*.py") if ".dist-info" not in str(p))
    return files[:max_files]


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_flake8(variant: str, files: Sequence[Path], jobs: str,
               extra: Sequence[str] = ()) -> Tuple[float, float, str]:
    """Wall seconds, CPU seconds (all flake8 processes), stdout."""
    with tempfile.TemporaryDirectory() as cwd:  # no project config files
        args = [sys.executable, "-c", DRIVER, variant, "--isolated", "--exit-zero", f"--jobs={jobs}",
                *extra, *map(str, files)]
        cpu0 = _children_cpu()
        t0 = time.perf_counter()
        proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True)
        elapsed = time.perf_counter() - t0
        cpu = _children_cpu() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"flake8 failed ({variant}):\n{proc.stderr[-2000:]}")
    return elapsed, cpu, proc.stdout


def main(argv: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", nargs="?", type=Path, help="directory of real Python sources")
    ap.add_argument("--max-files", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--jobs", default="1", help="flake8 --jobs (default 1, for stable timings)")
    ap.add_argument("--sample", type=int, default=0, help="print this many JX flags for review")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the results (Markdown) here")
    args = ap.parse_args(list(argv) or None)

    tmp = None
    corpus = args.corpus
    if corpus is None:
        tmp = tempfile.TemporaryDirectory(prefix="lintcorpus-")
        corpus = make_corpus(Path(tmp.name))
    # flake8 runs in a scratch directory (no project config), so every path must be absolute
    corpus = corpus.resolve()
    files = collect_files(corpus, args.max_files)
    if not files:
        print(f"lint_speed.py: no .py files under {corpus}, nothing to measure.", file=sys.stderr)
        return 2
    n_lines = sum(p.read_bytes().count(b"\n") for p in files)
    report = Report(args.out)
    report.add(environment(("flake8", "libcst")),
               f"corpus: {len(files)} files, {n_lines} lines, flake8 --jobs={args.jobs}, {args.repeats} repeats")

    def measure(variant: str) -> Tuple[float, float]:
        elapsed, cpu, _ = run_flake8(variant, files, args.jobs, ["--output-file", os.devnull])
        print(f"  {variant:>7} plugin  wall {elapsed:7.2f} s  cpu {cpu:7.2f} s", flush=True)
        return elapsed, cpu

    # CPU time (user+sys of every flake8 process) is robust to other load on the machine;
    # wall time is what a user waits.
    samples = interleaved_samples({"without": lambda: measure("without"), "with": lambda: measure("with")},
                                  args.repeats, alternate=True)
    times = {variant: [wall for wall, _ in runs] for variant, runs in samples.items()}
    cpus = {variant: [cpu for _, cpu in runs] for variant, runs in samples.items()}
    rows = [[f"{variant} JX", f"{min(times[variant]):.2f}", f"{statistics.median(times[variant]):.2f}",
             f"{min(cpus[variant]):.2f}", f"{statistics.median(cpus[variant]):.2f}",
             f"{n_lines / statistics.median(cpus[variant]):.0f}"] for variant in ("without", "with")]
    report.add("", *table(["flake8", "wall min", "wall med", "cpu min", "cpu med", "lines/cpu-s"], rows), "")
    for label, d in (("wall", times), ("cpu", cpus)):
        ratio_med = statistics.median(d["with"]) / statistics.median(d["without"])
        ratio_min = min(d["with"]) / min(d["without"])
        report.add(f"ratio with/without ({label}): {ratio_med:.2f} (medians), {ratio_min:.2f} (minima); "
                   f"target <= {TARGET_RATIO:.2f}")

    elapsed, _, out = run_flake8("with", files, args.jobs, ["--select=JX"])
    flags = [line for line in out.splitlines() if ": JX" in line]
    counts = collections.Counter(line.split(": ", 1)[1].split()[0] for line in flags)
    report.add("", f"flake8 --select=JX: {len(flags)} flags in {elapsed:.2f} s",
               *(f"  {code}  {counts[code]}" for code in sorted(counts)))
    if args.sample and flags:
        report.add("", f"sample of {min(args.sample, len(flags))} flags:",
                   *("  " + line.replace(str(corpus) + os.sep, "")
                     for line in random.Random(args.seed).sample(flags, min(args.sample, len(flags)))))
    report.save()
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
