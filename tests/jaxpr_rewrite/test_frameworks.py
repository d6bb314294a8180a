"""int8ify on real framework code: Flax linen, Flax nnx, Equinox modules, and an optax training step."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_all_dots_int8, dot_eqns
from jaxpr_rewrite import int8ify

X = jax.random.normal(jax.random.PRNGKey(0), (8, 16))


def rel_error(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_flax_linen_apply():
    nn = pytest.importorskip("flax.linen")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.relu(nn.Dense(32)(x))
            x = nn.Dropout(0.5, deterministic=not train)(x)
            return nn.Dense(4)(x)

    model = MLP()
    variables = model.init(jax.random.PRNGKey(1), X)
    apply = int8ify(model.apply, static_argnames=("train",))
    assert_all_dots_int8(jax.make_jaxpr(lambda v, x: apply(v, x, train=False))(variables, X), 2)
    out = jax.jit(apply, static_argnames=("train",))(variables, X, train=False)
    assert rel_error(out, model.apply(variables, X)) < 0.03


def test_flax_nnx_module_call():
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(16, 32, rngs=rngs)
            self.l2 = nnx.Linear(32, 4, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    model = MLP(nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @int8ify
    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    assert_all_dots_int8(jax.make_jaxpr(forward)(state, X), 2)
    assert rel_error(jax.jit(forward)(state, X), model(X)) < 0.03


def test_equinox_module_with_static_leaves():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(16, 4, width_size=32, depth=2, activation=jax.nn.gelu, key=jax.random.PRNGKey(2))

    # The module holds non-array leaves (the activation function, ints): static, as with eqx.filter_jit.
    forward = int8ify(lambda model, x: jax.vmap(model)(x))
    out = forward(model, X)
    assert rel_error(out, jax.vmap(model)(X)) < 0.03
    # and under eqx.filter_jit
    out_jit = eqx.filter_jit(forward)(model, X)
    np.testing.assert_allclose(out_jit, out, rtol=1e-6, atol=1e-6)
    # the module called directly, as a wrapped callable
    out_direct = int8ify(model)(X[0])
    assert rel_error(out_direct, model(X[0])) < 0.03


def test_equinox_rewritten_program_has_only_int8_dots():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.Linear(16, 4, key=jax.random.PRNGKey(3))
    params, static = eqx.partition(model, eqx.is_array)

    @int8ify
    def forward(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    assert_all_dots_int8(jax.make_jaxpr(forward)(params, X), 1)


def test_optax_training_step_with_straight_through_gradients():
    optax = pytest.importorskip("optax")
    key = jax.random.PRNGKey(4)
    true_w = jax.random.normal(key, (16, 4))
    y = X @ true_w
    params = {"w": jnp.zeros((16, 4)), "b": jnp.zeros((4,))}
    optimizer = optax.adam(0.05)
    opt_state = optimizer.init(params)

    def loss_fn(params, x, y):
        pred = x @ params["w"] + params["b"]
        return jnp.mean((pred - y) ** 2)

    int8_loss = int8ify(loss_fn)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(int8_loss)(params, X, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # the gradient is non-zero (straight-through, not through round) and close to the float one
    g_int8 = jax.grad(int8_loss)(params, X, y)
    g_float = jax.grad(loss_fn)(params, X, y)
    assert rel_error(g_int8["w"], g_float["w"]) < 0.05
    losses = []
    for _ in range(150):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert losses[-1] < 0.05 * losses[0], losses[::30]
    # the training step's forward pass runs int8: its first dot (before the transpose) is int8
    jaxpr = jax.make_jaxpr(lambda p: jax.value_and_grad(int8_loss)(p, X, y))(params)
    dots = dot_eqns(jaxpr)
    assert any(str(d.invars[0].aval.dtype) == "int8" for d in dots)


def test_flax_attention_passed_as_it_is_reports_flax_lines_and_takes_static_attention_scales():
    nn = pytest.importorskip("flax.linen")
    from jaxpr_rewrite import calibrate_activation_dots, quantize_params, report

    model = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=128)
    x = jax.random.normal(jax.random.PRNGKey(3), (4, 32, 128))
    variables = model.init(jax.random.PRNGKey(4), x)
    # JAX leaves Flax's frames out of an equation's user frame; with model.apply passed straight in, that would
    # be int8ify's own call of it, so the rows point at Flax's line instead
    rows = report(model.apply, variables, x).rows
    assert [(Path(r.file).name, r.function) for r in rows] == [("linear.py", "DenseGeneral.__call__")] * 3 + [
        ("attention.py", "dot_product_attention_weights"), ("attention.py", "dot_product_attention"),
        ("linear.py", "DenseGeneral.__call__")]
    scales = calibrate_activation_dots(model.apply, variables, x)
    assert [d.position for d in scales.dots] == [3, 4] and "attention.py" in scales.dots[0].source
    static = quantize_params(model.apply, variables, x, activations="static")
    out = jax.jit(int8ify(model.apply, activation_scales=scales))(static, x)
    assert rel_error(out, model.apply(variables, x)) < 0.06


def test_equinox_attention_takes_static_attention_scales():
    eqx = pytest.importorskip("equinox")
    from jaxpr_rewrite import calibrate_activation_dots

    attention = eqx.nn.MultiheadAttention(4, 128, key=jax.random.PRNGKey(5))
    params, static = eqx.partition(attention, eqx.is_array)

    def run(params, x):
        return eqx.combine(params, static)(x, x, x)

    x = jax.random.normal(jax.random.PRNGKey(6), (32, 128))
    scales = calibrate_activation_dots(run, params, x)
    assert len(scales.dots) == 2  # the vmapped heads' q.k and p.v
    out = int8ify(run, activation_scales=scales)(params, x)
    assert rel_error(out, run(params, x)) < 0.05


def test_weights_closed_over_by_flax_and_equinox_code_are_quantized_once(monkeypatch):
    """Serving code that closes over its weights (``lambda x: model.apply(variables, x)``, an Equinox module called
    as it is): each kernel is quantized once, when the program is traced, with the numbers of the weights passed
    as arguments, bit for bit."""
    nn, eqx = pytest.importorskip("flax.linen"), pytest.importorskip("equinox")
    from jaxpr_rewrite import api

    quantized = []
    original = api.quantized_weight
    monkeypatch.setattr(api, "quantized_weight",
                        lambda value, uses: quantized.append(value.shape) or original(value, uses))

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.gelu(nn.Dense(32)(x)))

    model = MLP()
    variables = model.init(jax.random.PRNGKey(5), X)
    got = jax.jit(int8ify(lambda x: model.apply(variables, x)))(X)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(int8ify(model.apply))(variables, X)))
    assert sorted(quantized) == [(16, 32), (32, 4)]

    module = eqx.nn.MLP(16, 4, width_size=32, depth=2, key=jax.random.PRNGKey(6))
    quantized.clear()
    got = jax.jit(int8ify(lambda x: jax.vmap(module)(x)))(X)
    want = eqx.filter_jit(int8ify(lambda m, x: jax.vmap(m)(x)))(module, X)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert sorted(quantized) == [(4, 32), (32, 16), (32, 32)]
