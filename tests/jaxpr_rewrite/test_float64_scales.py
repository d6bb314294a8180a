"""A GPU's quantization of a matrix operand, the scale taken inside the absmax reduction in float64
(``float64_scales.quantize_by_float64``), computed on this CPU (the same float64 arithmetic): the contract's codes,
scales and exponents bit for bit, and epilogue factors whose epilogue is the contract's."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from helpers import (assert_finite_slices_quantized_as_the_contract, evaluate_as, platform_eqns, reference_codes,
                     reference_scale_parts, with_zero_and_non_finite_rows)
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
    return with_zero_and_non_finite_rows(draw, x, max_bad=2)


@settings(max_examples=60, deadline=None)
@given(matrices(), st.booleans())
def test_codes_scales_and_exponents_are_the_contracts(case, transposed):
    x, bad_rows = case
    x = x.T if transposed else x
    scales, factor, finite = assert_finite_slices_quantized_as_the_contract(
        quantize_by_float64, x, bad_rows, 0 if transposed else 1, split=_as_the_power_of_twos)
    assert np.isinf(scales[~finite]).all() and np.isinf(factor[~finite]).all()


def _as_the_power_of_twos(scales, exponents, amax):
    """One scale, ``fl(2 / 127) * 2**(e - 1)``, stands for the absmax just below ``2**e`` too: split as ``2**e``'s."""
    below_a_power = np.frexp(amax)[0] * 2 == ALL_ONES
    return np.where(below_a_power, scales / 2, scales), np.where(below_a_power, exponents + 1, exponents)


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


def test_vectors_empty_slices_and_half_precision_inputs():
    """A vector (one slice, a scalar scale), slices with no element (the contract's scale 1), and bfloat16 and
    float16 operands (quantized as their float32 values)."""
    rng = np.random.default_rng(7)
    vector = np.round(rng.normal(size=256) * 16).astype(np.float32) / 16
    codes, scales, exponents, _ = jax.jit(lambda v: quantize_by_float64(v, (0,)))(vector)
    np.testing.assert_array_equal(np.asarray(codes), reference_codes(vector, (0,)))
    np.testing.assert_array_equal((np.asarray(scales), np.asarray(exponents)), reference_scale_parts(vector, (0,)))
    _, scales, exponents, (factor, power) = jax.jit(lambda v: quantize_by_float64(v, (1,)))(np.ones((4, 0), np.float32))
    np.testing.assert_array_equal(np.asarray(scales), 1)
    np.testing.assert_array_equal(np.asarray(exponents), 0)
    np.testing.assert_array_equal(np.asarray(factor) * np.asarray(power), 1)
    for dtype in (jnp.bfloat16, jnp.float16):
        x = jnp.asarray(rng.normal(size=(16, 128)) * 4, dtype)
        codes, scales, exponents, _ = jax.jit(lambda v: quantize_by_float64(v, (1,)))(x)
        as_float = np.asarray(x.astype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(codes), reference_codes(as_float, (1,)))
        np.testing.assert_array_equal(np.asarray(scales), reference_scale_parts(as_float, (1,))[0])
