"""The rewrite of one float matmul: quantize, int8 x int8 -> int32 dot, float32 scale epilogue.

This is the seed contract generalised to any dimension numbers: each operand gets one scale per index of its
non-contracting dims (batch + free), taken over all of its contracting dims; the codes go through one
``dot_general`` with the *same* dimension numbers and ``preferred_element_type=int32``; the int32 sums are scaled
by the outer product of the two scale arrays, formed by broadcasting into the output layout (never a matmul of
scales, never a B x D_in x D_out product).

What a platform computes its own way (its operands' layout, the GEMM's codes, a GPU's float64 epilogue and fused
kernels, the result as its consumers read it) is asked of :func:`jaxpr_rewrite._core.platforms.current`. The same
contract for ``ragged_dot_general`` is in :mod:`~jaxpr_rewrite._dots.ragged_dot`, the straight-through gradient in
:mod:`~jaxpr_rewrite._dots.straight_through`, and the ``"int8"`` backend built from them in
:mod:`~jaxpr_rewrite._backends.int8`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import numpy as np
from jax import lax

from .._core import platforms
from .._core.layout import blocked, blocked_dimension_numbers, contraction_size, is_static, scale_to_output
from .._numerics.int32_dot import int32_dot
from .._numerics.quantize import scale_product, to_compute
from .._quantized.array import QuantizedArray, is_quantized
from .operands import quantize_operand

__all__ = ["PER_CHANNEL", "Scheme", "common_dtype", "dot_result", "epilogue_dtype", "int8_dot_general_impl",
           "int8_sibling_dots_impl", "placements", "scaled", "scaled_int8_dot", "scaled_int8_dot_and_operands"]


class Scheme(NamedTuple):
    """How scales are laid out, and for which platforms the program is traced (hashable: it is a static argument of
    the rewritten dot, so a shared dot program is traced once per scheme).

    Attributes:
        granularity: ``"per-channel"`` (the contract: one scale per index of the non-contracting dims) or
            ``"per-tensor"`` (one scale per operand).
        block_size: if set, per-channel scales are refined to one per block of this many elements along the
            (flattened) contraction; int32 partial sums are scaled per block and summed in float32.
        fused_gpu_kernel: on an NVIDIA GPU, a dot of a float activation and a pre-quantized weight runs as one
            kernel (:mod:`~jaxpr_rewrite._platforms.fused_gpu_dot`, the ``"int8-fused"`` backend); the same numbers.
        platforms: the lowering platforms the program is for (:func:`~jaxpr_rewrite._core.platforms.target`);
            empty for the ones traced for at the call.
    """

    granularity: str = "per-channel"
    block_size: int | None = None
    fused_gpu_kernel: bool = False
    platforms: tuple = ()

    @property
    def per_channel(self) -> bool:
        """Whether the scales are the contract's: per channel, without blocks."""
        return self.granularity == PER_CHANNEL.granularity and self.block_size is None


PER_CHANNEL = Scheme()


def scaled(acc, operands, placements):
    """``acc * scale_lhs * scale_rhs`` (see :func:`~jaxpr_rewrite._numerics.quantize.scale_product`), each operand's
    epilogue factors placed into ``acc``'s layout by ``placements[side](values)``."""
    lhs, rhs = ([place(factor) for factor in q.epilogue_factors(acc.dtype)] for q, place in zip(operands, placements))
    return scale_product(acc, lhs, rhs)


def common_dtype(lhs_q, rhs_q, out_dtype=np.float32):
    """The epilogue's dtype: float64 when either operand's scales or the output are float64 (float32 operands
    with ``preferred_element_type=float64`` would overflow or flush in a float32 epilogue), float32 otherwise."""
    return epilogue_dtype(lhs_q.scale_dtype, rhs_q.scale_dtype, out_dtype)


def epilogue_dtype(lhs_scales_dtype, rhs_scales_dtype, out_dtype):
    """:func:`common_dtype` from the operands' scale dtypes, for a decision taken before they are quantized."""
    return np.promote_types(np.promote_types(lhs_scales_dtype, rhs_scales_dtype), out_dtype)


def scaled_int8_dot(lhs, rhs, dimension_numbers, lhs_reduce: Sequence[int], rhs_reduce: Sequence[int],
                    out_dtype=np.float32, fused_gpu_kernel: bool = False):
    """Quantize both operands (one scale per slice over ``*_reduce``), take their int8 dot into int32, and scale
    it back: ``acc * lhs_scale * rhs_scale`` in float32 (float64 for float64 operands or output).

    The platform the program is traced for may compute it its own way
    (:meth:`~jaxpr_rewrite._core.platforms.Platform.scaled_dot`: a GPU's float64 epilogue, an NVIDIA GPU's fused
    kernel); the same numbers wherever the contract's product is an ordinary float.

    Arguments:
        lhs, rhs: floating operands, or :class:`QuantizedArray` ones whose scales run over the axes not in
            ``*_reduce``.
        dimension_numbers: the dot's dimension numbers.
        lhs_reduce, rhs_reduce: the axes each scale covers (the contracting dims, or every axis).
        out_dtype: the dot's output dtype; a float64 one makes the epilogue float64.
        fused_gpu_kernel: on an NVIDIA GPU, take :func:`~jaxpr_rewrite._platforms.fused_gpu_dot.fused_dot` where it
            fits (a float activation times a pre-quantized 2-D weight, with dynamic or static activation scales).

    Returns:
        The result, in the epilogue's dtype.
    """
    return _scaled_int8_dot(lhs, rhs, dimension_numbers, lhs_reduce, rhs_reduce, out_dtype, keep_operands=False,
                            fused_gpu_kernel=fused_gpu_kernel)


def scaled_int8_dot_and_operands(lhs, rhs, dimension_numbers, lhs_reduce: Sequence[int],
                                 rhs_reduce: Sequence[int]):
    """:func:`scaled_int8_dot` with the quantized operands it multiplied, each quantized once on every platform.

    Returns:
        ``(out, lhs_parts, rhs_parts)``: the result and each operand's ``(codes, scales, exponents)`` (its scale per
        slice is ``scales * 2**exponents``).
    """
    return _scaled_int8_dot(lhs, rhs, dimension_numbers, lhs_reduce, rhs_reduce, np.float32, keep_operands=True)


def dot_result(out, lhs_q, rhs_q, keep_operands: bool):
    """``out``, with each operand's ``(codes, scales, exponents)`` after it where ``keep_operands``."""
    if not keep_operands:
        return out
    return out, *((q.codes, q.scales, q.exponents) for q in (lhs_q, rhs_q))


def _scaled_int8_dot(lhs, rhs, dimension_numbers, lhs_reduce, rhs_reduce, out_dtype, keep_operands: bool,
                     fused_gpu_kernel: bool = False):
    (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dimension_numbers
    platform = platforms.current()
    lhs = platform.laid_out(lhs, batch_axes=tuple(lhs_batch), contracting_axes=tuple(lhs_contracting))
    rhs = platform.laid_out(rhs, batch_axes=tuple(rhs_batch), contracting_axes=tuple(rhs_contracting))

    def portable():
        lhs_q = quantize_operand(lhs, lhs_reduce, rhs)
        rhs_q = quantize_operand(rhs, rhs_reduce, lhs)
        codes = platforms.current().gemm_codes(lhs_q.codes, rhs_q.codes)
        acc = int32_dot(*codes, dimension_numbers, common_dtype(lhs_q, rhs_q, out_dtype))
        out = scaled(acc, (lhs_q, rhs_q), placements(lhs_q, rhs_q, dimension_numbers, acc.shape))
        return dot_result(out, lhs_q, rhs_q, keep_operands)

    return platform.scaled_dot(lhs, rhs, dimension_numbers=dimension_numbers, lhs_reduce=tuple(lhs_reduce),
                               rhs_reduce=tuple(rhs_reduce), out_dtype=out_dtype,
                               fused_kernel=fused_gpu_kernel and not keep_operands, keep_operands=keep_operands,
                               portable=portable)


def placements(lhs_q, rhs_q, dimension_numbers, out_shape):
    """For each operand, the function that broadcasts its per-slice values into the dot's output layout."""
    return tuple(functools.partial(scale_to_output, kept_axes=q.kept_axes, ndim=q.ndim,
                                   dimension_numbers=dimension_numbers, side=side, out_shape=out_shape)
                 for side, q in enumerate((lhs_q, rhs_q)))


def _block_scaled_dot(lhs, rhs, dimension_numbers, block_size: int, out_dtype):
    """Sub-channel scaling: one scale per operand channel and block of ``block_size`` along the contraction."""
    (lc, rc), (lb, rb) = dimension_numbers
    n_blocks = -(-contraction_size(lhs.shape, lc) // block_size)
    # a block-scaled weight (quantize_params with block_size) comes in this layout already quantized
    lhs3 = lhs.block_operand(lc, lb, block_size) if is_quantized(lhs) else blocked(lhs, lc, lb, n_blocks, block_size)
    rhs3 = rhs.block_operand(rc, rb, block_size) if is_quantized(rhs) else blocked(rhs, rc, rb, n_blocks, block_size)
    dims3 = blocked_dimension_numbers(dimension_numbers, lhs.ndim, rhs.ndim)
    partial_sums = scaled_int8_dot(lhs3, rhs3, dims3, (lhs3.ndim - 1,), (rhs3.ndim - 1,), out_dtype)
    # partial_sums is (batch..., block, lhs free..., rhs free...): add the scaled blocks.
    return lax.reduce_sum(partial_sums, (len(lb),))


def _folded_side(lhs, rhs, dimension_numbers) -> int | None:
    """The side of a pre-quantized operand contracted along the axes its scales run over (a KV cache's values), or
    ``None``."""
    (lc, rc), _ = dimension_numbers
    for side, (x, contracting) in enumerate(((lhs, lc), (rhs, rc))):
        if is_quantized(x) and set(x.contracting) != {int(a) % x.ndim for a in contracting}:
            return side
    return None


def _folded_scales_dot(lhs, rhs, dimension_numbers, side: int, out_dtype):
    """A dot of a float operand ``p`` and a quantized one ``v`` contracted along the axes ``v``'s scales run over
    (attention's ``p . v`` over a KV cache's tokens, each token with its own scale over head_dim): each of ``v``'s
    scales folded into ``p`` before ``p`` is quantized, ``sum_s p[s] v[s] = sum_s (p[s] * s_v[s]) v_q[s]``.

    ``p * s_v`` is quantized with the contract's per-slice scales over the contraction, its codes meet ``v``'s
    codes in one int8 dot with int32 sums, and those are scaled by ``p * s_v``'s scales alone. A token holding NaN
    or Inf has a non-finite scale, which makes every output it feeds non-finite, as the contract's scales do.
    (``v.folds_into_partner`` has checked that each of ``v``'s scales multiplies one product of ``p``: it runs
    along the dot's batch and contracting axes only.)
    """
    (lc, rc), (lb, rb) = dimension_numbers
    quantized, other = (lhs, rhs) if side == 0 else (rhs, lhs)
    own_axes = {0: (lc, lb), 1: (rc, rb)}
    (q_contracting, q_batch), (o_contracting, o_batch) = own_axes[side], own_axes[1 - side]
    # each of v's kept axes is a batch or contracting axis of the dot: the matching axis of p
    partner_axis = {**dict(zip(q_batch, o_batch)), **dict(zip(q_contracting, o_contracting))}
    values = to_compute(other)
    order = sorted(range(len(quantized.kept_axes)), key=lambda i: partner_axis[quantized.kept_axes[i]])
    targets = tuple(partner_axis[quantized.kept_axes[i]] for i in order)
    for factor in _folded_factors(quantized, values.dtype):
        factor = factor if order == list(range(len(order))) else lax.transpose(factor, order)
        values = lax.mul(values, lax.broadcast_in_dim(factor, values.shape, targets))
    kept_shape = tuple(quantized.shape[a] for a in range(quantized.ndim) if a not in set(q_contracting))
    unit = QuantizedArray(quantized.codes, lax.full(kept_shape, 1, values.dtype), lax.full(kept_shape, 0, np.int32),
                          q_contracting, quantized.dtype)
    operands = (values, unit) if side == 1 else (unit, values)
    return scaled_int8_dot(*operands, dimension_numbers, lc, rc, out_dtype)


def _folded_factors(quantized: QuantizedArray, dtype) -> tuple:
    """``v``'s per-slice epilogue factors, which :func:`_folded_scales_dot` multiplies ``p`` by, with 0 for a slice
    never written: its scale 1 is a placeholder for its all-zero codes (a written slice's ``scales`` field is its
    mantissa over 127, below 2/127), and 0 is its values' own product, so that a probability met there (attention
    that does not mask the unwritten positions) takes no part in its row's absmax and leaves the written tokens'
    codes their resolution."""
    factor, power = quantized.epilogue_factors(dtype)
    if quantized.scales is None:
        return factor, power
    unwritten = lax.eq(quantized.scales, lax.full_like(quantized.scales, 1))
    return lax.select(unwritten, lax.full_like(factor, 0), factor), power


def int8_dot_general_impl(lhs, rhs, dimension_numbers, out_dtype, scheme: Scheme = PER_CHANNEL):
    """The int8 program for one ``dot_general`` (no gradient rule; see
    :data:`~jaxpr_rewrite._backends.int8.int8_dot_general`), traced for ``scheme.platforms``.

    An operand may come already quantized (a :class:`QuantizedArray` with per-channel scales over its
    non-contracting axes, as :func:`jaxpr_rewrite.quantize_params` makes for weights); it is used as is.
    """
    with platforms.target(scheme.platforms or None):
        return platforms.per_platform(functools.partial(_int8_dot, lhs, rhs, dimension_numbers, out_dtype, scheme))


def _int8_dot(lhs, rhs, dimension_numbers, out_dtype, scheme: Scheme):
    (lc, rc), (lb, _) = dimension_numbers
    folded = _folded_side(lhs, rhs, dimension_numbers)
    if folded is not None:
        out = _folded_scales_dot(lhs, rhs, dimension_numbers, folded, out_dtype)
    elif scheme.block_size is not None:
        out = _block_scaled_dot(lhs, rhs, dimension_numbers, scheme.block_size, out_dtype)
    else:
        per_tensor = scheme.granularity == "per-tensor"
        lhs_reduce = tuple(range(lhs.ndim)) if per_tensor else lc
        rhs_reduce = tuple(range(rhs.ndim)) if per_tensor else rc
        out = scaled_int8_dot(lhs, rhs, dimension_numbers, lhs_reduce, rhs_reduce, out_dtype,
                              fused_gpu_kernel=scheme.fused_gpu_kernel and not per_tensor)
    out = out if out.dtype == out_dtype else lax.convert_element_type(out, out_dtype)
    return platforms.current().dot_output(out, batched=bool(lb), decode_like=_decode_like(lhs, rhs, dimension_numbers))


# the most rows per batch index of a float operand meeting a stored one in a dot that reads like a decode step's
DECODE_ROWS = 128


def _decode_like(lhs, rhs, dimension_numbers) -> bool:
    """Whether the dot reads like a decode step's attention: one operand stored quantized (a KV cache), the other
    float with at most :data:`DECODE_ROWS` rows per batch index (its size over the axes it neither contracts nor
    batches: a step's few queries, not a prefill's thousands); not one whose rows are symbolic (``jax.export``)."""
    (lc, rc), (lb, rb) = dimension_numbers
    if is_quantized(lhs) == is_quantized(rhs):
        return False
    other, axes = (rhs, set(rc) | set(rb)) if is_quantized(lhs) else (lhs, set(lc) | set(lb))
    rows = [n for a, n in enumerate(other.shape) if a not in axes]
    return all(is_static(n) for n in rows) and int(np.prod(rows)) <= DECODE_ROWS


def int8_sibling_dots_impl(lhs, rhss, float_params, out_dtypes, scheme: Scheme) -> tuple:
    """The int8 programs of several dots of one activation ``lhs``: one program for all of them where the platform
    has one (:meth:`~jaxpr_rewrite._core.platforms.Platform.sibling_dots`: an NVIDIA GPU's kernel), elsewhere each
    dot's own :func:`int8_dot_general_impl`; the same numbers either way.

    Arguments:
        lhs: the float activation.
        rhss: the weights, one per dot.
        float_params: each dot's params, as sorted tuples of items.
        out_dtypes: each dot's output dtype.
        scheme: the layout of scales (its ``fused_gpu_kernel`` set).

    Returns:
        A tuple of the results.
    """
    dimension_numbers = [dict(params)["dimension_numbers"] for params in float_params]
    contracting = tuple(tuple(rc) for ((_, rc), _) in dimension_numbers)

    def each_dot():
        return tuple(_int8_dot(lhs, rhs, dims, out_dtype, scheme._replace(fused_gpu_kernel=False))
                     for rhs, dims, out_dtype in zip(rhss, dimension_numbers, out_dtypes))

    def siblings():
        return platforms.current().sibling_dots(lhs, rhss, contracting=contracting, out_dtypes=tuple(out_dtypes),
                                                each_dot=each_dot)

    with platforms.target(scheme.platforms or None):
        return platforms.per_platform(siblings)
