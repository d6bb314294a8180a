"""What fuzzed programs and real model code broke (issue 20's runtime items): wrapped objects with attributes,
custom_jvp rules with nested calls, cast chains, float static values, extreme magnitudes, x64 epilogues, skip
patterns under transforms, pre-quantized weights through scan/grad/casts, partial-manual shard_map, option
validation, and the cache shared by rebuilt wrappers. Every numeric check is against the numpy reference of
``helpers.py`` (exact integer sums, float64 scaling) or float64 numpy."""

import contextlib
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import (assert_all_dots_int8, assert_close_to_reference, away_from_ties, dot_eqns, float_dot_eqns,
                     reference_codes, reference_dot, reference_scales)
from jaxpr_rewrite import Int8ifyError, int8ify, quantize_params
from jaxpr_rewrite import report
from jaxpr_rewrite._quantized.array import is_quantized

MATMUL = (((1,), (0,)), ((), ()))


def data(m=16, k=256, n=128, seed=0):
    rng = np.random.default_rng(seed)
    return away_from_ties(rng.normal(size=(m, k)), (1,)), away_from_ties(rng.normal(size=(k, n)), (0,))


def assert_float32_close(got, want):
    """Within float32 rounding of sums of many terms: relative 1e-5, and 1e-6 of the largest entry absolute
    (entries that cancel keep the rounding of the terms they cancel)."""
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def dequantized(w, contracting):
    """The float64 value of ``w``'s int8 codes times its scales (what a pre-quantized weight stands for)."""
    codes = reference_codes(w, contracting).astype(np.float64)
    return codes * np.expand_dims(reference_scales(w, contracting), tuple(contracting))


# -- 1. the wrapper keeps its own attributes --------------------------------------------------------------------
class ModelWithAttributes:
    """A callable model whose attributes are named like the wrapper's (Equinox/nnx/HF style)."""

    def __init__(self, w):
        self.w = w
        self.fn = lambda x: jnp.zeros((x.shape[0], w.shape[1]))  # not what calling the model does
        self.config = {"hidden": w.shape[1]}

    def __call__(self, x):
        return x @ self.w


def test_wrapping_an_object_with_fn_and_config_attributes_calls_the_object():
    x, w = data()
    out = int8ify(ModelWithAttributes(w))(x)
    assert_close_to_reference(out, reference_dot(x, w, MATMUL))


def test_wrapping_a_wrapper_keeps_the_outer_options():
    x, w = data()
    inner = int8ify(lambda x, w: x @ w, skip=["*"])
    outer = int8ify(inner)
    assert_float32_close(inner(x, w), x.astype(np.float64) @ w)
    assert_close_to_reference(outer(x, w), reference_dot(x, w, MATMUL))
    assert outer.config.skip == () and inner.config.skip == ("*",)
    assert outer.__wrapped__ is inner and outer.__name__ == inner.__name__


# -- 2. custom_jvp rules computing primal and tangent in one nested call ---------------------------------------
@jax.custom_jvp
def dense_jvp_of_jit(x, w):
    return x @ w


@dense_jvp_of_jit.defjvp
def _dense_jvp_of_jit(primals, tangents):
    return jax.jvp(jax.jit(lambda x, w: x @ w), primals, tangents)


@jax.custom_jvp
def dense_jitted_rule(x, w):
    return x @ w


@dense_jitted_rule.defjvp
def _dense_jitted_rule(primals, tangents):
    @jax.jit
    def both(x, w, dx, dw):
        return x @ w, dx @ w + x @ dw

    return both(*primals, *tangents)


@pytest.mark.parametrize("dense", [dense_jvp_of_jit, dense_jitted_rule], ids=["jvp-of-jit", "jitted-helper"])
def test_custom_jvp_rule_with_nested_primal_and_tangent_runs_the_primal_in_int8(dense):
    x, w = data()
    loss = int8ify(lambda x, w: jnp.sum(dense(x, w)))
    value, (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1))(x, w)
    want = reference_dot(x, w, MATMUL)
    np.testing.assert_allclose(float(value), want.sum(), rtol=1e-5)
    assert abs(float(value) - (x.astype(np.float64) @ w).sum()) > 1e-3  # not the float forward pass
    # the tangent matmuls stay float (the backward pass is the float one)
    assert_float32_close(dx, np.ones((16, 128)) @ w.T.astype(np.float64))
    assert_float32_close(dw, x.T.astype(np.float64) @ np.ones((16, 128)))
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(x, w)
    assert len(float_dot_eqns(jaxpr)) < len(dot_eqns(jaxpr))  # an int8 dot is there


# -- 3. quantize_params through a chain of casts ----------------------------------------------------------------
def test_quantize_params_follows_every_cast_of_a_chain():
    x, w = data()
    w = (w * 1.001).astype(np.float32)  # bf16 rounding then changes the values

    def f(params, x):
        return x @ params["w"].astype(jnp.bfloat16).astype(jnp.float32)

    qparams = quantize_params(f, {"w": w}, x)
    assert is_quantized(qparams["w"])
    rounded = np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32))
    want = reference_dot(x, rounded, MATMUL)
    assert_close_to_reference(int8ify(f)(qparams, x), want)
    np.testing.assert_array_equal(np.asarray(int8ify(f)(qparams, x)), np.asarray(int8ify(f)({"w": w}, x)))


# -- 4. float static values keyed by their bits ------------------------------------------------------------------
def test_static_zero_and_negative_zero_are_different_programs():
    x, w = data()
    f = int8ify(lambda x, w, sign: (x @ w) * math.copysign(1.0, sign))
    want = reference_dot(x, w, MATMUL)
    assert_close_to_reference(f(x, w, 0.0), want)
    assert_close_to_reference(f(x, w, -0.0), -want)


def test_static_nan_hits_the_cache():
    x, w = data()
    traces = []

    def g(x, w, s):
        traces.append(s)
        return x @ w

    f = int8ify(g)
    f(x, w, float("nan"))
    f(x, w, float("nan"))  # another NaN object, the same bits
    assert len(traces) == 1


# -- 5. report's error at extreme magnitudes --------------------------------------------------------------------
@pytest.mark.parametrize("exponent", [70, -70])
def test_report_error_is_scale_invariant(exponent):
    x, w = data()
    scaled = (x * np.float32(2.0 ** exponent)).astype(np.float32)  # outputs ~1e22 / ~1e-20
    want = reference_dot(x, w, MATMUL)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    true_error = np.linalg.norm(want - exact) / np.linalg.norm(exact)
    (row,) = report(lambda x, w: x @ w, scaled, w).rows
    assert 1e-3 < true_error < 3e-2
    np.testing.assert_allclose(row.error, true_error, rtol=1e-2)


# -- 6. nvfp4 at small magnitudes -------------------------------------------------------------------------------
def test_nvfp4_small_operands_do_not_underflow():
    x, w = data(k=256)
    f = int8ify(lambda x, w: x @ w, backend="nvfp4")
    unit = np.asarray(f(x, w), np.float64)
    small = np.asarray(f((x * np.float32(2.0 ** -60)).astype(np.float32), (w * np.float32(2.0 ** -50)).astype(
        np.float32)), np.float64)  # x ~ 1e-18, w ~ 1e-15, results ~ 1e-32: ordinary float32 values
    # quantization is equivariant under powers of two: the same codes, the result scaled exactly
    np.testing.assert_array_equal(small, unit * 2.0 ** -110)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert np.linalg.norm(unit - exact) / np.linalg.norm(exact) < 0.25


# -- 7. the epilogue follows the output dtype under x64 --------------------------------------------------------
@pytest.mark.parametrize("magnitude", [1e30, 1e-30])
def test_float64_output_of_float32_operands_gets_a_float64_epilogue(magnitude):
    x, w = data()
    xs, ws = (x * np.float32(magnitude)).astype(np.float32), (w * np.float32(magnitude)).astype(np.float32)
    with jax.enable_x64(True):
        f = int8ify(lambda x, w: lax.dot_general(x, w, MATMUL, preferred_element_type=jnp.float64))
        out = f(xs, ws)
        assert out.dtype == np.float64
        assert_close_to_reference(out, reference_dot(xs, ws, MATMUL), rtol=1e-12)


# -- 8. skip patterns through JAX's transform wrappers ---------------------------------------------------------
def scoped_loss(*scopes):
    def loss(x, w):
        with contextlib.ExitStack() as stack:
            for scope in scopes:
                stack.enter_context(jax.named_scope(scope))
            return jnp.sum(jnp.sin(x @ w))

    return loss


@pytest.mark.parametrize("scopes, pattern", [(("attn",), "attn"), (("block", "attn"), "block/attn"),
                                             (("block", "attn"), "block/*"), (("block", "attn"), "*attn")])
def test_skip_matches_under_grad_and_vmap(scopes, pattern):
    x, w = data()
    loss = scoped_loss(*scopes)
    grad = int8ify(jax.grad(loss, argnums=1), skip=[pattern])
    jaxpr = jax.make_jaxpr(grad)(x, w)  # scopes jvp(attn), transpose(jvp(attn)), ...
    assert float_dot_eqns(jaxpr) and len(float_dot_eqns(jaxpr)) == len(dot_eqns(jaxpr))
    assert_float32_close(grad(x, w), jax.grad(loss, argnums=1)(x, w))
    batched = int8ify(jax.vmap(loss, in_axes=(0, None)), skip=[pattern])
    jaxpr = jax.make_jaxpr(batched)(x[None], w)  # scope vmap(attn) or vmap(block)/attn
    assert len(float_dot_eqns(jaxpr)) == len(dot_eqns(jaxpr)) == 1


def test_a_pattern_naming_the_wrapper_still_matches():
    x, w = data()
    grad = int8ify(jax.grad(scoped_loss("block", "attn"), argnums=1), skip=["jvp(block)/*"])
    assert len(float_dot_eqns(jax.make_jaxpr(grad)(x, w))) >= 1


# -- 9. a pre-quantized weight scanned over its contracting axis -----------------------------------------------
@pytest.mark.parametrize("n", [128, 256], ids=["K!=N", "K==N"])
def test_scan_over_the_contracting_axis_of_a_quantized_weight(n):
    x, w = data(n=n)

    def project(params, x):
        return x @ params["w"]

    def rows_sum(params, x):
        # sum_k x[:, k] * w[k]: a scan over the weight's contracting axis (not a matmul)
        def step(acc, xk_wk):
            xk, wk = xk_wk
            return acc + xk[:, None] * wk[None, :], None

        out, _ = lax.scan(step, jnp.zeros((x.shape[0], params["w"].shape[1])), (x.T, params["w"]))
        return out

    qparams = quantize_params(project, {"w": w}, x)
    assert is_quantized(qparams["w"])
    got = int8ify(rows_sum)(qparams, x)
    np.testing.assert_allclose(np.asarray(got, np.float64), x.astype(np.float64) @ dequantized(w, (0,)),
                               rtol=1e-4, atol=1e-4)


# -- 10. gradients with respect to pytrees holding QuantizedArray leaves --------------------------------------
def loss_with_bias(params, x):
    return jnp.sum(jnp.square(x @ params["w"] + params["b"]))


def test_grad_allow_int_through_quantized_params():
    x, w = data()
    b = np.linspace(-1, 1, 128).astype(np.float32)
    qparams = quantize_params(loss_with_bias, {"w": w, "b": b}, x)
    assert is_quantized(qparams["w"])
    grads = jax.grad(int8ify(loss_with_bias), allow_int=True)(qparams, x)
    y = reference_dot(x, w, MATMUL) + b
    assert_float32_close(grads["b"], 2 * y.sum(axis=0))
    assert grads["w"].codes.dtype == jax.dtypes.float0


def test_equinox_filter_grad_through_quantized_params():
    x, w = data()
    b = np.linspace(-1, 1, 128).astype(np.float32)
    qparams = quantize_params(loss_with_bias, {"w": w, "b": b}, x)
    grads = eqx.filter_grad(int8ify(loss_with_bias))(qparams, x)
    y = reference_dot(x, w, MATMUL) + b
    assert_float32_close(grads["b"], 2 * y.sum(axis=0))


# -- 11. QuantizedArray scales cast by a mixed-precision tree_map ---------------------------------------------
def to_bfloat16(leaf):
    return leaf.astype(jnp.bfloat16) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf


def test_bfloat16_scales_are_a_clear_error_and_the_is_leaf_recipe_works():
    x, w = data()
    qparams = quantize_params(lambda p, x: x @ p["w"], {"w": w}, x)
    cast = jax.tree_util.tree_map(to_bfloat16, qparams)
    f = int8ify(lambda p, x: x @ p["w"])
    for call in (lambda: f(cast, x), lambda: jax.grad(lambda p: jnp.sum(f(p, x)), allow_int=True)(cast)):
        with pytest.raises(Int8ifyError, match=r"scales are bfloat16.*is_leaf"):
            call()
    # the recipe the error gives: cast each QuantizedArray as a whole (its codes and scales stay)
    recast = jax.tree_util.tree_map(to_bfloat16, qparams, is_leaf=is_quantized)
    assert recast["w"].dtype == jnp.bfloat16 and recast["w"].scales.dtype == np.float32
    out = f(recast, x.astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    want = reference_dot(np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(np.float32)), w, MATMUL)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-2, atol=1e-2)


# -- 12. shard_map with some axes manual on an Explicit mesh --------------------------------------------------
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (tests/conftest.py sets them)")
def test_partially_manual_shard_map_on_an_explicit_mesh():
    x, w = data()
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    body = jax.shard_map(lambda x, w: lax.psum(x @ w, "model"), mesh=mesh, in_specs=(P(None, "model"),
                         P("model", None)), out_specs=P(), axis_names={"model"})
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
        ws = jax.device_put(w, NamedSharding(mesh, P("model", None)))
        f = int8ify(body)
        out = jax.jit(f)(xs, ws)
        assert_all_dots_int8(jax.make_jaxpr(f)(xs, ws))
    # each model shard sums half the contraction with its own scales, then psum adds the halves
    want = reference_dot(x[:, :128], w[:128], MATMUL) + reference_dot(x[:, 128:], w[128:], MATMUL)
    assert_float32_close(out, want)  # float32 adds the two halves


# -- 13. option errors (in tests/jaxpr_rewrite/test_options.py); plots of infinite errors -----------------------------
def test_numpy_scalar_smooth_alpha_is_accepted():
    x, w = data()
    x[:, 3] *= 30  # an outlier channel, so smoothing changes the numbers
    f = lambda p, x: x @ p["w"]  # noqa: E731
    by_float = quantize_params(f, {"w": w}, x, smooth_alpha=0.5)
    by_numpy = quantize_params(f, {"w": w}, x, smooth_alpha=np.float32(0.5))
    np.testing.assert_array_equal(np.asarray(by_numpy["w"].codes), np.asarray(by_float["w"].codes))
    for bad in (np.float32(1.5), True, "0.5"):
        with pytest.raises(Int8ifyError, match="smooth_alpha"):
            quantize_params(f, {"w": w}, x, smooth_alpha=bad)


def test_plot_of_an_infinite_error(tmp_path):
    pytest.importorskip("matplotlib")
    x, w = data()
    x[0, 0] = np.nan  # report measures an infinite error for it
    rep = report(lambda x, w: (x @ w, x[1:] @ w), x, w)
    assert rep.rows[0].error == math.inf and math.isfinite(rep.rows[1].error)
    rep.plot(tmp_path / "errors.png")
    assert (tmp_path / "errors.png").stat().st_size > 0


# -- 15. rebuilt wrappers share the cache ------------------------------------------------------------------------
def test_rebuilding_the_wrapper_reuses_the_traced_program():
    x, w = data()
    traces = []

    def mlp(x, w):
        traces.append(1)
        return jnp.tanh(x @ w)

    first = int8ify(mlp)(x, w)
    again = int8ify(mlp)(x, w)
    jax.jit(int8ify(mlp))(x, w)
    jax.jit(int8ify(mlp))(x, w)
    assert len(traces) == 1
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    int8ify(mlp, skip=["*"])(x, w)  # other options: another program
    assert len(traces) == 2
    assert int8ify(mlp) is int8ify(mlp) and int8ify(mlp) is not int8ify(mlp, skip=["*"])
