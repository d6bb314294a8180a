"""The deploy path's costs: checkpoint bytes, load time, ``quantize_params``' peak memory, and exported programs.

Usage::

    python benchmarks/deploy.py [--layers 24] [--width 2048] [--out DIR] [--batches 1,32,256]

On an MLP of ``--layers`` square float32 weights of ``--width`` (24 x 2048 is 403 MB of weights), prints:

* the bytes of the float32 params and of the int8 and int4 (W4A8) quantized params, each as an Orbax checkpoint
  (:func:`~jaxpr_rewrite.checkpoint.save_quantized`) and a SafeTensors file
  (:func:`~jaxpr_rewrite.safetensors_io.save_safetensors`), with its load time (median of 3, the files' loads
  interleaved, onto no target);
* ``quantize_params``' peak resident memory, measured in a fresh process (``VmHWM``) against its bound: the
  float params plus the quantized copy plus one layer's temporaries (three float copies of it) plus a fixed part
  (compiling the quantizer, the trace) measured on a one-layer model of width 256;
* the int8 program exported with ``jax.export`` for one batch size and for any (a symbolic batch): its serialized
  bytes, and at each of ``--batches`` the kernels XLA compiles it to and its time per call against the program
  traced at that batch size (medians of interleaved calls).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxpr_rewrite import int8ify, quantize_params  # noqa: E402
from jaxpr_rewrite.checkpoint import load_quantized, save_quantized  # noqa: E402
from jaxpr_rewrite.safetensors_io import load_safetensors, save_safetensors  # noqa: E402
from harness import Report, compile_ahead, environment, median_seconds, table, table_row, time_interleaved  # noqa: E402

MB = 2**20
SMALL_WIDTH = 256  # the one-layer model whose peak is the fixed part of quantize_params' memory
TEMPORARY_COPIES = 3  # float copies of one layer its quantization may hold at once


def mlp(params, x):
    for w in params:
        x = jax.nn.relu(x @ w)
    return x


def mlp_params(layers: int, width: int):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((width, width), np.float32) / np.float32(np.sqrt(width))) for _ in range(layers)]


def size_on_disk(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def peak_memory(layers: int, width: int, fixed_mmap_threshold: bool) -> dict:
    """``quantize_params``' peak resident memory over the process's before the params existed, in a fresh process.

    Read from ``/proc/self/status``: ``VmHWM`` (the peak, which a new program starts afresh, unlike
    ``ru_maxrss``, which a child inherits from the process that forked it) and ``VmRSS``. With
    ``fixed_mmap_threshold``, glibc's malloc keeps serving blocks over 1 MiB by ``mmap`` (``MALLOC_MMAP_THRESHOLD_``):
    by default it raises that threshold after the first large block is freed, so the per-weight device copies then
    come from the heap, which fragments and keeps memory the program no longer holds.
    """
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import jax
import numpy as np
from deploy import mlp, mlp_params, resident
from jaxpr_rewrite import quantize_params
jax.block_until_ready(jax.jit(lambda a: a + 1)(np.zeros(4, np.float32)))
before = resident("VmHWM")
params = mlp_params({layers}, {width})
with_params = resident("VmRSS")
qparams = jax.block_until_ready(quantize_params(mlp, params, np.zeros((8, {width}), np.float32)))
print(before, with_params, resident("VmHWM"))
"""
    # without JAX's persistent compilation cache: a program found there skips its compilation and the memory that
    # takes, so the small model's fixed part (the bound's) would depend on what an earlier process compiled
    env = {name: value for name, value in os.environ.items() if name != "JAX_COMPILATION_CACHE_DIR"}
    env.update({"MALLOC_MMAP_THRESHOLD_": str(MB)} if fixed_mmap_threshold else {})
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    before, with_params, peak = (int(v) for v in done.stdout.split())
    return {"before": before, "with_params": with_params, "peak": peak}


def quantized_bytes(layers: int, width: int) -> int:
    """int8 codes, float32 scales and int32 exponents of ``layers`` square weights."""
    return layers * (width * width + 8 * width)


def beyond_params(memory: dict, layers: int, width: int) -> int:
    """The peak beyond the float params and their int8 copy."""
    return memory["peak"] - memory["with_params"] - quantized_bytes(layers, width)


def resident(field: str) -> int:
    """A memory line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} (this measurement needs Linux)")


def kernels(executable) -> int:
    """The fusions, dots and custom calls of a compiled program's optimized HLO: the kernels XLA:CPU runs."""
    return len(re.findall(r"= \S+ (?:fusion|dot|custom-call)\(", executable.as_text()))


def checkpoint_costs(report: Report, params, x, out: Path) -> None:
    """Add the table of each format's bytes and load time: the float32, int8 and int4 params of ``mlp``, each
    written to ``out`` as an Orbax checkpoint and a SafeTensors file."""
    float_bytes = sum(w.nbytes for w in params)
    files = {}
    for label, bits in (("float32", None), ("int8", 8), ("int4 (W4A8)", 4)):
        tree = params if bits is None else quantize_params(mlp, params, x, bits=bits)
        for kind, save, load in (("Orbax", save_quantized, load_quantized),
                                 ("SafeTensors", save_safetensors, load_safetensors)):
            path = out / f"{label.split()[0]}.{kind.lower()}"
            shutil.rmtree(path, ignore_errors=True)
            save(path, tree)
            files[label, kind] = path, load
        del tree
    seconds = median_seconds({key: lambda path=path, load=load: jax.tree_util.tree_leaves(load(path))
                              for key, (path, load) in files.items()}, rounds=3)
    rows = []
    for (label, kind), (path, _) in files.items():
        size = size_on_disk(path)
        rows.append([label, kind, f"{size / MB:.1f} MB", f"{size / float_bytes:.2f}x",
                     f"{seconds[label, kind]:.3f}"])
    report.add(*table(["weights", "file", "bytes", "vs float32", "load (s)"], rows))


def exported_program_costs(report: Report, qparams, width: int, batches) -> None:
    """Add the exported int8 program's bytes, and per batch size its kernels and time against the traced one."""
    traced = int8ify(mlp)
    example = np.zeros((max(batches), width), np.float32)
    one_batch = jax.export.export(jax.jit(traced))(qparams, example)
    any_batch = jax.export.export(jax.jit(traced))(qparams, jax.ShapeDtypeStruct(
        (*jax.export.symbolic_shape("batch"), width), np.float32))
    report.add(f"exported int8 program (weights passed in): {len(one_batch.serialize()) / 1024:.1f} KiB for batch "
               f"{example.shape[0]}, {len(any_batch.serialize()) / 1024:.1f} KiB for any batch",
               *table(["batch", "kernels, any batch / traced", "ms, any batch", "ms, traced", "any batch / traced"]))
    for batch in batches:
        x = np.random.default_rng(batch).standard_normal((batch, width)).astype(np.float32)
        variants = compile_ahead({"any": (any_batch.call, (qparams, x)), "traced": (traced, (qparams, x))})
        ms = time_interleaved(variants, rounds=21, reps=1)
        report.add(table_row([batch, f"{kernels(variants['any'][0])} / {kernels(variants['traced'][0])}",
                              f"{ms['any']:.3f}", f"{ms['traced']:.3f}", f"{ms['any'] / ms['traced']:.2f}x"]))


def peak_memory_lines(layers: int, width: int) -> tuple[list[str], bool]:
    """``quantize_params``' peak memory against its bound, with ``MALLOC_MMAP_THRESHOLD_`` fixed and with glibc's
    default: one line each, and whether the bound holds with the threshold fixed (the default malloc's peak is
    reported, not held to it: :func:`peak_memory`).

    The fixed part (XLA's compile of the quantizer, the trace) is measured on one small layer; one layer's
    temporaries are bounded by three float copies of it (its device copy, the compiled pass's argument buffer,
    that pass's intermediates), so the full model may add only its params and quantized copy on top of that."""
    float_bytes = layers * width * width * 4
    lines, within = [], True
    for fixed_threshold, allocator in ((True, "MALLOC_MMAP_THRESHOLD_=1MiB"), (False, "default malloc")):
        # the larger of two fresh processes: on a busy machine one measured 11 MB against 17-18 MB idle
        fixed = max(beyond_params(peak_memory(1, SMALL_WIDTH, fixed_threshold), 1, SMALL_WIDTH) for _ in range(2))
        full = peak_memory(layers, width, fixed_threshold)
        extra = beyond_params(full, layers, width)
        bound = fixed + TEMPORARY_COPIES * width * width * 4
        ok = extra <= bound
        within = within and (ok or not fixed_threshold)
        total = full["peak"] - full["before"]
        lines.append(f"quantize_params (int8) peak memory, {allocator}: {total / MB:.0f} MB above the process before "
                     f"the params ({total / float_bytes:.2f}x the float model) = float params "
                     f"{float_bytes / MB:.0f} MB + int8 copy {quantized_bytes(layers, width) / MB:.0f} MB + "
                     f"{extra / MB:.0f} MB, against a bound "
                     f"of {bound / MB:.0f} MB (fixed {fixed / MB:.0f} MB + {TEMPORARY_COPIES} float layers): "
                     f"{'within' if ok else 'over'} float + quantized + one layer's temporaries")
    return lines, within


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None, help="where to write the files (default: a temp dir)")
    parser.add_argument("--batches", default="1,32,256", help="batch sizes the exported program is timed at")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="int8ify-deploy-"))
    out.mkdir(parents=True, exist_ok=True)
    params = mlp_params(args.layers, args.width)
    x = np.zeros((8, args.width), np.float32)
    report = Report()
    report.add(environment(("orbax-checkpoint", "safetensors")),
               f"MLP {args.layers} x {args.width}x{args.width} float32: {sum(w.nbytes for w in params) / MB:.1f} MB "
               "of weights")
    checkpoint_costs(report, params, x, out)
    exported_program_costs(report, quantize_params(mlp, params, x), args.width,
                           [int(b) for b in args.batches.split(",")])
    lines, within = peak_memory_lines(args.layers, args.width)
    report.add(*lines)
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
