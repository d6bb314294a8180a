"""Packed int4 codes: two 4-bit codes per byte along an array's last axis.

4-bit weights (``quantize_params(..., bits=4)``) keep their codes in ``[-7, 7]`` (symmetric, like the int8
contract's ``[-127, 127]``) and store them packed: element ``2 i`` of the last axis in the low nibble of byte ``i``,
element ``2 i + 1`` in its high nibble, each as a two's-complement nibble; an odd length gets a zero code at the
end. The bytes are ``uint8``, which every backend, Orbax and SafeTensors hold as they are. A dot unpacks them back
to int8 codes and runs the same int8 x int8 -> int32 dot as 8-bit weights.
"""

from __future__ import annotations

import numpy as np
from jax import lax

__all__ = ["INT4_MAX", "pack_int4", "packed_length", "unpack_int4"]

INT4_MAX = 7


def packed_length(length: int) -> int:
    """How many bytes ``length`` int4 codes take."""
    return -(-length // 2)


def pack_int4(codes):
    """Pack int8 codes in ``[-8, 7]`` into ``uint8`` bytes, two per byte along the last axis.

    Arguments:
        codes: an int8 array with at least one axis.

    Returns:
        A ``uint8`` array shaped like ``codes`` with a last axis of ``packed_length(codes.shape[-1])``.
    """
    length = codes.shape[-1]
    if length % 2:
        codes = lax.pad(codes, np.int8(0), [(0, 0, 0)] * (codes.ndim - 1) + [(0, 1, 0)])
    pairs = lax.reshape(codes, (*codes.shape[:-1], codes.shape[-1] // 2, 2))
    nibbles = lax.bitwise_and(lax.convert_element_type(pairs, np.uint8), np.uint8(0xF))
    low = lax.index_in_dim(nibbles, 0, axis=-1, keepdims=False)
    high = lax.index_in_dim(nibbles, 1, axis=-1, keepdims=False)
    return lax.bitwise_or(low, lax.shift_left(high, np.uint8(4)))


def unpack_int4(packed, length: int):
    """The int8 codes of :func:`pack_int4`'s bytes.

    Arguments:
        packed: ``uint8`` bytes, two codes each along the last axis.
        length: how many codes the last axis holds (the padding code of an odd length is dropped).

    Returns:
        int8 codes in ``[-8, 7]``, shaped like ``packed`` with a last axis of ``length``.
    """
    as_int8 = lax.bitcast_convert_type(packed, np.int8)
    # an arithmetic shift right sign-extends each nibble once it sits in the byte's top four bits
    low = lax.shift_right_arithmetic(lax.shift_left(as_int8, np.int8(4)), np.int8(4))
    high = lax.shift_right_arithmetic(as_int8, np.int8(4))
    pairs = lax.concatenate([low[..., None], high[..., None]], packed.ndim)
    codes = lax.reshape(pairs, (*packed.shape[:-1], packed.shape[-1] * 2))
    return codes if codes.shape[-1] == length else lax.slice_in_dim(codes, 0, length, axis=-1)
