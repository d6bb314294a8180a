"""The rewrite of one float ``dot_general``: quantize, int8 x int8 -> int32 dot, float32 scale epilogue.

This is the seed contract generalised to any dimension numbers: each operand gets one scale per index of
its non-contracting dims (batch + free), taken over all of its contracting dims; the codes go through one
``dot_general`` with the *same* dimension numbers and ``preferred_element_type=int32``; the int32 sums are
scaled by the outer product of the two scale arrays, formed by broadcasting into the output layout.

Gradients use the straight-through estimator: the rewritten dot's JVP is the float dot's, evaluated at the
float operands.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from .quantize import MAX_INT32_SAFE_CONTRACTION, quantize


def _free_axes(ndim: int, contracting: Sequence[int], batch: Sequence[int]) -> tuple[int, ...]:
    return tuple(a for a in range(ndim) if a not in contracting and a not in batch)


def scale_to_output(scales, ndim: int, dimension_numbers, side: int, out_shape) -> jax.Array:
    """Broadcast one operand's per-channel scales into the dot_general output layout.

    ``dot_general``'s output is ``(batch dims in dimension-number order, lhs free dims, rhs free dims)``.

    Arguments:
        scales: float32 scales over the operand's non-contracting axes, in their original order.
        ndim: the operand's rank.
        dimension_numbers: the dot's ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.
        side: 0 for the lhs, 1 for the rhs.
        out_shape: the dot's output shape.

    Returns:
        ``scales`` broadcast to ``out_shape``.
    """
    (contract, batch) = (dimension_numbers[0][side], dimension_numbers[1][side])
    kept = [a for a in range(ndim) if a not in contract]
    free = _free_axes(ndim, contract, batch)
    n_batch = len(batch)
    if side == 0:
        out_positions = {a: n_batch + i for i, a in enumerate(free)}
    else:
        n_lhs_free = len(out_shape) - n_batch - len(free)
        out_positions = {a: n_batch + n_lhs_free + i for i, a in enumerate(free)}
    out_positions.update({a: i for i, a in enumerate(batch)})
    # broadcast_in_dim needs increasing target positions: reorder the scale axes first when the batch
    # dims are not listed in ascending order.
    order = sorted(range(len(kept)), key=lambda i: out_positions[kept[i]])
    if order != list(range(len(kept))):
        scales = lax.transpose(scales, order)
    targets = tuple(sorted(out_positions[a] for a in kept))
    return lax.broadcast_in_dim(scales, tuple(out_shape), targets)


def _int32_dot(lhs_codes, rhs_codes, dimension_numbers):
    """``dot_general`` of int8 codes into int32, split along the contraction when it could overflow.

    A contraction longer than ``MAX_INT32_SAFE_CONTRACTION`` is flattened, zero-padded and cut into chunks
    that become one extra batch dim of the same single int8 dot; each chunk sums exactly in int32 and the
    chunk sums are added in float32.

    Returns:
        float32 sums in the dot's output layout.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    contraction = int(np.prod([lhs_codes.shape[a] for a in lc], dtype=np.int64))
    if contraction <= MAX_INT32_SAFE_CONTRACTION:
        acc = lax.dot_general(lhs_codes, rhs_codes, dimension_numbers, preferred_element_type=np.int32)
        return lax.convert_element_type(acc, np.float32)
    lhs_free = _free_axes(lhs_codes.ndim, lc, lb)
    rhs_free = _free_axes(rhs_codes.ndim, rc, rb)
    n_chunks = -(-contraction // MAX_INT32_SAFE_CONTRACTION)
    chunk = -(-contraction // n_chunks)

    def chunked(codes, batch, free, contract):
        moved = lax.transpose(codes, (*batch, *free, *contract))
        lead = moved.shape[: len(batch) + len(free)]
        flat = lax.reshape(moved, (*lead, contraction))
        padded = lax.pad(flat, np.int8(0), [(0, 0, 0)] * len(lead) + [(0, n_chunks * chunk - contraction, 0)])
        return lax.reshape(padded, (*lead, n_chunks, chunk))

    lhs3 = chunked(lhs_codes, lb, lhs_free, lc)
    rhs3 = chunked(rhs_codes, rb, rhs_free, rc)
    n_batch = len(lb)
    lhs_chunk_axis, rhs_chunk_axis = n_batch + len(lhs_free), n_batch + len(rhs_free)
    chunk_dims = (
        ((lhs_chunk_axis + 1,), (rhs_chunk_axis + 1,)),
        ((*range(n_batch), lhs_chunk_axis), (*range(n_batch), rhs_chunk_axis)),
    )
    acc = lax.dot_general(lhs3, rhs3, chunk_dims, preferred_element_type=np.int32)
    # acc is (batch..., chunk, lhs free..., rhs free...): sum the chunks in float32.
    return lax.reduce_sum(lax.convert_element_type(acc, np.float32), (n_batch,))


def int8_dot_general_impl(lhs, rhs, dimension_numbers, out_dtype):
    """The int8 program for one ``dot_general`` (no gradient rule; see :func:`int8_dot_general`)."""
    (lc, rc), _ = dimension_numbers
    lhs_q = quantize(lhs, lc)
    rhs_q = quantize(rhs, rc)
    acc = _int32_dot(lhs_q.codes, rhs_q.codes, dimension_numbers)
    lhs_scale = scale_to_output(lhs_q.scales, lhs.ndim, dimension_numbers, 0, acc.shape)
    rhs_scale = scale_to_output(rhs_q.scales, rhs.ndim, dimension_numbers, 1, acc.shape)
    out = lax.mul(lax.mul(acc, lhs_scale), rhs_scale)
    return out if out.dtype == out_dtype else lax.convert_element_type(out, out_dtype)


def _float_params(params: tuple) -> dict:
    return dict(params)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def int8_dot_general(lhs, rhs, float_params: tuple, out_dtype):
    """One float ``dot_general`` computed in int8, with a straight-through gradient.

    Arguments:
        lhs, rhs: the dot's operands (floating).
        float_params: the original equation's params as a sorted tuple of items (hashable); the
            ``dimension_numbers`` drive the int8 dot, and all of them are reused verbatim for the float
            dots of the JVP.
        out_dtype: the dot's output dtype.

    Returns:
        The dot's value in ``out_dtype``, computed as ``int32_sum * lhs_scale * rhs_scale``.
    """
    return int8_dot_general_impl(lhs, rhs, _float_params(float_params)["dimension_numbers"], out_dtype)


def _straight_through_jvp(float_params, out_dtype, primals, tangents):
    lhs, rhs = primals
    lhs_dot, rhs_dot = tangents
    out = int8_dot_general(lhs, rhs, float_params, out_dtype)
    params = _float_params(float_params)
    terms = []
    if type(lhs_dot) is not SymbolicZero:
        terms.append(lax.dot_general_p.bind(lhs_dot, rhs, **params))
    if type(rhs_dot) is not SymbolicZero:
        terms.append(lax.dot_general_p.bind(lhs, rhs_dot, **params))
    if not terms:
        return out, lax.zeros_like_array(out)
    tangent = terms[0] if len(terms) == 1 else lax.add(*terms)
    return out, tangent.astype(out.dtype)


int8_dot_general.defjvp(_straight_through_jvp, symbolic_zeros=True)
