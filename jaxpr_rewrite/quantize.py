"""The numerics of the int8 contract: ``absmax / 127`` scales, codes, and the scale epilogue, exactly.

Everything here is written with ``lax`` primitives (not ``jnp.where``/``jnp.round``/``jnp.clip``), so a rewritten
jaxpr reads as a flat list of equations instead of nested ``jit[_where]`` calls. Each function returns plain
arrays; :mod:`jaxpr_rewrite.quantized` packs them into a :class:`~jaxpr_rewrite.quantized.QuantizedArray`.

The contract, for one slice ``v`` (the elements one scale covers) with ``a = max|v|``:

* ``s = a / 127`` in float32, correctly rounded; ``s = 1`` for an all-zero slice;
* codes ``q = clip(rint(v / s), -127, 127)`` with ``v / s`` correctly rounded in float32 and ties to even;
* the dot's output ``y = acc * s_lhs * s_rhs`` in float32 (``acc`` the exact integer sum).

Four things make XLA's answer differ from that formula unless handled, and each is handled here:

* **Division.** XLA turns ``a / 127`` into ``a * (1/127)`` and ``v / broadcast(s)`` into ``v * (1/s)``, which
  differ from the division by one ulp and move values that sit on a rounding tie (integers, dyadic values,
  bfloat16 data) to the other code. Both divisions use :func:`true_divide`, which XLA keeps a division.
* **NaN and Inf.** XLA's CPU ``reduce_max`` drops NaN. :func:`absmax` takes the maximum over the integer bit
  patterns instead, where NaN is the largest; a slice holding NaN or Inf gets a NaN or Inf scale, so every output
  that depends on it comes out non-finite.
* **Tiny slices.** XLA flushes subnormal floats to zero, so ``a / 127`` for ``a < 127 * 2**-126`` cannot be
  represented. A slice with ``a < 2**-100`` is multiplied by ``2**64`` first (exact): its scale keeps full
  precision and its codes full resolution; the ``2**-64`` goes into the scale's exponent, which the epilogue
  applies exactly. For every other slice this changes nothing, bit for bit.
* **Epilogue range.** ``(acc * s_lhs) * s_rhs`` overflows (or underflows) in its intermediate product when one
  scale is huge and the other tiny, although the result is an ordinary float. :func:`scale_product` splits each
  scale into a mantissa in ``[1, 2)`` and an integer exponent, multiplies the mantissas, and applies the summed
  exponent with exact power-of-two multiplies; in the normal range this is the same number, bit for bit.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from jax import lax

__all__ = [
    "INT8_MAX",
    "MAX_INT32_SAFE_CONTRACTION",
    "TINY_ABSMAX",
    "absmax",
    "dequantize_codes",
    "ldexp_exact",
    "pow2",
    "quantize_parts",
    "scale_product",
    "scales_from_absmax",
    "split_scale",
    "to_float32",
    "true_divide",
]

INT8_MAX = 127
# The largest contraction whose int8 x int8 products cannot overflow an int32 sum: 127 * 127 * K < 2**31.
MAX_INT32_SAFE_CONTRACTION = (2**31 - 1) // (INT8_MAX * INT8_MAX)
# Slices with an absmax below this are multiplied by 2**TINY_SHIFT before their scale is taken.
TINY_ABSMAX = np.float32(2.0**-100)
TINY_SHIFT = 64


def to_float32(x):
    return x if x.dtype == np.float32 else lax.convert_element_type(x, np.float32)


def true_divide(numerator, denominator):
    """``numerator / denominator`` as an IEEE division, never a multiply by a reciprocal.

    XLA rewrites a division by a constant or by a broadcast into a multiply by its reciprocal. The divisor here
    is a ``select`` that passes NaN numerators through, which XLA cannot see through, so the division stays.
    """
    return lax.div(numerator, lax.select(lax.ne(numerator, numerator), numerator, denominator))


def pow2(exponent):
    """``2.0 ** exponent`` in float32, exactly, for int32 ``exponent`` in ``[-126, 127]``."""
    return lax.bitcast_convert_type(lax.shift_left(lax.add(exponent, np.int32(127)), np.int32(23)), np.float32)


def absmax(x, reduce_axes: Sequence[int]):
    """``max|x|`` over ``reduce_axes`` in float32: NaN for a slice holding NaN, 0 for an empty slice.

    The maximum is taken over the bit patterns of ``|x|`` as integers, which order non-negative floats exactly
    and put NaN above infinity, so no backend can drop a NaN (XLA's CPU float ``reduce_max`` does).
    """
    bits = lax.bitcast_convert_type(lax.abs(to_float32(x)), np.int32)
    # an empty slice reduces to INT32_MIN, the bits of -0.0: an empty slice is an all-zero slice
    return lax.bitcast_convert_type(lax.reduce_max(bits, tuple(reduce_axes)), np.float32)


def scales_from_absmax(amax):
    """The contract's scales from slice absmaxes.

    Arguments:
        amax: float32 absmaxes (from :func:`absmax`).

    Returns:
        ``(scales, exponents, prescale)``: float32 ``scales`` and int32 ``exponents``, the scale of a slice being
        ``scales * 2**exponents``, and the exact power of two its values are multiplied by before division.
        ``exponents`` is 0 (``prescale`` 1) except for slices with an absmax below ``2**-100``, whose ``scales``
        are taken on the slice multiplied by ``2**64``. A scale is 1 for an all-zero slice and NaN (Inf) for a
        slice holding NaN (Inf).
    """
    tiny = lax.bitwise_and(lax.lt(amax, TINY_ABSMAX), lax.gt(amax, np.float32(0)))
    exponents = lax.mul(lax.convert_element_type(tiny, np.int32), np.int32(-TINY_SHIFT))
    prescale = pow2(lax.neg(exponents))
    divisor = lax.broadcast(np.float32(INT8_MAX), amax.shape)
    scales = true_divide(lax.mul(amax, prescale), divisor)
    # an all-zero slice (absmax 0, or -0.0 from an empty one) gets scale 0 + 1
    scales = lax.add(scales, lax.convert_element_type(lax.eq(amax, np.float32(0)), np.float32))
    return scales, exponents, prescale


def quantize_parts(x, reduce_axes: Sequence[int]):
    """The contract's quantization of ``x`` with one scale per slice over ``reduce_axes``.

    Returns:
        ``(codes, scales, exponents)``: int8 ``codes = clip(rint(x / scale), -127, 127)`` (ties to even) and the
        per-slice ``scales * 2**exponents`` over the other axes, in order.
    """
    reduce_axes = tuple(reduce_axes)
    kept_axes = tuple(a for a in range(x.ndim) if a not in reduce_axes)
    scales, exponents, prescale = scales_from_absmax(absmax(x, reduce_axes))
    x32 = lax.mul(to_float32(x), lax.broadcast_in_dim(prescale, x.shape, kept_axes))
    quotient = true_divide(x32, lax.broadcast_in_dim(scales, x.shape, kept_axes))
    rounded = lax.round(quotient, lax.RoundingMethod.TO_NEAREST_EVEN)
    codes = lax.convert_element_type(lax.clamp(np.float32(-INT8_MAX), rounded, np.float32(INT8_MAX)), np.int8)
    return codes, scales, exponents


def dequantize_codes(codes, scales, exponents, kept_axes: Sequence[int]):
    """``codes * scales * 2**exponents`` in float32, the scales broadcast from ``kept_axes``."""
    kept_axes = tuple(kept_axes)
    value = lax.mul(lax.convert_element_type(codes, np.float32), lax.broadcast_in_dim(scales, codes.shape, kept_axes))
    return lax.mul(value, lax.broadcast_in_dim(pow2(exponents), codes.shape, kept_axes))


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
    up = lax.bitwise_or(lax.gt(rest, half), lax.bitwise_and(lax.eq(rest, half),
                                                             lax.eq(lax.bitwise_and(kept, np.int32(1)), np.int32(1))))
    subnormal = lax.bitwise_or(sign, lax.add(kept, lax.convert_element_type(up, np.int32)))
    ok = lax.bitwise_and(lax.is_finite(scales), lax.ne(magnitude, np.int32(0)))
    value = lax.select(lax.gt(biased, np.int32(0)), normal, subnormal)
    return lax.select(ok, lax.bitcast_convert_type(value, np.float32), scales)


def split_scale(scales, exponents):
    """``(mantissa, exponent)`` with ``scales * 2**exponents == mantissa * 2**exponent``, mantissa in [1, 2).

    Scales are positive. A non-finite scale keeps its value as the mantissa, so NaN and Inf propagate.
    """
    bits = lax.bitcast_convert_type(scales, np.int32)
    mantissa_bits = lax.bitwise_or(lax.bitwise_and(bits, np.int32(0x7FFFFF)), np.int32(127 << 23))
    mantissa = lax.select(lax.is_finite(scales), lax.bitcast_convert_type(mantissa_bits, np.float32), scales)
    exponent = lax.add(lax.sub(lax.shift_right_logical(bits, np.int32(23)), np.int32(127)), exponents)
    return mantissa, exponent


def scale_product(acc, factors: Sequence[tuple]):
    """``acc * s_1 * s_2 * ...`` in float32 without intermediate overflow or underflow.

    Arguments:
        acc: float32 sums.
        factors: ``(mantissa, exponent)`` pairs from :func:`split_scale`, each already broadcast to
            ``acc.shape``.

    Returns:
        The product, rounded once per mantissa multiply like ``(acc * s_1) * s_2``; identical to it whenever
        that product's intermediates are normal floats, and finite and correct whenever the result is.
    """
    out, exponent = acc, None
    for mantissa, e in factors:
        out = lax.mul(out, mantissa)
        exponent = e if exponent is None else lax.add(exponent, e)
    # |out| < 2**35 here, so only exponents in about [-160, 130] leave a finite nonzero result; clamping to
    # [-252, 254] keeps each half in [-126, 127], where pow2 is exact, and changes no representable result.
    exponent = lax.clamp(np.int32(-252), exponent, np.int32(254))
    half = lax.shift_right_arithmetic(exponent, np.int32(1))
    return lax.mul(lax.mul(out, pow2(half)), pow2(lax.sub(exponent, half)))
