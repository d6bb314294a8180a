"""The contract's correctly rounded quotients without relying on the hardware's division.

XLA compiles a float32 division for NVIDIA GPUs to PTX ``div.full.f32`` (its LLVM backend sets
``-nvptx-prec-divf32=1``, and its Triton fusions emit the same instruction), a full-range approximation within 2 ulp,
and for TPUs to a multiply by a reciprocal refined by one Newton step (``vrcp``): neither is the correctly rounded
quotient the contract's ``absmax / 127`` and ``rint(x / s)`` ask for, so a scale could come out an ulp or two off and
a value near a rounding boundary (every tie among them: integers, dyadic and bfloat16 data) could get the
neighbouring code. Exact forms instead:

* :func:`divided_by_odd`: a scale's mantissa divided by 127 (or 7), by integer arithmetic on its bits, on every
  platform but CPU (:func:`divided_by_code_limit` chooses). Integer division is exact everywhere; it runs on the
  small per-slice arrays.
* :func:`reciprocal_by_integers`: a correctly rounded reciprocal (a static scale's, a SmoothQuant factor's) by
  integer long division of its significand, on every platform but CPU (:func:`reciprocal` chooses).
* :func:`rounded_quotients_by_float64`, the codes of :func:`rounded_quotients` of float32 values on GPUs:
  ``fl32(n * r)`` with ``r = 1 / d`` and the product in float64 is ``fl32(n / d)`` exactly (a float32 quotient is
  never within 2**-49 of a float32 rounding boundary unless it is on one, which it cannot be), so one float64
  multiply and two conversions per element replace the division.
* :func:`rounded_quotients_exactly`, the codes on TPU (which has no float64) and of float64 values: ``rint(fl(n /
  d))`` from an approximate quotient (the hardware's division), settled by an exact comparison of
  ``n`` with the rounding boundary nearest it; its products are of half-width factors, exact in the float format,
  so no rounding (and no fused multiply-add a compiler may form) changes the comparison. On TPU each slice's
  divisor and prescale travel as one float (:func:`signed_divisors`), decoded per element over short slices.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from jax import lax

from .._core import platforms
from .float_formats import float_format, pow2

__all__ = ["correctly_rounded_divide", "divide_in_float64", "divided_by_code_limit", "divided_by_limit_in_floats",
           "divided_by_odd", "divisor_prescale", "quotients_by_division", "quotients_by_float64", "quotients_exactly",
           "reciprocal", "reciprocal_by_integers", "reciprocal_in_floats", "reciprocals_in_float64",
           "rounded_quotients", "rounded_quotients_by_float64", "rounded_quotients_exactly", "signed_divisors",
           "tpu_per_slice_parts", "tpu_quotients_per_element_parts", "tpu_quotients_per_slice_parts", "true_divide"]

# Quotient bits per step of the long division: the remainder (below the significand's 2**p) shifted by this many
# bits stays below 2**31 for float32's int32 bits (2**60 for float64's int64).
_LONG_DIVISION_STEP = 7


def divided_by_odd(m, divisor: int):
    """``m / divisor`` correctly rounded, for positive floats ``m`` whose quotient is a normal float (NaN and Inf
    pass through), and an odd ``divisor`` (127 or 7), with integer arithmetic alone.

    With ``m = M * 2**q`` (``M`` the significand, an integer of ``p = mantissa bits + 1`` bits) the quotient's
    significand is ``round(M * 2**k / divisor)`` for the ``k`` (``ceil(log2(divisor))`` or one less) that puts it in
    ``[2**(p-1), 2**p)``; the divisor is odd, so there is no tie, and ``(M * 2**k + (divisor - 1) / 2) // divisor`` is
    that rounding. ``M * 2**k`` stays below ``2**31`` for float32 (``2**60`` for float64).
    """
    fmt = float_format(m)
    bits_type, mantissa_bits = fmt.bits, fmt.mantissa_bits
    top = int(divisor - 1).bit_length()  # 2**(top - 1) < divisor < 2**top
    bits = lax.bitcast_convert_type(m, bits_type)
    field = lax.shift_right_logical(bits, bits_type(mantissa_bits))
    implicit = bits_type(1 << mantissa_bits)
    significand = lax.bitwise_or(lax.bitwise_and(bits, bits_type((1 << mantissa_bits) - 1)), implicit)
    # the quotient's significand fits one binade lower for significands from divisor * 2**(p - top) up
    shift = lax.select(lax.lt(significand, bits_type(divisor << (mantissa_bits + 1 - top))),
                       lax.full_like(bits, top), lax.full_like(bits, top - 1))
    rounded = lax.div(lax.add(lax.shift_left(significand, shift), bits_type((divisor - 1) // 2)), bits_type(divisor))
    quotient = lax.add(lax.shift_left(lax.sub(field, shift), bits_type(mantissa_bits)), lax.sub(rounded, implicit))
    return lax.select(lax.is_finite(m), lax.bitcast_convert_type(quotient, m.dtype), m)


def divided_by_code_limit(mantissa, limit: int):
    """A scale's mantissa divided by the code limit (127, or 7 for int4), correctly rounded, as the platform the program
    is traced for computes it (:meth:`~jaxpr_rewrite._core.platforms.Platform.divide_by_code_limit`): an IEEE
    division on CPU, :func:`divided_by_odd` elsewhere (a GPU's and a TPU's float division are approximate)."""
    return platforms.current().divide_by_code_limit(mantissa, limit=limit)


def divided_by_limit_in_floats(mantissa, limit: int):
    """``mantissa / limit`` as an IEEE division (XLA:CPU keeps it one; :func:`divided_by_odd` would repeat per element
    inside the codes' loop there)."""
    return true_divide(mantissa, lax.full_like(mantissa, limit))


def reciprocal_by_integers(d):
    """``1 / d`` correctly rounded, as XLA:CPU's IEEE division gives it (subnormal inputs and results flushed to zero:
    zero and subnormal ``d`` give Inf, ``d`` above the largest reciprocal of a normal float gives 0; Inf gives 0,
    NaN stays NaN), with integer arithmetic alone.

    With ``|d| = D * 2**q`` (``D`` the significand, an integer of ``p = mantissa bits + 1`` bits) the reciprocal's
    significand is ``round(2**(2p - 1) / D)``, in ``(2**(p-1), 2**p]``: a long division, a few bits per step, whose
    last remainder rounds it (no tie: ``2**(2p)`` is not an odd multiple of ``D`` unless ``D`` is a power of two,
    whose quotient is exact). A significand of ``2**p`` carries into the exponent field by itself.
    """
    fmt = float_format(d)
    bits_type, mantissa_bits, bias = fmt.bits, fmt.mantissa_bits, fmt.bias
    implicit = bits_type(1 << mantissa_bits)
    magnitude_bits = lax.bitcast_convert_type(lax.abs(d), bits_type)
    field = lax.shift_right_logical(magnitude_bits, bits_type(mantissa_bits))
    significand = lax.bitwise_or(lax.bitwise_and(magnitude_bits, bits_type((1 << mantissa_bits) - 1)), implicit)
    top = lax.full_like(significand, 2 << mantissa_bits)
    quotient = lax.div(top, significand)
    remainder = lax.sub(top, lax.mul(quotient, significand))
    for done in range(0, mantissa_bits, _LONG_DIVISION_STEP):
        step = bits_type(min(_LONG_DIVISION_STEP, mantissa_bits - done))
        shifted = lax.shift_left(remainder, step)
        quotient = lax.add(lax.shift_left(quotient, step), lax.div(shifted, significand))
        remainder = lax.rem(shifted, significand)
    rounded = lax.add(quotient, lax.convert_element_type(lax.ge(lax.add(remainder, remainder), significand),
                                                         bits_type))
    result_field = lax.sub(bits_type(2 * bias - 1), field)
    magnitude = lax.bitcast_convert_type(
        lax.add(lax.shift_left(result_field, bits_type(mantissa_bits)), lax.sub(rounded, implicit)), d.dtype)
    # the result's field is at least 1 wherever the rounded significand carries it up from 0
    tiny = lax.bitwise_or(lax.lt(result_field, bits_type(0)),
                          lax.bitwise_and(lax.eq(result_field, bits_type(0)), lax.lt(rounded, top)))
    magnitude = lax.select(lax.bitwise_or(tiny, lax.eq(field, bits_type(2 * bias + 1))), lax.full_like(d, 0),
                           magnitude)
    magnitude = lax.select(lax.eq(field, bits_type(0)), lax.full_like(d, np.inf), magnitude)
    negative = lax.lt(lax.bitcast_convert_type(d, bits_type), bits_type(0))  # -0.0 included
    return lax.select(lax.ne(d, d), d, lax.select(negative, lax.neg(magnitude), magnitude))


@jax.custom_jvp
def reciprocal(d):
    """``1 / d``, correctly rounded on every platform (:meth:`~jaxpr_rewrite._core.platforms.Platform.reciprocal`: on
    CPU an IEEE division, elsewhere :func:`reciprocal_by_integers`, a GPU's and a TPU's float division being
    approximate). For the small arrays a quantized program takes reciprocals of once (a static scale, a SmoothQuant
    factor vector). Its derivative is ``-1 / d**2`` on every platform (the integer form alone would have none)."""
    return platforms.current().reciprocal(d)


def reciprocal_in_floats(d):
    """``1 / d`` as an IEEE division."""
    return true_divide(lax.full_like(d, 1), d)


@reciprocal.defjvp
def _reciprocal_jvp(primals, tangents):
    (d,), (tangent,) = primals, tangents
    inverse = reciprocal(d)
    return inverse, lax.neg(lax.mul(lax.mul(inverse, inverse), tangent))


def rounded_quotients_exactly(numerators, divisors, approximate):
    """``rint(fl(n / d))`` (the quotient correctly rounded in the float format, then to the nearest integer, ties to
    even) for positive normal divisors ``d`` of at least ``2**-90``, wherever ``approximate`` is within 1/4 of the
    quotient (the hardware's division is, for every quotient below ``2**19`` in magnitude; beyond, a code may be
    one off, which the clip to the code limit removes) and the boundary's product ``b * d`` below the format's
    largest float (one beyond gives the code nearer zero: for a code's largest boundary, ``limit + 1/2``, the clip
    makes that the same code); NaN for a NaN quotient or divisor. ``divisors`` and ``approximate`` are per element,
    like ``numerators``.

    ``approximate`` names the half-integer ``b = floor(a) + 1/2`` nearest the quotient, the one rounding boundary
    the code can be on either side of: the code is ``floor(a)`` or one more. ``fl(n / d)`` is ``b`` itself exactly
    when ``n / d`` lies within ``b +- u`` (``u`` half the spacing of the floats at ``b``; ``b``'s significand is
    even, so the ends round to it; at ``|b| = 1/2``, where the floats below are closer, both codes on that side are
    0), and then the code is ``rint(b)``. Which side ``n`` lies on is the sign of ``n - b * d``, and whether it is
    within the tie band its magnitude against ``u * d``: with ``d = high + low``, each half of its significand's
    bits, ``n - b * high`` is exact (Sterbenz) near the boundary, ``b * high`` and ``b * low`` are exact (half-width
    factors), and so is their difference there; far from it a rounding cannot move it past a bound that small.
    ``u`` is ``b``'s power of two (its exponent bits) times ``2**-(mantissa bits + 1)``. The code is then
    ``rint(b + t)``, ``t`` a quarter towards ``n``'s side of the band and 0 inside it: one rounding to the nearest
    integer, which XLA folds into the conversion to int8 that follows (XLA:TPU v5e, a pass over 4096 x 4096 values:
    5.8k bundles per loop iteration, from 9.0k with a select between ``rint(b)`` and ``floor(a)`` plus a side).
    """
    dtype = numerators.dtype.type
    fmt = float_format(numerators)
    bits_type, mantissa_bits = fmt.bits, fmt.mantissa_bits
    low_bits = (mantissa_bits + 1) // 2
    high = lax.bitcast_convert_type(
        lax.bitwise_and(lax.bitcast_convert_type(divisors, bits_type), bits_type(~((1 << low_bits) - 1))),
        numerators.dtype)
    low = lax.sub(divisors, high)
    below = lax.floor(approximate)
    boundary = lax.add(below, dtype(0.5))
    exponent_field = bits_type(((1 << (8 * np.dtype(bits_type).itemsize - 1 - mantissa_bits)) - 1) << mantissa_bits)
    binade = lax.bitcast_convert_type(lax.bitwise_and(lax.bitcast_convert_type(boundary, bits_type), exponent_field),
                                      numerators.dtype)
    bound = lax.mul(lax.mul(binade, dtype(2.0 ** -(mantissa_bits + 1))), divisors)
    residual = lax.sub(lax.sub(numerators, lax.mul(boundary, high)), lax.mul(boundary, low))
    # rint(b - 1/4) = floor(a), rint(b + 1/4) = floor(a) + 1, rint(b) the even one; b +- 1/4 is exact wherever a
    # code can be (|b| below 2**21 in float32)
    quarter = lax.full_like(numerators, 0.25)
    nudge = lax.select(lax.gt(residual, bound), quarter,
                       lax.select(lax.lt(residual, lax.neg(bound)), lax.neg(quarter), lax.full_like(numerators, 0)))
    return lax.round(lax.add(boundary, nudge), lax.RoundingMethod.TO_NEAREST_EVEN)


def rounded_quotients_by_float64(numerators, reciprocals):
    """``rint(fl32(n / d))`` for float32 numerators ``n`` (NaN for NaN, as the division gives it) from
    ``reciprocals``, ``1 / d`` in float64 within ``2**-52`` relative (:func:`reciprocals_in_float64`): one float64
    multiply, its rounding to float32 and to the nearest integer, ties to even.

    Why the float32 rounding of ``p = fl64(n * r)`` is ``fl32(n / d)``, with no correction: ``p`` is within
    ``2**-51`` relative of ``n / d``. With ``n = N * 2**a`` and ``d = D * 2**b`` (``N``, ``D`` integers below
    ``2**24``), a float32 rounding boundary, the midpoint ``m = M * 2**c`` of two neighbouring floats (``M`` odd, below
    ``2**25``), is never ``n / d`` itself (``N * 2**a = M * D * 2**(b + c)`` would give ``N`` the 25 bits of ``M``
    at least), and otherwise ``|n - m * d|`` is a nonzero multiple of ``2**(b + c)``, so ``n / d`` is at least
    ``1 / (M * D) > 2**-49`` relative away from it: ``p`` is on the same side of every boundary, and rounds to the
    same float32. The product is a plain multiply (no add for a compiler to fuse into it), and a GPU's float64
    division and conversions are IEEE's.
    """
    with jax.enable_x64(True):  # float64 inside the program, whatever the program's own setting
        products = lax.mul(lax.convert_element_type(numerators, np.float64), reciprocals)
        quotients = lax.convert_element_type(products, np.float32)
    return lax.round(quotients, lax.RoundingMethod.TO_NEAREST_EVEN)


def reciprocals_in_float64(divisors):
    """``1 / divisors`` in float64, correctly rounded (a float64 division), per slice: what
    :func:`rounded_quotients_by_float64` multiplies the values by."""
    with jax.enable_x64(True):
        return lax.div(np.float64(1), lax.convert_element_type(divisors, np.float64))


def true_divide(numerator, denominator):
    """``numerator / denominator`` as an IEEE division, never a multiply by a reciprocal.

    XLA rewrites a division by a constant or by a broadcast into a multiply by its reciprocal. The divisor here
    is a ``select`` that passes NaN numerators through, which XLA cannot see through, so the division stays.
    """
    return lax.div(numerator, lax.select(lax.ne(numerator, numerator), numerator, denominator))


def correctly_rounded_divide(numerator, denominator):
    """``numerator / denominator``, correctly rounded on CPU and GPUs: :func:`true_divide` on CPU (and for float64
    everywhere); on GPUs, whose float32 division is approximate, :func:`divide_in_float64`. A TPU, which has no
    float64, keeps its own division (within 2 ulps on a v5e). For arrays a program divides once (a smoothed weight's
    value), not per code (:meth:`~jaxpr_rewrite._core.platforms.Platform.divide`)."""
    if float_format(numerator).dtype != np.float32:
        return true_divide(numerator, denominator)
    return platforms.current().divide(numerator, denominator)


def divide_in_float64(numerator, denominator):
    """The float64 quotient of float32 operands rounded once to float32: the correctly rounded float32 quotient (53
    bits hold twice float32's 24 and two more, so the second rounding cannot move it)."""
    with jax.enable_x64(True):
        wide = lax.div(lax.convert_element_type(numerator, np.float64),
                       lax.convert_element_type(denominator, np.float64))
        return lax.convert_element_type(wide, np.float32)


def rounded_quotients(values, scales, prescale, kept_axes: tuple):
    """``rint((values * 2**-e) / scales)`` per element (exact wherever it is below ``2**19`` in magnitude, beyond the
    code limit the caller clips to), the division correctly rounded, the per-slice ``prescale = 2**-e`` and
    ``scales`` (a mantissa divided by the code limit) broadcast from ``kept_axes``; the multiply is exact.

    As the platform the program is traced for computes it
    (:meth:`~jaxpr_rewrite._core.platforms.Platform.rounded_quotients`): on CPU :func:`quotients_by_division`, an
    IEEE division; on TPU (whose float division is a multiply by a refined reciprocal) :func:`quotients_exactly`, or
    for float32 :func:`tpu_quotients_per_slice_parts` / :func:`tpu_quotients_per_element_parts`, whichever the layout
    makes cheaper (:func:`tpu_per_slice_parts`); on GPUs (whose float32 division is ``div.full.f32``, within 2 ulp)
    :func:`quotients_by_float64` for float32 values, four operations per element instead of the exact comparison's
    twenty or so, and :func:`quotients_exactly` for float64 ones.
    """
    return platforms.current().rounded_quotients(values, scales, prescale, kept_axes=tuple(kept_axes))


def _per_element(values, kept_axes: tuple):
    return functools.partial(lax.broadcast_in_dim, shape=values.shape, broadcast_dimensions=kept_axes)


def _prescaled(values, prescale, kept_axes: tuple):
    return lax.mul(values, _per_element(values, kept_axes)(prescale))


def quotients_by_division(values, scales, prescale, kept_axes: tuple):
    """:func:`rounded_quotients` by an IEEE division (:func:`true_divide`)."""
    quotients = true_divide(_prescaled(values, prescale, kept_axes), _per_element(values, kept_axes)(scales))
    return lax.round(quotients, lax.RoundingMethod.TO_NEAREST_EVEN)


def quotients_exactly(values, scales, prescale, kept_axes: tuple):
    """:func:`rounded_quotients` from the hardware's approximate division, settled by
    :func:`rounded_quotients_exactly`."""
    numerators = _prescaled(values, prescale, kept_axes)
    # the divisor per element: adding ``numerators * 0`` (0, NaN for NaN and Inf, whose codes are then NaN) keeps
    # XLA from moving the divisor's halves and the tie bound before the broadcast, where each would be a per-slice
    # array of its own that the quantization pass broadcasts
    divisors = lax.add(_per_element(values, kept_axes)(scales), lax.mul(numerators, numerators.dtype.type(0)))
    return rounded_quotients_exactly(numerators, divisors, lax.div(numerators, divisors))


def quotients_by_float64(values, scales, prescale, kept_axes: tuple):
    """:func:`rounded_quotients` of float32 values by :func:`rounded_quotients_by_float64`, each slice's reciprocal
    taken in float64."""
    reciprocals = _per_element(values, kept_axes)(reciprocals_in_float64(scales))
    return rounded_quotients_by_float64(_prescaled(values, prescale, kept_axes), reciprocals)


def tpu_quotients_per_element_parts(values, scales, prescale, kept_axes: tuple):
    """The TPU's :func:`rounded_quotients` of float32 ``values`` from one broadcast per-slice array,
    :func:`signed_divisors`, its prescale and divisor decoded per element and the approximate quotient a division:
    for short slices along the last axis (:func:`tpu_per_slice_parts`), where XLA:TPU pays for each broadcast array
    per slice (a transformer's attention probabilities, 128 values per slice: about 20k estimated v6e cycles per
    array), far more than the decoding costs."""
    per_slice = lax.broadcast_in_dim(signed_divisors(scales, prescale), values.shape, kept_axes)
    # adding ``values * 0`` (0, NaN for NaN and Inf, whose codes are then NaN) keeps XLA from moving the decoding
    # before the broadcast, where each decoded part would be a per-slice array of its own that the pass broadcasts
    signed = lax.add(per_slice, lax.mul(values, values.dtype.type(0)))
    numerators = lax.mul(values, divisor_prescale(signed))
    divisors = lax.abs(signed)
    return rounded_quotients_exactly(numerators, divisors, lax.div(numerators, divisors))


def tpu_quotients_per_slice_parts(values, scales, prescale, kept_axes: tuple):
    """The TPU's :func:`rounded_quotients` of float32 ``values`` with the divisor, its prescale and its reciprocal
    each a broadcast per-slice array, the approximate quotient a multiply by the reciprocal (within a few ulp, as
    :func:`rounded_quotients_exactly` allows): fewer vector instructions per element than
    :func:`tpu_quotients_per_element_parts`, where the broadcasts are cheap (:func:`tpu_per_slice_parts`)."""
    per_element = functools.partial(lax.broadcast_in_dim, shape=values.shape, broadcast_dimensions=kept_axes)
    signed = signed_divisors(scales, prescale)
    divisors = lax.abs(signed)
    numerators = lax.mul(values, per_element(divisor_prescale(signed)))
    approximate = lax.mul(numerators, per_element(lax.div(np.float32(1), divisors)))
    return rounded_quotients_exactly(numerators, per_element(divisors), approximate)


# Slices along the last axis at least this long take their divisor's parts per slice on TPU (tpu_per_slice_parts)
TPU_PER_SLICE_PARTS_FROM = 256
# A TPU vector register's lanes: a kept last axis at least this wide takes the divisor's parts per slice
_TPU_LANES = 128


def tpu_per_slice_parts(shape, kept_axes: tuple) -> bool:
    """Whether the TPU's quantization pass over an array of ``shape`` with one scale per index of ``kept_axes``
    broadcasts its divisor's parts per slice (fewer vector instructions per element) rather than one per-slice
    array it decodes per element.

    XLA:TPU lays an array's last axis along the vector lanes. A per-slice array constant along it (the last axis
    reduced) is spread across the lanes, a cost per slice that only long slices amortize; one kept along it
    broadcasts down the sublanes, cheaply where it fills the lanes. XLA:TPU's final machine code (v5e) for a pass,
    per-slice parts against per-element ones: 0.61-0.73x the bundles over slices of 192 values and more along the
    last axis (a Dense layer's activation), 0.89x over 256 in one shape, 1.05-1.8x over 128 (attention's
    probabilities); 0.62-0.63x with the last axis kept and 128 wide or more (a weight's columns), 1.19-1.26x for
    attention's values (kept, 64 wide, batch and heads in front). Since the codes' rounding joined the conversion
    to int8 (:func:`rounded_quotients_exactly`), both forms have 13 operations per vreg fewer: 0.56x over 4096-long
    rows, 1.9x over 128-long ones. On a v5e chip, through HBM: 0.96x the time over 4096-long rows, 1.9x over
    128-long ones (``benchmarks/results/tpu-v5-lite.md``, the fourth run).
    """
    if not shape:
        return False
    if len(shape) - 1 in kept_axes:
        return isinstance(shape[-1], int) and shape[-1] >= _TPU_LANES
    slice_length = math.prod(size for axis, size in enumerate(shape) if axis not in kept_axes)
    # a symbolic slice length (an exported program's dimension variable) keeps the form that is never far off
    return isinstance(slice_length, int) and slice_length >= TPU_PER_SLICE_PARTS_FROM


# A tiny slice's divisor and values, both scaled up by this power of two (:func:`signed_divisors`)
_TINY_SHIFT = 64


def signed_divisors(scales, prescale):
    """Each float32 slice's divisor and prescale in one float, for a quantization pass that reads one per-slice array.

    With ``prescale = 2**-e`` and ``scales`` below 1 (1 for an all-zero slice), the contract's scale ``s = scales *
    2**e``: ``s`` itself for ``e >= -64`` (at least ``2**-71``: :func:`rounded_quotients_exactly` holds from
    ``2**-90``; a huge one's products overflow only at the boundary ``127.5``, whose codes the clip makes 127 either
    way); ``-(s * 2**64)`` for a tiny slice, whose values :func:`divisor_prescale` scales by ``2**64`` too. Each is
    exact (a multiply by a power of two), NaN and Inf stay NaN and Inf.
    """
    field = lax.shift_right_logical(lax.bitcast_convert_type(prescale, np.int32), np.int32(23))
    exponents = lax.sub(np.int32(127), field)
    tiny = lax.lt(exponents, np.int32(-_TINY_SHIFT))
    shifted = lax.add(exponents, lax.select(tiny, lax.full_like(exponents, _TINY_SHIFT), lax.full_like(exponents, 0)))
    divisors = lax.mul(scales, pow2(shifted))
    return lax.select(tiny, lax.neg(divisors), divisors)


def divisor_prescale(signed):
    """The power of two that scales each value for its divisor ``|signed|`` (:func:`signed_divisors`): ``2**64`` for a
    tiny slice's (negative), 1 for every other; per element, so that the quantization pass broadcasts one per-slice
    array."""
    return lax.select(lax.lt(signed, np.float32(0)), lax.full_like(signed, 2.0**_TINY_SHIFT), lax.full_like(signed, 1))
