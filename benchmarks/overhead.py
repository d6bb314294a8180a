"""What int8ify costs before the first result: tracing, rewriting, compiling, and ``report``.

Usage::

    python benchmarks/overhead.py [--repeats 3]

Prints, each a median of ``--repeats`` runs on fresh function objects (so no JAX trace cache is reused):

* the rewrite of a 96-layer MLP (``Int8ified.rewritten_jaxpr``: trace + rewrite) against ``jax.make_jaxpr`` of
  the float program (target: at most 5x);
* the first call of a 24-layer Flax MLP (trace + rewrite + compile + run) under ``jax.jit(int8ify(f))`` against
  ``jax.jit(f)`` (target: at most 1.5x), beside the same first call of the MLP written by hand in W8A8 (weights and
  activations quantized per call with the plain ``absmax / 127`` formula): what any int8 program of this model
  costs XLA to compile, the floor under the target;
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
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from jaxpr_rewrite import int8ify, quantize_params
from jaxpr_rewrite import report  # noqa: E402
from speed import quantize_plain  # noqa: E402  (benchmarks/speed.py: the hand-written quantization)


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


def timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def median(fn, repeats: int) -> float:
    return statistics.median(timed(fn) for _ in range(repeats))


def flax_mlp(layers: int, width: int):
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(layers):
                x = nn.gelu(nn.Dense(width)(x))
            return x

    return MLP()


def hand_w8a8_flax_mlp(layers: int):
    """The Flax MLP's forward pass written by hand in W8A8: per-row activation and per-column weight scales,
    ``absmax / 127``, quantized on every call (as ``int8ify`` does without ``quantize_params``)."""
    def apply(variables, x):
        for i in range(layers):
            dense = variables["params"][f"Dense_{i}"]
            (xq, sx), (wq, sw) = quantize_plain(x, 1), quantize_plain(dense["kernel"], 0)
            acc = jax.lax.dot_general(xq, wq, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
            x = jax.nn.gelu(acc.astype(jnp.float32) * sx * sw + dense["bias"])
        return x

    return apply


def dispatch_us(params, x, repeats: int, calls: int = 5000) -> tuple[float, float]:
    """Microseconds per call ``jax.jit`` spends on ``params`` (as they are, then as a list of their leaves) in a
    program that ignores them, over the same call without them: medians of ``repeats`` interleaved rounds."""
    ignoring = jax.jit(lambda params, x: x * 2)

    def per_call(params) -> float:
        for _ in range(200):
            ignoring(params, x)
        start = time.perf_counter()
        for _ in range(calls):
            out = ignoring(params, x)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / calls * 1e6

    leaves = jax.tree_util.tree_leaves(params)
    rounds = []
    for _ in range(repeats):
        without = per_call(())
        rounds.append((per_call(params) - without, per_call(leaves) - without))
    return tuple(float(v) for v in np.median(np.array(rounds), axis=0))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    ns = parser.parse_args(argv)
    rows = []

    params, x = mlp_params(96, 256), jnp.ones((8, 256))
    trace = median(lambda: jax.make_jaxpr(fresh_mlp())(params, x), ns.repeats)
    rewrite = median(lambda: int8ify(fresh_mlp()).rewritten_jaxpr(params, x), ns.repeats)
    rows.append(("96-layer MLP: rewrite vs make_jaxpr", trace, rewrite, 5.0))

    try:
        model = flax_mlp(24, 256)
        variables = model.init(jax.random.PRNGKey(0), jnp.ones((8, 256)))
        x = jnp.ones((32, 256))
        float_first = median(lambda: jax.jit(lambda v, x: model.apply(v, x))(variables, x), ns.repeats)
        int8_first = median(lambda: jax.jit(int8ify(lambda v, x: model.apply(v, x)))(variables, x), ns.repeats)
        hand_first = median(lambda: jax.jit(hand_w8a8_flax_mlp(24))(variables, x), ns.repeats)
        rows.append(("24-layer Flax MLP: first call", float_first, int8_first, 1.5))
        rows.append(("  the same, hand-written W8A8 (the floor)", float_first, hand_first, None))
    except ImportError:
        print("flax not installed: first-call row skipped")

    params, x = mlp_params(8, 256), jnp.asarray(np.random.default_rng(1).normal(size=(32, 256)), jnp.float32)
    float_first = median(lambda: jax.jit(fresh_mlp())(params, x), ns.repeats)
    int8_first = median(lambda: jax.jit(int8ify(fresh_mlp()))(params, x), ns.repeats)
    report_time = median(lambda: report(fresh_mlp(), params, x).rows[0].error, ns.repeats)
    rows.append(("8-layer MLP: report vs float first call", float_first, report_time, 2.0))
    rows.append(("  report vs int8ify first call (the floor)", int8_first, report_time, None))

    params, x = mlp_params(4, 1024), jnp.asarray(np.random.default_rng(2).normal(size=(32, 1024)), jnp.float32)
    float_first = median(lambda: jax.jit(closing_over(fresh_mlp(), params))(x), ns.repeats)
    int8_first = median(lambda: jax.jit(int8ify(closing_over(fresh_mlp(), params)))(x), ns.repeats)
    rows.append(("4x1024 MLP, closed-over weights: first call", float_first, int8_first, 1.5))

    quantized = quantize_params(fresh_mlp(), params, x)
    quantized_us, list_us = dispatch_us(quantized, x, ns.repeats)

    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, median of {ns.repeats} runs on fresh functions")
    print(f"{'what':44s} {'base s':>9s} {'measured s':>10s} {'ratio':>7s} {'target':>7s}")
    for what, base, ours, target in rows:
        target = "" if target is None else f"{target:6.1f}x"
        print(f"{what:44s} {base:9.3f} {ours:10.3f} {ours / base:6.2f}x {target:>7s}")
    print(f"jit dispatch per call of the 4x1024 MLP's quantized params: {quantized_us:.1f} us; the same "
          f"{len(jax.tree_util.tree_leaves(quantized))} arrays as a list: {list_us:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
