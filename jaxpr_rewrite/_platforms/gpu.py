"""The contract's program on XLA's GPU compiler (CUDA and ROCm): float64 where a float32 division would be
approximate, int8 buffers and a padded contraction for the int8 GEMM, and on NVIDIA GPUs Pallas kernels that fuse a
weight's dot with its activation's quantization.

XLA compiles a float32 division for GPUs to ``div.full.f32``, within 2 ulp of the quotient: the codes are float64
quotients rounded to float32 (:func:`~jaxpr_rewrite._numerics.exact_division.quotients_by_float64`), whose rounding
is provably the correctly rounded one, and a dot with dynamic scales reads each activation's float64 scale in its
epilogue (:func:`~jaxpr_rewrite._numerics.float64_scales.scale_product_in_float64`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core.layout import is_static
from .._core.platforms import Platform, register_platform
from .._dots.int8_dot import dot_result, epilogue_dtype, placements
from .._dots.operands import has_dynamic_scales, quantize_operand_in_float64
from .._numerics.exact_division import (divide_in_float64, divided_by_odd, quotients_by_float64, quotients_exactly,
                                        reciprocal_by_integers)
from .._numerics.float64_scales import quantize_by_float64, scale_product_in_float64
from .._numerics.int32_dot import contraction_padding, int32_dot, matrix_vector_safe_dot, padded_contraction
from .._numerics.quantize import compute_dtype, marked_codes, quantize_with_factors
from .._numerics.static_scales import factor_or_inf_by_codes, fields_by_slices, quantize_static_parts
from .._quantized.activations import ScaledActivation
from .._quantized.array import is_quantized
from .fused_gpu_dot import fits_fused_kernel, fused_dot, fused_dots
from .gpu_gemm_flags import check_int8_gemm_flags

__all__ = ["Gpu", "fits_fused_kernel_dot"]


class Gpu(Platform):
    """XLA's GPU program; ``nvidia``: CUDA, whose Pallas (Triton) kernels compute a weight's dot in one kernel."""

    def __init__(self, lowering: str, nvidia: bool):
        self.lowerings = (lowering,)
        self.nvidia = nvidia
        self.sibling_kernel = nvidia

    def divide_by_code_limit(self, mantissa, *, limit: int):
        return divided_by_odd(mantissa, limit)

    def reciprocal(self, d):
        return reciprocal_by_integers(d)

    def divide(self, numerator, denominator):
        return divide_in_float64(numerator, denominator)

    def rounded_quotients(self, values, scales, prescale, *, kept_axes: tuple):
        """Float32 values by :func:`~jaxpr_rewrite._numerics.exact_division.quotients_by_float64` (four operations per
        element instead of the exact comparison's twenty or so: the transformer block of
        ``benchmarks/accelerators.py`` launches 34 kernels on an H200 instead of 36); float64 ones exactly."""
        if values.dtype == np.float32:
            return quotients_by_float64(values, scales, prescale, kept_axes)
        return quotients_exactly(values, scales, prescale, kept_axes)

    def quantize_dynamic(self, x, *, reduce_axes: tuple):
        """A float32 matrix's scales taken inside its absmax reduction, in float64
        (:func:`~jaxpr_rewrite._numerics.float64_scales.quantize_by_float64`), so no kernel of its own computes them
        (a ragged dot's, a dot's with a float64 epilogue; a float32 dot's dynamic scales are
        :meth:`scaled_dot`'s); XLA's GPU compiler fuses the NaN-to-Inf select into the reduction."""
        if x.ndim <= 2 and compute_dtype(x.dtype) == np.float32:
            return quantize_by_float64(x, reduce_axes=reduce_axes)
        return quantize_with_factors(x, reduce_axes)

    def quantize_static(self, x, static, *, reduce_axes: tuple, sums_values: bool):
        """Each slice's factor straight from a reduction over the codes, Inf for a slice holding NaN or Inf
        (:func:`~jaxpr_rewrite._numerics.static_scales.factor_or_inf_by_codes`): XLA's GPU compiler makes a kernel of
        its own of per-slice arithmetic after a reduction it cannot fuse (the transformer block of
        ``benchmarks/accelerators.py`` with static scales launched 28 kernels, 24 with the factor from this
        reduction). The operand keeps its shape (the matrix form XLA:CPU reads makes one kernel more here)."""
        return quantize_static_parts(x, static, reduce_axes, codes_of=marked_codes, factor_of=factor_or_inf_by_codes)

    def static_scale_fields(self, vector, *, count: int) -> tuple:
        return fields_by_slices(vector, count)

    def gemm_codes(self, lhs_codes, rhs_codes) -> tuple:
        """The codes as int8 buffers (an optimization barrier), not float32 quotients XLA converts inside the GEMM
        fusion. XLA's autotuner tries each GEMM tiling on random data in its operands' dtypes and rejects one whose
        result differs; float32 data in [0, 1) converted to int8 is all zero codes, so it could not reject the Triton
        tilings with a K block of 16, whose ``mma.m16n8k32`` takes the same half of K twice and doubles every sum (an
        H200 kept one for small dots)."""
        return lax.optimization_barrier((lhs_codes, rhs_codes))

    def int8_sums(self, lhs_codes, rhs_codes, *, dimension_numbers):
        """The contraction zero-padded to a multiple of 4: XLA's Triton int8 GEMM (JAX 0.11) returns doubled sums
        otherwise."""
        pad = contraction_padding(lhs_codes.shape, dimension_numbers[0][0])
        if not (is_static(pad) and pad == 0):
            lhs_codes, rhs_codes = padded_contraction(lhs_codes, rhs_codes, dimension_numbers, pad)
        return matrix_vector_safe_dot(lhs_codes, rhs_codes, dimension_numbers)

    def scaled_dot(self, lhs, rhs, *, dimension_numbers, lhs_reduce: tuple, rhs_reduce: tuple, out_dtype,
                   fused_kernel: bool, keep_operands: bool, portable):
        """On an NVIDIA GPU, a float activation times a pre-quantized 2-D weight as one kernel where it fits
        (:func:`~jaxpr_rewrite._platforms.fused_gpu_dot.fused_dot`); a float32 dot with dynamic scales with its
        epilogue reading each activation's float64 scale (:func:`_float64_epilogue_dot`), the same result wherever the
        contract's product is an ordinary float; any other as the contract's portable program."""
        if self.nvidia and fused_kernel and fits_fused_kernel_dot(lhs, rhs, dimension_numbers, out_dtype):
            (_, weight_contracting), _ = dimension_numbers
            return fused_dot(lhs, rhs, tuple(weight_contracting))
        if _takes_float64_epilogue(lhs, rhs, out_dtype):
            return _float64_epilogue_dot(lhs, rhs, dimension_numbers, lhs_reduce, rhs_reduce, keep_operands)
        return portable()

    def sibling_dots(self, lhs, rhss, *, contracting: tuple, out_dtypes: tuple, each_dot) -> tuple:
        """On an NVIDIA GPU, one kernel for every dot (:func:`~jaxpr_rewrite._platforms.fused_gpu_dot.fused_dots`)."""
        if not self.nvidia:
            return each_dot()
        outs = fused_dots(lhs, rhss, list(contracting))
        return tuple(out if out.dtype == out_dtype else lax.convert_element_type(out, out_dtype)
                     for out, out_dtype in zip(outs, out_dtypes))

    def check_gemm(self) -> None:
        check_int8_gemm_flags()


def _float64_epilogue_dot(lhs, rhs, dimension_numbers, lhs_reduce, rhs_reduce, keep_operands: bool):
    """A float32 dot whose operands with dynamic scales keep their float64 slice scales
    (:func:`~jaxpr_rewrite._dots.operands.quantize_operand_in_float64`), read by the epilogue
    (:func:`~jaxpr_rewrite._numerics.float64_scales.scale_product_in_float64`)."""
    (lhs_q, lhs_scale), (rhs_q, rhs_scale) = (quantize_operand_in_float64(lhs, lhs_reduce, rhs),
                                              quantize_operand_in_float64(rhs, rhs_reduce, lhs))
    acc = int32_dot(*GPU.gemm_codes(lhs_q.codes, rhs_q.codes), dimension_numbers, np.float32)
    placed = placements(lhs_q, rhs_q, dimension_numbers, acc.shape)
    with jax.enable_x64(True):  # the float64 scales keep their dtype through the broadcasts
        sides = [place(scale) if scale is not None else tuple(place(f) for f in q.epilogue_factors(np.float32))
                 for q, scale, place in zip((lhs_q, rhs_q), (lhs_scale, rhs_scale), placed)]
    return dot_result(scale_product_in_float64(acc, *sides), lhs_q, rhs_q, keep_operands)


def fits_fused_kernel_dot(lhs, rhs, dimension_numbers, out_dtype) -> bool:
    """Whether :func:`~jaxpr_rewrite._platforms.fused_gpu_dot.fused_dot` computes the dot: a float activation with the
    contract's dynamic scales, or the static scale of the pre-quantized weight it meets, times a weight, with a
    float32 epilogue."""
    if is_quantized(lhs) or any(isinstance(x, ScaledActivation) for x in (lhs, rhs)):
        return False
    if not (is_quantized(rhs) or has_dynamic_scales(rhs, lhs)):
        return False
    rhs_scales = rhs.scale_dtype if is_quantized(rhs) else compute_dtype(rhs.dtype)
    return (epilogue_dtype(compute_dtype(lhs.dtype), rhs_scales, out_dtype) == np.float32
            and fits_fused_kernel(lhs, rhs, dimension_numbers))


def _takes_float64_epilogue(lhs, rhs, out_dtype) -> bool:
    """Whether the dot's epilogue is :func:`~jaxpr_rewrite._numerics.float64_scales.scale_product_in_float64`: a
    float32 epilogue with at least one operand on dynamic scales."""
    scales_dtypes = [x.scale_dtype if is_quantized(x)
                     else compute_dtype(jnp.result_type(x.value if isinstance(x, ScaledActivation) else x))
                     for x in (lhs, rhs)]
    return (epilogue_dtype(*scales_dtypes, out_dtype) == np.float32
            and (has_dynamic_scales(lhs, rhs) or has_dynamic_scales(rhs, lhs)))


GPU = register_platform(Gpu("cuda", nvidia=True))
register_platform(Gpu("rocm", nvidia=False))
