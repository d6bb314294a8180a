"""4-bit weights with int8 dots (W4A8): packed codes, their scales and the dot against an independent numpy
reference (codes ``clip(rint(w / (absmax / 7)), -7, 7)``, nibbles packed by integer arithmetic, exact int64 sums),
at realistic sizes, with odd contraction lengths and all-zero slices; the contract's NaN and range rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from helpers import (assert_all_dots_int8, reference_codes, reference_dot, reference_pack_int4, reference_scales,
                     reference_unpack_int4)
from jaxpr_rewrite import Int8ifyError, QuantizedArray, int8ify, quantize_params
from jaxpr_rewrite import quantize
from jaxpr_rewrite._numerics.int4 import pack_int4, unpack_int4

MATMUL = (((1,), (0,)), ((), ()))


@given(hnp.arrays(np.int8, hnp.array_shapes(min_dims=1, max_dims=3, max_side=33),
                  elements=st.integers(-8, 7)))
def test_packing_matches_the_documented_nibble_layout(codes):
    # under jit: one compilation per shape instead of one per primitive and shape
    packed = np.asarray(jax.jit(pack_int4)(jnp.asarray(codes)))
    assert packed.dtype == np.uint8
    np.testing.assert_array_equal(packed, reference_pack_int4(codes))
    unpacked = jax.jit(unpack_int4, static_argnums=1)(jnp.asarray(packed), codes.shape[-1])
    np.testing.assert_array_equal(np.asarray(unpacked), codes)
    np.testing.assert_array_equal(reference_unpack_int4(packed, codes.shape[-1]), codes)


def weight(rows, cols, seed=0):
    """Gaussian weights with an all-zero column and an all-zero row (an all-zero slice either way)."""
    w = np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32) / np.sqrt(rows)
    w[:, 3] = 0
    w[5, :] = 0
    return w


@pytest.mark.parametrize("shape, axis", [((333, 256), 0), ((256, 333), 1), ((1024, 65), 0)],
                         ids=["odd-K-first", "odd-K-packed-axis", "wide-K"])
def test_codes_and_scales_match_the_reference(shape, axis):
    w = weight(*shape)
    q = quantize(w, (axis,), bits=4)
    assert q.bits == 4 and q.shape == shape and q.codes.dtype == jnp.uint8
    assert q.codes.shape == (shape[0], -(-shape[1] // 2))
    want = reference_codes(w, (axis,), limit=7)
    assert want.min() >= -7 and want.max() <= 7
    np.testing.assert_array_equal(np.asarray(q.codes), reference_pack_int4(want))
    np.testing.assert_array_equal(np.asarray(q.unpacked().codes), want)
    np.testing.assert_array_equal(np.asarray(q.scale_values(), np.float64), reference_scales(w, (axis,), limit=7))
    zero_slice = 3 if axis == 0 else 5  # the all-zero column (axis 0) or row (axis 1): scale 1, codes 0
    assert np.asarray(q.scale_values())[zero_slice] == 1
    assert q.nbytes < quantize(w, (axis,)).nbytes * 0.6


def w4a8_reference(x, w, contracting_axis):
    """The W4A8 value of ``x @ w`` (or ``x @ w.T`` when ``w`` contracts its axis 1), in float64."""
    return reference_dot(x, w if contracting_axis == 0 else w.T, MATMUL, rhs_limit=7)


@pytest.mark.parametrize("shape, axis", [((333, 256), 0), ((256, 333), 1), ((1024, 128), 0)],
                         ids=["odd-K", "odd-K-transposed", "wide-K"])
def test_w4a8_dot_matches_the_reference(shape, axis):
    w = weight(*shape)
    k = shape[axis]
    x = np.random.default_rng(1).normal(size=(64, k)).astype(np.float32)
    x[7] = 0  # an all-zero activation row

    def layer(params, x):
        return x @ params["w"] if axis == 0 else x @ params["w"].T

    qparams = quantize_params(layer, {"w": w}, x, bits=4)
    assert isinstance(qparams["w"], QuantizedArray) and qparams["w"].bits == 4
    out = np.asarray(jax.jit(int8ify(layer))(qparams, x), np.float64)
    np.testing.assert_allclose(out, w4a8_reference(x, w, axis), rtol=1e-6)
    assert np.all(out[7] == 0)
    jaxpr = int8ify(layer).rewritten_jaxpr(qparams, x)
    assert_all_dots_int8(jaxpr, 1)
    # packed codes, scales, exponents, the two epilogue factors, and x
    expected = ["uint8", "float32", "int32", "float32", "float32", "float32"]
    assert [str(v.aval.dtype) for v in jaxpr.jaxpr.invars] == expected


def test_nan_and_range_rules_hold():
    w = weight(256, 128)
    # a column far below 1 (still normal floats) against activations far above: acc * s_x alone would overflow
    w[:, 10] *= 2.0**-110
    w[17, 20] = np.nan  # NaN in a weight column: every output of that column is non-finite
    x = np.random.default_rng(2).normal(size=(32, 256)).astype(np.float32) * np.float32(2.0**120)
    x[4, 9] = np.inf  # Inf in an activation row: every output of that row is non-finite

    def layer(params, x):
        return x @ params["w"]

    qparams = quantize_params(layer, {"w": w}, x, bits=4)
    out = np.asarray(jax.jit(int8ify(layer))(qparams, x), np.float64)
    assert not np.isfinite(out[:, 20]).any() and not np.isfinite(out[4]).any()
    finite_rows = [r for r in range(32) if r != 4]
    finite_cols = [c for c in range(128) if c != 20]
    got = out[np.ix_(finite_rows, finite_cols)]
    clean_x = np.delete(x, 4, axis=0)
    clean_w = np.delete(w, 20, axis=1)
    np.testing.assert_allclose(got, w4a8_reference(clean_x, clean_w, 0), rtol=1e-6)
    assert np.all(np.isfinite(got)) and np.abs(got[:, 10]).max() < 2.0**16  # about 2**120 * 2**-110


def test_stacked_layers_in_a_scan_stay_packed():
    rng = np.random.default_rng(3)
    stacked = rng.normal(size=(3, 128, 128)).astype(np.float32) / 12
    x = rng.normal(size=(16, 128)).astype(np.float32)

    def model(params, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params)[0]

    qparams = quantize_params(model, stacked, x, bits=4)
    assert qparams.bits == 4 and qparams.codes.shape == (3, 128, 64) and qparams.scales.shape == (3, 128)
    h = x
    for layer in stacked:
        h = np.asarray(jnp.tanh(np.float32(w4a8_reference(h, layer, 0))))  # the device's tanh, as the model's
    np.testing.assert_allclose(np.asarray(jax.jit(int8ify(model))(qparams, x)), h, rtol=1e-4, atol=1e-6)
    assert_all_dots_int8(int8ify(model).rewritten_jaxpr(qparams, x))


def test_unsupported_widths_are_refused():
    with pytest.raises(Int8ifyError, match=r"bits must be one of \[4, 8\], got 3"):
        quantize_params(lambda p, x: x @ p, np.ones((64, 64), np.float32), np.ones((2, 64), np.float32), bits=3)
    with pytest.raises(Int8ifyError, match="a scalar has none"):
        quantize(np.float32(1), (), bits=4)
