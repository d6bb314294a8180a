"""Symmetric int8 quantization with one scale per slice: the seed contract's ``absmax / 127`` rule.

Everything here is written with ``lax`` primitives (not ``jnp.where``/``jnp.round``/``jnp.clip``), so a
rewritten jaxpr reads as a flat list of equations instead of nested ``jit[_where]`` calls.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

INT8_MAX = 127
# The largest contraction whose int8 x int8 products cannot overflow an int32 sum: 127 * 127 * K < 2**31.
MAX_INT32_SAFE_CONTRACTION = (2**31 - 1) // (INT8_MAX * INT8_MAX)
SMALLEST_NORMAL = np.finfo(np.float32).tiny


class Quantized(NamedTuple):
    """int8 codes and the float32 scales they were divided by.

    Attributes:
        codes: int8 array of the operand's shape.
        scales: float32 array over the operand's kept (non-reduced) axes, in their original order.
    """

    codes: jnp.ndarray
    scales: jnp.ndarray


def absmax_scale(x, reduce_axes: Sequence[int]):
    """``absmax / 127`` over ``reduce_axes`` in float32, with ``1`` where the slice is all zero.

    Arguments:
        x: a floating array.
        reduce_axes: the axes one scale covers (for a dot operand: its contracting dims).

    Returns:
        float32 scales over the remaining axes, in their original order. A slice holding NaN or Inf gets a
        non-finite scale, so every output that depends on it comes out non-finite. A nonzero slice whose
        scale would be subnormal (absmax below ``127 * 1.18e-38``) gets the smallest normal float32.
    """
    x32 = x if x.dtype == np.float32 else lax.convert_element_type(x, np.float32)
    amax = lax.reduce_max(lax.abs(x32), tuple(reduce_axes))
    if any(x.shape[a] == 0 for a in reduce_axes):
        # reduce_max of an empty slice is -inf; an empty slice is an all-zero slice.
        amax = lax.max(amax, np.float32(0))
    # XLA flushes subnormal floats to zero on CPU and GPU: an absmax below 127 * FLT_MIN would give a zero
    # scale and divide by it. Such slices get the smallest normal scale instead (their products underflow
    # to zero in float32 either way); NaN still propagates through max.
    scale = lax.max(lax.div(amax, np.float32(INT8_MAX)), np.float32(SMALLEST_NORMAL))
    return lax.select(lax.eq(amax, np.float32(0)), lax.full_like(amax, 1.0), scale)


def quantize(x, reduce_axes: Sequence[int]) -> Quantized:
    """Quantize ``x`` to int8 with one symmetric scale per slice over ``reduce_axes``.

    ``codes = clip(round(x / scale), -127, 127)``, rounding to nearest even.

    Arguments:
        x: a floating array (bfloat16 and float16 are upcast to float32 first).
        reduce_axes: the axes one scale covers.

    Returns:
        A :class:`Quantized` with the codes and the scales.
    """
    reduce_axes = tuple(sorted(a % max(x.ndim, 1) for a in reduce_axes))
    kept_axes = tuple(a for a in range(x.ndim) if a not in reduce_axes)
    scales = absmax_scale(x, reduce_axes)
    x32 = x if x.dtype == np.float32 else lax.convert_element_type(x, np.float32)
    scaled = lax.div(x32, lax.broadcast_in_dim(scales, x.shape, kept_axes))
    rounded = lax.round(scaled, lax.RoundingMethod.TO_NEAREST_EVEN)
    clipped = lax.clamp(np.float32(-INT8_MAX), rounded, np.float32(INT8_MAX))
    return Quantized(lax.convert_element_type(clipped, np.int8), scales)


def dequantize(q: Quantized, reduce_axes: Sequence[int]):
    """``codes * scales`` in float32: the value a :class:`Quantized` stands for.

    Arguments:
        q: codes and scales, the scales over the axes not in ``reduce_axes``.
        reduce_axes: the axes each scale covers.
    """
    ndim = q.codes.ndim
    kept = tuple(a for a in range(ndim) if a not in {r % max(ndim, 1) for r in reduce_axes})
    codes = lax.convert_element_type(q.codes, np.float32)
    return lax.mul(codes, lax.broadcast_in_dim(q.scales, q.codes.shape, kept))
