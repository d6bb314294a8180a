"""Where the time of an int8 program goes on CPU: its int8 dots, and the passes around them, kernel by kernel.

    python benchmarks/kernels.py [--quick] [--batches 32 256] [--width 1024] [--out benchmarks/results/kernels.md]

End-to-end times (``benchmarks/peers.py``) add up the int8 dots and everything else, and on a shared machine the
dots alone move by 10-30% from run to run, which hides the passes around them (absmax, scale, quantize,
epilogue) that int8ify adds. This script runs each variant of the Flax MLP of ``peers.py`` under JAX's profiler
and takes the median time of every kernel XLA:CPU runs (its thunks: fusions, YNNPACK dots and reductions) over
the calls, then splits it into the int8 dots (a fusion whose computation holds an s8 ``dot``) and the rest. XLA:CPU
runs independent kernels at once (the quantization of each weight when the weights come per call, a reduction
over the codes beside its dot), and then kernel times overlap: their sum exceeds the call's wall time, printed
beside it (the median of single calls, the variants interleaved), so compare such a variant's passes with care.
Variants: ``floor`` (the dots plus the model's own bias and gelu, each dot's input a cast to int8, the model's
float input's too: ``peers.floor_program``), ``hand W8A8``, ``int8ify+qparams``,
``int8ify static`` and ``int8ify (weights/call)`` (the weights quantized in the program, under ``jit``). The
passes are printed in microseconds per call and as a ratio to the floor's (what the model itself must run
besides its dots).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from harness import Report, compile_ahead, environment, table, table_row, time_interleaved  # noqa: E402
from peers import WIDTH, calibration_batches, flax_mlp, floor_program, hand_program  # noqa: E402

from jaxpr_rewrite import int8ify, quantize_params  # noqa: E402


def int8_dot_kernels(hlo: str) -> set[str]:
    """The names of the ENTRY instructions of an optimized CPU HLO module that run an int8 ``dot``: a fusion whose
    computation holds one, or the ``dot`` itself (older XLA:CPU runs an unfused dot as a kernel of its own)."""
    int32_dot = r"= s32\[[^\]]*\][^ ]* dot\("
    computations = dict(re.findall(r"^%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S | re.M))
    entry = hlo[hlo.index("\nENTRY"):]
    names = set(re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) " + int32_dot, entry, re.M))
    for name, body in re.findall(r"^\s*%?([\w.\-]+) = [^\n]*?calls=%?([\w.\-]+)", hlo, re.M):
        called = computations.get(body, "")
        if re.search(int32_dot, called):
            names.add(name)
    return names


def kernel_times(fn, args, calls: int) -> dict[str, float]:
    """Median microseconds per call of each kernel ``fn(*args)`` runs, from a profile of ``calls`` calls."""
    for _ in range(5):
        jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        (path,) = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    durations = collections.defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and "dur" in event:
            durations[event["name"]].append(float(event["dur"]))
    return {name: float(np.median(d)) * len(d) / calls for name, d in durations.items()}


def kernel_names(executable) -> tuple[set, set]:
    """``(int8 dots, other kernels)``: the names of the kernels a compiled program runs, from its optimized HLO."""
    hlo = executable.as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    kernels = set(re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", entry, re.M))  # each runs as a thunk of its name
    dots = int8_dot_kernels(hlo)
    return dots, kernels - dots


def split(times: dict, names: tuple[set, set]) -> tuple[float, float]:
    """``(int8 dots, other kernels)``: microseconds per call, from :func:`kernel_times` and :func:`kernel_names`."""
    return tuple(sum(t for k, t in times.items() if k in group) for group in names)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--width", type=int, default=WIDTH, help="the layers' width")
    parser.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    parser.add_argument("--out", help="also write the table (Markdown) here")
    args = parser.parse_args(argv)
    calls, repeats = (10, 1) if args.quick else (100, 3)

    width = args.width
    model, params = flax_mlp(width)
    apply = model.apply
    report = Report(args.out)
    report.add(environment(("flax",)), "",
               f"Flax MLP 4 x Dense({width}) + gelu; microseconds per call, each kernel's median over {calls} "
               f"profiled calls, the best of {repeats} profiles; wall: the median of {calls} interleaved calls", "",
               *table(["batch", "variant", "wall", "int8 dots", "passes around them", "passes x floor's"]))
    for batch in args.batches:
        x = jax.random.normal(jax.random.PRNGKey(batch), (batch, width))
        wrapped = int8ify(apply)
        hand, hand_weights = hand_program(params)
        (floor, floor_args), _ = floor_program(params, x)
        variants = compile_ahead({
            "floor": (floor, floor_args),
            "hand W8A8": (hand, (hand_weights, x)),
            "int8ify+qparams": (wrapped, (quantize_params(apply, params, x), x)),
            "int8ify static": (wrapped, (quantize_params(apply, params, x, activations="static",
                                                         calibration=calibration_batches(batch, width)), x)),
            "int8ify (weights/call)": (wrapped, (params, x)),
        })
        best = {}
        for name, (fn, fn_args) in variants.items():
            names = kernel_names(fn)
            runs = [split(kernel_times(fn, fn_args, calls), names) for _ in range(repeats)]
            best[name] = (min(dots for dots, _ in runs), min(passes for _, passes in runs))
        walls = time_interleaved(variants, rounds=calls, reps=1)
        for name, (dots, passes) in best.items():
            report.add(table_row([batch, name, f"{walls[name] * 1e3:.0f}", f"{dots:.1f}", f"{passes:.1f}",
                                  f"{passes / best['floor'][1]:.2f}"]))
        report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
