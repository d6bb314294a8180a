"""Weights quantized once (quantize_params / QuantizedArray): same numbers as the dynamic path, bit for bit."""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (TPU_DIVISION_ULPS, approximate_division, assert_all_dots_int8, assert_close_to_reference,
                     assert_within_ulps, evaluate_as, is_max_reduction, platform_eqns, reference_dot)
from jaxpr_rewrite import (Int8ifyError, QuantizationWarning, QuantizedArray, dot_eqns, int8ify, iter_eqns,
                           quantize_params)
from jaxpr_rewrite._backends import int8 as int8_backend


@pytest.fixture(scope="module")
def mlp(load_example):
    """The example's Dense + gelu MLP."""
    return load_example("mlp.py").mlp


rng = np.random.default_rng(7)

PARAMS = [
    {"w": jnp.asarray(rng.normal(size=(32, 32)), jnp.float32), "b": jnp.asarray(rng.normal(size=32), jnp.float32)}
    for _ in range(3)
]
X = jnp.asarray(rng.normal(size=(8, 32)), jnp.float32)


def test_weights_become_quantized_and_biases_stay(mlp):
    q = quantize_params(mlp, PARAMS, X)
    for layer in q:
        assert isinstance(layer["w"], QuantizedArray) and layer["w"].codes.dtype == jnp.int8
        assert layer["w"].scales.shape == (32,) and layer["w"].contracting == (0,)
        assert not isinstance(layer["b"], QuantizedArray)


def test_bit_identical_to_dynamic_path(mlp):
    q = quantize_params(mlp, PARAMS, X)
    f = jax.jit(int8ify(mlp))
    np.testing.assert_array_equal(np.asarray(f(q, X)), np.asarray(f(PARAMS, X)))
    np.testing.assert_array_equal(np.asarray(int8ify(mlp)(q, X)), np.asarray(f(PARAMS, X)))  # eager too


def test_program_quantizes_only_activations(mlp):
    q = quantize_params(mlp, PARAMS, X)
    jaxpr = jax.make_jaxpr(int8ify(mlp))(q, X)
    assert_all_dots_int8(jaxpr, 3)
    # one absmax per dot, on every platform: the activation's; none for the weights
    for platform in ("cpu", "cuda", "tpu"):
        assert sum(is_max_reduction(e) for e in platform_eqns(jaxpr, platform)) == 3
    int8_inputs = [v for v in jaxpr.jaxpr.invars if v.aval.dtype == jnp.int8]
    assert len(int8_inputs) == 3


def _main_inputs(lowered) -> int:
    """How many inputs the lowered program's entry computation takes."""
    (signature,) = [line for line in lowered.as_text().splitlines() if "func.func public @main(" in line]
    return len(re.findall(r"%arg\d+: ", signature))


@pytest.mark.parametrize("options", [{}, {"activations": "static", "calibration": [(X,)]}, {"smooth_alpha": 0.5}],
                         ids=["dynamic", "static", "smoothed"])
def test_compiled_program_takes_only_the_arrays_its_dots_read(mlp, monkeypatch, options):
    """The int8 dots read a weight's codes, stored epilogue factors and static scale (the other operand is multiplied
    by a smoothed weight's stored reciprocals before its dot): its scales, exponents and smoothing factors are not
    inputs of the compiled program, whose outputs and straight-through gradient are those of the program handed
    every array, bit for bit."""
    q = quantize_params(mlp, PARAMS, X, **options)
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path((q, X))[0]]
    unread_fields = ("scales", "exponents", "smooth")
    unread = [path for path in paths if getattr(path[-1], "name", None) in unread_fields]
    assert len(unread) == (9 if "smooth_alpha" in options else 6)

    def compiled():  # a new wrapper each time: int8ify of the same function would be the cached one
        f = int8ify(lambda p, x: mlp(p, x))
        return (_main_inputs(jax.jit(f).lower(q, X)), np.asarray(jax.jit(f)(q, X)),
                np.asarray(jax.grad(lambda x: f(q, x).sum())(X)))

    inputs, out, grad = compiled()
    assert inputs == len(paths) - len(unread)
    monkeypatch.setattr(int8_backend, "_as_dots_read_it", lambda x: x)  # every array handed to the dots
    every_inputs, every_out, every_grad = compiled()
    assert every_inputs == len(paths)
    np.testing.assert_array_equal(out, every_out)
    np.testing.assert_array_equal(grad, every_grad)


def test_memory_is_about_a_quarter(mlp):
    params = [{"w": jnp.ones((512, 512)), "b": jnp.zeros(512)} for _ in range(2)]
    q = quantize_params(mlp, params, jnp.ones((1, 512)))
    total = lambda tree: sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree))  # noqa: E731
    assert total(q) / total(params) <= 0.27  # biases included


def test_leaf_used_outside_a_dot_stays_float():
    """A table read by a lookup, a dot and an elementwise op (not only lookups besides its matmuls) stays float,
    and the warning names the first use that keeps it so."""

    def tied(params, ids):
        emb = params["table"][ids]
        return emb @ params["table"].T + params["table"].mean()  # read whole: its float values are needed

    params = {"table": jnp.asarray(rng.normal(size=(10, 16)), jnp.float32)}
    ids = jnp.arange(4)
    with pytest.warns(QuantizationWarning, match=r"\['table'\]: it is used by gather at .*test_params.py"):
        q = quantize_params(tied, params, ids)
    assert not isinstance(q["table"], QuantizedArray)
    np.testing.assert_array_equal(int8ify(tied)(q, ids), int8ify(tied)(params, ids))


def test_leaf_used_with_two_contractions_stays_float():
    def two_ways(params, x, y):
        w = params["w"]
        return x @ w, w @ y  # contracting dim 0 and dim 1

    params = {"w": jnp.asarray(rng.normal(size=(16, 16)), jnp.float32)}
    x = jnp.ones((2, 16))
    with pytest.warns(QuantizationWarning, match=r"\['w'\]: its matmuls contract different axes"):
        q = quantize_params(two_ways, params, x, x.T)
    assert not isinstance(q["w"], QuantizedArray)


def test_quantized_array_passed_to_another_contraction_is_dequantized():
    """A QuantizedArray used where its scales do not fit is dequantized, not misread."""
    w = jnp.asarray(rng.normal(size=(16, 16)), jnp.float32)
    qa = quantize_params(lambda p, x: x @ p, w, jnp.ones((2, 16)))
    assert isinstance(qa, QuantizedArray)
    y = jnp.ones((16, 3))
    got = int8ify(lambda w, y: w @ y)(qa, y)  # w contracts its dim 1 here
    want = int8ify(lambda w, y: w @ y)(qa.materialise(), y)
    np.testing.assert_array_equal(got, want)
    # a non-dot use sees codes * scales
    np.testing.assert_allclose(int8ify(lambda w: w * 2)(qa), 2 * qa.materialise())


def test_options_are_respected(mlp):
    f = int8ify(mlp, min_contracting_size=64)  # every dot skipped: nothing to quantize
    q = quantize_params(f, PARAMS, X)
    assert not any(isinstance(layer["w"], QuantizedArray) for layer in q)
    with pytest.raises(Int8ifyError, match="already quantized"):
        quantize_params(mlp, quantize_params(mlp, PARAMS, X), X)


def test_gradient_wrt_activations_with_quantized_weights(mlp):
    q = quantize_params(mlp, PARAMS[:1], X)
    g = jax.grad(lambda x: int8ify(mlp)(q, x).sum())(X)  # its straight-through float dot at float32 (conftest)
    w_deq = np.asarray(q[0]["w"].materialise())
    np.testing.assert_allclose(g, np.ones((8, 32)) @ w_deq.T, rtol=1e-5)


def test_quantized_array_is_a_pytree():
    qa = quantize_params(lambda p, x: x @ p, PARAMS[0]["w"], X)
    leaves, tree = jax.tree_util.tree_flatten(qa)
    # codes, scales, exponents, and the epilogue factors quantize_params computes once
    assert [leaf.dtype for leaf in leaves] == [jnp.int8, jnp.float32, jnp.int32, jnp.float32, jnp.float32]
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert back.contracting == qa.contracting and back.dtype == qa.dtype
    assert "QuantizedArray(i8[32, 32]" in repr(qa)


def outlier_data():
    """Activations with two outlier channels (as LayerNorm outputs of transformers have)."""
    x = rng.normal(size=(64, 32)).astype(np.float32)
    x[:, [3, 17]] *= 40
    w = (rng.normal(size=(32, 16)) / 6).astype(np.float32)
    return jnp.asarray(x), {"w": jnp.asarray(w)}


def dense(params, x):
    return x @ params["w"]


def test_smoothing_matches_its_reference_and_cuts_the_error():
    from helpers import reference_dot

    x, params = outlier_data()
    q = quantize_params(dense, params, x, smooth_alpha=0.5)
    s = np.asarray(q["w"].smooth)
    # the factors: sqrt(max|x_k|) / sqrt(max|w_k|)
    want_s = np.sqrt(np.abs(np.asarray(x)).max(0)) / np.sqrt(np.abs(np.asarray(params["w"])).max(1))
    np.testing.assert_allclose(s, want_s, rtol=1e-5)
    got = np.asarray(jax.jit(int8ify(dense))(q, x), np.float64)
    # exactly the contract applied to (x * (1 / s)) and (s * w)
    x_s = (np.asarray(x) * (np.float32(1) / s.astype(np.float32))).astype(np.float32)
    w_s = (np.asarray(params["w"]) * s[:, None].astype(np.float32)).astype(np.float32)
    np.testing.assert_allclose(got, reference_dot(x_s, w_s, (((1,), (0,)), ((), ()))), rtol=1e-5)
    # and the outlier channels no longer dominate every token's scale
    exact = np.asarray(x, np.float64) @ np.asarray(params["w"], np.float64)
    plain = np.asarray(int8ify(dense)(params, x), np.float64)
    err = lambda y: np.linalg.norm(y - exact) / np.linalg.norm(exact)  # noqa: E731
    assert err(got) < 0.5 * err(plain), (err(got), err(plain))


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
def test_smoothing_factors_are_the_same_wherever_they_are_computed(alpha):
    """The factors are the float64 ``a**alpha / b**(1 - alpha)`` rounded once to float32 (computed on the host, so a
    checkpoint does not depend on the device's ``pow`` and division), bit for bit; a factor that is not a normal
    float32, or whose reciprocal is not, is 1, as for an all-zero or non-finite side."""
    from jaxpr_rewrite._ptq.params import smoothing_factors

    rng = np.random.default_rng(int(alpha * 10))
    a = (rng.uniform(1, 2, 4096) * 2.0 ** rng.integers(-40, 40, 4096)).astype(np.float32)
    b = (rng.uniform(1, 2, 4096) * 2.0 ** rng.integers(-40, 40, 4096)).astype(np.float32)
    want = (a.astype(np.float64) ** alpha / b.astype(np.float64) ** (1 - alpha)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(smoothing_factors(a, b, alpha)).view(np.int32), want.view(np.int32))
    extreme_a = np.array([0, np.inf, np.nan, 3e38, 1.0], np.float32)
    extreme_b = np.array([1, 1, 1, 1e-38, 1e-45], np.float32)
    got = np.asarray(smoothing_factors(extreme_a, extreme_b, alpha))
    finite = np.isfinite(got) & (got >= np.finfo(np.float32).tiny) & (1 / got.astype(np.float64) >= 1.2e-38)
    assert finite.all() and (got[:3] == 1).all(), got


@pytest.mark.usefixtures("every_platform_programs")
def test_smoothing_stores_the_exact_reciprocal_of_its_factors():
    """``quantize_params`` stores ``1 / smooth`` correctly rounded, so the program multiplies by it as it is (off
    CPU a reciprocal in the program is integer long division: a GPU kernel per weight); a smoothed weight without it
    (built by hand, or read from an older file) computes it in the program, to the same bits."""
    from helpers import platform_eqns

    x, params = outlier_data()
    q = quantize_params(dense, params, x, smooth_alpha=0.5)
    s = np.asarray(q["w"].smooth, np.float32)
    np.testing.assert_array_equal(np.asarray(q["w"].smooth_inverse).view(np.int32), (np.float32(1) / s).view(np.int32))
    without = {"w": q["w"].replace(smooth_inverse=None)}
    np.testing.assert_array_equal(jax.jit(int8ify(dense))(without, x), jax.jit(int8ify(dense))(q, x))

    def long_divisions(qparams):
        jaxpr = jax.make_jaxpr(int8ify(dense))(qparams, x)
        return sum(e.primitive.name == "rem" for e in platform_eqns(jaxpr, "cuda"))

    assert long_divisions(q) == 0 and long_divisions(without) > 0
    with pytest.raises(Int8ifyError, match="smooth_inverse has shape"):
        q["w"].replace(smooth_inverse=jnp.ones(3)).check()
    with pytest.raises(Int8ifyError, match="smooth_inverse is set without smooth factors"):
        q["w"].replace(smooth=None).check()


def test_smoothed_weights_keep_float_semantics():
    x, params = outlier_data()
    q = quantize_params(dense, params, x, smooth_alpha=0.5, calibration=[(x[:8],), (x[8:],)])
    w_max = float(jnp.abs(params["w"]).max())
    np.testing.assert_allclose(q["w"].materialise(), params["w"], rtol=0.02, atol=0.02 * w_max)
    # a use with another contraction sees the dequantized (unsmoothed) weight
    got = int8ify(lambda w, y: w @ y)(q["w"], jnp.ones((16, 3)))
    want = int8ify(lambda w, y: w @ y)(q["w"].materialise(), jnp.ones((16, 3)))
    np.testing.assert_array_equal(got, want)
    # its float value is the IEEE quotient codes * scale / smooth, eager and under jit (XLA would multiply by
    # 1 / smooth there, 1 ulp off); a TPU keeps its own division, within 2 ulps
    codes = np.asarray(q["w"].codes, np.float32) * np.asarray(q["w"].scale_values(), np.float32)
    want = codes / np.asarray(q["w"].smooth, np.float32)[:, None]
    assert_value = (functools.partial(assert_within_ulps, ulps=TPU_DIVISION_ULPS) if approximate_division()
                    else np.testing.assert_array_equal)
    assert_value(q["w"].materialise(), want)
    assert_value(jax.jit(lambda w: w.materialise())(q["w"]), want)
    # straight-through gradient wrt the activations: through x / s, at s * w: the float weight
    g = jax.grad(lambda x: int8ify(dense)(q, x).sum())(x)
    np.testing.assert_allclose(g, np.ones((64, 16)) @ np.asarray(q["w"].materialise()).T, rtol=1e-4, atol=1e-5)
    with pytest.raises(Int8ifyError, match="smooth_alpha must be in"):
        quantize_params(dense, params, x, smooth_alpha=1.5)


def test_smooth_skip_by_scope():
    x, params = outlier_data()

    def two_layers(params, x):
        with jax.named_scope("first"):
            h = x @ params["w"]
        with jax.named_scope("second"):
            return h @ params["v"]

    params = {**params, "v": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)}
    q = quantize_params(two_layers, params, x, smooth_alpha=0.5, smooth_skip=("*second*",))
    assert q["w"].smooth is not None and q["v"].smooth is None
    assert isinstance(q["v"], QuantizedArray)


def test_weights_reading_one_activation_share_their_smoothing():
    x, params = outlier_data()
    params = {"q": params["w"], "k": params["w"] * 2, "v": params["w"] * 3}

    def qkv(params, x):
        return x @ params["q"], x @ params["k"], x @ params["v"]

    q = quantize_params(qkv, params, x, smooth_alpha=0.5)
    groups = {q[name].smooth_group for name in "qkv"}
    assert len(groups) == 1 and None not in groups
    np.testing.assert_array_equal(q["q"].smooth, q["v"].smooth)
    # the program rescales the shared activation once (XLA then merges its three identical quantizations)
    jaxpr = jax.make_jaxpr(int8ify(qkv))(q, x)
    # the rescale is outside the three dots (each one equation, pjit[name=int8_dot_general])
    rescales = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "mul" and e.outvars[0].aval.shape == x.shape]
    assert len(rescales) == 1
    outs = jax.jit(int8ify(qkv))(q, x)
    exact = [np.asarray(x, np.float64) @ np.asarray(params[n], np.float64) for n in "qkv"]
    for got, want in zip(outs, exact):
        assert np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want) < 0.02


# -- weights in loops, casts, explanations --------------------------------------------------------------------------
def _assert_codes_consumed(fn, qparams, *args, n_dots):
    """Every dot of the rewritten program is int8, and no weight is quantized inside it: its only absmax
    reductions are the activations' (one per dot)."""
    jaxpr = jax.make_jaxpr(int8ify(fn))(qparams, *args)
    assert_all_dots_int8(jaxpr)
    for platform in ("cpu", "cuda", "tpu"):
        float_weights = [e for e in platform_eqns(jaxpr, platform) if is_max_reduction(e)]
        assert len(float_weights) == n_dots, len(float_weights)


def test_scan_over_stacked_layers_consumes_the_codes():
    """A scan over stacked layers (L, K, N): one scale per layer and column, the codes sliced per step."""
    layers = {"w": jnp.asarray(rng.normal(size=(6, 64, 64)) / 8, jnp.float32), "b": jnp.zeros((6, 64))}
    x = jnp.asarray(rng.normal(size=(16, 64)), jnp.float32)

    def stack(params, x):
        def layer(h, p):
            return jax.nn.gelu(h @ p["w"] + p["b"]), None
        return jax.lax.scan(layer, x, params)[0]

    q, why = quantize_params(stack, layers, x, explain=True)
    assert isinstance(q["w"], QuantizedArray) and q["w"].scales.shape == (6, 64) and q["w"].contracting == (1,)
    assert why["['w']"].startswith("quantized") and why["['b']"].startswith("kept float: it feeds no matmul")
    f = jax.jit(int8ify(stack))
    np.testing.assert_array_equal(np.asarray(f(q, x)), np.asarray(f(layers, x)))  # bit-identical
    # one dot in the scan body: its activation's absmax is the only reduce_max
    _assert_codes_consumed(stack, q, x, n_dots=1)


def test_decode_loop_weights_are_quantized_and_used_inside_the_loop():
    params = {"w": jnp.asarray(rng.normal(size=(32, 32)) / 6, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(4, 32)), jnp.float32)

    def fori(params, x):
        return jax.lax.fori_loop(0, 5, lambda i, h: jnp.tanh(h @ params["w"]), x)

    def while_loop(params, x):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ params["w"])), (0, x))[1]

    def branch(params, x):
        return jax.lax.cond(x.sum() > 0, lambda h: h @ params["w"], lambda h: -(h @ params["w"]), x)

    for fn, n_dots in ((fori, 1), (while_loop, 1), (branch, 2)):
        q = quantize_params(fn, params, x)
        assert isinstance(q["w"], QuantizedArray), fn.__name__
        f = jax.jit(int8ify(fn))
        np.testing.assert_array_equal(np.asarray(f(q, x)), np.asarray(f(params, x)))
        _assert_codes_consumed(fn, q, x, n_dots=n_dots)


def test_weights_cast_before_their_dot():
    """bfloat16 compute with float32 params (flax nn.Dense(dtype=bfloat16)): the cast value is quantized."""
    params = {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(8, 64)), jnp.bfloat16)

    def dense(params, x):
        return x @ params["w"].astype(jnp.bfloat16)

    q = quantize_params(dense, params, x)
    assert isinstance(q["w"], QuantizedArray) and q["w"].dtype == jnp.float32
    f = jax.jit(int8ify(dense))
    np.testing.assert_array_equal(np.asarray(f(q, x), np.float32), np.asarray(f(params, x), np.float32))
    _assert_codes_consumed(dense, q, x, n_dots=1)


def test_weights_cast_before_their_dot_under_gpu_excess_precision():
    """XLA's GPU compiler drops the ``float32 -> bfloat16 -> float32`` pair between the cast and the quantizer
    (``xla_allow_excess_precision``): the codes must still be the bfloat16 weight's, as ``quantize_params`` takes
    them (an H200 gave outputs 2 bfloat16 steps off before)."""
    params = {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(8, 64)), jnp.bfloat16)

    def dense(params, x):
        return x @ params["w"].astype(jnp.bfloat16)

    q = quantize_params(dense, params, x)
    (want,) = evaluate_as("cuda", int8ify(dense), q, x)
    (got,) = evaluate_as("cuda", int8ify(dense), params, x, excess_precision=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_float16_casts_before_their_dot_under_gpu_excess_precision():
    """The float16 twin, where ``reduce_precision`` cannot keep the rounding (XLA flushes float16's subnormals
    there): a float32 weight and activation cast to float16 right before their dot are quantized from their float16
    values, subnormals (2**-24 to 2**-14) and ties included, as the numpy reference takes them."""
    w = rng.normal(size=(64, 32)).astype(np.float32)
    w[:, 3] *= np.float32(2.0**-17)  # a column of float16 subnormals: its scale and codes come from them
    x = rng.normal(size=(8, 64)).astype(np.float32)
    x[2] *= np.float32(2.0**-18)  # a row of float16 subnormals
    x[5, :8] = np.float32(1 + 2.0**-11)  # halfway between two float16 values: 1 (ties to even)
    w16, x16 = w.astype(np.float16).astype(np.float32), x.astype(np.float16).astype(np.float32)
    assert np.mean(w16 != w) > 0.99 and np.mean(x16 != x) > 0.99
    params = {"w": jnp.asarray(w)}

    def dense(params, x):
        return jnp.matmul(x.astype(jnp.float16), params["w"].astype(jnp.float16), preferred_element_type=jnp.float32)

    want = reference_dot(x16, w16, (((1,), (0,)), ((), ())))
    (got,) = evaluate_as("cuda", int8ify(dense), params, jnp.asarray(x), excess_precision=True)
    assert_close_to_reference(got, want)
    assert_close_to_reference(jax.jit(int8ify(dense))(params, x), want)

    def dense16(params, x):  # float16 out, the weight quantized once
        return x.astype(jnp.float16) @ params["w"].astype(jnp.float16)

    q = quantize_params(dense16, params, x)
    (want16,) = evaluate_as("cuda", int8ify(dense16), q, x)
    (got16,) = evaluate_as("cuda", int8ify(dense16), params, x, excess_precision=True)
    np.testing.assert_array_equal(np.asarray(got16, np.float32), np.asarray(want16, np.float32))


def test_flax_dense_with_bfloat16_compute():
    nn = pytest.importorskip("flax.linen")
    model = nn.Dense(32, dtype=jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(8, 64)), jnp.float32)
    variables = model.init(jax.random.PRNGKey(0), x)
    q, why = quantize_params(model.apply, variables, x, explain=True)
    assert isinstance(q["params"]["kernel"], QuantizedArray), why
    f = jax.jit(int8ify(model.apply))
    np.testing.assert_array_equal(np.asarray(f(q, x), np.float32), np.asarray(f(variables, x), np.float32))


def test_a_leaf_left_float_is_never_silent():
    params = {"w": jnp.asarray(rng.normal(size=(32, 32)), jnp.float32), "b": jnp.zeros(32)}
    x = jnp.asarray(rng.normal(size=(4, 32)), jnp.float32)

    def tied(params, x):
        return x @ params["w"] + params["w"][0] + params["b"]  # w also read by a gather: stays float

    with pytest.warns(QuantizationWarning, match=r"\['w'\]: it is used by .* at .*test_params.py"):
        q = quantize_params(tied, params, x)
    assert not isinstance(q["w"], QuantizedArray)
    _, why = quantize_params(tied, params, x, explain=True)
    assert why["['w']"].startswith("kept float: it is used by") and "feeds no matmul" in why["['b']"]
    # a bias alone is no surprise: no warning; nor is one whose sum with the activation feeds the next layer's
    # matmul (the sum is a new value, not the bias: this warned for every Dense bias but the last)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_params(lambda p, x: x @ p["w"] + p["b"], params, x)
        _, why = quantize_params(lambda p, x: jnp.tanh(x @ p["w"] + p["b"]) @ p["w"], params, x, explain=True)
    assert "feeds no matmul" in why["['b']"]


def test_a_leaf_reaching_its_matmul_through_a_slice_or_split_is_named_and_warned_about():
    """Stacked layers indexed in a Python loop and a fused QKV kernel split in three reach their matmuls through
    primitives quantize_params does not follow: they stay float, and the reason says the result feeds a matmul
    (it used to say "it feeds no matmul", and so no QuantizationWarning came)."""
    params = {"stacked": jnp.asarray(rng.normal(size=(2, 64, 64)), jnp.float32) / 8,
              "qkv": jnp.asarray(rng.normal(size=(64, 192)), jnp.float32) / 8,
              "table": jnp.asarray(rng.normal(size=(64,)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(8, 64)), jnp.float32)

    def model(params, x):
        for i in range(2):
            x = jnp.tanh(x @ params["stacked"][i])
        q, k, v = (x @ w for w in jnp.split(params["qkv"], 3, axis=1))
        return jax.nn.softmax(q @ k.T) @ v + params["table"][3]  # table: read by a slice, which reaches no matmul

    warned = (r"left 2 parameter\(s\) that feed a matmul in float.*\['qkv'\]: it is used by split at "
              r".*test_params\.py:\d+ \(.*model\), whose result feeds a matmul \(quantize_params follows casts")
    with pytest.warns(QuantizationWarning, match=warned):
        quantize_params(model, params, x)
    _, why = quantize_params(model, params, x, explain=True)
    stacked = why["['stacked']"]
    assert stacked.startswith("kept float: it is used by slice at ") and "feeds a matmul" in stacked
    assert why["['table']"].startswith("kept float: it feeds no matmul (it is used by slice at ")


def test_smoothing_groups_of_separate_calls_never_collide():
    """Two quantize_params calls both used to number their groups from 0: a program reading one activation
    through weights of both reused the wrong rescaled activation (40% error, silently)."""
    x, params = outlier_data()

    def one(params, x):
        return x @ params["w"]

    a = quantize_params(one, params, x, smooth_alpha=0.5)
    b = quantize_params(one, {"w": params["w"] * 3 + 1}, x * jnp.asarray(rng.uniform(0.1, 5, 32), jnp.float32),
                        smooth_alpha=0.5)
    assert a["w"].smooth_group != b["w"].smooth_group

    def both(wa, wb, x):
        return x @ wa, x @ wb

    got_a, got_b = jax.jit(int8ify(both))(a["w"], b["w"], x)
    for got, w in ((got_a, params["w"]), (got_b, params["w"] * 3 + 1)):
        exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        assert np.linalg.norm(np.asarray(got) - exact) / np.linalg.norm(exact) < 0.02


def test_transposed_weights_are_quantized():
    """x @ w.T (tied embeddings, torch-layout weights): the codes are transposed, not recomputed."""
    params = {"table": jnp.asarray(rng.normal(size=(48, 32)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(8, 32)), jnp.float32)

    def logits(params, x):
        return x @ params["table"].T

    q = quantize_params(logits, params, x)
    assert isinstance(q["table"], QuantizedArray)
    assert q["table"].contracting == (1,) and q["table"].scales.shape == (48,)
    f = jax.jit(int8ify(logits))
    np.testing.assert_array_equal(np.asarray(f(q, x)), np.asarray(f(params, x)))
    _assert_codes_consumed(logits, q, x, n_dots=1)


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_one_row_times_transposed_codes(activations):
    """Batch-1 decoding with tied embeddings: one row (a matrix of one row, a vector, one row per sequence) times a
    pre-quantized weight's codes transposed in the program. XLA:CPU of jaxlib 0.12.1 failed to compile the one-row
    dot unpadded (an i32 added to an i8 in the fusion it emits for the transpose and the vector-matrix dot); at
    realistic sizes each row gets the numbers it gets among other rows."""
    table = {"table": jnp.asarray(rng.normal(size=(1024, 256)), jnp.float32)}
    xs = jnp.asarray(rng.normal(size=(4, 256)), jnp.float32)

    def logits(params, x):
        return x @ params["table"].T

    q = quantize_params(logits, table, xs, activations=activations)
    f = jax.jit(int8ify(logits))
    among_rows = np.asarray(f(q, xs))
    for row in range(len(xs)):
        np.testing.assert_array_equal(np.asarray(f(q, xs[row:row + 1])), among_rows[row:row + 1])
    np.testing.assert_array_equal(np.asarray(f(q, xs[0])), among_rows[0])
    np.testing.assert_array_equal(np.asarray(f(q, xs[:3, None]))[:, 0], among_rows[:3])
    if activations == "dynamic":  # the contract's numbers (a static scale is calibrated: its own reference)
        want = reference_dot(np.asarray(xs[:1]), np.asarray(table["table"]).T, (((1,), (0,)), ((), ())))
        assert_close_to_reference(f(q, xs[:1]), want)


def test_quantized_params_print_and_map_like_any_pytree():
    q = quantize_params(lambda p, x: x @ p["w"], {"w": PARAMS[0]["w"]}, X)
    assert repr(q) == "{'w': QuantizedArray(i8[32, 32], contracting=(0,), dtype=float32)}"
    shapes = jax.tree_util.tree_map(lambda a: a.shape, q)  # the leaves become tuples: repr must still work
    assert "codes=(32, 32)" in repr(shapes)


def _tied(params, tokens):
    """An LLM's tied embedding: read by the lookup of its tokens and by the LM head's ``x @ embed.T``."""
    x = params["embed"][tokens]
    return jnp.tanh(x @ params["w"]) @ params["embed"].T


def test_a_tied_embedding_is_quantized_for_its_head_with_its_float_rows_kept_for_its_lookup(tmp_path):
    from jaxpr_rewrite.safetensors_io import load_safetensors, save_safetensors

    vocab, d = 1024, 128
    params = {"embed": jnp.asarray(rng.normal(size=(vocab, d)), jnp.float32),
              "w": jnp.asarray(rng.normal(size=(d, d)) / np.sqrt(d), jnp.float32)}
    tokens = jnp.asarray(rng.integers(0, vocab, size=(4, 16)), jnp.int32)
    q, why = quantize_params(_tied, params, tokens, explain=True)
    embed = q["embed"]
    assert isinstance(embed, QuantizedArray) and embed.contracting == (1,)
    assert why["['embed']"] == ("quantized: 1 matmul use(s), contracting axes (1,); "
                                "its float values kept for its lookups")
    np.testing.assert_array_equal(np.asarray(embed.materialise()), np.asarray(params["embed"]))
    # the head's codes are the ones the program would compute from the float table, so the outputs are bit-identical
    want = np.asarray(jax.jit(int8ify(_tied))(params, tokens))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(np.asarray(jax.jit(int8ify(_tied))(q, tokens)), want)
        jaxpr = int8ify(_tied).rewritten_jaxpr(q, tokens)
    # the table is not quantized in the program: no absmax over its 1024 x 128 values; the head reads its codes
    assert not any(e.primitive.name == "reduce_max" and e.invars[0].aval.shape == (vocab, d) for e in iter_eqns(jaxpr))
    assert any(tuple(v.aval.shape) == (d, vocab) and v.aval.dtype == np.int8 for e in dot_eqns(jaxpr) for v in e.invars)
    save_safetensors(tmp_path / "tied.safetensors", q)
    loaded = load_safetensors(tmp_path / "tied.safetensors")
    np.testing.assert_array_equal(np.asarray(loaded["embed"].value), np.asarray(params["embed"]))
    np.testing.assert_array_equal(np.asarray(jax.jit(int8ify(_tied))(loaded, tokens)), want)


@pytest.mark.parametrize("pattern", ["lm_head", "*head"])
def test_a_tied_embedding_whose_head_is_skipped_by_its_name_scope_stays_float(pattern):
    """The head's ``x @ embed.T`` under ``named_scope("lm_head")``: the scope of the dot reached through the
    transpose is the dot's own (``lm_head``), so ``skip`` keeps it float and the table holds no codes."""

    def head_in_scope(params, tokens):
        x = params["embed"][tokens]
        with jax.named_scope("lm_head"):
            return x @ params["embed"].T

    params = {"embed": jnp.asarray(rng.normal(size=(512, 64)), jnp.float32)}
    tokens = jnp.asarray(rng.integers(0, 512, size=(2, 8)), jnp.int32)
    q, why = quantize_params(int8ify(head_in_scope, skip=[pattern]), params, tokens, explain=True)
    assert not isinstance(q["embed"], QuantizedArray)
    assert why["['embed']"].endswith(f"stays float (name scope 'lm_head' matches skip pattern '{pattern}')")
    quantized, _ = quantize_params(int8ify(head_in_scope, skip=["other"]), params, tokens, explain=True)
    assert isinstance(quantized["embed"], QuantizedArray)


def test_a_weight_whose_only_matmul_is_skipped_is_float_without_a_warning():
    """A weight kept float by ``skip`` is what the options ask for: no warning that int8ify quantizes it per call."""
    params = {"embed": jnp.asarray(rng.normal(size=(256, 64)), jnp.float32)}
    tokens = jnp.zeros((2, 8), jnp.int32)
    fn = int8ify(lambda p, t: p["embed"][t] @ p["embed"].T, skip=["*"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q, why = quantize_params(fn, params, tokens, explain=True)
        quantize_params(fn, params, tokens)
    assert not isinstance(q["embed"], QuantizedArray) and why["['embed']"].startswith("float: its matmul at ")
