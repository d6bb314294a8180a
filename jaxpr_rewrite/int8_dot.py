"""The rewrite of one float matmul: quantize, int8 x int8 -> int32 dot, float32 scale epilogue.

This is the seed contract generalised to any dimension numbers: each operand gets one scale per index of its
non-contracting dims (batch + free), taken over all of its contracting dims; the codes go through one
``dot_general`` with the *same* dimension numbers and ``preferred_element_type=int32``; the int32 sums are scaled
by the outer product of the two scale arrays, formed by broadcasting into the output layout (never a matmul of
scales, never a B x D_in x D_out product).

The same contract for ``ragged_dot_general`` is in :mod:`~jaxpr_rewrite.ragged_dot`, the straight-through gradient
in :mod:`~jaxpr_rewrite.straight_through`, and the ``"int8"`` backend built from them in
:mod:`~jaxpr_rewrite.int8_backend`.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
from jax import lax

from .config import RewriteConfig
from .int32_dot import int32_dot
from .layout import blocked, blocked_dimension_numbers, contraction_size, scale_to_output
from .quantize import scale_product
from .operands import quantize_operand
from .quantized import is_quantized

__all__ = ["PER_CHANNEL", "Scheme", "int8_dot_general_impl", "scaled_int8_dot"]


class Scheme(NamedTuple):
    """How scales are laid out (hashable: it is a static argument of the rewritten dot).

    Attributes:
        granularity: ``"per-channel"`` (the contract: one scale per index of the non-contracting dims) or
            ``"per-tensor"`` (one scale per operand).
        block_size: if set, per-channel scales are refined to one per block of this many elements along the
            (flattened) contraction; int32 partial sums are scaled per block and summed in float32.
    """

    granularity: str = "per-channel"
    block_size: int | None = None

    @classmethod
    def of(cls, config: RewriteConfig) -> "Scheme":
        return cls(config.granularity, None if config.block_size is None else int(config.block_size))


PER_CHANNEL = Scheme()


def _scaled(acc, operands, placements):
    """``acc * scale_lhs * scale_rhs`` (see :func:`~jaxpr_rewrite.quantize.scale_product`), each operand's
    epilogue factors placed into ``acc``'s layout by ``placements[side](values)``."""
    lhs, rhs = ([place(factor) for factor in q.epilogue_factors(acc.dtype)] for q, place in zip(operands, placements))
    return scale_product(acc, lhs, rhs)


def _common_dtype(lhs_q, rhs_q, out_dtype=np.float32):
    """The epilogue's dtype: float64 when either operand's scales or the output are float64 (float32 operands
    with ``preferred_element_type=float64`` would overflow or flush in a float32 epilogue), float32 otherwise."""
    return np.promote_types(np.promote_types(lhs_q.scales.dtype, rhs_q.scales.dtype), out_dtype)


def scaled_int8_dot(lhs, rhs, dimension_numbers, lhs_reduce: Sequence[int], rhs_reduce: Sequence[int],
                    out_dtype=np.float32):
    """Quantize both operands (one scale per slice over ``*_reduce``), take their int8 dot into int32, and scale
    it back: ``acc * lhs_scale * rhs_scale`` in float32 (float64 for float64 operands or output).

    Arguments:
        lhs, rhs: floating operands, or :class:`QuantizedArray` ones whose scales run over the axes not in
            ``*_reduce``.
        dimension_numbers: the dot's dimension numbers.
        lhs_reduce, rhs_reduce: the axes each scale covers (the contracting dims, or every axis).
        out_dtype: the dot's output dtype; a float64 one makes the epilogue float64.

    Returns:
        ``(lhs_q, rhs_q, out)``: both operands quantized, and the result in the epilogue's dtype.
    """
    lhs_q = quantize_operand(lhs, lhs_reduce, rhs)
    rhs_q = quantize_operand(rhs, rhs_reduce, lhs)
    acc = int32_dot(lhs_q.codes, rhs_q.codes, dimension_numbers, _common_dtype(lhs_q, rhs_q, out_dtype))

    def placement(q, side):
        return lambda values: scale_to_output(values, q.kept_axes, q.ndim, dimension_numbers, side, acc.shape)

    out = _scaled(acc, (lhs_q, rhs_q), (placement(lhs_q, 0), placement(rhs_q, 1)))
    return lhs_q, rhs_q, out


def _block_scaled_dot(lhs, rhs, dimension_numbers, block_size: int, out_dtype):
    """Sub-channel scaling: one scale per operand channel and block of ``block_size`` along the contraction."""
    (lc, rc), (lb, rb) = dimension_numbers
    n_blocks = -(-contraction_size(lhs.shape, lc) // block_size)
    # a block-scaled weight (quantize_params with block_size) comes in this layout already quantized
    lhs3 = lhs.block_operand(lc, lb, block_size) if is_quantized(lhs) else blocked(lhs, lc, lb, n_blocks, block_size)
    rhs3 = rhs.block_operand(rc, rb, block_size) if is_quantized(rhs) else blocked(rhs, rc, rb, n_blocks, block_size)
    dims3 = blocked_dimension_numbers(dimension_numbers, lhs.ndim, rhs.ndim)
    _, _, partial_sums = scaled_int8_dot(lhs3, rhs3, dims3, (lhs3.ndim - 1,), (rhs3.ndim - 1,), out_dtype)
    # partial_sums is (batch..., block, lhs free..., rhs free...): add the scaled blocks.
    return lax.reduce_sum(partial_sums, (len(lb),))


def int8_dot_general_impl(lhs, rhs, dimension_numbers, out_dtype, scheme: Scheme = PER_CHANNEL):
    """The int8 program for one ``dot_general`` (no gradient rule; see :data:`int8_dot_general`).

    An operand may come already quantized (a :class:`QuantizedArray` with per-channel scales over its
    non-contracting axes, as :func:`jaxpr_rewrite.quantize_params` makes for weights); it is used as is.
    """
    (lc, rc), _ = dimension_numbers
    if scheme.block_size is not None:
        out = _block_scaled_dot(lhs, rhs, dimension_numbers, scheme.block_size, out_dtype)
    else:
        per_tensor = scheme.granularity == "per-tensor"
        lhs_reduce = tuple(range(lhs.ndim)) if per_tensor else lc
        rhs_reduce = tuple(range(rhs.ndim)) if per_tensor else rc
        _, _, out = scaled_int8_dot(lhs, rhs, dimension_numbers, lhs_reduce, rhs_reduce, out_dtype)
    return out if out.dtype == out_dtype else lax.convert_element_type(out, out_dtype)
