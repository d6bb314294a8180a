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

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .config import RewriteConfig
from .int32_dot import int32_dot
from .layout import blocked, blocked_dimension_numbers, contraction_size, scale_to_output
from .float64_scales import scale_product_in_float64
from .fused_gpu_dot import fits_fused_kernel, fused_dot, fused_dots
from .quantize import compute_dtype, scale_product
from .operands import has_dynamic_scales, quantize_operand, quantize_operand_in_float64
from .quantized import is_quantized
from .static_activations import ScaledActivation
from .tpu_layout import laid_out_for_tpu

__all__ = ["PER_CHANNEL", "Scheme", "fits_sibling_kernel", "int8_dot_general_impl", "int8_sibling_dots_impl",
           "scaled_int8_dot", "scaled_int8_dot_and_operands"]


class Scheme(NamedTuple):
    """How scales are laid out (hashable: it is a static argument of the rewritten dot).

    Attributes:
        granularity: ``"per-channel"`` (the contract: one scale per index of the non-contracting dims) or
            ``"per-tensor"`` (one scale per operand).
        block_size: if set, per-channel scales are refined to one per block of this many elements along the
            (flattened) contraction; int32 partial sums are scaled per block and summed in float32.
        fused_gpu_kernel: on an NVIDIA GPU, a dot of a float activation and a pre-quantized weight runs as one
            kernel (:mod:`~jaxpr_rewrite.fused_gpu_dot`, the ``"int8-fused"`` backend); the same numbers.
    """

    granularity: str = "per-channel"
    block_size: int | None = None
    fused_gpu_kernel: bool = False

    @classmethod
    def of(cls, config: RewriteConfig, fused_gpu_kernel: bool = False) -> "Scheme":
        return cls(config.granularity, None if config.block_size is None else int(config.block_size),
                   fused_gpu_kernel)


PER_CHANNEL = Scheme()


def _scaled(acc, operands, placements):
    """``acc * scale_lhs * scale_rhs`` (see :func:`~jaxpr_rewrite.quantize.scale_product`), each operand's
    epilogue factors placed into ``acc``'s layout by ``placements[side](values)``."""
    lhs, rhs = ([place(factor) for factor in q.epilogue_factors(acc.dtype)] for q, place in zip(operands, placements))
    return scale_product(acc, lhs, rhs)


def _common_dtype(lhs_q, rhs_q, out_dtype=np.float32):
    """The epilogue's dtype: float64 when either operand's scales or the output are float64 (float32 operands
    with ``preferred_element_type=float64`` would overflow or flush in a float32 epilogue), float32 otherwise."""
    return _epilogue_dtype(lhs_q.scale_dtype, rhs_q.scale_dtype, out_dtype)


def _epilogue_dtype(lhs_scales_dtype, rhs_scales_dtype, out_dtype):
    """:func:`_common_dtype` from the operands' scale dtypes, for a decision taken before they are quantized."""
    return np.promote_types(np.promote_types(lhs_scales_dtype, rhs_scales_dtype), out_dtype)


def scaled_int8_dot(lhs, rhs, dimension_numbers, lhs_reduce: Sequence[int], rhs_reduce: Sequence[int],
                    out_dtype=np.float32, fused_gpu_kernel: bool = False):
    """Quantize both operands (one scale per slice over ``*_reduce``), take their int8 dot into int32, and scale
    it back: ``acc * lhs_scale * rhs_scale`` in float32 (float64 for float64 operands or output).

    A float32 dot with dynamic scales is lowered per platform (``lax.platform_dependent``): on GPUs its epilogue
    reads each activation's float64 scale (:func:`~jaxpr_rewrite.float64_scales.scale_product_in_float64`), the
    same result wherever the contract's product is an ordinary float; CPU and TPU take
    :func:`~jaxpr_rewrite.quantize.scale_product`.

    Arguments:
        lhs, rhs: floating operands, or :class:`QuantizedArray` ones whose scales run over the axes not in
            ``*_reduce``.
        dimension_numbers: the dot's dimension numbers.
        lhs_reduce, rhs_reduce: the axes each scale covers (the contracting dims, or every axis).
        out_dtype: the dot's output dtype; a float64 one makes the epilogue float64.
        fused_gpu_kernel: on an NVIDIA GPU, take :func:`~jaxpr_rewrite.fused_gpu_dot.fused_dot` where it fits (a
            float activation times a pre-quantized 2-D weight, with dynamic or static activation scales).

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


def _scaled_int8_dot(lhs, rhs, dimension_numbers, lhs_reduce, rhs_reduce, out_dtype, keep_operands: bool,
                     fused_gpu_kernel: bool = False):
    (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dimension_numbers
    lhs, rhs = laid_out_for_tpu(lhs, lhs_batch, lhs_contracting), laid_out_for_tpu(rhs, rhs_batch, rhs_contracting)

    def result(out, lhs_q, rhs_q):
        if not keep_operands:
            return out
        return out, *((q.codes, q.scales, q.exponents) for q in (lhs_q, rhs_q))

    def portable(gemm_codes=_int8_buffers_on_gpu):
        lhs_q = quantize_operand(lhs, lhs_reduce, rhs)
        rhs_q = quantize_operand(rhs, rhs_reduce, lhs)
        acc = int32_dot(*gemm_codes(lhs_q.codes, rhs_q.codes), dimension_numbers,
                        _common_dtype(lhs_q, rhs_q, out_dtype))
        return result(_scaled(acc, (lhs_q, rhs_q), _placements(lhs_q, rhs_q, dimension_numbers, acc.shape)),
                      lhs_q, rhs_q)

    # the branch CPU and TPU take where the platform is chosen here: no second choice for the GEMM's codes
    on_cpu_or_tpu = functools.partial(portable, gemm_codes=_as_they_are)

    def on_gpu():
        (lhs_q, lhs_scale), (rhs_q, rhs_scale) = (quantize_operand_in_float64(lhs, lhs_reduce, rhs),
                                                  quantize_operand_in_float64(rhs, rhs_reduce, lhs))
        acc = int32_dot(*_int8_buffers(lhs_q.codes, rhs_q.codes), dimension_numbers, np.float32)
        placements = _placements(lhs_q, rhs_q, dimension_numbers, acc.shape)
        with jax.enable_x64(True):  # the float64 scales keep their dtype through the broadcasts
            sides = [place(scale) if scale is not None else tuple(place(f) for f in q.epilogue_factors(np.float32))
                     for q, scale, place in zip((lhs_q, rhs_q), (lhs_scale, rhs_scale), placements)]
        return result(scale_product_in_float64(acc, *sides), lhs_q, rhs_q)

    float64_epilogue = _takes_float64_epilogue(lhs, rhs, out_dtype)
    if fused_gpu_kernel and not keep_operands and _fits_fused_kernel(lhs, rhs, dimension_numbers, out_dtype):
        (_, weight_contracting), _ = dimension_numbers
        on_cuda = functools.partial(fused_dot, lhs, rhs, tuple(weight_contracting))
        return lax.platform_dependent(cpu=on_cpu_or_tpu, tpu=on_cpu_or_tpu, cuda=on_cuda,
                                      default=on_gpu if float64_epilogue else portable)
    if not float64_epilogue:
        return portable()
    return lax.platform_dependent(cpu=on_cpu_or_tpu, tpu=on_cpu_or_tpu, default=on_gpu)


def _int8_buffers(lhs_codes, rhs_codes):
    """The codes as int8 buffers for a GPU's GEMM (an optimization barrier), not float32 quotients XLA converts
    inside the GEMM fusion. XLA's autotuner tries each GEMM tiling on random data in its operands' dtypes and
    rejects one whose result differs; float32 data in [0, 1) converted to int8 is all zero codes, so it could not
    reject the Triton tilings with a K block of 16, whose ``mma.m16n8k32`` takes the same half of K twice and
    doubles every sum (an H200 kept one for small dots)."""
    return lax.optimization_barrier((lhs_codes, rhs_codes))


def _as_they_are(lhs_codes, rhs_codes):
    """The codes for XLA:CPU's and XLA:TPU's dot, which fuse the quantization into it."""
    return lhs_codes, rhs_codes


def _int8_buffers_on_gpu(lhs_codes, rhs_codes):
    """:func:`_int8_buffers` on GPUs, the codes as they are elsewhere: for a dot whose program is not chosen per
    platform already."""
    return lax.platform_dependent(lhs_codes, rhs_codes, cpu=_as_they_are, tpu=_as_they_are, default=_int8_buffers)


def _fits_fused_kernel(lhs, rhs, dimension_numbers, out_dtype) -> bool:
    """Whether :func:`~jaxpr_rewrite.fused_gpu_dot.fused_dot` computes the dot: a float activation with the
    contract's dynamic scales, or the static scale of the pre-quantized weight it meets, times a weight, with a
    float32 epilogue."""
    if is_quantized(lhs) or any(isinstance(x, ScaledActivation) for x in (lhs, rhs)):
        return False
    if not (is_quantized(rhs) or has_dynamic_scales(rhs, lhs)):
        return False
    rhs_scales = rhs.scale_dtype if is_quantized(rhs) else compute_dtype(rhs.dtype)
    return (_epilogue_dtype(compute_dtype(lhs.dtype), rhs_scales, out_dtype) == np.float32
            and fits_fused_kernel(lhs, rhs, dimension_numbers))


def _placements(lhs_q, rhs_q, dimension_numbers, out_shape):
    """For each operand, the function that broadcasts its per-slice values into the dot's output layout."""
    return tuple(functools.partial(scale_to_output, kept_axes=q.kept_axes, ndim=q.ndim,
                                   dimension_numbers=dimension_numbers, side=side, out_shape=out_shape)
                 for side, q in enumerate((lhs_q, rhs_q)))


def _takes_float64_epilogue(lhs, rhs, out_dtype) -> bool:
    """Whether a GPU's epilogue of this dot is :func:`~jaxpr_rewrite.float64_scales.scale_product_in_float64`: a
    float32 epilogue with at least one operand on dynamic scales."""
    scales_dtypes = [x.scale_dtype if is_quantized(x)
                     else compute_dtype(jnp.result_type(x.value if isinstance(x, ScaledActivation) else x))
                     for x in (lhs, rhs)]
    return (_epilogue_dtype(*scales_dtypes, out_dtype) == np.float32
            and (has_dynamic_scales(lhs, rhs) or has_dynamic_scales(rhs, lhs)))


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
        out = scaled_int8_dot(lhs, rhs, dimension_numbers, lhs_reduce, rhs_reduce, out_dtype,
                              fused_gpu_kernel=scheme.fused_gpu_kernel and not per_tensor)
    out = out if out.dtype == out_dtype else lax.convert_element_type(out, out_dtype)
    if dimension_numbers[1][0] and TPU_FUSION_OF_BATCHED_EPILOGUE_CRASHES:
        out = lax.platform_dependent(out, tpu=lax.optimization_barrier, default=lambda out: out)
    return out


# Whether a batched dot's output goes behind an optimization barrier on TPU, written out before its consumers read it
# (as the float program's attention scores are). XLA:TPU's compiler in the libtpu of JAX 0.10 dies of a stack
# overflow (SIGSEGV, the whole process) estimating the cost of fusing the epilogue with a softmax over the output,
# attention's softmax(q . k), in every int8ify'd BERT-style encoder (the deviceless TPU compile reproduces it;
# docs/performance.md); JAX 0.12's compiles it, and the barrier would cost its transformer block 4-10% of its
# estimated cycles with static scales. JAX 0.11's was not tried. An unbatched dot (Dense, an MLP) is never affected.
TPU_FUSION_OF_BATCHED_EPILOGUE_CRASHES = jax.__version_info__ < (0, 12)


def fits_sibling_kernel(lhs, rhs, dimension_numbers, out_dtype, scheme: Scheme) -> bool:
    """Whether the dot joins its siblings' kernel (:func:`int8_sibling_dots_impl`): one that ``scheme`` computes
    with :func:`~jaxpr_rewrite.fused_gpu_dot.fused_dot` on an NVIDIA GPU."""
    return (scheme.fused_gpu_kernel and scheme.granularity == PER_CHANNEL.granularity and scheme.block_size is None
            and _fits_fused_kernel(lhs, rhs, dimension_numbers, out_dtype))


def int8_sibling_dots_impl(lhs, rhss, float_params, out_dtypes, scheme: Scheme) -> tuple:
    """The int8 programs of several dots of one activation ``lhs`` (each fitting :func:`fits_sibling_kernel`): on
    an NVIDIA GPU one kernel for all of them (:func:`~jaxpr_rewrite.fused_gpu_dot.fused_dots`), elsewhere each dot's
    own :func:`int8_dot_general_impl`; the same numbers either way.

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

    def each_dot():
        return tuple(int8_dot_general_impl(lhs, rhs, dims, out_dtype, scheme._replace(fused_gpu_kernel=False))
                     for rhs, dims, out_dtype in zip(rhss, dimension_numbers, out_dtypes))

    def on_cuda():
        outs = fused_dots(lhs, rhss, [tuple(rc) for ((_, rc), _) in dimension_numbers])
        return tuple(out if out.dtype == out_dtype else lax.convert_element_type(out, out_dtype)
                     for out, out_dtype in zip(outs, out_dtypes))

    return lax.platform_dependent(cuda=on_cuda, default=each_dot)
