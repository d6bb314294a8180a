"""A GPU's dynamic quantization, the scale taken inside the absmax reduction in float64
(``float64_scales.quantize_by_float64``), and its float64 epilogue (``scale_product_in_float64``), computed on this
CPU (the same float64 arithmetic): the contract's codes, scales and exponents bit for bit, epilogue factors whose
epilogue is the contract's, an epilogue rounded as the contract's product is, and whole GPU programs bit for bit
the CPU's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

from helpers import (CPU, assert_finite_slices_quantized_as_the_contract, evaluate_as, examples, is_max_reduction,
                     platform_eqns, reference_codes, reference_scale_parts, with_zero_and_non_finite_rows)
from jaxpr_rewrite import int8ify, quantize_params
from jaxpr_rewrite._core import platforms
from jaxpr_rewrite._numerics.float64_scales import (nan_safe_magnitude_of_bits, quantize_by_float64,
                                                    rounded_significands, scale_product_in_float64)
from jaxpr_rewrite._numerics.quantize import epilogue_factors, nan_safe_magnitude, pow2, scale_product

TINY = np.finfo(np.float32).tiny
ALL_ONES = np.float32(2 - 2.0**-23)  # the mantissa whose scale, fl(2 / 127), is also the next binade's smallest


@pytest.fixture(autouse=True, scope="module")
def _on_the_cpu():
    """A GPU's float64 arithmetic is IEEE's, as the CPU's is: these run on the CPU also where the default device is a
    TPU, whose float64 is a pair of float32s (XLA:TPU does not even compile some of its bit operations)."""
    with jax.default_device(CPU):
        yield


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


@examples(60)
@given(matrices(), st.booleans())
def test_codes_scales_and_exponents_are_the_contracts(case, transposed):
    x, bad_rows = case
    x = x.T if transposed else x
    scales, factor, finite = assert_finite_slices_quantized_as_the_contract(
        quantize_by_float64, x, bad_rows, 0 if transposed else 1, split=_as_the_power_of_twos)
    assert np.isinf(scales[~finite]).all() and np.isinf(factor[~finite]).all()


@examples(40)
@given(st.sampled_from([(np.float32, np.uint32), (np.float64, np.uint64)]), st.integers(0, 2**32 - 1))
def test_the_magnitude_of_the_bits_is_the_selects(dtypes, seed):
    """The NaN-safe magnitude from the bits (integer operations, for operands scaled over leading axes on GPUs) is
    the select form's bit for bit: random bit patterns, every NaN payload and sign, Inf, zeros, subnormals."""
    float_type, bits_type = dtypes
    info = np.iinfo(bits_type)
    rng = np.random.default_rng(seed)
    patterns = rng.integers(0, info.max, size=4096, dtype=bits_type, endpoint=True)
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, np.finfo(float_type).max,
                         np.finfo(float_type).smallest_subnormal, -np.finfo(float_type).tiny], float_type)
    exponent_field = np.array(np.inf, float_type).view(bits_type)
    nans = (patterns | exponent_field | bits_type(1)).view(float_type)  # either sign, any payload
    x = np.concatenate([patterns.view(float_type), nans, specials])
    with jax.enable_x64(float_type == np.float64):
        got = np.asarray(jax.jit(nan_safe_magnitude_of_bits)(x))
        want = np.asarray(jax.jit(nan_safe_magnitude)(x))
    assert got.dtype == want.dtype == float_type
    finite_or_inf = ~np.isnan(want)
    assert not np.isnan(got).any() and np.isinf(got[np.isnan(x)]).all()
    # XLA reads subnormals as zero on CPU: compare the bits where the select's result is not flushed
    kept = finite_or_inf & ((want != 0) | (x == 0))
    assert got[kept].tobytes() == want[kept].tobytes()


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


@pytest.mark.parametrize("spec, shapes", [
    ("ij,jk->ik", [(64, 256), (256, 128)]),
    ("btd,de->bte", [(4, 16, 256), (256, 128)]),  # a transformer's activation
    ("bqhd,bkhd->bhqk", [(2, 16, 3, 64), (2, 16, 3, 64)]),  # attention: both operands activations
])
@pytest.mark.usefixtures("every_platform_programs")
def test_only_a_gpu_takes_the_scale_inside_the_reduction(spec, shapes):
    """In a rewritten dot, the GPU's absmax reduction is over float64 scales (one reduction per activation, no
    float32 division and no float64 one per slice: the codes divide per element), and its epilogue rounds a
    float64 product to the float32 result; CPU and TPU keep theirs; a float64 program (no wider format) keeps the
    contract's form on a GPU too."""
    jaxpr = jax.make_jaxpr(int8ify(lambda a, b: jnp.einsum(spec, a, b)))(*(jnp.ones(s) for s in shapes))
    out_shape = jax.eval_shape(lambda a, b: jnp.einsum(spec, a, b), *(jnp.ones(s) for s in shapes)).shape
    for platform, dtype in (("cuda", np.float64), ("cpu", np.float32), ("tpu", np.float32)):
        eqns = list(platform_eqns(jaxpr, platform))
        reductions = [e.outvars[0].aval.dtype for e in eqns if is_max_reduction(e)]
        assert reductions == [dtype, dtype], (platform, reductions)
        divisions = [e.outvars[0].aval for e in eqns if e.primitive.name == "div"]
        wide_products = [e for e in eqns if e.primitive.name == "mul" and e.outvars[0].aval.shape == out_shape
                         and e.outvars[0].aval.dtype == np.float64]
        if platform == "cuda":
            assert sorted(a.shape for a in divisions) == sorted(shapes)
            assert wide_products
        else:
            assert not wide_products
    with jax.enable_x64(True), platforms.target(("cpu", "cuda")):  # (a TPU refuses float64 dots)
        doubles = jax.make_jaxpr(int8ify(lambda a, b: a @ b))(jnp.ones((8, 64)), jnp.ones((64, 16)))
    assert [e.outvars[0].aval.dtype for e in platform_eqns(doubles, "cuda") if e.primitive.name == "reduce_max"] == [
        np.float64, np.float64]
    assert not any(e.primitive.name == "convert_element_type" and e.params["new_dtype"] == np.float32
                   for e in platform_eqns(doubles, "cuda"))


def test_significands_round_to_nearest_even_with_any_exponent():
    """Ties between two float32 significands go to the even one, in every binade of float64 (far beyond
    float32's), for either sign; zeros and infinities stay as they are."""
    significands = np.array([1, 1 + 2**-24, 1 + 3 * 2**-24, 1 + 2**-24 + 2**-40, 2 - 2**-24, 1.5 + 2**-25])
    want = np.array([1, 1, 1 + 2**-22, 1 + 2**-23, 2, 1.5])
    powers = 2.0 ** np.array([-1000, -160, -1, 0, 100, 900])[:, None]
    values = np.concatenate([(significands * powers).ravel(), -(significands * powers).ravel(), [0.0, np.inf]])
    expected = np.concatenate([(want * powers).ravel(), -(want * powers).ravel(), [0.0, np.inf]])
    with jax.enable_x64(True):
        got = np.asarray(jax.jit(rounded_significands)(values))
    np.testing.assert_array_equal(got, expected)


def _rounded_to_significand(v):
    """``v`` (float64) rounded to 24 significant bits, ties to even, the exponent unbounded (numpy reference)."""
    mantissa, exponent = np.frexp(v)
    return np.ldexp(np.rint(np.ldexp(mantissa, 24)), exponent - 24)


@pytest.mark.parametrize("lhs_form, rhs_form", [("float64", "factors"), ("float64", "float64"),
                                                ("factors", "float64")])
def test_float64_epilogue_in_every_pair_of_binades(lhs_form, rhs_form):
    """The GPU's epilogue over every pair of scale binades, float32's normal range and the subnormal absmaxes'
    scales below it: the contract's ``(acc * s_rhs) * s_lhs`` with its first product rounded to a float32
    significand and its second rounded once (numpy's float64 reference, exact here), whatever each side's form (an
    activation's float64 scale, a weight's stored factors); so bit for bit the contract's plain formula wherever
    that one's scales and intermediate are normal floats, and :func:`scale_product`'s wherever that result is a
    normal float or overflows."""
    rng = np.random.default_rng(11)
    exponents = np.arange(-134, 127, dtype=np.int32)
    n = exponents.size
    mantissas = (rng.uniform(1, 2, size=n) / 127).astype(np.float32)
    acc = rng.integers(-(2**30), 2**30, size=(n, n)).astype(np.float32)  # the int32 sums, as the program's floats
    acc[:, 0] = 0.0
    s = mantissas.astype(np.float64) * 2.0 ** exponents.astype(np.float64)

    @jax.jit
    def epilogue(acc, scales, exponents):
        def side(form, axis):
            if form == "factors":
                return tuple(lax.broadcast_in_dim(v, acc.shape, (axis,)) for v in epilogue_factors(scales, exponents))
            with jax.enable_x64(True):
                exact = lax.mul(lax.convert_element_type(scales, np.float64), pow2(exponents, np.float64))
                return lax.broadcast_in_dim(exact, acc.shape, (axis,))
        return scale_product_in_float64(acc, side(lhs_form, 0), side(rhs_form, 1))

    got = np.asarray(epilogue(acc, mantissas, exponents))
    first = _rounded_to_significand(acc.astype(np.float64) * s[None, :])  # exact products: 24 x 24 bits
    with np.errstate(over="ignore"):
        want = (first * s[:, None]).astype(np.float32)
    subnormal = (want != 0) & (np.abs(want) < TINY)  # XLA:CPU may flush those to zero; a GPU does not
    np.testing.assert_array_equal(got[~subnormal], want[~subnormal])
    assert np.all((got[subnormal] == want[subnormal]) | (got[subnormal] == 0))
    assert np.isinf(want).sum() > 1000 and (np.abs(want) < TINY).sum() > 1000

    s32 = s.astype(np.float32)
    with np.errstate(over="ignore", under="ignore"):
        plain = (acc * s32[None, :]) * s32[:, None]
        first32 = acc * s32[None, :]
    ordinary = ((np.abs(s) >= TINY)[:, None] & (np.abs(s) >= TINY)[None, :] & (np.abs(first32) >= TINY)
                & np.isfinite(first32) & (np.abs(plain) >= TINY) & np.isfinite(plain))
    assert ordinary.sum() > n * n // 3
    np.testing.assert_array_equal(got[ordinary], plain[ordinary])
    in_range = (np.abs(s) >= TINY)
    split = np.asarray(jax.jit(lambda acc, m, e: scale_product(
        acc, [lax.broadcast_in_dim(v, acc.shape, (0,)) for v in epilogue_factors(m, e)],
        [lax.broadcast_in_dim(v, acc.shape, (1,)) for v in epilogue_factors(m, e)]))(acc, mantissas, exponents))
    comparable = in_range[:, None] & in_range[None, :] & ((np.abs(split) >= TINY) | (split == 0) | np.isinf(split))
    np.testing.assert_array_equal(got[comparable], split[comparable])


@examples(8)
@given(st.integers(0, 2**31 - 1), st.sampled_from([
    ("ij,jk->ik", (32, 256), (256, 64)), ("ij,jk->ik", (128, 1024), (1024, 256)),
    ("btd,de->bte", (4, 32, 256), (256, 128)), ("bqhd,bkhd->bhqk", (2, 32, 4, 64), (2, 32, 4, 64)),
    ("bhqk,bkhd->bqhd", (2, 4, 32, 32), (2, 32, 4, 64))]), st.booleans())
def test_a_gpu_dot_is_the_contracts(seed, case, special_slices):
    """``int8ify`` of a matmul, a transformer's projection and its attention einsums as the GPU program computes
    them, evaluated here: bit for bit the CPU program's, slices of zeros, NaN and Inf included."""
    spec, a_shape, b_shape = case
    rng = np.random.default_rng(seed)
    a = np.round(rng.normal(size=a_shape) * 8).astype(np.float32) / 8  # ties among the codes
    b = rng.normal(size=b_shape).astype(np.float32)
    if special_slices:
        a[0] = 0.0
        a.reshape(-1)[-1] = np.nan
        b.reshape(-1)[rng.choice(b.size, size=2, replace=False)] = np.inf, np.nan
    f = int8ify(lambda a, b: jnp.einsum(spec, a, b))
    (on_gpu,) = evaluate_as("cuda", f, a, b)
    np.testing.assert_array_equal(np.asarray(on_gpu), np.asarray(jax.jit(f)(a, b)))


@pytest.mark.parametrize("program", ["weight on the right", "weight on the left", "blocks", "bfloat16"])
def test_a_gpu_dot_with_stored_factors_blocks_or_half_precision_is_the_cpus(program):
    """The GPU's float64 epilogue with a pre-quantized weight's stored factors on either side, with block scales
    (partial sums per block), and with bfloat16 operands: bit for bit the CPU program's."""
    rng = np.random.default_rng(3)
    x = np.round(rng.normal(size=(64, 256)) * 8).astype(np.float32) / 8
    w = rng.normal(size=(256, 128)).astype(np.float32)
    x[5] = 0.0
    x[9, 3] = np.nan
    if program == "weight on the left":
        fn, args = (lambda p, v: p["w"].T @ v.T), ({"w": w}, x)
    else:
        fn, args = (lambda p, v: v @ p["w"]), ({"w": w}, x)
    options = {"block_size": 64} if program == "blocks" else {}
    if program == "bfloat16":
        args = ({"w": jnp.asarray(w, jnp.bfloat16)}, jnp.asarray(x, jnp.bfloat16))
    f = int8ify(fn, **options)
    params = args[0] if program == "blocks" else quantize_params(fn, *args)
    (on_gpu,) = evaluate_as("cuda", f, params, args[1])
    # compared as float32: numpy's NaN-aware comparison does not know bfloat16 (row 9 is NaN)
    np.testing.assert_array_equal(np.asarray(on_gpu, np.float32), np.asarray(jax.jit(f)(params, args[1]), np.float32))


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


@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (2, 64)])
def test_a_slice_of_zeros_has_scale_one_whatever_its_length(shape):
    """A slice of zeros gets the contract's scale 1, also where it has one element: XLA drops a reduction's initial
    value over a dimension of size 1, so the floor cannot live there (the seed's 1 x 1 zero matrix had scale 0 on an
    H200)."""
    x = np.zeros(shape, np.float32)
    x[0, 0] = 0.0 if shape[1] == 1 else 3.0  # one slice of zeros beside an ordinary one, where there is room
    codes, scales, exponents, (factor, power) = jax.jit(lambda v: quantize_by_float64(v, (1,)))(x)
    np.testing.assert_array_equal(np.asarray(codes), reference_codes(x, (1,)))
    np.testing.assert_array_equal((np.asarray(scales), np.asarray(exponents)), reference_scale_parts(x, (1,)))
    zero_rows = ~x.any(axis=1)
    np.testing.assert_array_equal((np.asarray(factor) * np.asarray(power))[zero_rows], 1)
    w = np.ones((shape[1], 4), np.float32)
    (y,) = evaluate_as("cuda", int8ify(lambda a, b: a @ b), x, w)
    np.testing.assert_array_equal(np.asarray(y), x @ w)


@pytest.mark.usefixtures("every_platform_programs")
@pytest.mark.parametrize("weights", ["float", "quantized", "static", "bfloat16"])
def test_a_gpu_gemm_reads_int8_buffers(weights):
    """On a GPU the int8 dot's operands are int8 buffers (an optimization barrier on the codes), not float32
    quotients converted inside XLA's GEMM fusion: the autotuner tests each GEMM tiling on its operands' dtypes, and
    float32 test data in [0, 1) converted to int8 is all zero codes, which hid the Triton tilings that double every
    sum (on an H200, x = 1e36 times w = 1e-30 gave 1.28e8 for 6.4e7). The CPU's program has no barrier."""
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(8, 128)).astype(np.float32), rng.normal(size=(128, 16)).astype(np.float32)
    fn = lambda p, v: v @ p["w"]  # noqa: E731
    if weights == "bfloat16":  # a bfloat16 epilogue: the dot the other platforms run too
        x, w = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    params = {"w": w} if weights in ("float", "bfloat16") else quantize_params(
        fn, {"w": w}, x, activations="static" if weights == "static" else "dynamic")
    jaxpr = jax.make_jaxpr(int8ify(fn))(params, x).jaxpr
    for platform, barriers_per_dot in (("cuda", 1), ("cpu", 0)):
        eqns = list(platform_eqns(jaxpr, platform))
        int8_dots = [e for e in eqns if e.primitive.name == "dot_general" and e.invars[0].aval.dtype == np.int8]
        # (a barrier's outputs may reach the dot through the platform choice's cond: counted, not traced)
        int8_barriers = [e for e in eqns if e.primitive.name == "optimization_barrier"
                         and [v.aval.dtype for v in e.invars] == [np.int8, np.int8]]
        assert len(int8_dots) == 1 and len(int8_barriers) == barriers_per_dot, platform
        if int8_barriers:
            assert [v.aval.shape for v in int8_barriers[0].invars] == [v.aval.shape for v in int8_dots[0].invars]
