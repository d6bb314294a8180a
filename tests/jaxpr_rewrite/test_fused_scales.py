"""The CUDA program's dynamic quantization (``quantize_scaled_max_parts``: the scale taken inside the absmax
reduction) against the contract's numpy reference: the same codes, bit for bit, and the same scale value
(``scales * 2**exponents``, exactly) for every finite slice, in every binade up to the largest float; a NaN scale
for a slice holding NaN or Inf. Run here on the CPU: the function is plain ``lax``, and its numerics do not depend
on the platform that compiles it."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import platform_eqns, reference_codes, reference_scales
from jaxpr_rewrite import int8ify
from jaxpr_rewrite.fused_scales import LARGEST_DIVIDEND, quantize_scaled_max_parts

F32 = np.finfo(np.float32)


def _check_against_reference(x, reduce_axes):
    x = np.asarray(x, np.float32)
    kept = tuple(a for a in range(x.ndim) if a not in reduce_axes)
    codes, scales, exponents, (factor, power) = jax.jit(
        lambda v: quantize_scaled_max_parts(v, reduce_axes))(x)
    finite = np.isfinite(x).all(axis=reduce_axes) if reduce_axes else np.isfinite(x)
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite slice: its reference codes are not compared
        want_codes = reference_codes(x, reduce_axes)
        want_scales = reference_scales(x, reduce_axes)
    got_scales = np.asarray(scales, np.float64) * np.exp2(np.asarray(exponents, np.float64))
    np.testing.assert_array_equal(got_scales[finite], want_scales[finite])
    # the epilogue's factors hold the same value: f * g == scales * 2**exponents, exactly
    np.testing.assert_array_equal((np.asarray(factor, np.float64) * np.asarray(power, np.float64))[finite],
                                  want_scales[finite])
    assert np.isnan(np.asarray(scales)[~finite]).all() and np.isnan(np.asarray(factor)[~finite]).all()
    per_slice = np.broadcast_to(np.expand_dims(finite, reduce_axes), x.shape) if kept else np.full(x.shape, finite)
    np.testing.assert_array_equal(np.asarray(codes)[per_slice], want_codes[per_slice])


@st.composite
def operands(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=ndim, max_size=ndim)))
    reduce_axes = tuple(sorted(draw(st.sets(st.integers(0, ndim - 1)))))  # () too: a scale per element
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "quarters", "tiny", "huge", "top", "zeros"]))
    x = {"normal": lambda: rng.normal(size=shape),
         "quarters": lambda: rng.integers(-300, 300, size=shape) / 4.0,  # rich in rounding ties
         "tiny": lambda: rng.normal(size=shape) * 2.0**-120,
         "huge": lambda: rng.normal(size=shape) * 2.0**120,
         # the top 1/128 of the float range, where the scale comes from the second quotient
         "top": lambda: rng.choice([-1, 1], size=shape) * rng.uniform(0.985, 1, size=shape) * F32.max,
         "zeros": lambda: np.zeros(shape)}[kind]().astype(np.float32)
    x[np.abs(x) < F32.tiny] = 0.0  # XLA reads subnormal inputs as zero (README)
    flat = x.reshape(-1)
    for _ in range(draw(st.integers(0, 2))):
        flat[draw(st.integers(0, flat.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 0.0]))
    return x, reduce_axes


@settings(max_examples=150, deadline=None)
@given(operands())
def test_codes_and_scales_match_the_contract_on_finite_slices(case):
    _check_against_reference(*case)


def test_every_binade_and_the_edges_of_each():
    """One row per binade of the absmax (2**-126 up to the largest float), its mantissa at 1, at 127/64 (where
    ``a * 128/127`` moves to the next binade), just below 2 and random; rows at and just above the largest value
    whose first quotient is finite; a zero row and rows holding NaN, Inf and -Inf."""
    rng = np.random.default_rng(7)
    exponents = np.arange(-126, 128)
    rows = []
    for mantissa in (1.0, 127 / 64, 2 - 2.0**-23, None):
        m = rng.uniform(1, 2, exponents.size) if mantissa is None else np.full(exponents.size, mantissa)
        rows.append(np.minimum(np.ldexp(m, exponents), F32.max).astype(np.float32))
    edge = LARGEST_DIVIDEND[np.dtype(np.float32)]
    rows.append(np.array([edge, np.nextafter(edge, np.float32(np.inf)), F32.max], np.float32))
    amax = np.concatenate(rows)
    x = (rng.uniform(-1, 1, size=(amax.size, 200)) * amax[:, None].astype(np.float64)).astype(np.float32)
    x[np.abs(x) < F32.tiny] = 0
    x[:, 11] = amax
    x[::2, 11] *= -1
    x = np.concatenate([x, np.zeros((4, 200), np.float32)])
    x[-3, 5], x[-2, 6], x[-1, 7] = np.nan, np.inf, -np.inf
    _check_against_reference(x, (1,))
    _check_against_reference(x.T.copy(), (0,))


def test_float64_keeps_its_range():
    """With float64 operands the quotients and scales are float64, exact up to float64's largest value."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(8)
        top = float(LARGEST_DIVIDEND[np.dtype(np.float64)])
        x = np.stack([rng.normal(size=256) * 1e200, rng.normal(size=256) * 1e-200, rng.uniform(-1, 1, 256) * 1.79e308,
                      np.full(256, top), rng.integers(-300, 300, 256) / 4.0])
        codes, scales, exponents, _ = jax.jit(lambda v: quantize_scaled_max_parts(v, (1,)))(x)
        assert scales.dtype == np.float64
        want_scales = np.abs(x).max(axis=1) / 127  # correctly rounded float64, all normal here
        np.testing.assert_array_equal(np.asarray(scales) * np.exp2(np.asarray(exponents, np.float64)), want_scales)
        np.testing.assert_array_equal(np.asarray(codes), np.clip(np.rint(x / want_scales[:, None]), -127, 127))


def test_cuda_takes_the_scale_inside_the_reduction():
    """Compiled for CUDA, a matrix operand's dynamic scale is one integer maximum per slice (of the elements'
    quotient bits) and no division of the per-slice values; CPU and TPU keep their own programs."""
    jaxpr = jax.make_jaxpr(int8ify(lambda a, b: a @ b))(jnp.ones((64, 256)), jnp.ones((256, 128)))

    def maxima(platform):
        return [e.invars[0].aval.dtype for e in platform_eqns(jaxpr, platform) if e.primitive.name == "reduce_max"]

    assert maxima("cuda") == [np.int32, np.int32]
    assert maxima("cpu") == maxima("tpu") == [np.float32, np.float32]
    per_slice_divisions = [e for e in platform_eqns(jaxpr, "cuda")
                           if e.primitive.name == "div" and e.outvars[0].aval.ndim == 1]
    assert not per_slice_divisions
