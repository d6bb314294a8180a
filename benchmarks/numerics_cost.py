"""What exact ties and NaN/overflow safety cost: the contract as int8ify computes it, against the plain formulas.

Usage::

    python benchmarks/numerics_cost.py [--repeats 15] [--quick] [--models mlp1024:16,mlp1024:256,minilm:32]

``int8ify(backend="int8")`` (the default) computes the scales and codes with IEEE divisions (bit-identical to the
seed's ``absmax / 127`` and ``rint(x / s)`` under jit), a NaN-safe absmax and a range-safe epilogue. The
``"int8-plain"`` backend registered here is the same program written the obvious way: ``reduce_max`` (drops NaN
on CPU), ``absmax / 127`` and ``x / s`` (which XLA turns into reciprocal multiplies: off by one code on ties),
and ``(acc * s_x) * s_w`` (overflows in between). Both run in one process, jit-compiled, interleaved, medians
after warm-up, on the MLP of ``benchmarks/speed.py`` and the all-MiniLM-L6-v2 encoder of ``examples/minilm``
(random weights: speed does not depend on them), with weights quantized per call and once (``quantize_params``).
``benchmarks/device_check.py`` runs it on an accelerator (its ``exactness`` step), where XLA's cost model and the
chip disagree on what the exact codes cost.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "examples" / "minilm"))

from jaxpr_rewrite import int8ify, quantize_params, register_backend  # noqa: E402
from jaxpr_rewrite._core.layout import scale_to_output  # noqa: E402
from jaxpr_rewrite._numerics.quantize import scale_values  # noqa: E402
from jaxpr_rewrite._quantized.array import is_quantized  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from speed import cpu_model, model_cases, time_interleaved  # noqa: E402

import model as minilm  # noqa: E402  (examples/minilm/model.py)
from mlp import init_mlp, mlp  # noqa: E402  (examples/mlp.py)


@register_backend("int8-plain", takes_prequantized=True)
def plain_backend(lhs, rhs, float_params, out_dtype, config):
    """The contract written the obvious way (per-channel scales, no exactness or range care)."""
    dims = dict(float_params)["dimension_numbers"]
    (lc, rc), _ = dims

    def quantize(x, axes):
        if is_quantized(x):  # pre-quantized weights: their codes and plain scale values
            return x.codes, scale_values(x.scales, x.exponents), x.kept_axes
        x = x.astype(jnp.float32)
        kept = tuple(a for a in range(x.ndim) if a not in axes)
        amax = jnp.max(jnp.abs(x), axis=tuple(axes))
        s = jnp.where(amax == 0, 1.0, amax / 127)
        codes = jnp.clip(jnp.round(x / jnp.expand_dims(s, tuple(axes))), -127, 127).astype(jnp.int8)
        return codes, s, kept

    (lq, ls, lk), (rq, rs, rk) = quantize(lhs, lc), quantize(rhs, rc)
    acc = lax.dot_general(lq, rq, dims, preferred_element_type=jnp.int32).astype(jnp.float32)
    out = acc * scale_to_output(ls, lk, lq.ndim, dims, 0, acc.shape) * scale_to_output(rs, rk, rq.ndim, dims, 1,
                                                                                       acc.shape)
    return out.astype(out_dtype)


DEFAULT_MODELS, QUICK_MODELS = "mlp1024:16,mlp1024:256,minilm:32", "mlp1024:16,minilm:8"
TABLE_HEADER = ["| model | weights | plain | exact | exact / plain |", "|---|---|---|---|---|"]


def cases(models: str):
    """``(name, fn, params, rest)`` per model of ``models`` (``mlpWIDTH:BATCH`` and ``minilm:BATCH``)."""
    rng = np.random.default_rng(0)
    for width, batch in model_cases(models):
        if width is None:
            ids = jnp.asarray(rng.integers(1000, 20000, size=(batch, 128)), jnp.int32)
            yield (f"MiniLM encoder, batch {batch} x 128", minilm.encode, minilm.init_params(),
                   (ids, jnp.ones((batch, 128), jnp.int32)))
        else:
            x = jnp.asarray(rng.normal(size=(batch, width)), jnp.float32)
            yield f"MLP 4x{width}, batch {batch}", mlp, init_mlp(jax.random.PRNGKey(0), width, 4), (x,)


def exactness_rows(models: str, repeats: int):
    """The table's rows (Markdown), one model at a time as each is measured: the plain and exact programs'
    median ms, with weights quantized per call and once."""
    for name, fn, params, rest in cases(models):
        exact, plain = jax.jit(int8ify(fn)), jax.jit(int8ify(fn, backend="int8-plain"))
        qparams = quantize_params(fn, params, *rest)
        ms = time_interleaved({"plain": (plain, (params, *rest)), "exact": (exact, (params, *rest)),
                               "plain q": (plain, (qparams, *rest)), "exact q": (exact, (qparams, *rest))}, repeats, 1)
        for weights, suffix in (("per call", ""), ("once", " q")):
            p, e = ms["plain" + suffix], ms["exact" + suffix]
            yield f"| {name} | {weights} | {p:.3f} | {e:.3f} | {e / p:.2f}x |"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer repeats")
    parser.add_argument("--models", help=f"mlpWIDTH:BATCH and minilm:BATCH, comma-separated (default "
                        f"{DEFAULT_MODELS}; with --quick {QUICK_MODELS})")
    ns = parser.parse_args(argv)
    repeats = 5 if ns.quick else ns.repeats
    models = ns.models or (QUICK_MODELS if ns.quick else DEFAULT_MODELS)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} (CPU: {cpu_model()}); medians of {repeats} "
          "interleaved runs (ms)")
    print("\n".join(TABLE_HEADER), flush=True)
    for row in exactness_rows(models, repeats):
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
