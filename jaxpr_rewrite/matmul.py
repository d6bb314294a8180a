"""The seed problem: one per-channel int8 matmul with its codes and scales exposed."""

from __future__ import annotations

import jax
import numpy as np

from .int8_dot import scaled_int8_dot
from .quantize import ldexp_exact, scale_values

_MATMUL_DIMS = (((1,), (0,)), ((), ()))


def int8_matmul(x, w) -> dict:
    """``x @ w`` in int8 with one scale per row of ``x`` and per column of ``w``.

    The same computation ``int8ify(lambda x, w: x @ w)`` emits, so ``y`` is bit-identical to it.

    Arguments:
        x: float array of shape ``(B, D_in)``, one token per row.
        w: float array of shape ``(D_in, D_out)``, one output channel per column.

    Returns:
        A dict with ``w_q`` (int8, ``(D_in, D_out)``), ``w_scales`` (float32, ``(D_out,)``), ``x_q`` (int8,
        ``(B, D_in)``), ``x_scales`` (float32, ``(B,)``) and ``y`` (float32, ``(B, D_out)``).
    """
    x, w = jax.numpy.asarray(x), jax.numpy.asarray(w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"int8_matmul expects x (B, D_in) and w (D_in, D_out); got {x.shape} and {w.shape}")
    for name, v in (("x", x), ("w", w)):
        if not jax.numpy.issubdtype(v.dtype, jax.numpy.floating):
            raise TypeError(f"int8_matmul expects floating {name}, got {v.dtype}")
    x_q, w_q, y = scaled_int8_dot(x, w, _MATMUL_DIMS, (1,), (0,))
    return {"w_q": w_q.codes, "w_scales": _scale_values(w_q), "x_q": x_q.codes, "x_scales": _scale_values(x_q), "y": y}


def _scale_values(q):
    """The scales as float32 values, ``scales * 2**exponents`` (subnormal for a slice whose absmax is below
    ``127 * 2**-126``; the codes and ``y`` keep full precision there, see :mod:`jaxpr_rewrite.quantize`)."""
    if q.scales.dtype == np.float32:
        return ldexp_exact(q.scales, q.exponents)
    return scale_values(q.scales, q.exponents)
