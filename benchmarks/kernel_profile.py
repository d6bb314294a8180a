"""Where a program's device time goes, kernel by kernel: int8ify against the hand-written W8A8 program.

    python benchmarks/kernel_profile.py [--model mlp|minilm] [--width 4096] [--batch N] [--calls 20] [--hlo-dir DIR]
        [--trace-dir DIR] [--top 12] [--kinds] [--quick]

XLA's cost model prices a TPU program's kernels by their memory traffic, and the chip disagreed with it: the MLP
at d 4096 with dynamic scales took 1.17x the hand-written program's time on a v5e, where the model put the two
within 1%. This asks the device. Each variant of the MLP of ``benchmarks/speed.py`` (bf16, hand W8A8, ``int8ify`` +
``quantize_params`` with the contract's formulas and with the plain ones, ``int8ify`` static) or of the MiniLM
encoder (``--model minilm``: bf16, ``int8ify`` + ``quantize_params``, static, static attention too, each from the
float32 params and from the bf16 ones, the bare int8 dots) is called ``calls`` times under ``jax.profiler.trace``;
the device's timeline in the Perfetto trace it writes (the processes named ``/device:...``, their ``XLA Ops``
threads where they have them) gives each kernel's time, summed by name (or by kind, ``--kinds``: the name less its
numeric suffix) and divided by the calls. Kernel names are the optimized HLO's (``fusion.25``, ``convolution.3``):
``--hlo-dir`` saves each variant's (``jax.jit(f).lower(...).compile().as_text()``) to read them beside. On the chip
it found the activations kept in VMEM between kernels, so the exact quantization pass was bound by its vector
instructions (96 us per layer against the hand-written pass's 17), not by memory
(``benchmarks/results/tpu-v5-lite.md``, the fourth run). A CPU has no device timeline; there the table says so.
``benchmarks/device_check.py`` runs this in its ``profile`` step.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "examples" / "minilm"))

from jaxpr_rewrite import calibrate_activation_dots, int8ify, quantize_params  # noqa: E402

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


def profile(fn, args, calls: int, trace_dir: Path | None = None) -> dict[str, tuple[float, float]]:
    """:func:`device_kernel_times` of ``calls`` calls of ``fn(*args)`` (compiled and warmed up first). The trace is
    kept in ``trace_dir`` when given (to open in Perfetto or TensorBoard), in a temporary folder otherwise."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as scratch:
        log_dir = trace_dir if trace_dir is not None else Path(scratch)
        with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
        return device_kernel_times(trace_events(log_dir), calls)


def mlp_variants(width: int, batch: int) -> dict:
    """``name -> (jitted fn, args)``: the MLP of ``benchmarks/speed.py`` in bf16, written by hand in W8A8, and
    int8ify'd with weights quantized once: dynamic activation scales computed as the contract says and with the
    plain formulas (``benchmarks/numerics_cost.py``'s backend), and static activation scales."""
    from mlp import init_mlp, mlp
    from numerics_cost import plain_backend  # noqa: F401  (registers the "int8-plain" backend)
    from speed import hand_mlp, hand_mlp_weights

    params = init_mlp(jax.random.PRNGKey(0), width, 4)
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, width))
    bf16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), (params, x))
    rewritten, qparams = jax.jit(int8ify(mlp)), quantize_params(mlp, params, x)
    return {"bf16": (jax.jit(mlp), bf16),
            "hand W8A8": (jax.jit(hand_mlp), (hand_mlp_weights(params), x)),
            "int8ify+qparams": (rewritten, (qparams, x)),
            "int8ify plain formulas": (jax.jit(int8ify(mlp, backend="int8-plain")), (qparams, x)),
            "int8ify static": (rewritten, (quantize_params(mlp, params, x, activations="static"), x))}


def minilm_variants(batch: int, layers: int | None = None) -> dict:
    """``name -> (jitted fn, args)``: the all-MiniLM-L6-v2 encoder of ``examples/minilm`` (random weights; its first
    ``layers`` encoder layers, all six by default) on ``batch`` sequences of 128 tokens in bf16, int8ify'd with
    weights quantized once (dynamic scales, static scales, and static scales for the attention einsums'
    activations too) from its float32 params and from its bf16 ones (the model's own operations then run in bf16,
    as in the bf16 program), and its bare int8 dots."""
    import model as minilm
    from speed import bare_dots, cast_floats

    params = minilm.init_params()
    params = {**params, "layers": params["layers"][:layers]}
    ids = jnp.asarray(np.random.default_rng(0).integers(1000, 20000, size=(batch, 128)), jnp.int32)
    rest = (ids, jnp.ones((batch, 128), jnp.int32))
    bf16 = cast_floats(params, jnp.bfloat16)
    rewritten = jax.jit(int8ify(minilm.encode))
    variants = {"bf16": (jax.jit(minilm.encode), (bf16, *rest))}
    for suffix, weights in (("", params), (", bf16 model", bf16)):
        static = quantize_params(minilm.encode, weights, *rest, activations="static")
        attention = calibrate_activation_dots(minilm.encode, weights, *rest)
        variants.update({
            f"int8ify+qparams{suffix}": (rewritten, (quantize_params(minilm.encode, weights, *rest), *rest)),
            f"int8ify static{suffix}": (rewritten, (static, *rest)),
            f"int8ify static+attn{suffix}": (jax.jit(int8ify(minilm.encode, activation_scales=attention)),
                                             (static, *rest)),
        })
    bare, bare_args = bare_dots(minilm.encode, params, *rest)
    variants["bare int8 dots"] = (bare, (bare_args,))
    return variants


def by_kind(times: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """:func:`device_kernel_times` summed over the kernels of one kind: names less their numeric suffix
    (``clamp_convert_fusion.3`` and ``clamp_convert_fusion`` are both ``clamp_convert_fusion``), for programs
    with a kernel per layer."""
    kinds = collections.defaultdict(lambda: [0.0, 0.0])
    for name, (launches, us) in times.items():
        kind = kinds[re.sub(r"\.\d+$", "", name)]
        kind[0] += launches
        kind[1] += us
    return {kind: (launches, us) for kind, (launches, us) in kinds.items()}


def profile_rows(variants: dict, calls: int, top: int = 12, hlo_dir: Path | None = None,
                 trace_dir: Path | None = None, kinds: bool = False):
    """The table's rows (Markdown), one variant at a time: its ``top`` kernels by time (kinds of kernels with
    ``kinds``: :func:`by_kind`) and its whole device time per call. ``hlo_dir`` receives each variant's optimized
    HLO, ``trace_dir`` its profile (one folder each)."""
    for name, (fn, args) in variants.items():
        slug = "".join(c if c.isalnum() else "-" for c in name)
        if hlo_dir is not None:
            hlo_dir.mkdir(parents=True, exist_ok=True)
            (hlo_dir / f"{slug}.hlo.txt").write_text(fn.lower(*args).compile().as_text())
        times = profile(fn, args, calls, None if trace_dir is None else trace_dir / slug)
        if not times:
            yield f"| {name} | (no device timeline on {jax.default_backend()}) | | | |"
            continue
        total = sum(us for _, us in times.values())
        count = len(times)
        if kinds:
            times = by_kind(times)
        for kernel, (launches, us) in sorted(times.items(), key=lambda item: -item[1][1])[:top]:
            yield f"| {name} | {kernel} | {launches:g} | {us:.1f} | {us / total:.1%} |"
        yield f"| {name} | **all {count} kernels** | | **{total:.1f}** | 100% |"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["mlp", "minilm"], default="mlp")
    parser.add_argument("--width", type=int, default=4096, help="the MLP's width")
    parser.add_argument("--batch", type=int, help="default: 4096 for the MLP, 128 for MiniLM")
    parser.add_argument("--calls", type=int, default=20, help="calls profiled per variant")
    parser.add_argument("--hlo-dir", type=Path, help="save each variant's optimized HLO here")
    parser.add_argument("--trace-dir", type=Path, help="keep each variant's profile here")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per variant, the longest first")
    parser.add_argument("--kinds", action="store_true",
                        help="sum the kernels of one kind (their names less the numeric suffix)")
    parser.add_argument("--quick", action="store_true", help="a small model, two calls")
    ns = parser.parse_args(argv)
    default_batch = 128 if ns.model == "minilm" else 4096
    width, batch, calls = (64, 8, 2) if ns.quick else (ns.width, ns.batch or default_batch, ns.calls)
    if ns.model == "minilm":
        title, variants = f"MiniLM encoder, batch {batch} x 128", minilm_variants(batch)
    else:
        title, variants = f"MLP 4x{width}, batch {batch}", mlp_variants(width, batch)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {title}, {calls} calls")
    print("\n".join(TABLE_HEADER), flush=True)
    for row in profile_rows(variants, calls, ns.top, ns.hlo_dir, ns.trace_dir, ns.kinds):
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
