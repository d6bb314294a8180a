"""Dynamic scales computed inside the absmax reduction, for XLA's GPU compiler: the contract's ``absmax / 127`` as
the maximum of the elements' own quotients, so no division is left between the reduction and the codes.

A correctly rounded division by a positive constant is monotone, so over a slice the maximum of ``fl(|x| / d)`` is
``fl(max|x| / d)``, bit for bit. With ``d = 127/128`` that is ``t = 128 * s`` for the slice's scale ``s = a / 127``,
a normal float for every normal ``a``: the slice's ``scales`` are ``t``'s mantissa times ``2**-7`` and its
``exponents`` ``t``'s exponent. ``t`` overflows only for ``a`` in the top ``1/128`` of the float range; there the
element's quotient is taken with ``d = 254`` (``s / 2``, a normal float) and moved to the bits ``t`` would have if
its exponent field went one past the largest, which in the integer order of the bits sorts above every finite
``t``: one integer maximum per slice holds either. NaN and Inf get the largest bits of all, which decode to a NaN
scale (every output of the slice NaN, as with the CPU program's dynamic scales).

The decoding is integer arithmetic on those bits, with no selection between two decodings: XLA's GPU compiler
repeats a per-slice computation that small inside each kernel that reads it (the quantization, the next layer's
epilogue), while a division per slice, or a select on the bits, it keeps as a kernel of its own (the H200 MLP of
``benchmarks/accelerators.py``: 13 kernels this way, the hand-written program's count; 16-17 otherwise). XLA:TPU
estimates this form 6-8% more cycles than the division per slice and on CPU it ran 1.2-1.9x slower (a division per
element), so only the CUDA lowering of a matrix operand takes it (:func:`~jaxpr_rewrite.operands.quantize_operand`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from jax import lax

from .quantize import (FORMATS, INT8_MAX, clipped_codes, epilogue_factors, float_format, max_over, nan_safe_magnitude,
                       pow2, rounded_quotients, to_compute, true_divide)

__all__ = ["quantize_scaled_max_parts"]

ABOVE_DIVISOR, TOP_DIVISOR = INT8_MAX / 128, 2 * INT8_MAX  # a / d: 128 * s, and s / 2 at the top of the range
EXPONENT_OFFSET = 7  # s = t * 2**-7


def _largest_dividend(dtype) -> np.ndarray:
    """The largest finite ``y`` whose ``fl(y / ABOVE_DIVISOR)`` is finite (``y`` above it: the top branch)."""
    divisor, y = dtype(ABOVE_DIVISOR), dtype(np.finfo(dtype).max * ABOVE_DIVISOR)
    with np.errstate(over="ignore"):
        while np.isfinite(np.nextafter(y, dtype(np.inf)) / divisor):
            y = np.nextafter(y, dtype(np.inf))
        while not np.isfinite(y / divisor):
            y = np.nextafter(y, dtype(0))
    return y


LARGEST_DIVIDEND = {dtype: _largest_dividend(fmt.dtype) for dtype, fmt in FORMATS.items()}


def _slice_maximum(magnitude, reduce_axes: tuple):
    """Per slice, the integer maximum of each element's quotient bits (module docstring)."""
    fmt = float_format(magnitude)
    top = lax.gt(magnitude, lax.full_like(magnitude, LARGEST_DIVIDEND[np.dtype(fmt.dtype)]))
    divisor = lax.select(top, lax.full_like(magnitude, TOP_DIVISOR), lax.full_like(magnitude, ABOVE_DIVISOR))
    bits = lax.bitcast_convert_type(true_divide(magnitude, divisor), fmt.bits)
    # at the top, s / 2 (just above 2**(bias - 7)) moves 8 exponent fields up, past the largest; Inf, first capped
    # below 2**(bias - 6), lands on the largest bits of all
    below_cap = fmt.bits(((2 * fmt.bias - 6) << fmt.mantissa_bits) - 1)
    moved = lax.add(lax.min(bits, below_cap), fmt.bits(8 << fmt.mantissa_bits))
    return max_over(lax.select(top, moved, bits), reduce_axes)


def _decoded(most, fmt):
    """``(scales, exponents)`` of a slice from its maximum's bits, with integer arithmetic alone."""
    mantissa_bits = fmt.bits(fmt.mantissa_bits)
    # 2**-exponents stays normal: the exponent is capped one below the bias, which t's top binade and the top of
    # the range reach; their scales are then 2 and 4 times larger
    exponents = lax.min(lax.sub(lax.shift_right_logical(most, mantissa_bits), fmt.bits(fmt.bias)),
                        fmt.bits(fmt.bias - 1))
    # scales = t's mantissa with the exponent field bias - 7 (or one and two more at the top): the larger of the two
    # bit patterns, as the cap above takes the smaller exponent
    mantissa = lax.bitwise_and(most, fmt.bits((1 << fmt.mantissa_bits) - 1))
    scale_bits = lax.max(lax.add(mantissa, fmt.bits((fmt.bias - EXPONENT_OFFSET) << fmt.mantissa_bits)),
                         lax.sub(most, fmt.bits((fmt.bias + EXPONENT_OFFSET - 1) << fmt.mantissa_bits)))
    # a slice holding NaN or Inf has the largest bits, which the +1 wraps to the sign bit: all ones, a NaN scale
    nonfinite = lax.shift_right_arithmetic(lax.add(most, fmt.bits(1)), fmt.bits(8 * np.dtype(fmt.bits).itemsize - 1))
    scales = lax.bitcast_convert_type(lax.bitwise_or(scale_bits, nonfinite), fmt.dtype)
    # an all-zero slice (or one of subnormals, which XLA reads as zero): scale 1
    zero = lax.lt(most, fmt.bits(1 << fmt.mantissa_bits))
    scales = lax.select(zero, lax.full_like(scales, 1), scales)
    exponents = lax.convert_element_type(lax.select(zero, lax.full_like(exponents, 0), exponents), np.int32)
    return scales, exponents


def quantize_scaled_max_parts(x, reduce_axes: Sequence[int]):
    """The contract's quantization of a dot operand, its scale computed inside the absmax reduction.

    The codes are :func:`~jaxpr_rewrite.quantize.quantize_parts`' bit for bit and each slice's scale
    ``scales * 2**exponents`` is the same value, ``absmax / 127`` correctly rounded (1 for an all-zero slice); a
    slice holding NaN or Inf gets a NaN scale, as :func:`~jaxpr_rewrite.quantize.quantize_dynamic_parts` gives it.
    The split of the value between ``scales`` and ``exponents`` is this function's own (``scales`` in
    ``[2**-7, 2**-6)`` below the top binade). Subnormal inputs are read as zero, as XLA reads them on the GPU.

    Arguments:
        x: a floating array.
        reduce_axes: the axes one scale covers (the dot's contracting dims).

    Returns:
        ``(codes, scales, exponents, factors)``: as :func:`~jaxpr_rewrite.quantize.quantize_dynamic_parts`
        returns them.
    """
    reduce_axes = tuple(reduce_axes)
    kept_axes = tuple(a for a in range(x.ndim) if a not in reduce_axes)
    values = to_compute(x)
    fmt = float_format(values)
    scales, exponents = _decoded(_slice_maximum(nan_safe_magnitude(values), reduce_axes), fmt)
    codes = clipped_codes(rounded_quotients(values, scales, pow2(lax.neg(exponents), fmt.dtype), kept_axes))
    return codes, scales, exponents, epilogue_factors(scales, exponents)
