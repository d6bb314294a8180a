"""Writes into a quantized array: an int8 KV cache updated in place (``lax.dynamic_update_slice``,
``.at[...].set``) stays quantized, each written slice quantized once with its own scale.

A cache made by :func:`~jaxpr_rewrite.quantize_cache` holds one scale per slice over its last axis (a token's
head_dim). Writing float values into it quantizes them with the contract's rule over the same axes (codes and scales
bit for bit those of :func:`~jaxpr_rewrite.quantize`), and writes their codes and scales where the float values would
go; the rest of the cache is untouched. A write that does not cover whole slices (part of a token's head_dim) would
change a slice's scale for values it does not write: the cache is then materialised, and the write is the float
program's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..._core import platforms
from ..._dots.operands import quantize
from ..._quantized.array import QuantizedArray, is_quantized
from .registry import RuleContext, register

__all__ = ["writable"]


def writable(array) -> bool:
    """Whether float values can be written into ``array`` as codes and scales of its own layout: an int8
    :class:`QuantizedArray` with one scale per slice (no blocks, smoothing, static activation scale or kept float
    value)."""
    return (is_quantized(array) and array.bits == 8 and array.block_size is None and array.smooth is None
            and array.activation_scale is None and array.value is None)


def _quantized_like(array: QuantizedArray, values, reduce_axes: tuple) -> QuantizedArray:
    """``values`` quantized over ``reduce_axes`` (the axes of ``values`` that ``array``'s scales cover)."""
    return quantize(lax.convert_element_type(values, array.dtype), reduce_axes)


def _with_parts(array: QuantizedArray, written: QuantizedArray, write) -> QuantizedArray:
    """``array`` with each of its codes and per-slice arrays replaced by ``write(part, written part)``: the written
    values' codes, scales and exponents, and, where ``array`` stores its epilogue factors, the written slices'
    factors (computed for them alone)."""
    changes = {name: write(getattr(array, name), getattr(written, name)) for name in ("codes", "scales", "exponents")}
    if array.epilogue_factor is not None:
        factor, power = written.epilogue_factors(array.scale_dtype)
        changes["epilogue_factor"] = write(array.epilogue_factor, factor)
        changes["epilogue_power"] = write(array.epilogue_power, power)
    return array.replace(**changes)


def _dynamic_update_slice_quantized(context: RuleContext, eqn, invals):
    """Float values written into a quantized array over whole slices: quantized, and their codes and scales written
    at the same place (the starts of the kept axes for the scales)."""
    array, update, *starts = invals
    if not writable(array) or is_quantized(update):
        return None
    reduce_axes = array.contracting
    if any(update.shape[a] != array.shape[a] for a in reduce_axes):
        return None  # part of a slice: its scale would change for values this write does not hold
    written = _quantized_like(array, update, reduce_axes)
    kept_starts = [start for a, start in enumerate(starts) if a not in reduce_axes]

    def write(part, new):  # the codes at every start, a per-slice array at the kept axes' (as its platform writes it)
        if part.ndim == array.ndim:
            # the primitive's starts: already wrapped once by lax's API, clamped by XLA, never wrapped again
            return lax.dynamic_update_slice_p.bind(part, new, *starts)
        return platforms.current().write_per_slice(part, new, *kept_starts)

    return [_with_parts(array, written, write)]


def _scatter_quantized(context: RuleContext, eqn, invals):
    """``.at[...].set(values)`` into a quantized array, where each written window covers whole slices (the scales'
    axes are window axes written whole): the values quantized over those axes, their codes scattered as the float
    values would be and their scales with those axes left out of the dimension numbers.

    A scales' axis may also be indexed where the index cannot move a whole-axis window (``jax.vmap`` of a
    ``dynamic_update_slice`` indexes every axis, in ``CLIP`` mode): its index component is then left out of the
    scales' indices too. Where an index could drop the window instead (``FILL_OR_DROP``), the write is the float
    program's."""
    array, indices, updates = invals
    params = eqn.params
    if not writable(array) or is_quantized(updates) or params.get("update_jaxpr") is not None:
        return None
    dnums = params["dimension_numbers"]
    reduce_axes = array.contracting
    window_axes = [a for a in range(array.ndim)
                   if a not in dnums.inserted_window_dims and a not in dnums.operand_batching_dims]
    update_axis = dict(zip(window_axes, dnums.update_window_dims))  # operand window axis -> updates axis
    if any(a not in update_axis or updates.shape[update_axis[a]] != array.shape[a] for a in reduce_axes):
        return None
    indexed = [k for k, a in enumerate(dnums.scatter_dims_to_operand_dims) if a in reduce_axes]
    if indexed and params["mode"] not in (lax.GatherScatterMode.CLIP, lax.GatherScatterMode.PROMISE_IN_BOUNDS):
        return None
    update_reduce = tuple(sorted(update_axis[a] for a in reduce_axes))
    written = _quantized_like(array, updates, update_reduce)
    scale_dnums = _without_axes(dnums, reduce_axes, update_reduce)
    scale_indices = _without_components(indices, indexed)
    kept_params = {k: v for k, v in params.items() if k != "dimension_numbers"}

    def write(part, new):  # the codes as the values would be, a per-slice array without the slices' axes
        if part.ndim == array.ndim:
            return eqn.primitive.bind(part, indices, new, dimension_numbers=dnums, **kept_params)
        return eqn.primitive.bind(part, scale_indices, new, dimension_numbers=scale_dnums, **kept_params)

    return [_with_parts(array, written, write)]


def _without_components(indices, components: list):
    """Scatter indices without the index-vector ``components`` (the last axis is the index vector)."""
    if not components:
        return indices
    kept = np.array([k for k in range(indices.shape[-1]) if k not in components], np.int32)
    return jnp.take(indices, kept, axis=-1)


def _without_axes(dnums, operand_axes: tuple, update_axes: tuple):
    """Scatter dimension numbers for the arrays with ``operand_axes`` (window axes written whole) taken out of the
    operand and ``update_axes`` out of the updates."""

    def renumber(axes, removed):
        return tuple(a - sum(r < a for r in removed) for a in axes if a not in removed)

    return jax.lax.ScatterDimensionNumbers(
        update_window_dims=renumber(dnums.update_window_dims, update_axes),
        inserted_window_dims=renumber(dnums.inserted_window_dims, operand_axes),
        scatter_dims_to_operand_dims=renumber(dnums.scatter_dims_to_operand_dims, operand_axes),
        operand_batching_dims=renumber(dnums.operand_batching_dims, operand_axes),
        scatter_indices_batching_dims=dnums.scatter_indices_batching_dims)


register("dynamic_update_slice", quantized=_dynamic_update_slice_quantized)
register("scatter", quantized=_scatter_quantized)
