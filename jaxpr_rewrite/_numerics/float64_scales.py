"""A GPU's dynamic quantization and epilogue: each slice's scale taken inside its absmax reduction, in float64, and
read by the epilogue as it is.

XLA's GPU compiler makes the per-row work between a row's absmax and its uses (the scale ``absmax / 127``, its split
into mantissa and power of two, the epilogue factors) a kernel of its own per dot: it does not repeat it inside the
kernels that read it (the 4 x 1024 MLP of ``benchmarks/accelerators.py``: 17 kernels on an H200, a transformer block
34). Here every element contributes its own candidate scale, ``|x| / 127`` rounded to a float32 significand (24 bits,
its exponent unbounded) in float64, and a slice's scale is their maximum: the rounding is monotone, so that maximum is
the absmax's rounded quotient, the contract's scale, bit for bit. The codes divide by it per element
(:func:`quantize_with_float64_scales`), and the epilogue multiplies by it in float64 and rounds once
(:func:`scale_product_in_float64`), so no kernel works per row: the MLP launches 13 kernels and the block 26 (28 since
the GEMMs take int8 buffers, :mod:`~jaxpr_rewrite._dots.int8_dot`), at most the hand-written program's (13 and 28). The
divide stays per element because a per-row reciprocal made XLA compute it in a kernel of its own again; it is about ten
float64 operations, cheap where FP64 runs at half the FP32 rate, as on A100/H100/H200, and not on GPUs with 1/64-rate
FP64. :func:`quantize_by_float64` gives the same quantization with float32 epilogue factors, for the ragged dot's
epilogue.

Why each rounding is exact (``n``, ``d`` float32 values, ``N``, ``D`` their integer significands, below ``2**24``):

* ``fl64(|x| * fl64(1 / limit))`` is within ``2**-52`` relative of ``|x| / limit``, which is never a midpoint between
  two 24-bit significands (``N = limit * M * 2**k`` for an odd 25-bit ``M`` has more than 24 bits) and otherwise at
  least ``1 / (limit * M) > 2**-32`` relative from one: rounding the float64 to 24 bits gives the correctly rounded
  quotient, whatever its exponent (subnormal absmaxes included).
* ``fl32(fl64(n / d))``, the codes' quotient, is ``fl32(n / d)``: a quotient of two 24-bit significands is never a
  float32 midpoint and otherwise more than ``2**-49`` relative from one (:func:`~jaxpr_rewrite._numerics.exact_division.
  rounded_quotients_by_float64`), farther than a float64 division's rounding. A GPU's float64 division and
  conversions are IEEE's (XLA's approximate division is float32's ``div.full.f32``).
* The epilogue's float64 products are exact: each multiplies a float32 significand (24 bits) by another and by
  powers of two, 48 bits, within float64's range by hundreds of binades. The result is then rounded twice, as the
  contract's ``(acc * s_rhs) * s_lhs`` is: first to 24 bits (``fl32(acc * f)`` for a weight's stored factor, or
  :func:`rounded_significands`), then, once, to float32.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np
from jax import lax

from .quantize import (FORMATS, INT8_MAX, clipped_codes, epilogue_window, float_format, nan_safe_magnitude, pow2,
                       to_compute)

__all__ = ["FLOOR_SCALE", "nan_safe_magnitude_of_bits", "quantize_by_float64", "quantize_with_float64_scales",
           "rounded_significands", "scale_candidates", "scale_product_in_float64"]

_FLOAT32, _FLOAT64 = FORMATS[np.dtype(np.float32)], FORMATS[np.dtype(np.float64)]
# float64 significand bits below a float32 significand's 24
_DROPPED_BITS = _FLOAT64.mantissa_bits - _FLOAT32.mantissa_bits
# a slice of zeros' float64 scale: the smallest normal float64, below every slice's real scale (at least
# 2**-149 / 127), so its zeros divide into zero codes and its zero sums scale to zero, with no select per slice (XLA's
# GPU compiler made that select a kernel of its own)
FLOOR_SCALE = np.float64(np.finfo(np.float64).tiny)


def rounded_significands(values):
    """Float64 ``values`` rounded to the nearest float32 significand (24 bits, ties to even), their exponent
    unbounded, on the bits: the dropped part rounded into the kept one (a carry moves into the exponent field), so a
    value's sign and range stay as they are. 0 and Inf stay as they are.

    Integer arithmetic because a float32 round trip is not one to XLA: with its default
    ``xla_allow_excess_precision`` it removes a ``float64 -> float32 -> float64`` conversion pair as an excess
    precision it may keep (and a float32 would bound the exponent)."""
    bits = lax.bitcast_convert_type(values, np.int64)
    kept_lowest = lax.bitwise_and(lax.shift_right_logical(bits, np.int64(_DROPPED_BITS)), np.int64(1))
    below_half = np.int64((1 << (_DROPPED_BITS - 1)) - 1)
    kept = np.int64(~((1 << _DROPPED_BITS) - 1))
    return lax.bitcast_convert_type(lax.bitwise_and(lax.add(lax.add(bits, below_half), kept_lowest), kept),
                                    np.float64)


def _own_exponents(scale):
    """``e`` with the float64 ``scale`` in ``[2**(e - 7), 2**(e - 6))``: the absmax's power of two, or one more
    for the mantissas whose quotient by 127 reaches ``2**-6``; at most 128 (for an infinite scale)."""
    bits = lax.bitcast_convert_type(scale, np.int64)
    power = lax.convert_element_type(lax.shift_right_logical(bits, np.int64(_FLOAT64.mantissa_bits)), np.int32)
    return lax.min(lax.sub(power, np.int32(_FLOAT64.bias - 7)), np.int32(128))


def _split(scale, own):
    """The float64 ``scale`` (a float32 significand times a power of two, or Inf) as
    :func:`~jaxpr_rewrite._numerics.quantize.quantize_parts` holds it, ``scales * 2**exponents``: ``exponents`` the
    absmax's power of two (within ``[-127, 126]``), ``scales`` in ``[1/127, 2/127)`` (beyond in the end binades).

    ``own`` (:func:`_own_exponents`) is that power of two or one more: one more where it leaves ``scales`` below
    ``1/127``. One float32 scale stands for two absmaxes, ``2**e`` and the float32 below it (whose quotient by 127
    rounds up to ``2/127``); it is split as ``2**e``'s."""
    lowest = np.float64(np.float32(1) / np.float32(INT8_MAX))
    below = lax.lt(lax.mul(scale, pow2(lax.neg(own), np.float64)), lowest)
    exponents = lax.clamp(np.int32(-127), lax.sub(own, lax.convert_element_type(below, np.int32)), np.int32(126))
    return lax.convert_element_type(lax.mul(scale, pow2(lax.neg(exponents), np.float64)), np.float32), exponents


def _factors(scale, own):
    """The epilogue factors of the float64 ``scale``, ``(scale * 2**(c - own), 2**(own - c))`` with ``c = clip(own, -60,
    60)`` (:func:`~jaxpr_rewrite._numerics.quantize.epilogue_factors`' window): the first in ``[2**-7, 2**-6) times
    ``2**c``, the second 1 wherever ``own`` is within the window. Split by the scale's own power of two rather than the
    absmax's, so they need nothing but the scale's exponent bits (XLA repeats that inside the kernel reading them, where
    it kept a correction to the absmax's exponent in a kernel of its own); the window's guarantees hold as for
    :func:`~jaxpr_rewrite._numerics.quantize.epilogue_factors`, whose first factor lies in ``[2**-7, 2**-5)`` times
    ``2**c``, and so the epilogue's products are the same."""
    window = epilogue_window(_FLOAT32)
    clipped = lax.clamp(np.int32(-window), own, np.int32(window))
    factor = lax.convert_element_type(lax.mul(scale, pow2(lax.sub(clipped, own), np.float64)), np.float32)
    return factor, pow2(lax.sub(own, clipped))


def nan_safe_magnitude_of_bits(values):
    """``|x|`` with NaN as Inf (:func:`~jaxpr_rewrite._numerics.quantize.nan_safe_magnitude`, bit for bit) from the
    bits: the sign bit cleared and every NaN (the patterns above Inf's) lowered to Inf, integer operations and no
    comparison.

    A matrix scaled per column (the weight of ``x @ w``) is quantized in the transposed layout XLA's int8 GEMM reads
    it in, and XLA's GPU compiler made the comparison of the select form a transposing kernel of its own per such
    matrix: the 4 x 1024 MLP of ``benchmarks/accelerators.py`` handed float weights launched 34 kernels on an H200,
    30 with this form. Every other operand keeps the select, which fuses as well or better there (this form in
    every operand: the transformer block with static weight scales 27 kernels instead of 24; in attention's ``v``,
    scaled over the sequence, the ``int8-fused`` block 22 instead of 21)."""
    fmt = float_format(values)
    magnitude_bits = lax.bitwise_and(lax.bitcast_convert_type(values, fmt.bits), fmt.bits(np.iinfo(fmt.bits).max))
    infinity_bits = np.asarray(np.inf, fmt.dtype).view(fmt.bits)
    return lax.bitcast_convert_type(lax.min(magnitude_bits, infinity_bits), fmt.dtype)


def scale_candidates(magnitudes):
    """Each magnitude's candidate scale, ``|x| / 127`` rounded to a float32 significand in float64 (its exponent
    unbounded), and at least :data:`FLOOR_SCALE`: a slice's scale is the maximum of its candidates, which is its
    absmax's candidate (the rounding is monotone), the contract's ``absmax / 127``, and ``FLOOR_SCALE`` for a slice of
    zeros. The floor is taken per element, not left to the reduction's initial value: XLA drops that value where it
    reduces over a dimension of size 1 (for a max it is meant to be an identity), which gave a one-element slice of
    zeros the scale 0."""
    with jax.enable_x64(True):
        candidates = rounded_significands(lax.mul(lax.convert_element_type(magnitudes, np.float64),
                                                  np.float64(1) / np.float64(INT8_MAX)))
        return lax.max(candidates, FLOOR_SCALE)


def quantize_by_float64(x, reduce_axes: Sequence[int]):
    """The contract's int8 quantization of ``x`` (a float32, bfloat16 or float16 array) with one scale per slice
    over ``reduce_axes``, the scale taken inside the absmax reduction in float64.

    Arguments:
        x: the operand.
        reduce_axes: the axes one scale covers (the dot's contracting dims).

    Returns:
        ``(codes, scales, exponents, factors)``, as :func:`~jaxpr_rewrite._numerics.quantize.quantize_dynamic_parts`
        returns them: the codes, scales and exponents of :func:`~jaxpr_rewrite._numerics.quantize.quantize_parts`, bit
        for bit (a slice holding NaN or Inf has an infinite scale), and epilogue factors (:func:`_factors`) that give
        the epilogue of its scales' :func:`~jaxpr_rewrite._numerics.quantize.epilogue_factors`.
    """
    codes, scales, exponents, scale = quantize_with_float64_scales(x, reduce_axes)
    with jax.enable_x64(True):
        scale = lax.select(lax.eq(scale, FLOOR_SCALE), lax.full_like(scale, 1), scale)
        factors = _factors(scale, _own_exponents(scale))
    return codes, scales, exponents, factors


def quantize_with_float64_scales(x, reduce_axes: Sequence[int]):
    """:func:`quantize_by_float64`'s codes, scales and exponents, and each slice's scale as one float64 value for
    :func:`scale_product_in_float64`: ``scales * 2**exponents`` exactly, Inf for a slice holding NaN or Inf, and
    for a slice of zeros (whose contract scale is 1) the smallest normal float64, which its zero sums scale to
    zero as well."""
    reduce_axes = tuple(reduce_axes)
    kept_axes = tuple(a for a in range(x.ndim) if a not in reduce_axes)
    values = to_compute(x)
    scaled_per_column = x.ndim == 2 and reduce_axes == (0,)
    magnitudes = (nan_safe_magnitude_of_bits if scaled_per_column else nan_safe_magnitude)(values)
    with jax.enable_x64(True):  # float64 inside the program, whatever the program's own setting
        # FLOOR_SCALE is far below any slice's scale: a slice of zeros (or none) keeps it
        scale = lax.reduce(scale_candidates(magnitudes), FLOOR_SCALE, lax.max, reduce_axes)
        zero = lax.eq(scale, FLOOR_SCALE)
        divided = lax.div(lax.convert_element_type(values, np.float64),
                          lax.broadcast_in_dim(scale, values.shape, kept_axes))
        codes = clipped_codes(lax.round(lax.convert_element_type(divided, np.float32),
                                        lax.RoundingMethod.TO_NEAREST_EVEN))
        scales, exponents = _split(scale, _own_exponents(scale))
    scales = lax.select(zero, lax.full_like(scales, 1), scales)
    exponents = lax.select(zero, lax.full_like(exponents, 0), exponents)
    return codes, scales, exponents, scale


def scale_product_in_float64(acc, lhs, rhs):
    """``acc * s_lhs * s_rhs`` for float32 sums on a GPU: the contract's ``(acc * s_rhs) * s_lhs`` with its first
    product rounded to a float32 significand and the second rounded once, from float64, to the float32 result.

    Arguments:
        acc: the sums, float32, in the dot's output layout.
        lhs, rhs: each operand's scales placed into ``acc``'s layout: one float64 array (the slice scales of
            :func:`quantize_with_float64_scales`), or a pair of float32 :func:`~jaxpr_rewrite._numerics.quantize.
            epilogue_factors` ``(f, g)`` (a pre-quantized weight's stored ones; a weight on the right keeps its
            ``acc * f`` in float32, the multiply XLA fuses into its GEMM kernel).

    Each float64 product is exact (two 24-bit significands, and powers of two, far inside float64's range), so the
    result is ``fl32(fl24(acc * s_rhs) * s_lhs)``, ``fl24`` rounding to a float32 significand with the exponent
    unbounded: wherever the contract's product and its intermediate are normal floats, that formula bit for bit, and
    elsewhere one rounding closer to the exact product than :func:`~jaxpr_rewrite._numerics.quantize.scale_product`,
    with no intermediate to overflow or underflow. The epilogue reads each activation's float64 scale straight from its
    absmax reduction: no kernel computes per-row factors (a transformer block on an H200: 26 kernels instead of 34, the
    hand-written program's 28)."""
    with jax.enable_x64(True):
        wide = functools.partial(lax.convert_element_type, new_dtype=np.float64)
        if isinstance(rhs, tuple):
            factor, power = rhs
            first = lax.mul(wide(lax.mul(acc, factor)), wide(power))  # fl32(acc * f) is fl24(acc * s) times 1/power
        else:
            first = rounded_significands(lax.mul(wide(acc), rhs))
        if isinstance(lhs, tuple):
            factor, power = lhs
            product = lax.mul(lax.mul(first, wide(factor)), wide(power))
        else:
            product = lax.mul(first, lhs)
        return lax.convert_element_type(product, np.float32)
