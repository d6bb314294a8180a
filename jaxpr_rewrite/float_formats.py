"""The bit layouts of the compute dtypes (float32, float64), for the exact arithmetic on scales and quotients."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from jax import lax

__all__ = ["FORMATS", "FloatFormat", "float_format", "pow2"]


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
