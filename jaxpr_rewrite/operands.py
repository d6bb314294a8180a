"""Arrays quantized (:func:`quantize`, the contract's rule), and a dot's operands on their way in: one quantized
with its partner's static scale or the contract's dynamic ones, one divided by a smoothed weight's factors."""

from __future__ import annotations

import functools
import math
import numbers
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from .blocks import from_blocks, to_blocks
from .errors import Int8ifyError
from .float64_scales import quantize_by_float64, quantize_with_float64_scales
from .int4 import pack_int4
from .layout import contraction_size, decided, one_or_more
from .quantize import (compute_dtype, epilogue_factors, quantize_dynamic_parts, quantize_parts,
                       quantize_parts_nan_as_inf)
from .quantized import CODE_LIMITS, QuantizedArray, is_quantized
from .static_activations import ScaledActivation
from .static_scales import quantize_static_parts

__all__ = ["has_dynamic_scales", "quantize", "quantize_operand", "quantize_operand_in_float64",
           "smoothed_activation"]


def quantize(x, reduce_axes: int | Sequence[int], bits: int = 8, block_size: int | None = None) -> QuantizedArray:
    """Quantize ``x`` with one symmetric scale per slice over ``reduce_axes`` (the contract's rule).

    Arguments:
        x: a floating array (bfloat16 and float16 are upcast to float32 first).
        reduce_axes: the axes one scale covers (for a dot operand: its contracting dims), distinct, each in
            ``[-x.ndim, x.ndim)`` (negative ones count from the end); a single int is one axis, as numpy's ``axis``.
        bits: 8 (codes in ``[-127, 127]``, scales ``absmax / 127``) or 4 (codes in ``[-7, 7]``, scales
            ``absmax / 7``, packed two per byte along the last axis).
        block_size: ``None``, or one scale per index of the kept axes and block of this many elements of the
            flattened contraction (zero-padded to whole blocks), as a block-scaled dot quantizes its operands.

    Returns:
        A :class:`QuantizedArray` (``.codes``, ``.scales``, ``.exponents``) standing for ``x``.
    """
    if bits not in CODE_LIMITS:
        raise Int8ifyError(f"bits must be one of {sorted(CODE_LIMITS)}, got {bits!r}")
    x = x if hasattr(x, "ndim") and hasattr(x, "dtype") else jnp.asarray(x)
    _check_floating(x)
    reduce_axes = _normalized_axes(reduce_axes, x.shape)
    if bits == 4 and x.ndim == 0:
        raise Int8ifyError("4-bit codes are packed along the last axis; a scalar has none")
    kept = tuple(a for a in range(x.ndim) if a not in reduce_axes)
    if block_size is None:
        codes, scales, exponents = quantize_parts(x, reduce_axes, CODE_LIMITS[bits])
    else:
        blocked = to_blocks(x, kept, reduce_axes, block_size)
        codes, scales, exponents = quantize_parts(blocked, (blocked.ndim - 1,), CODE_LIMITS[bits])
        codes = from_blocks(codes, x.shape, kept, reduce_axes)
    if bits == 8:
        return QuantizedArray(codes, scales, exponents, reduce_axes, x.dtype, block_size=block_size)
    return QuantizedArray(pack_int4(codes), scales, exponents, reduce_axes, x.dtype, bits=4, length=x.shape[-1],
                          block_size=block_size)


def _check_floating(x) -> None:
    """Raise :class:`~jaxpr_rewrite.errors.Int8ifyError` unless ``x``'s dtype is a floating one (read off its
    static dtype, so a traced ``x`` costs nothing): an integer or bool array has no fraction to keep, and a complex
    one would lose its imaginary part."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        instead = ("quantize its real and imaginary parts separately" if jnp.issubdtype(x.dtype, jnp.complexfloating)
                   else "cast it to a float dtype first, e.g. x.astype(jnp.float32)")
        raise Int8ifyError(f"quantize needs a floating array x, got dtype {np.dtype(x.dtype).name} (shape "
                           f"{tuple(x.shape)}); {instead}")


def _normalized_axes(reduce_axes, shape: tuple) -> tuple:
    """``reduce_axes`` (one int, or a sequence of them, negative ones counting from the end) as the sorted
    non-negative axes of an array of ``shape``.

    Raises:
        Int8ifyError: an axis that is not an int, out of range for ``shape``, or named twice (a plain ``a % ndim``
            would quietly wrap an out-of-range axis onto another one).
    """
    ndim = len(shape)
    if isinstance(reduce_axes, numbers.Integral) and not isinstance(reduce_axes, (bool, np.bool_)):
        reduce_axes = (reduce_axes,)
    try:
        axes = tuple(reduce_axes)
    except TypeError:
        axes = None
    if axes is None or not all(isinstance(a, numbers.Integral) and not isinstance(a, (bool, np.bool_))
                               for a in axes):
        raise Int8ifyError(f"quantize: reduce_axes must be an int or a sequence of ints (axes of x), got "
                           f"{reduce_axes!r}")
    for a in axes:
        if not -ndim <= a < ndim:
            allowed = "x is a scalar, so pass reduce_axes=()" if ndim == 0 else f"use axes in [{-ndim}, {ndim - 1}]"
            raise Int8ifyError(f"quantize: reduce_axes {axes} holds axis {a}, out of range for x of shape "
                               f"{tuple(shape)}; {allowed}")
    normalized = sorted(int(a) % ndim for a in axes)
    if len(set(normalized)) < len(normalized):
        raise Int8ifyError(f"quantize: reduce_axes {axes} names an axis of x (shape {tuple(shape)}) more than once; "
                           f"list each axis once")
    return tuple(normalized)


def quantize_operand(x, reduce_axes: Sequence[int], partner) -> QuantizedArray:
    """One operand of an int8 dot, quantized: as it is when it already is a :class:`QuantizedArray`; with the
    static scale its ``partner`` (the dot's other operand) was calibrated with, when that is a pre-quantized weight
    holding one; with its own when it is a :class:`~jaxpr_rewrite.static_activations.ScaledActivation` (a
    calibrated dot of two activations); else with the contract's dynamic per-slice scales.

    The dynamic scales of a matrix (an operand of rank 2) are lowered per platform (``lax.platform_dependent``),
    the same codes and scale values for every finite slice either way. On CPU,
    :func:`~jaxpr_rewrite.quantize.quantize_dynamic_parts`: XLA:CPU's reduction cannot fuse
    :func:`~jaxpr_rewrite.quantize.absmax`'s NaN-to-Inf select, which then writes a temporary as large as the
    operand, so NaN and Inf are caught on the int8 codes instead; but a matrix whose ``|x|`` XLA:CPU writes out as a
    kernel of its own anyway (one of fewer than 4096 values) or of one slice takes that select, which joins that
    kernel, where the check on the codes would add two or three kernels (:func:`_where_cpu_writes_magnitudes`; the
    Flax MLP at batch 1: 28 instead of 44). On GPUs,
    :func:`~jaxpr_rewrite.float64_scales.quantize_by_float64`: the scale taken inside the absmax reduction, so no
    kernel of its own computes it (a ragged dot's; a dot's dynamic scales on a GPU are
    :func:`quantize_operand_in_float64`'s, read by its float64 epilogue). On TPU, and for operands of higher rank,
    :func:`~jaxpr_rewrite.quantize.quantize_parts`: GPU and TPU fuse that select into the reduction (the check on
    the codes costs TPU cycles), and XLA:CPU's dot reads a higher-rank operand's codes through a reshape, so a
    second reader of the codes (the check) makes it compute them twice and write out the quotients (the MiniLM
    encoder's program: 915 kernels instead of 674, and no faster; ``docs/performance.md``); on CPU such an operand
    takes NaN as Inf in its values (:func:`~jaxpr_rewrite.quantize.quantize_parts_nan_as_inf`, the same codes and
    scales), a select that joins the kernel computing the operand instead of writing a temporary. On TPU, whatever the
    rank, with ``keep_values``: the operand and its absmax reach the quantization pass together, where XLA:TPU
    would otherwise compute the operand's producer (the previous dot's epilogue, an activation function) a second
    time.
    """
    if is_quantized(x):
        return x
    of_weight = not isinstance(x, ScaledActivation)
    if of_weight:
        static = partner.static_scale if _has_static_scale(partner) else None
    else:
        static, x = x.static_scale, x.value
    x, reduce_axes = _as_operand(x, reduce_axes)
    by_contract = functools.partial(_quantize_with_factors, reduce_axes=reduce_axes)
    on_tpu = functools.partial(by_contract, keep_values=True)
    if static is not None:
        parts = _static_parts(x, static, reduce_axes, tpu_sums_values=of_weight and x.ndim <= 2)
    elif x.ndim > 2:
        on_cpu = functools.partial(_quantize_nan_as_inf_with_factors, reduce_axes=reduce_axes)
        parts = lax.platform_dependent(x, cpu=on_cpu, tpu=on_tpu, default=by_contract)
    else:
        on_gpu = (functools.partial(quantize_by_float64, reduce_axes=reduce_axes)
                  if compute_dtype(x.dtype) == np.float32 else by_contract)
        on_cpu = functools.partial(_where_cpu_writes_magnitudes, reduce_axes, by_contract,
                                   functools.partial(quantize_dynamic_parts, reduce_axes=reduce_axes))
        parts = lax.platform_dependent(x, cpu=on_cpu, tpu=on_tpu, default=on_gpu)
    codes, scales, exponents, (factor, power) = parts
    return QuantizedArray(codes, scales, exponents, reduce_axes, x.dtype, epilogue_factor=factor,
                          epilogue_power=power)


# XLA:CPU writes a float array of fewer values than this out as ``|x|``, a kernel of its own, before reducing it in its
# own loops (in two steps), where the NaN-to-Inf select joins it at no cost; YNNPACK reduces a larger one reading ``x``
# (JAX 0.10.2 to 0.12.1; before 0.10.2 XLA:CPU writes every ``|x|`` out, but one rule keeps the rewritten program the
# same on every JAX version)
CPU_WRITES_MAGNITUDES_BELOW = 4096


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


def quantize_operand_in_float64(x, reduce_axes: Sequence[int], partner):
    """:func:`quantize_operand` for a GPU's float64 epilogue
    (:func:`~jaxpr_rewrite.float64_scales.scale_product_in_float64`): ``(q, scale)``, an operand with dynamic
    scales quantized by :func:`~jaxpr_rewrite.float64_scales.quantize_with_float64_scales` (any rank) with its
    float64 slice scales, any other as :func:`quantize_operand` makes it with ``None``."""
    if not has_dynamic_scales(x, partner):
        return quantize_operand(x, reduce_axes, partner), None
    x, reduce_axes = _as_operand(x, reduce_axes)
    codes, scales, exponents, scale = quantize_with_float64_scales(x, reduce_axes)
    return QuantizedArray(codes, scales, exponents, reduce_axes, x.dtype), scale


def _as_operand(x, reduce_axes: Sequence[int]):
    """``x`` as an array (a Python or NumPy value made one) and ``reduce_axes`` as sorted non-negative axes."""
    x = x if hasattr(x, "ndim") and hasattr(x, "dtype") else jnp.asarray(x)
    return x, tuple(sorted(a % max(x.ndim, 1) for a in reduce_axes))


def has_dynamic_scales(x, partner) -> bool:
    """Whether :func:`quantize_operand` ``(x, ..., partner)`` takes the contract's dynamic per-slice scales: ``x``
    is neither quantized already nor given a static scale (its own, or its partner's)."""
    return not (is_quantized(x) or isinstance(x, ScaledActivation) or _has_static_scale(partner))


def _has_static_scale(partner) -> bool:
    # read off the stored vector: StaticScale.stored_in would trace its slices into whatever program asks
    return is_quantized(partner) and partner.activation_scale is not None


def _static_parts(x, static, reduce_axes: tuple, tpu_sums_values: bool):
    """:func:`~jaxpr_rewrite.static_scales.quantize_static_parts`; on CPU, an operand of rank 3 or more contracted over
    its trailing axes is quantized as a matrix with one slice per row (one reshape there and back, the same codes
    and scales).

    XLA:CPU's dot reads such an operand's codes as that matrix; with the codes' NaN check reading them in the
    operand's own shape, XLA computed the codes twice, once per shape (the MiniLM encoder with static scales: 319
    kernels instead of 277, and 20% slower). XLA's GPU compiler makes one kernel more of the matrix form (the
    transformer block of ``benchmarks/accelerators.py``: 29 instead of 28), so it keeps the operand's shape.
    """
    split = x.ndim - len(reduce_axes)
    in_shape = functools.partial(quantize_static_parts, static=static, reduce_axes=reduce_axes,
                                 tpu_sums_values=tpu_sums_values)
    if x.ndim <= 2 or reduce_axes != tuple(range(split, x.ndim)):
        return in_shape(x)
    return lax.platform_dependent(x, cpu=functools.partial(_static_parts_as_matrix, static=static, split=split),
                                  default=in_shape)


def _static_parts_as_matrix(x, static, split: int):
    kept_shape = x.shape[:split]
    matrix = lax.reshape(x, (math.prod(kept_shape), math.prod(x.shape[split:])))
    codes, scales, exponents, (factor, power) = quantize_static_parts(matrix, static, (1,))
    per_slice = functools.partial(lax.reshape, new_sizes=kept_shape)
    return lax.reshape(codes, x.shape), per_slice(scales), per_slice(exponents), (per_slice(factor), per_slice(power))


def _quantize_with_factors(x, reduce_axes, keep_values: bool = False):
    """:func:`~jaxpr_rewrite.quantize.quantize_parts` and the epilogue factors of its scales, laid out as
    :func:`~jaxpr_rewrite.quantize.quantize_dynamic_parts` returns them."""
    codes, scales, exponents = quantize_parts(x, reduce_axes, keep_values=keep_values)
    return codes, scales, exponents, epilogue_factors(scales, exponents)


def _quantize_nan_as_inf_with_factors(x, reduce_axes):
    """:func:`_quantize_with_factors` (bit for bit) by :func:`~jaxpr_rewrite.quantize.quantize_parts_nan_as_inf`."""
    codes, scales, exponents = quantize_parts_nan_as_inf(x, reduce_axes)
    return codes, scales, exponents, epilogue_factors(scales, exponents)


def smoothed_activation(activation, inverse, axis: int):
    """``activation / smooth`` along ``axis``, as a smoothed weight's dot computes it: a multiply per element by
    ``inverse``, the factors' correctly rounded reciprocal in float32
    (:func:`~jaxpr_rewrite.quantize.smoothing_inverse`, or a weight's
    :meth:`~jaxpr_rewrite.quantized.QuantizedArray.smoothing_multiplier`), cast to the activation's dtype."""
    inverse = lax.convert_element_type(inverse, activation.dtype)
    return lax.mul(activation, lax.broadcast_in_dim(inverse, activation.shape, (axis,)))
