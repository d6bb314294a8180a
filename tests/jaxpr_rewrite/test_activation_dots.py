"""Static scales for the matmuls between two activations: ``calibrate_activation_dots`` and
``int8ify(fn, activation_scales=...)`` against a numpy reference."""

import json
import sys
import warnings
from pathlib import Path

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from helpers import assert_same_bits_but_nan, evaluate_as, examples, platform_eqns
from jaxpr_rewrite import (ActivationScales, Int8ifyError, QuantizationWarning, calibrate_activation_dots, int8ify,
                           iter_eqns, quantize_params)
from jaxpr_rewrite import report
from jaxpr_rewrite._numerics.static_scales import StaticScale

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import speed  # noqa: E402

RNG = np.random.default_rng(11)

# the reference's einsum spec -> (dot_general dimension numbers, lhs and rhs shapes at scale n)
SPECS = {
    "mk,kn->mn": ((((1,), (0,)), ((), ())), lambda n: ((n, 2 * n), (2 * n, n + 3))),
    "bqd,bkd->bqk": ((((2,), (2,)), ((0,), (0,))), lambda n: ((2, n, n + 1), (2, n + 2, n + 1))),
    "bhqk,bkhd->bhqd": ((((3,), (1,)), ((0, 1), (0, 2))), lambda n: ((2, 3, n, n + 1), (2, n + 1, 3, n))),
    "kb,kn->bn": ((((0,), (0,)), ((), ())), lambda n: ((2 * n, n), (2 * n, n + 1))),
}


def einsum_fn(spec):
    """The matmul ``spec`` as one ``dot_general`` of ``a`` and ``b`` in that order (``jnp.einsum`` may swap them)."""
    def fn(params, a, b):
        return jax.lax.dot_general(a, b, SPECS[spec][0])

    return fn


def static_codes(x, amax):
    """The static-scale quantization in numpy: the scale ``amax / 127`` (held as mantissa / 127 times ``2**e``),
    codes by one multiply with its reciprocal, clipped; ``(codes, scale)``."""
    amax = np.float32(amax)
    e = np.floor(np.log2(amax)).astype(np.int32)
    scale = np.float32(amax * np.float32(2.0 ** -e)) / np.float32(127)
    reciprocal = np.float32(np.float32(2.0 ** -e) / scale)
    codes = np.clip(np.rint(x.astype(np.float32) * reciprocal), -127, 127).astype(np.int64)
    return codes, np.float64(scale) * 2.0 ** e


def reference(spec, a, b, amax):
    """Both operands quantized with their calibrated scales, exact integer sums, scaled in float64."""
    (a_codes, s_a), (b_codes, s_b) = static_codes(a, amax[0]), static_codes(b, amax[1])
    return np.einsum(spec, a_codes, b_codes) * s_a * s_b


def calibrated(spec, n, batches=2):
    shapes = SPECS[spec][1](n)
    calibration = [tuple(RNG.standard_normal(s).astype(np.float32) for s in shapes) for _ in range(batches)]
    scales = calibrate_activation_dots(einsum_fn(spec), {}, *calibration[0], calibration=calibration)
    return scales, calibration, shapes


@examples(12)
@given(spec=st.sampled_from(sorted(SPECS)), n=st.integers(1, 24), spread=st.floats(0.5, 4.0))
def test_a_dot_of_two_activations_matches_the_static_reference(spec, n, spread):
    scales, calibration, shapes = calibrated(spec, n)
    (dot,) = scales.dots
    assert dot.absmax == tuple(float(max(np.abs(c[side]).max() for c in calibration)) for side in (0, 1))
    a, b = (spread * RNG.standard_normal(s).astype(np.float32) for s in shapes)  # spread > 1: values saturate
    y = np.asarray(int8ify(einsum_fn(spec), activation_scales=scales)({}, a, b), np.float64)
    np.testing.assert_allclose(y, reference(spec, a, b, dot.absmax), rtol=2e-6, atol=1e-6)


def test_attention_sized_dots_match_the_reference_and_nan_reaches_only_its_outputs():
    spec = "bqd,bkd->bqk"
    scales, _, shapes = calibrated(spec, 128)
    a, b = (RNG.standard_normal(s).astype(np.float32) for s in shapes)
    a[0, 5, 7], b[1, 9, 0], b[1, 20, 128] = np.nan, np.inf, -np.inf
    y = np.asarray(jax.jit(int8ify(einsum_fn(spec), activation_scales=scales))({}, a, b), np.float64)
    bad = np.zeros(y.shape, bool)
    bad[0, 5, :] = True
    bad[1, :, [9, 20]] = True
    assert not np.isfinite(y[bad]).any() and np.isfinite(y[~bad]).all()
    a, b = np.nan_to_num(a, posinf=0, neginf=0), np.nan_to_num(b, posinf=0, neginf=0)
    np.testing.assert_allclose(y[~bad], reference(spec, a, b, scales.dots[0].absmax)[~bad], rtol=2e-6, atol=1e-6)


def block(params, x):
    return speed.block(params, x, heads=2)


@pytest.fixture(scope="module")
def transformer():
    params = speed.init_block(jax.random.PRNGKey(0), d=128, mlp_dim=512)
    calibration = [(jax.random.normal(jax.random.PRNGKey(i), (4, 32, 128)),) for i in (1, 2)]
    return params, calibration


def test_a_transformer_block_calibrates_its_attention_einsums_only(transformer):
    params, calibration = transformer
    scales = calibrate_activation_dots(block, params, *calibration[0], calibration=calibration)
    assert scales.n_dots == 8 and [d.position for d in scales.dots] == [3, 4]
    assert all("speed.py" in d.source for d in scales.dots)
    static = quantize_params(block, params, *calibration[0], activations="static", calibration=calibration)
    x = calibration[0][0]
    fn = int8ify(block, activation_scales=scales)
    jaxpr = fn.rewritten_jaxpr(static, x)
    float_names = [e.primitive.name for e in iter_eqns(jax.make_jaxpr(block)(params, x))]
    for platform in ("cpu", "cuda", "tpu"):
        names = [e.primitive.name for e in platform_eqns(jaxpr, platform)]
        # no absmax of any dot operand; on CPU the only max reductions left are the softmax's (a GPU takes each
        # row's factor from a maximum over its codes)
        assert names.count("abs") == float_names.count("abs")
        if platform == "cpu":
            assert names.count("reduce_max") == float_names.count("reduce_max")
    int8_dots = [e for e in iter_eqns(jaxpr) if e.primitive.name == "dot_general"
                 and e.invars[0].aval.dtype == jnp.int8]
    assert len(int8_dots) == 8
    y, y_float = np.asarray(jax.jit(fn)(static, x)), np.asarray(block(params, x))
    assert np.linalg.norm(y - y_float) / np.linalg.norm(y_float) < 0.05
    # the same scales serve weights quantized per call and float params
    np.testing.assert_allclose(np.asarray(fn(params, x)), y_float, rtol=0.1, atol=0.1)


def test_the_gradient_is_the_float_matmuls():
    spec = "bqd,bkd->bqk"
    scales, calibration, _ = calibrated(spec, 16)
    a, b = calibration[0]
    loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f({}, a, b)))  # noqa: E731
    quantized = jax.grad(loss(int8ify(einsum_fn(spec), activation_scales=scales)), argnums=(0, 1))(a, b)
    y = np.asarray(int8ify(einsum_fn(spec), activation_scales=scales)({}, a, b))
    # straight through: the float einsum's derivative, taken at the quantized output's sin'
    expected = jax.grad(lambda a, b: jnp.sum(jnp.cos(y) * jnp.einsum(spec, a, b)), argnums=(0, 1))(a, b)
    for got, want in zip(quantized, expected):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_report_measures_the_static_program():
    spec = "mk,kn->mn"
    scales, calibration, shapes = calibrated(spec, 64)
    a, b = (2 * RNG.standard_normal(s).astype(np.float32) for s in shapes)
    (row,) = report(int8ify(einsum_fn(spec), activation_scales=scales), {}, a, b).rows
    (dynamic,) = report(einsum_fn(spec), {}, a, b).rows
    want = np.asarray(np.einsum(spec, a.astype(np.float64), b.astype(np.float64)))
    expected = np.linalg.norm(reference(spec, a, b, scales.dots[0].absmax) - want) / np.linalg.norm(want)
    np.testing.assert_allclose(row.error, expected, rtol=1e-3)
    assert row.error > 2 * dynamic.error  # saturated at twice the calibrated range


def test_percentile_calibration_and_the_dict_round_trip():
    spec = "bqd,bkd->bqk"
    shapes = SPECS[spec][1](32)
    calibration = [tuple(RNG.standard_normal(s).astype(np.float32) for s in shapes)]
    fn = einsum_fn(spec)
    full = calibrate_activation_dots(fn, {}, *calibration[0])
    clipped = calibrate_activation_dots(fn, {}, *calibration[0], percentile=99.0)
    for side in (0, 1):
        want = np.percentile(np.abs(calibration[0][side]), 99.0)
        np.testing.assert_allclose(clipped.dots[0].absmax[side], want, rtol=1e-5)  # (interpolated in float32)
        assert clipped.dots[0].absmax[side] < full.dots[0].absmax[side]
    restored = ActivationScales.from_dict(json.loads(json.dumps(clipped.as_dict())))
    assert restored == clipped and hash(restored) == hash(clipped)
    a, b = calibration[0]
    np.testing.assert_array_equal(np.asarray(int8ify(fn, activation_scales=restored)({}, a, b)),
                                  np.asarray(int8ify(fn, activation_scales=clipped)({}, a, b)))


def test_dots_in_nested_jit_and_skipped_dots_keep_dynamic_scales():
    a, b = RNG.standard_normal((8, 64)).astype(np.float32), RNG.standard_normal((64, 8)).astype(np.float32)
    nested = lambda p, a, b: jax.jit(jnp.matmul)(a, b)  # noqa: E731
    assert calibrate_activation_dots(nested, {}, a, b).dots == ()

    def scoped(p, a, b):
        with jax.named_scope("attention"):
            return a @ b

    skipping = int8ify(scoped, skip="attention*")
    assert calibrate_activation_dots(skipping, {}, a, b).dots == ()
    assert len(calibrate_activation_dots(scoped, {}, a, b).dots) == 1


def test_scales_of_another_program_are_an_error():
    a, b = RNG.standard_normal((8, 64)).astype(np.float32), RNG.standard_normal((64, 8)).astype(np.float32)
    one = lambda p, a, b: a @ b  # noqa: E731
    two = lambda p, a, b: (a @ b) @ (b.T @ a.T)  # noqa: E731
    scales = calibrate_activation_dots(one, {}, a, b)
    with pytest.raises(Int8ifyError, match="calibrated on a program with 1 top-level float dot_general.*has 3"):
        int8ify(two, activation_scales=scales)({}, a, b)
    other = ActivationScales.from_dict({**scales.as_dict(), "dots": [
        {**scales.as_dict()["dots"][0], "dimension_numbers": [[[0], [1]], [[], []]]}]})
    with pytest.raises(Int8ifyError, match=r"do not fit the dot_general at .*test_activation_dots.py:\d+"):
        int8ify(one, activation_scales=other)({}, a, b)

    def scoped(p, a, b, swap):  # two dots of one shape, in the other order when swap is set
        names = ("keys", "values")[::-1 if swap else 1]
        outs = []
        for name, (x, y) in zip(names, ((a, b), (b.T, a.T))):
            with jax.named_scope(name):
                outs.append(x @ y)
        return outs

    wrapped = int8ify(scoped, static_argnames="swap")
    calibrated = calibrate_activation_dots(wrapped, {}, a, b, swap=False)
    assert [d.scope for d in calibrated.dots] == ["keys", "values"]
    wrapped.with_options(activation_scales=calibrated)({}, a, b, swap=False)
    with pytest.raises(Int8ifyError, match="name scope 'keys'"):
        wrapped.with_options(activation_scales=calibrated)({}, a, b, swap=True)


@pytest.mark.parametrize("options, message", [
    ({"activation_scales": {"n_dots": 1}}, "must be the ActivationScales"),
    ({"granularity": "per-tensor"}, "need backend='int8', granularity='per-channel' and no block_size"),
    ({"block_size": 32}, "need backend='int8', granularity='per-channel' and no block_size"),
])
def test_bad_options_are_errors(options, message):
    a = RNG.standard_normal((8, 64)).astype(np.float32)
    scales = calibrate_activation_dots(lambda p, a: a @ a.T, {}, a)
    with pytest.raises(Int8ifyError, match=message):
        int8ify(lambda p, a: a @ a.T, **{"activation_scales": scales, **options})


@pytest.mark.parametrize("calibration, what", [
    (lambda a: [a, a], r"not a list whose item 0 is an array of shape \(8, 64\) \(float32\)"),
    (lambda a: a, r"not an array of shape \(8, 64\) \(float32\)"),
    (lambda a: [1.0], r"not a list whose item 0 is a float"),
])
def test_calibration_of_arrays_instead_of_argument_tuples_is_an_error(calibration, what):
    """``tuple()`` of an array splits it into its rows, one argument each: the call failed with a count of
    arguments ("takes 2 positional arguments but 9 were given") that named neither calibration nor the cause."""
    a = RNG.standard_normal((8, 64)).astype(np.float32)
    with pytest.raises(Int8ifyError, match=rf"calibrate_activation_dots: calibration must be a sequence of argument "
                                           rf"tuples .* e\.g\. calibration=\[\(x1,\), \(x2,\)\], {what}"):
        calibrate_activation_dots(lambda p, a: a @ a.T, {}, a, calibration=calibration(a))


def test_bad_calibration_is_an_error():
    a = RNG.standard_normal((8, 64)).astype(np.float32)
    fn = lambda p, a: a @ a.T  # noqa: E731
    bad = a.copy()
    bad[2, 3] = np.nan
    with pytest.raises(Int8ifyError, match=r"operands of the dot_general at .*hold NaN or Inf"):
        calibrate_activation_dots(fn, {}, a, calibration=[(a,), (bad,)])
    with pytest.raises(Int8ifyError, match=r"percentile must be a number in \(0, 100\]"):
        calibrate_activation_dots(fn, {}, a, percentile=0)
    with pytest.raises(Int8ifyError, match="calibration holds no batch"):
        calibrate_activation_dots(fn, {}, a, calibration=[])
    with pytest.raises(Int8ifyError, match="not the dict ActivationScales.as_dict writes"):
        ActivationScales.from_dict({"dots": [{"position": 0}]})
    dot = {"position": 0, "dimension_numbers": [[[1], [0]], [[], []]], "ranks": [2, 2], "scope": "", "source": "x",
           "absmax": [1, 1]}
    for dots, n_dots in (([dot, dot], 2), ([{**dot, "position": 1}], 1)):
        with pytest.raises(Int8ifyError, match="must be distinct and below the program's"):
            ActivationScales.from_dict({"n_dots": n_dots, "dots": dots})
    with pytest.raises(Int8ifyError, match="must be finite and non-negative"):
        ActivationScales.from_dict({"n_dots": 1, "dots": [{**dot, "absmax": [-1, 1]}]})
    # the smallest absmax a static scale takes depends on the operands' dtype: checked where the program gives it
    tiny = ActivationScales.from_dict({"n_dots": 1, "dots": [{**dot, "absmax": [1e-38, 1]}]})
    with pytest.raises(Int8ifyError, match=r"absmax of the lhs of the dot at x is 1e-38, below 3.76e-37, the smallest "
                                           r"a static scale of float32 values takes"):
        int8ify(fn, activation_scales=tiny)({}, a)


def test_an_all_zero_operand_in_calibration_warns_naming_the_dot():
    """Its static scale is the contract's 1 for an all-zero slice, which rounds every later value below 0.5 to 0;
    quantize_params warned about it, calibrate_activation_dots did not."""
    a = RNG.standard_normal((8, 64)).astype(np.float32)
    fn = lambda p, a: a @ a.T  # noqa: E731
    with pytest.warns(QuantizationWarning, match=r"dot_general\(s\) at .*test_activation_dots.py:\d+ .*all zero"):
        scales = calibrate_activation_dots(fn, {}, a, calibration=[(np.zeros_like(a),)])
    assert [dot.absmax for dot in scales.dots] == [(0.0, 0.0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calibrate_activation_dots(fn, {}, a, calibration=[(np.zeros_like(a),), (a,)])


def test_half_precision_operands_and_calibration_batches_of_other_shapes():
    spec = "bqd,bkd->bqk"
    fn = einsum_fn(spec)
    batches = [tuple(RNG.standard_normal((b, 16, 64)).astype(np.float32) for _ in range(2)) for b in (2, 5)]
    as_bf16 = [tuple(jnp.asarray(x, jnp.bfloat16) for x in batch) for batch in batches]
    scales = calibrate_activation_dots(fn, {}, *as_bf16[0], calibration=as_bf16)
    (dot,) = scales.dots  # the largest |x| over both programs
    assert dot.absmax == tuple(float(max(jnp.abs(b[side]).max() for b in as_bf16)) for side in (0, 1))
    a, b = (jnp.asarray(RNG.standard_normal((3, 16, 64)), jnp.bfloat16) for _ in range(2))
    y = int8ify(fn, activation_scales=scales)({}, a, b)
    assert y.dtype == jnp.bfloat16
    want = reference(spec, np.asarray(a, np.float32), np.asarray(b, np.float32), dot.absmax)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-2, atol=1e-2)  # bf16 output rounding


def test_a_weight_passed_through_a_jitted_helper_beside_the_activation_is_still_a_weight():
    @jax.jit
    def project(w, x):
        return w, x @ w

    def fn(params, x):
        w, h = project(params["w"], x)
        return (h @ w.T) @ (h.T @ h)  # a dot with the weight, then two between activations

    params = {"w": RNG.standard_normal((64, 64)).astype(np.float32)}
    x = RNG.standard_normal((8, 64)).astype(np.float32)
    scales = calibrate_activation_dots(fn, params, x)
    assert scales.n_dots == 3 and [d.position for d in scales.dots] == [1, 2]


def test_quantized_params_calibrate_as_the_values_they_stand_for(transformer):
    from jaxpr_rewrite._quantized.array import is_quantized, materialise

    params, calibration = transformer
    qparams = quantize_params(block, params, *calibration[0])
    values = jax.tree_util.tree_map(materialise, qparams, is_leaf=is_quantized)
    from_quantized = calibrate_activation_dots(block, qparams, *calibration[0], calibration=calibration)
    assert from_quantized == calibrate_activation_dots(block, values, *calibration[0], calibration=calibration)


@pytest.mark.usefixtures("every_platform_programs")
def test_tpu_finds_nan_in_both_activations_by_their_codes():
    """A TPU marks an activation's NaN/Inf slices with a sum over its values only where the activation feeds a
    weight's dot; both operands of a dot of two activations keep the minimum over their codes (XLA:TPU made that sum
    a pass of its own over the attention's operands), and the program is the CPU's, bit for bit."""
    scales, calibration, shapes = calibrated("bqd,bkd->bqk", 16)
    fn = int8ify(einsum_fn("bqd,bkd->bqk"), activation_scales=scales)
    a, b = (RNG.standard_normal(s).astype(np.float32) for s in shapes)
    a[1, 3, 0], b[0, 5, 2] = np.nan, np.inf
    jaxpr = jax.make_jaxpr(fn)({}, a, b)
    names = [e.primitive.name for e in iter_eqns(jaxpr, platform="tpu")]
    # (its sums are the masked sums that read each operand's stored scale fields on TPU)
    assert names.count("reduce_min") == 2 and names.count("reduce_sum") == 2 * len(StaticScale._fields)
    want = np.asarray(jax.jit(fn)({}, a, b))
    (got,) = evaluate_as("tpu", fn, {}, a, b)
    assert np.isnan(want).any()
    assert_same_bits_but_nan(got, want)
