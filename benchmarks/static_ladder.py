"""What each step from the floor to int8ify's static-scale program costs: the MLP of ``benchmarks/peers.py`` written
by hand as a ladder of programs, each one step more of what int8ify's program computes per layer, timed interleaved
beside int8ify's program itself.

Usage::

    python benchmarks/static_ladder.py                       # the MLP 4 x 1024 at batch 256 and 32
    python benchmarks/static_ladder.py --width 4096 --batches 4096 1024    # on an accelerator

The programs, from the floor up (each step keeps those before it):

* ``floor``: ``peers.floor_program``, the int8 dots with the model's own bias and gelu, the next input a cast;
* ``one factor``: the codes of a static scale, ``int8(clip(round(y * (1 / s))))``, and the epilogue one multiply of
  the int32 sums by a per-column factor (the weight's scale times the activation's);
* ``the contract's order``: the sums times the weight's scale, then times the activation's (two multiplies, as
  ``y = a * s_x * s_w`` is rounded);
* ``a row factor``: the activation's scale a per-row array (int8ify's, where a row holding NaN or Inf makes the
  scale NaN);
* ``powers of two``: the range-safe epilogue's two more multiplies, by the weight's and the activation's powers;
* ``NaN rows``: a per-row check over the values (a sum of ``y - y``, NaN where one is NaN or Inf) feeds the next
  layer's row factor, so that a row holding NaN or Inf gives NaN outputs;
* ``NaN codes``: a value that is NaN or Inf gets the code -128, clipped and marked before the rounding as int8ify
  does on CPU and GPU: int8ify's program there, written by hand (on TPU, whose row check never reads the codes,
  int8ify's matrix codes are unmarked, as ``NaN rows``' are);
* ``int8ify static``: ``int8ify`` with ``quantize_params(..., activations="static")``.

Each program's outputs are compared with int8ify's (the relative error printed): from the contract's order on, every
one gives int8ify's outputs bit for bit (``tests/test_benchmarks.py``); ``one factor`` rounds its epilogue otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..")]

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from peers import LAYERS, calibration_batches, flax_mlp, floor_program, layers  # noqa: E402
from speed import cpu_model, rel_error, time_interleaved  # noqa: E402

from jaxpr_rewrite import int8ify, quantize_params  # noqa: E402
from jaxpr_rewrite._quantized.array import is_quantized  # noqa: E402

RUNGS = ("one factor", "the contract's order", "a row factor", "powers of two", "NaN rows", "NaN codes")


def stored_layers(static):
    """Per layer ``(codes, weight factor, weight power, activation scale, bias)`` from int8ify's static params."""
    found = []
    for layer in layers(static):
        kernel = layer["kernel"]
        assert is_quantized(kernel), "a static layer's kernel is a QuantizedArray"
        found.append((kernel.codes, kernel.epilogue_factor.reshape(-1), kernel.epilogue_power.reshape(-1),
                      kernel.activation_scale, layer["bias"]))
    return found


def ladder_program(rung: str):
    """The hand-written static program up to ``rung`` (one of :data:`RUNGS`), reading int8ify's stored scales: the
    activation's ``(absmax, reciprocal, factor, power)`` and the weight's factor and power per column."""
    level = RUNGS.index(rung)
    marks, checks = level >= RUNGS.index("NaN codes"), level >= RUNGS.index("NaN rows")

    def codes_of(y, reciprocal):
        if marks:  # int8ify's order: clipped and marked, then rounded (the rounding the conversion's operand)
            return jnp.round(jnp.where(jnp.isfinite(y), jnp.clip(y * reciprocal, -127, 127), -128)).astype(jnp.int8)
        return jnp.clip(jnp.round(y * reciprocal), -127, 127).astype(jnp.int8)

    def row_factors(y, factor):
        # the activation's factor per row, NaN for a row holding NaN or Inf (int8ify's sum on TPU)
        return jnp.sum(y - y, axis=1) + factor if checks else jnp.full(y.shape[:1], factor)

    def run(x, stored):
        _, reciprocal, factor, _ = stored[0][3]
        codes, rows = codes_of(x, reciprocal), row_factors(x, factor)
        for i, (w, weight_factor, weight_power, activation, bias) in enumerate(stored):
            _, _, factor, power = activation
            acc = lax.dot_general(codes, w, (((1,), (0,)), ((), ())),  # noqa: JX101 (int8 codes, int32 sums)
                                  preferred_element_type=jnp.int32).astype(jnp.float32)
            if level == RUNGS.index("one factor"):
                y = acc * (weight_factor * factor)[None, :]
            elif level == RUNGS.index("the contract's order"):
                y = acc * weight_factor[None, :] * factor
            else:
                y = acc * weight_factor[None, :] * rows[:, None]
            if level >= RUNGS.index("powers of two"):
                y = y * weight_power[None, :] * power
            y = y + bias
            if i < LAYERS - 1:
                y = nn.gelu(y)
                _, reciprocal, factor, _ = stored[i + 1][3]
                codes, rows = codes_of(y, reciprocal), row_factors(y, factor)
        return y

    return jax.jit(run)


TABLE_HEADER = ["| batch | program | ms | x floor | x int8ify static | rel. error vs int8ify |",
                "|---|---|---|---|---|---|"]


def ladder_rows(width: int, batches, rounds: int, reps: int):
    """The table's rows (Markdown), one batch at a time: the floor, each step of :data:`RUNGS` and int8ify's static
    program, timed interleaved, with each one's time over the floor's and over int8ify's, and its outputs' relative
    error to int8ify's."""
    model, params = flax_mlp(width)
    for batch in batches:
        x = jax.random.normal(jax.random.PRNGKey(batch), (batch, width))
        static = quantize_params(model.apply, params, x, activations="static",
                                 calibration=calibration_batches(batch, width))
        stored = stored_layers(static)
        (floor, floor_args), _ = floor_program(params, x)
        variants = {"floor": (floor, floor_args)}
        variants.update({rung: (ladder_program(rung), (x, stored)) for rung in RUNGS})
        variants["int8ify static"] = (jax.jit(int8ify(model.apply)), (static, x))
        times = time_interleaved(variants, rounds, reps)
        reference = variants["int8ify static"][0](static, x)
        for name, ms in times.items():
            fn, fn_args = variants[name]
            error = "" if name == "floor" else f"{rel_error(fn(*fn_args), reference):.1e}"
            yield (f"| {batch} | {name} | {ms:.3f} | {ms / times['floor']:.2f} | {ms / times['int8ify static']:.2f} | "
                   f"{error} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 32])
    parser.add_argument("--quick", action="store_true", help="few rounds (a smoke run)")
    parser.add_argument("--out", help="also write the table (Markdown) here")
    args = parser.parse_args(argv)
    rounds, reps = (3, 2) if args.quick else (25, 5)
    device = "" if jax.default_backend() == "cpu" else f"device: {jax.devices()[0].device_kind}; "
    lines = [f"{device}CPU: {cpu_model()}, {os.cpu_count()} cores; JAX {jax.__version__}", "",
             f"Flax MLP {LAYERS} x Dense({args.width}) + gelu, static activation scales; ms per call (median of "
             f"{rounds} interleaved rounds of {reps} calls)", "", *TABLE_HEADER]
    print("\n".join(lines), flush=True)
    for line in ladder_rows(args.width, args.batches, rounds, reps):
        lines.append(line)
        print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
