"""The contract's correctly rounded divisions without the hardware's: a scale's mantissa divided by 127 (or 7) in
integer arithmetic, the codes from a float64 reciprocal, as the GPU program computes them (XLA compiles a GPU's float32
division to an approximation within 2 ulp), and settled exactly from an approximate quotient, as the TPU program
computes them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

from helpers import (CPU, TPU_DIVISION_ULPS, approximate_division, assert_within_ulps, evaluate_as, examples,
                     ieee_float64, platform_eqns, reference_codes, reference_scale_parts)
from jaxpr_rewrite._numerics import exact_division
from jaxpr_rewrite._numerics.exact_division import (correctly_rounded_divide, divided_by_odd, divisor_prescale,
                                                    reciprocal, reciprocal_by_integers, reciprocals_in_float64,
                                                    rounded_quotients_by_float64, rounded_quotients_exactly,
                                                    signed_divisors, tpu_per_slice_parts, true_divide)
from jaxpr_rewrite._dots.operands import smoothed_activation
from jaxpr_rewrite._numerics.quantize import quantize_parts, smoothing_inverse
from jaxpr_rewrite._numerics.static_scales import StaticScale


@pytest.mark.parametrize("divisor", [127, 7])
def test_every_float32_mantissa_divided_by_the_code_limit(divisor):
    """Every float32 in [1, 4) (the mantissas a scale is made of, the top binade's included), bit for bit."""
    bits = np.arange(np.float32(1).view(np.int32), np.float32(4).view(np.int32), dtype=np.int32)
    mantissas = bits.view(np.float32)
    got = np.asarray(jax.jit(lambda m: divided_by_odd(m, divisor))(mantissas))
    np.testing.assert_array_equal(got.view(np.int32), (mantissas / np.float32(divisor)).view(np.int32))


def test_division_by_odd_passes_nan_and_inf_and_keeps_float64():
    special = np.array([np.inf, np.nan, 2.0**-22, np.nextafter(np.float32(4), np.float32(0))], np.float32)
    got = np.asarray(jax.jit(lambda m: divided_by_odd(m, 127))(special))
    np.testing.assert_array_equal(got, special / np.float32(127))
    mantissas = np.random.default_rng(0).uniform(1, 4, 200_000)
    with ieee_float64():
        got = np.asarray(jax.jit(lambda m: divided_by_odd(m, 127))(jnp.asarray(mantissas)))
    np.testing.assert_array_equal(got, mantissas / 127)


def _ieee_reciprocal(values):
    """``1 / values`` by XLA:CPU's IEEE division (subnormal inputs and results flushed to zero), on the CPU also where
    the default device is a GPU, whose float division is approximate."""
    with jax.default_device(CPU):
        return np.asarray(jax.jit(lambda v: true_divide(lax.full_like(v, 1), v))(values))


def _same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    int_type = np.int32 if got.dtype == np.float32 else np.int64
    differ = (got.view(int_type) != want.view(int_type)) & ~(np.isnan(got) & np.isnan(want))
    assert not differ.any(), (np.asarray(got)[differ][:5], np.asarray(want)[differ][:5])


@pytest.mark.parametrize("exponent", [0, -1, 63, -64, 125, 126, 127, -126, -127])
def test_every_float32_significand_has_its_reciprocal(exponent):
    """Every float32 significand at binades across the range, the ends where the reciprocal leaves the normal range
    (flushed to zero, as XLA:CPU's division gives it) and where the input is subnormal (taken as zero): bit for bit,
    and numpy's correctly rounded reciprocal wherever input and result are normal floats."""
    bits = np.arange(np.float32(1).view(np.int32), np.float32(2).view(np.int32), dtype=np.int32)
    values = (bits.view(np.float32).astype(np.float64) * 2.0**exponent).astype(np.float32)
    got = np.asarray(jax.jit(reciprocal_by_integers)(values))
    _same_bits(got, _ieee_reciprocal(values))
    want = (1 / values.astype(np.float64)).astype(np.float32)
    normal = (np.abs(want) >= np.finfo(np.float32).tiny) & (np.abs(values) >= np.finfo(np.float32).tiny)
    _same_bits(got[normal], want[normal])
    assert exponent < 126 or np.count_nonzero(got == 0) > 1000  # the flushed end was reached
    assert np.isinf(got[np.abs(values) < np.finfo(np.float32).tiny]).all()


def test_reciprocal_of_any_bits_signs_zeros_nan_inf_and_float64():
    rng = np.random.default_rng(2)
    values = rng.integers(-2**31, 2**31, 2_000_000, dtype=np.int64).astype(np.int32).view(np.float32)
    special = np.array([0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 2.0**-126, 2.0**126, -(2.0**127), 3e38],
                       np.float32)
    values = np.concatenate([values, special])
    _same_bits(jax.jit(reciprocal_by_integers)(values), _ieee_reciprocal(values))
    doubles = rng.uniform(1, 2, 500_000) * 2.0 ** rng.integers(-1020, 1020, 500_000)
    with ieee_float64():
        got = np.asarray(jax.jit(reciprocal_by_integers)(jnp.asarray(np.concatenate([doubles, -doubles]))))
    _same_bits(got, 1 / np.concatenate([doubles, -doubles]))


@examples(20)
@given(st.floats(2.0**-121, 2.0**127, width=32), st.integers(0, 2**31 - 1))
def test_static_scales_and_smoothing_are_the_same_on_every_platform(amax, seed):
    """What a static scale stores (its reciprocal among it) and the reciprocal of SmoothQuant factors a smoothed
    activation is multiplied by, as the CUDA and TPU programs compute them (their ``platform_dependent`` branches,
    evaluated here): CPU's IEEE values, bit for bit."""
    amax = np.float32(amax)
    rng = np.random.default_rng(seed)
    factors = (rng.uniform(1, 2, 256) * 2.0 ** rng.integers(-60, 60, 256)).astype(np.float32)
    activation = rng.standard_normal((8, 256)).astype(np.float32)
    want_scale = np.asarray(StaticScale.of(amax).stored())
    want_inverse = _ieee_reciprocal(factors)
    _same_bits(jax.jit(smoothing_inverse)(factors), want_inverse)
    _same_bits(jax.jit(lambda v, f: smoothed_activation(v, smoothing_inverse(f), 1))(activation, factors),
               activation * want_inverse)
    for platform in ("cuda", "tpu"):
        _same_bits(evaluate_as(platform, lambda a: StaticScale.of(a).stored(), amax), want_scale)
        _same_bits(evaluate_as(platform, smoothing_inverse, factors), want_inverse)
        _same_bits(evaluate_as(platform, reciprocal, factors), want_inverse)
        np.testing.assert_allclose(evaluate_as(platform, jax.grad(lambda f: reciprocal(f).sum()), factors)[0],
                                   -(want_inverse.astype(np.float64) ** 2), rtol=1e-6)


def _around_every_boundary(scales, limit, dtype=np.float32, spread=6):
    """Per scale, values within ``spread`` ulp of every rounding boundary ``(k + 1/2) * s`` and the boundaries'
    float products themselves (ties among them), negative ones and zeros."""
    int_type = np.int32 if dtype == np.float32 else np.int64
    halves = (np.arange(-limit - 1, limit + 1) + 0.5).astype(dtype)
    near = (scales[:, None].astype(np.float64) * halves[None, :]).astype(dtype)
    offsets = np.arange(-spread, spread + 1, dtype=int_type)
    values = (near[:, :, None].view(int_type) + offsets).view(dtype).reshape(len(scales), -1)
    return np.concatenate([values, (scales[:, None] * halves[None, :]).astype(dtype),
                           np.zeros((len(scales), 2), dtype)], axis=1)


def _exact_codes(values, scales, error=0.0):
    """The codes, the approximate quotients multiplied by ``1 + error``."""
    divisors = lax.broadcast_in_dim(scales, values.shape, (0,))
    approximate = lax.mul(lax.div(values, divisors), values.dtype.type(1 + error))
    return rounded_quotients_exactly(values, divisors, approximate)


def _float64_codes(values, scales, error=0.0):
    """The GPU's codes, the float64 reciprocals multiplied by ``1 + error``."""
    with jax.enable_x64(True):
        reciprocals = lax.mul(reciprocals_in_float64(scales), np.float64(1 + error))
    return rounded_quotients_by_float64(values, lax.broadcast_in_dim(reciprocals, values.shape, (0,)))


@pytest.mark.parametrize("error", [0.0, 2.0**-22, -(2.0**-22), 2.0**-20, -(2.0**-20), 2.0**-10, -(2.0**-10)])
def test_codes_exact_whatever_the_approximate_quotient(error):
    """Scales over their whole range ``[1/127, 4/127)``; the approximate quotient off by up to ``2**-10`` relative
    (a TPU's or a GPU's division is within 2 ulp, ``2**-22``): the codes are ``rint(fl(x / s))`` bit for bit, ties
    to even."""
    rng = np.random.default_rng(int(abs(error) * 2**30) % 1000 + (error < 0))
    scales = np.concatenate([(rng.uniform(1, 4, 600) / 127), [1 / 127, 2 / 127, 1 / 64]]).astype(np.float32)
    values = _around_every_boundary(scales, 127)
    got = np.asarray(jax.jit(lambda v, s: _exact_codes(v, s, error=error))(values, scales))
    np.testing.assert_array_equal(got, np.rint(values / scales[:, None]))
    assert np.count_nonzero(np.abs(values / scales[:, None] % 1) == 0.5) > 1000  # ties were among them


def test_codes_exact_for_int4_limits_float64_and_non_finite():
    rng = np.random.default_rng(1)
    scales = (rng.uniform(1, 4, 300) / 7).astype(np.float32)
    values = _around_every_boundary(scales, 7)
    got = np.asarray(jax.jit(_exact_codes)(values, scales))
    np.testing.assert_array_equal(np.clip(got, -7, 7), np.clip(np.rint(values / scales[:, None]), -7, 7))
    scales64 = rng.uniform(1, 4, 100) / 127
    values64 = _around_every_boundary(scales64, 127, np.float64, spread=3)
    with ieee_float64():
        got = np.asarray(jax.jit(_exact_codes)(jnp.asarray(values64), jnp.asarray(scales64)))
    np.testing.assert_array_equal(got, np.rint(values64 / scales64[:, None]))
    special = np.array([[np.nan, np.inf, -np.inf, 1.0]], np.float32)
    got = np.asarray(jax.jit(_exact_codes)(special, np.array([np.float32(1 / 127)])))
    assert np.isnan(got[0, 0]) and got[0, 3] == 127 and not np.any(np.abs(got[0, 1:3]) < 127)


@pytest.mark.parametrize("error", [0.0, 2.0**-51, -(2.0**-51)])
@pytest.mark.parametrize("limit", [127, 7])
def test_float64_codes_exact_around_every_boundary(limit, error):
    """The GPU's codes: a float64 reciprocal per slice, one float64 multiply per element. Scales over their whole
    range ``[1/limit, 4/limit)`` and at its ends, values within 6 ulp of every rounding boundary and on them (ties),
    the reciprocal off by up to ``2**-51`` (twice a float64 division's rounding): ``rint(fl32(x / s))`` bit for
    bit."""
    rng = np.random.default_rng(limit + int(error * 2**53))
    scales = np.concatenate([rng.uniform(1, 4, 2000) / limit,
                             [1 / limit, 2 / limit, np.nextafter(np.float32(4 / limit), 0)]]).astype(np.float32)
    values = _around_every_boundary(scales, limit)
    got = np.asarray(jax.jit(lambda v, s: _float64_codes(v, s, error=error))(values, scales))
    np.testing.assert_array_equal(got, np.rint(values / scales[:, None]))
    assert np.count_nonzero(np.abs(values / scales[:, None] % 1) == 0.5) > 1000  # ties were among them


def test_float64_codes_of_non_finite_values_and_zeros():
    special = np.array([[np.nan, np.inf, -np.inf, 1.0, -0.0, 0.0]], np.float32)
    got = np.asarray(jax.jit(_float64_codes)(special, np.array([np.float32(1 / 127)])))
    np.testing.assert_array_equal(got[:, 1:], [[np.inf, -np.inf, 127, 0, 0]])
    assert np.isnan(got[0, 0])


@examples(25)
@given(st.sampled_from([(64, 256), (8, 1024), (3, 5, 96)]), st.integers(0, 2**31 - 1),
       st.sampled_from(["normal", "integers", "bfloat16", "tiny"]))
def test_gpu_and_tpu_programs_quantize_like_the_contract(shape, seed, data):
    """``quantize_parts`` as the CUDA and TPU programs compute it (their ``platform_dependent`` branches, evaluated
    here), on realistic shapes and data full of ties: the reference's codes, scales and exponents, bit for bit."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if data == "integers":
        x = np.round(x * 40).astype(np.float32)
    elif data == "bfloat16":
        x = np.array(jnp.asarray(x * 3, jnp.bfloat16).astype(jnp.float32))
    elif data == "tiny":  # a / 127 below the normal range; every element a normal float
        x = (np.sign(x) * rng.uniform(0.5, 1, shape) * 2.0**-120).astype(np.float32)
    x[0] = 0
    axes = (x.ndim - 1,)
    want_scales, want_exponents = reference_scale_parts(x, axes)
    for platform in ("cuda", "tpu"):
        codes, scales, exponents = evaluate_as(platform, lambda v: quantize_parts(v, axes), x)
        np.testing.assert_array_equal(np.asarray(codes), reference_codes(x, axes))
        np.testing.assert_array_equal(np.asarray(scales), want_scales)
        np.testing.assert_array_equal(np.asarray(exponents), want_exponents)


@pytest.mark.usefixtures("every_platform_programs")
def test_tpu_codes_broadcast_one_per_slice_array():
    """The TPU's quantization pass broadcasts one per-slice array along the slices, the signed divisor that holds
    the prescale too, and derives the prescale, the divisor's halves and the tie bound per element: XLA:TPU pays for
    each broadcast array per slice (``docs/performance.md``), and would move an elementwise operation on a broadcast
    before it, making each derived value an array of its own, but for the ``x * 0`` added to the divisor. The CPU's
    pass broadcasts two, the prescale and the divisor."""
    jaxpr = jax.make_jaxpr(lambda v: quantize_parts(v, (1,)))(jnp.ones((8, 64)))
    for platform, count in (("tpu", 1), ("cpu", 2)):
        broadcasts = [e for e in platform_eqns(jaxpr, platform) if e.primitive.name == "broadcast_in_dim"
                      and e.invars[0].aval.shape == (8,) and e.outvars[0].aval.shape == (8, 64)]
        assert len(broadcasts) == count, platform
    multiplies_by_zero = [e for e in platform_eqns(jaxpr, "tpu") if e.primitive.name == "mul"
                          and any(getattr(v, "val", None) is not None and np.all(v.val == 0) for v in e.invars)]
    assert len(multiplies_by_zero) == 1


@pytest.mark.usefixtures("every_platform_programs")
@pytest.mark.parametrize("shape, kept_axes, per_slice", [
    ((64, 4096), (0,), True), ((64, 256), (0,), True), ((64, 255), (0,), False), ((64, 128), (0,), False),
    ((4096, 128), (1,), True), ((8, 64, 256), (0, 2), True), ((4, 12, 128, 128), (0, 1, 2), False),
    ((4, 6, 128, 64), (0, 1, 3), False), ((4, 2, 128), (0,), True), ((128,), (), False), ((512,), (), True)])
def test_tpu_pass_takes_per_slice_parts_where_they_pay(shape, kept_axes, per_slice):
    """The TPU's pass broadcasts its divisor's parts per slice (divisor, prescale, reciprocal: three arrays) where
    the last axis is kept and fills the 128 lanes, or the slices hold at least 256 values; otherwise one per-slice
    array it decodes per element (:func:`test_tpu_codes_broadcast_one_per_slice_array`)."""
    assert tpu_per_slice_parts(shape, kept_axes) == per_slice
    reduce_axes = tuple(a for a in range(len(shape)) if a not in kept_axes)
    jaxpr = jax.make_jaxpr(lambda v: quantize_parts(v, reduce_axes))(jnp.ones(shape))
    kept_shape = tuple(shape[a] for a in kept_axes)
    broadcasts = [e for e in platform_eqns(jaxpr, "tpu") if e.primitive.name == "broadcast_in_dim"
                  and e.invars[0].aval.shape == kept_shape and e.outvars[0].aval.shape == shape
                  and not hasattr(e.invars[0], "val")]  # a constant's broadcast (a literal's) is not per slice
    assert len(broadcasts) == (3 if per_slice else 1)


def test_tpu_pass_form_with_symbolic_dimensions():
    """An exported program's dimension variables: a symbolic batch leaves the choice to the slices' length; a
    symbolic slice length keeps the per-element form (never more than 1.3x the pass's memory time on a v5e)."""
    batch, length = jax.export.symbolic_shape("b, t")
    assert tpu_per_slice_parts((batch, 4096), (0,)) and not tpu_per_slice_parts((batch, 128), (0,))
    assert not tpu_per_slice_parts((4, length), (0,)) and tpu_per_slice_parts((length, 128), (1,))
    assert not tpu_per_slice_parts((128, length), (1,))


@pytest.mark.parametrize("per_slice_parts", [True, False])
@pytest.mark.parametrize("limit", [127, 7])
def test_tpu_codes_exact_in_every_binade(limit, per_slice_parts, monkeypatch):
    """The TPU's codes (its ``platform_dependent`` branch, evaluated here) for one slice per power of two of the
    absmax, from the smallest normal to the top binade, with every value within two ulp of a rounding boundary of
    its slice's scale or on one: the reference's codes bit for bit, on both sides of the exponents (-64, -65) where
    :func:`signed_divisors` switches to a tiny slice's shifted divisor; with the divisor's parts per slice (the
    approximate quotient a multiply by its reciprocal) and per element."""
    monkeypatch.setattr(exact_division, "tpu_per_slice_parts", lambda shape, kept_axes: per_slice_parts)
    rng = np.random.default_rng(limit)
    exponents = np.arange(-126, 128)
    amax = (rng.uniform(1, 2, exponents.size) * 2.0**exponents).astype(np.float32)
    amax[-1] = np.finfo(np.float32).max
    scales = (amax / np.float32(limit)).astype(np.float32)  # IEEE: the contract's scale
    halves = np.arange(-limit - 1, limit + 1) + 0.5
    with np.errstate(over="ignore"):  # the top binade's outer boundary, dropped below
        near = (scales[:, None].astype(np.float64) * halves).astype(np.float32)
    values = (near[:, :, None].view(np.int32) + np.arange(-2, 3, dtype=np.int32)).view(np.float32).reshape(
        exponents.size, -1)
    values = np.where(np.abs(values) <= amax[:, None], values, 0).astype(np.float32)
    values = np.where(np.abs(values) >= np.finfo(np.float32).tiny, values, 0).astype(np.float32)
    x = np.concatenate([amax[:, None], values], axis=1)
    codes, got_scales, got_exponents = evaluate_as("tpu", lambda v: quantize_parts(v, (1,), limit), x)
    want_scales, want_exponents = reference_scale_parts(x, (1,), limit)
    np.testing.assert_array_equal(np.asarray(got_scales), want_scales)
    np.testing.assert_array_equal(np.asarray(got_exponents), want_exponents)
    np.testing.assert_array_equal(np.asarray(codes), reference_codes(x, (1,), limit))
    quotients = x.astype(np.float64) / (want_scales.astype(np.float64) * np.exp2(want_exponents))[:, None]
    assert np.count_nonzero(np.abs(quotients % 1) == 0.5) > 3 * exponents.size  # ties were among them


def test_signed_divisors_hold_scale_and_prescale():
    """A slice's divisor and prescale as the TPU's pass reads them back: the scale itself and 1 down to an absmax
    of ``2**-64``; below, the scale and the values both scaled by ``2**64``; NaN and Inf stay NaN and Inf."""
    exponents = np.array([-126, -65, -64, 0, 64, 65, 126], np.int32)
    scales = np.float32([1 / 127, 1.5 / 127, 1.99 / 127, 1 / 7, 3.9 / 7, 2 / 127, np.inf])
    prescale = np.exp2(-exponents.astype(np.float64)).astype(np.float32)
    signed = np.asarray(jax.jit(signed_divisors)(scales, prescale))
    multiplier = np.asarray(jax.jit(divisor_prescale)(signed))
    shift = np.where(exponents < -64, 64.0, 0.0)
    np.testing.assert_array_equal(np.abs(signed), scales.astype(np.float64) * np.exp2(exponents + shift))
    np.testing.assert_array_equal(multiplier, np.exp2(shift))
    assert np.isnan(jax.jit(signed_divisors)(np.float32([np.nan]), np.float32([1.0]))[0])


@pytest.mark.usefixtures("every_platform_programs")
def test_only_cpu_trusts_the_division():
    """On CPU the scale's mantissa and the codes are IEEE divisions; on CUDA and TPU the mantissa is divided by 127
    in integers: on CUDA one float64 division per slice and a float64 multiply per element; on TPU each element's
    float32 division is only the approximate quotient, settled by the exact comparison (the divisor's halves and the
    boundary's exponent bits: more ``and`` on bits)."""
    jaxpr = jax.make_jaxpr(lambda v: quantize_parts(v, (1,)))(jnp.ones((8, 64)))
    eqns = {p: list(platform_eqns(jaxpr, p)) for p in ("cuda", "tpu", "cpu")}
    masks = {p: sum(e.primitive.name == "and" for e in found) for p, found in eqns.items()}
    assert masks["tpu"] > masks["cuda"] > masks["cpu"]
    for platform, found in eqns.items():
        divisions = [e.outvars[0].aval for e in found if e.primitive.name == "div"]
        per_element = [a for a in divisions if a.dtype == np.float32 and a.shape == (8, 64)]
        in_integers = [a for a in divisions if a.dtype == np.int32]
        in_float64 = [a.shape for a in divisions if a.dtype == np.float64]
        assert (len(per_element), len(in_integers)) == {"cpu": (1, 0), "cuda": (0, 1), "tpu": (1, 1)}[platform]
        assert in_float64 == ([(8,)] if platform == "cuda" else [])
        products = [e.outvars[0].aval.shape for e in found if e.primitive.name == "mul"
                    and e.outvars[0].aval.dtype == np.float64]
        assert products == ([(8, 64)] if platform == "cuda" else [])


def test_ulp_distance_counts_the_float32_values_between():
    """The TPU's tolerance (``assert_within_ulps``), itself checked: across zero, at the largest float, NaN."""
    want = np.array([1.0, -0.0, np.finfo(np.float32).max, np.nan, -3e-38], np.float32)
    two_up = np.nextafter(np.nextafter(want, np.float32(np.inf)), np.float32(np.inf))
    assert_within_ulps(two_up, want, 2)
    assert_within_ulps(np.array([0.0], np.float32), np.array([-0.0], np.float32), 0)
    with pytest.raises(AssertionError):
        assert_within_ulps(np.nextafter(two_up, np.float32(np.inf)), want, 2)
    with pytest.raises(AssertionError):  # a NaN where a number is wanted
        assert_within_ulps(np.array([np.nan], np.float32), np.array([1.0], np.float32), 2)
    smallest = np.float32(np.finfo(np.float32).smallest_subnormal)
    assert_within_ulps(np.array([smallest], np.float32), np.array([-smallest], np.float32), 2)


def test_a_smoothed_weights_value_is_the_ieee_quotient_on_a_gpu():
    """``codes * scale / smooth`` of a smoothed weight, as the CUDA program computes it (its float64 quotient, here on
    the CPU's IEEE float64): the CPU's IEEE float32 quotient, bit for bit (on an H200 the float32 division was within
    an ulp of it)."""
    rng = np.random.default_rng(5)
    values = (rng.normal(size=20_000) * 2.0 ** rng.integers(-60, 60, 20_000)).astype(np.float32)
    divisors = (rng.uniform(1, 2, 20_000) * 2.0 ** rng.integers(-60, 60, 20_000)).astype(np.float32)
    want = values / divisors
    (got,) = evaluate_as("cuda", correctly_rounded_divide, values, divisors)
    _same_bits(got, want)
    on_device = jax.jit(correctly_rounded_divide)(values, divisors)
    if approximate_division():  # a TPU keeps its own division there
        assert_within_ulps(on_device, want, TPU_DIVISION_ULPS)
    else:
        _same_bits(on_device, want)
