"""Edge cases: long contractions (int32 overflow), zero-size dims, NaN/Inf, literal and constant operands."""

import jax

import numpy as np
import pytest
from jax import lax

from helpers import assert_all_dots_int8, away_from_ties, reference_codes, reference_dot
from jaxpr_rewrite import int8ify
from jaxpr_rewrite.quantize import MAX_INT32_SAFE_CONTRACTION

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
