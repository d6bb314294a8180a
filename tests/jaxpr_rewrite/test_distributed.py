"""int8ify under sharding: jit with NamedSharding over a mesh of 8 CPU devices, and inside shard_map."""

import jax
import jax.numpy as jnp

import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import assert_all_dots_int8, away_from_ties, reference_dot
from jaxpr_rewrite import int8ify

MATMUL = (((1,), (0,)), ((), ()))

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (tests/conftest.py sets them)")


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def data(shape_x=(16, 32), shape_w=(32, 8)):
    rng = np.random.default_rng(0)
    return away_from_ties(rng.normal(size=shape_x), (1,)), away_from_ties(rng.normal(size=shape_w), (0,))


def test_jit_with_named_shardings_keeps_output_sharding(mesh):
    x, w = data()
    x_sharding = NamedSharding(mesh, P("data", None))
    w_sharding = NamedSharding(mesh, P(None, "model"))
    out_sharding = NamedSharding(mesh, P("data", "model"))
    xs, ws = jax.device_put(x, x_sharding), jax.device_put(w, w_sharding)
    f = jax.jit(int8ify(lambda x, w: x @ w), out_shardings=out_sharding)
    out = f(xs, ws)
    assert out.sharding == out_sharding
    np.testing.assert_allclose(np.asarray(out, np.float64), reference_dot(x, w, MATMUL), rtol=1e-6)
    # a nested jit with its own shardings keeps them after the rewrite
    inner = jax.jit(lambda x, w: x @ w, out_shardings=out_sharding)
    g = jax.jit(int8ify(lambda x, w: inner(x, w)))
    out2 = g(xs, ws)
    assert out2.sharding == out_sharding
    jaxpr = jax.make_jaxpr(int8ify(lambda x, w: inner(x, w)))(xs, ws)
    (call,) = [e for e in jaxpr.eqns if e.primitive.name == "jit"]
    assert call.params["out_shardings"] == (out_sharding,)
    assert_all_dots_int8(jaxpr, 1)


def test_sharded_inputs_to_eager_call(mesh):
    x, w = data()
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    out = int8ify(lambda x, w: x @ w)(xs, w)
    np.testing.assert_allclose(np.asarray(out, np.float64), reference_dot(x, w, MATMUL), rtol=1e-6)


def test_inside_shard_map(mesh):
    """Each shard quantizes its own rows (per-row scales are local), the result gathered by out_specs."""
    x, w = data()

    def local(x, w):
        return x @ w

    f = jax.shard_map(local, mesh=mesh, in_specs=(P("data", None), P()), out_specs=P("data", None))
    rewritten = int8ify(f)
    jaxpr = jax.make_jaxpr(rewritten)(x, w)
    assert_all_dots_int8(jaxpr, 1)
    (smap,) = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    before = [e for e in jax.make_jaxpr(f)(x, w).eqns if e.primitive.name == "shard_map"][0]
    for name, value in before.params.items():
        if name != "jaxpr":
            assert smap.params[name] == value, name
    out = jax.jit(rewritten)(x, w)
    # rows are independent, so sharding rows gives the 2-D contract exactly
    np.testing.assert_allclose(np.asarray(out, np.float64), reference_dot(x, w, MATMUL), rtol=1e-6)


def test_shard_map_with_collective_over_contraction(mesh):
    """A contraction split across devices: each shard quantizes its slice of K, partial sums psum'd."""
    x, w = data()

    def local(x, w):
        return jax.lax.psum(x @ w, "model")

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "model"), P("model", None)), out_specs=P())
    out = jax.jit(int8ify(f))(x, w)
    half = x.shape[1] // 2
    want = reference_dot(x[:, :half], w[:half], MATMUL) + reference_dot(x[:, half:], w[half:], MATMUL)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5)


def test_explicit_sharding_keeps_out_sharding():
    """jnp.matmul(x, w, out_sharding=P()) with a sharded contraction on an Explicit mesh: the float program
    works, and so must the int8 one (it used to drop out_sharding and raise ShardingTypeError)."""
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    xs, ws = data((8, 64), (64, 16))
    with jax.set_mesh(mesh):
        x = jax.device_put(xs, NamedSharding(mesh, P("x", "y")))
        w = jax.device_put(ws, NamedSharding(mesh, P("y", None)))
        for spec in (P(), P("x")):
            f = lambda x, w, spec=spec: jnp.matmul(x, w, out_sharding=spec)  # noqa: E731
            got = jax.jit(int8ify(f))(x, w)
            assert got.sharding.spec == jax.jit(f)(x, w).sharding.spec
            np.testing.assert_allclose(np.asarray(got, np.float64), reference_dot(xs, ws, MATMUL), rtol=1e-5)


def test_explicit_mesh_with_quantized_weights_types_values_like_float_weights():
    """Pre-quantized weights sharded over an Explicit mesh: the program is typed as the float weights' would be
    (the weight's stand-in carries its codes' sharding), so the output keeps the column sharding, its values are
    the unsharded program's bit for bit, and a gradient through it (relu's select compares both sides' shardings)
    is the unsharded one's, also after calls outside the mesh's context traced a program of the same arguments."""
    from jaxpr_rewrite import quantize_params

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    rng = np.random.default_rng(1)
    params = {"w1": rng.normal(size=(96, 256)).astype(np.float32) / 8, "b1": rng.normal(size=256).astype(np.float32),
              "w2": rng.normal(size=(256, 64)).astype(np.float32) / 16}
    x = rng.normal(size=(32, 96)).astype(np.float32)

    def mlp(p, x):
        return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"]

    def column_parallel(a):
        return NamedSharding(mesh, P(None, "model") if a.ndim == 2 else P("model"))

    qparams = quantize_params(mlp, params, x)
    want = np.asarray(jax.jit(int8ify(mlp))(qparams, x))
    want_grad = np.asarray(jax.grad(lambda x: int8ify(mlp)(qparams, x).sum())(x))
    placed, float_placed = (jax.device_put(p, jax.tree_util.tree_map(column_parallel, p)) for p in (qparams, params))
    assert placed["w1"].codes.sharding.spec == P(None, "model") and placed["w1"].scales.sharding.spec == P("model")
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    f = int8ify(mlp)
    np.testing.assert_array_equal(np.asarray(f(placed, xs)), want)  # traced outside the mesh's context first
    with jax.set_mesh(mesh):
        got = jax.jit(f)(placed, xs)
        assert got.sharding.spec == jax.jit(mlp)(float_placed, xs).sharding.spec == P("data", "model")
        np.testing.assert_array_equal(np.asarray(got), want)
        grad = jax.grad(lambda x: f(placed, x).sum())(xs)
        assert grad.sharding.spec == jax.grad(lambda x: mlp(float_placed, x).sum())(xs).sharding.spec
        # the straight-through gradient is float matmuls, their sums split over the mesh: equal to rounding
        np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-6)
