"""Static (calibrated) activation scales: the scale with what the hot path needs precomputed, stored as one vector,
and the quantization of an activation with it (one multiply, round and clip per element; no absmax)."""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import numpy as np
from jax import lax

from .exact_division import reciprocal
from .int32_dot import with_a_zero_row
from .layout import is_static
from .quantize import (NONFINITE_CODE, compute_dtype, epilogue_factors, holds_nonfinite, marked_codes, poison,
                       saturated_codes, scale_parts, to_compute)

__all__ = ["SMALLEST_STATIC_ABSMAX", "StaticScale", "quantize_static_parts", "smallest_static_absmax"]


def smallest_static_absmax(dtype) -> float:
    """The smallest nonzero calibrated absmax a static scale of activations of ``dtype`` takes: its codes are one
    multiply by the reciprocal ``2**-e / scales`` (up to ``127 * 2**-e``) in their compute dtype, finite for
    ``e >= 7 - maxexp`` and infinite below (every code saturated): 2**-121 for float32 (and the narrower floats it
    computes), 2**-1017 for float64."""
    return 2.0 ** (7 - np.finfo(compute_dtype(dtype)).maxexp)


# The float32 one (activations of float32, bfloat16 and float16)
SMALLEST_STATIC_ABSMAX = smallest_static_absmax(np.float32)


class StaticScale(NamedTuple):
    """A calibrated per-tensor activation scale ``absmax / 127``, with what the hot path needs precomputed (0-d
    arrays in the compute dtype). A weight stores it as one vector (:meth:`stored`), so it travels, is checkpointed
    and exported like the weight's other arrays.

    Attributes:
        absmax: the calibrated absmax.
        reciprocal: what the codes multiply by, ``2**-e / scales`` of the scale ``scales * 2**e`` (1 for an
            all-zero calibration).
        factor, power: the scale's :func:`epilogue_factors`.
    """

    absmax: object
    reciprocal: object
    factor: object
    power: object

    @classmethod
    def of(cls, amax) -> "StaticScale":
        """The static scale of a calibrated absmax (a finite non-negative scalar)."""
        amax = to_compute(amax)
        scales, exponents, prescale = scale_parts(amax)
        zero = lax.eq(amax, amax.dtype.type(0))
        # 2**-e / scales: the power of two is exact, and the reciprocal correctly rounded on every platform
        multiplier = lax.select(zero, lax.full_like(scales, 1), lax.mul(prescale, reciprocal(scales)))
        return cls(amax, multiplier, *epilogue_factors(scales, exponents))

    def stored(self):
        """The scale as one vector of its fields, in order."""
        return lax.concatenate([lax.reshape(to_compute(v, self.absmax.dtype), (1,)) for v in self], 0)

    @classmethod
    def stored_in(cls, vector) -> "StaticScale":
        """The scale a :meth:`stored` vector holds. On TPU each field is a masked sum of the vector (exact: the fields
        are finite): XLA:TPU makes a kernel of each slice of it (the static MLP of ``benchmarks/accelerators.py``:
        5-8% of its estimated cycles), as XLA's GPU compiler does of each reduction."""
        count = len(cls._fields)
        return cls(*lax.platform_dependent(vector, tpu=functools.partial(_fields_by_masks, count=count),
                                           default=functools.partial(_fields_by_slices, count=count)))


def _fields_by_masks(vector, count: int) -> tuple:
    masks = np.eye(count, dtype=vector.dtype)
    return tuple(lax.reduce_sum(lax.mul(vector, mask), (0,)) for mask in masks)


def _fields_by_slices(vector, count: int) -> tuple:
    return tuple(lax.index_in_dim(vector, i, keepdims=False) for i in range(count))


def quantize_static_parts(x, static: StaticScale, reduce_axes: Sequence[int], tpu_sums_values: bool = False):
    """Quantization of ``x`` with one calibrated (static) scale for the whole array.

    The hot path of static activation scales: no absmax and no scale computation per call; the codes are one
    multiply by the precomputed reciprocal of the scale, a round to nearest even and a clip, so values beyond the
    calibrated range saturate at +-127. NaN and Inf still make every output they feed non-finite: they get the code
    -128, which no finite value gets, and the minimum code of each slice over ``reduce_axes`` (a reduction over the
    int8 codes, fused into the quantization's pass) makes that slice's scale NaN. A GPU takes each slice's factor
    straight from a reduction over the codes instead (:func:`_factor_or_inf`), Inf for a slice holding NaN or Inf,
    so its outputs are Inf or NaN, as with dynamic scales. With ``tpu_sums_values``, a TPU takes each slice's factor
    from a sum over its values (:func:`_sum_with_nonfinite`): the same factors as the CPU's, bit for bit; its codes
    are then not marked (:func:`~jaxpr_rewrite.quantize.saturated_codes`): a slice holding NaN or Inf has a NaN
    factor, whatever its codes.

    Arguments:
        x: a floating array.
        static: the calibrated scale.
        reduce_axes: the axes one slice covers (the dot's contracting dims).
        tpu_sums_values: whether a TPU marks the slices holding NaN or Inf with a sum over the values rather than
            the codes' minimum: for a matrix feeding a weight's dot, where it saves a kernel per dot. In a
            transformer block (activations of rank 3 and 4) XLA:TPU fused the sums less well than the minimum
            (``docs/performance.md``).

    Returns:
        ``(codes, scales, exponents, factors)``: int8 codes and, per slice over the other axes, the scale as
        :func:`quantize_parts` lays it out (``scales * 2**exponents``, NaN ``scales`` for a non-finite slice) and
        its :func:`epilogue_factors`.
    """
    reduce_axes = tuple(reduce_axes)
    kept_shape = tuple(x.shape[a] for a in range(x.ndim) if a not in reduce_axes)
    values = to_compute(x)
    quotients = lax.mul(values, to_compute(static.reciprocal, values.dtype))
    if tpu_sums_values:  # the TPU finds NaN and Inf in the values' sum, and needs no marks in the codes
        codes = lax.platform_dependent(values, quotients, tpu=lambda values, quotients: saturated_codes(quotients),
                                       default=marked_codes)
    else:
        codes = marked_codes(values, quotients)

    def per_slice(value):
        return lax.broadcast(to_compute(value, values.dtype), kept_shape)

    def poisoned_by_codes(values, codes, factor):
        return lax.add(per_slice(factor), poison(_holds_nonfinite_as_dot_reads(codes, reduce_axes),
                                                 per_slice(factor)))

    def poisoned_by_values(values, codes, factor):
        return _sum_with_nonfinite(values, factor, reduce_axes)

    def infinite_by_codes(values, codes, factor):
        return _factor_or_inf(codes, factor, reduce_axes)

    # the factor per slice, NaN (Inf on a GPU) for a slice holding NaN or Inf
    factor = to_compute(static.factor, values.dtype)
    on_tpu = poisoned_by_values if tpu_sums_values else poisoned_by_codes
    factor = lax.platform_dependent(values, codes, factor, cpu=poisoned_by_codes, tpu=on_tpu,
                                    default=infinite_by_codes)
    nonfinite = lax.sub(factor, factor)  # 0, NaN for a slice holding NaN or Inf
    # the scale as quantize_parts holds it, for the operand's other uses (the dot itself reads the factors)
    scale, exponent, _ = scale_parts(to_compute(static.absmax, values.dtype))
    return (codes, lax.add(per_slice(scale), nonfinite), lax.broadcast(exponent, kept_shape),
            (factor, per_slice(static.power)))


def _holds_nonfinite_as_dot_reads(codes, reduce_axes: tuple):
    """:func:`~jaxpr_rewrite.quantize.holds_nonfinite` per slice of ``codes``; for a matrix of one row (batch-1
    inference), over the codes as a CPU's int8 dot reads them, padded to two rows
    (:func:`~jaxpr_rewrite.int32_dot.with_a_zero_row`; only a GPU's program pads the contraction too): XLA:CPU then
    computes the codes once, with the previous layer's epilogue in the same kernel, instead of once more for the
    check (an MLP layer: 3 kernels instead of 5)."""
    if codes.ndim == 2 and reduce_axes == (1,) and is_static(codes.shape[0]) and codes.shape[0] == 1:
        return lax.slice(holds_nonfinite(with_a_zero_row(codes, 0), reduce_axes), (0,), (1,))
    return holds_nonfinite(codes, reduce_axes)


def _factor_or_inf(codes, factor, reduce_axes: tuple):
    """``factor`` per slice of ``codes`` over ``reduce_axes``, Inf for a slice holding the code -128 (NaN or Inf,
    :func:`~jaxpr_rewrite.quantize.marked_codes`), as one reduction's output: the maximum of ``factor`` or Inf per
    element, exact whatever its order (no NaN enters it).

    XLA's GPU compiler makes a kernel of its own of per-slice arithmetic after a reduction that it cannot fuse into
    the kernels that read it (NaN marked from the minimum code, then added to the factor): the transformer block of
    ``benchmarks/accelerators.py`` with static scales launched 28 kernels (23 with its attention static too), 24
    (21) with the factor taken from this reduction, which joins the quantization's pass.
    """
    marked = lax.eq(codes, lax.full_like(codes, NONFINITE_CODE))
    placed = lax.select(marked, lax.full(codes.shape, np.inf, factor.dtype),
                        lax.full(codes.shape, factor, factor.dtype))
    most = lax.reduce_max(placed, reduce_axes)
    if any(codes.shape[a] == 0 for a in reduce_axes):
        most = lax.max(most, factor)  # the maximum of an empty slice is -Inf: it holds no NaN, its factor is factor
    return most


def _sum_with_nonfinite(values, value, reduce_axes: tuple):
    """``value`` per slice of ``values`` over ``reduce_axes``, NaN for a slice holding NaN or Inf, as one reduction's
    output: the slice's sum of ``x - x`` (0 for a finite ``x``, NaN otherwise) with ``value`` added at its first
    element, exact in whatever order the sum runs (an empty slice gives 0).

    XLA:TPU makes a kernel of its own of any per-slice arithmetic after a reduction (NaN marked from the minimum
    code, then added to the factor: one kernel per dot, 7% of the static MLP's estimated cycles on v5e, 10% on
    v6e); the sum fuses into the quantization's pass.
    """
    first = lax.full(values.shape, True, np.bool_)
    for axis in reduce_axes:
        first = lax.bitwise_and(first, lax.eq(lax.broadcasted_iota(np.int32, values.shape, axis), np.int32(0)))
    placed = lax.select(first, lax.full_like(values, value), lax.full_like(values, 0))
    return lax.reduce_sum(lax.add(lax.sub(values, values), placed), reduce_axes)
