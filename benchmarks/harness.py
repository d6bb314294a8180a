"""What every benchmark under ``benchmarks/`` shares: the header naming the machine, interleaved timing of several
variants in one process, Markdown tables and the result file.

* :func:`environment`: the device, the CPU (and whether it has AMX-INT8), the cores and the versions, printed first by
  every benchmark, so that results from different machines compare: XLA's int8 dots run ~7x float32 on a Xeon
  with AMX-INT8 and ~1.5x on an AMD EPYC without it.
* :func:`time_interleaved`: each variant's median time per call, the variants called in turn round by round
  (:func:`interleaved_samples`) after a warm-up. A shared machine's load changes over seconds; timing one variant
  after the other would put that change into their ratio, interleaving spreads it over all of them. Each variant's
  program is compiled ahead of time for its own arguments (``jax.jit(f).lower(*args).compile()``,
  :func:`compile_ahead`), and the executables are what is timed: a ``jax.jit`` function compiles at its first
  call, under whatever state holds then, and one traced again after ``jax.clear_caches()`` finds the shared
  programs of its rewritten dots as the last form traced them, so that an A/B of two such functions can time one
  program twice.
* :func:`table` and :class:`Report`: Markdown tables, each line printed as it comes (a long run shows its rows as
  they finish) and kept for the result file.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

import jax

Sample = TypeVar("Sample")


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` and whether it has AMX-INT8 (XLA's int8 dots run ~7x float32
    with it, ~1.5x without), or what :mod:`platform` knows where there is no ``/proc/cpuinfo``."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    names = re.findall(r"^model name\s*:\s*(.+)$", info, re.M)
    amx = " (AMX-INT8)" if "amx_int8" in info else " (no AMX)"
    return (names[0].strip() if names else platform.machine()) + amx


def package_version(name: str) -> str | None:
    """The installed version of the distribution ``name``, ``None`` where it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(packages: Iterable[str] = ()) -> str:
    """The header line every benchmark prints first: device, CPU, cores, Python, JAX and jaxlib, and the versions of
    those of ``packages`` (distribution names, such as a peer library) that are installed."""
    parts = [f"device: {jax.devices()[0].device_kind}", f"CPU: {cpu_model()}, {os.cpu_count()} cores",
             f"Python {platform.python_version()}", f"JAX {jax.__version__}, jaxlib {package_version('jaxlib')}"]
    versions = [f"{name} {package_version(name)}" for name in packages if package_version(name)]
    return "; ".join(parts + ([", ".join(versions)] if versions else []))


@dataclasses.dataclass(frozen=True)
class AsCalled:
    """A variant's function timed as it is called, not compiled ahead of time: where the call itself is what is
    measured (an eager ``int8ify`` call and its weights cache, ``jax.jit``'s dispatch)."""

    fn: Callable

    def __call__(self, *args):
        return self.fn(*args)


def compile_ahead(variants: Mapping[str, tuple[Callable, tuple]]) -> dict[str, tuple[Callable, tuple]]:
    """Each variant's program compiled ahead of time for its own arguments, so that no two variants run one
    executable by accident.

    Arguments:
        variants: name -> ``(fn, args)``; ``fn`` is traced with ``args`` by ``jax.jit(fn).lower(*args).compile()``,
            unless it is already compiled (a ``jax.stages.Compiled``) or marked :class:`AsCalled`.

    Returns:
        name -> ``(executable, args)``, in the order of ``variants``; call an executable as ``fn(*args)``.
    """
    return {name: (fn if isinstance(fn, (AsCalled, jax.stages.Compiled)) else jax.jit(fn).lower(*args).compile(),
                   args)
            for name, (fn, args) in variants.items()}


def interleaved_samples(measures: Mapping[str, Callable[[], Sample]], rounds: int,
                        alternate: bool = False) -> dict[str, list[Sample]]:
    """Each measurement taken ``rounds`` times, the measurements in turn within each round.

    Arguments:
        measures: name -> a function taking one sample (a time, or anything a benchmark reads off one run).
        rounds: how many samples of each.
        alternate: reverse the order every other round, for measurements long enough that which one runs first in
            a round moves its sample (a subprocess each).

    Returns:
        name -> its samples, in the order taken.
    """
    samples = {name: [] for name in measures}
    for round_index in range(rounds):
        order = list(measures)[::-1] if alternate and round_index % 2 else list(measures)
        for name in order:
            samples[name].append(measures[name]())
    return samples


def time_interleaved(variants: Mapping[str, tuple[Callable, tuple]], rounds: int, reps: int, warmup: int = 2,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median milliseconds per call of each variant, timed interleaved (:func:`interleaved_samples`).

    Arguments:
        variants: name -> ``(fn, args)``, compiled by :func:`compile_ahead` (a no-op for its own output).
        rounds: samples per variant; the median is taken over them.
        reps: calls per sample, waited for together at its end (the calls' dispatch overlaps, as in a loop).
        warmup: calls of each variant before any is timed, each waited for.
        clock: seconds, read at each sample's start and end (a test's fake clock).

    Returns:
        name -> median milliseconds per call, in the order of ``variants``.
    """
    compiled = compile_ahead(variants)
    for fn, args in compiled.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))

    def per_call_ms(fn, args) -> float:
        start = clock()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        return (clock() - start) / reps * 1e3

    samples = interleaved_samples({name: functools.partial(per_call_ms, fn, args)
                                   for name, (fn, args) in compiled.items()}, rounds)
    return {name: statistics.median(values) for name, values in samples.items()}


def median_seconds(calls: Mapping[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median wall seconds of each of ``calls`` (name -> a function of no arguments, its result waited for), the
    calls interleaved round by round: for what is measured once per call, such as a first call's compile or a
    checkpoint's load."""

    def seconds(call) -> float:
        start = time.perf_counter()
        jax.block_until_ready(call())
        return time.perf_counter() - start

    samples = interleaved_samples({name: functools.partial(seconds, call) for name, call in calls.items()}, rounds)
    return {name: statistics.median(values) for name, values in samples.items()}


def speedups(times: Mapping[str, float], baseline: str) -> dict[str, float]:
    """Each variant's speed against ``baseline``: the baseline's time over the variant's (above 1: faster)."""
    return {name: times[baseline] / time_ for name, time_ in times.items()}


def table_row(cells: Sequence) -> str:
    """One Markdown table line; each cell as ``str`` writes it."""
    return "| " + " | ".join(map(str, cells)) + " |"


def table(columns: Sequence[str], rows: Iterable[Sequence] = ()) -> list[str]:
    """The lines of a Markdown table: its header, the rule under it, then one line per row (:func:`table_row`)."""
    return [table_row(columns), "|" + "---|" * len(columns), *map(table_row, rows)]


class Report:
    """A benchmark's output: each line printed as it is added, and kept to be written to a result file."""

    def __init__(self, path: str | os.PathLike | None = None):
        """``path``: the result file :meth:`save` writes (``None``: print only)."""
        self.path = Path(path) if path else None
        self.lines: list[str] = []

    def add(self, *lines: str) -> None:
        """Print ``lines`` (flushed: a long run shows each row as it finishes) and keep them."""
        for line in lines:
            print(line, flush=True)
        self.lines.extend(lines)

    def save(self) -> None:
        """Write the lines so far to the result file, when there is one, its folder made. A benchmark saves after
        each finished part, so that a run stopped later keeps what it measured."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n".join(self.lines) + "\n")
        print(f"saved to {self.path}", flush=True)
