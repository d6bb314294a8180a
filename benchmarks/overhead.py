"""What int8ify costs before the first result: tracing, rewriting, compiling, and ``report``.

Usage::

    python benchmarks/overhead.py [--repeats 3] [--dry-run] [--out FILE]

Prints, each a median of ``--repeats`` runs on fresh function objects (so no JAX trace cache is reused), the two
programs of each row interleaved (``benchmarks/harness.py``; ``--dry-run``: toy sizes, in seconds):

* the rewrite of a 96-layer MLP (``Int8ified.rewritten_jaxpr``: trace + rewrite) against ``jax.make_jaxpr`` of
  the float program (target: at most 5x);
* the first call of a 24-layer Flax MLP (trace + rewrite + compile + run) under ``jax.jit(int8ify(f))`` against
  ``jax.jit(f)`` (target: at most 1.5x), the same with the weights from ``quantize_params`` (target: at most 2x),
  beside the same first call of the MLP written by hand in W8A8 (activations, and weights per call or passed
  quantized, with the plain ``absmax / 127`` formula): what any int8 program of this model costs XLA to compile,
  the floors;
* ``report(f, *arrays)`` (one compiled measuring pass) against the float program's first call (target: under 2x)
  and against ``int8ify``'s first call: the measuring pass compiles the float and the int8 matmuls together, so
  the int8 program's own first call is its floor;
* the first call of a 4 x 1024 MLP that closes over its weights, ``jax.jit(int8ify(lambda x: mlp(params, x)))``,
  against the float closure's (target: at most 1.5x): int8ify quantizes the weights once when it traces the
  program, where XLA would fold their quantization at compile time (seconds per million weights);
* what ``jax.jit`` takes per call to dispatch the 4 x 1024 MLP's ``quantize_params`` output (four QuantizedArrays,
  the biases) to a program that ignores it, over the same call without it, beside the same arrays passed as a list:
  the flattening of the QuantizedArrays (microseconds; a serving loop at batch 1 pays it on every call).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import AsCalled, Report, environment, median_seconds, table, table_row, time_interleaved  # noqa: E402
from speed import quantize_plain  # noqa: E402  (benchmarks/speed.py: the hand-written quantization)

from jaxpr_rewrite import int8ify, quantize_params, report  # noqa: E402


class Sizes(NamedTuple):
    """The models' sizes: the layers of the MLP rewritten, of the Flax MLP and of the MLP ``report`` measures, the
    MLPs' width, the width of the MLP that closes over its weights, and the calls per dispatch sample."""

    rewrite_layers: int
    flax_layers: int
    report_layers: int
    width: int
    closed_width: int
    dispatch_calls: int


SIZES = Sizes(96, 24, 8, 256, 1024, 5000)
DRY_RUN_SIZES = Sizes(4, 2, 2, 64, 128, 50)  # the same steps in seconds: numbers that mean nothing


def mlp_params(layers: int, width: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), jnp.float32), jnp.zeros(width))
            for _ in range(layers)]


def fresh_mlp():
    """A new function object each time, so JAX's caches keyed on the function never hit."""

    def mlp(params, x):
        for w, b in params:
            x = jax.nn.gelu(x @ w + b)
        return x

    return mlp


def closing_over(fn, params):
    """``fn`` with its weights closed over (constants of its program), as ``lambda x: model.apply(params, x)``."""
    return lambda x: fn(params, x)


def flax_mlp(layers: int, width: int):
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(layers):
                x = nn.gelu(nn.Dense(width)(x))
            return x

    return MLP()


def hand_w8a8_flax_mlp(layers: int, weights_quantized: bool = False):
    """The Flax MLP's forward pass written by hand in W8A8: per-row activation and per-column weight scales,
    ``absmax / 127``, the weights quantized on every call (as ``int8ify`` does without ``quantize_params``) or,
    with ``weights_quantized``, passed as :func:`quantized_kernels`' ``(codes, scales)``."""
    def apply(variables, x):
        for i in range(layers):
            dense = variables["params"][f"Dense_{i}"]
            xq, sx = quantize_plain(x, 1)
            wq, sw = dense["kernel"] if weights_quantized else quantize_plain(dense["kernel"], 0)
            acc = jax.lax.dot_general(xq, wq, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
            x = jax.nn.gelu(acc.astype(jnp.float32) * sx * sw + dense["bias"])
        return x

    return apply


def quantized_kernels(variables):
    """The Flax MLP's variables with each kernel replaced by its plain ``(codes, scales)``."""
    params = {name: dict(dense, kernel=quantize_plain(dense["kernel"], 0))
              for name, dense in variables["params"].items()}
    return {"params": params}


def dispatch_us(params, x, repeats: int, calls: int) -> tuple[float, float]:
    """Microseconds per call ``jax.jit`` spends on ``params`` (as they are, then as a list of their leaves) in a
    program that ignores them, over the same call without them: medians of ``repeats`` interleaved rounds of
    ``calls`` calls each, through ``jax.jit``'s own dispatch (what is measured: not compiled ahead of time)."""
    ignoring = AsCalled(jax.jit(lambda params, x: x * 2))
    times = time_interleaved({"without": (ignoring, ((), x)), "params": (ignoring, (params, x)),
                              "leaves": (ignoring, (jax.tree_util.tree_leaves(params), x))},
                             rounds=repeats, reps=calls, warmup=200)
    return tuple(float((times[name] - times["without"]) * 1e3) for name in ("params", "leaves"))


def row(what: str, base: float, measured: float, target: float | None = None) -> str:
    """A table row: the two medians, their ratio and the target it is held to (none for a floor's row)."""
    return table_row([what, f"{base:.3f}", f"{measured:.3f}", f"{measured / base:.2f}x",
                      "" if target is None else f"{target:.1f}x"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true",
                        help="toy sizes: that the script runs, in seconds (its numbers mean nothing)")
    parser.add_argument("--out", help="also write the table (Markdown) here")
    ns = parser.parse_args(argv)
    sizes = DRY_RUN_SIZES if ns.dry_run else SIZES
    width = sizes.width
    out = Report(ns.out)
    out.add(environment(("flax",)), "", f"Median of {ns.repeats} runs on fresh functions, interleaved", "",
            *table(["what", "base s", "measured s", "ratio", "target"]))

    params, x = mlp_params(sizes.rewrite_layers, width), jnp.ones((8, width))
    seconds = median_seconds({"trace": lambda: jax.make_jaxpr(fresh_mlp())(params, x),
                              "rewrite": lambda: int8ify(fresh_mlp()).rewritten_jaxpr(params, x)}, ns.repeats)
    out.add(row(f"{sizes.rewrite_layers}-layer MLP: rewrite vs make_jaxpr", seconds["trace"], seconds["rewrite"], 5.0))

    try:
        model = flax_mlp(sizes.flax_layers, width)
    except ImportError:
        print("flax not installed: first-call row skipped")
    else:
        variables = model.init(jax.random.PRNGKey(0), jnp.ones((8, width)))
        x = jnp.ones((32, width))
        quantized = quantize_params(lambda v, x: model.apply(v, x), variables, x)
        hand_variables = quantized_kernels(variables)
        seconds = median_seconds({
            "float": lambda: jax.jit(lambda v, x: model.apply(v, x))(variables, x),
            "int8ify": lambda: jax.jit(int8ify(lambda v, x: model.apply(v, x)))(variables, x),
            "quantized": lambda: jax.jit(int8ify(lambda v, x: model.apply(v, x)))(quantized, x),
            "hand": lambda: jax.jit(hand_w8a8_flax_mlp(sizes.flax_layers))(variables, x),
            "hand quantized": lambda: jax.jit(hand_w8a8_flax_mlp(sizes.flax_layers, True))(hand_variables, x)},
            ns.repeats)
        out.add(row(f"{sizes.flax_layers}-layer Flax MLP: first call", seconds["float"], seconds["int8ify"], 1.5),
                row("  the same, weights from quantize_params", seconds["float"], seconds["quantized"], 2.0),
                row("  the same, hand-written W8A8 (the floor)", seconds["float"], seconds["hand"]),
                row("  the same, hand-written W8A8, weights quantized once", seconds["float"],
                    seconds["hand quantized"]))

    params = mlp_params(sizes.report_layers, width)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(32, width)), jnp.float32)
    seconds = median_seconds({"float": lambda: jax.jit(fresh_mlp())(params, x),
                              "int8ify": lambda: jax.jit(int8ify(fresh_mlp()))(params, x),
                              "report": lambda: report(fresh_mlp(), params, x).rows[0].error}, ns.repeats)
    out.add(row(f"{sizes.report_layers}-layer MLP: report vs float first call", seconds["float"], seconds["report"],
                2.0),
            row("  report vs int8ify first call (the floor)", seconds["int8ify"], seconds["report"]))

    closed = sizes.closed_width
    params, x = mlp_params(4, closed), jnp.asarray(np.random.default_rng(2).normal(size=(32, closed)), jnp.float32)
    seconds = median_seconds({"float": lambda: jax.jit(closing_over(fresh_mlp(), params))(x),
                              "int8ify": lambda: jax.jit(int8ify(closing_over(fresh_mlp(), params)))(x)}, ns.repeats)
    out.add(row(f"4x{closed} MLP, closed-over weights: first call", seconds["float"], seconds["int8ify"], 1.5))

    quantized = quantize_params(fresh_mlp(), params, x)
    quantized_us, list_us = dispatch_us(quantized, x, ns.repeats, sizes.dispatch_calls)
    out.add("", f"jit dispatch per call of the 4x{closed} MLP's quantized params: {quantized_us:.1f} us; the same "
                f"{len(jax.tree_util.tree_leaves(quantized))} arrays as a list: {list_us:.1f} us")
    out.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
