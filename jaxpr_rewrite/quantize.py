"""The numerics of the int8 contract: ``absmax / 127`` scales, codes, and the scale epilogue, exactly.

Everything here is written with ``lax`` primitives (not ``jnp.where``/``jnp.round``/``jnp.clip``), so a rewritten
jaxpr reads as a flat list of equations instead of nested ``jit[_where]`` calls. Each function returns plain
arrays; :mod:`jaxpr_rewrite.quantized` packs them into a :class:`~jaxpr_rewrite.quantized.QuantizedArray`.

The contract, for one slice ``v`` (the elements one scale covers) with ``a = max|v|``:

* ``s = a / 127`` in float32, correctly rounded; ``s = 1`` for an all-zero slice;
* codes ``q = clip(rint(v / s), -127, 127)`` with ``v / s`` correctly rounded in float32 and ties to even;
* the dot's output ``y = acc * s_lhs * s_rhs`` in float32 (``acc`` the exact integer sum).

Scales and the epilogue are float32, or float64 for float64 operands (with ``jax_enable_x64``), so a float64 program
keeps its range; the codes are int8 and the sums int32 either way.

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
  applies exactly. For every other slice this changes nothing, bit for bit. (float64: ``2**-900`` and
  ``2**512``.)
* **Epilogue range.** ``(acc * s_lhs) * s_rhs`` overflows (or underflows) in its intermediate product when one
  scale is huge and the other tiny, although the result is an ordinary float. :func:`scale_product` splits each
  scale into a mantissa in ``[1, 2)`` and an integer exponent, multiplies the mantissas, and applies the summed
  exponent with exact power-of-two multiplies; in the normal range this is the same number, bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
from jax import lax

__all__ = [
    "FORMATS",
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
    "compute_dtype",
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
    bias: int
    tiny_absmax: float  # slices with a smaller absmax are multiplied by 2**tiny_shift first
    tiny_shift: int
    max_exponent_half: int  # pow2 is exact for exponents in [1 - bias, bias]


FORMATS = {
    np.dtype(np.float32): FloatFormat(np.float32, np.int32, 23, 127, 2.0**-100, 64, 126),
    np.dtype(np.float64): FloatFormat(np.float64, np.int64, 52, 1023, 2.0**-900, 512, 1022),
}
TINY_ABSMAX = np.float32(2.0**-100)


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
    """``2.0 ** exponent`` in ``dtype``, exactly, for int32 ``exponent`` in the dtype's normal range."""
    fmt = FORMATS[np.dtype(dtype)]
    biased = lax.convert_element_type(lax.add(exponent, np.int32(fmt.bias)), fmt.bits)
    return lax.bitcast_convert_type(lax.shift_left(biased, fmt.bits(fmt.mantissa_bits)), fmt.dtype)


def absmax(x, reduce_axes: Sequence[int]):
    """``max|x|`` over ``reduce_axes`` in the compute dtype: NaN for a slice holding NaN, 0 for an empty slice.

    The maximum is taken over the bit patterns of ``|x|`` as integers, which order non-negative floats exactly
    and put NaN above infinity, so no backend can drop a NaN (XLA's CPU float ``reduce_max`` does).
    """
    magnitude = lax.abs(to_compute(x))
    fmt = _format(magnitude)
    bits = lax.bitcast_convert_type(magnitude, fmt.bits)
    # an empty slice reduces to the integer minimum, the bits of -0.0: an empty slice is an all-zero slice
    return lax.bitcast_convert_type(lax.reduce_max(bits, tuple(reduce_axes)), fmt.dtype)


def scales_from_absmax(amax):
    """The contract's scales from slice absmaxes.

    Arguments:
        amax: absmaxes (from :func:`absmax`).

    Returns:
        ``(scales, exponents, prescale)``: ``scales`` (the compute dtype) and int32 ``exponents``, the scale of a
        slice being ``scales * 2**exponents``, and the exact power of two its values are multiplied by before
        division. ``exponents`` is 0 (``prescale`` 1) except for slices with an absmax below ``2**-100``
        (float64: ``2**-900``), whose ``scales`` are taken on the slice multiplied by ``2**64`` (``2**512``). A
        scale is 1 for an all-zero slice and NaN (Inf) for a slice holding NaN (Inf).
    """
    fmt = _format(amax)
    tiny = lax.bitwise_and(lax.lt(amax, fmt.dtype(fmt.tiny_absmax)), lax.gt(amax, fmt.dtype(0)))
    exponents = lax.mul(lax.convert_element_type(tiny, np.int32), np.int32(-fmt.tiny_shift))
    prescale = pow2(lax.neg(exponents), fmt.dtype)
    divisor = lax.broadcast(fmt.dtype(INT8_MAX), amax.shape)
    scales = true_divide(lax.mul(amax, prescale), divisor)
    # an all-zero slice (absmax 0, or -0.0 from an empty one) gets scale 0 + 1
    scales = lax.add(scales, lax.convert_element_type(lax.eq(amax, fmt.dtype(0)), fmt.dtype))
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
    values = lax.mul(to_compute(x), lax.broadcast_in_dim(prescale, x.shape, kept_axes))
    quotient = true_divide(values, lax.broadcast_in_dim(scales, x.shape, kept_axes))
    rounded = lax.round(quotient, lax.RoundingMethod.TO_NEAREST_EVEN)
    limit = scales.dtype.type(INT8_MAX)
    codes = lax.convert_element_type(lax.clamp(-limit, rounded, limit), np.int8)
    return codes, scales, exponents


def dequantize_codes(codes, scales, exponents, kept_axes: Sequence[int]):
    """``codes * scales * 2**exponents`` in the scales' dtype, the scales broadcast from ``kept_axes``."""
    kept_axes = tuple(kept_axes)
    value = lax.mul(lax.convert_element_type(codes, scales.dtype),
                    lax.broadcast_in_dim(scales, codes.shape, kept_axes))
    return lax.mul(value, lax.broadcast_in_dim(pow2(exponents, scales.dtype), codes.shape, kept_axes))


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
    fmt = _format(scales)
    bits = lax.bitcast_convert_type(scales, fmt.bits)
    mantissa_mask = fmt.bits((1 << fmt.mantissa_bits) - 1)
    mantissa_bits = lax.bitwise_or(lax.bitwise_and(bits, mantissa_mask), fmt.bits(fmt.bias << fmt.mantissa_bits))
    mantissa = lax.select(lax.is_finite(scales), lax.bitcast_convert_type(mantissa_bits, fmt.dtype), scales)
    biased = lax.convert_element_type(lax.shift_right_logical(bits, fmt.bits(fmt.mantissa_bits)), np.int32)
    exponent = lax.add(lax.sub(biased, np.int32(fmt.bias)), exponents)
    return mantissa, exponent


def scale_product(acc, factors: Sequence[tuple]):
    """``acc * s_1 * s_2 * ...`` without intermediate overflow or underflow.

    Arguments:
        acc: the sums, in the compute dtype.
        factors: ``(mantissa, exponent)`` pairs from :func:`split_scale`, each already broadcast to
            ``acc.shape``.

    Returns:
        The product, rounded once per mantissa multiply like ``(acc * s_1) * s_2``; identical to it whenever
        that product's intermediates are normal floats, and finite and correct whenever the result is.
    """
    fmt = _format(acc)
    out, exponent = acc, None
    for mantissa, e in factors:
        out = lax.mul(out, mantissa)
        exponent = e if exponent is None else lax.add(exponent, e)
    # |out| < 2**35 here, so only exponents within about [-bias - 35, bias + 2] leave a finite nonzero result;
    # clamping to twice the normal range keeps each half where pow2 is exact and changes no representable result.
    limit = fmt.max_exponent_half
    exponent = lax.clamp(np.int32(-2 * limit), exponent, np.int32(2 * limit))
    half = lax.shift_right_arithmetic(exponent, np.int32(1))
    return lax.mul(lax.mul(out, pow2(half, fmt.dtype)), pow2(lax.sub(exponent, half), fmt.dtype))
