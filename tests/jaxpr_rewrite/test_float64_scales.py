"""A GPU's quantization of a matrix operand, the scale taken inside the absmax reduction in float64
(``float64_scales.quantize_by_float64``), computed on this CPU (the same float64 arithmetic): the contract's codes,
scales and exponents bit for bit, and epilogue factors whose epilogue is the contract's."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from helpers import evaluate_as, platform_eqns, reference_codes, reference_scale_parts
from jaxpr_rewrite import int8ify
from jaxpr_rewrite.float64_scales import quantize_by_float64
from jaxpr_rewrite.quantize import epilogue_factors, scale_product

TINY = np.finfo(np.float32).tiny
ALL_ONES = np.float32(2 - 2.0**-23)  # the mantissa whose scale, fl(2 / 127), is also the next binade's smallest


@st.composite
def matrices(draw):
    rows, cols = draw(st.sampled_from([(1, 64), (8, 256), (64, 128), (3, 1024)]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "quarters", "bfloat16", "tiny", "huge", "top", "binades", "powers",
                                 "all ones"]))
    x = rng.normal(size=(rows, cols))
    if kind == "quarters":  # rich in rounding ties
        x = rng.integers(-300, 300, size=(rows, cols)) / 4.0
    elif kind == "bfloat16":
        x = np.array(jnp.asarray(x * 3, jnp.bfloat16).astype(jnp.float32))
    elif kind in ("tiny", "huge"):  # scales below float32's normal range; near its top
        x = x * 2.0 ** (-120 if kind == "tiny" else 120)
    elif kind == "top":  # absmax in the top binade, where the exponent is kept one lower
        x = rng.uniform(-1, 1, size=(rows, cols)) * 3.4e38
    elif kind == "binades":  # each row in another binade, over the whole normal range
        x = x * 2.0 ** rng.integers(-125, 127, size=(rows, 1))
    elif kind in ("powers", "all ones"):  # absmax exactly 2**e, or the float32 below it
        peak = 2.0 ** rng.integers(-120, 120, size=rows)
        x = rng.uniform(-0.5, 0.5, size=(rows, cols)) * peak[:, None]
        x[:, 0] = (peak if kind == "powers" else peak * ALL_ONES / 2).astype(np.float32)
    x = np.array(x, np.float32)
    x[np.abs(x) < TINY] = 0.0  # XLA reads subnormal inputs as zero (README)
    if draw(st.booleans()):
        x[draw(st.integers(0, rows - 1))] = 0.0  # an all-zero slice
    bad_rows = draw(st.sets(st.integers(0, rows - 1), max_size=2))
    for r in bad_rows:
        x[r, draw(st.integers(0, cols - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return x, sorted(bad_rows)


@settings(max_examples=60, deadline=None)
@given(matrices(), st.booleans())
def test_codes_scales_and_exponents_are_the_contracts(case, transposed):
    x, bad_rows = case
    axis = 0 if transposed else 1
    x = x.T if transposed else x
    codes, scales, exponents, (factor, power) = jax.jit(lambda v: quantize_by_float64(v, (axis,)))(x)
    codes, scales, exponents = np.asarray(codes), np.asarray(scales), np.asarray(exponents)
    with np.errstate(invalid="ignore"):  # the reference's codes of a non-finite slice are not compared
        want_codes = reference_codes(x, (axis,))
        want_scales, want_exponents = reference_scale_parts(x, (axis,))
    finite = np.ones(x.shape[1 - axis], bool)
    finite[bad_rows] = False
    take = (lambda a: a[:, finite]) if transposed else (lambda a: a[finite])
    np.testing.assert_array_equal(take(codes), take(want_codes))
    # one scale, fl(2 / 127) * 2**(e - 1), stands for the absmax just below 2**e too: split as 2**e's
    amax = np.max(np.abs(x), axis=axis)
    below_a_power = finite & (np.frexp(amax)[0] * 2 == ALL_ONES)
    want_scales = np.where(below_a_power, want_scales / 2, want_scales)
    want_exponents = np.where(below_a_power, want_exponents + 1, want_exponents)
    np.testing.assert_array_equal(scales[finite], want_scales[finite])
    np.testing.assert_array_equal(exponents[finite], want_exponents[finite])
    # the epilogue factors are the contract's scale: f * g == scales * 2**exponents, exactly
    got = np.asarray(factor, np.float64) * np.asarray(power, np.float64)
    np.testing.assert_array_equal(got[finite], want_scales[finite].astype(np.float64) * 2.0 ** want_exponents[finite])
    assert np.isinf(scales[~finite]).all() and np.isinf(np.asarray(factor)[~finite]).all()


def test_the_scale_below_a_power_of_two_is_split_as_the_power_of_twos():
    """``fl((2 - 2**-23) / 127) == 2 * fl(1 / 127)``: the one scale two absmaxes share (int8's limit only)."""
    assert np.float32(ALL_ONES) / np.float32(127) == 2 * (np.float32(1) / np.float32(127))
    x = np.array([[ALL_ONES, 0.5], [1.0, -0.25]], np.float32)
    codes, scales, exponents, _ = jax.jit(lambda v: quantize_by_float64(v, (1,)))(x)
    np.testing.assert_array_equal(np.asarray(scales), np.float32(1) / np.float32(127))
    np.testing.assert_array_equal(np.asarray(exponents), [1, 0])
    np.testing.assert_array_equal(np.asarray(codes), reference_codes(x, (1,)))


def test_epilogue_of_the_factors_is_the_contracts_in_every_pair_of_binades():
    """Rows quantized here, one per binade of the normal range (and mantissas up to the all-ones one), columns by
    their stored factors (:func:`epilogue_factors`): the epilogue is the one of the contract's factors, bit for bit,
    wherever its result is a normal float, and infinite wherever that overflows."""
    rng = np.random.default_rng(5)
    exponents = np.arange(-126, 128)
    mantissas = np.concatenate([rng.uniform(1, 2, exponents.size - 2), [1.0, ALL_ONES]])
    amax = (mantissas * 2.0**exponents).astype(np.float32)
    x = np.concatenate([amax[:, None], (amax[:, None] * rng.uniform(-1, 1, (amax.size, 63))).astype(np.float32)], 1)
    x[np.abs(x) < TINY] = 0.0
    _, _, _, rows = jax.jit(lambda v: quantize_by_float64(v, (1,)))(x)
    want_scales, want_exponents = reference_scale_parts(x, (1,))
    reference_rows = epilogue_factors(jnp.asarray(want_scales), jnp.asarray(want_exponents))
    acc = rng.integers(-(2**30), 2**30, size=(amax.size, amax.size)).astype(np.float32)

    @jax.jit
    def epilogue(acc, row_factors, column_factors):
        return scale_product(acc, [lax.broadcast_in_dim(v, acc.shape, (0,)) for v in row_factors],
                             [lax.broadcast_in_dim(v, acc.shape, (1,)) for v in column_factors])

    got = np.asarray(epilogue(acc, rows, reference_rows))
    want = np.asarray(epilogue(acc, reference_rows, reference_rows))
    normal = np.isfinite(want) & (np.abs(want) >= TINY)
    assert normal.sum() > acc.size // 2 and (~normal).sum() > 1000
    np.testing.assert_array_equal(got[normal], want[normal])
    assert np.isinf(got[np.isinf(want)]).all()


def test_only_a_gpu_takes_the_scale_inside_the_reduction():
    """In a rewritten matrix dot, the GPU's absmax reduction is over float64 scales (one reduction per operand, no
    float32 division and no float64 one per slice: the codes divide per element); CPU and TPU keep theirs; a
    float64 program (no wider format) keeps the contract's form on a GPU too."""
    jaxpr = jax.make_jaxpr(int8ify(lambda a, b: a @ b))(jnp.ones((64, 256)), jnp.ones((256, 128)))
    for platform, dtype in (("cuda", np.float64), ("cpu", np.float32), ("tpu", np.float32)):
        eqns = list(platform_eqns(jaxpr, platform))
        reductions = [e.outvars[0].aval.dtype for e in eqns if e.primitive.name == "reduce_max"]
        assert reductions == [dtype, dtype], (platform, reductions)
        divisions = [e.outvars[0].aval for e in eqns if e.primitive.name == "div"]
        if platform == "cuda":
            assert sorted(a.shape for a in divisions) == [(64, 256), (256, 128)]
    with jax.enable_x64(True):
        doubles = jax.make_jaxpr(int8ify(lambda a, b: a @ b))(jnp.ones((8, 64)), jnp.ones((64, 16)))
    assert [e.outvars[0].aval.dtype for e in platform_eqns(doubles, "cuda") if e.primitive.name == "reduce_max"] == [
        np.float64, np.float64]
    assert not any(e.primitive.name == "convert_element_type" and e.params["new_dtype"] == np.float32
                   for e in platform_eqns(doubles, "cuda"))


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([(32, 256, 64), (128, 1024, 256)]))
def test_a_gpu_matmul_is_the_contracts(seed, shape):
    """``int8ify(a @ b)`` as the GPU program computes it, evaluated here: the contract's result, bit for bit the
    CPU program's."""
    m, k, n = shape
    rng = np.random.default_rng(seed)
    a = np.round(rng.normal(size=(m, k)) * 8).astype(np.float32) / 8  # ties among the codes
    b = rng.normal(size=(k, n)).astype(np.float32)
    f = int8ify(lambda a, b: a @ b)
    (on_gpu,) = evaluate_as("cuda", f, a, b)
    np.testing.assert_array_equal(np.asarray(on_gpu), np.asarray(jax.jit(f)(a, b)))
