"""Eager calls quantize each float weight (a jax.Array) that comes back once, and reuse its codes while the
array lives."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpr_rewrite import api, int8ify

RNG = np.random.default_rng(11)


def mlp(params, x):
    h = jax.nn.gelu(x @ params["w1"] + params["b"])
    return h @ params["w2"]


def make_params(d=256, hidden=512):
    return {"w1": jnp.asarray(RNG.standard_normal((d, hidden)) / 16, jnp.float32),
            "w2": jnp.asarray(RNG.standard_normal((hidden, 64)) / 20, jnp.float32),
            "b": jnp.asarray(RNG.standard_normal(hidden), jnp.float32)}


@pytest.fixture
def quantizations(monkeypatch):
    calls = []
    original = api.quantized_weight

    def counting(value, uses):
        calls.append(value.shape)
        return original(value, uses)

    monkeypatch.setattr(api, "quantized_weight", counting)
    return calls


def test_the_same_weights_are_quantized_once_and_give_the_same_numbers(quantizations):
    params = make_params()
    wrapped = int8ify(mlp, min_contracting_size=1)
    per_call = jax.jit(wrapped)  # under jit the weights are quantized inside the program, every call
    for _ in range(3):
        x = jnp.asarray(RNG.standard_normal((32, 256)), jnp.float32)
        np.testing.assert_array_equal(np.asarray(wrapped(params, x)), np.asarray(per_call(params, x)))
    # w1 and w2, once each, on their second call; the bias is no matmul operand; each x is new
    assert sorted(quantizations) == [(256, 512), (512, 64)]
    fresh, x = make_params(), jnp.asarray(RNG.standard_normal((32, 256)), jnp.float32)
    wrapped(fresh, x)
    assert len(quantizations) == 2
    wrapped(fresh, x)  # x came back too: its codes are reused as well, with the same numbers
    assert sorted(quantizations[2:]) == [(32, 256), (256, 512), (512, 64)]
    np.testing.assert_array_equal(np.asarray(wrapped(fresh, x)), np.asarray(per_call(fresh, x)))


def test_a_weight_is_forgotten_with_its_array(quantizations):
    wrapped = int8ify(mlp, min_contracting_size=2)
    params = make_params()
    x = jnp.ones((8, 256))
    wrapped(params, x)
    wrapped(params, x)
    entries = wrapped._weights._entries
    assert len(entries) == 3 and quantizations  # w1, w2 and x
    del params, x
    gc.collect()
    assert len(entries) == 0


def test_numpy_weights_are_quantized_every_call(quantizations):
    """A numpy array can change in place between calls: its codes are never reused."""
    params = {k: np.array(v) for k, v in make_params().items()}
    wrapped = int8ify(mlp, min_contracting_size=3)
    x = jnp.asarray(RNG.standard_normal((16, 256)), jnp.float32)
    before = np.asarray(wrapped(params, x))
    params["w2"] *= 2  # in place
    after = np.asarray(wrapped(params, x))
    np.testing.assert_allclose(after, 2 * before, rtol=1e-5, atol=1e-6)
    assert quantizations == [(16, 256)]  # only x, a jax.Array passed twice
