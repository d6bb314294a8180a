"""The contract's numbers on the inputs where XLA's shortcuts bite, at realistic sizes (64 to 1024 wide):
NaN/Inf, epilogue overflow, tiny scales, exact rounding ties, float64 -- and a hypothesis differential test mixing
them all against the numpy float64 reference with exact integer sums."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import away_from_ties, examples, ieee_float64, reference_codes, reference_dot, reference_scale_parts
from jaxpr_rewrite import int8_matmul, int8ify, quantize_params
from jaxpr_rewrite import quantize

MATMUL = (((1,), (0,)), ((), ()))
matmul = int8ify(lambda x, w: x @ w)
jit_matmul = jax.jit(matmul)
rng = np.random.default_rng(2026)


def _both(fn, *args):
    """``fn`` eager and under jit."""
    return [np.asarray(fn(*args)), np.asarray(jax.jit(fn)(*args))]


# -- NaN and Inf ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k, n", [(64, 64), (512, 256), (1024, 128)])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_bad_weight_makes_exactly_its_column_non_finite(k, n, bad):
    """A NaN/Inf in w[5, 7] reaches every output of column 7 (XLA's CPU reduce_max drops NaN for many layouts,
    which used to give the NaN code 0 and a finite column)."""
    x = np.ones((4, k), np.float32)
    w = rng.normal(size=(k, n)).astype(np.float32)
    w[5, 7] = bad
    for got in _both(matmul, x, w):
        assert not np.any(np.isfinite(got[:, 7])), got[:, 7]
        assert np.all(np.isfinite(np.delete(got, 7, axis=1)))


@pytest.mark.parametrize("options", [{}, {"granularity": "per-tensor"}, {"block_size": 32}, {"backend": "mxfp8"},
                                     {"backend": "nvfp4"}])
def test_bad_activation_reaches_its_outputs_under_every_scheme(options):
    x = rng.normal(size=(8, 256)).astype(np.float32)
    w = rng.normal(size=(256, 64)).astype(np.float32)
    x[3, 200] = np.nan
    got = np.asarray(jax.jit(int8ify(lambda x, w: x @ w, **options))(x, w))
    assert not np.any(np.isfinite(got[3]))
    if "granularity" not in options:  # per-tensor: one scale for everything, so every output is NaN
        assert np.all(np.isfinite(np.delete(got, 3, axis=0)))


def test_nan_in_prequantized_weights_and_chunked_contraction():
    w = rng.normal(size=(64, 64)).astype(np.float32)
    w[10, 3] = np.nan
    qw = quantize_params(lambda w, x: x @ w, jnp.asarray(w), jnp.ones((2, 64)))
    got = np.asarray(jax.jit(int8ify(lambda w, x: x @ w))(qw, np.ones((2, 64), np.float32)))
    assert not np.any(np.isfinite(got[:, 3])) and np.all(np.isfinite(np.delete(got, 3, axis=1)))
    k = 140_000  # chunked: one int8 dot with an extra batch dim of chunks
    x = np.ones((2, k), np.float32)
    x[1, 70_000] = np.inf
    got = np.asarray(jit_matmul(x, np.ones((k, 3), np.float32)))
    assert np.all(np.isfinite(got[0])) and not np.any(np.isfinite(got[1]))


# -- range --------------------------------------------------------------------------------------------------------
def test_epilogue_does_not_overflow_before_the_small_scale():
    """x = 1e36, w = 1e-30: the product 6.4e7 is an ordinary float; (acc * s_x) * s_w overflowed to inf."""
    x = np.full((2, 64), 1e36, np.float32)
    w = np.full((64, 3), 1e-30, np.float32)
    for got in _both(matmul, x, w):
        np.testing.assert_allclose(got, np.full((2, 3), 64e6), rtol=1e-6)
    # rows and columns of very different magnitudes in one product: every representable result is right
    x = rng.normal(size=(4, 256)).astype(np.float32) * np.array([[1e-30], [1e30], [1.0], [1e-37]], np.float32)
    x[np.abs(x) < np.finfo(np.float32).tiny] = 0  # XLA reads subnormal inputs as zero
    w = rng.normal(size=(256, 64)).astype(np.float32) * np.repeat([1e25, 1e-25], 32).astype(np.float32)
    got = np.asarray(jit_matmul(x, w), np.float64)
    want = reference_dot(x, w, MATMUL)
    representable = np.abs(want) < np.finfo(np.float32).max
    assert representable.sum() == 4 * 64 - 32 and np.all(np.isfinite(got[representable]))
    np.testing.assert_allclose(got[representable], want[representable], rtol=1e-6, atol=np.finfo(np.float32).tiny)


def test_tiny_rows_keep_full_code_resolution():
    """Rows at 3e-38 against weights of 1e30: the products are ordinary floats; codes must use +-127, not 2-3."""
    # normal float32 values just above the subnormal range (XLA reads subnormal inputs as zero)
    x = (rng.choice([-1, 1], size=(8, 512)) * rng.uniform(1.2e-38, 4e-38, size=(8, 512))).astype(np.float32)
    w = (rng.normal(size=(512, 64)) * 1e30).astype(np.float32)
    out = jax.jit(int8_matmul)(x, w)
    np.testing.assert_array_equal(np.asarray(out["x_q"]), reference_codes(x, (1,)))
    assert np.abs(np.asarray(out["x_q"])).max(axis=1).min() == 127
    exact = x.astype(np.float64) @ w.astype(np.float64)
    rel = np.linalg.norm(np.asarray(jit_matmul(x, w), np.float64) - exact) / np.linalg.norm(exact)
    assert rel < 0.02, rel  # int8 accuracy, not the 17% of 2-3 code levels
    np.testing.assert_allclose(np.asarray(out["y"], np.float64), reference_dot(x, w, MATMUL), rtol=1e-6)


def test_scales_and_codes_in_every_binade():
    """One row per float32 binade of the absmax (2**-126 to the largest float), plus an Inf row and a zero row:
    scales, exponents and codes are the reference's, bit for bit, and the codes of every finite row reach +-127."""
    exponents = np.arange(-126, 128)
    mantissas = rng.uniform(1, 2, size=exponents.size)
    mantissas[-1] = np.float32(2 - 2.0**-23)  # the largest float32
    amax = np.ldexp(mantissas, exponents).astype(np.float32)
    x = (rng.uniform(-1, 1, size=(exponents.size, 256)) * amax[:, None].astype(np.float64)).astype(np.float32)
    x[np.abs(x) < np.finfo(np.float32).tiny] = 0  # XLA reads subnormal inputs as zero
    x[:, 17] = -amax
    x = away_from_ties(x, (1,))
    x = np.concatenate([x, np.full((1, 256), 1.0, np.float32), np.zeros((1, 256), np.float32)])
    x[-2, 5] = np.inf
    want_scales, want_exponents = reference_scale_parts(x, (1,))
    for q in (quantize(x, (1,)), jax.jit(lambda x: quantize(x, (1,)))(x)):
        np.testing.assert_array_equal(np.asarray(q.scales), want_scales)
        np.testing.assert_array_equal(np.asarray(q.exponents)[:-2], want_exponents[:-2])
        assert np.asarray(q.exponents)[-1] == 0
        codes = np.asarray(q.codes)
        np.testing.assert_array_equal(codes[:-2], reference_codes(x[:-2], (1,)))
        assert np.all(np.abs(codes[:-2]).max(axis=1) == 127) and np.all(codes[-1] == 0)


def test_float64_operands_beyond_float32_range():
    with ieee_float64():
        x = rng.normal(size=(4, 128)) * 1e200
        w = rng.normal(size=(128, 32)) * 1e-150
        got = jax.jit(matmul)(x, w)
        assert got.dtype == np.float64
        exact = x @ w
        assert np.all(np.isfinite(np.asarray(got)))
        rel = np.linalg.norm(np.asarray(got) - exact) / np.linalg.norm(exact)
        assert rel < 0.02, rel
        q = quantize(jnp.asarray(x), (1,))
        assert q.scales.dtype == np.float64
        np.testing.assert_array_equal(np.asarray(q.codes), np.clip(np.rint(x / (np.abs(x).max(1) / 127)[:, None]),
                                                                   -127, 127))


# -- exact ties ---------------------------------------------------------------------------------------------------
def tie_rich(shape, dtype=np.float32):
    """Integers, dyadic fractions and bfloat16-valued data: many values sit exactly on a rounding tie of
    x / (absmax / 127), where a reciprocal multiply lands on the other code."""
    kind = rng.integers(0, 3)
    if kind == 0:
        x = rng.integers(-300, 300, shape) / 4.0
    elif kind == 1:
        x = rng.integers(-127, 128, shape).astype(np.float64)
    else:
        x = np.asarray(jnp.asarray(rng.normal(size=shape), jnp.bfloat16), np.float64)
    return x.astype(dtype)


def test_issue_example_ties():
    x = np.array([[-2.25, 4.5, 1.0, 0.5]], np.float32)
    for codes in _both(lambda x: quantize(x, (1,)).codes, x):
        np.testing.assert_array_equal(codes, [[-63, 127, 28, 14]])


@pytest.mark.parametrize("shape", [(64, 64), (256, 512), (128, 1024)])
def test_codes_and_scales_are_the_seed_formula_bit_for_bit_on_tied_data(shape):
    x = tie_rich(shape)
    want_scales, _ = reference_scale_parts(x, (1,))
    want_codes = reference_codes(x, (1,))
    for fn in (lambda x: quantize(x, (1,)), jax.jit(lambda x: quantize(x, (1,)))):
        q = fn(x)
        np.testing.assert_array_equal(np.asarray(q.scales), want_scales)
        np.testing.assert_array_equal(np.asarray(q.codes), want_codes)
    w = tie_rich((shape[1], 64))
    out = jax.jit(int8_matmul)(x, w)
    np.testing.assert_array_equal(np.asarray(out["w_q"]), reference_codes(w, (0,)))
    # the reported scales are the values absmax / 127, correctly rounded (numpy's float32 division)
    np.testing.assert_array_equal(np.asarray(out["x_scales"]), np.max(np.abs(x), axis=1) / np.float32(127))


def test_bfloat16_operands_on_ties():
    x = jnp.asarray(tie_rich((64, 256)), jnp.bfloat16)
    w = jnp.asarray(tie_rich((256, 128)), jnp.bfloat16)
    got = np.asarray(jit_matmul(x, w), np.float64)
    want = reference_dot(np.asarray(x, np.float32), np.asarray(w, np.float32), MATMUL)
    np.testing.assert_allclose(got, want, rtol=8e-3)  # the result is bfloat16


# -- differential test -------------------------------------------------------------------------------------------
SPECIALS = {
    "normal": lambda r, s: r.normal(size=s),
    "tied": lambda r, s: r.integers(-300, 300, s) / 4.0,
    "huge": lambda r, s: r.normal(size=s) * 1e33,
    "tiny": lambda r, s: r.normal(size=s) * 1e-36,
    "zero": lambda r, s: np.zeros(s),
}


@examples(20)
@given(
    b=st.sampled_from([1, 3, 64]),
    k=st.sampled_from([64, 256]),
    n=st.sampled_from([8, 256]),
    kinds=st.lists(st.sampled_from(sorted(SPECIALS)), min_size=2, max_size=2),
    bad=st.sampled_from([None, np.nan, np.inf]),
    seed=st.integers(0, 2**16),
)
def test_differential_against_the_float64_reference(b, k, n, kinds, bad, seed):
    """Rows and columns of every kind (normal, tied, huge, tiny, zero) mixed in one product; every finite
    output matches the reference; every output that depends on a NaN/Inf is non-finite."""
    r = np.random.default_rng(seed)
    x = SPECIALS[kinds[0]](r, (b, k)).astype(np.float32)
    w = SPECIALS[kinds[1]](r, (k, n)).astype(np.float32)
    if b > 1:
        x[0] = SPECIALS["normal"](r, (k,))
    x[np.abs(x) < np.finfo(np.float32).tiny] = 0  # XLA treats subnormal inputs as zero
    w[np.abs(w) < np.finfo(np.float32).tiny] = 0
    if bad is not None:
        x[-1, k // 2] = bad
    got = np.asarray(jit_matmul(x, w), np.float64)
    finite_rows = np.all(np.isfinite(x), axis=1)
    want = reference_dot(np.where(np.isfinite(x), x, 0), w, MATMUL)
    representable = np.abs(want) < np.finfo(np.float32).max
    ok = finite_rows[:, None] & representable
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-6, atol=np.finfo(np.float32).tiny)
    assert not np.any(np.isfinite(got[~finite_rows]))
