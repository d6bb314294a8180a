"""Static activation scales: ``quantize_params(activations="static")`` against a numpy reference."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from helpers import assert_same_bits_but_nan, evaluate_as, examples, platform_eqns
from jaxpr_rewrite._core import platforms
from hypothesis import given
from hypothesis import strategies as st
from jaxpr_rewrite import Int8ifyError, QuantizationWarning, int8ify, quantize_params

ss = importlib.import_module("jaxpr_rewrite._numerics.static_scales")

RNG = np.random.default_rng(7)


def dense(params, x):
    return x @ params["w"]


def mlp(params, x):
    return jax.nn.relu(x @ params["w1"]) @ params["w2"]


def attention_inputs(params, x):
    return (x @ params["wq"]) + (x @ params["wk"]) * (x @ params["wv"])


def static_reference(x, w, amax):
    """The static-scale int8 dot in numpy: one activation scale ``amax / 127`` (held as mantissa / 127 times
    ``2**e``), codes by one multiply with its reciprocal, per-column weight scales, exact integer sums."""
    amax = np.float32(amax)
    e = np.floor(np.log2(amax)).astype(np.int32)
    scales = np.float32(amax * np.float32(2.0 ** -e)) / np.float32(127)
    reciprocal = np.float32(np.float32(2.0 ** -e) / scales)
    x_codes = np.clip(np.rint(x.astype(np.float32) * reciprocal), -127, 127).astype(np.int64)
    s_x = np.float64(scales) * 2.0 ** e
    w_amax = np.abs(w).max(axis=0)
    s_w = np.where(w_amax == 0, 1.0, w_amax.astype(np.float64) / 127)
    w_codes = np.clip(np.rint(w / s_w.astype(np.float32)), -127, 127).astype(np.int64)
    return (x_codes @ w_codes) * s_x * s_w


def make_dense(d_in=384, d_out=256, batch=64):
    params = {"w": (RNG.standard_normal((d_in, d_out)) / np.sqrt(d_in)).astype(np.float32)}
    calibration = [(RNG.standard_normal((batch, d_in)).astype(np.float32),) for _ in range(3)]
    return params, calibration


def test_static_scale_is_the_calibration_absmax_and_matches_the_reference():
    params, calibration = make_dense()
    qparams = quantize_params(dense, params, *calibration[0], activations="static", calibration=calibration)
    expected = max(np.abs(c[0]).max() for c in calibration)
    assert float(qparams["w"].static_scale.absmax) == expected
    x = RNG.standard_normal((64, 384)).astype(np.float32)
    y = np.asarray(jax.jit(int8ify(dense))(qparams, x), np.float64)
    np.testing.assert_allclose(y, static_reference(x, params["w"], expected), rtol=2e-6, atol=1e-6)


def test_values_beyond_the_calibrated_range_saturate():
    params, calibration = make_dense()
    qparams = quantize_params(dense, params, *calibration[0], activations="static", calibration=calibration)
    amax = float(qparams["w"].static_scale.absmax)
    x = RNG.standard_normal((64, 384)).astype(np.float32)
    x[:8] *= 10  # well outside the calibrated range: their codes clip at +-127
    y = np.asarray(jax.jit(int8ify(dense))(qparams, x), np.float64)
    np.testing.assert_allclose(y, static_reference(x, params["w"], amax), rtol=2e-6, atol=1e-6)
    assert not np.allclose(y[:8], (x[:8].astype(np.float64) @ params["w"]), rtol=0.2)


def test_nan_and_inf_still_propagate_only_to_the_outputs_they_feed():
    params, calibration = make_dense()
    qparams = quantize_params(dense, params, *calibration[0], activations="static", calibration=calibration)
    x = RNG.standard_normal((64, 384)).astype(np.float32)
    x[3, 10], x[5, 0], x[9, 383] = np.nan, np.inf, -np.inf
    y = np.asarray(jax.jit(int8ify(dense))(qparams, x))
    bad = {3, 5, 9}
    for row in range(64):
        assert (not np.isfinite(y[row]).any()) if row in bad else np.isfinite(y[row]).all()
    finite = [r for r in range(64) if r not in bad]
    amax = float(qparams["w"].static_scale.absmax)
    np.testing.assert_allclose(y[finite], static_reference(x[finite], params["w"], amax), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 384), (1, 1, 384)])
def test_a_single_row_gets_the_outputs_it_gets_among_other_rows(shape):
    """One row (batch-1 inference, whose check for NaN and Inf reads the codes padded to two rows, as the int8 dot
    does) gives the outputs the many-row program gives it, bit for bit, NaN for a row holding NaN or Inf."""
    params, calibration = make_dense()
    qparams = quantize_params(dense, params, *calibration[0], activations="static", calibration=calibration)
    x = RNG.standard_normal((6, 384)).astype(np.float32)
    x[1] = RNG.integers(-300, 300, size=384) / 4.0  # rich in rounding ties
    x[3, 10], x[4, 0], x[5, 383] = np.nan, np.inf, -np.inf
    program = jax.jit(int8ify(dense))
    many = np.asarray(program(qparams, x))
    for row in range(6):
        one = np.asarray(program(qparams, x[row].reshape(shape))).reshape(-1)
        assert_same_bits_but_nan(one, many[row])
        assert np.isnan(one).all() == (row >= 3)


@pytest.mark.parametrize("layout", ["sequence", "heads", "contraction first"])
def test_activations_of_higher_rank_match_the_reference(layout):
    d_in, d_out = 384, 256
    fn, shape, rows = {
        "sequence": (dense, (4, 16, d_in), lambda x: x.reshape(-1, d_in)),
        "heads": (dense, (2, 3, 8, d_in), lambda x: x.reshape(-1, d_in)),
        "contraction first": (lambda p, x: jnp.einsum("dbs,df->bsf", x, p["w"]), (d_in, 4, 16),
                              lambda x: x.reshape(d_in, -1).T),
    }[layout]
    params = {"w": (RNG.standard_normal((d_in, d_out)) / np.sqrt(d_in)).astype(np.float32)}
    calibration = [(RNG.standard_normal(shape).astype(np.float32),) for _ in range(2)]
    qparams = quantize_params(fn, params, *calibration[0], activations="static", calibration=calibration)
    amax = float(qparams["w"].static_scale.absmax)
    x = RNG.standard_normal(shape).astype(np.float32)
    x.flat[[5, 700, 2000]] = np.nan, np.inf, -np.inf
    y = np.asarray(jax.jit(int8ify(fn))(qparams, x), np.float64).reshape(-1, d_out)
    flat = rows(x)
    bad = ~np.isfinite(flat).all(axis=1)
    assert bad.sum() == 3 and not np.isfinite(y[bad]).any() and np.isfinite(y[~bad]).all()
    np.testing.assert_allclose(y[~bad], static_reference(flat[~bad], params["w"], amax), rtol=2e-6, atol=1e-6)
    if layout != "contraction first":
        # quantized once, as a matrix: XLA:CPU's dot reads the codes as one, and with the NaN check reading them
        # in the activation's own shape XLA computed them twice (a contraction-first one is transposed for the dot)
        compiled = jax.jit(int8ify(fn)).lower(qparams, x).compile().as_text()
        assert compiled.count("round-nearest-even(") == 1


@pytest.mark.usefixtures("every_platform_programs")
def test_the_hot_path_has_no_absmax_reduction():
    params, calibration = make_dense()
    dynamic = quantize_params(dense, params, *calibration[0])
    static = quantize_params(dense, params, *calibration[0], activations="static", calibration=calibration)

    def primitives(qparams, platform):
        jaxpr = int8ify(dense).rewritten_jaxpr(qparams, calibration[0][0])
        return [e.primitive.name for e in platform_eqns(jaxpr, platform)]

    for platform in ("cpu", "cuda", "tpu"):
        assert "abs" in primitives(dynamic, platform) and "abs" not in primitives(static, platform)
        assert primitives(static, platform).count("dot_general") == 1
    # a GPU's one maximum is over the codes (each slice's factor, Inf where a code marks NaN or Inf)
    assert [primitives(static, platform).count("reduce_max") for platform in ("cpu", "cuda", "tpu")] == [0, 1, 0]


@pytest.mark.usefixtures("every_platform_programs")
def test_the_codes_rounding_is_their_conversions_operand():
    """The static codes are clipped and marked (-128 for NaN and Inf) before they are rounded, so that the rounding
    is the int8 conversion's operand, which XLA:TPU folds into the conversion; a clip or select between the two made
    the TPU round and then convert in thirteen vector operations (the static MLP at d 4096 ran 4% slower on a v5e
    chip, ``benchmarks/results/tpu-v5-lite.md``)."""
    params, calibration = make_dense()
    static = quantize_params(dense, params, *calibration[0], activations="static", calibration=calibration)
    jaxpr = int8ify(dense).rewritten_jaxpr(static, calibration[0][0])
    for platform in ("cpu", "cuda", "tpu"):
        eqns = list(platform_eqns(jaxpr, platform))
        producers = {id(out): e for e in eqns for out in e.outvars}
        conversions = [e for e in eqns if e.primitive.name == "convert_element_type"
                       and e.params["new_dtype"] == np.int8]
        assert conversions, platform
        for conversion in conversions:
            producer = producers.get(id(conversion.invars[0]))
            assert producer is not None and producer.primitive.name == "round", (platform, producer)


@pytest.mark.usefixtures("every_platform_programs")
@pytest.mark.parametrize("layout, tpu_marks", [("matrix", False), ("sequence", True)])
def test_only_codes_whose_nan_check_reads_them_are_marked(layout, tpu_marks):
    """A value that is NaN or Inf gets the code -128 where the slice's NaN check reads the codes (CPU, GPU, and a TPU's
    operands of rank 3 or more), and no mark where a TPU finds it in a sum over the values (a matrix): marking takes
    two vector operations per element (the static MLP at d 4096: 1.6-1.8% of its time on a v5e chip,
    ``benchmarks/results/tpu-v5-lite.md``, the eighteenth run)."""
    fn, qparams, x, _ = _static_case(layout)
    jaxpr = int8ify(fn).rewritten_jaxpr(qparams, x)
    for platform in ("cpu", "cuda", "tpu"):
        marks = sum(e.primitive.name == "is_finite" and e.invars[0].aval.size == x.size
                    for e in platform_eqns(jaxpr, platform))  # (not the scale's own, of one value)
        assert (marks > 0) == (platform != "tpu" or tpu_marks), (platform, marks)


@pytest.mark.parametrize("amax", [0.0, 2.0**-121, 1e-30, 0.7, 3.0, 127.0, 1e30, float(np.finfo(np.float32).max)])
def test_the_stored_scale_reads_the_same_on_every_platform(amax):
    """A weight's stored static scale is read by slices (CPU, GPU) or, on TPU, by masked sums of its vector (XLA:TPU
    makes a kernel of each slice): the same fields, bit for bit, over the whole range of calibrated absmaxes."""
    vector = jax.jit(lambda a: ss.StaticScale.of(a).stored())(np.float32(amax))
    count = len(ss.StaticScale._fields)
    by_masks = jax.jit(lambda v: ss.fields_by_masks(v, count))(vector)
    by_slices = jax.jit(lambda v: ss.fields_by_slices(v, count))(vector)
    for masked, sliced in zip(by_masks, by_slices):
        assert np.asarray(masked).tobytes() == np.asarray(sliced).tobytes()
    np.testing.assert_array_equal(np.asarray(by_slices), np.asarray(vector))


@pytest.mark.usefixtures("every_platform_programs")
def test_tpu_reads_the_stored_scale_without_slices():
    params, calibration = make_dense()
    static = quantize_params(dense, params, *calibration[0], activations="static", calibration=calibration)
    jaxpr = jax.make_jaxpr(int8ify(dense))(static, calibration[0][0])

    def slices(platform):
        return sum(e.primitive.name in ("slice", "squeeze") for e in platform_eqns(jaxpr, platform))

    assert slices("tpu") == 0 and slices("cpu") == slices("cuda") > 0


@pytest.mark.usefixtures("every_platform_programs")
def test_tpu_and_gpu_mark_nan_and_inf_rows_in_the_quantizations_own_reduction():
    """On TPU a row's factor, NaN for a row holding NaN or Inf, is the output of one sum over the activation, and on a
    GPU (Inf there) of one maximum over its codes: XLA:TPU and XLA:GPU make a kernel of their own of the per-row work
    after a minimum over the codes, which the CPU keeps."""
    params, calibration = make_dense()
    static = quantize_params(dense, params, *calibration[0], activations="static", calibration=calibration)
    jaxpr = jax.make_jaxpr(int8ify(dense))(static, calibration[0][0])

    def reductions(platform):
        names = [e.primitive.name for e in platform_eqns(jaxpr, platform)]
        return names.count("reduce_min"), names.count("reduce_sum"), names.count("reduce_max")

    assert reductions("cpu") == (1, 0, 0)
    assert reductions("cuda") == (0, 0, 1)
    # the masked sums that read the stored scale's fields, and the row marks
    assert reductions("tpu") == (0, len(ss.StaticScale._fields) + 1, 0)


def _static_case(layout):
    """A dense (or contraction-first einsum) of a weight with a static activation scale, and an input of ``layout``
    holding NaN, Inf, -0 and a value beyond the calibrated range."""
    d_in, d_out = 384, 256
    fn, shape = {
        "matrix": (dense, (64, d_in)),
        "sequence": (dense, (4, 16, d_in)),
        "heads": (dense, (2, 3, 8, d_in)),
        "contraction first": (lambda p, x: jnp.einsum("dbs,df->bsf", x, p["w"]), (d_in, 4, 16)),
    }[layout]
    params = {"w": (RNG.standard_normal((d_in, d_out)) / np.sqrt(d_in)).astype(np.float32)}
    calibration = [(RNG.standard_normal(shape).astype(np.float32),)]
    qparams = quantize_params(fn, params, *calibration[0], activations="static", calibration=calibration)
    x = RNG.standard_normal(shape).astype(np.float32)
    x.flat[[5, 700, 2000, 2001]] = np.nan, np.inf, -np.inf, np.inf
    x.flat[3000:3100] = -0.0
    x.flat[4000] = 50.0  # beyond the calibrated range: saturates
    return fn, qparams, x, d_out


@pytest.mark.parametrize("layout", ["matrix", "sequence", "heads", "contraction first"])
def test_gpu_program_with_static_scales_is_the_cpus_but_inf_for_nan_rows(layout):
    """A GPU's static quantization (each slice's factor the maximum of ``factor`` or Inf over its codes) gives the
    CPU's outputs bit for bit wherever they are finite, and non-finite outputs (Inf or NaN) exactly where a slice
    holds NaN or Inf."""
    fn, qparams, x, d_out = _static_case(layout)
    want = np.asarray(jax.jit(int8ify(fn))(qparams, x))
    (got,) = evaluate_as("cuda", int8ify(fn), qparams, x)
    got = np.asarray(got)
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite)
    assert got[finite].tobytes() == want[finite].tobytes()
    assert 0 < (~finite).any(axis=-1).sum() < want.size // d_out
    assert np.isinf(got[~finite]).any()  # the GPU's factor is Inf, not NaN: rows of nonzero sums are Inf


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
def test_a_slice_of_nothing_has_a_finite_factor(platform):
    """An empty contraction's slices hold no NaN: their factor is finite on every platform (a maximum over nothing
    would be -Inf, and their zero sums would scale to NaN): the static one on CPU and GPU, the TPU's sum of nothing
    on TPU."""
    static = ss.StaticScale.of(np.float32(3.0))
    x = np.zeros((8, 0), np.float32)

    def factors(v):
        return platforms.current().quantize_static(v, static, reduce_axes=(1,), sums_values=True)[3][0]

    (got,) = evaluate_as(platform, factors, x)
    want = np.float32(0) if platform == "tpu" else np.asarray(static.factor)
    np.testing.assert_array_equal(np.asarray(got), np.full(8, want, np.float32))


@pytest.mark.parametrize("layout", ["matrix", "sequence", "contraction first"])
def test_tpu_program_with_static_scales_is_the_cpus_bit_for_bit(layout):
    fn, qparams, x, d_out = _static_case(layout)
    want = np.asarray(jax.jit(int8ify(fn))(qparams, x))
    (got,) = evaluate_as("tpu", int8ify(fn), qparams, x)
    assert_same_bits_but_nan(got, want)
    assert 0 < (~np.isfinite(want)).any(axis=-1).sum() < want.size // d_out


@examples(60)
@given(st.data())
def test_sum_with_nonfinite_is_the_value_or_nan_per_slice(data):
    shape = tuple(data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=4), label="shape"))
    reduce_axes = tuple(sorted(data.draw(st.sets(st.integers(0, len(shape) - 1)), label="reduce_axes")))
    value = np.float32(data.draw(st.floats(2.0**-126, 2.0**127, width=32), label="value"))
    values = np.asarray(data.draw(st.lists(st.sampled_from([0.0, -0.0, 1.5, -3.0, 1e38, -1e-38, 2.0**-120]),
                                           min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))),
                        np.float32).reshape(shape)
    for special in data.draw(st.lists(st.sampled_from([np.nan, np.inf, -np.inf]), max_size=3), label="specials"):
        if values.size:
            values.flat[data.draw(st.integers(0, values.size - 1))] = special
    got = np.asarray(jax.jit(lambda v: ss._sum_with_nonfinite(v, value, reduce_axes))(values))
    empty = any(shape[a] == 0 for a in reduce_axes)
    nonfinite = ~np.isfinite(values).all(axis=reduce_axes) if reduce_axes else ~np.isfinite(values)
    want = np.where(nonfinite, np.float32(np.nan), np.float32(0 if empty else value))
    assert_same_bits_but_nan(got, want)


def test_percentile_calibration():
    params, calibration = make_dense()
    qparams = quantize_params(dense, params, *calibration[0], activations="static", calibration=calibration,
                              activation_percentile=99.0)
    expected = max(np.percentile(np.abs(c[0]), 99.0) for c in calibration)
    np.testing.assert_allclose(float(qparams["w"].static_scale.absmax), expected, rtol=1e-6)
    assert float(qparams["w"].static_scale.absmax) < max(np.abs(c[0]).max() for c in calibration)


@pytest.mark.usefixtures("every_platform_programs")
def test_weights_reading_one_activation_share_its_quantization():
    d = 256
    params = {n: (RNG.standard_normal((d, d)) / 16).astype(np.float32) for n in ("wq", "wk", "wv")}
    x = RNG.standard_normal((32, d)).astype(np.float32)
    qparams = quantize_params(attention_inputs, params, x, activations="static")
    assert len({qparams[n].activation_group for n in params}) == 1
    assert len({float(qparams[n].static_scale.absmax) for n in params}) == 1
    jaxpr = int8ify(attention_inputs).rewritten_jaxpr(qparams, x)
    for platform in ("cpu", "cuda", "tpu"):  # one per dot, with one scale:
        assert [e.primitive.name for e in platform_eqns(jaxpr, platform)].count("round") == 3, platform
    compiled = jax.jit(int8ify(attention_inputs)).lower(qparams, x).compile().as_text()
    assert compiled.count("round-nearest-even(") == 1  # XLA keeps one quantization
    y = np.asarray(jax.jit(int8ify(attention_inputs))(qparams, x), np.float64)
    amax = float(np.abs(x).max())
    ref = static_reference(x, params["wq"], amax) + (static_reference(x, params["wk"], amax)
                                                     * static_reference(x, params["wv"], amax))
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_static_scales_compose_with_smoothquant():
    d = 256
    params = {"w1": (RNG.standard_normal((d, 512)) / 16).astype(np.float32),
              "w2": (RNG.standard_normal((512, 64)) / 16).astype(np.float32)}
    x = RNG.standard_normal((64, d)).astype(np.float32)
    x[:, 5] *= 40  # an outlier channel
    qparams = quantize_params(mlp, params, x, smooth_alpha=0.5, activations="static")
    w1 = qparams["w1"]
    assert w1.smooth is not None
    inverse = (np.float32(1) / np.asarray(w1.smooth, np.float32)).astype(np.float32)
    np.testing.assert_allclose(float(w1.static_scale.absmax), np.abs(x * inverse).max(), rtol=1e-6)
    y = np.asarray(jax.jit(int8ify(mlp))(qparams, x))
    ref = np.asarray(mlp(params, x))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.05


def test_weights_outside_top_level_dots_keep_dynamic_scales():
    d = 128
    stacked = {"w": (RNG.standard_normal((4, d, d)) / 12).astype(np.float32)}

    def scanned(params, x):
        return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params["w"])[0]

    x = RNG.standard_normal((16, d)).astype(np.float32)
    qparams, why = quantize_params(scanned, stacked, x, activations="static", explain=True)
    assert qparams["w"].activation_scale is None
    assert "dynamic activation scales" in why["['w']"] and "top-level" in why["['w']"]
    np.testing.assert_array_equal(jax.jit(int8ify(scanned))(qparams, x),
                                  jax.jit(int8ify(scanned))(quantize_params(scanned, stacked, x), x))


def test_static_scales_survive_tree_maps_and_casts():
    params, calibration = make_dense()
    qparams = quantize_params(dense, params, *calibration[0], activations="static", calibration=calibration)
    copied = jax.tree_util.tree_map(lambda a: a, qparams)
    x = calibration[1][0]
    np.testing.assert_array_equal(jax.jit(int8ify(dense))(copied, x), jax.jit(int8ify(dense))(qparams, x))
    assert copied["w"].astype(jnp.bfloat16).activation_scale is copied["w"].activation_scale


@pytest.mark.parametrize("options, message", [
    ({"activations": "calibrated"}, "activations must be one of"),
    ({"activation_percentile": 99.0}, "pass activations='static'"),
    ({"activations": "static", "activation_percentile": 0}, "activation_percentile must be a number"),
    ({"activations": "static", "activation_percentile": True}, "activation_percentile must be a number"),
])
def test_bad_options_are_named(options, message):
    params, calibration = make_dense()
    with pytest.raises(Int8ifyError, match=message):
        quantize_params(dense, params, *calibration[0], **options)


@pytest.mark.parametrize("smooth_alpha", [None, 0.5])
def test_calibration_of_arrays_instead_of_argument_tuples_is_an_error(smooth_alpha):
    """``calibration=[x]`` or ``calibration=x`` (arrays, not argument tuples) failed with "dense() takes 2
    positional arguments but 65 were given" (``tuple()`` split each array into its rows)."""
    params, calibration = make_dense()
    x = calibration[0][0]
    for bad, what in (([x, x], r"a list whose item 0 is an array of shape \(64, 384\) \(float32\)"),
                      (x, r"an array of shape \(64, 384\) \(float32\)")):
        with pytest.raises(Int8ifyError, match=rf"quantize_params: calibration must be a sequence of argument tuples "
                                               rf".*, not {what}; wrap each batch's arguments in a tuple"):
            quantize_params(dense, params, x, activations="static", calibration=bad, smooth_alpha=smooth_alpha)


@pytest.mark.parametrize("options", [dict(activations="static"), dict(smooth_alpha=0.5),
                                     dict(activations="static", smooth_alpha=0.5)])
def test_calibration_without_a_batch_is_an_error(options):
    """An empty list, or a generator already consumed, gave dynamic scales and no SmoothQuant factors, silently."""
    params, calibration = make_dense()
    x = calibration[0][0]
    consumed = ((x,) for _ in range(2))
    list(consumed)
    for empty, kind in (([], "list"), (consumed, "generator")):
        with pytest.raises(Int8ifyError, match=rf"quantize_params: calibration holds no batch \(an empty {kind}"):
            quantize_params(dense, params, x, calibration=empty, **options)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("options, what", [(dict(activations="static"), "no static scale"),
                                           (dict(smooth_alpha=0.5), "no SmoothQuant factors")])
def test_nonfinite_calibration_data_is_an_error_naming_the_leaf(value, options, what):
    """SmoothQuant measured such a channel's absmax as NaN or Inf and gave it the factor 1, silently."""
    params, calibration = make_dense()
    good = calibration[0][0]
    bad = good.copy()
    bad[3, 5] = value
    with pytest.raises(Int8ifyError, match=rf"\['w'\]'s matmuls hold NaN or Inf on the calibration inputs, so {what}"):
        quantize_params(dense, params, good, calibration=[(good,), (bad,)], **options)


def test_calibration_too_small_for_a_static_scale_is_an_error_naming_the_leaf():
    """Below 2**-121 a static scale's reciprocal (the hot path's one multiply) overflows and every code would
    saturate: a clear error instead, naming the weight; 2**-121 itself quantizes like the reference."""
    params, _ = make_dense(d_in=64, d_out=8, batch=4)
    tiny = np.full((4, 64), 2e-37, np.float32)
    with pytest.raises(Int8ifyError, match=r"\['w'\].*absmax of 2e-37.*below 3.76e-37"):
        quantize_params(dense, params, tiny, activations="static")
    smallest = np.full((4, 64), 2.0**-121, np.float32)
    q = quantize_params(dense, params, smallest, activations="static")
    x = (smallest * np.random.default_rng(3).uniform(-1, 1, smallest.shape)).astype(np.float32)
    x[np.abs(x) < np.finfo(np.float32).tiny] = 0  # XLA reads subnormal inputs as zero (README)
    # (and flushes subnormal results: outputs below float32's normal range may come out 0)
    np.testing.assert_allclose(np.asarray(jax.jit(int8ify(dense))(q, x), np.float64),
                               static_reference(x, params["w"], 2.0**-121), rtol=1e-6,
                               atol=np.finfo(np.float32).tiny)


def test_all_zero_calibration_warns_naming_the_leaf():
    """Activations all zero on the calibration inputs give the contract's scale 1 (an all-zero slice), which at
    inference rounds every activation below 0.5 to 0: a QuantizationWarning names the weight."""
    params, _ = make_dense(d_in=64, d_out=8, batch=4)
    zeros = np.zeros((4, 64), np.float32)
    with pytest.warns(QuantizationWarning, match=r"\['w'\]'s matmuls were all zero on the calibration inputs"):
        q = quantize_params(dense, params, zeros, activations="static")
    np.testing.assert_array_equal(np.asarray(jax.jit(int8ify(dense))(q, zeros)), 0)


def test_report_measures_the_static_scale_error_per_dot():
    from jaxpr_rewrite import report

    params, calibration = make_dense()
    static = quantize_params(dense, params, *calibration[0], activations="static", calibration=calibration)
    x = calibration[1][0]
    x[:4] *= 10  # beyond the calibrated range: the static program saturates there, the dynamic one does not
    (dynamic_row,) = report(int8ify(dense), params, x).rows
    (static_row,) = report(int8ify(dense), static, x).rows
    amax = float(static["w"].static_scale.absmax)
    reference = x.astype(np.float64) @ np.asarray(static["w"].materialise()).astype(np.float64)
    want = np.linalg.norm(static_reference(x, params["w"], amax) - reference) / np.linalg.norm(reference)
    np.testing.assert_allclose(static_row.error, want, rtol=1e-3)
    assert static_row.error > 3 * dynamic_row.error
