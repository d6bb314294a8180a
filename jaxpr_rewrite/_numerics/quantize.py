"""The numerics of the int8 contract: ``absmax / 127`` scales, codes, and the scale epilogue, exactly.

Everything here is written with ``lax`` primitives (not ``jnp.where``/``jnp.round``/``jnp.clip``), so a rewritten
jaxpr reads as a flat list of equations instead of nested ``jit[_where]`` calls. Each function returns plain
arrays; :mod:`jaxpr_rewrite._quantized.array` packs them into a :class:`~jaxpr_rewrite.quantized.QuantizedArray`.

The contract, for one slice ``v`` (the elements one scale covers) with ``a = max|v|``:

* ``s = a / 127`` in float32, correctly rounded; ``s = 1`` for an all-zero slice;
* codes ``q = clip(rint(v / s), -127, 127)`` with ``v / s`` correctly rounded in float32 and ties to even;
* the dot's output ``y = (acc * s_rhs) * s_lhs`` in float32 (``acc`` the exact integer sum).

Scales and the epilogue are float32, or float64 for float64 operands (with ``jax_enable_x64``), so a float64
program keeps its range; the codes are int8 and the sums int32 either way.

**How a scale is held.** A slice's scale is ``scales * 2**exponents``: ``2**exponents`` is the power of two of its
absmax (``a = m * 2**e``, ``1 <= m < 2``) and ``scales = m / 127`` lies in ``[1/127, 2/127)``. Multiplying by a power
of two is exact, so ``scales * 2**exponents`` *is* the contract's ``a / 127``, and ``v / s`` is
``(v * 2**-e) / scales``, bit for bit. Four things make XLA's answer differ from the contract unless handled, and
this representation plus two small devices handle all four:

* **Division.** XLA turns ``a / 127`` into ``a * (1/127)`` and, on CPU, ``v / broadcast(s)`` into ``v * (1/s)``;
  on CUDA it compiles every float division to an approximation within 2 ulp (PTX ``div.full.f32``) and on TPU to a
  refined reciprocal; each moves values on a rounding tie (integers, dyadic values, bfloat16 data) to the other
  code. On CPU both divisions are IEEE ones that XLA keeps divisions; elsewhere the scale's mantissa is divided by
  127 in integers, and each code is a float64 quotient rounded to float32 on a GPU and the approximate quotient
  corrected exactly on a TPU (:mod:`jaxpr_rewrite._numerics.exact_division`; a GPU's matrix operands:
  :mod:`jaxpr_rewrite._numerics.float64_scales`).
* **NaN and Inf.** XLA's CPU ``reduce_max`` drops NaN. :func:`absmax` turns NaN into Inf before reducing (in
  the same fused pass on GPU and TPU); a slice holding NaN or Inf gets an infinite scale, so every output that
  depends on it comes out non-finite (Inf or NaN). The rewritten program on CPU, whose reduction cannot fuse that
  select, quantizes a matrix operand of 4096 values or more with :func:`quantize_dynamic_parts` instead: NaN and
  Inf get the code -128 and make their slice's scale NaN; an operand of higher rank takes NaN as Inf in its values
  (:func:`quantize_parts_nan_as_inf`), a select that joins the kernel computing the operand.
* **Tiny slices.** XLA flushes subnormal floats to zero, so ``a / 127`` for ``a < 127 * 2**-126`` cannot be
  represented as one float. Held as ``scales * 2**exponents`` it needs no special case: the codes of such a slice
  use the full +-127 range like any other.
* **Epilogue range.** ``(acc * s_rhs) * s_lhs`` overflows (or underflows) in its intermediate product when one
  scale is huge and the other tiny, although the result is an ordinary float. :func:`scale_product` multiplies
  the sums by each scale with its exponent clipped to a safe window (the scale itself for every ordinary slice),
  then by the power of two the clip took off; wherever the plain product's intermediates are normal floats this
  is the same number, bit for bit, it is finite and correct whenever the result is, and it is four multiplies by
  per-row and per-column values, which XLA fuses into its GPU GEMM kernel.

Inputs below float32's normal range (subnormals) are read as zero by XLA on CPU and GPU (float16's subnormals
are normal float32 values: :func:`to_compute` keeps them).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from jax import lax

from .exact_division import divided_by_code_limit, reciprocal, rounded_quotients
from .float_formats import FORMATS, FloatFormat, float_format, pow2, widened  # noqa: F401  (part of this module's API)

__all__ = [
    "FORMATS",
    "INT8_MAX",
    "MAX_INT32_SAFE_CONTRACTION",
    "NONFINITE_CODE",
    "absmax",
    "clipped_codes",
    "compute_dtype",
    "dequantize_by_factors",
    "epilogue_factors",
    "epilogue_window",
    "float_format",
    "holds_nonfinite",
    "marked_codes",
    "max_over",
    "nan_marked_codes",
    "nan_safe_magnitude",
    "poison",
    "pow2",
    "quantize_dynamic_parts",
    "quantize_parts",
    "quantize_with_factors",
    "quantize_nan_as_inf_with_factors",
    "quantize_parts_nan_as_inf",
    "saturated_codes",
    "scale_parts",
    "scale_values",
    "scale_product",
    "smoothing_inverse",
    "to_compute",
]

INT8_MAX = 127
# The code that marks a NaN or Inf value in the rewritten program's codes (:func:`marked_codes`,
# :func:`nan_marked_codes`): no finite value gets it, so a minimum (or a comparison) over a slice's codes finds one
NONFINITE_CODE = -INT8_MAX - 1
# The largest contraction whose int8 x int8 products cannot overflow an int32 sum: 127 * 127 * K < 2**31.
MAX_INT32_SAFE_CONTRACTION = (2**31 - 1) // (INT8_MAX * INT8_MAX)


def compute_dtype(dtype) -> np.dtype:
    """The dtype scales and the epilogue are computed in for operands of ``dtype``: float64 for float64, float32
    for every other float (bfloat16 and float16 are upcast)."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def to_compute(x, dtype=None):
    """``x`` in its compute dtype (or ``dtype``).

    A bfloat16 or float16 ``x`` is widened from its bits (:func:`~jaxpr_rewrite._numerics.float_formats.widened`): where
    ``x`` is a wider value cast down (``Dense(dtype=bfloat16)`` with float32 params), XLA's GPU compiler drops the
    ``float32 -> bfloat16 -> float32`` pair under its default ``xla_allow_excess_precision``, and the codes would
    be taken from the unrounded weight."""
    dtype = compute_dtype(x.dtype) if dtype is None else np.dtype(dtype)
    return x if x.dtype == dtype else widened(x, dtype)


def absmax(x, reduce_axes: Sequence[int]):
    """``max|x|`` over ``reduce_axes`` in the compute dtype: Inf for a slice holding NaN or Inf, 0 for an empty one.

    NaN becomes Inf before the reduction (one fused pass), because XLA's CPU float ``reduce_max`` drops NaN for
    many layouts.
    """
    return max_over(nan_safe_magnitude(to_compute(x)), tuple(reduce_axes))


def nan_safe_magnitude(x):
    """``|x|`` with NaN as Inf, so that its maximum over a slice holding NaN or Inf is Inf."""
    return lax.select(lax.ne(x, x), lax.full_like(x, np.inf), lax.abs(x))


def max_over(magnitude, axes: tuple):
    """The maximum of ``magnitude`` over ``axes``, 0 for an empty slice."""
    amax = lax.reduce_max(magnitude, axes)
    if any(magnitude.shape[a] == 0 for a in axes):
        amax = lax.max(amax, magnitude.dtype.type(0))  # reduce_max of an empty slice is -inf: an all-zero slice
    return amax


def scale_parts(amax, limit: int = INT8_MAX):
    """The contract's scales from slice absmaxes, as ``scales * 2**exponents``, and ``2**-exponents``.

    Arguments:
        amax: absmaxes (from :func:`absmax`), float32 or float64.
        limit: the largest code: 127 for int8, 7 for int4 weights.

    Returns:
        ``(scales, exponents, prescale)``: ``exponents`` (int32) is the power of two of the absmax and ``scales``
        (the absmax's dtype) its mantissa divided by ``limit``, in ``[1/limit, 2/limit)`` (``[2/limit, 4/limit)``
        in the top binade, where the exponent is kept one lower so ``2**-exponents`` is a normal float; below that
        for a subnormal absmax, on a device that does not read it as zero); an all-zero slice has scale 1
        (``scales`` 1, ``exponents`` 0) and a slice holding NaN or Inf an infinite scale, which makes every output
        it feeds infinite or NaN. ``prescale = 2**-exponents`` is the codes' exact prescale (any value for an
        all-zero slice, whose elements are all zero). The mantissa is ``amax * 2**-exponents``, a multiply by a
        power of two and so exact, with ``2**-exponents`` built from the absmax's exponent field.
    """
    fmt = float_format(amax)
    field = lax.shift_right_logical(lax.bitcast_convert_type(amax, fmt.bits), fmt.bits(fmt.mantissa_bits))
    # 2**-e must be a normal float for the prescale: the top binade (and Inf) keeps e = bias - 1; a subnormal
    # absmax has field 0, e = -bias, which makes the same exact multiply
    field = lax.min(field, fmt.bits(2 * fmt.bias - 1))
    exponents = lax.sub(lax.convert_element_type(field, np.int32), np.int32(fmt.bias))
    inverse = lax.bitcast_convert_type(
        lax.shift_left(lax.sub(fmt.bits(2 * fmt.bias), field), fmt.bits(fmt.mantissa_bits)), fmt.dtype)
    mantissa = lax.mul(amax, inverse)  # exact: in [1, 2), [2, 4) in the top binade, Inf for Inf
    scales = divided_by_code_limit(mantissa, limit)
    zero = lax.eq(amax, fmt.dtype(0))
    scales = lax.select(zero, lax.full_like(scales, 1), scales)
    exponents = lax.select(zero, lax.full_like(exponents, 0), exponents)
    return scales, exponents, inverse


def quantize_parts(x, reduce_axes: Sequence[int], limit: int = INT8_MAX, keep_values: bool = False):
    """The contract's quantization of ``x`` with one scale per slice over ``reduce_axes``.

    Arguments:
        x: a floating array.
        reduce_axes: the axes one scale covers.
        limit: the largest code: 127 for int8, 7 for int4 weights (scales are then ``absmax / 7``).
        keep_values: hand ``x`` (in its own dtype) to the quantization pass as the array its absmax was taken
            from (an optimization barrier on the two together), so the compiler writes ``x`` out beside the absmax
            rather than compute ``x``'s producer again inside the quantization pass; the same codes and scales.
            XLA:TPU otherwise recomputes the previous dot's epilogue and activation function there
            (``docs/performance.md``).

    Returns:
        ``(codes, scales, exponents)``: int8 ``codes = clip(rint(x / scale), -limit, limit)`` (ties to even) and
        each slice's scale as ``scales * 2**exponents``, over the other axes in order.
    """
    reduce_axes = tuple(reduce_axes)
    kept_axes = tuple(a for a in range(x.ndim) if a not in reduce_axes)
    amax = absmax(x, reduce_axes)
    if keep_values:
        x, amax = lax.optimization_barrier((x, amax))
    return _codes_and_scales(to_compute(x), amax, kept_axes, limit)


def quantize_parts_nan_as_inf(x, reduce_axes: Sequence[int]):
    """:func:`quantize_parts`' codes, scales and exponents, bit for bit, with NaN made Inf in the values themselves,
    before both the absmax and the codes, rather than in the absmax's magnitudes.

    XLA:CPU's reduction cannot fuse :func:`absmax`'s NaN-to-Inf select, so that select writes a temporary as large
    as ``x`` before the reduction reads it. A select on the values joins the kernel that computes ``x`` (the
    previous dot's epilogue), which writes ``x`` anyway, and the reduction then takes ``|x|`` as it reads it (after
    a layer norm, which XLA:CPU computes in a YNNPACK kernel that takes no select, it is a pass of its own; and it
    keeps XLA from fusing an epilogue into a transposing quantization loop, ``docs/performance.md``): the
    transformer block of ``benchmarks/speed.py`` and the MiniLM encoder run in 0.89-0.96x and 0.88-0.93x the time
    on JAX 0.10.2; on 0.12.1, whose calls XLA could inline late, only with the dot's program
    inlined early (``int8_backend._inlines_early``): 0.82-0.86x and 0.87-0.89x (``docs/performance.md``). A NaN's
    code is the same either way: its slice's scale is Inf, and ``NaN / Inf`` and ``Inf / Inf`` are both NaN.
    """
    reduce_axes = tuple(reduce_axes)
    kept_axes = tuple(a for a in range(x.ndim) if a not in reduce_axes)
    values = to_compute(x)
    values = lax.select(lax.ne(values, values), lax.full_like(values, np.inf), values)
    return _codes_and_scales(values, max_over(lax.abs(values), reduce_axes), kept_axes)


def quantize_with_factors(x, reduce_axes: Sequence[int], keep_values: bool = False):
    """:func:`quantize_parts` and the epilogue factors of its scales, laid out as :func:`quantize_dynamic_parts`
    returns them."""
    codes, scales, exponents = quantize_parts(x, reduce_axes, keep_values=keep_values)
    return codes, scales, exponents, epilogue_factors(scales, exponents)


def quantize_nan_as_inf_with_factors(x, reduce_axes: Sequence[int]):
    """:func:`quantize_with_factors` (bit for bit) by :func:`quantize_parts_nan_as_inf`."""
    codes, scales, exponents = quantize_parts_nan_as_inf(x, reduce_axes)
    return codes, scales, exponents, epilogue_factors(scales, exponents)


def _codes_and_scales(values, amax, kept_axes: tuple, limit: int = INT8_MAX):
    """The clipped codes of ``values`` and their slices' scale parts, from the slices' absmax."""
    scales, exponents, prescale = scale_parts(amax, limit)
    # (a non-finite slice's exponent is meaningless, but its scale is Inf and so is every output it feeds)
    return clipped_codes(rounded_quotients(values, scales, prescale, kept_axes), limit), scales, exponents


def clipped_codes(rounded, limit: int = INT8_MAX):
    """int8 codes from rounded quotients: clipped to ``[-limit, limit]``."""
    bound = rounded.dtype.type(limit)
    return lax.convert_element_type(lax.clamp(-bound, rounded, bound), np.int8)


def marked_codes(values, quotients):
    """int8 codes of ``quotients`` (``values`` times a static scale's reciprocal): rounded to nearest, ties to even,
    clipped, and :data:`NONFINITE_CODE` (-128) for a NaN or Inf value (no finite value gets it).

    Clipped and marked before the rounding, so that the rounding is the conversion's operand, which XLA:TPU folds
    into its conversion to int8; a clip or select between the two made it round in six vector operations, then
    convert in seven more (the static MLP's dot kernels, v5e: 0.93x the bundles; the input's quantization pass
    0.51x). The same codes: rounding to nearest is monotone and keeps the integers -127, 127 and -128.
    """
    marked = lax.select(lax.is_finite(values), _clipped(quotients), lax.full_like(quotients, NONFINITE_CODE))
    return _rounded_to_int8(marked)


def saturated_codes(quotients):
    """int8 codes of ``quotients`` (``values`` times a static scale's reciprocal), rounded to nearest, ties to even,
    and clipped, with no mark for NaN or Inf: for an operand whose slices holding them are found in its values (their
    factor is NaN, so their outputs are NaN whatever their codes), where :func:`marked_codes`' test and select would
    be two vector operations per element for nothing. Clipped before the rounding, which is the conversion's operand,
    as there."""
    return _rounded_to_int8(_clipped(quotients))


def _clipped(quotients):
    limit = quotients.dtype.type(INT8_MAX)
    return lax.clamp(-limit, quotients, limit)


def _rounded_to_int8(clipped):
    """Rounded to nearest, ties to even, as the conversion's operand (XLA:TPU folds such a rounding into it)."""
    return lax.convert_element_type(lax.round(clipped, lax.RoundingMethod.TO_NEAREST_EVEN), np.int8)


def nan_marked_codes(rounded):
    """int8 codes from the rounded quotients of a value by its slice's own dynamic scale, :data:`NONFINITE_CODE`
    where the quotient is NaN: :func:`marked_codes`' codes for every value, in two operations per element instead
    of four.

    No clip is needed: a slice's scale is its absmax over 127, correctly rounded, so a finite value's quotient is at
    most ``127 / (1 - 2**-24)`` in magnitude, which rounds to 127. And the quotient is NaN exactly where the value
    is NaN or Inf: NaN over any scale; Inf over its slice's scale, which is Inf too (an absmax that holds the Inf);
    a finite value's over a NaN scale (a reduction that kept a NaN), which makes the whole slice NaN-marked.
    """
    marked = lax.select(lax.ne(rounded, rounded), lax.full_like(rounded, NONFINITE_CODE), rounded)
    return lax.convert_element_type(marked, np.int8)


def holds_nonfinite(codes, reduce_axes):
    """Per slice over ``reduce_axes``, whether it holds NaN or Inf: its minimum code is :data:`NONFINITE_CODE`
    (:func:`marked_codes`, :func:`nan_marked_codes`; an int8 reduction, cheaper than one over the floats)."""
    return lax.eq(lax.reduce_min(codes, tuple(reduce_axes)), np.int8(NONFINITE_CODE))


def poison(nonfinite_slices, values):
    """NaN where a slice holds NaN or Inf, 0 elsewhere: added to a per-slice scale, it makes that slice's outputs
    NaN and leaves every other scale exactly as it is."""
    return lax.select(nonfinite_slices, lax.full_like(values, np.nan), lax.full_like(values, 0))


def quantize_dynamic_parts(x, reduce_axes: Sequence[int]):
    """The contract's quantization of a dot operand in the rewritten program: :func:`quantize_parts`' codes and
    scales, bit for bit, for every finite slice, in the passes XLA makes cheapest.

    The absmax is a plain ``max|x|``, which XLA fuses into its reduction kernel (on CPU, one YNNPACK reduction
    reading ``x``, where :func:`absmax`'s NaN-to-Inf select writes a temporary as large as ``x`` first). NaN and Inf
    are caught in the quantization pass instead, as with static scales: they get the code ``-128``, which no finite
    value gets, and a minimum over each slice's int8 codes makes that slice's scale NaN, so every output it feeds
    is NaN (its ``max|x|`` may have dropped a NaN; its other codes are then meaningless). The per-slice factors of
    the epilogue are computed here, on the small per-slice arrays, so the epilogue only multiplies.

    Arguments:
        x: a floating array.
        reduce_axes: the axes one scale covers (the dot's contracting dims).

    Returns:
        ``(codes, scales, exponents, factors)``: as
        :func:`~jaxpr_rewrite._numerics.static_scales.quantize_static_parts` returns them.
    """
    reduce_axes = tuple(reduce_axes)
    kept_axes = tuple(a for a in range(x.ndim) if a not in reduce_axes)
    values = to_compute(x)
    scales, exponents, prescale = scale_parts(max_over(lax.abs(values), reduce_axes))
    codes = nan_marked_codes(rounded_quotients(values, scales, prescale, kept_axes))
    nonfinite = poison(holds_nonfinite(codes, reduce_axes), scales)
    factor, power = epilogue_factors(scales, exponents)
    return codes, lax.add(scales, nonfinite), exponents, (lax.add(factor, nonfinite), power)


def smoothing_inverse(smooth):
    """``1 / smooth`` of SmoothQuant factors, correctly rounded in their compute dtype (float32, float64 for a float64
    weight's) on every platform (what a smoothed weight's dot multiplies its other operand by)."""
    return reciprocal(to_compute(smooth))


def dequantize_by_factors(codes, factor, power, kept_axes: Sequence[int]):
    """``codes * scales * 2**exponents`` from the scales' :func:`epilogue_factors` ``(factor, power)``: ``(codes *
    factor) * power`` in the factors' dtype, the per-slice values broadcast from ``kept_axes``."""
    kept_axes = tuple(kept_axes)
    factor, power = (lax.broadcast_in_dim(f, codes.shape, kept_axes) for f in (factor, power))
    return lax.mul(lax.mul(lax.convert_element_type(codes, factor.dtype), factor), power)


def scale_values(scales, exponents):
    """The scales as plain values, ``scales * 2**exponents`` (float64, or float32 where XLA flushes a subnormal
    result to zero; :func:`jaxpr_rewrite._dots.matmul.ldexp_exact` gives exact float32 values)."""
    scale, power = epilogue_factors(scales, exponents)
    return lax.mul(scale, power)


def epilogue_factors(scales, exponents) -> tuple:
    """One operand's per-slice factors for :func:`scale_product`: ``(scales * 2**c, 2**(exponents - c))`` with
    ``c = clip(exponents, -W, W)`` (``W = (bias - 7) // 2``: 60 for float32, 508 for float64), both computed on the
    small per-slice arrays.

    The first factor is the slice's scale itself wherever its exponent is within ``+-W`` (every ordinary array),
    and a normal float always; the second is 1 there, and carries what the clip took off for a huge or tiny
    slice. Both are exact: a multiply by a power of two.
    """
    fmt = float_format(scales)
    window = epilogue_window(fmt)
    clipped = lax.clamp(np.int32(-window), exponents, np.int32(window))
    return lax.mul(scales, pow2(clipped, fmt.dtype)), pow2(lax.sub(exponents, clipped), fmt.dtype)


def epilogue_window(fmt: FloatFormat) -> int:
    """``W``, the exponents :func:`epilogue_factors` leaves in a scale's first factor: within ``+-W``."""
    return (fmt.bias - 7) // 2


def scale_product(acc, lhs: Sequence, rhs: Sequence):
    """``acc * s_lhs * s_rhs`` for scales held as ``scales * 2**exponents``.

    Arguments:
        acc: the sums, in the compute dtype.
        lhs, rhs: each operand's :func:`epilogue_factors` ``(f, g)``, already broadcast to ``acc.shape``.

    Computed as ``(((acc * f_rhs) * f_lhs) * g_rhs) * g_lhs``: four multiplies by per-row and per-column values and
    no outer product of scales, the form XLA fuses into the epilogue of its GPU GEMM kernel, the rhs (the weight
    of ``x @ w``) first, so a pre-quantized weight's stored factors join that kernel. Where both exponents are
    within ``+-W`` that is ``(acc * s_rhs) * s_lhs`` times 1 and 1, bit for bit. Elsewhere the clipped ``f`` keeps
    ``acc * f_rhs`` (at most ``2**31 * 2**-5 * 2**W``) and ``acc * f_rhs * f_lhs`` within range unless the result
    itself overflows or underflows, and the powers of two ``g`` then move it to the result exactly: ``g > 1`` only
    for a huge slice, where the intermediate is below the result, and ``g < 1`` only for a tiny one, where it is
    above. So no intermediate overflows or underflows unless the result does, and wherever the plain product's
    intermediates are normal floats this is the same number. The last multiply is a power of two, exact: XLA:CPU
    fuses it with an add that follows into one multiply-add, which then rounds as the add alone would (a factor
    last, the program's next add would skip the product's rounding).
    """
    (f_l, g_l), (f_r, g_r) = lhs, rhs
    return lax.mul(lax.mul(lax.mul(lax.mul(acc, f_r), f_l), g_r), g_l)
