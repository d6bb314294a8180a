"""Eager calls quantize each float weight (a jax.Array) that comes back once, and reuse its codes while the
array lives."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import is_max_reduction
from jaxpr_rewrite import calibrate_activation_dots, int8ify, quantize_params
from jaxpr_rewrite import _api as api
from jaxpr_rewrite._core.jaxprs import iter_eqns

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


def test_weights_a_function_closes_over_are_quantized_once_when_traced(quantizations):
    """The arrays a function closes over are constants of its program: each weight among them is quantized once,
    when the program is traced (under an enclosing jit too), and the program holds its int8 codes, with the numbers
    of the same weights passed as arguments, bit for bit. No absmax of a weight is left in it for XLA to fold at
    compile time (about a second per million weights on CPU). The bias, no matmul operand, stays float."""
    params = make_params()
    closed = int8ify(lambda x: mlp(params, x), min_contracting_size=4)
    passed = jax.jit(int8ify(mlp, min_contracting_size=4))
    x = jnp.asarray(RNG.standard_normal((32, 256)), jnp.float32)
    want = np.asarray(passed(params, x))
    np.testing.assert_array_equal(np.asarray(jax.jit(closed)(x)), want)
    np.testing.assert_array_equal(np.asarray(closed(x)), want)
    assert sorted(quantizations) == [(256, 512), (512, 64)]  # once, for every call and trace above
    closed(x[:8])  # another call signature, another program: the same codes
    assert len(quantizations) == 2
    jaxpr = closed.rewritten_jaxpr(x)
    absmax_inputs = {e.invars[0].aval.shape for e in iter_eqns(jaxpr.jaxpr) if is_max_reduction(e)}
    assert absmax_inputs == {(32, 256), (32, 512)}  # the activations' alone
    assert {c.shape for c in jaxpr.consts if c.dtype == np.int8} == {(256, 512), (512, 64)}
    assert not [c for c in jaxpr.consts if c.shape in {(256, 512), (512, 64)} and c.dtype == np.float32]


def test_derivatives_through_closed_over_weights_are_those_of_pre_quantized_ones():
    """A closed-over weight is a pre-quantized one: the straight-through derivative of its matmul is the float
    matmul's at the weight's value inside the dot, as with quantize_params, bit for bit."""
    params = make_params()
    x = jnp.asarray(RNG.standard_normal((16, 256)), jnp.float32)
    closed = int8ify(lambda v: mlp(params, v), min_contracting_size=5)
    passed = int8ify(mlp, min_contracting_size=5)
    qparams = quantize_params(passed, params, x)
    got = jax.grad(lambda v: closed(v).sum())(x)
    want = jax.grad(lambda v: passed(qparams, v).sum())(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.all(np.isfinite(np.asarray(got)))


def _scan_layers(params, x):
    def layer(h, w):
        return jax.nn.relu(h @ w), None
    return jax.lax.scan(layer, x, params["stack"])[0]


def _decode_loop(params, x):
    return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ params["w"]), x)


def _bfloat16_layer(params, x):
    return (x.astype(jnp.bfloat16) @ params["w"].astype(jnp.bfloat16)).astype(jnp.float32)


def _remat_and_cond(params, x):
    h = jax.checkpoint(lambda v: jnp.tanh(v @ params["w"]))(x)
    return jax.lax.cond(h.sum() > 0, lambda v: v @ params["w"], lambda v: -(v @ params["w"]), h)


def _jitted_helper(params, x):
    return jax.jit(lambda v: jax.nn.relu(v @ params["w"]))(x)  # closing over the weight, a constant of its own jaxpr


def _weight_used_elsewhere(params, x):
    return x @ params["w"] + params["w"][0]  # (a sum of a constant would be folded in another order than run)


def _two_contractions(params, x):
    return (x @ params["w"]) @ params["w"].T


@pytest.mark.parametrize("fn, quantized", [
    (_scan_layers, 1), (_decode_loop, 1), (_bfloat16_layer, 1), (_remat_and_cond, 1), (_jitted_helper, 1),
    (_weight_used_elsewhere, 0), (_two_contractions, 0),
])
def test_closed_over_weights_anywhere_in_the_program(fn, quantized, quantizations):
    """Weights closed over by a scan over stacked layers, a decode loop, a cast, remat and cond, or by a jitted
    function called inside, are quantized once when traced; one also used other than as a matmul operand, or
    contracted along two axes, stays float, as quantize_params keeps it. Either way the numbers are those of the
    weights passed as arguments, bit for bit."""
    params = {"w": jnp.asarray(RNG.standard_normal((128, 128)) / 12, jnp.float32)}
    params["stack"] = jnp.stack([params["w"], 2 * params["w"]])
    x = jnp.asarray(RNG.standard_normal((16, 128)), jnp.float32)
    want = np.asarray(jax.jit(int8ify(fn, min_contracting_size=6))(params, x))
    got = np.asarray(jax.jit(int8ify(lambda v: fn(params, v), min_contracting_size=6))(x))
    np.testing.assert_array_equal(got, want)
    assert len(quantizations) == quantized


@pytest.mark.parametrize("how", ["static", "smoothed", "calibrated activation dot"])
def test_an_activation_passed_again_keeps_the_scales_its_dots_read_it_with(how, quantizations):
    """The same input array passed again is quantized once like a weight, with its dynamic scales: right where a
    dot reads it so, wrong where it reads it through a weight's static scale or SmoothQuant factors, or the
    calibrated scales of a dot between two activations. The second eager call of a static-scale model took the
    dynamic scales (0.8 off the first call's numbers) until such calls stopped replacing any input."""
    params = make_params()
    x = jnp.asarray(RNG.standard_normal((32, 256)), jnp.float32)
    if how == "calibrated activation dot":  # the weight w2 after it is still quantized once
        fn, args = (lambda p, a, b: (a @ b) @ p["w2"]), ({"w2": params["w2"]}, x, params["w1"])
        wrapped = int8ify(fn, activation_scales=calibrate_activation_dots(fn, *args), min_contracting_size=7)
    else:
        wrapped = int8ify(mlp, min_contracting_size=7)
        options = {"activations": "static"} if how == "static" else {"smooth_alpha": 0.5}
        args = (quantize_params(wrapped, params, x, **options), x)
    want = np.asarray(jax.jit(wrapped)(*args))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(wrapped(*args)), want)
    assert quantizations == ([(512, 64)] if how == "calibrated activation dot" else [])


@pytest.mark.parametrize("how", ["static", "smoothed"])
def test_an_activation_closed_over_keeps_the_scales_its_dots_read_it_with(how, quantizations):
    """A constant is quantized ahead like a weight, with its dynamic scales; a closed-over activation meeting a
    weight with a static scale or SmoothQuant factors took them instead of the weight's (0.8 off the numbers of
    the same activation passed as an argument)."""
    params = make_params()
    x = jnp.asarray(RNG.standard_normal((32, 256)), jnp.float32)
    wrapped = int8ify(mlp, min_contracting_size=8)
    options = {"activations": "static"} if how == "static" else {"smooth_alpha": 0.5}
    qparams = quantize_params(wrapped, params, x, **options)
    want = np.asarray(jax.jit(wrapped)(qparams, x))
    closed = int8ify(lambda p: mlp(p, x), min_contracting_size=8)
    np.testing.assert_array_equal(np.asarray(jax.jit(closed)(qparams)), want)
    np.testing.assert_array_equal(np.asarray(closed(qparams)), want)
    assert quantizations == []
