"""The rewrite of one float ``dot_general``: quantize, int8 x int8 -> int32 dot, float32 scale epilogue.

This is the seed contract generalised to any dimension numbers: each operand gets one scale per index of
its non-contracting dims (batch + free), taken over all of its contracting dims; the codes go through one
``dot_general`` with the *same* dimension numbers and ``preferred_element_type=int32``; the int32 sums are
scaled by the outer product of the two scale arrays, formed by broadcasting into the output layout.

Gradients use the straight-through estimator: the rewritten dot's JVP is the float dot's, evaluated at the
float operands.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from .quantize import MAX_INT32_SAFE_CONTRACTION, Quantized, dequantize, quantize


class Scheme(NamedTuple):
    """How scales are laid out (hashable: it is a static argument of the rewritten dot).

    Attributes:
        granularity: ``"per-channel"`` (the contract: one scale per index of the non-contracting dims) or
            ``"per-tensor"`` (one scale per operand).
        block_size: if set, per-channel scales are refined to one per block of this many elements along
            the (flattened) contraction; int32 partial sums are scaled per block and summed in float32.
    """

    granularity: str = "per-channel"
    block_size: int | None = None


PER_CHANNEL = Scheme()


def _free_axes(ndim: int, contracting: Sequence[int], batch: Sequence[int]) -> tuple[int, ...]:
    return tuple(a for a in range(ndim) if a not in contracting and a not in batch)


def scale_to_output(scales, kept_axes: Sequence[int], ndim: int, dimension_numbers, side: int, out_shape) -> jax.Array:
    """Broadcast one operand's scales into the dot_general output layout.

    ``dot_general``'s output is ``(batch dims in dimension-number order, lhs free dims, rhs free dims)``.

    Arguments:
        scales: float32 scales over the operand axes ``kept_axes``, in that (ascending) order.
        kept_axes: operand axes the scales run over; none of them contracting (``()`` for one scale).
        ndim: the operand's rank.
        dimension_numbers: the dot's ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.
        side: 0 for the lhs, 1 for the rhs.
        out_shape: the dot's output shape.

    Returns:
        ``scales`` broadcast to ``out_shape``.
    """
    contract, batch = dimension_numbers[0][side], dimension_numbers[1][side]
    free = _free_axes(ndim, contract, batch)
    n_batch = len(batch)
    offset = n_batch if side == 0 else len(out_shape) - len(free)
    out_positions = {a: offset + i for i, a in enumerate(free)}
    out_positions.update({a: i for i, a in enumerate(batch)})
    # broadcast_in_dim needs increasing target positions: reorder the scale axes first when the batch
    # dims are not listed in ascending order.
    order = sorted(range(len(kept_axes)), key=lambda i: out_positions[kept_axes[i]])
    if order != list(range(len(kept_axes))):
        scales = lax.transpose(scales, order)
    targets = tuple(sorted(out_positions[a] for a in kept_axes))
    return lax.broadcast_in_dim(scales, tuple(out_shape), targets)


def _blocked(x, contract, batch, n_blocks: int, block: int):
    """Move ``x`` to ``(batch..., free..., K)`` and cut the flattened contraction ``K`` into
    ``(n_blocks, block)``, zero-padded at the end."""
    free = _free_axes(x.ndim, contract, batch)
    moved = lax.transpose(x, (*batch, *free, *contract))
    lead = moved.shape[: len(batch) + len(free)]
    contraction = int(np.prod(moved.shape[len(lead):], dtype=np.int64))
    flat = lax.reshape(moved, (*lead, contraction))
    pad = n_blocks * block - contraction
    if pad:
        flat = lax.pad(flat, lax.full((), 0, x.dtype), [(0, 0, 0)] * len(lead) + [(0, pad, 0)])
    return lax.reshape(flat, (*lead, n_blocks, block))


def _blocked_dimension_numbers(dimension_numbers, lhs_ndim: int, rhs_ndim: int):
    """Dimension numbers of the dot between two :func:`_blocked` operands: the block index joins the
    batch dims, the block's elements are contracted."""
    (lc, rc), (lb, rb) = dimension_numbers
    n_batch = len(lb)
    lhs_block_axis = n_batch + len(_free_axes(lhs_ndim, lc, lb))
    rhs_block_axis = n_batch + len(_free_axes(rhs_ndim, rc, rb))
    return (
        ((lhs_block_axis + 1,), (rhs_block_axis + 1,)),
        ((*range(n_batch), lhs_block_axis), (*range(n_batch), rhs_block_axis)),
    )


def contraction_size(shape, contracting: Sequence[int]) -> int:
    """The number of products each output sums: the product of the contracting dims' sizes."""
    return int(np.prod([shape[a] for a in contracting], dtype=np.int64))


def _matrix_vector_safe_dot(lhs_codes, rhs_codes, dimension_numbers):
    """The int8 x int8 -> int32 dot, with a one-row lhs padded to two rows.

    XLA's CPU backend runs an s8 x s8 -> s32 dot with a single lhs row (batch-1 inference) on a slow
    matrix-vector path, about 3x slower than the same dot with two rows (benchmarks/speed.py). Padding the
    row with zeros and slicing it off again keeps one int8 dot and exact sums.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lhs_free = _free_axes(lhs_codes.ndim, lc, lb)
    rhs_free = _free_axes(rhs_codes.ndim, rc, rb)
    one_row = lhs_free and all(lhs_codes.shape[a] == 1 for a in lhs_free)
    if not one_row or contraction_size(rhs_codes.shape, rhs_free) <= 1:
        return lax.dot_general(lhs_codes, rhs_codes, dimension_numbers, preferred_element_type=np.int32)
    padding = [(0, 1 if a == lhs_free[0] else 0, 0) for a in range(lhs_codes.ndim)]
    padded = lax.pad(lhs_codes, np.int8(0), padding)
    acc = lax.dot_general(padded, rhs_codes, dimension_numbers, preferred_element_type=np.int32)
    return lax.slice_in_dim(acc, 0, 1, axis=len(lb))


def _int32_dot(lhs_codes, rhs_codes, dimension_numbers):
    """``dot_general`` of int8 codes into int32, split along the contraction when it could overflow.

    A contraction longer than ``MAX_INT32_SAFE_CONTRACTION`` is flattened, zero-padded and cut into chunks
    that become one extra batch dim of the same single int8 dot; each chunk sums exactly in int32 and the
    chunk sums are added in float32.

    Returns:
        float32 sums in the dot's output layout.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    contraction = contraction_size(lhs_codes.shape, lc)
    if contraction <= MAX_INT32_SAFE_CONTRACTION:
        return lax.convert_element_type(_matrix_vector_safe_dot(lhs_codes, rhs_codes, dimension_numbers), np.float32)
    n_chunks = -(-contraction // MAX_INT32_SAFE_CONTRACTION)
    chunk = -(-contraction // n_chunks)
    lhs3 = _blocked(lhs_codes, lc, lb, n_chunks, chunk)
    rhs3 = _blocked(rhs_codes, rc, rb, n_chunks, chunk)
    acc = lax.dot_general(
        lhs3, rhs3, _blocked_dimension_numbers(dimension_numbers, lhs_codes.ndim, rhs_codes.ndim),
        preferred_element_type=np.int32,
    )
    # acc is (batch..., chunk, lhs free..., rhs free...): sum the chunks in float32.
    return lax.reduce_sum(lax.convert_element_type(acc, np.float32), (len(lb),))


def _block_scaled_dot(lhs, rhs, dimension_numbers, block_size: int):
    """Sub-channel scaling: one scale per operand channel and block of ``block_size`` along the contraction."""
    (lc, rc), (lb, rb) = dimension_numbers
    n_blocks = -(-contraction_size(lhs.shape, lc) // block_size)
    lhs3 = _blocked(lhs, lc, lb, n_blocks, block_size)
    rhs3 = _blocked(rhs, rc, rb, n_blocks, block_size)
    dims3 = _blocked_dimension_numbers(dimension_numbers, lhs.ndim, rhs.ndim)
    lhs_q, rhs_q = quantize(lhs3, (lhs3.ndim - 1,)), quantize(rhs3, (rhs3.ndim - 1,))
    acc = lax.convert_element_type(
        lax.dot_general(lhs_q.codes, rhs_q.codes, dims3, preferred_element_type=np.int32), np.float32
    )
    lhs_scale = scale_to_output(lhs_q.scales, tuple(range(lhs3.ndim - 1)), lhs3.ndim, dims3, 0, acc.shape)
    rhs_scale = scale_to_output(rhs_q.scales, tuple(range(rhs3.ndim - 1)), rhs3.ndim, dims3, 1, acc.shape)
    # acc is (batch..., block, lhs free..., rhs free...): scale each block's partial sums, then add them.
    return lax.reduce_sum(lax.mul(lax.mul(acc, lhs_scale), rhs_scale), (len(lb),))


def int8_dot_general_impl(lhs, rhs, dimension_numbers, out_dtype, scheme: Scheme = PER_CHANNEL):
    """The int8 program for one ``dot_general`` (no gradient rule; see :func:`int8_dot_general`).

    An operand may come already quantized (a :class:`Quantized` with per-channel scales over its
    non-contracting axes, as :func:`jaxpr_rewrite.quantize_params` makes for weights); it is used as is.
    """
    (lc, rc), _ = dimension_numbers
    if scheme.block_size is not None:
        out = _block_scaled_dot(lhs, rhs, dimension_numbers, scheme.block_size)
    else:
        per_tensor = scheme.granularity == "per-tensor"
        lhs_reduce = tuple(range(lhs.ndim)) if per_tensor else lc
        rhs_reduce = tuple(range(rhs.ndim)) if per_tensor else rc
        _, _, out = scaled_int8_dot(lhs, rhs, dimension_numbers, lhs_reduce, rhs_reduce)
    return out if out.dtype == out_dtype else lax.convert_element_type(out, out_dtype)


def scaled_int8_dot(lhs, rhs, dimension_numbers, lhs_reduce: Sequence[int], rhs_reduce: Sequence[int]):
    """Quantize both operands (one scale per slice over ``*_reduce``), take their int8 dot into int32, and
    scale it back: ``acc * lhs_scale * rhs_scale`` in float32.

    Arguments:
        lhs, rhs: floating operands, or :class:`Quantized` ones whose scales already run over the axes not
            in ``*_reduce``.
        dimension_numbers: the dot's dimension numbers.
        lhs_reduce, rhs_reduce: the axes each scale covers (the contracting dims, or every axis).

    Returns:
        ``(lhs_q, rhs_q, out)``: both operands' codes and scales, and the float32 result.
    """
    lhs_q = lhs if isinstance(lhs, Quantized) else quantize(lhs, lhs_reduce)
    rhs_q = rhs if isinstance(rhs, Quantized) else quantize(rhs, rhs_reduce)
    acc = _int32_dot(lhs_q.codes, rhs_q.codes, dimension_numbers)
    scaled = acc
    for side, q in enumerate((lhs_q, rhs_q)):
        ndim = q.codes.ndim
        reduce = (lhs_reduce, rhs_reduce)[side]
        kept = tuple(a for a in range(ndim) if a not in reduce)
        scaled = lax.mul(scaled, scale_to_output(q.scales, kept, ndim, dimension_numbers, side, acc.shape))
    return lhs_q, rhs_q, scaled


def _float_value(operand, contracting, like):
    """The float value of an operand for the JVP's float dots: pre-quantized weights are dequantized."""
    if not isinstance(operand, Quantized):
        return operand
    return dequantize(operand, contracting).astype(like.dtype)


def _has_tangent(primal, tangent) -> bool:
    # Pre-quantized operands are constants of the program: no tangent flows through their codes.
    return not isinstance(primal, Quantized) and type(tangent) is not SymbolicZero


def straight_through(impl):
    """Wrap a quantized dot into a function with a straight-through gradient.

    Arguments:
        impl: ``impl(lhs, rhs, dimension_numbers, out_dtype, option)``, the quantized program for one
            ``dot_general`` (``option``: a hashable description of the scheme or format).

    Returns:
        A ``jax.custom_jvp`` function ``fn(lhs, rhs, float_params, out_dtype, option)``, where
        ``float_params`` are the original ``dot_general`` params as a sorted tuple of items. Its JVP is the
        float dot's, evaluated at the float operands (pre-quantized operands: at ``codes * scales``), so
        ``grad`` sees the float dot while the forward pass stays quantized.
    """

    def dot(lhs, rhs, float_params, out_dtype, option):
        return impl(lhs, rhs, dict(float_params)["dimension_numbers"], out_dtype, option)

    dot.__name__ = dot.__qualname__ = impl.__name__.removesuffix("_impl")
    dot = jax.custom_jvp(dot, nondiff_argnums=(2, 3, 4))

    def straight_through_jvp(float_params, out_dtype, option, primals, tangents):
        lhs, rhs = primals
        lhs_dot, rhs_dot = tangents
        out = dot(lhs, rhs, float_params, out_dtype, option)
        params = dict(float_params)
        (lc, rc), _ = params["dimension_numbers"]
        terms = []
        if _has_tangent(lhs, lhs_dot):
            terms.append(lax.dot_general_p.bind(lhs_dot, _float_value(rhs, rc, lhs_dot), **params))
        if _has_tangent(rhs, rhs_dot):
            terms.append(lax.dot_general_p.bind(_float_value(lhs, lc, rhs_dot), rhs_dot, **params))
        if not terms:
            return out, lax.zeros_like_array(out)
        tangent = terms[0] if len(terms) == 1 else lax.add(*terms)
        return out, tangent.astype(out.dtype)

    dot.defjvp(straight_through_jvp, symbolic_zeros=True)
    return dot


int8_dot_general = straight_through(int8_dot_general_impl)
"""``int8_dot_general(lhs, rhs, float_params, out_dtype, scheme)``: one float ``dot_general`` computed in
int8 under :class:`Scheme` ``scheme``, as ``int32_sum * lhs_scale * rhs_scale`` in ``out_dtype``, with a
straight-through gradient. ``lhs``/``rhs`` may be :class:`Quantized` (pre-quantized weights, no gradient)."""
