"""The shared equation evaluator: new equations keep the source line they replace, values are dropped after
their last reader, and the rewrite's lazy custom_jvp rules share no mutable state across threads."""

import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_rewrite import int8ify
from jaxpr_rewrite._interpret.evaluate import evaluate


class Value:
    """A stand-in value the evaluator passes around without knowing what it is."""


def test_values_are_dropped_after_their_last_reader():
    closed = jax.make_jaxpr(lambda x: jnp.sin(jnp.cos(jnp.exp(x))) + 1.0)(1.0)
    alive = []

    def step(eqn, invals):
        gc.collect()
        alive.append([ref() is not None for ref in refs])
        out = Value()
        refs.append(weakref.ref(out))
        return [out]

    refs: list = []
    evaluate(closed.jaxpr, closed.consts, [Value()], step)
    # when the last equation runs, only its own input (the previous result) is still held
    assert alive[-1] == [False] * (len(refs) - 2) + [True]


def test_concurrent_gradients_of_one_cached_program():
    @jax.custom_jvp
    def dense(x, w):
        return x @ w

    @dense.defjvp
    def dense_jvp(primals, tangents):
        (x, w), (dx, dw) = primals, tangents
        return dense(x, w), dx @ w + x @ dw

    def model(x, w):
        with jax.named_scope("outer"):
            return jnp.tanh(dense(x, w)).sum()

    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(8, 32)).astype(np.float32), rng.normal(size=(32, 16)).astype(np.float32)
    f = int8ify(model)
    want = np.asarray(jax.grad(f, argnums=1)(x, w))
    results, errors = [], []

    def work():
        try:
            for _ in range(5):
                results.append(np.asarray(jax.grad(f, argnums=1)(x, w)))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 20
    for got in results:
        np.testing.assert_array_equal(got, want)
    assert not hasattr(next(iter(f._programs.values())).rewriter, "scope")  # no shared "current scope"
