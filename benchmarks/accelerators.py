"""Kernels launched on an H200 and XLA's estimated TPU cycles, compiled without the device.

    gpu-aot/bin/python benchmarks/accelerators.py --gpu [--out benchmarks/results/accelerators-gpu.md]
    tpu-aot/bin/python benchmarks/accelerators.py --tpu [--out benchmarks/results/accelerators-tpu.md]
        (JAX 0.12's: benchmarks/results/accelerators-tpu-jax0.12.md)

Each runs under the virtual environment of the matching deviceless compiler (``../shared/tools/gpu_compile`` or
``../shared/tools/tpu_compile``; their READMEs say how to install them). Models: the 4 x Dense(1024) + gelu MLP at
batch 1024 and one pre-LN transformer block (d 384, 6 heads, MLP 1536) at batch 32 x 128. Variants:

* ``bf16``             the model in bfloat16 (params and input cast);
* ``bf16, f32 input``  the same bfloat16 model handed the float32 input the int8 variants get (cast inside it): for
  comparison only, the targets are read against ``bf16``;
* ``hand W8A8``        the int8 program written by hand with the plain formulas, weights pre-quantized;
* ``int8ify+qparams``  ``int8ify`` with weights quantized once (dynamic per-row activation scales);
* ``int8ify static``   the same with static activation scales (``quantize_params(activations="static")``);
* ``int8ify static+attn`` (models with matmuls between two activations) the attention einsums' activations static
  too (``int8ify(fn, activation_scales=calibrate_activation_dots(...))``);
* ``+smooth``          ``int8ify+qparams`` and ``int8ify static`` with SmoothQuant (``smooth_alpha=0.5``), whose dots
  multiply their activation by the stored reciprocal of its factors;
* ``int8ify fused``    (GPU) ``backend="int8-fused"``: each dot of a pre-quantized weight one Pallas kernel (dynamic
  scales; ``static`` and ``static+attn`` as above);
* ``float weights``    (GPU) ``int8ify`` and ``int8ify fused`` handed the float weights, quantized on every call (as
  in training);
* ``bare int8 dots``   only the model's int8 x int8 -> int32 dots.

GPU: the kernels the program launches (fusions, library calls) from XLA's real H200 compiler. TPU: the kernels,
the sum of XLA:TPU's ``estimated_cycles`` over them (its cost model, not a measured time) and whether every
rewritten dot runs on the int8 MXU (``vmatmul.s8`` in the final machine code). A second table reads the targets
off these counts (:func:`gpu_target_lines`, :func:`tpu_target_lines`): on the H200 at most bf16's kernels plus one
per int8 dot; on TPU at most the hand-written program's estimated cycles, and bf16's on v5e. Compile-only: no
timings. The programs are traced on this CPU machine for another platform, so int8ify gets ``late_inlining=False``
(what it chooses when traced on the accelerator itself).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.join(HERE, "..", "..", "shared", "tools")


def _tool(flag: str):
    """The deviceless compiler's ``compile`` function (imported before JAX, which it configures)."""
    if flag == "gpu":
        sys.path.insert(0, os.path.join(TOOLS, "gpu_compile"))
        from compile_sm90 import compile_for_gpu

        return lambda fn, *args: compile_for_gpu(fn, *args, spec="h200")
    sys.path.insert(0, os.path.join(TOOLS, "tpu_compile"))
    from compile_tpu import compile_for_tpu

    return lambda fn, *args, target="v5e": compile_for_tpu(fn, *args, target=target, llo=True)


def gpu_target_lines(kernels: dict, int8_dots: dict) -> list[str]:
    """The H200 target per model: each int8ify variant launches at most bf16's kernels plus one per int8 dot.

    Arguments:
        kernels: model -> variant -> kernels launched.
        int8_dots: model -> how many int8 dots its rewritten program has.

    Returns:
        Markdown table lines.
    """
    lines = ["| model | variant | kernels | bound: bf16 + one per int8 dot | holds |", "|---|---|---|---|---|"]
    for model, counts in kernels.items():
        bound = counts["bf16"] + int8_dots[model]
        for variant, count in counts.items():
            if variant.startswith("int8ify"):
                lines.append(f"| {model} | {variant} | {count} | {bound} | {'yes' if count <= bound else 'no'} |")
    return lines


def tpu_target_lines(cycles: dict) -> list[str]:
    """The TPU targets per model and chip: each int8ify variant's estimated cycles at most the hand-written
    program's, and on v5e at most bf16's too.

    Arguments:
        cycles: (model, target) -> variant -> summed estimated cycles.

    Returns:
        Markdown table lines.
    """
    lines = ["| model | target | variant | cycles / hand W8A8 | cycles / bf16 | cycles / bf16, f32 input | holds |",
             "|---|---|---|---|---|---|---|"]
    for (model, target), counts in cycles.items():
        for variant, count in counts.items():
            if not variant.startswith("int8ify"):
                continue
            to_hand, to_bf16 = count / counts["hand W8A8"], count / counts["bf16"]
            same_input = counts.get("bf16, f32 input")
            to_same_input = f"{count / same_input:.2f}" if same_input else "-"
            holds = to_hand <= 1 and (target != "v5e" or to_bf16 <= 1)
            lines.append(f"| {model} | {target} | {variant} | {to_hand:.2f} | {to_bf16:.2f} | {to_same_input} | "
                         f"{'yes' if holds else 'no'} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--gpu", action="store_const", const="gpu", dest="which")
    which.add_argument("--tpu", action="store_const", const="tpu", dest="which")
    parser.add_argument("--out", help="also write the table (Markdown) here")
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test of the script)")
    parser.add_argument("--models", nargs="+", choices=("mlp", "block"), default=("mlp", "block"),
                        help="which models")
    args = parser.parse_args(argv)
    compile_fn = _tool(args.which)

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import speed
    from harness import Report, environment, table, table_row
    from mlp import init_mlp, mlp

    from jaxpr_rewrite import calibrate_activation_dots, int8ify, quantize_params

    width, batch, d, seq, block_batch = (1024, 1024, 384, 128, 32) if not args.quick else (128, 64, 64, 16, 2)
    mlp_params = init_mlp(jax.random.PRNGKey(0), width, 4)
    mlp_x = jax.random.normal(jax.random.PRNGKey(1), (batch, width))
    block_params = speed.init_block(jax.random.PRNGKey(2), d=d, mlp_dim=4 * d)
    block_x = jax.random.normal(jax.random.PRNGKey(3), (block_batch, seq, d))

    def block(params, x):
        return speed.block(params, x, heads=d // 64)

    def hand_block(params, x):
        return speed.hand_block(params, x, heads=d // 64)

    to_bf16 = lambda tree: jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), tree)  # noqa: E731
    models = {
        f"MLP 4x{width}, batch {batch}": (
            mlp, mlp_params, mlp_x, speed.hand_mlp, speed.hand_mlp_weights(mlp_params)),
        f"transformer block d {d}, batch {block_batch}x{seq}": (
            block, block_params, block_x, hand_block,
            speed.hand_weights(block_params, ["wq", "wk", "wv", "wo", "w1", "w2"])),
    }
    targets = ["h200"] if args.which == "gpu" else ["v5e", "v6e"]
    report = Report(args.out)
    report.add(f"{environment()}; deviceless {args.which.upper()} compile", "")
    if args.which == "gpu":
        report.add(*table(["model", "variant", "kernels on H200", "GEMM fusions", "other kernels"]))
    else:
        report.add(*table(["model", "target", "variant", "kernels", "estimated cycles", "MXU dtypes of the dots"]))
    chosen = {key: name for key, name in zip(("mlp", "block"), models)}
    counted = {}  # GPU: model -> variant -> kernels; TPU: (model, target) -> variant -> estimated cycles
    int8_dots = {}
    for name, (model, params, x, hand_fn, hand_params) in models.items():
        if name not in (chosen[key] for key in args.models):
            continue
        qparams = quantize_params(model, params, x)
        static = quantize_params(model, params, x, activations="static")
        smoothed = {mode: quantize_params(model, params, x, smooth_alpha=0.5, activations=mode)
                    for mode in ("dynamic", "static")}
        bare, bare_args = speed.bare_dots(model, params, x, platform="cuda" if args.which == "gpu" else "tpu")
        int8_dots[name] = len(bare_args)
        on_accelerator = int8ify(model, late_inlining=False)
        variants = {
            "bf16": (model, (to_bf16(params), x.astype(jnp.bfloat16))),
            "bf16, f32 input": (lambda p, v, model=model: model(p, v.astype(jnp.bfloat16)), (to_bf16(params), x)),
            "hand W8A8": (hand_fn, (hand_params, x)),
            "int8ify+qparams": (on_accelerator, (qparams, x)),
            "int8ify static": (on_accelerator, (static, x)),
        }
        attention = calibrate_activation_dots(model, params, x)
        if attention.dots:
            variants["int8ify static+attn"] = (on_accelerator.with_options(activation_scales=attention), (static, x))
        variants["int8ify+qparams+smooth"] = (on_accelerator, (smoothed["dynamic"], x))
        variants["int8ify static+smooth"] = (on_accelerator, (smoothed["static"], x))
        if args.which == "gpu":  # the Pallas kernel runs on NVIDIA GPUs only (elsewhere the int8 programs above)
            fused = on_accelerator.with_options(backend="int8-fused")
            variants["int8ify fused"] = (fused, (qparams, x))
            variants["int8ify fused static"] = (fused, (static, x))
            if attention.dots:
                variants["int8ify fused static+attn"] = (fused.with_options(activation_scales=attention), (static, x))
            variants["int8ify, float weights"] = (on_accelerator, (params, x))
            variants["int8ify fused, float weights"] = (fused, (params, x))
        variants["bare int8 dots"] = (bare, (bare_args,))
        for target in targets:
            for variant, (fn, fn_args) in variants.items():
                if args.which == "gpu":
                    rows = compile_fn(fn, *fn_args).fusions()
                    gemms = sum(1 for r in rows if "gemm" in (r.get("backend_kind") or "")
                                or r.get("what") == "custom-call")
                    report.add(table_row([name, variant, len(rows), gemms, len(rows) - gemms]))
                    counted.setdefault(name, {})[variant] = len(rows)
                else:
                    result = compile_fn(fn, *fn_args, target=target)
                    rows = result.fusions()
                    cycles = sum(int(r.get("cycles") or 0) for r in rows)
                    from compile_tpu import llo_mxu_dtypes, llo_op_counts

                    mxu = sorted({llo_mxu_dtypes(llo_op_counts(text)) for text in result.llo.values()} - {""})
                    report.add(table_row([name, target, variant, len(rows), f"{cycles:,}", ", ".join(mxu)]))
                    counted.setdefault((name, target), {})[variant] = cycles
    report.add("", "Targets:", "",
               *(gpu_target_lines(counted, int8_dots) if args.which == "gpu" else tpu_target_lines(counted)))
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
