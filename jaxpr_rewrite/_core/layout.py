"""Where a dot's axes go: the contraction's size, an operand's free axes, per-slice values broadcast into the
``dot_general`` output layout, a contraction cut into blocks (sub-channel scales, int32-safe chunks), and a one-row
operand padded with a zero row."""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._compat import InconclusiveDimension

__all__ = ["blocked", "blocked_dimension_numbers", "contraction_size", "decided", "free_axes", "is_static",
           "one_or_more", "scale_to_output", "with_a_zero_row"]


def contraction_size(shape, contracting):
    """The number of products each output sums: the product of the contracting dims' sizes (an int, or a
    symbolic expression where a dim is one of ``jax.export``'s symbolic dims)."""
    size = 1
    for a in contracting:
        size = size * shape[a]
    return size


def is_static(size) -> bool:
    """Whether a dim or size is a known int rather than a ``jax.export`` symbolic expression."""
    return not jax.export.is_symbolic_dim(size)


def decided(comparison: Callable[[], bool]) -> bool | None:
    """The value of a comparison of dims, or ``None`` where symbolic dims' constraints leave it open.

    A comparison of ints is always decided; ``jax.export`` decides one of symbolic dims from their constraints
    (``symbolic_shape("k", constraints=("k <= 4096",))`` makes ``k <= 133144`` true)."""
    try:
        return bool(comparison())
    except InconclusiveDimension:
        return None


def one_or_more(sizes: Sequence, one: Callable, more: Callable, *operands):
    """``one(*operands)`` where the product of ``sizes`` is 1, ``more(*operands)`` where it is not; where a size is
    one of ``jax.export``'s symbolic dims that leave it open, a ``lax.cond`` of the two, which XLA settles once the
    exported program's shapes are refined at a call (it keeps the one branch)."""
    if any(is_static(n) and n != 1 for n in sizes):
        return more(*operands)
    if all(is_static(n) for n in sizes):
        return one(*operands)
    return lax.cond(jnp.asarray(contraction_size(sizes, range(len(sizes)))) == 1, one, more, *operands)


def free_axes(ndim: int, contracting: Sequence[int], batch: Sequence[int]) -> tuple[int, ...]:
    return tuple(a for a in range(ndim) if a not in contracting and a not in batch)


def scale_to_output(scales, kept_axes: Sequence[int], ndim: int, dimension_numbers, side: int, out_shape):
    """Broadcast one operand's per-slice values (scales, exponents) into the ``dot_general`` output layout.

    ``dot_general``'s output is ``(batch dims in dimension-number order, lhs free dims, rhs free dims)``.

    Arguments:
        scales: values over the operand axes ``kept_axes``, in that (ascending) order.
        kept_axes: operand axes the values run over; none of them contracting (``()`` for one value).
        ndim: the operand's rank.
        dimension_numbers: the dot's ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.
        side: 0 for the lhs, 1 for the rhs.
        out_shape: the dot's output shape.

    Returns:
        ``scales`` broadcast to ``out_shape``.
    """
    contract, batch = dimension_numbers[0][side], dimension_numbers[1][side]
    free = free_axes(ndim, contract, batch)
    offset = len(batch) if side == 0 else len(out_shape) - len(free)
    out_positions = {a: offset + i for i, a in enumerate(free)}
    out_positions.update({a: i for i, a in enumerate(batch)})
    # broadcast_in_dim needs increasing target positions: reorder the axes first when the batch dims are not
    # listed in ascending order.
    order = sorted(range(len(kept_axes)), key=lambda i: out_positions[kept_axes[i]])
    if order != list(range(len(kept_axes))):
        scales = lax.transpose(scales, order)
    targets = tuple(sorted(out_positions[a] for a in kept_axes))
    return lax.broadcast_in_dim(scales, tuple(out_shape), targets)


def blocked(x, contract, batch, n_blocks: int, block: int):
    """Move ``x`` to ``(batch..., free..., K)`` and cut the flattened contraction ``K`` into ``(n_blocks, block)``,
    zero-padded at the end."""
    free = free_axes(x.ndim, contract, batch)
    moved = lax.transpose(x, (*batch, *free, *contract))
    lead = moved.shape[: len(batch) + len(free)]
    flat = lax.reshape(moved, (*lead, contraction_size(moved.shape, range(len(lead), moved.ndim))))
    pad = n_blocks * block - flat.shape[-1]
    if pad:
        flat = lax.pad(flat, lax.full((), 0, x.dtype), [(0, 0, 0)] * len(lead) + [(0, pad, 0)])
    return lax.reshape(flat, (*lead, n_blocks, block))


def blocked_dimension_numbers(dimension_numbers, lhs_ndim: int, rhs_ndim: int):
    """Dimension numbers of the dot between two :func:`blocked` operands: the block index joins the batch
    dims, the block's elements are contracted."""
    (lc, rc), (lb, rb) = dimension_numbers
    n_batch = len(lb)
    lhs_block_axis = n_batch + len(free_axes(lhs_ndim, lc, lb))
    rhs_block_axis = n_batch + len(free_axes(rhs_ndim, rc, rb))
    return (
        ((lhs_block_axis + 1,), (rhs_block_axis + 1,)),
        ((*range(n_batch), lhs_block_axis), (*range(n_batch), rhs_block_axis)),
    )


def with_a_zero_row(codes, row_axis: int):
    """``codes`` with a row of zeros added along ``row_axis``: a one-row lhs as its int8 dot reads it. Another reader
    of the codes that reads this same array instead (static scales' check for NaN and Inf) lets XLA compute them
    once, padded."""
    return lax.pad(codes, np.int8(0), [(0, 1 if a == row_axis else 0, 0) for a in range(codes.ndim)])
