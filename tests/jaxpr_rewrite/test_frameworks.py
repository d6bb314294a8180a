"""int8ify on real framework code: Flax linen, Flax nnx, Equinox modules, and an optax training step."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_all_dots_int8, dot_eqns
from jaxpr_rewrite import Int8ifyError, int8ify, quantize_params

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


def test_flax_nnx_kv_cache_decoding_keeps_the_cache_it_updates():
    """An nnx module passed as it is updates its variables in place (here its KV cache): int8ify carries the
    updates out of the traced program into the caller's module, eagerly and inside nnx.jit, so each decoding step
    reads the keys and values of the steps before (without that, every step saw an empty cache: error ~1.2)."""
    nnx = pytest.importorskip("flax.nnx")
    batch, length, width = 2, 8, 128
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, length, width))
    attention = nnx.MultiHeadAttention(num_heads=4, in_features=width, decode=True, rngs=nnx.Rngs(0))

    def decode(step):
        attention.init_cache((batch, length, width))
        out = jnp.concatenate([step(attention, x[:, i:i + 1]) for i in range(length)], axis=1)
        assert int(attention.cache_index[...]) == length
        return out

    want = decode(lambda m, t: m(t))
    eager = decode(int8ify(lambda m, t: m(t)))
    jitted = decode(nnx.jit(int8ify(lambda m, t: m(t))))
    assert rel_error(eager, want) < 0.03 and rel_error(jitted, want) < 0.03
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-5, atol=1e-6)
    assert_all_dots_int8(jax.make_jaxpr(int8ify(lambda m, t: m(t)))(attention, x[:, :1]), 6)


def test_flax_nnx_training_step_updates_batch_statistics_and_rng_counts():
    """nnx.jit + nnx.value_and_grad + nnx.Optimizer around an int8ified call: BatchNorm's running statistics and
    Dropout's RNG counter advance as in the float step (they stayed at their initial values before)."""
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.fc1, self.bn = nnx.Linear(64, 128, rngs=rngs), nnx.BatchNorm(128, rngs=rngs)
            self.drop, self.fc2 = nnx.Dropout(0.5, rngs=rngs), nnx.Linear(128, 10, rngs=rngs)

        def __call__(self, x):
            return self.fc2(self.drop(nnx.relu(self.bn(self.fc1(x)))))

    x, y = jax.random.normal(jax.random.PRNGKey(0), (32, 64)), jnp.arange(32) % 10
    trained = {}
    for name, wrap in [("float", lambda f: f), ("int8", int8ify)]:
        model = Net(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, x, y, wrap=wrap):
            def loss(model):
                logits = wrap(lambda m, x: m(x))(model, x)
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

            value, grads = nnx.value_and_grad(loss)(model)
            optimizer.update(model, grads)
            return value

        for _ in range(3):
            step(model, optimizer, x, y)
        trained[name] = model
    float_model, int8_model = trained["float"], trained["int8"]
    assert int(int8_model.drop.rngs.count[...]) == int(float_model.drop.rngs.count[...]) == 3
    assert float(jnp.abs(float_model.bn.mean[...]).sum()) > 0.1
    assert rel_error(int8_model.bn.mean[...], float_model.bn.mean[...]) < 0.03
    assert rel_error(int8_model.bn.var[...], float_model.bn.var[...]) < 0.03


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


def test_an_equinox_step_returning_its_model_gets_its_quantized_weights_back():
    """The Equinox pattern ``return out, model`` (the model's KV cache updated): ``quantize_params`` of the step
    quantizes the weights it returns as they are, and each call, jitted or eager, gives them back quantized, the
    same codes and bytes, so the next call computes what a model rebuilt from the first weights would."""
    eqx = pytest.importorskip("equinox")
    from jaxpr_rewrite.quantized import QuantizedArray

    class Decoder(eqx.Module):
        w_in: jax.Array
        w_out: jax.Array
        cache: jax.Array

        def __call__(self, x, pos):
            h = jax.nn.relu(x @ self.w_in)
            cache = self.cache.at[pos].set(h[0])
            return h @ self.w_out + cache.mean(0), eqx.tree_at(lambda m: m.cache, self, cache)

    rng = np.random.default_rng(3)
    model = Decoder(jnp.asarray(rng.normal(size=(256, 512)) / 16, jnp.float32),
                    jnp.asarray(rng.normal(size=(512, 512)) / 22, jnp.float32), jnp.zeros((8, 512)))
    x = jnp.asarray(rng.normal(size=(4, 256)), jnp.float32)

    def step(model, x, pos):
        return model(x, pos)

    quantized, why = quantize_params(step, model, x, 0, explain=True)
    assert isinstance(quantized.w_in, QuantizedArray) and isinstance(quantized.w_out, QuantizedArray), why
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(quantized))
    for call in (eqx.filter_jit(int8ify(step)), int8ify(step)):
        fed_back = quantized
        for pos in range(3):
            rebuilt = eqx.tree_at(lambda m: m.cache, quantized, fed_back.cache)
            want, _ = int8ify(step)(rebuilt, x, pos)
            got, fed_back = call(fed_back, x, pos)
            for name in ("w_in", "w_out"):
                back, first = getattr(fed_back, name), getattr(quantized, name)
                assert isinstance(back, QuantizedArray), (name, pos)
                np.testing.assert_array_equal(np.asarray(back.codes), np.asarray(first.codes))
            assert sum(leaf.nbytes for leaf in jax.tree.leaves(fed_back)) == nbytes
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_weight_returned_transposed_stays_float():
    """Only a leaf returned as it is comes back quantized; ``w.T`` returned is a float value of the weight."""
    w = jnp.asarray(np.random.default_rng(4).normal(size=(128, 64)), jnp.float32)
    _, why = quantize_params(lambda p, x: (x @ p["w"], p["w"].T), {"w": w}, jnp.ones((4, 128)), explain=True)
    assert why["['w']"] == "kept float: it is returned"


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
    from jaxpr_rewrite import _api as api

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


def test_modules_passed_the_wrong_way_get_the_way_that_works():
    """A quantized Equinox module called as the function itself, and @int8ify on a Flax linen method: each error
    says how to pass the module instead (they named Equinox's own line, or only that a module is not hashable)."""
    eqx = pytest.importorskip("equinox")
    nn = pytest.importorskip("flax.linen")
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 128))
    linear = eqx.nn.Linear(128, 64, key=jax.random.PRNGKey(1))
    quantized = quantize_params(lambda m, x: jax.vmap(m)(x), linear, x)
    with pytest.raises(Int8ifyError, match=r"the function, a Linear, holds QuantizedArrays .* pass the module in, "
                                           r"int8ify\(lambda m, x: m\(x\)\)\(module, x\)"):
        jax.vmap(int8ify(quantized))(x)
    assert rel_error(int8ify(lambda m, x: jax.vmap(m)(x))(quantized, x), jax.vmap(linear)(x)) < 0.03

    class Dense(nn.Module):
        @int8ify
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(x)

    with pytest.raises(Int8ifyError, match=r"not hashable .*int8ify the function of its variables, "
                                           r"int8ify\(model.apply\)\(variables, x\)"):
        Dense().init(jax.random.PRNGKey(0), x)


def test_a_tied_flax_embedding_left_float_is_located_in_the_users_module():
    """Flax's Embed looks tokens up with a gather inside a jitted jnp.take, whose equations carry no user frame:
    the reason a tied embedding also read whole stays float named "<unknown location>"; it names the module's
    line now."""
    nn = pytest.importorskip("flax.linen")

    class Tied(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            embed = nn.Embed(256, 64)
            return embed.attend(embed(tokens)) + embed.embedding.mean()  # also read whole: kept float

    tokens = jnp.arange(16) % 256
    model = Tied()
    variables = model.init(jax.random.PRNGKey(0), tokens)
    _, why = quantize_params(model.apply, variables, tokens, explain=True)
    # the module's line where JAX records none inside jnp.take (Flax 0.12.8); Embed's own where it does (0.12.12)
    assert re.fullmatch(r"kept float: it is used by gather at .*\.py:\d+ \(.*(Tied|Embed)\.__call__\)",
                        why["['params']['Embed_0']['embedding']"])
