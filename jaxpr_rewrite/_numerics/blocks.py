"""The block layout of block-scaled weights: an array's contraction cut into blocks of ``block`` elements.

A weight quantized with ``block_size`` (``quantize_params(int8ify(fn, block_size=32), ...)``) has one scale per
index of its kept axes and block of its contraction, exactly as a block-scaled dot quantizes a float operand
(:func:`jaxpr_rewrite._dots.int8_dot.blocked`): the kept axes first, then the contracting axes flattened in order,
zero-padded to a whole number of blocks and cut into ``(n_blocks, block)``. Its codes keep the array's own layout;
:func:`to_blocks` and :func:`from_blocks` convert between the two.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from jax import lax

__all__ = ["from_blocks", "n_blocks", "to_blocks"]


def n_blocks(contraction: int, block: int) -> int:
    """How many blocks of ``block`` cover a contraction of ``contraction`` elements."""
    return -(-contraction // block)


def to_blocks(x, lead: Sequence[int], contracting: Sequence[int], block: int):
    """``x`` as ``(*lead shape, n_blocks, block)``.

    Arguments:
        x: the array.
        lead: its kept axes, in the order they lead the result.
        contracting: its contracting axes, in the order they are flattened.
        block: the block length; the flattened contraction is zero-padded to whole blocks.

    Returns:
        The blocked array.
    """
    moved = lax.transpose(x, (*lead, *contracting))
    lead_shape = moved.shape[:len(lead)]
    length = int(np.prod(moved.shape[len(lead):], dtype=np.int64))
    flat = lax.reshape(moved, (*lead_shape, length))
    pad = n_blocks(length, block) * block - length
    if pad:
        flat = lax.pad(flat, lax.full((), 0, x.dtype), [(0, 0, 0)] * len(lead_shape) + [(0, pad, 0)])
    return lax.reshape(flat, (*lead_shape, n_blocks(length, block), block))


def from_blocks(blocked, shape: Sequence[int], lead: Sequence[int], contracting: Sequence[int]):
    """The array of ``shape`` that :func:`to_blocks` turned into ``blocked`` (the padding dropped).

    Arguments:
        blocked: ``(*lead shape, n_blocks, block)``.
        shape: the array's shape.
        lead, contracting: as given to :func:`to_blocks`.

    Returns:
        The array, in its own layout.
    """
    lead_shape = tuple(shape[a] for a in lead)
    contract_shape = tuple(shape[a] for a in contracting)
    length = int(np.prod(contract_shape, dtype=np.int64))
    flat = lax.reshape(blocked, (*lead_shape, blocked.shape[-2] * blocked.shape[-1]))
    if flat.shape[-1] != length:
        flat = lax.slice_in_dim(flat, 0, length, axis=-1)
    moved = lax.reshape(flat, (*lead_shape, *contract_shape))
    order = (*lead, *contracting)
    return lax.transpose(moved, tuple(order.index(a) for a in range(len(order))))
