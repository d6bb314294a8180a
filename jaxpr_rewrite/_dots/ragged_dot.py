"""The int8 contract for ``ragged_dot_general`` (the grouped matmuls of mixture-of-experts layers): one scale per
lhs row, one per group and column of the rhs."""

from __future__ import annotations

import functools
import inspect

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core import platforms
from .._core.errors import Int8ifyError
from .._numerics.int32_dot import INT8_PRECISION
from .int8_dot import PER_CHANNEL, Scheme, common_dtype, scaled  # the dot's own epilogue, shared
from .._core.layout import free_axes, scale_to_output
from .operands import quantize_operand

__all__ = ["int8_ragged_dot_general_impl", "ragged_dot_float", "supports_ragged"]


def _ragged_layout(ragged):
    """The supported ragged layout (one ragged lhs non-contracting dim, one rhs group dim), or an error."""
    (lc, rc), (lb, rb) = ragged.dot_dimension_numbers
    if len(ragged.lhs_ragged_dimensions) != 1 or len(ragged.rhs_group_dimensions) != 1:
        return None
    (ragged_axis,), (group_axis,) = ragged.lhs_ragged_dimensions, ragged.rhs_group_dimensions
    if ragged_axis in lc or ragged_axis in lb or group_axis in rc or group_axis in rb:
        return None
    return ragged_axis, group_axis


def _group_of_each_row(group_sizes, n_rows: int):
    """For each index along the ragged dim, the group it belongs to (``G`` past the last group's end)."""
    ends = jnp.cumsum(group_sizes)
    rows = lax.iota(group_sizes.dtype, n_rows)
    return jnp.sum((rows[:, None] >= ends[None, :]).astype(np.int32), axis=1)


def ragged_dot_float(lhs, rhs, group_sizes, **params):
    """The float ``ragged_dot_general`` with the equation's params (those this JAX version's API takes)."""
    accepted = inspect.signature(lax.ragged_dot_general).parameters
    return lax.ragged_dot_general(lhs, rhs, group_sizes, **{k: v for k, v in params.items() if k in accepted})


def int8_ragged_dot_general_impl(lhs, rhs, group_sizes, float_params, out_dtype, scheme: Scheme = PER_CHANNEL):
    """The int8 program for one ``ragged_dot_general`` whose lhs is ragged along a non-contracting dim (the
    grouped matmul of a mixture-of-experts layer): per-row lhs scales, per-group per-column rhs scales, one int8
    ``ragged_dot_general`` into int32, and each row scaled by its own group's column scales; traced for
    ``scheme.platforms``."""
    with platforms.target(scheme.platforms or None):
        return platforms.per_platform(
            functools.partial(_int8_ragged_dot, lhs, rhs, group_sizes, float_params, out_dtype, scheme))


def _int8_ragged_dot(lhs, rhs, group_sizes, float_params, out_dtype, scheme: Scheme):
    params = dict(float_params)
    ragged = params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = ragged.dot_dimension_numbers
    ragged_axis, group_axis = _ragged_layout(ragged)
    if not scheme.per_channel:
        raise Int8ifyError("ragged_dot_general is rewritten with per-channel scales only (no granularity or "
                           "block_size); skip it with skip_if to keep it float")
    lhs_q, rhs_q = quantize_operand(lhs, lc, None), quantize_operand(rhs, rc, None)  # dynamic scales
    int_params = {**params, "preferred_element_type": np.int32, "precision": INT8_PRECISION}
    sums = ragged_dot_float(lhs_q.codes, rhs_q.codes, group_sizes, **int_params)
    acc = lax.convert_element_type(sums, common_dtype(lhs_q, rhs_q, out_dtype))
    lhs_dims = ragged.dot_dimension_numbers
    out_shape = acc.shape
    # rhs (with the group dim) maps to the output as a dot without its group dim: batch, lhs free, rhs free.
    rhs_free = free_axes(rhs_q.ndim, rc, (*rb, group_axis))
    lhs_free = free_axes(lhs_q.ndim, lc, lb)
    ragged_out = len(lb) + lhs_free.index(ragged_axis)
    rhs_out = {a: i for a, i in zip(rb, range(len(lb)))}
    rhs_out.update({a: len(out_shape) - len(rhs_free) + i for i, a in enumerate(rhs_free)})
    groups = _group_of_each_row(group_sizes, lhs_q.shape[ragged_axis])  # (R,), group sizes are 1-D here

    def place_lhs(values):
        return scale_to_output(values, lhs_q.kept_axes, lhs_q.ndim, lhs_dims, 0, out_shape)

    def place_rhs(values):
        # values over rhs kept axes (group dim included); pick each ragged row's group, then broadcast.
        kept = list(rhs_q.kept_axes)
        moved = lax.transpose(values, [kept.index(group_axis)] + [i for i, a in enumerate(kept) if a != group_axis])
        n_groups = moved.shape[0]
        rows = lax.clamp(np.int32(0), groups, np.int32(n_groups - 1))
        picked = jnp.take(moved, rows, axis=0, mode="clip")  # (R, rest...)
        rest = [a for a in kept if a != group_axis]
        targets = [ragged_out] + [rhs_out[a] for a in rest]
        order = sorted(range(len(targets)), key=lambda i: targets[i])
        if order != list(range(len(targets))):
            picked = lax.transpose(picked, order)
        return lax.broadcast_in_dim(picked, out_shape, tuple(sorted(targets)))

    out = scaled(acc, (lhs_q, rhs_q), (place_lhs, place_rhs))
    # rows past the last group belong to none, and the float ragged dot gives 0 there: their scales (the row's own,
    # NaN for a row holding NaN; the last group's columns, clamped) must not make them NaN
    in_a_group = lax.broadcast_in_dim(groups < rhs_q.shape[group_axis], out.shape, (ragged_out,))
    out = lax.select(in_a_group, out, lax.full_like(out, 0))
    return out if out.dtype == out_dtype else lax.convert_element_type(out, out_dtype)


def supports_ragged(params) -> bool:
    """Whether a ``ragged_dot_general`` with these params has the layout the int8 rewrite handles."""
    return _ragged_layout(params["ragged_dot_dimension_numbers"]) is not None
