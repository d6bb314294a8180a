"""int8ify as a wrapper: composition with JAX transforms, pytrees, kwargs, static arguments, caching."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_all_dots_int8, assert_close_to_reference, away_from_ties, dot_eqns, reference_dot
from jaxpr_rewrite import Int8ifyError, TracedValueError, int8ify, quantize_params
from jaxpr_rewrite._core.jaxprs import default_device_backend, default_platform

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


def test_programs_are_keyed_by_the_settings_they_are_traced_under():
    """A program traced without x64 is not reused under jax.enable_x64 (nor the other way): the same values and
    types as jax.jit, which keys its cache on those settings too, in either order."""
    float64_dot = jax.default_backend() != "tpu"  # a TPU has no float64 for the contract (the test below)

    def f(x, w):
        wide = (jnp.asarray(x, float) @ jnp.asarray(w, float),) if float64_dot else ()
        return (x @ w, jnp.arange(3)) + wide

    for first_x64 in (False, True):
        g = int8ify(f)
        for x64 in (first_x64, not first_x64, first_x64):
            with jax.enable_x64(x64):
                got, want = g(X, W), jax.jit(f)(X, W)
            assert [a.dtype for a in got] == [a.dtype for a in want], (first_x64, x64)
            np.testing.assert_allclose(np.asarray(got[0], np.float64), WANT, rtol=1e-6)


def test_state_updated_in_the_arguments_is_written_back_to_the_callers_objects():
    """A function that updates its arguments in place (a dict entry, a list item, an attribute) updates the
    caller's objects as the float function does, eagerly and under grad; where that cannot be carried out of the
    traced program, the error names the place."""
    class Box:  # a pytree node naming its child by attribute, as Flax NNX modules do
        def __init__(self, value):
            self.value = value

    jax.tree_util.register_pytree_with_keys(
        Box, lambda b: (((jax.tree_util.GetAttrKey("value"), b.value),), None), lambda _, c: Box(*c))

    def step(state, x, w):
        state["calls"] = state["calls"] + 1
        state["history"][0] = x @ w
        state["box"].value = state["box"].value + (x @ w).sum()
        return jnp.tanh(x @ w)

    def fresh():  # "box" starts as a Python number: a static leaf, which the call replaces by a traced value
        return {"calls": jnp.zeros((), jnp.int32), "history": [jnp.zeros((4, 5))], "box": Box(0.0)}

    want, got = fresh(), fresh()
    for _ in range(2):
        want_out, got_out = step(want, X, W), int8ify(step)(got, X, W)
    assert int(got["calls"]) == int(want["calls"]) == 2
    np.testing.assert_allclose(np.asarray(got["history"][0], np.float64), WANT, rtol=1e-6)
    np.testing.assert_allclose(float(got["box"].value), 2 * WANT.sum(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), rtol=0.05, atol=0.02)
    state = fresh()
    jax.grad(lambda x: int8ify(step)(state, x, W).sum())(X)
    assert isinstance(state["calls"], jax.Array) and int(state["calls"]) == 1  # concrete again after grad

    def grows(state, x):
        state["new"] = x @ W
        return x

    with pytest.raises(Int8ifyError, match=r"stores traced values into its arguments at argument 0 \['new'\] and "
                                           r"changes their structure"):
        int8ify(grows)({}, X)

    jax.tree_util.register_pytree_node(Pair := type("Pair", (), {}), lambda p: ((p.a,), None),
                                       lambda _, c: setattr(p := Pair(), "a", c[0]) or p)

    def unkeyed(pair, x):
        pair.a = x @ W
        return x

    pair = Pair()
    pair.a = jnp.zeros((4, 5))
    with pytest.raises(Int8ifyError, match=r"updates argument 0 \[<flat index 0>\] in place.*names its children "
                                           r"by position only"):
        int8ify(unkeyed)(pair, X)


def test_closure_over_an_outer_tracer():
    @jax.jit
    def outer(x, w):
        return int8ify(lambda x: x @ w)(x)

    np.testing.assert_allclose(np.asarray(outer(X, W), np.float64), WANT, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(outer(X, 2 * W), np.float64), 2 * WANT, rtol=1e-6)


def test_closed_over_weights_give_the_contract_and_a_quantized_one_gets_one_sentence():
    """A float weight closed over gives the contract (int8ify quantizes it once when it traces the program); a
    QuantizedArray closed over, which JAX cannot compute with, is named with the user's line and what works."""
    np.testing.assert_allclose(np.asarray(jax.jit(int8ify(lambda x: x @ jnp.asarray(W)))(X), np.float64), WANT,
                               rtol=1e-6)
    qparams = quantize_params(lambda w, x: x @ w, jnp.asarray(W), X)
    with pytest.raises(Int8ifyError, match=r"uses a QuantizedArray it does not take as an argument at "
                                           r".*test_api\.py:\d+ \(unsupported operand.*pass them in"):
        int8ify(lambda x: x @ qparams)(X)
    np.testing.assert_array_equal(np.asarray(int8ify(lambda w, x: x @ w)(qparams, X)),
                                  np.asarray(jax.jit(int8ify(lambda x: x @ jnp.asarray(W)))(X)))


def test_errors_are_clear():
    with pytest.raises(Int8ifyError, match="not hashable"):
        int8ify(matmul, static_argnums=(1,))(X, [1, 2])
    with pytest.raises(Int8ifyError, match="expects a callable"):
        int8ify(3)
    with pytest.raises(Int8ifyError, match=r"complex operands \(complex64\[2,2\], complex64\[2,2\]\)"):
        int8ify(matmul)(jnp.ones((2, 2), jnp.complex64), jnp.ones((2, 2), jnp.complex64))


def test_a_float64_dot_on_a_tpu_is_refused_with_what_to_do(monkeypatch):
    """A TPU has no IEEE float64 (XLA:TPU holds one as two float32s), and the contract's float64 scales come from
    float64 bits: its compiler rejected the program. On a TPU such a dot is refused when it is rewritten, naming
    the operands and the line; a float32 dot with a float64 result still is rewritten, and so is every dot on CPU,
    the TPU host's own under ``jax.default_device`` included."""
    def f(x, w):
        return jnp.asarray(x, float) @ jnp.asarray(w, float)

    def wide_result(x, w):
        return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float64)

    with jax.enable_x64(True):
        monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
        assert_all_dots_int8(int8ify(f).rewritten_jaxpr(X, W), expected_count=1)  # on CPU: rewritten
        monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
        with pytest.raises(Int8ifyError, match=r"dot_general at .*test_api\.py:\d+ .*has float64 operands "
                                               r"\(float64\[4,8\], float64\[8,5\]\) on a TPU.*cast the operands to "
                                               r"float32"):
            int8ify(f).rewritten_jaxpr(X, W)
        jaxpr = int8ify(wide_result).rewritten_jaxpr(X, W)
        # a TPU host's float64 work put on its CPU (jax.default_device) runs there: rewritten
        for device in (jax.devices("cpu")[0], "cpu"):
            with jax.default_device(device):
                assert_all_dots_int8(int8ify(f).rewritten_jaxpr(X, W), expected_count=1)
    assert jaxpr.out_avals[0].dtype == np.float64
    assert_all_dots_int8(jaxpr, expected_count=1)


# -- signatures, static values, options, errors, cache ------------------------------------------------------------
def test_static_values_are_keyed_by_type_and_value():
    """True == 1 and hash(True) == hash(1), but they are different programs, as for jax.jit."""
    g = int8ify(lambda x, w, flag: (x @ w) * (2 if flag is True else 3), static_argnums=2)
    np.testing.assert_allclose(g(X, W, True), 2 * np.asarray(g(X, W, 1)) / 3, rtol=1e-6)
    np.testing.assert_allclose(g(X, W, 1.0), g(X, W, 1), rtol=0)


def test_python_numbers_are_static_leaves():
    """Python ints/floats/bools are static, as with equinox.filter_jit: usable as shapes under jax.jit."""
    f = int8ify(lambda x, w, n: jnp.tile(x @ w, (n, 1)))
    assert f(X, W, 3).shape == (12, 5)
    assert jax.jit(int8ify(lambda x, w, n: jnp.tile(x @ w, (n, 1))), static_argnums=2)(X, W, 2).shape == (8, 5)
    eqx = pytest.importorskip("equinox")

    class Repeat(eqx.Module):
        w: jax.Array
        times: int

        def __call__(self, x):
            return jnp.tile(x @ self.w, (self.times, 1))

    assert eqx.filter_jit(int8ify(lambda m, x: m(x)))(Repeat(jnp.asarray(W), 3), X).shape == (12, 5)


@pytest.mark.parametrize("options, message", [
    ({"static_argnums": -4}, r"static_argnums=-4 is out of range for matmul\(x, w\), which takes 2"),
    ({"static_argnums": 2}, "static_argnums=2 is out of range"),
    ({"static_argnums": "x"}, "static_argnums must be ints"),
    ({"block_size": True}, "block_size must be an int"),
    ({"min_contracting_size": True}, "min_contracting_size must be a non-negative int"),
    ({"cache_size": 0}, "cache_size must be a positive int"),
])
def test_options_are_validated_when_wrapping(options, message):
    with pytest.raises(Int8ifyError, match=message):
        int8ify(matmul, **options)


def test_int8ify_of_none_is_rejected():
    with pytest.raises(Int8ifyError, match="expects a callable, got NoneType"):
        int8ify(None)
    assert callable(int8ify(skip="x"))  # the decorator form still works


def test_python_branch_on_a_traced_value_names_the_users_line():
    def f(x, w):
        y = x @ w
        if y.sum() > 0:  # BRANCH
            return y
        return -y

    line = f.__code__.co_firstlineno + 2
    for call in (lambda: int8ify(f)(X, W), lambda: jax.jit(int8ify(f))(X, W)):
        with pytest.raises(TracedValueError, match=rf"test_api.py:{line}: JX201 Python control flow") as info:
            call()
        assert info.value.code == "JX201" and info.value.line == line and "if y.sum() > 0" in info.value.text
    from jaxpr_rewrite import report

    with pytest.raises(TracedValueError, match=rf"test_api.py:{line}: JX201"):
        report(f, X, W)


def test_clear_errors_for_bad_inputs():
    from jaxpr_rewrite import QuantizedArray, quantize, quantize_params, verify
    from jaxpr_rewrite._quantized.array import ARRAY_FIELDS, METADATA_FIELDS

    q = quantize(jnp.asarray(W), (0,))
    bad = QuantizedArray(q.codes, q.scales[:2], q.exponents[:2], (0,), np.float32)
    with pytest.raises(Int8ifyError, match=r"malformed: scales have shape \(2,\), expected \(5,\)"):
        int8ify(lambda w, x: x @ w)(bad, X)
    # a well-formed array is checked once per pytree structure and leaf types; a malformed one of the same
    # structure differs in its leaves' shapes, so it is still checked and named after a good call
    apply = int8ify(lambda w, x: x @ w)
    apply(q, X)
    with pytest.raises(Int8ifyError, match=r"passed to <lambda> \(QuantizedArray\(i8\[8, 5\].*malformed: scales"):
        apply(bad, X)
    with pytest.raises(Int8ifyError, match=r"needs its dtype and either contracting \(axes\) or from_end .*got "
                                           r"contracting=None, from_end=None, dtype=<class 'numpy.float32'>"):
        QuantizedArray(q.codes, q.scales, q.exponents, dtype=np.float32)
    with pytest.raises(Int8ifyError, match=r"got contracting=\(0,\), from_end=\(-2,\), dtype=None"):
        QuantizedArray(q.codes, q.scales, q.exponents, (0,), from_end=(-2,))
    # what the pytree unflattening passes: every field by name, from_end as it is stored
    children, metadata = q.tree_flatten()
    rebuilt = QuantizedArray(**dict(zip(ARRAY_FIELDS, children)), **dict(zip(METADATA_FIELDS, metadata)))
    assert (rebuilt.from_end, rebuilt.contracting, rebuilt.dtype) == ((-2,), (0,), np.float32)
    with pytest.raises(Int8ifyError, match="verify expects the model function as its first argument, got int"):
        verify(42)
    with pytest.raises(Int8ifyError, match="quantize_params expects the model function as its first argument, "
                                           "got int"):
        quantize_params(3, {"w": W}, X)


@functools.lru_cache(maxsize=None)
def _fully_quantized():
    """A weight with every optional child present: SmoothQuant factors, stored epilogue factors, a static scale."""
    return quantize_params(lambda p, x: x @ p["w"], {"w": jnp.asarray(W)}, X, smooth_alpha=0.5,
                           activations="static")["w"]


# A child or static field replaced by what a hand-built QuantizedArray (``replace``, ``tree_unflatten``) may hold
# instead, the sentence that names it, and the one under jax.jit where that differs (jit makes a Python scalar leaf
# a 0-d array).
MALFORMED_PARTS = {
    "a Python float scale": ({"scales": 1.0}, r"scales is a float \(1.0\), not an array",
                             r"scales have shape \(\), expected \(5,\)"),
    "a list of codes": ({"codes": [[1, 2]]}, r"codes is a list \(\[\[1, 2\]\]\), not an array",
                        r"codes is a list, not an array"),  # of tracers, too long a repr to show
    "missing exponents": ({"exponents": None}, r"exponents is missing \(None\)"),
    "a Python float epilogue factor": ({"epilogue_factor": 2.0}, r"epilogue_factor is a float \(2.0\), not an array",
                                       r"epilogue_factor has shape \(\), expected \(5,\)"),
    "a Python float static scale": ({"activation_scale": 0.5}, r"activation_scale is a float \(0.5\), not an array",
                                    r"activation_scale has shape \(\), expected \(4,\)"),
    "exponents of another dtype": ({"exponents": np.zeros(5, np.int8)}, r"exponents are int8, not int32"),
    "a scalar smooth factor": ({"smooth": np.float32(2.0)}, r"smooth factors have shape \(\), expected \(8,\): one "
                                                            r"per index of the single contracting axis"),
    "a short static scale": ({"activation_scale": np.ones(3, np.float32)},
                             r"activation_scale has shape \(3,\), expected \(4,\)"),
    "a static scale per row": ({"activation_scale": np.ones((8, 4), np.float32)},
                               r"activation_scale has shape \(8, 4\), expected \(4,\)"),
    "an integer dtype": ({"dtype": np.int32}, r"dtype is int32, not a float dtype"),
    "4 bits without a length": ({"bits": 4}, r"length is None for 4-bit codes"),
    "a length on 8-bit codes": ({"length": 3}, r"length is 3 for 8-bit codes"),
    "an empty block": ({"block_size": 0}, r"block_size is 0, not a positive int"),
    "an axis beyond the codes": ({"from_end": (-3,)}, r"from_end is \(-3,\), not distinct contracting axes"),
    "a factor without its power": ({"epilogue_power": None}, r"epilogue_factor and epilogue_power are set together"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_PARTS))
@pytest.mark.parametrize("use", ["call", "jit", "check"])
def test_a_malformed_part_is_named_not_an_attribute_or_broadcast_error(case, use):
    q = _fully_quantized()
    assert all(getattr(q, name) is not None for name in ("smooth", "epilogue_factor", "activation_scale"))
    q.check()  # well formed as quantize_params made it
    changes, message, *message_under_jit = MALFORMED_PARTS[case]
    if use == "jit" and message_under_jit:
        (message,) = message_under_jit
    bad = q.replace(**changes)
    run = {"call": lambda: int8ify(lambda w, x: x @ w)(bad, X),
           "jit": lambda: jax.jit(int8ify(lambda w, x: x @ w))(bad, X),
           "check": lambda: bad.check()}[use]
    with pytest.raises(Int8ifyError, match="malformed: .*" + message):
        run()


def test_a_static_field_equal_in_value_but_not_in_type_is_checked_again():
    # length=64.0 compares and hashes equal to 64: the check of a well-formed array's structure must not vouch for it
    q = quantize_params(lambda p, x: x @ p["w"], {"w": jnp.asarray(W)}, X, bits=4)["w"]
    apply = int8ify(lambda w, x: x @ w)
    apply(q, X)
    with pytest.raises(Int8ifyError, match=r"length is 5.0, not a non-negative int"):
        apply(q.replace(length=float(q.length)), X)


def test_replace_names_what_it_cannot_set():
    q = _fully_quantized()
    with pytest.raises(Int8ifyError, match=r"no fields \['contracting'\] \(the contracting axes are from_end"):
        q.replace(contracting=(1,))
    with pytest.raises(Int8ifyError, match=r"dtype 'floaty' is not a dtype"):
        q.replace(dtype="floaty")
    assert q.replace(dtype="bfloat16").dtype == jnp.bfloat16  # a name reads as its dtype, as in the constructor
    with pytest.raises(Int8ifyError, match=r"astype\(int32\): its codes stand for a float array"):
        q.astype(jnp.int32)
    assert q.astype(jnp.float16).dtype == jnp.float16


def test_stacked_quantized_arrays_keep_their_optional_children_per_layer():
    # a tree_map of jnp.stack gives every child the stacked axis, smooth factors and static scale included;
    # lax.scan then slices one weight per step, as it does float weights
    q = _fully_quantized()
    stacked = jax.tree_util.tree_map(lambda a: jnp.stack([a, -a if a.dtype == jnp.int8 else a]), q)
    stacked.check()

    def layers(w, x):
        return jax.lax.scan(lambda total, wi: (total + jnp.tanh(x @ wi), x @ wi), jnp.zeros((4, 5)), w)

    per_layer = int8ify(layers)
    total, outputs = per_layer(stacked, X)
    once = int8ify(lambda w, x: x @ w)(q, X)
    assert np.array_equal(outputs, np.stack([once, -once]))  # the second layer's codes are negated
    np.testing.assert_allclose(total, 0.0, atol=1e-6)


@pytest.mark.parametrize("options", [{"smooth_alpha": 0.5}, {"activations": "static"}],
                         ids=["smoothed", "static scale"])
@pytest.mark.parametrize("use", ["int8ify(vmap)", "fori_loop index"])
def test_stacked_weights_met_all_at_once_follow_the_contract_on_their_values(options, use):
    # one dot meeting every stacked weight (int8ify(vmap)), or an index the rewrite cannot follow, cannot apply
    # per-weight smoothing or static scales: the dot measures its activation, the contract on each weight's value
    rng = np.random.default_rng(3)
    x = away_from_ties(rng.normal(size=(16, 64)), (1,))
    ws = [jnp.asarray(rng.normal(size=(64, 48)).astype(np.float32)) for _ in range(2)]
    quantized = [quantize_params(lambda p, x: x @ p["w"], {"w": w}, x, **options)["w"] for w in ws]
    groups = {"smooth_group": None, "activation_group": None}  # each quantize_params call has its own group
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[q.replace(**groups) for q in quantized])
    stacked.check()
    run = {
        "int8ify(vmap)": int8ify(jax.vmap(lambda w, x: x @ w, in_axes=(0, None))),
        "fori_loop index": int8ify(lambda w, x: jax.lax.fori_loop(
            0, 2, lambda i, out: out.at[i].set(x @ w[i]), jnp.zeros((2, 16, 48)))),
    }[use]
    got = run(stacked, x)
    for layer, q in enumerate(quantized):
        assert_close_to_reference(got[layer], reference_dot(x, np.asarray(q.materialise()), MATMUL))
    assert_all_dots_int8(jax.make_jaxpr(run)(stacked, x))


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
def test_arrays_on_different_devices_get_one_sentence():
    x = jax.device_put(X, jax.devices()[0])
    w = jax.device_put(W, jax.devices()[1])
    message = r"committed to different devices \(args\[0\] on \[0\], args\[1\] on \[1\]\)"
    with pytest.raises(Int8ifyError, match=message):
        int8ify(matmul)(x, w)


def test_program_cache_is_bounded_and_releases_programs():
    import gc
    import weakref

    f = int8ify(matmul, cache_size=4)
    first = None
    for rows in range(1, 7):  # six signatures through a cache of four
        f(X[:1].repeat(rows, 0), W)
        if rows == 1:
            (signature,) = f._programs
            first = weakref.ref(f._programs[signature].float_jaxpr)
    assert len(f._programs) == 4 and len(f._compiled) <= 4
    gc.collect()
    assert first() is None  # the evicted program (and its compiled executable) is gone
    # recently used signatures stay
    f(X[:1].repeat(6, 0), W)
    assert len(f._programs) == 4


def test_with_options_keeps_the_rest():
    g = int8ify(matmul, static_argnames=("w",), min_contracting_size=4).with_options(granularity="per-tensor")
    assert g.config.min_contracting_size == 4 and g.config.granularity == "per-tensor"
    assert g.static_argnames == ("w",) and g.static_argnums == (1,)
    with pytest.raises(Int8ifyError, match="unknown int8ify option"):
        g.with_options(granularty="per-tensor")


def test_float_and_rewritten_jaxprs_come_from_one_trace():
    traces = []

    def f(x, w):
        traces.append(1)  # runs once per trace of f
        return jnp.tanh(x @ w)

    wrapped = int8ify(f)
    x, w = jax.ShapeDtypeStruct((8, 64), jnp.float32), jax.ShapeDtypeStruct((64, 32), jnp.float32)
    before = wrapped.float_jaxpr(x, w)
    after = wrapped.rewritten_jaxpr(x, w)
    assert len(traces) == 1
    (dot,) = dot_eqns(before)
    assert [v.aval.dtype for v in dot.invars] == [jnp.float32, jnp.float32]
    assert_all_dots_int8(after, 1)
    assert [v.aval for v in before.jaxpr.invars] == [v.aval for v in after.jaxpr.invars]


def _dense(params, x):
    return x @ params["w"]


RNG_INLINE = np.random.default_rng(0)
W_INLINE = {"w": RNG_INLINE.standard_normal((64, 32)).astype(np.float32)}
X2 = RNG_INLINE.standard_normal((8, 64)).astype(np.float32)
X3 = RNG_INLINE.standard_normal((2, 4, 64)).astype(np.float32)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("choice", [None, False, True])
@pytest.mark.parametrize("case, late_on_cpu", [
    ("dynamic scales of a rank-3 activation", False),
    ("block-scaled", True),
    ("dynamic scales of a matrix", False),
    ("a static activation scale", False),
])
def test_rewritten_dots_are_inlined_late_on_cpu_where_jax_can_say_so(backend, choice, case, late_on_cpu,
                                                                     monkeypatch):
    """JAX 0.11+ can ask XLA to inline a call late (about half the compile time of a deep model on CPU); other
    backends, and older JAX, keep the default. On CPU a dot that quantizes an operand in its program (dynamic scales
    of a matrix or of a higher-rank activation, a static scale) keeps early inlining too: XLA:CPU runs it faster so,
    fused with what computes the operand; a block-scaled dot is inlined late. The late_inlining option overrides the
    default backend (a program traced on CPU to run elsewhere)."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    options = {"late_inlining": choice, **({"block_size": 32} if case == "block-scaled" else {})}
    wrapped = int8ify(_dense, **options)
    x = X3 if case == "dynamic scales of a rank-3 activation" else X2
    activations = "static" if case == "a static activation scale" else "dynamic"
    params = quantize_params(wrapped, W_INLINE, x, activations=activations) if case != "block-scaled" else W_INLINE
    jaxpr = wrapped.rewritten_jaxpr(params, x)
    (call,) = [e for e in jaxpr.jaxpr.eqns if e.params.get("name") == "int8_dot_general"]
    assert jaxpr.jaxpr.eqns == [call]  # choosing leaves nothing traced beside the call
    inline = getattr(jax, "Inline", None)
    if inline is None:  # before JAX 0.11 the param is a bool: inline into the caller's jaxpr or not
        assert call.params["inline"] is False
    else:
        late = (backend == "cpu" if choice is None else choice) and late_on_cpu
        assert call.params["inline"] == (inline.XLA_LATE if late else inline.AUTO)


def test_the_choices_made_for_a_backend_follow_jax_default_device(monkeypatch):
    """Where a program runs by default is the device ``jax.default_device`` sets, if any (a TPU host's float64 work
    put on its CPU): a block-scaled dot traced there is inlined late as on CPU, whatever the default backend, and
    the programs walked for that device are the CPU's (on a TPU host: not the first device's)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert default_device_backend() == "tpu"
    wrapped = int8ify(_dense, block_size=32)
    for device in (jax.devices("cpu")[0], "cpu"):
        with jax.default_device(device):
            assert default_device_backend() == default_platform() == "cpu"
            (call,) = [e for e in wrapped.rewritten_jaxpr(W_INLINE, X2).jaxpr.eqns
                       if e.params.get("name") == "int8_dot_general"]
        inline = getattr(jax, "Inline", None)
        assert call.params["inline"] == (False if inline is None else inline.XLA_LATE)
