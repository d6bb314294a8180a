"""Where a program's device time goes, kernel by kernel: int8ify against the hand-written W8A8 program.

    python benchmarks/kernel_profile.py [--width 4096] [--batch 4096] [--calls 20] [--hlo-dir DIR] [--quick]

On a TPU v5e chip the MLP at d 4096 with dynamic scales took 1.17x the hand-written program's time, which neither
XLA's cost model (the two within 1%) nor the machine code of their kernels (within 3% per dot, the quantization
pass within 10% of the plain division's) explains. This asks the device. Each variant of the MLP of
``benchmarks/speed.py`` (bf16, hand W8A8, ``int8ify`` + ``quantize_params``, ``int8ify`` static) is called
``calls`` times under ``jax.profiler.trace``; the device's timeline in the Perfetto trace it writes (the processes
named ``/device:...``, their ``XLA Ops`` threads where they have them) gives each kernel's time, summed by name
and divided by the calls. Kernel names are the optimized HLO's (``fusion.25``, ``convolution.3``): ``--hlo-dir``
saves each variant's (``jax.jit(f).lower(...).compile().as_text()``) to read them beside. A CPU has no device
timeline; there the table says so. ``benchmarks/device_check.py`` runs this in its ``profile`` step.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

from jaxpr_rewrite import int8ify, quantize_params  # noqa: E402

TABLE_HEADER = ["| variant | kernel | launches per call | us per call | share of the device time |",
                "|---|---|---|---|---|"]


def device_kernel_times(events: list[dict], calls: int) -> dict[str, tuple[float, float]]:
    """``kernel name -> (launches per call, microseconds per call)`` from a Perfetto trace's events: the complete
    events (``ph == "X"``, ``dur`` in microseconds) of the processes named ``/device:...``, on their threads named
    ``XLA Ops`` where a process has such threads (its other threads nest the same time: modules, steps), on all its
    threads otherwise. Empty when the trace has no device timeline (a CPU)."""
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, name in processes.items() if name.startswith("/device:")}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] in devices}
    op_threads = {key for key, name in threads.items() if name == "XLA Ops"}
    pids_with_op_threads = {pid for pid, _ in op_threads}
    launches, durations = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in devices:
            continue
        if e["pid"] in pids_with_op_threads and (e["pid"], e.get("tid")) not in op_threads:
            continue
        launches[e["name"]] += 1
        durations[e["name"]] += float(e.get("dur", 0.0))
    return {name: (launches[name] / calls, durations[name] / calls) for name in durations}


def trace_events(log_dir: Path) -> list[dict]:
    """The events of the Perfetto trace ``jax.profiler.trace(log_dir, create_perfetto_trace=True)`` wrote."""
    path = next(log_dir.rglob("perfetto_trace.json.gz"))
    with gzip.open(path) as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def profile(fn, args, calls: int) -> dict[str, tuple[float, float]]:
    """:func:`device_kernel_times` of ``calls`` calls of ``fn(*args)`` (compiled and warmed up first)."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
        return device_kernel_times(trace_events(Path(log_dir)), calls)


def mlp_variants(width: int, batch: int) -> dict:
    """``name -> (jitted fn, args)``: the MLP of ``benchmarks/speed.py`` in bf16, written by hand in W8A8, and
    int8ify'd with weights quantized once, dynamic and static activation scales."""
    from mlp import init_mlp, mlp
    from speed import hand_mlp, hand_mlp_weights

    params = init_mlp(jax.random.PRNGKey(0), width, 4)
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, width))
    bf16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), (params, x))
    rewritten = jax.jit(int8ify(mlp))
    return {"bf16": (jax.jit(mlp), bf16),
            "hand W8A8": (jax.jit(hand_mlp), (hand_mlp_weights(params), x)),
            "int8ify+qparams": (rewritten, (quantize_params(mlp, params, x), x)),
            "int8ify static": (rewritten, (quantize_params(mlp, params, x, activations="static"), x))}


def profile_rows(variants: dict, calls: int, top: int = 12, hlo_dir: Path | None = None):
    """The table's rows (Markdown), one variant at a time: its ``top`` kernels by time and its whole device time
    per call."""
    for name, (fn, args) in variants.items():
        if hlo_dir is not None:
            hlo_dir.mkdir(parents=True, exist_ok=True)
            slug = "".join(c if c.isalnum() else "-" for c in name)
            (hlo_dir / f"{slug}.hlo.txt").write_text(fn.lower(*args).compile().as_text())
        times = profile(fn, args, calls)
        if not times:
            yield f"| {name} | (no device timeline on {jax.default_backend()}) | | | |"
            continue
        total = sum(us for _, us in times.values())
        for kernel, (launches, us) in sorted(times.items(), key=lambda item: -item[1][1])[:top]:
            yield f"| {name} | {kernel} | {launches:g} | {us:.1f} | {us / total:.1%} |"
        yield f"| {name} | **all {len(times)} kernels** | | **{total:.1f}** | 100% |"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=20, help="calls profiled per variant")
    parser.add_argument("--hlo-dir", type=Path, help="save each variant's optimized HLO here")
    parser.add_argument("--quick", action="store_true", help="a small MLP, two calls")
    ns = parser.parse_args(argv)
    width, batch, calls = (64, 8, 2) if ns.quick else (ns.width, ns.batch, ns.calls)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; MLP 4x{width}, batch {batch}, {calls} calls")
    print("\n".join(TABLE_HEADER), flush=True)
    for row in profile_rows(mlp_variants(width, batch), calls, hlo_dir=ns.hlo_dir):
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
