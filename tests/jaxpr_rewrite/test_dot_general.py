"""The rewrite of one dot_general, for any dimension numbers, shapes and float dtypes, against the
independent numpy reference (exact integer sums, float64 epilogue)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from helpers import (assert_all_dots_int8, assert_same_bits_but_nan, away_from_ties, dot_eqns, dot_problems,
                     evaluate_as, examples, on_cpu, platform_eqns, program_dots, reference_dot)
from jaxpr_rewrite import int8ify

# Output tolerance per dtype: float32 is the contract's 1e-6; narrower outputs add one rounding.
RTOL = {np.dtype(np.float32): 1e-6, np.dtype(ml_dtypes.bfloat16): 2**-8, np.dtype(np.float16): 2**-10}


@given(dot_problems())
# a float16 product in float16's subnormal range (found by the thorough profile)
@example((np.array(0.0001258, np.float16), np.array(-0.1321, np.float16), (((), ()), ((), ()))))
def test_any_dimension_numbers_match_reference(problem):
    lhs, rhs, dims = problem

    def f(a, b):
        return jax.lax.dot_general(a, b, dims)

    rewritten = int8ify(f)
    jaxpr = jax.make_jaxpr(rewritten)(lhs, rhs)
    assert_all_dots_int8(jaxpr, expected_count=1)
    got = jax.jit(rewritten)(lhs, rhs)
    assert got.dtype == jax.eval_shape(f, lhs, rhs).dtype
    want = reference_dot(lhs, rhs, dims)
    # an output in the dtype's subnormal range is rounded to a spacing of its smallest subnormal, which for float16
    # (about 6e-8, outputs below 6.1e-5) is more than the relative tolerance: one such spacing is allowed too
    atol = float(ml_dtypes.finfo(lhs.dtype).smallest_subnormal)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=RTOL[np.dtype(lhs.dtype)], atol=atol)


def _near_rounding_boundaries(rng, shape, contracting) -> np.ndarray:
    """float32 values whose quotients by their slice's scale lie on or within two ulps of a rounding boundary
    ``k + 1/2``: each slice over ``contracting`` holds its absmax ``a`` and values next to ``(k + 1/2) * s``, ``s``
    the contract's scale ``fl(a / 127)``. A division that is not correctly rounded gives some of them the
    neighbouring code."""
    kept = [axis for axis in range(len(shape)) if axis not in contracting]
    order = kept + list(contracting)
    rows = int(np.prod([shape[a] for a in kept], dtype=np.int64))
    length = int(np.prod([shape[a] for a in contracting], dtype=np.int64))
    absmax = np.float32(2.0) ** rng.uniform(-4, 4, size=(rows, 1)).astype(np.float32)
    scale = absmax / np.float32(127)
    halves = rng.integers(-125, 125, size=(rows, length)).astype(np.float32) + np.float32(0.5)
    values = halves * scale
    for _ in range(2):  # move each value 0-2 ulps either way
        step = rng.integers(-1, 2, size=values.shape)
        values = np.where(step > 0, np.nextafter(values, np.float32(np.inf)),
                          np.where(step < 0, np.nextafter(values, np.float32(-np.inf)), values))
    values[:, :1] = absmax * rng.choice(np.float32([-1, 1]), size=(rows, 1))
    canonical = values.reshape([shape[a] for a in order])
    return np.transpose(canonical, np.argsort(order)).astype(np.float32)


@st.composite
def boundary_problems(draw):
    """:func:`dot_problems` with both operands :func:`_near_rounding_boundaries` in float32 (where the divisions a
    GPU and a TPU do not round correctly meet the contract's), or, in bfloat16 and float16, small integers (a value
    half its slice's absmax is a tie); NaN, Inf and -0 placed in the lhs."""
    lhs, rhs, dims = draw(dot_problems())
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    if lhs.dtype == np.float32:
        lhs = _near_rounding_boundaries(rng, lhs.shape, dims[0][0])
        rhs = _near_rounding_boundaries(rng, rhs.shape, dims[0][1])
    else:
        lhs, rhs = (np.rint(rng.normal(scale=3.0, size=a.shape)).astype(a.dtype) for a in (lhs, rhs))
    if lhs.size > 1:
        flat = lhs.reshape(-1)
        spots = rng.choice(lhs.size, size=min(3, lhs.size - 1), replace=False)
        flat[spots] = rng.choice(np.float32([np.nan, np.inf, -np.inf, -0.0]), size=spots.size).astype(lhs.dtype)
    return lhs, rhs, dims


@examples(60)
@given(boundary_problems())
def test_gpu_and_tpu_programs_give_the_cpus_bits_for_any_dimension_numbers(problem):
    """The program each platform compiles (its own exact divisions: the TPU's settled approximate quotients, the
    GPU's float64 scales and epilogue), evaluated on this CPU, gives the outputs of the program this machine's
    default device runs (the CPU's, or a TPU's) bit for bit."""
    lhs, rhs, dims = problem
    rewritten = int8ify(lambda a, b: jax.lax.dot_general(a, b, dims))
    want = jax.jit(rewritten)(lhs, rhs)
    for platform in ("cuda", "tpu"):
        # compiled by XLA:CPU as one program: the platform's arithmetic, one compile per example
        (got,) = jax.jit(functools.partial(evaluate_as, platform, rewritten))(*on_cpu((lhs, rhs)))
        assert_same_bits_but_nan(got, want)


def test_int8_dot_keeps_dimension_numbers():
    """The int8 dot has the same dimension numbers as the float dot it replaces."""
    dims = (((2, 0), (0, 3)), ((1,), (2,)))
    lhs, rhs = jnp.ones((3, 4, 5, 6)), jnp.ones((5, 7, 4, 3))
    (float_dot,) = dot_eqns(jax.make_jaxpr(lambda a, b: jax.lax.dot_general(a, b, dims))(lhs, rhs))
    (int8_dot,) = program_dots(jax.make_jaxpr(int8ify(lambda a, b: jax.lax.dot_general(a, b, dims)))(lhs, rhs))
    assert int8_dot.params["dimension_numbers"] == float_dot.params["dimension_numbers"]
    assert int8_dot.params["preferred_element_type"] == np.int32


ENTRY_POINTS = {
    "matmul @": (lambda a, b: a @ b, (4, 6), (6, 3)),
    "jnp.dot": (jnp.dot, (4, 6), (6, 3)),
    "jnp.matmul batched": (jnp.matmul, (2, 4, 6), (2, 6, 3)),
    "jnp.einsum attention": (lambda q, k: jnp.einsum("bhqd,bhkd->bhqk", q, k), (2, 3, 4, 5), (2, 3, 6, 5)),
    "jnp.einsum two contractions": (lambda a, b: jnp.einsum("ijk,kjl->il", a, b), (3, 4, 5), (5, 4, 2)),
    "jnp.tensordot": (lambda a, b: jnp.tensordot(a, b, axes=([0, 2], [2, 0])), (3, 4, 5), (5, 2, 3)),
    "vector dot": (jnp.dot, (6,), (6,)),
    "matrix-vector": (lambda a, b: a @ b, (4, 6), (6,)),
    "jnp.inner": (jnp.inner, (3, 6), (2, 6)),
}


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_entry_points(name):
    """Every way users write a matmul becomes exactly the reference, with only int8 dots left."""
    fn, lhs_shape, rhs_shape = ENTRY_POINTS[name]
    rng = np.random.default_rng(1)
    lhs = rng.normal(size=lhs_shape).astype(np.float32)
    rhs = rng.normal(size=rhs_shape).astype(np.float32)
    (float_dot,) = dot_eqns(jax.make_jaxpr(fn)(lhs, rhs))
    dims = float_dot.params["dimension_numbers"]
    lhs = away_from_ties(lhs, dims[0][0])
    rhs = away_from_ties(rhs, dims[0][1])
    rewritten = int8ify(fn)
    assert_all_dots_int8(jax.make_jaxpr(rewritten)(lhs, rhs), expected_count=1)
    got = rewritten(lhs, rhs)
    want = reference_dot(lhs, rhs, dims)
    # jnp wrappers may transpose the dot's output; compare through the float function's own layout
    float_out = np.asarray(fn(lhs, rhs))
    assert got.shape == float_out.shape
    np.testing.assert_allclose(np.sort(np.asarray(got, np.float64).ravel()), np.sort(want.ravel()), rtol=1e-6)
    # and the int8 result approximates the float one
    np.testing.assert_allclose(np.asarray(got), float_out, rtol=0.05, atol=0.05 * np.abs(float_out).max())


def test_integer_and_int8_dots_are_left_alone():
    def f(a, b, c, d):
        return a @ b, jax.lax.dot_general(c, d, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)

    args = (jnp.ones((2, 3), jnp.int32), jnp.ones((3, 4), jnp.int32))
    args += (jnp.ones((2, 3), jnp.int8), jnp.ones((3, 4), jnp.int8))
    before = jax.make_jaxpr(f)(*args)
    after = jax.make_jaxpr(int8ify(f))(*args)
    assert str(before) == str(after)


def test_bfloat16_scales_and_epilogue_in_float32():
    lhs = jnp.ones((4, 8), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(int8ify(lambda a, b: a @ b))(lhs, lhs.T)
    (dot,) = assert_all_dots_int8(jaxpr, expected_count=1)
    assert jaxpr.out_avals[0].dtype == jnp.bfloat16
    text = str(jaxpr)
    assert "f32[4]" in text  # the scales
    assert "mul" in text


def test_preferred_float32_output_from_bf16_operands():
    a = jnp.asarray(np.random.default_rng(2).normal(size=(4, 8)), jnp.bfloat16)

    def f(a, b):
        return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    out = int8ify(f)(a, a.T)
    assert out.dtype == jnp.float32
    want = reference_dot(np.asarray(a, np.float32), np.asarray(a, np.float32).T, (((1,), (0,)), ((), ())))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)


@pytest.mark.parametrize("lhs_shape", [(8, 64), (1, 64), (2, 140_000)], ids=["rows", "one-row", "chunked"])
def test_int8_dots_keep_the_default_precision_under_a_float32_default(lhs_shape):
    """An int8 dot's sums are exact at any precision; without an explicit one, ``jax_default_matmul_precision=
    "float32"`` (a common setting) would ask XLA for an fp32 contraction of int8 codes, which XLA:TPU's ragged dot
    refused (test_ragged.py). The one-row and chunked (overflow-safe) forms ask for the default too."""
    x = jax.ShapeDtypeStruct(lhs_shape, jnp.float32)
    w = jax.ShapeDtypeStruct((lhs_shape[1], 16), jnp.float32)
    with jax.default_matmul_precision("float32"):
        dots = dot_eqns(jax.make_jaxpr(int8ify(jnp.matmul))(x, w))
        lowered = jax.jit(int8ify(jnp.matmul)).lower(x, w).as_text()
    assert dots and all(str(d.invars[0].aval.dtype) == "int8" for d in dots)
    assert all(d.params["precision"] == (jax.lax.Precision.DEFAULT,) * 2 for d in dots)
    assert "HIGHEST" not in lowered


@pytest.mark.usefixtures("every_platform_programs")
@pytest.mark.parametrize("contraction", [390, 5])
def test_only_a_gpu_pads_a_contraction_to_a_multiple_of_4(contraction):
    """XLA's GPU int8 GEMM doubles the sums of a contraction whose length is not a multiple of 4, so a GPU's program
    zero-pads both operands' codes there; CPU and TPU dots read the codes as they are (padded, a pre-quantized
    weight's codes were copied on every call), and the GPU's program gives the same numbers."""
    rng = np.random.default_rng(contraction)
    x = rng.standard_normal((8, contraction)).astype(np.float32)
    w = rng.standard_normal((contraction, 64)).astype(np.float32)
    x[1] = rng.integers(-300, 300, size=contraction) / 4.0  # rich in rounding ties
    rewritten = int8ify(lambda a, b: a @ b)
    jaxpr = jax.make_jaxpr(rewritten)(x, w)
    pads = {platform: [e.params["padding_config"] for e in platform_eqns(jaxpr, platform) if e.primitive.name == "pad"]
            for platform in ("cpu", "cuda", "tpu")}
    padding = -contraction % 4
    assert pads == {"cpu": [], "tpu": [], "cuda": [((0, 0, 0), (0, padding, 0)), ((0, padding, 0), (0, 0, 0))]}
    (cpu,) = evaluate_as("cpu", rewritten, x, w)
    np.testing.assert_array_equal(evaluate_as("cuda", rewritten, x, w)[0], cpu)
    np.testing.assert_allclose(np.asarray(cpu, np.float64), reference_dot(x, w, (((1,), (0,)), ((), ()))), rtol=1e-6)
