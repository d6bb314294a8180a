"""Static (calibrated) activation scales: the scale with what the hot path needs precomputed, stored as one vector,
and the quantization of an activation with it (one multiply, round and clip per element; no absmax)."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
from jax import lax

from .._core import platforms
from .exact_division import reciprocal
from .int32_dot import holds_nonfinite_as_dot_reads
from .quantize import NONFINITE_CODE, compute_dtype, epilogue_factors, poison, scale_parts, to_compute

__all__ = ["SMALLEST_STATIC_ABSMAX", "StaticScale", "factor_or_inf_by_codes", "factor_poisoned_by_codes",
           "factor_poisoned_by_values", "fields_by_masks", "fields_by_slices", "quantize_static_parts",
           "smallest_static_absmax"]


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
        """The scale a :meth:`stored` vector holds, its fields read as the platform the program is traced for reads
        them (:meth:`~jaxpr_rewrite._core.platforms.Platform.static_scale_fields`)."""
        return cls(*platforms.current().static_scale_fields(vector, count=len(cls._fields)))


def fields_by_masks(vector, count: int) -> tuple:
    """The fields of a stored vector as masked sums of it (exact: the fields are finite): XLA:TPU makes a kernel of
    each slice of it (the static MLP of ``benchmarks/accelerators.py``: 5-8% of its estimated cycles), as XLA's GPU
    compiler does of each reduction."""
    masks = np.eye(count, dtype=vector.dtype)
    return tuple(lax.reduce_sum(lax.mul(vector, mask), (0,)) for mask in masks)


def fields_by_slices(vector, count: int) -> tuple:
    """The fields of a stored vector as its slices."""
    return tuple(lax.index_in_dim(vector, i, keepdims=False) for i in range(count))


def quantize_static_parts(x, static: StaticScale, reduce_axes: Sequence[int], codes_of, factor_of):
    """Quantization of ``x`` with one calibrated (static) scale for the whole array.

    The hot path of static activation scales: no absmax and no scale computation per call; the codes are one
    multiply by the precomputed reciprocal of the scale, a round to nearest even and a clip, so values beyond the
    calibrated range saturate at +-127. NaN and Inf still make every output they feed non-finite: each slice's factor
    is NaN (or Inf) where it holds one, found by ``factor_of`` (:func:`factor_poisoned_by_codes`,
    :func:`factor_poisoned_by_values` or :func:`factor_or_inf_by_codes`, as a platform's
    :meth:`~jaxpr_rewrite._core.platforms.Platform.quantize_static` chooses), from codes that ``codes_of`` marks -128
    for NaN and Inf (:func:`~jaxpr_rewrite._numerics.quantize.marked_codes`) or leaves unmarked where the factor is
    found in the values (:func:`~jaxpr_rewrite._numerics.quantize.saturated_codes`).

    Arguments:
        x: a floating array.
        static: the calibrated scale.
        reduce_axes: the axes one slice covers (the dot's contracting dims).
        codes_of: ``codes_of(values, quotients)``, the int8 codes of the quotients (the values times the reciprocal).
        factor_of: ``factor_of(values, codes, factor, reduce_axes, kept_shape)``, the epilogue factor per slice,
            NaN or Inf for a slice holding NaN or Inf.

    Returns:
        ``(codes, scales, exponents, factors)``: int8 codes and, per slice over the other axes, the scale as
        :func:`~jaxpr_rewrite._numerics.quantize.quantize_parts` lays it out (``scales * 2**exponents``, NaN
        ``scales`` for a non-finite slice) and its epilogue factors.
    """
    reduce_axes = tuple(reduce_axes)
    kept_shape = tuple(x.shape[a] for a in range(x.ndim) if a not in reduce_axes)
    values = to_compute(x)
    quotients = lax.mul(values, to_compute(static.reciprocal, values.dtype))
    codes = codes_of(values, quotients)
    factor = factor_of(values, codes, to_compute(static.factor, values.dtype), reduce_axes, kept_shape)
    nonfinite = lax.sub(factor, factor)  # 0, NaN for a slice holding NaN or Inf
    # the scale as quantize_parts holds it, for the operand's other uses (the dot itself reads the factors)
    scale, exponent, _ = scale_parts(to_compute(static.absmax, values.dtype))
    return (codes, lax.add(_per_slice(scale, values.dtype, kept_shape), nonfinite),
            lax.broadcast(exponent, kept_shape), (factor, _per_slice(static.power, values.dtype, kept_shape)))


def _per_slice(value, dtype, kept_shape: tuple):
    return lax.broadcast(to_compute(value, dtype), kept_shape)


def factor_poisoned_by_codes(values, codes, factor, reduce_axes: tuple, kept_shape: tuple):
    """``factor`` per slice, NaN for a slice whose codes hold -128 (NaN or Inf): the minimum code per slice over the
    codes as the int8 dot reads them (:func:`~jaxpr_rewrite._numerics.int32_dot.holds_nonfinite_as_dot_reads`), an
    int8 reduction fused into the quantization's pass."""
    per_slice = _per_slice(factor, values.dtype, kept_shape)
    return lax.add(per_slice, poison(holds_nonfinite_as_dot_reads(codes, reduce_axes), per_slice))


def factor_poisoned_by_values(values, codes, factor, reduce_axes: tuple, kept_shape: tuple):
    """``factor`` per slice, NaN for a slice holding NaN or Inf, found in a sum over the values
    (:func:`_sum_with_nonfinite`): the codes need no marks."""
    return _sum_with_nonfinite(values, factor, reduce_axes)


def factor_or_inf_by_codes(values, codes, factor, reduce_axes: tuple, kept_shape: tuple):
    """``factor`` per slice, Inf for a slice holding NaN or Inf, from one reduction over the codes
    (:func:`_factor_or_inf`)."""
    return _factor_or_inf(codes, factor, reduce_axes)


def _factor_or_inf(codes, factor, reduce_axes: tuple):
    """``factor`` per slice of ``codes`` over ``reduce_axes``, Inf for a slice holding the code -128 (NaN or Inf,
    :func:`~jaxpr_rewrite._numerics.quantize.marked_codes`), as one reduction's output: the maximum of ``factor`` or Inf
    per element, exact whatever its order (no NaN enters it).

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
