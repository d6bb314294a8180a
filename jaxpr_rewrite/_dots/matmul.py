"""The seed problem: one per-channel int8 matmul with its codes and scales exposed."""

from __future__ import annotations

import jax
import numpy as np
from jax import lax

from .._core import platforms
from .int8_dot import scaled_int8_dot_and_operands
from .._numerics.quantize import scale_values

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

    Raises:
        Int8ifyError: ``XLA_FLAGS`` would make the default device (a Hopper GPU) double the int8 sums
            (:meth:`~jaxpr_rewrite._core.platforms.Platform.check_gemm`).
    """
    x, w = jax.numpy.asarray(x), jax.numpy.asarray(w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"int8_matmul expects x (B, D_in) and w (D_in, D_out); got {x.shape} and {w.shape}")
    for name, v in (("x", x), ("w", w)):
        if not jax.numpy.issubdtype(v.dtype, jax.numpy.floating):
            raise TypeError(f"int8_matmul expects floating {name}, got {v.dtype}")
    platforms.check_gemms()
    # the codes and scales the dot itself multiplied: each operand quantized once, on every platform
    y, (x_q, x_scales, x_exponents), (w_q, w_scales, w_exponents) = scaled_int8_dot_and_operands(
        x, w, _MATMUL_DIMS, (1,), (0,))
    return {"w_q": w_q, "w_scales": _scale_values(w_scales, w_exponents), "x_q": x_q,
            "x_scales": _scale_values(x_scales, x_exponents), "y": y}


def _scale_values(scales, exponents):
    """The scales as float32 values, ``scales * 2**exponents`` (subnormal for a slice whose absmax is below
    ``127 * 2**-126``; the codes and ``y`` keep full precision there, see :mod:`jaxpr_rewrite._numerics.quantize`)."""
    if scales.dtype == np.float32:
        return ldexp_exact(scales, exponents)
    return scale_values(scales, exponents)


def ldexp_exact(scales, exponents):
    """``scales * 2**exponents`` as float32 values, rounded once (to nearest even) even where the result is
    subnormal, which a float multiply on XLA would flush to zero. Built from the bits, so nothing is flushed."""
    bits = lax.bitcast_convert_type(scales, np.int32)
    sign = lax.bitwise_and(bits, np.int32(-(2**31)))
    magnitude = lax.bitwise_and(bits, np.int32(0x7FFFFFFF))
    biased = lax.add(lax.shift_right_logical(magnitude, np.int32(23)), exponents)
    normal = lax.bitwise_or(sign, lax.bitwise_or(lax.shift_left(biased, np.int32(23)),
                                                 lax.bitwise_and(magnitude, np.int32(0x7FFFFF))))
    # below the normal range: shift the 24-bit significand right and round half to even
    significand = lax.bitwise_or(lax.bitwise_and(magnitude, np.int32(0x7FFFFF)), np.int32(0x800000))
    shift = lax.clamp(np.int32(1), lax.sub(np.int32(1), biased), np.int32(25))
    kept = lax.shift_right_logical(significand, shift)
    rest = lax.bitwise_and(significand, lax.sub(lax.shift_left(np.int32(1), shift), np.int32(1)))
    half = lax.shift_left(np.int32(1), lax.sub(shift, np.int32(1)))
    odd = lax.eq(lax.bitwise_and(kept, np.int32(1)), np.int32(1))
    up = lax.bitwise_or(lax.gt(rest, half), lax.bitwise_and(lax.eq(rest, half), odd))
    subnormal = lax.bitwise_or(sign, lax.add(kept, lax.convert_element_type(up, np.int32)))
    ok = lax.bitwise_and(lax.is_finite(scales), lax.ne(magnitude, np.int32(0)))
    value = lax.select(lax.gt(biased, np.int32(0)), normal, subnormal)
    return lax.select(ok, lax.bitcast_convert_type(value, np.float32), scales)
