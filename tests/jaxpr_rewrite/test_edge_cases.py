"""Edge cases: long contractions (int32 overflow), zero-size dims, NaN/Inf, literal and constant operands, and
``quantize``'s axes and dtypes."""

import jax

import numpy as np
import pytest
from jax import lax

from helpers import assert_all_dots_int8, away_from_ties, reference_codes, reference_dot
from jaxpr_rewrite import Int8ifyError, int8ify
from jaxpr_rewrite import quantize
from jaxpr_rewrite._numerics.quantize import MAX_INT32_SAFE_CONTRACTION

MATMUL = (((1,), (0,)), ((), ()))


def test_overflow_bound():
    assert 127 * 127 * MAX_INT32_SAFE_CONTRACTION <= 2**31 - 1 < 127 * 127 * (MAX_INT32_SAFE_CONTRACTION + 1)


def test_long_contraction_is_chunked_exactly():
    """K = 140,000 > 133,144: a single int32 sum could overflow; chunks sum exactly and add in float32."""
    k = 140_000
    # every code is +-127 so a single int32 accumulator would overflow: 127*127*140000 > 2**31
    x = np.ones((2, k), np.float32)
    x[1, ::2] = -1
    w = np.ones((k, 3), np.float32)
    f = int8ify(lambda x, w: x @ w)
    jaxpr = jax.make_jaxpr(f)(x, w)
    (dot,) = assert_all_dots_int8(jaxpr, 1)
    assert dot.invars[0].aval.shape[-1] <= MAX_INT32_SAFE_CONTRACTION
    got = np.asarray(jax.jit(f)(x, w), np.float64)
    want = reference_dot(x, w, MATMUL)  # exact int64 sums
    np.testing.assert_allclose(want[0], k, rtol=1e-7)  # scales are float32: 1/127 is not exact
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_long_contraction_over_two_dims_with_batch():
    x = away_from_ties(np.random.default_rng(0).normal(size=(2, 700, 200)), (1, 2))
    w = away_from_ties(np.random.default_rng(1).normal(size=(200, 2, 700)), (2, 0))
    dims = (((1, 2), (2, 0)), ((0,), (1,)))
    got = jax.jit(int8ify(lambda a, b: lax.dot_general(a, b, dims)))(x, w)
    np.testing.assert_allclose(np.asarray(got, np.float64), reference_dot(x, w, dims), rtol=1e-5)


@pytest.mark.parametrize("x_shape, w_shape", [((0, 4), (4, 3)), ((2, 0), (0, 3)), ((2, 4), (4, 0))])
def test_zero_size_dims(x_shape, w_shape):
    x, w = np.ones(x_shape, np.float32), np.ones(w_shape, np.float32)
    got = int8ify(lambda x, w: x @ w)(x, w)
    assert got.shape == (x_shape[0], w_shape[1])
    np.testing.assert_array_equal(got, np.zeros(got.shape))


def test_all_zero_slices_give_exact_zeros():
    x = np.array([[0, 0, 0], [1, -2, 0.5]], np.float32)
    w = np.array([[0, 1], [0, 2], [0, 3]], np.float32)
    got = np.asarray(int8ify(lambda x, w: x @ w)(x, w))
    assert np.all(got[0] == 0) and np.all(got[:, 0] == 0)
    assert np.all(got[1, 1:] != 0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_never_give_finite_wrong_numbers(bad):
    x = np.array([[1.0, 2.0, 3.0], [1.0, bad, 3.0], [0.0, 0.0, 0.0]], np.float32)
    w = np.array([[1.0, 0.5], [2.0, 0.0], [3.0, -1.0]], np.float32)
    got = np.asarray(jax.jit(int8ify(lambda x, w: x @ w))(x, w))
    assert np.all(np.isfinite(got[0])) and np.all(got[2] == 0)
    # every output that depends on the bad row is non-finite
    assert not np.any(np.isfinite(got[1])), got[1]


def test_nan_in_weights_column():
    x = np.ones((2, 3), np.float32)
    w = np.array([[1.0, np.nan], [2.0, 0.0], [3.0, 1.0]], np.float32)
    got = np.asarray(int8ify(lambda x, w: x @ w)(x, w))
    assert np.all(np.isfinite(got[:, 0])) and np.all(np.isnan(got[:, 1]))


def test_literal_and_constant_operands():
    const = away_from_ties(np.random.default_rng(4).normal(size=(3, 2)), (0,))
    x = away_from_ties(np.random.default_rng(5).normal(size=(4, 3)), (1,))

    def f(x):
        outer = lax.dot_general(x, 2.0, (((), ()), ((), ())))  # a Python-scalar (literal) operand
        return x @ const, outer

    rewritten = int8ify(f)
    assert_all_dots_int8(jax.make_jaxpr(rewritten)(x), 2)
    y, outer = rewritten(x)
    np.testing.assert_allclose(np.asarray(y, np.float64), reference_dot(x, const, MATMUL), rtol=1e-6)
    # no contraction: each element is its own channel, quantized to +-127 exactly
    np.testing.assert_allclose(np.asarray(outer), 2 * x, rtol=1e-6)


def test_tiny_slices_keep_full_code_resolution():
    """A slice whose absmax / 127 would be subnormal (flushed to zero by XLA) is scaled by 2**64 first: its codes
    use the full +-127 range and its scale is the exact (subnormal) float32 value."""
    from jaxpr_rewrite import int8_matmul

    x = np.array([[1e30, 2e30], [0.0, 0.0]], np.float32)
    w = np.array([[0.0, 9.630474e-38], [0.0, -5.0e-38]], np.float32)
    out = jax.jit(int8_matmul)(x, w)
    np.testing.assert_array_equal(np.asarray(out["w_q"]), reference_codes(w, (0,)))
    assert np.asarray(out["w_q"])[0, 1] == 127 and np.asarray(out["w_q"])[1, 1] == -66
    want_scale = np.float32(np.float64(9.630474e-38) / 127)  # subnormal, rounded once
    np.testing.assert_array_equal(np.asarray(out["w_scales"]), np.array([1.0, want_scale], np.float32))
    np.testing.assert_array_equal(np.asarray(out["y"])[1], 0)
    np.testing.assert_allclose(np.asarray(out["y"], np.float64), reference_dot(x, w, MATMUL), rtol=1e-6)


# -- quantize's arguments ----------------------------------------------------------------------------------------
def test_quantize_takes_one_int_axis_and_negative_axes():
    """A single int is one axis (as numpy's ``axis``) and a negative one counts from the end, eager and under jit
    (the axes are checked on the static shape only)."""
    x = np.random.default_rng(6).normal(size=(2, 3, 4)).astype(np.float32)
    want = quantize(x, (1,))
    for q in (quantize(x, 1), quantize(x, (-2,)), quantize(x, np.int64(-2)), jax.jit(lambda x: quantize(x, -2))(x)):
        assert q.contracting == want.contracting
        np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(want.codes))
        np.testing.assert_array_equal(np.asarray(q.scales), np.asarray(want.scales))
    assert quantize(x, (-1, 0)).contracting == quantize(x, (0, 2)).contracting


@pytest.mark.parametrize("axes, message", [
    ((3,), r"axis 3, out of range for x of shape \(2, 3, 4\); use axes in \[-3, 2\]"),
    ((-4,), r"axis -4, out of range"),
    (3, r"axis 3, out of range"),
    ((1, 1), r"names an axis of x \(shape \(2, 3, 4\)\) more than once"),
    ((2, -1), r"more than once"),
    ((1.0,), r"must be an int or a sequence of ints"),
    (None, r"must be an int or a sequence of ints"),
])
def test_quantize_rejects_out_of_range_and_repeated_axes(axes, message):
    """An out-of-range axis used to wrap onto another one (3 -> 0, -4 -> 2) and an int to fail with a bare
    TypeError."""
    x = np.ones((2, 3, 4), np.float32)
    with pytest.raises(Int8ifyError, match=message):
        quantize(x, axes)
    with pytest.raises(Int8ifyError, match=message):
        jax.jit(lambda x: quantize(x, axes))(x)


@pytest.mark.parametrize("dtype, instead", [
    (np.int32, r"cast it to a float dtype"), (np.int8, r"cast it to a float dtype"),
    (np.bool_, r"cast it to a float dtype"), (np.complex64, r"quantize its real and imaginary parts separately"),
])
def test_quantize_rejects_non_floating_dtypes(dtype, instead):
    """An integer or bool array has no fraction to keep; a complex one lost its imaginary part."""
    x = np.ones((2, 4), dtype)
    with pytest.raises(Int8ifyError, match=rf"floating array x, got dtype {np.dtype(dtype).name} .*; {instead}"):
        quantize(x, (1,))
    with pytest.raises(Int8ifyError, match="floating array x"):
        jax.jit(lambda x: quantize(x, 1))(x)


def test_quantize_of_a_scalar_takes_no_axes():
    assert int(quantize(np.float32(-2), ()).codes) == -127
    with pytest.raises(Int8ifyError, match=r"axis 0, out of range for x of shape \(\); x is a scalar, so pass"):
        quantize(np.float32(-2), 0)
