"""int8ify as a wrapper: composition with JAX transforms, pytrees, kwargs, static arguments, caching."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_all_dots_int8, away_from_ties, reference_dot
from jaxpr_rewrite import Int8ifyError, int8ify

MATMUL = (((1,), (0,)), ((), ()))
rng = np.random.default_rng(3)
X = away_from_ties(rng.normal(size=(4, 8)), (1,))
W = away_from_ties(rng.normal(size=(8, 5)), (0,))
WANT = reference_dot(X, W, MATMUL)


def matmul(x, w):
    return x @ w


@pytest.mark.parametrize(
    "make",
    [
        lambda: int8ify(matmul),
        lambda: jax.jit(int8ify(matmul)),
        lambda: int8ify(jax.jit(matmul)),
        lambda: jax.jit(int8ify(jax.jit(matmul))),
        lambda: int8ify(int8ify(matmul)),
    ],
    ids=["eager", "jit(int8ify)", "int8ify(jit)", "jit(int8ify(jit))", "int8ify(int8ify)"],
)
def test_compositions_give_the_contract(make):
    fn = make()
    assert_all_dots_int8(jax.make_jaxpr(fn)(X, W), 1)
    np.testing.assert_allclose(np.asarray(fn(X, W), np.float64), WANT, rtol=1e-6)


def test_vmap_of_int8ify_quantizes_per_example():
    xs = np.stack([X, 3 * X, 0 * X])
    got = jax.vmap(int8ify(matmul), in_axes=(0, None))(xs, W)
    for i, x in enumerate(xs):
        np.testing.assert_allclose(np.asarray(got[i], np.float64), reference_dot(x, W, MATMUL), rtol=1e-6)
    assert np.all(np.asarray(got[2]) == 0)


def test_grad_is_straight_through():
    """grad of a single-dot loss equals the float gradient (the backward pass is the float dot's)."""
    loss = lambda x, w: jnp.sum(jnp.sin(matmul(x, w)))  # noqa: E731
    int8_loss = lambda x, w: jnp.sum(jnp.sin(int8ify(matmul)(x, w)))  # noqa: E731
    gx, gw = jax.grad(int8_loss, argnums=(0, 1))(X, W)
    # the cotangent flows through sin at the *int8* output; the dot's own transpose is the float one
    g_out = np.cos(np.asarray(int8ify(matmul)(X, W)))
    np.testing.assert_allclose(gx, g_out @ W.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gw, X.T @ g_out, rtol=1e-5, atol=1e-6)
    # for a linear loss it is exactly the float gradient
    lin = lambda w: jnp.sum(matmul(X, w))  # noqa: E731
    np.testing.assert_allclose(jax.grad(lambda w: jnp.sum(int8ify(matmul)(X, w)))(W), jax.grad(lin)(W), rtol=1e-6)
    del loss


def test_grad_of_jit_of_int8ify_and_jvp():
    f = jax.jit(int8ify(matmul))
    np.testing.assert_allclose(jax.grad(lambda w: f(X, w).sum())(W), X.T @ np.ones((4, 5)), rtol=1e-5)
    primal, tangent = jax.jvp(lambda x: int8ify(matmul)(x, W), (X,), (np.ones_like(X),))
    np.testing.assert_allclose(primal, WANT, rtol=1e-6)
    np.testing.assert_allclose(tangent, np.ones_like(X) @ W, rtol=1e-5)


def test_pytrees_and_kwargs_in_and_out():
    @int8ify
    def f(params, x, *, scale=1.0):
        h = x @ params["layers"][0]["w"]
        return {"out": h * scale, "aux": (h.sum(), None)}

    params = {"layers": [{"w": W}]}
    out = f(params, X, scale=2.0)
    np.testing.assert_allclose(np.asarray(out["out"], np.float64), 2 * WANT, rtol=1e-6)
    assert out["aux"][1] is None
    assert_all_dots_int8(jax.make_jaxpr(lambda p, x: f(p, x, scale=2.0))(params, X), 1)


def test_static_argnums_and_argnames():
    calls = []

    def f(x, w, activation, transpose=False):
        calls.append(1)
        y = (x @ w).T if transpose else x @ w
        return getattr(jax.nn, activation)(y)

    g = int8ify(f, static_argnums=(2,), static_argnames=("transpose",))
    a = g(X, W, "relu", transpose=True)
    b = g(X, W, "relu", transpose=True)
    assert a.shape == (5, 4) and len(calls) == 1  # cached per signature: traced once
    g(X, W, "relu", transpose=False)
    assert len(calls) == 2
    np.testing.assert_allclose(np.asarray(b, np.float64), np.maximum(WANT.T, 0), rtol=1e-6)
    # by name and by position mean the same argument
    h = int8ify(f, static_argnames=("activation", "transpose"))
    np.testing.assert_allclose(h(X, W, "relu", True), a)


def test_decorator_with_options_and_method():
    class Model:
        def __init__(self, w):
            self.w = w

        @int8ify(static_argnums=(0,))
        def __call__(self, x):
            return x @ self.w

        def __hash__(self):
            return id(self)

    m = Model(W)
    np.testing.assert_allclose(np.asarray(m(X), np.float64), WANT, rtol=1e-6)


def test_non_array_leaves_are_static_like_filter_jit():
    @int8ify
    def f(layer, x):
        return layer["act"](x @ layer["w"])

    out = f({"w": W, "act": jax.nn.relu}, X)
    np.testing.assert_allclose(np.asarray(out, np.float64), np.maximum(WANT, 0), rtol=1e-6)


def test_eager_calls_are_cached_not_retraced():
    traces = []

    @int8ify
    def f(x, w):
        traces.append(1)
        return x @ w

    for _ in range(5):
        f(X, W)
    assert len(traces) == 1
    f(X[:2], W)  # a new shape is a new signature
    assert len(traces) == 2


def test_closure_over_an_outer_tracer():
    @jax.jit
    def outer(x, w):
        return int8ify(lambda x: x @ w)(x)

    np.testing.assert_allclose(np.asarray(outer(X, W), np.float64), WANT, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(outer(X, 2 * W), np.float64), 2 * WANT, rtol=1e-6)


def test_errors_are_clear():
    with pytest.raises(Int8ifyError, match="unknown int8ify option"):
        int8ify(matmul, granularty="per-tensor")
    with pytest.raises(Int8ifyError, match="not hashable"):
        int8ify(matmul, static_argnums=(1,))(X, [1, 2])
    with pytest.raises(Int8ifyError, match="static_argnames contains 'nope'"):
        int8ify(matmul, static_argnames=("nope",))
    with pytest.raises(Int8ifyError, match="expects a callable"):
        int8ify(3)
    with pytest.raises(Int8ifyError, match=r"complex operands \(complex64\[2,2\], complex64\[2,2\]\)"):
        int8ify(matmul)(jnp.ones((2, 2), jnp.complex64), jnp.ones((2, 2), jnp.complex64))
