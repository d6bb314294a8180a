"""Speed, memory, compile time and error of int8ify against float32 and hand-written int8, in one process.

    python benchmarks/speed.py [--quick | --dry-run] [--out benchmarks/results/speed.md] [--plot PNG|none]

Models: a 4 x Dense(1024) + gelu MLP, and a pre-LN transformer block (d=256, 4 heads, mlp 1024, seq 32),
each at batch 1, 16 and 256 (``--dry-run``: toy sizes, one round). Variants, each compiled ahead of time and timed
interleaved (medians after warm-up; ``benchmarks/harness.py``):

* ``float32``          the model as written;
* ``int8ify``          ``jit(int8ify(model))``: weights and activations quantized on every call;
* ``int8ify+qparams``  weights quantized once by ``quantize_params``, activations per call;
* ``hand W8A8``        the same int8 program written by hand (~15 lines), weights pre-quantized;
* ``bare int8 dots``   only the model's int8 x int8 -> int32 dots, no quantization or epilogue.

Speed is reported as float32 time / variant time (higher is faster), and each time as a multiple of the bare
int8 dots' (what bounds every int8 variant on this machine; the header names the CPU and whether it has AMX-INT8,
so that tables from different machines compare). Also: parameter bytes of the
quantized weights vs float32, trace + rewrite + compile time of a 48-layer MLP vs plain ``jit``, and the
relative Frobenius error of each variant's output against float32.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# the examples' models, and the package itself where it is not installed (a checkout on an accelerator machine)
HERE = os.path.dirname(__file__)
sys.path[:0] = [os.path.join(HERE, "..", "examples"), os.path.join(HERE, "..")]

from harness import (Report, compile_ahead, environment, median_seconds, speedups, table, table_row,  # noqa: E402
                     time_interleaved)

from jaxpr_rewrite import default_platform, dot_eqns, int8ify, quantize, quantize_params  # noqa: E402
from jaxpr_rewrite.plotting import bar_chart, new_figure, save  # noqa: E402

# -- models ---------------------------------------------------------------------------------------------
from mlp import init_mlp, mlp  # noqa: E402  (examples/mlp.py: Dense + gelu layers)


def init_block(key, d=256, mlp_dim=1024):
    k = jax.random.split(key, 6)
    dense = lambda key, i, o: jax.random.normal(key, (i, o)) * np.sqrt(1 / i)  # noqa: E731
    return {
        "wq": dense(k[0], d, d), "wk": dense(k[1], d, d), "wv": dense(k[2], d, d), "wo": dense(k[3], d, d),
        "w1": dense(k[4], d, mlp_dim), "w2": dense(k[5], mlp_dim, d),
        "ln1": jnp.ones(d), "ln2": jnp.ones(d),
    }


def layer_norm(x, g):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + 1e-6) * g


def block(params, x, heads=4):
    b, t, d = x.shape
    h = layer_norm(x, params["ln1"])
    split = lambda y: y.reshape(b, t, heads, d // heads)  # noqa: E731
    q, k, v = split(h @ params["wq"]), split(h @ params["wk"]), split(h @ params["wv"])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
    attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, d)
    x = x + attn @ params["wo"]
    h = layer_norm(x, params["ln2"])
    return x + jax.nn.gelu(h @ params["w1"]) @ params["w2"]


# -- hand-written W8A8 and bare int8 dots -------------------------------------------------------------------
def quantize_plain(x, axis):
    """The plain per-channel quantization over ``axis``, written out by hand: ``(codes, scales)``, the scales
    keeping ``axis`` with size 1."""
    s = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / 127
    s = jnp.where(s == 0, 1.0, s)
    return jnp.clip(jnp.round(x / s), -127, 127).astype(jnp.int8), s


def hand_dense(x, qw):
    xq, sx = quantize_plain(x, -1)
    acc = lax.dot_general(xq, qw["codes"], (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * sx * qw["scales"]


def hand_weights(params, names):
    out = dict(params)
    for n in names:
        q = quantize(params[n], (0,))
        out[n] = {"codes": q.codes, "scales": q.scale_values()}
    return out


def hand_mlp_weights(params):
    """The hand-written MLP's weights (:func:`hand_mlp`): each layer's ``w`` quantized, its bias as it is."""
    return [hand_weights(layer, ["w"]) for layer in params]


def hand_mlp(qparams, x):
    for i, layer in enumerate(qparams):
        x = hand_dense(x, layer["w"]) + layer["b"]
        if i < len(qparams) - 1:
            x = jax.nn.gelu(x)
    return x


def hand_int8_einsum(spec, a, b, a_axis, b_axis):
    """An einsum of two activations, each quantized over its contracted axis."""
    aq, sa = quantize_plain(a, a_axis)
    bq, sb = quantize_plain(b, b_axis)
    acc = jnp.einsum(spec, aq, bq, preferred_element_type=jnp.int32).astype(jnp.float32)
    return acc * jnp.einsum(spec, sa, sb)  # scales have size 1 along the contraction: an outer product


def hand_block(qp, x, heads=4):
    b, t, d = x.shape
    h = layer_norm(x, qp["ln1"])
    split = lambda y: y.reshape(b, t, heads, d // heads)  # noqa: E731
    q, k, v = split(hand_dense(h, qp["wq"])), split(hand_dense(h, qp["wk"])), split(hand_dense(h, qp["wv"]))
    scores = hand_int8_einsum("bqhd,bkhd->bhqk", q, k, -1, -1) / np.sqrt(d // heads)
    attn = hand_int8_einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v, -1, 1).reshape(b, t, d)
    x = x + hand_dense(attn, qp["wo"])
    h = layer_norm(x, qp["ln2"])
    return x + hand_dense(jax.nn.gelu(hand_dense(h, qp["w1"])), qp["w2"])


def bare_dots(program_fn, *args, platform=None):
    """The int8 dots of ``program_fn``'s int8ify'd program alone, as ``platform`` (default: this machine's) runs
    it, fed int8 inputs of the right shapes."""
    dots = [
        (e.invars[0].aval.shape, e.invars[1].aval.shape, e.params["dimension_numbers"])
        for e in dot_eqns(jax.make_jaxpr(int8ify(program_fn))(*args), platform=platform or default_platform())
        if e.invars[0].aval.dtype == jnp.int8
    ]
    operands = [(jnp.ones(a, jnp.int8), jnp.ones(b, jnp.int8)) for a, b, _ in dots]
    dims = [d for _, _, d in dots]

    def run(operands):
        # the operands are int8 arrays made above; the linter cannot see their dtype through the list
        return [
            lax.dot_general(a, b, d, preferred_element_type=jnp.int32)  # noqa: JX101
            for (a, b), d in zip(operands, dims)
        ]

    return jax.jit(run), operands


# -- timing ---------------------------------------------------------------------------------------------------
def rel_error(a, b) -> float:
    """The relative Frobenius error of ``a`` against the reference ``b``."""
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


class Sizes(NamedTuple):
    """The models' sizes: the MLP's width, the transformer block's width, MLP width and tokens, the batches, and the
    layers and width of the MLP whose compile time is measured."""

    mlp_width: int
    block_width: int
    block_mlp_width: int
    block_tokens: int
    batches: tuple
    compile_layers: int
    compile_width: int


SIZES = Sizes(1024, 256, 1024, 32, (1, 16, 256), 48, 256)
DRY_RUN_SIZES = Sizes(64, 32, 128, 8, (8,), 6, 64)  # the same steps in seconds: numbers that mean nothing


def bench_model(name, model, params, x, hand_fn, hand_params, rounds, reps) -> list[tuple]:
    """The rows of one model at one batch: ``(model, batch, variant, ms, speed vs float32, x bare int8 dots, relative
    error vs float32)`` per variant, the variants timed interleaved and each error read off the timed program."""
    wrapped = int8ify(model)
    bare, bare_args = bare_dots(model, params, x)
    variants = compile_ahead({
        "float32": (model, (params, x)),
        "int8ify": (wrapped, (params, x)),
        "int8ify+qparams": (wrapped, (quantize_params(model, params, x), x)),
        "hand W8A8": (hand_fn, (hand_params, x)),
        "bare int8 dots": (bare, (bare_args,)),
    })
    times = time_interleaved(variants, rounds, reps)
    speeds = speedups(times, "float32")
    reference = variants["float32"][0](params, x)
    errors = {variant: rel_error(fn(*args), reference) for variant, (fn, args) in variants.items()
              if variant != "bare int8 dots"}
    return [(name, x.shape[0], variant, ms, speeds[variant], ms / times["bare int8 dots"],
             errors.get(variant, float("nan"))) for variant, ms in times.items()]


def compile_times(layers: int, width: int) -> dict[str, float]:
    """Seconds to trace, rewrite and compile an MLP of ``layers`` x ``width`` under ``jax.jit(int8ify(...))`` against
    plain ``jax.jit``, with float weights and with weights quantized once, and what ``quantize_params`` takes."""
    params = init_mlp(jax.random.PRNGKey(5), width, layers)
    x = jnp.ones((8, width))
    quantized = jax.block_until_ready(quantize_params(mlp, params, x))
    # each once: a second compile of the same program would find JAX's caches
    return median_seconds({
        "jit(float32)": lambda: jax.jit(mlp).lower(params, x).compile(),
        "jit(int8ify): trace + rewrite + compile": lambda: jax.jit(int8ify(mlp)).lower(params, x).compile(),
        "quantize_params (preparation)": lambda: quantize_params(mlp, params, x),
        "jit(int8ify) with qparams: trace + rewrite + compile":
            lambda: jax.jit(int8ify(mlp)).lower(quantized, x).compile(),
    }, rounds=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--dry-run", action="store_true",
                        help="toy sizes and one round: that the script runs, in seconds (its numbers mean nothing)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "speed.md"))
    parser.add_argument("--plot", help="bar chart of the speed ratios (default: beside --out, .png; 'none' to skip)")
    args = parser.parse_args(argv)
    rounds, reps = (1, 1) if args.dry_run else (3, 2) if args.quick else (9, 5)
    sizes = DRY_RUN_SIZES if args.dry_run else SIZES

    report = Report(args.out)
    report.add(environment(), "", *table(["model", "batch", "variant", "ms", "speed vs float32", "x bare int8 dots",
                                          "rel. error vs float32"]))
    ratios = []
    key = jax.random.PRNGKey(0)
    mlp_params = init_mlp(key, sizes.mlp_width, 4)
    mlp_hand = hand_mlp_weights(mlp_params)
    blk_params = init_block(key, d=sizes.block_width, mlp_dim=sizes.block_mlp_width)
    blk_hand = hand_weights(blk_params, ["wq", "wk", "wv", "wo", "w1", "w2"])
    for batch in sizes.batches:
        x = jax.random.normal(jax.random.PRNGKey(batch), (batch, sizes.mlp_width))
        rows = bench_model(f"MLP 4x{sizes.mlp_width}", mlp, mlp_params, x, hand_mlp, mlp_hand, rounds, reps)
        xb = jax.random.normal(jax.random.PRNGKey(batch), (batch, sizes.block_tokens, sizes.block_width))
        rows += bench_model("transformer block", block, blk_params, xb, hand_block, blk_hand, rounds, max(1, reps // 2))
        for model, b, variant, ms, speed, over_bare, err in rows:
            report.add(table_row([model, b, variant, f"{ms:.3f}", f"{speed:.2f}x", f"{over_bare:.2f}", f"{err:.2e}"]))
            ratios.append((f"{model}, batch {b}: {variant}", speed, variant))
        report.save()  # each finished batch kept, should a later one not finish

    q = quantize_params(mlp, mlp_params, jnp.ones((1, sizes.mlp_width)))
    float_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(mlp_params))
    q_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(q))
    ratio = q_bytes / float_bytes
    seconds = compile_times(sizes.compile_layers, sizes.compile_width)
    report.add("", f"MLP parameter bytes: float32 {float_bytes:,}, quantized {q_bytes:,} ({ratio:.3f}x)", "",
               *table([f"{sizes.compile_layers}-layer MLP (width {sizes.compile_width})", "seconds"],
                      [(what, f"{time_:.2f}") for what, time_ in seconds.items()]))
    report.save()
    plot_path = args.plot or os.path.splitext(args.out)[0] + ".png"
    if plot_path != "none":
        print(f"saved the chart to {plot_ratios(ratios, plot_path)}")
    return 0


VARIANT_COLORS = {"float32": "#888888", "int8ify": "#8fb3e0", "int8ify+qparams": "#3b6fb6", "hand W8A8": "#e08a2c",
                  "bare int8 dots": "#5a9e4b"}


def plot_ratios(ratios, path):
    """One bar per (model, batch, variant): speed vs float32, coloured by variant."""
    fig, (ax,) = new_figure(width=max(8.0, 0.3 * len(ratios) + 2), height=5)
    bar_chart(ax, [label for label, _, _ in ratios], [speed for _, speed, _ in ratios],
              [VARIANT_COLORS.get(variant, "#444444") for _, _, variant in ratios],
              title=f"speed vs float32 (higher is faster), JAX {jax.__version__}, {jax.devices()[0].device_kind}",
              ylabel="float32 time / variant time", legend=VARIANT_COLORS)
    ax.axhline(1.0, color="black", linewidth=0.8)
    return save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
