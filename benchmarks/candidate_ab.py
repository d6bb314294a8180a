"""Candidate changes to the rewrite, each timed against int8ify's own program on this device, in pairs.

    python benchmarks/candidate_ab.py [--candidates NAME ...] [--tokens 197 128 77 50] [--batch 128] [--d 384]
        [--head-dim 64] [--model block|mlp] [--pairs 4] [--quick] [--out FILE]

A candidate replaces one function of the rewrite while its program is traced and compiled. Each program is compiled
ahead of time (``jax.jit(f).lower(*args).compile()``) right after its form is set, and the executables are timed: a
``jax.jit`` function traced after ``jax.clear_caches()`` traces again once its compiled run is dropped, and then finds
the rewritten dots' shared programs as the last form traced them, so an A/B of two such functions times one program
twice (the nineteenth TPU run's A/Bs did; ``benchmarks/results/tpu-v5-lite.md``). The candidates:

* ``xla-layouts``: the dots' float operands in the layouts XLA chooses, as before
  :mod:`jaxpr_rewrite._platforms.tpu_layout` (``laid_out_for_tpu`` an identity): the A/B of that rule, which a CPU or GPU
  program does not see (the same program there). At 197 tokens (a ViT's) XLA:TPU wrote the int8 codes of
  attention's query, key and value, and of its output, in the layout of their float input and relayouted them for
  the int8 dot: 2.4 of the 4.8 ms of the transformer block below on a v5e chip (the nineteenth run). In the twentieth
  two forms of the rule as candidates (``with_layout_constraint`` on batched dots' operands, then on unbatched ones'
  too) took 0.60x and 0.53x of that program's time at 197 tokens and 0.55x and 0.52x at 77, and 1.004-1.012x at 128,
  where XLA made no copy.
* ``powers``: the epilogue without its two power-of-two multiplies, a bound on what storing weights without their
  unit powers could win (not range-safe; on CPU not the contract's rounding either, as XLA:CPU then fuses the last
  multiply with the next add). In the twentieth run, with weights quantized once: 0.90x at 128 tokens, 0.95x at 77,
  0.98x at 197, the same bits; 0.98x with static scales.
* ``unit-powers``: the part of that bound a stored format could take, exactly: each pre-quantized weight's powers of
  two, and each static activation scale's, known to be 1 (constants of the program, which XLA folds), as every
  weight and calibration of ordinary range has them; a dynamic activation keeps its power. (On CPU a dot of a weight
  and a static scale then ends its epilogue in a factor that is no power of two, which XLA:CPU fuses with the next
  add: the same bits there would need one power kept.) In the twenty-first run: 0.99-1.00x at 128 and 77 tokens with
  weights quantized once (the bound's 10% is the activations' powers), 0.97-0.98x with static scales (the bound's
  whole gain there), the same bits.
* ``no-row-power`` and ``one-row-power``: where the bound's 10% lies with dynamic scales, each a bound too: the left
  operand's per-row power of two dropped, or made one power for the whole operand (its largest: not range-safe
  either; the right operand's powers kept). In the twenty-first run 0.90x and 0.93-0.97x at 128 and 77 tokens.
* ``marked-codes``: the previous program of an MLP with static scales on TPU, whose codes marked NaN and Inf with
  -128 (:func:`jaxpr_rewrite._numerics.quantize.marked_codes`) where the slice's NaN check, a sum over the values, never reads
  them (now :func:`jaxpr_rewrite._numerics.quantize.saturated_codes`). In the twenty-first run it took 1.016-1.022x the time of
  the MLP at d 4096 and batch 4096.

The model: the transformer block of ``benchmarks/speed.py`` at d 384 (``--d``; heads of 64 features, ``--head-dim``),
with weights quantized once (dynamic scales) and with static scales, attention's too, at each ``--tokens``; or
(``--model mlp``) the MLP of ``examples/mlp.py``, 4 layers of width ``--d`` at ``--batch``. Each row
gives the medians of bf16's program (timed in the same rounds, for scale) and both programs, the candidate's time over
int8ify's in each pair (orders alternating), whether the outputs are the same bits, whether the candidate's optimized
HLO is another program than int8ify's (else the A/B timed one program twice), and the copies of int8 codes in each.
``benchmarks/device_check.py`` runs it in its ``candidates`` step.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

from jaxpr_rewrite import calibrate_activation_dots, int8ify, quantize_params  # noqa: E402
from jaxpr_rewrite._backends import int8 as int8_backend
from jaxpr_rewrite._dots import int8_dot
from jaxpr_rewrite._numerics import static_scales  # noqa: E402
from jaxpr_rewrite._numerics.quantize import marked_codes  # noqa: E402
from jaxpr_rewrite._numerics.static_scales import StaticScale  # noqa: E402
from mlp import init_mlp, mlp  # noqa: E402
from speed import block, cast_floats, init_block, time_interleaved  # noqa: E402

TABLE_HEADER = ["| program | bf16, ms | int8ify, ms | candidate, ms | candidate / int8ify (pairs) | same bits "
                "| another program | int8 copies |", "|---|---|---|---|---|---|---|---|"]


def _as_xla_lays_it_out(operand, batch_axes, contracting_axes):
    return operand


def _without_powers(acc, lhs, rhs):
    (f_lhs, _), (f_rhs, _) = lhs, rhs
    return lax.mul(lax.mul(acc, f_rhs), f_lhs)


def _with_unit_weight_powers(original):
    def as_dots_read_it(x):
        x = original(x)
        if getattr(x, "epilogue_power", None) is None:
            return x
        return x.replace(epilogue_power=jnp.ones(x.epilogue_power.shape, x.epilogue_power.dtype))
    return as_dots_read_it


def _with_unit_static_power(original):
    def stored_in(vector):
        scale = original(vector)
        return scale._replace(power=jnp.ones((), jnp.result_type(scale.power)))
    return stored_in


def _lhs_power_as(reduce):
    """A replacement of ``int8_dot._scaled`` whose left operand's power of two is ``reduce(power)``: ``None`` drops it,
    a reduction to one value makes it one power for the whole operand."""
    def scaled(acc, operands, placements):
        (lhs_q, rhs_q), (place_lhs, place_rhs) = operands, placements
        f_lhs, g_lhs = lhs_q.epilogue_factors(acc.dtype)
        lhs = (place_lhs(f_lhs), None if reduce is None else lax.broadcast(reduce(g_lhs), acc.shape))
        rhs = tuple(place_rhs(factor) for factor in rhs_q.epilogue_factors(acc.dtype))
        out = lax.mul(lax.mul(acc, rhs[0]), lhs[0])
        out = lax.mul(out, rhs[1])
        return out if lhs[1] is None else lax.mul(out, lhs[1])
    return scaled


def _marked(quotients):
    # marked where the quotient is not finite: the operations of marking where the value is not, which the TPU's
    # program never reads either way (its rows holding NaN or Inf have a NaN factor)
    return marked_codes(quotients, quotients)


def _largest(power):
    return lax.reduce_max(power, tuple(range(power.ndim)))


# name -> [(the object whose function it replaces, the function's name, the replacement built from the original)]
CANDIDATES = {
    "xla-layouts": [(int8_dot, "laid_out_for_tpu", lambda original: _as_xla_lays_it_out)],
    "powers": [(int8_dot, "scale_product", lambda original: _without_powers)],
    "unit-powers": [(int8_backend, "_as_dots_read_it", _with_unit_weight_powers),
                    (StaticScale, "stored_in", _with_unit_static_power)],
    "marked-codes": [(static_scales, "saturated_codes", lambda original: _marked)],
    "no-row-power": [(int8_dot, "_scaled", lambda original: _lhs_power_as(None))],
    "one-row-power": [(int8_dot, "_scaled", lambda original: _lhs_power_as(_largest))],
}
# The candidates that change only a TPU's program (on CPU and GPU the same program: an A/B there times one program
# twice), and the one that changes only an MLP's (a matrix's static codes; the block's activations have three axes).
TPU_ONLY = frozenset({"xla-layouts", "marked-codes"})
MLP_ONLY = frozenset({"marked-codes"})


def compiled(fn, args, options: dict, candidate: str | None = None):
    """``int8ify(fn, **options)`` compiled ahead of time for ``args``, with ``candidate``'s replacement in place
    while it is traced and compiled (a fresh wrapper each time: ``int8ify(fn)`` of one ``fn`` is cached). The caches
    are cleared before each trace and after a candidate's, so no program reads another form's dot programs."""
    if candidate is None:
        jax.clear_caches()
        return jax.jit(int8ify(lambda *a: fn(*a), late_inlining=False, **options)).lower(*args).compile()
    # each replaced attribute as it is stored (a classmethod's descriptor, not the bound method), to put it back
    stored = [(owner, name, inspect.getattr_static(owner, name)) for owner, name, _ in CANDIDATES[candidate]]
    for owner, name, replacement in CANDIDATES[candidate]:
        setattr(owner, name, replacement(getattr(owner, name)))
    try:
        return compiled(fn, args, options)
    finally:
        for owner, name, attribute in stored:
            setattr(owner, name, attribute)
        jax.clear_caches()


_METADATA = re.compile(r", metadata=\{[^}]*\}")
_SOURCE_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def program_text(hlo: str) -> str:
    """An optimized HLO's text without its source locations: two traces of one program differ in those only."""
    lines, in_sources = [], False
    for line in hlo.splitlines():
        if line.strip() in _SOURCE_SECTIONS:
            in_sources = True
        elif in_sources and not line.strip():
            in_sources = False
        elif not in_sources:
            lines.append(_METADATA.sub("", line))
    return "\n".join(lines)


def int8_copies(hlo: str) -> int:
    """The copies of int8 arrays in an optimized HLO's text (relayouts of codes)."""
    return sum(" = s8[" in line and " copy(" in line for line in hlo.splitlines())


def candidate_rows(candidates, tokens, batch: int, pairs: int, rounds: int, reps: int, d: int = 384,
                   head_dim: int = 64, model: str = "block"):
    """The table's rows (Markdown): each candidate against int8ify's program for the block at each token count (or
    the MLP, ``model="mlp"``: 4 layers of width ``d``, ``tokens`` ignored), with dynamic scales and with static
    scales (the block's attention's too)."""
    for label, bf16, modes in (_mlp_cases(d, batch) if model == "mlp" else _block_cases(tokens, batch, d, head_dim)):
        for mode, (fn, args, options) in modes.items():
            base = compiled(fn, args, options)  # int8ify's program, once for every candidate
            base_out, base_hlo = np.asarray(base(*args)), base.as_text()
            for candidate in candidates:
                new = compiled(fn, args, options, candidate)
                new_hlo = new.as_text()
                same = np.array_equal(base_out, np.asarray(new(*args)), equal_nan=True)
                ratios, times = [], []
                for i in range(pairs):
                    order = [("int8ify", (base, args)), ("candidate", (new, args))]
                    t = time_interleaved(dict([("bf16", bf16), *(order if i % 2 == 0 else order[::-1])]),
                                         rounds=rounds, reps=reps)
                    ratios.append(t["candidate"] / t["int8ify"])
                    times.append((t["bf16"], t["int8ify"], t["candidate"]))
                medians = " | ".join(f"{m:.3f}" for m in np.median(times, axis=0))
                another = program_text(base_hlo) != program_text(new_hlo)
                yield (f"| {label}, {mode}: {candidate} | {medians} | {min(ratios):.3f}-{max(ratios):.3f} | {same} "
                       f"| {another} | {int8_copies(base_hlo)} / {int8_copies(new_hlo)} |")


def _block_cases(tokens, batch: int, d: int, head_dim: int):
    """``(label, bf16's program and arguments, {mode: (fn, arguments, int8ify's options)})`` per token count."""
    params = init_block(jax.random.PRNGKey(2), d=d, mlp_dim=4 * d)

    def model(p, v):
        return block(p, v, heads=d // head_dim)

    heads = "" if head_dim == 64 else f" (heads of {head_dim})"
    for n_tokens in tokens:
        x = jax.random.normal(jax.random.PRNGKey(3), (batch, n_tokens, d))
        bf16 = (jax.jit(model), cast_floats((params, x), jnp.bfloat16))  # the reference every row times beside
        attention = calibrate_activation_dots(model, params, x)
        static = quantize_params(model, params, x, activations="static", calibration=[(x,)])
        yield (f"block d {d}{heads}, {batch} x {n_tokens} tokens", bf16,
               {"qparams": (model, (quantize_params(model, params, x), x), {}),
                "static + attention": (model, (static, x), {"activation_scales": attention})})


def _mlp_cases(d: int, batch: int):
    """:func:`_block_cases` for the MLP of ``examples/mlp.py`` (4 x Dense(d) + gelu) at ``batch``."""
    params = init_mlp(jax.random.PRNGKey(0), d, 4)
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, d))
    static = quantize_params(mlp, params, x, activations="static", calibration=[(x,)])
    yield (f"MLP 4 x {d}, batch {batch}", (jax.jit(mlp), cast_floats((params, x), jnp.bfloat16)),
           {"qparams": (mlp, (quantize_params(mlp, params, x), x), {}), "static": (mlp, (static, x), {})})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", nargs="+", choices=sorted(CANDIDATES), default=sorted(CANDIDATES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[197, 128, 77, 50])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--d", type=int, default=384, help="the block's width")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--model", choices=["block", "mlp"], default="block",
                        help="the transformer block, or the MLP of examples/mlp.py (4 layers of width --d)")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a small block, one pair of one round")
    parser.add_argument("--out", type=Path, help="also write the table here")
    ns = parser.parse_args(argv)
    batch, tokens, pairs, rounds, reps = ((2, [20], 1, 1, 1) if ns.quick else
                                          (ns.batch, ns.tokens, ns.pairs, 10, 5))
    lines = [f"{jax.devices()[0].device_kind}, JAX {jax.__version__}", "", *TABLE_HEADER]
    print("\n".join(lines), flush=True)
    for row in candidate_rows(ns.candidates, tokens, batch, pairs, rounds, reps, ns.d, ns.head_dim, ns.model):
        lines.append(row)
        print(row, flush=True)
    if ns.out:
        ns.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
