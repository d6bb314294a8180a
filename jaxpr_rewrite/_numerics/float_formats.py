"""The bit layouts of the compute dtypes (float32, float64), for the exact arithmetic on scales and quotients, and
the exact widening of bfloat16 and float16 to float32."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["FORMATS", "FloatFormat", "float_format", "pow2", "widened"]


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


def float_format(x) -> FloatFormat:
    """The bit layout of ``x``'s dtype (a compute dtype: float32 or float64)."""
    return FORMATS[np.dtype(x.dtype)]


def pow2(exponent, dtype=np.float32):
    """``2.0 ** exponent`` in ``dtype``, exactly, for int32 ``exponent`` in ``[1 - bias, bias]``."""
    fmt = FORMATS[np.dtype(dtype)]
    biased = lax.convert_element_type(lax.add(exponent, np.int32(fmt.bias)), fmt.bits)
    return lax.bitcast_convert_type(lax.shift_left(biased, fmt.bits(fmt.mantissa_bits)), fmt.dtype)


def widened(x, dtype=np.float32):
    """``x`` converted to the wider float ``dtype``, exactly; a bfloat16 or float16 ``x`` through its bits.

    XLA's GPU compiler removes a ``float32 -> float16 -> float32`` (or bfloat16) pair of conversions under its
    default ``xla_allow_excess_precision`` (SimplifyFPConversions): where a model casts a float32 value to float16
    right before its dot, a plain widening would hand the quantizer the unrounded float32 value. XLA cannot see
    through a bitcast, so the narrow value's bits are widened with integer ops instead, to the same number
    ``convert_element_type`` gives. (``reduce_precision`` keeps a bfloat16 rounding, but XLA's float16 one flushes
    float16's subnormals, 2**-24 to 2**-14, to zero; the bits are also the cheaper widening of bfloat16 on GPUs.)"""
    narrow = np.dtype(x.dtype)
    if narrow == np.dtype(jnp.bfloat16):
        # bfloat16 is float32's top half
        bits = lax.convert_element_type(lax.bitcast_convert_type(x, np.uint16), np.uint32)
        x = lax.bitcast_convert_type(lax.shift_left(bits, np.uint32(16)), np.float32)
    elif narrow == np.dtype(np.float16):
        x = _float16_to_float32(x)
    return x if x.dtype == np.dtype(dtype) else lax.convert_element_type(x, dtype)


def _float16_to_float32(x):
    """A float16 ``x`` as float32, from its bits (sign 1, exponent 5 with bias 15, mantissa 10)."""
    bits = lax.convert_element_type(lax.bitcast_convert_type(x, np.uint16), np.uint32)
    magnitude = lax.bitwise_and(bits, np.uint32(0x7FFF))
    sign = lax.shift_left(lax.shift_right_logical(bits, np.uint32(15)), np.uint32(31))
    exponent = lax.shift_right_logical(magnitude, np.uint32(10))
    # a normal number: the mantissa moves up 13 bits and the exponent is rebiased from 15 to 127; Inf and NaN
    # (exponent 31) become float32's exponent 255 with the same mantissa, so NaN stays NaN
    rebias = lax.select(lax.eq(exponent, np.uint32(31)), lax.full_like(bits, (255 - 31) << 23),
                        lax.full_like(bits, (127 - 15) << 23))
    normal = lax.add(lax.shift_left(magnitude, np.uint32(13)), rebias)
    # a subnormal (exponent 0) is mantissa * 2**-24, a normal float32: the product is exact (zero stays zero)
    subnormal = lax.bitcast_convert_type(
        lax.mul(lax.convert_element_type(magnitude, np.float32), np.float32(2.0**-24)), np.uint32)
    wide = lax.select(lax.eq(exponent, np.uint32(0)), subnormal, normal)
    return lax.bitcast_convert_type(lax.bitwise_or(wide, sign), np.float32)
