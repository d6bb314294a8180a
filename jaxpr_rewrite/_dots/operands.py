"""Arrays quantized (:func:`quantize`, the contract's rule), and a dot's operands on their way in: one quantized
with its partner's static scale or the contract's dynamic ones, one divided by a smoothed weight's factors."""

from __future__ import annotations

import numbers
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core import platforms
from .._core.errors import Int8ifyError
from .._numerics.blocks import from_blocks, to_blocks
from .._numerics.float64_scales import quantize_with_float64_scales
from .._numerics.int4 import pack_int4
from .._numerics.quantize import quantize_parts
from .._quantized.activations import ScaledActivation
from .._quantized.array import CODE_LIMITS, QuantizedArray, is_quantized

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
    """Raise :class:`~jaxpr_rewrite._core.errors.Int8ifyError` unless ``x``'s dtype is a floating one (read off its
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
    holding one; with its own when it is a :class:`~jaxpr_rewrite._quantized.activations.ScaledActivation` (a
    calibrated dot of two activations); else with the contract's dynamic per-slice scales.

    The platform the program is traced for quantizes it
    (:meth:`~jaxpr_rewrite._core.platforms.Platform.quantize_dynamic`,
    :meth:`~jaxpr_rewrite._core.platforms.Platform.quantize_static`): the same codes and scale values for every
    finite slice on every platform, in the passes its compiler runs fastest.
    """
    if is_quantized(x):
        return x
    of_weight = not isinstance(x, ScaledActivation)
    if of_weight:
        static = partner.static_scale if _has_static_scale(partner) else None
    else:
        static, x = x.static_scale, x.value
    x, reduce_axes = _as_operand(x, reduce_axes)
    platform = platforms.current()
    if static is not None:
        parts = platform.quantize_static(x, static, reduce_axes=reduce_axes, sums_values=of_weight and x.ndim <= 2)
    else:
        parts = platform.quantize_dynamic(x, reduce_axes=reduce_axes)
    codes, scales, exponents, (factor, power) = parts
    return QuantizedArray(codes, scales, exponents, reduce_axes, x.dtype, epilogue_factor=factor,
                          epilogue_power=power)


def quantize_operand_in_float64(x, reduce_axes: Sequence[int], partner):
    """:func:`quantize_operand` for a GPU's float64 epilogue
    (:func:`~jaxpr_rewrite._numerics.float64_scales.scale_product_in_float64`): ``(q, scale)``, an operand with dynamic
    scales quantized by :func:`~jaxpr_rewrite._numerics.float64_scales.quantize_with_float64_scales` (any rank) with its
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


def smoothed_activation(activation, inverse, axis: int):
    """``activation / smooth`` along ``axis``, as a smoothed weight's dot computes it: a multiply per element by
    ``inverse``, the factors' correctly rounded reciprocal in float32
    (:func:`~jaxpr_rewrite._numerics.quantize.smoothing_inverse`, or a weight's
    :meth:`~jaxpr_rewrite.quantized.QuantizedArray.smoothing_multiplier`), cast to the activation's dtype."""
    inverse = lax.convert_element_type(inverse, activation.dtype)
    return lax.mul(activation, lax.broadcast_in_dim(inverse, activation.shape, (axis,)))
