"""The contract's program on XLA:CPU: IEEE divisions, NaN caught on the int8 codes, matrices XLA:CPU's dot reads.

XLA:CPU keeps a float division an IEEE one where its divisor is a ``select`` it cannot see through
(:func:`~jaxpr_rewrite._numerics.exact_division.true_divide`), so the contract's quotients are plain divisions here.
Its ``reduce_max`` drops NaN, and its reduction cannot fuse :func:`~jaxpr_rewrite._numerics.quantize.absmax`'s
NaN-to-Inf select, which then writes a temporary as large as the operand: so NaN and Inf are caught on the int8
codes of a large matrix instead (:func:`~jaxpr_rewrite._numerics.quantize.quantize_dynamic_parts`), or in the values
of a higher-rank operand (:func:`~jaxpr_rewrite._numerics.quantize.quantize_parts_nan_as_inf`).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax

from .._core.layout import contraction_size, decided, one_or_more
from .._core.platforms import Platform, register_platform
from .._numerics.exact_division import (divided_by_limit_in_floats, quotients_by_division, reciprocal_in_floats,
                                        true_divide)
from .._numerics.int32_dot import matrix_vector_safe_dot
from .._numerics.quantize import (marked_codes, quantize_dynamic_parts, quantize_nan_as_inf_with_factors,
                                  quantize_with_factors)
from .._numerics.static_scales import factor_poisoned_by_codes, fields_by_slices, quantize_static_parts

__all__ = ["CPU_WRITES_MAGNITUDES_BELOW", "Cpu"]

# XLA:CPU writes a float array of fewer values than this out as ``|x|``, a kernel of its own, before reducing it in its
# own loops (in two steps), where the NaN-to-Inf select joins it at no cost; YNNPACK reduces a larger one reading ``x``
# (JAX 0.10.2 to 0.12.1; before 0.10.2 XLA:CPU writes every ``|x|`` out, but one rule keeps the rewritten program the
# same on every JAX version)
CPU_WRITES_MAGNITUDES_BELOW = 4096


class Cpu(Platform):
    """XLA:CPU's program."""

    lowerings = ("cpu",)

    def divide_by_code_limit(self, mantissa, *, limit: int):
        return divided_by_limit_in_floats(mantissa, limit)

    def reciprocal(self, d):
        return reciprocal_in_floats(d)

    def divide(self, numerator, denominator):
        return true_divide(numerator, denominator)

    def rounded_quotients(self, values, scales, prescale, *, kept_axes: tuple):
        return quotients_by_division(values, scales, prescale, kept_axes)

    def quantize_dynamic(self, x, *, reduce_axes: tuple):
        """A matrix's NaN and Inf caught on its codes where XLA:CPU would write ``|x|`` out for the NaN-to-Inf select
        (:func:`_where_cpu_writes_magnitudes`); an operand of higher rank takes NaN as Inf in its values, a select
        that joins the kernel computing the operand: XLA:CPU's dot reads such an operand's codes through a reshape,
        so a second reader of the codes (the check) makes it compute them twice and write out the quotients (the
        MiniLM encoder's program: 915 kernels instead of 674, and no faster; ``docs/performance.md``)."""
        if x.ndim > 2:
            return quantize_nan_as_inf_with_factors(x, reduce_axes)
        nan_safe = functools.partial(quantize_with_factors, reduce_axes=reduce_axes)
        checked = functools.partial(quantize_dynamic_parts, reduce_axes=reduce_axes)
        return _where_cpu_writes_magnitudes(reduce_axes, nan_safe, checked, x)

    def quantize_static(self, x, static, *, reduce_axes: tuple, sums_values: bool):
        """Codes marked -128 for NaN and Inf, found by the minimum code per slice; an operand of rank 3 or more
        contracted over its trailing axes quantized as a matrix with one slice per row (one reshape there and back,
        the same codes and scales).

        XLA:CPU's dot reads such an operand's codes as that matrix; with the codes' NaN check reading them in the
        operand's own shape, XLA computed the codes twice, once per shape (the MiniLM encoder with static scales: 319
        kernels instead of 277, and 20% slower)."""
        split = x.ndim - len(reduce_axes)
        if x.ndim <= 2 or reduce_axes != tuple(range(split, x.ndim)):
            return _static_parts(x, static, reduce_axes)
        kept_shape = x.shape[:split]
        matrix = lax.reshape(x, (math.prod(kept_shape), math.prod(x.shape[split:])))
        codes, scales, exponents, (factor, power) = _static_parts(matrix, static, (1,))
        per_slice = functools.partial(lax.reshape, new_sizes=kept_shape)
        return (lax.reshape(codes, x.shape), per_slice(scales), per_slice(exponents),
                (per_slice(factor), per_slice(power)))

    def static_scale_fields(self, vector, *, count: int) -> tuple:
        return fields_by_slices(vector, count)

    def int8_sums(self, lhs_codes, rhs_codes, *, dimension_numbers):
        return matrix_vector_safe_dot(lhs_codes, rhs_codes, dimension_numbers)


def _static_parts(x, static, reduce_axes: tuple):
    return quantize_static_parts(x, static, reduce_axes, codes_of=marked_codes, factor_of=factor_poisoned_by_codes)


def _where_cpu_writes_magnitudes(reduce_axes: tuple, nan_safe, checked, x):
    """``nan_safe(x)`` (the contract's NaN-to-Inf absmax) for a matrix whose ``|x|`` XLA:CPU writes out before reducing
    it (:data:`CPU_WRITES_MAGNITUDES_BELOW`), or of a single slice (a matrix-vector product's vector, whose check on
    the codes would also have them written twice, once padded for the dot); ``checked(x)`` (NaN and Inf caught on
    the codes, a reduction beside the dot: two kernels for a small matrix, one for a larger) for every other. A
    ``lax.cond``, which XLA settles at the call, where ``jax.export``'s symbolic dims leave the choice open."""
    kept = [d for a, d in enumerate(x.shape) if a not in reduce_axes]
    values = contraction_size(x.shape, range(x.ndim))
    small = decided(lambda: values < CPU_WRITES_MAGNITUDES_BELOW)
    if small:
        return nan_safe(x)
    if small is False:
        return one_or_more(kept, nan_safe, checked, x)
    one_slice = jnp.asarray(contraction_size(kept, range(len(kept)))) == 1
    return lax.cond(one_slice | (jnp.asarray(values) < CPU_WRITES_MAGNITUDES_BELOW), nan_safe, checked, x)


CPU = register_platform(Cpu())
