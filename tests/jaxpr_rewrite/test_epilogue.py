"""The scale epilogue over every pair of float32 scale exponents: exact where the plain formula is, and correct
wherever the result is a normal float."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxpr_rewrite import int8ify, quantize_params
from jaxpr_rewrite._numerics.quantize import epilogue_factors, scale_product
from jaxpr_rewrite._quantized.array import is_quantized

TINY, HUGE = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def test_epilogue_in_every_pair_of_binades():
    rng = np.random.default_rng(3)
    exponents = np.arange(-127, 127, dtype=np.int32)
    n = exponents.size
    mantissas = (rng.uniform(1, 2, size=n) / 127).astype(np.float32)  # scales: mantissa / 127, in [1/127, 2/127)
    acc = rng.integers(-(2**30), 2**30, size=(n, n)).astype(np.float32)  # int32 sums, as floats

    @jax.jit
    def epilogue(acc, scales, exponents):
        f, g = epilogue_factors(scales, exponents)
        rows = [lax.broadcast_in_dim(v, acc.shape, (0,)) for v in (f, g)]
        cols = [lax.broadcast_in_dim(v, acc.shape, (1,)) for v in (f, g)]
        return scale_product(acc, rows, cols)

    got = np.asarray(epilogue(acc, mantissas, exponents), np.float64)
    s = mantissas.astype(np.float64) * 2.0 ** exponents.astype(np.float64)
    exact = acc.astype(np.float64) * s[:, None] * s[None, :]
    normal = (np.abs(exact) >= TINY) & (np.abs(exact) <= HUGE * (1 - 2**-23))
    # two roundings at most: within 2 ulp of the exact product wherever the result is a normal float
    np.testing.assert_allclose(got[normal], exact[normal], rtol=2.5e-7, atol=0)
    assert np.all(np.isinf(got[np.abs(exact) > HUGE * (1 + 2**-23)]))
    # bit for bit the contract's (acc * s_r) * s_l wherever that formula's scales and intermediate are normal
    s32 = s.astype(np.float32)
    with np.errstate(over="ignore", under="ignore"):
        first = acc * s32[None, :]
        plain = first * s32[:, None]
    ordinary = ((np.abs(s) >= TINY)[:, None] & (np.abs(s) >= TINY)[None, :] & (np.abs(first) >= TINY)
                & np.isfinite(first) & (np.abs(plain.astype(np.float64)) >= TINY) & np.isfinite(plain))
    assert ordinary.sum() > n * n // 2
    np.testing.assert_array_equal(got[ordinary], plain[ordinary].astype(np.float64))


@pytest.mark.parametrize("weights", ["float", "quantized once", "static scales", "both operands quantized once"])
def test_a_following_add_reads_the_rounded_result(weights):
    """The rewritten dot's float32 result is rounded before the program adds to it: XLA:CPU fuses the epilogue's
    last multiply with a following add into one multiply-add, and that multiply is a power of two (1 for every
    ordinary scale), exact, so the multiply-add rounds as the add alone. An epilogue ending in a scale's factor
    would skip the product's rounding there (a quarter of the outputs off by an ulp, tried)."""
    rng = np.random.default_rng(4)
    params = {"x": jnp.asarray(rng.normal(size=(64, 256)), jnp.float32),
              "w": jnp.asarray(rng.normal(size=(256, 512)) / 16, jnp.float32)}
    bias = jnp.asarray(rng.normal(size=512), jnp.float32)
    dot = lambda p, x: x @ p["w"]  # noqa: E731
    if weights == "both operands quantized once":  # the activation is a parameter too
        dot = lambda p, x: p["x"] @ p["w"]  # noqa: E731
        params = quantize_params(dot, params, params["x"])
        assert is_quantized(params["x"]) and is_quantized(params["w"])
    elif weights != "float":
        static = {"activations": "static"} if weights == "static scales" else {}
        params = quantize_params(dot, params, params["x"], **static)
        assert (params["w"].activation_scale is not None) == bool(static)
    x = jnp.asarray(rng.normal(size=(64, 256)), jnp.float32)
    product = np.asarray(jax.jit(int8ify(dot))(params, x))
    with_bias = jax.jit(int8ify(lambda p, x: dot(p, x) + bias))(params, x)
    np.testing.assert_array_equal(with_bias, product + np.asarray(bias))
