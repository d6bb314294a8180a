"""The contract's program on XLA:TPU: exact quotients without float64, NaN found where XLA:TPU fuses it, and float
operands in the layout its int8 dot reads.

A TPU has no float64 and compiles a float32 division to a multiply by a refined reciprocal: each code is the
hardware's quotient settled by an exact comparison with the nearest rounding boundary
(:func:`~jaxpr_rewrite._numerics.exact_division.rounded_quotients_exactly`), each slice's divisor and prescale
travelling as one float where that is cheaper (:func:`~jaxpr_rewrite._numerics.exact_division.tpu_per_slice_parts`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax import lax

from .._core.platforms import Platform, register_platform
from .._numerics.exact_division import (divided_by_odd, quotients_exactly, reciprocal_by_integers, tpu_per_slice_parts,
                                        tpu_quotients_per_element_parts, tpu_quotients_per_slice_parts, true_divide)
from .._numerics.int32_dot import matrix_vector_safe_dot
from .._numerics.quantize import marked_codes, quantize_with_factors, saturated_codes
from .._numerics.static_scales import (factor_poisoned_by_codes, factor_poisoned_by_values, fields_by_masks,
                                       quantize_static_parts)
from .tpu_cache_write import token_written, writes_in_place
from .tpu_layout import laid_out_for_tpu

__all__ = ["TPU_FUSION_OF_BATCHED_EPILOGUE_CRASHES", "Tpu"]

# Whether a batched dot of two operands quantized in the program goes behind an optimization barrier on TPU, its
# output written out before its consumers read it (as the float program's attention scores are). XLA:TPU's compiler
# in the libtpu of JAX 0.10 dies of a stack overflow (SIGSEGV, the whole process) estimating the cost of fusing the
# epilogue with a softmax over the output, attention's softmax(q . k), in int8ify'd BERT-style encoders (the
# deviceless TPU compile reproduces it: MiniLM at batch 128 with static attention scales; docs/performance.md); JAX
# 0.12's compiles it, and the barrier would cost its transformer block 4-10% of its estimated cycles with static
# scales. JAX 0.11's was not tried. A decode step's attention (a stored KV cache read by a few query rows) keeps
# its fusion: the Llama-shaped decoder's decode compiles without the barrier (dynamic and static scales, deviceless)
# and runs 4% faster so at batch 128 on a v5e; its prefill (thousands of rows) keeps the barrier, without which it
# compiles but ran at 1.22x bf16's speed against 1.51x. An unbatched dot (Dense, an MLP) is never affected.
TPU_FUSION_OF_BATCHED_EPILOGUE_CRASHES = jax.__version_info__ < (0, 12)


class Tpu(Platform):
    """XLA:TPU's program."""

    lowerings = ("tpu",)

    def divide_by_code_limit(self, mantissa, *, limit: int):
        return divided_by_odd(mantissa, limit)

    def reciprocal(self, d):
        return reciprocal_by_integers(d)

    def divide(self, numerator, denominator):
        """The TPU's own division (within 2 ulps on a v5e): it has no float64 to round a quotient from."""
        return true_divide(numerator, denominator)

    def rounded_quotients(self, values, scales, prescale, *, kept_axes: tuple):
        """Float32 values with the divisor's parts broadcast per slice or decoded per element from one per-slice
        array, whichever the layout makes cheaper; float64 ones (which XLA:TPU emulates) by the plain exact form."""
        if values.dtype != np.float32:
            return quotients_exactly(values, scales, prescale, kept_axes)
        per_slice = tpu_per_slice_parts(values.shape, kept_axes)
        form = tpu_quotients_per_slice_parts if per_slice else tpu_quotients_per_element_parts
        return form(values, scales, prescale, kept_axes=kept_axes)

    def quantize_dynamic(self, x, *, reduce_axes: tuple):
        """The contract's NaN-to-Inf absmax (XLA:TPU fuses the select into its reduction; a check on the codes costs
        it cycles), with the operand and its absmax handed to the quantization pass together, where XLA:TPU would
        otherwise compute the operand's producer (the previous dot's epilogue, an activation function) a second
        time."""
        return quantize_with_factors(x, reduce_axes, keep_values=True)

    def quantize_static(self, x, static, *, reduce_axes: tuple, sums_values: bool):
        """With ``sums_values``, each slice's factor from a sum over its values
        (:func:`~jaxpr_rewrite._numerics.static_scales.factor_poisoned_by_values`), which joins the quantization's
        pass where per-slice arithmetic after a reduction would be a kernel of its own (7% of the static MLP's
        estimated cycles on v5e), and codes without marks; in a transformer block (activations of rank 3 and 4)
        XLA:TPU fused those sums less well than the minimum over the marked codes, which the others take."""
        if sums_values:
            return quantize_static_parts(x, static, reduce_axes, codes_of=lambda values, quotients: saturated_codes(
                quotients), factor_of=factor_poisoned_by_values)
        return quantize_static_parts(x, static, reduce_axes, codes_of=marked_codes, factor_of=factor_poisoned_by_codes)

    def static_scale_fields(self, vector, *, count: int) -> tuple:
        return fields_by_masks(vector, count)

    def write_per_slice(self, array, update, *starts):
        """One decode token's scales written in place by a Pallas kernel (:mod:`.tpu_cache_write`), where XLA:TPU
        would move the whole array through VMEM to write them; other writes by ``lax.dynamic_update_slice``."""
        if writes_in_place(array.shape, update.shape, array.dtype):
            return token_written(array, update, *starts)
        return super().write_per_slice(array, update, *starts)

    def laid_out(self, operand, *, batch_axes: tuple, contracting_axes: tuple):
        return laid_out_for_tpu(operand, batch_axes, contracting_axes)

    def int8_sums(self, lhs_codes, rhs_codes, *, dimension_numbers):
        return matrix_vector_safe_dot(lhs_codes, rhs_codes, dimension_numbers)

    def dot_output(self, out, *, batched: bool, decode_like: bool):
        crashes = batched and not decode_like and TPU_FUSION_OF_BATCHED_EPILOGUE_CRASHES
        return lax.optimization_barrier(out) if crashes else out


TPU = register_platform(Tpu())
