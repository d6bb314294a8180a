"""The numerics of the int8 contract: ``absmax / 127`` scales, codes, and the scale epilogue, exactly.

Everything here is written with ``lax`` primitives (not ``jnp.where``/``jnp.round``/``jnp.clip``), so a rewritten
jaxpr reads as a flat list of equations instead of nested ``jit[_where]`` calls. Each function returns plain
arrays; :mod:`jaxpr_rewrite.quantized` packs them into a :class:`~jaxpr_rewrite.quantized.QuantizedArray`.

The contract, for one slice ``v`` (the elements one scale covers) with ``a = max|v|``:

* ``s = a / 127`` in float32, correctly rounded; ``s = 1`` for an all-zero slice;
* codes ``q = clip(rint(v / s), -127, 127)`` with ``v / s`` correctly rounded in float32 and ties to even;
* the dot's output ``y = acc * s_lhs * s_rhs`` in float32 (``acc`` the exact integer sum).

Scales and the epilogue are float32, or float64 for float64 operands (with ``jax_enable_x64``), so a float64
program keeps its range; the codes are int8 and the sums int32 either way.

**How a scale is held.** A slice's scale is ``scales * 2**exponents``: ``2**exponents`` is the power of two of its
absmax (``a = m * 2**e``, ``1 <= m < 2``) and ``scales = m / 127`` lies in ``[1/127, 2/127)``. Multiplying by a power
of two is exact, so ``scales * 2**exponents`` *is* the contract's ``a / 127``, and ``v / s`` is
``(v * 2**-e) / scales``, bit for bit. Four things make XLA's answer differ from the contract unless handled, and
this representation plus two small devices handle all four:

* **Division.** XLA turns ``a / 127`` into ``a * (1/127)`` and ``v / broadcast(s)`` into ``v * (1/s)``, which
  differ from the division by one ulp and move values that sit on a rounding tie (integers, dyadic values,
  bfloat16 data) to the other code. Both divisions use :func:`true_divide`, which XLA keeps a division.
* **NaN and Inf.** XLA's CPU ``reduce_max`` drops NaN. :func:`absmax` turns NaN into Inf before reducing (in
  the same fused pass); a slice holding NaN or Inf gets an infinite scale, so every output that depends on it
  comes out non-finite (Inf or NaN).
* **Tiny slices.** XLA flushes subnormal floats to zero, so ``a / 127`` for ``a < 127 * 2**-126`` cannot be
  represented as one float. Held as ``scales * 2**exponents`` it needs no special case: the codes of such a slice
  use the full +-127 range like any other.
* **Epilogue range.** ``(acc * s_lhs) * s_rhs`` overflows (or underflows) in its intermediate product when one
  scale is huge and the other tiny, although the result is an ordinary float. :func:`scale_product` multiplies
  the sums by the two ``scales`` (an intermediate below ``2**21`` in magnitude) and applies the exponents as two
  power-of-two factors of about half the total each; wherever the plain product's intermediates are normal floats
  this is the same number, bit for bit, and it is finite and correct whenever the result is.

Inputs below float32's normal range (subnormals) are read as zero by XLA on CPU and GPU.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
from jax import lax

__all__ = [
    "FORMATS",
    "INT8_MAX",
    "MAX_INT32_SAFE_CONTRACTION",
    "absmax",
    "compute_dtype",
    "dequantize_codes",
    "epilogue_factors",
    "ldexp_exact",
    "pow2",
    "quantize_parts",
    "scale_values",
    "scale_product",
    "scales_from_absmax",
    "to_compute",
    "true_divide",
]

INT8_MAX = 127
# The largest contraction whose int8 x int8 products cannot overflow an int32 sum: 127 * 127 * K < 2**31.
MAX_INT32_SAFE_CONTRACTION = (2**31 - 1) // (INT8_MAX * INT8_MAX)


class FloatFormat(NamedTuple):
    """The bit layout of a compute dtype, for the exact scale arithmetic."""

    dtype: type
    bits: type  # the integer type of the same width
    mantissa_bits: int
    bias: int  # pow2 is exact for exponents in [1 - bias, bias]


FORMATS = {
    np.dtype(np.float32): FloatFormat(np.float32, np.int32, 23, 127),
    np.dtype(np.float64): FloatFormat(np.float64, np.int64, 52, 1023),
}


def compute_dtype(dtype) -> np.dtype:
    """The dtype scales and the epilogue are computed in for operands of ``dtype``: float64 for float64, float32
    for every other float (bfloat16 and float16 are upcast)."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _format(x) -> FloatFormat:
    return FORMATS[np.dtype(x.dtype)]


def to_compute(x, dtype=None):
    """``x`` in its compute dtype (or ``dtype``)."""
    dtype = compute_dtype(x.dtype) if dtype is None else np.dtype(dtype)
    return x if x.dtype == dtype else lax.convert_element_type(x, dtype)


def true_divide(numerator, denominator):
    """``numerator / denominator`` as an IEEE division, never a multiply by a reciprocal.

    XLA rewrites a division by a constant or by a broadcast into a multiply by its reciprocal. The divisor here
    is a ``select`` that passes NaN numerators through, which XLA cannot see through, so the division stays.
    """
    return lax.div(numerator, lax.select(lax.ne(numerator, numerator), numerator, denominator))


def pow2(exponent, dtype=np.float32):
    """``2.0 ** exponent`` in ``dtype``, exactly, for int32 ``exponent`` in ``[1 - bias, bias]``."""
    fmt = FORMATS[np.dtype(dtype)]
    biased = lax.convert_element_type(lax.add(exponent, np.int32(fmt.bias)), fmt.bits)
    return lax.bitcast_convert_type(lax.shift_left(biased, fmt.bits(fmt.mantissa_bits)), fmt.dtype)


def absmax(x, reduce_axes: Sequence[int]):
    """``max|x|`` over ``reduce_axes`` in the compute dtype: Inf for a slice holding NaN or Inf, 0 for an empty one.

    NaN becomes Inf before the reduction (one fused pass), because XLA's CPU float ``reduce_max`` drops NaN for
    many layouts.
    """
    x = to_compute(x)
    axes = tuple(reduce_axes)
    magnitude = lax.select(lax.ne(x, x), lax.full_like(x, np.inf), lax.abs(x))
    amax = lax.reduce_max(magnitude, axes)
    if any(x.shape[a] == 0 for a in axes):
        amax = lax.max(amax, x.dtype.type(0))  # reduce_max of an empty slice is -inf: it is an all-zero slice
    return amax


def scales_from_absmax(amax):
    """The contract's scales from slice absmaxes, as ``scales * 2**exponents``.

    Arguments:
        amax: absmaxes (from :func:`absmax`), float32 or float64.

    Returns:
        ``(scales, exponents)``: ``exponents`` (int32) is the power of two of the absmax and ``scales`` (the
        absmax's dtype) is its mantissa divided by 127, in ``[1/127, 2/127)`` (``[2/127, 4/127)`` in the top
        binade, where the exponent is kept one lower so ``2**-exponents`` is a normal float; below ``1/127`` for a
        subnormal absmax, on a device that does not read it as zero); an all-zero slice has scale 1 (``scales`` 1,
        ``exponents`` 0) and a slice holding NaN or Inf an infinite scale, which makes every output it feeds
        infinite or NaN.

    The mantissa is ``amax * 2**-exponents``, a multiply by a power of two and so exact, with ``2**-exponents``
    built from the absmax's exponent field.
    """
    scales, exponents, _ = _scale_parts(amax)
    return scales, exponents


def _scale_parts(amax, limit: int = INT8_MAX):
    """:func:`scales_from_absmax` (the mantissa divided by ``limit``, the largest code), and ``2**-exponents``
    (the codes' exact prescale; any value for an all-zero slice, whose elements are all zero)."""
    fmt = _format(amax)
    field = lax.shift_right_logical(lax.bitcast_convert_type(amax, fmt.bits), fmt.bits(fmt.mantissa_bits))
    # 2**-e must be a normal float for the prescale: the top binade (and Inf) keeps e = bias - 1; a subnormal
    # absmax has field 0, e = -bias, which makes the same exact multiply
    field = lax.min(field, fmt.bits(2 * fmt.bias - 1))
    exponents = lax.sub(lax.convert_element_type(field, np.int32), np.int32(fmt.bias))
    inverse = lax.bitcast_convert_type(
        lax.shift_left(lax.sub(fmt.bits(2 * fmt.bias), field), fmt.bits(fmt.mantissa_bits)), fmt.dtype)
    mantissa = lax.mul(amax, inverse)  # exact: in [1, 2), [2, 4) in the top binade, Inf for Inf
    scales = true_divide(mantissa, lax.full_like(amax, limit))
    zero = lax.eq(amax, fmt.dtype(0))
    scales = lax.select(zero, lax.full_like(scales, 1), scales)
    exponents = lax.select(zero, lax.full_like(exponents, 0), exponents)
    return scales, exponents, inverse


def quantize_parts(x, reduce_axes: Sequence[int], limit: int = INT8_MAX):
    """The contract's quantization of ``x`` with one scale per slice over ``reduce_axes``.

    Arguments:
        x: a floating array.
        reduce_axes: the axes one scale covers.
        limit: the largest code: 127 for int8, 7 for int4 weights (scales are then ``absmax / 7``).

    Returns:
        ``(codes, scales, exponents)``: int8 ``codes = clip(rint(x / scale), -limit, limit)`` (ties to even) and
        each slice's scale as ``scales * 2**exponents``, over the other axes in order.
    """
    reduce_axes = tuple(reduce_axes)
    kept_axes = tuple(a for a in range(x.ndim) if a not in reduce_axes)
    scales, exponents, prescale = _scale_parts(absmax(x, reduce_axes), limit)
    values = to_compute(x)
    # x * 2**-e is exact (a non-finite slice's exponent is meaningless, but its scale is Inf and so is every output
    # it feeds)
    values = lax.mul(values, lax.broadcast_in_dim(prescale, x.shape, kept_axes))
    quotient = true_divide(values, lax.broadcast_in_dim(scales, x.shape, kept_axes))
    rounded = lax.round(quotient, lax.RoundingMethod.TO_NEAREST_EVEN)
    bound = scales.dtype.type(limit)
    codes = lax.convert_element_type(lax.clamp(-bound, rounded, bound), np.int8)
    return codes, scales, exponents


def dequantize_codes(codes, scales, exponents, kept_axes: Sequence[int]):
    """``codes * scales * 2**exponents`` in the scales' dtype, the per-slice values broadcast from ``kept_axes``."""
    kept_axes = tuple(kept_axes)
    scales, low, high = (lax.broadcast_in_dim(f, codes.shape, kept_axes) for f in epilogue_factors(scales, exponents))
    return lax.mul(lax.mul(lax.mul(lax.convert_element_type(codes, scales.dtype), scales), low), high)


def scale_values(scales, exponents):
    """The scales as plain values, ``scales * 2**exponents`` (float64, or float32 where XLA flushes a subnormal
    result to zero; see :func:`ldexp_exact` for exact float32 values)."""
    scales, low, high = epilogue_factors(scales, exponents)
    return lax.mul(lax.mul(scales, low), high)


def epilogue_factors(scales, exponents) -> tuple:
    """One operand's per-slice factors for :func:`scale_product`: ``(scales, 2**h, 2**(exponents - h))`` with
    ``h = exponents // 2``, each half a normal float (computed on the small per-slice arrays)."""
    fmt = _format(scales)
    half = lax.shift_right_arithmetic(exponents, np.int32(1))
    return scales, pow2(half, fmt.dtype), pow2(lax.sub(exponents, half), fmt.dtype)


def scale_product(acc, lhs: Sequence, rhs: Sequence):
    """``acc * s_lhs * s_rhs`` for scales held as ``scales * 2**exponents``.

    Arguments:
        acc: the sums, in the compute dtype.
        lhs, rhs: each operand's :func:`epilogue_factors`, already broadcast to ``acc.shape``.

    ``acc * scales_lhs * scales_rhs`` stays within ``2**21`` in magnitude (``|acc| < 2**31``, ``scales < 2**-5``)
    and rounds exactly like ``(acc * s_lhs) * s_rhs``. The exponents are then applied as
    ``(2**h_lhs * 2**h_rhs) * (2**h'_lhs * 2**h'_rhs)``: each bracket is a power of two within the normal range and
    about half the total, so no intermediate overflows or underflows unless the result does. All multiplies,
    fused by XLA into the epilogue's one pass.
    """
    (s_l, a_l, b_l), (s_r, a_r, b_r) = lhs, rhs
    out = lax.mul(lax.mul(acc, s_l), s_r)
    return lax.mul(lax.mul(out, lax.mul(a_l, a_r)), lax.mul(b_l, b_r))


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
