"""Candidate changes to the rewrite, each timed against int8ify's own program on this device, in pairs.

    python benchmarks/candidate_ab.py [--candidates layout powers] [--tokens 197 128] [--batch 128] [--pairs 4]
        [--quick] [--out FILE]

A candidate replaces one function of the rewrite while its program is traced and compiled. Each program is compiled
ahead of time (``jax.jit(f).lower(*args).compile()``) right after its form is set, and the executables are timed: a
``jax.jit`` function traced after ``jax.clear_caches()`` traces again once its compiled run is dropped, and then finds
the rewritten dots' shared programs as the last form traced them, so an A/B of two such functions times one program
twice (the nineteenth TPU run's A/Bs did; ``benchmarks/results/tpu-v5-lite.md``). The candidates, leads from that run:

* ``layout``: the float operands of batched int8 dots (attention's query, key, value and probabilities) constrained
  to a layout whose largest non-batch axis is minor (``jax.experimental.layout.with_layout_constraint``). At 197
  tokens (a ViT's) XLA:TPU writes those operands' int8 codes in the layout of their float input and relayouts them
  for the attention dot: 2.4 of the 4.8 ms of the transformer block below on a v5e chip. Read across runs, the
  constrained block took 3.0 ms there.
* ``powers``: the epilogue without its two power-of-two multiplies, a bound on what storing weights without their
  unit powers could win (not range-safe; on CPU not the contract's rounding either, as XLA:CPU then fuses the last
  multiply with the next add). Read across runs, 1.20 ms against 1.35 for the block at 128 tokens on the chip.

The model: the transformer block of ``benchmarks/speed.py`` at d 384, with weights quantized once (dynamic scales) and
with static scales, attention's too, at each ``--tokens``. Each row gives both programs' medians, the candidate's
time over int8ify's in each pair (orders alternating), whether the outputs are the same bits, whether the candidate's
optimized HLO is another program than int8ify's (else the A/B timed one program twice), and the copies of int8 codes
in each. ``benchmarks/device_check.py`` runs it in its ``candidates`` step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from jaxpr_rewrite import calibrate_activation_dots, int8ify, quantize_params  # noqa: E402
from jaxpr_rewrite import int8_dot  # noqa: E402
from speed import block, init_block, time_interleaved  # noqa: E402

TABLE_HEADER = ["| program | int8ify, ms | candidate, ms | candidate / int8ify (pairs) | same bits | another program "
                "| int8 copies |", "|---|---|---|---|---|---|---|"]


def _largest_axis_minor(x, batch_axes):
    """``x`` constrained to a layout with its batch axes major and its other axes by size, the largest minor."""
    rest = sorted((axis for axis in range(x.ndim) if axis not in batch_axes), key=lambda axis: x.shape[axis])
    order = (*batch_axes, *rest)
    if order == tuple(range(x.ndim)):
        return x
    return with_layout_constraint(x, Layout(major_to_minor=order))


def _layout_form(original):
    def scaled_int8_dot(lhs, rhs, dimension_numbers, *args, **kwargs):
        _, (lhs_batch, rhs_batch) = dimension_numbers

        def placed(x, batch_axes):
            # (a pre-quantized weight is no jax.Array: it keeps its stored layout)
            floating = isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
            if not batch_axes or not floating or x.ndim < 3:
                return x
            return _largest_axis_minor(x, tuple(batch_axes))

        return original(placed(lhs, lhs_batch), placed(rhs, rhs_batch), dimension_numbers, *args, **kwargs)

    return scaled_int8_dot


def _without_powers(acc, lhs, rhs):
    (f_lhs, _), (f_rhs, _) = lhs, rhs
    return lax.mul(lax.mul(acc, f_rhs), f_lhs)


# name -> (the function of jaxpr_rewrite.int8_dot it replaces, the replacement built from the original)
CANDIDATES = {
    "layout": ("_scaled_int8_dot", _layout_form),
    "powers": ("scale_product", lambda original: _without_powers),
}


def compiled(fn, args, options: dict, candidate: str | None = None):
    """``int8ify(fn, **options)`` compiled ahead of time for ``args``, with ``candidate``'s replacement in place
    while it is traced and compiled (a fresh wrapper each time: ``int8ify(fn)`` of one ``fn`` is cached). The caches
    are cleared before each trace and after a candidate's, so no program reads another form's dot programs."""
    if candidate is None:
        jax.clear_caches()
        return jax.jit(int8ify(lambda *a: fn(*a), late_inlining=False, **options)).lower(*args).compile()
    name, replacement = CANDIDATES[candidate]
    original = getattr(int8_dot, name)
    setattr(int8_dot, name, replacement(original))
    try:
        return compiled(fn, args, options)
    finally:
        setattr(int8_dot, name, original)
        jax.clear_caches()


def int8_copies(hlo: str) -> int:
    """The copies of int8 arrays in an optimized HLO's text (relayouts of codes)."""
    return sum(" = s8[" in line and " copy(" in line for line in hlo.splitlines())


def candidate_rows(candidates, tokens, batch: int, pairs: int, rounds: int, reps: int, d: int = 384):
    """The table's rows (Markdown): each candidate against int8ify's program for the block at each token count,
    with dynamic scales and with static scales (attention's too)."""
    params = init_block(jax.random.PRNGKey(2), d=d, mlp_dim=4 * d)

    def model(p, v):
        return block(p, v, heads=d // 64)

    for n_tokens in tokens:
        x = jax.random.normal(jax.random.PRNGKey(3), (batch, n_tokens, d))
        attention = calibrate_activation_dots(model, params, x)
        static = quantize_params(model, params, x, activations="static", calibration=[(x,)])
        modes = {"qparams": ((quantize_params(model, params, x), x), {}),
                 "static + attention": ((static, x), {"activation_scales": attention})}
        for mode, (args, options) in modes.items():
            base = compiled(model, args, options)  # int8ify's program, once for every candidate
            base_out, base_hlo = np.asarray(base(*args)), base.as_text()
            for candidate in candidates:
                new = compiled(model, args, options, candidate)
                same = np.array_equal(base_out, np.asarray(new(*args)), equal_nan=True)
                ratios, times = [], []
                for i in range(pairs):
                    order = [("int8ify", (base, args)), ("candidate", (new, args))]
                    t = time_interleaved(dict(order if i % 2 == 0 else order[::-1]), rounds=rounds, reps=reps)
                    ratios.append(t["candidate"] / t["int8ify"])
                    times.append((t["int8ify"], t["candidate"]))
                label = f"block d {d}, {batch} x {n_tokens} tokens, {mode}: {candidate}"
                yield (f"| {label} | {np.median([a for a, _ in times]):.3f} | {np.median([b for _, b in times]):.3f} "
                       f"| {min(ratios):.3f}-{max(ratios):.3f} | {same} | {base_hlo != new.as_text()} "
                       f"| {int8_copies(base_hlo)} / {int8_copies(new.as_text())} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", nargs="+", choices=sorted(CANDIDATES), default=sorted(CANDIDATES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[197, 128])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a small block, one pair of one round")
    parser.add_argument("--out", type=Path, help="also write the table here")
    ns = parser.parse_args(argv)
    batch, tokens, pairs, rounds, reps = ((2, [20], 1, 1, 1) if ns.quick else
                                          (ns.batch, ns.tokens, ns.pairs, 10, 5))
    lines = [f"{jax.devices()[0].device_kind}, JAX {jax.__version__}", "", *TABLE_HEADER]
    print("\n".join(lines), flush=True)
    for row in candidate_rows(ns.candidates, tokens, batch, pairs, rounds, reps):
        lines.append(row)
        print(row, flush=True)
    if ns.out:
        ns.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
