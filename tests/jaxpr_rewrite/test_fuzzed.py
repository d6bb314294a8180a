"""What a user's fuzzing of the library found (issue 68): float64 calibration and smoothing, malformed static scales,
NaN under a percentile, a donated weight, explanations, the command line's shapes; pre-quantized weights inside
custom derivatives and shard_map; nnx modules with shared state and Python attributes; stored files; 4-bit
sharded restore; block scales contracted out of axis order; exported programs served by JAX alone. Numbers are
checked against numpy in float64 (exact integer sums of the reference codes where the codes are the contract's)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from helpers import ieee_float64
from jaxpr_rewrite import ActivationScales, Int8ifyError, QuantizationWarning, int8ify, quantize_params
from jaxpr_rewrite.cli import UsageError, parse_args_spec

RNG = np.random.default_rng(68)


def matmul(params, x):
    return x @ params["w"]


def relative_error(got, want) -> float:
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


@pytest.fixture
def x64():
    with ieee_float64():  # (on the host's CPU where the default device is a TPU, which has no IEEE float64)
        yield


# -- 5. float64 static activation scales -------------------------------------------------------------------------
@pytest.mark.parametrize("magnitude", [1e-40, 1e40])
def test_float64_static_scales_are_calibrated_in_float64(x64, magnitude):
    """float32 reads a float64 activation of 1e-40 as zero (all-zero outputs) and one of 1e40 as Inf (refused)."""
    w = RNG.standard_normal((256, 128))
    x = RNG.standard_normal((32, 256)) * magnitude
    static = quantize_params(matmul, {"w": w}, x, activations="static")
    scale = np.asarray(static["w"].activation_scale)
    assert scale.dtype == np.float64 and scale[0] == np.abs(x).max()
    got = int8ify(matmul)(static, x)
    # float64 codes of x by its static scale absmax / 127 and of w by its per-column ones; exact integer sums
    x_scale = np.abs(x).max() / 127
    w_scales = np.abs(w).max(axis=0) / 127
    x_codes, w_codes = np.clip(np.rint(x / x_scale), -127, 127), np.clip(np.rint(w / w_scales), -127, 127)
    want = (x_codes @ w_codes) * w_scales * x_scale
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    assert relative_error(got, x @ w) < 0.02


def test_float64_static_scales_of_dots_between_activations(x64):
    from jaxpr_rewrite import calibrate_activation_dots

    a = RNG.standard_normal((64, 128)) * 1e-40

    def attention(params, a):
        return a @ a.T

    scales = calibrate_activation_dots(attention, {}, a)
    got = int8ify(attention, activation_scales=scales)({}, a)
    assert relative_error(got, a @ a.T) < 0.02


# -- 6. SmoothQuant on float64 weights ---------------------------------------------------------------------------
@pytest.mark.parametrize("magnitude", [1e100, 1e-100])
def test_smoothing_float64_weights_computes_the_smoothed_weight_in_float64(x64, magnitude):
    w = RNG.standard_normal((256, 128)) * magnitude
    x = RNG.standard_normal((32, 256))
    x[:, 3] *= 30  # an outlier channel, what smoothing is for
    smoothed = quantize_params(matmul, {"w": w}, x, smooth_alpha=0.5)
    assert smoothed["w"].smooth.dtype == np.float64
    got = np.asarray(int8ify(matmul)(smoothed, x))
    assert np.isfinite(got).all() and relative_error(got, x @ w) < 0.01
    unsmoothed = int8ify(matmul)(quantize_params(matmul, {"w": w}, x), x)
    assert relative_error(got, x @ w) < relative_error(unsmoothed, x @ w)


# -- 11. ActivationScales.from_dict checks what it reads ---------------------------------------------------------
DOT = {"position": 0, "dimension_numbers": [[[1], [1]], [[], []]], "ranks": [2, 2], "scope": "", "source": "f:1",
       "absmax": [1.0, 2.0]}


@pytest.mark.parametrize("field, value, expected", [
    ("absmax", [1.5], "dots\\[0\\].absmax is \\[1.5\\], not two numbers"),
    ("absmax", "12", "dots\\[0\\].absmax is '12', not two numbers"),
    ("ranks", [2, "2"], "dots\\[0\\].ranks is \\[2, '2'\\], not two ints"),
    ("dimension_numbers", [[1], [0]], "dots\\[0\\].dimension_numbers is"),
    ("position", 0.5, "dots\\[0\\].position is 0.5, not an int"),
])
def test_a_malformed_activation_scales_dict_is_an_error_naming_the_field(field, value, expected):
    assert ActivationScales.from_dict({"n_dots": 1, "dots": [DOT]}).dots[0].absmax == (1.0, 2.0)
    with pytest.raises(Int8ifyError, match=f"not the dict ActivationScales.as_dict writes: {expected}"):
        ActivationScales.from_dict({"n_dots": 1, "dots": [{**DOT, field: value}]})


# -- 12. a percentile does not hide NaN, nor call a zero percentile all-zero activations --------------------------
def test_nan_in_calibration_is_an_error_with_a_percentile():
    from jaxpr_rewrite import calibrate_activation_dots

    w = RNG.standard_normal((128, 64)).astype(np.float32)
    x = RNG.standard_normal((64, 128)).astype(np.float32)
    bad = x.copy()
    bad[5, 7] = np.nan
    with pytest.raises(Int8ifyError, match=r"the activations met by \['w'\]'s matmuls hold NaN or Inf"):
        quantize_params(matmul, {"w": w}, x, activations="static", activation_percentile=99.0, calibration=[(bad,)])
    with pytest.raises(Int8ifyError, match="hold NaN or Inf"):
        calibrate_activation_dots(lambda p, a: a @ a.T, {}, bad, percentile=99.0)


def test_a_percentile_of_zero_does_not_say_the_activations_were_all_zero():
    w = RNG.standard_normal((128, 64)).astype(np.float32)
    x = np.zeros((64, 128), np.float32)
    x[0] = RNG.standard_normal(128)  # one row of 64 nonzero: the 90th percentile of |x| is 0
    with pytest.warns(QuantizationWarning, match=r"had a 90.0th percentile of \|x\| of 0 \(at least 90.0% of the "
                                                 r"values zero\)") as caught:
        quantize_params(matmul, {"w": w}, x, activations="static", activation_percentile=90.0)
    assert "all zero" not in str(caught[0].message)


# -- 13. a donated weight ------------------------------------------------------------------------------------------
def test_a_donated_weight_fails_as_the_float_function_does():
    w = jnp.asarray(RNG.standard_normal((256, 128)).astype(np.float32))
    x = RNG.standard_normal((16, 256)).astype(np.float32)
    f = int8ify(matmul)
    f({"w": w}, x)
    f({"w": w}, x)  # the second call quantizes the weight once, kept while it lives
    w.delete()  # as donating it to another computation does
    with pytest.raises(RuntimeError, match="deleted"):
        matmul({"w": w}, x)
    with pytest.raises(Exception, match="deleted"):
        f({"w": w}, x)


# -- 14. explanations, the command line's shapes -------------------------------------------------------------------
def test_explain_names_the_matmul_that_keeps_a_weight_dynamic():
    w = RNG.standard_normal((64, 64)).astype(np.float32)
    x = RNG.standard_normal((8, 64)).astype(np.float32)

    def f(params, x):
        h = x @ params["w"]
        return lax.fori_loop(0, 2, lambda i, h: h @ params["w"], h)  # the matmul in the loop

    _, why = quantize_params(f, {"w": w}, x, activations="static", explain=True)
    line = f.__code__.co_firstlineno + 2
    assert f"its matmul at tests/jaxpr_rewrite/test_fuzzed.py:{line} " in why["['w']"], why


@pytest.mark.parametrize("spec", ["f32[4,,8]", "f32[4,]", "f32[,4]"])
def test_a_shape_with_a_missing_dim_is_a_usage_error(spec):
    assert parse_args_spec("f32[4,8] i32[]")[0].shape == (4, 8)
    with pytest.raises(UsageError, match="dims must be integers, one between each two commas"):
        parse_args_spec(spec)


# -- 9. block scales contracted out of the weight's axis order ----------------------------------------------------
def test_a_block_scaled_weight_contracted_out_of_axis_order_stays_float():
    w = RNG.standard_normal((32, 16, 64)).astype(np.float32)
    x = RNG.standard_normal((4, 16, 32)).astype(np.float32)

    def reversed_order(params, x):  # contracts w's axes in the order (1, 0)
        return jnp.einsum("bij,jin->bn", x, params["w"])

    def in_order(params, x):
        return jnp.tensordot(x, params["w"], axes=((2, 1), (0, 1)))

    blocked = int8ify(reversed_order, block_size=32)
    kept, why = quantize_params(blocked, {"w": w}, x, explain=True)
    assert isinstance(kept["w"], np.ndarray)
    assert "contracts its axes in the order (1, 0), and block scales follow the axes' own order" in why["['w']"]
    want = np.einsum("bij,jin->bn", x.astype(np.float64), w)
    got = blocked({"w": w}, x)
    assert relative_error(got, want) < 0.02
    # a weight quantized for a dot contracting in order meets the reversed one: its value, not an AttributeError
    stored = quantize_params(int8ify(in_order, block_size=32), {"w": w}, x)
    np.testing.assert_array_equal(blocked(stored, x), blocked({"w": np.asarray(stored["w"].materialise())}, x))
    assert relative_error(int8ify(in_order, block_size=32)(stored, x), want) < 0.02


# -- 8. sharded restore of 4-bit codes whose packed axis is sharded -------------------------------------------------
@pytest.mark.parametrize("columns, packed_spec", [(6, None), (8, "model")])
def test_sharded_like_keeps_a_packed_axis_whole_where_bytes_straddle_shards(tmp_path, columns, packed_spec):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpr_rewrite.checkpoint import load_quantized, save_quantized, sharded_like

    w = RNG.standard_normal((256, columns)).astype(np.float32)
    x = RNG.standard_normal((8, 256)).astype(np.float32)
    q4 = quantize_params(matmul, {"w": w}, x, bits=4)
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
    target = sharded_like(jax.eval_shape(lambda p: p, q4), {"w": NamedSharding(mesh, P(None, "model"))})
    assert target["w"].codes.sharding.spec == P(None, packed_spec) and target["w"].scales.sharding.spec == P("model")
    save_quantized(tmp_path / "ckpt", q4)
    placed = load_quantized(tmp_path / "ckpt", target)
    np.testing.assert_array_equal(placed["w"].codes, q4["w"].codes)
    np.testing.assert_array_equal(int8ify(matmul)(placed, x), int8ify(matmul)(q4, x))


# -- 3, 4. nnx modules with shared state, and their Python attributes ----------------------------------------------
def nnx_counter_models():
    nnx = pytest.importorskip("flax.nnx")

    class Counted(nnx.Module):
        """A matmul that counts its calls in a Variable and in a plain Python attribute."""

        def __init__(self, w):
            self.w = nnx.Param(jnp.asarray(w))
            self.count = nnx.Variable(jnp.zeros((), jnp.float32))
            self.calls = 0

        def __call__(self, x):
            self.count[...] = self.count[...] + 1
            self.calls += 1
            return x @ self.w[...]

    class Tied(nnx.Module):
        def __init__(self, w):
            self.first = Counted(w)
            self.second = self.first  # one submodule, used twice

        def __call__(self, x):
            return self.second(self.first(x))

    return nnx, Counted, Tied


@pytest.mark.parametrize("wrap", ["eager", "nnx.jit"])
def test_nnx_shared_state_is_updated_once_per_use_as_the_float_function_does(wrap):
    nnx, Counted, Tied = nnx_counter_models()
    w = RNG.standard_normal((128, 128)).astype(np.float32) / 11
    x = RNG.standard_normal((8, 128)).astype(np.float32)
    wrapped = (lambda f: f) if wrap == "eager" else nnx.jit
    tied, float_tied = Tied(w), Tied(w)
    call = wrapped(int8ify(lambda model, x: model(x)))
    for _ in range(2):
        got = call(tied, x)
        want = float_tied(x)
    assert float(tied.first.count[...]) == float(float_tied.first.count[...]) == 4
    assert tied.second is tied.first and tied.first.calls == float_tied.first.calls == 4
    assert relative_error(got, np.asarray(x, np.float64) @ w @ w) < 0.02
    assert relative_error(got, want) < 0.02
    # one module passed as two arguments
    counted, float_counted = Counted(w), Counted(w)
    both = wrapped(int8ify(lambda a, b, x: b(a(x))))
    both(counted, counted, x)
    float_counted(float_counted(x))
    assert float(counted.count[...]) == float(float_counted.count[...]) == 2 and counted.calls == 2


def test_an_nnx_python_attribute_update_with_a_variable_update_is_written_back():
    nnx, Counted, _ = nnx_counter_models()
    model = Counted(RNG.standard_normal((64, 64)).astype(np.float32))
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    for calls in (1, 2, 3):
        int8ify(lambda m, x: m(x))(model, x)
        assert model.calls == calls and float(model.count[...]) == calls


# -- 7. stored files: 0-d and float8 leaves, tuple keys, places holding no array, damaged documents -----------------
def stored_formats():
    from jaxpr_rewrite.checkpoint import load_quantized, save_quantized
    from jaxpr_rewrite.safetensors_io import load_safetensors, save_safetensors

    return {"safetensors": (save_safetensors, load_safetensors), "orbax": (save_quantized, load_quantized)}


def assert_same_stored_tree(got, want):
    """The same structure (QuantizedArrays as leaves, Nones and empty containers included), the same leaf bits."""
    from jaxpr_rewrite.quantized import is_quantized

    leaves_got, tree_got = jax.tree_util.tree_flatten(got, is_leaf=is_quantized)
    leaves_want, tree_want = jax.tree_util.tree_flatten(want, is_leaf=is_quantized)
    assert tree_got == tree_want, (tree_got, tree_want)
    for a, b in zip(jax.tree_util.tree_leaves(leaves_got), jax.tree_util.tree_leaves(leaves_want)):
        assert np.dtype(a.dtype) == np.dtype(b.dtype) and np.shape(a) == np.shape(b)
        as_bytes = [np.atleast_1d(np.asarray(leaf)).view(np.uint8) for leaf in (a, b)]  # float8 too, bit for bit
        np.testing.assert_array_equal(*as_bytes)


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_stored_trees_round_trip_whatever_their_leaves_and_keys(tmp_path, fmt):
    save, load = stored_formats()[fmt]
    v = RNG.standard_normal(256).astype(np.float32)
    x = RNG.standard_normal((4, 256)).astype(np.float32)
    vector = quantize_params(lambda p, x: x @ p["v"], {"v": v}, x)["v"]  # its scales are 0-d
    assert vector.scales.shape == ()
    tree = {"scalar": np.float32(3.5), "vector": vector, "fp8": jnp.asarray(v[:8], jnp.float8_e4m3fn),
            "none": None, "nothing": {}, "items": [None, np.ones(3, np.float32)],
            "flat": {("layer", "kernel"): np.arange(6, dtype=np.float32).reshape(2, 3),  # flatten_dict's keys
                     ("layer", "bias"): np.zeros(3, np.float32)}}
    save(tmp_path / "stored", tree)
    assert_same_stored_tree(load(tmp_path / "stored"), tree)
    assert_same_stored_tree(load(tmp_path / "stored", jax.eval_shape(lambda t: t, tree)), tree)
    np.testing.assert_array_equal(int8ify(lambda p, x: x @ p["v"])({"v": load(tmp_path / "stored")["vector"]}, x),
                                  int8ify(lambda p, x: x @ p["v"])({"v": vector}, x))


def test_safetensors_refuses_a_tensor_named_like_its_header_metadata(tmp_path):
    save, _ = stored_formats()["safetensors"]
    with pytest.raises(Int8ifyError, match=r"cannot save leaf \['__metadata__'\] to .*: its tensor would be named "
                                           r"'__metadata__', the name SafeTensors' header gives its metadata"):
        save(tmp_path / "m.safetensors", {"__metadata__": np.ones(3, np.float32)})


@pytest.mark.parametrize("damage, message", [
    (lambda text: text[:-20], r"its 'int8ify.layout' metadata, the layout document, is not valid JSON"),
    (lambda text: text.replace('"tensors": {"value": "b"}', '"tensors": {"value": "c"}'),
     r"its layout document is damaged: leaf 0 \(\['b'\]\) names tensors \['c'\] the document does not list"),
    (lambda text: text.replace('"kind": "array"', '"kind": "arrays"'),
     r"its layout document is damaged: leaf 0 \(\['b'\]\) is of the unknown kind 'arrays'"),
])
def test_a_damaged_layout_document_is_an_error_naming_the_file_and_leaf(tmp_path, damage, message):
    import json

    from safetensors import safe_open
    from safetensors.numpy import save_file

    from jaxpr_rewrite.safetensors_io import LAYOUT_KEY, load_safetensors, save_safetensors

    path = tmp_path / "model.safetensors"
    save_safetensors(path, {"b": np.ones(3, np.float32)})
    with safe_open(path, framework="numpy") as file:
        text, value = file.metadata()[LAYOUT_KEY], file.get_tensor("b")
    json.loads(text)
    save_file({"b": value}, path, metadata={LAYOUT_KEY: damage(text)})
    with pytest.raises(Int8ifyError, match=f"{path}.*{message}"):
        load_safetensors(path)


# -- 1. pre-quantized weights inside custom_jvp and custom_vjp ------------------------------------------------------
@jax.custom_vjp
def vjp_dense(x, w):
    return x @ w


def _vjp_dense_fwd(x, w):
    return x @ w, (x, w)


def _vjp_dense_bwd(residuals, g):
    x, w = residuals
    return 2 * (g @ w.T), x.T @ g  # a rule of the user's own (twice the true dx): it must be the one applied


vjp_dense.defvjp(_vjp_dense_fwd, _vjp_dense_bwd)


@jax.custom_jvp
def jvp_dense(x, w):
    return x @ w


@jvp_dense.defjvp
def _jvp_dense_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    return x @ w, 3 * (dx @ w) + x @ dw  # (three times the true tangent of x)


@pytest.mark.parametrize("dense, factor", [(vjp_dense, 2), (jvp_dense, 3)], ids=["custom_vjp", "custom_jvp"])
@pytest.mark.parametrize("bits, activations", [(4, "dynamic"), (8, "static")])
def test_a_quantized_weight_keeps_its_codes_inside_custom_derivatives(dense, factor, bits, activations):
    w = RNG.standard_normal((256, 128)).astype(np.float32) / 16
    x = RNG.standard_normal((16, 256)).astype(np.float32)

    def inside(params, x):
        return dense(x, params["w"])

    stored, why = quantize_params(inside, {"w": w}, x, bits=bits, activations=activations, explain=True)
    assert why["['w']"].startswith("quantized"), why
    direct = int8ify(matmul)(stored, x)  # the same weight, the same dot, outside the custom derivative
    np.testing.assert_array_equal(int8ify(inside)(stored, x), direct)
    np.testing.assert_array_equal(jax.jit(int8ify(inside))(stored, x), direct)
    value = np.asarray(stored["w"].materialise(), np.float64)  # the weight's value inside the dot
    # the derivative is the user's rule at the weight's value inside the dot
    loss = int8ify(lambda params, x: jnp.sum(inside(params, x) ** 2))
    for grad in (jax.grad(loss, argnums=1), jax.grad(jax.jit(loss), argnums=1)):
        got = grad(stored, x)
        want = factor * (2 * np.asarray(direct, np.float64)) @ value.T
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


# -- 1. pre-quantized weights inside shard_map -------------------------------------------------------------------
@pytest.mark.parametrize("bits, activations", [(4, "dynamic"), (8, "static")])
def test_a_quantized_weight_keeps_its_codes_inside_shard_map(bits, activations):
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2], axis_types=(AxisType.Auto,))
    w = RNG.standard_normal((256, 128)).astype(np.float32) / 16
    x = RNG.standard_normal((16, 256)).astype(np.float32)

    def columns(params, x):  # each device: all rows of x times its 64 columns of w
        return jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P(), P(None, "model")),
                             out_specs=P(None, "model"))(x, params["w"])

    def rows(params, x):  # each device: its half of the contraction, summed across devices
        return jax.shard_map(lambda x, w: jax.lax.psum(x @ w, "model"), mesh=mesh,
                             in_specs=(P(None, "model"), P("model", None)), out_specs=P())(x, params["w"])

    for fn in (columns, rows):
        stored, why = quantize_params(fn, {"w": w}, x, bits=bits, activations=activations, explain=True)
        assert why["['w']"].startswith("quantized"), why
        value = np.asarray(stored["w"].materialise(), np.float64)
        got = int8ify(fn)(stored, x)
        assert relative_error(got, x.astype(np.float64) @ value) < 0.02
        np.testing.assert_array_equal(jax.jit(int8ify(fn))(stored, x), got)
    # the column-parallel dots are the unsharded dot's columns, bit for bit: the stored codes and scales
    np.testing.assert_array_equal(int8ify(columns)(stored, x), int8ify(matmul)(stored, x))
    # float weights passed again are quantized once, ahead: the same numbers as quantizing them in the program
    f, weights = int8ify(columns), {"w": jnp.asarray(w)}
    np.testing.assert_array_equal(f(weights, x), f(weights, x))
