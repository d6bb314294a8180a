"""The rewritten program's dynamic quantization on CPU (``quantize_dynamic_parts``) against the contract's
(``quantize_parts``) and a numpy reference: the same codes and scales, bit for bit, for every finite slice; NaN
scales for a slice holding NaN or Inf."""

import importlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import (assert_finite_slices_quantized_as_the_contract, assert_same_bits_but_nan, evaluate_as, examples,
                     ieee_float64, is_max_reduction, platform_eqns, with_zero_and_non_finite_rows)
from jaxpr_rewrite import int8ify, quantize_params
from jaxpr_rewrite._numerics import exact_division

qz = importlib.import_module("jaxpr_rewrite._numerics.quantize")


@st.composite
def operands(draw):
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 300))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "quarters", "tiny", "huge", "top", "zeros"]))
    x = {"normal": lambda: rng.normal(size=(rows, cols)),
         "quarters": lambda: rng.integers(-300, 300, size=(rows, cols)) / 4.0,  # rich in rounding ties
         "tiny": lambda: rng.normal(size=(rows, cols)) * 2.0**-120,
         "huge": lambda: rng.normal(size=(rows, cols)) * 2.0**120,
         # up to float32's largest: an absmax in the top binade, whose scale keeps its exponent one lower
         "top": lambda: rng.uniform(-1.99, 1.99, size=(rows, cols)) * 2.0**127,
         "zeros": lambda: np.zeros((rows, cols))}[kind]().astype(np.float32)
    x[np.abs(x) < np.finfo(np.float32).tiny] = 0.0  # XLA reads subnormal inputs as zero (README)
    return with_zero_and_non_finite_rows(draw, x, max_bad=rows)


@examples(100)
@given(operands(), st.booleans())
def test_codes_and_scales_match_the_contract_on_finite_slices(case, transposed):
    x, bad_rows = case
    x = x.T if transposed else x
    scales, factor, finite = assert_finite_slices_quantized_as_the_contract(
        qz.quantize_dynamic_parts, x, bad_rows, 0 if transposed else 1)
    assert np.isnan(scales[~finite]).all() and np.isnan(factor[~finite]).all()


@examples(60)
@given(operands(), st.booleans(), st.booleans())
def test_the_tpu_programs_codes_in_either_form_match_the_contract(case, transposed, per_slice_parts):
    """The TPU's program (its ``platform_dependent`` branches, evaluated here) with its pass in either form (the
    divisor's parts broadcast per slice, the approximate quotient a multiply by the reciprocal; or one per-slice
    array decoded per element), whichever ``tpu_per_slice_parts`` would choose: the contract's codes and scales on
    every finite slice, tiny, huge and tied ones included; NaN scales for a slice holding NaN or Inf."""
    x, bad_rows = case
    x = x.T if transposed else x

    def on_tpu(v, axes):
        codes, scales, exponents, factor, power = evaluate_as("tpu", lambda w: qz.quantize_dynamic_parts(w, axes), v)
        return codes, scales, exponents, (factor, power)

    with mock.patch.object(exact_division, "tpu_per_slice_parts", lambda shape, kept_axes: per_slice_parts):
        scales, factor, finite = assert_finite_slices_quantized_as_the_contract(on_tpu, x, bad_rows,
                                                                                0 if transposed else 1)
    assert np.isnan(scales[~finite]).all() and np.isnan(factor[~finite]).all()


def test_float64_codes_are_the_contracts_up_to_the_largest_float():
    """float64 operands (``jax_enable_x64``) take the same unclipped codes: numpy's float64 ``rint(x / (amax /
    127))`` bit for bit, in float64's top binade, for a tiny row and for ties; NaN and Inf rows get NaN scales."""
    rng = np.random.default_rng(11)
    x = rng.uniform(-1.99, 1.99, size=(6, 300)) * 2.0**1023  # up to float64's largest
    x[1] = np.ldexp(x[1], -2000)  # a tiny row (2**-2000 itself underflows to 0 as a Python float)
    x[2] = rng.integers(-300, 300, size=300) / 4.0  # rich in rounding ties
    x[3, 7], x[4, 0] = np.nan, -np.inf
    x[5] = 0.0
    with ieee_float64():
        codes, scales, _, _ = jax.jit(lambda v: qz.quantize_dynamic_parts(v, (1,)))(jnp.asarray(x))
    codes, scales = np.asarray(codes), np.asarray(scales)
    assert scales.dtype == np.float64
    amax = np.abs(x[:3]).max(axis=1, keepdims=True)
    np.testing.assert_array_equal(codes[:3], np.rint(x[:3] / (amax / 127)))
    np.testing.assert_array_equal(codes[5], 0)
    assert (scales[5] == 1) and np.isnan(scales[3:5]).all()


def _absmax_producers(jaxpr, platform):
    eqns = list(platform_eqns(jaxpr, platform))
    made_by = {id(v): e.primitive.name for e in eqns for v in e.outvars}
    return [made_by.get(id(e.invars[0])) for e in eqns if is_max_reduction(e)]


@pytest.mark.usefixtures("every_platform_programs")
def test_cpu_absmax_of_a_matrix_reads_the_operand_directly():
    """On CPU a matrix operand's absmax is ``reduce_max(abs(x))`` (fused into XLA's reduction), not of a NaN-to-Inf
    select that XLA:CPU writes out as a temporary as large as the operand; TPU keeps that select; CUDA reduces the
    elements' scales, rounded on their bits and floored per element (``float64_scales``). An operand of higher rank
    on CPU (whose codes XLA's dot reads through a reshape) takes NaN as Inf in its values: a select that the absmax's
    ``abs`` and the codes' quotients both read, which XLA fuses into the kernel that computes the operand."""
    matrices = jax.make_jaxpr(int8ify(lambda a, b: a @ b))(jnp.ones((64, 256)), jnp.ones((256, 128)))
    assert _absmax_producers(matrices, "cpu") == ["abs", "abs"]  # both operands are float: one absmax each
    assert _absmax_producers(matrices, "tpu") == ["select_n", "select_n"]
    assert _absmax_producers(matrices, "cuda") == ["max", "max"]
    batched = jax.make_jaxpr(int8ify(lambda a, b: a @ b))(jnp.ones((4, 16, 256)), jnp.ones((256, 128)))
    assert _absmax_producers(batched, "cpu") == ["abs", "abs"]  # the (4, 16, 256) activation, the weight
    eqns = list(platform_eqns(batched, "cpu"))

    def readers(var):
        return sorted(e.primitive.name for e in eqns if any(v is var for v in e.invars))

    nan_as_inf = [e.outvars[0] for e in eqns if e.primitive.name == "select_n" and "abs" in readers(e.outvars[0])]
    # one select, read by the absmax's |x| and by the codes' quotients (their prescale's multiply)
    assert [readers(v) for v in nan_as_inf] == [["abs", "mul"]]


@examples(60)
@given(operands(), st.sampled_from(["rows", "columns", "rank 3", "rank 3, middle axis"]))
def test_nan_as_inf_in_the_values_quantizes_as_the_contract_does(case, layout):
    """``quantize_parts_nan_as_inf`` (NaN made Inf in the values, before the absmax and the codes) gives
    ``quantize_parts``' codes, scales and exponents bit for bit, NaN and Inf slices included."""
    x, _ = case
    v, axes = {"rows": (x, (1,)), "columns": (x.T, (0,)), "rank 3": (x[:, None, :], (2,)),
               "rank 3, middle axis": (x[:, :, None], (1,))}[layout]
    got = jax.jit(lambda w: qz.quantize_parts_nan_as_inf(w, axes))(v)
    want = jax.jit(lambda w: qz.quantize_parts(w, axes))(v)
    for g, w in zip(got, want, strict=True):
        assert np.asarray(g).dtype == np.asarray(w).dtype and np.asarray(g).tobytes() == np.asarray(w).tobytes()


@pytest.mark.parametrize("rows, width, nan_safe", [
    (1, 256, True), (1, 8192, True), (2, 256, True), (15, 256, True), (16, 256, False), (4, 1024, False)])
@pytest.mark.usefixtures("every_platform_programs")
def test_cpu_quantizes_a_single_row_or_a_small_matrix_with_the_nan_safe_absmax(rows, width, nan_safe):
    """A matrix with one slice (a matrix-vector product's vector) or fewer than 4096 elements, whose ``|x|`` XLA:CPU
    writes out as a kernel of its own before reducing it in its own loops, takes the NaN-to-Inf absmax on CPU and no
    minimum over its codes beside the dot (two or three kernels more per dot); a larger one, whose ``|x|`` XLA:CPU's
    YNNPACK reduction reads as it reduces, takes the check on its codes."""
    weights = quantize_params(lambda w, a: a @ w, np.ones((width, 128), np.float32), jnp.ones((rows, width)))
    jaxpr = jax.make_jaxpr(int8ify(lambda w, a: a @ w))(weights, jnp.ones((rows, width)))
    code_minimums = sum(e.primitive.name == "reduce_min" for e in platform_eqns(jaxpr, "cpu"))
    assert (_absmax_producers(jaxpr, "cpu"), code_minimums) == ((["select_n"], 0) if nan_safe else (["abs"], 1))


def test_a_single_row_or_a_few_get_the_outputs_they_get_among_many_rows():
    """The program of one row and of a small matrix (the NaN-safe absmax, no check on the codes) gives each row the
    outputs the many-row program gives it, bit for bit where they are finite, and non-finite outputs (Inf or NaN)
    for a row holding NaN or Inf, at a realistic width and with rows rich in rounding ties."""
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((512, 384)) / 20).astype(np.float32)
    x = rng.standard_normal((12, 512)).astype(np.float32)  # 6144 values: the codes' check
    x[1] = rng.integers(-300, 300, size=512) / 4.0
    x[2] = 0.0
    x[3, 17], x[4, 0], x[5, 511] = np.nan, np.inf, -np.inf
    weights = quantize_params(lambda w, a: a @ w, w, jnp.asarray(x))
    matmul = jax.jit(int8ify(lambda w, a: a @ w))
    many = np.asarray(matmul(weights, x))
    for first, count in [(row, 1) for row in range(6)] + [(0, 3), (3, 3)]:
        few = np.asarray(matmul(weights, x[first:first + count]))
        for row in range(first, first + count):
            if np.isfinite(x[row]).all():
                assert_same_bits_but_nan(few[row - first], many[row])
            else:
                assert not np.isfinite(few[row - first]).any() and not np.isfinite(many[row]).any()


def _two_layers(params, x):
    return jax.nn.gelu(x @ params["w1"] + params["b"]) @ params["w2"]


def _barriers(jaxpr, platform):
    """Per ``optimization_barrier`` of ``platform``'s program, its inputs' shapes and whether a max reduction makes
    each."""
    eqns = list(platform_eqns(jaxpr, platform))
    reduced = {id(v) for e in eqns if is_max_reduction(e) for v in e.outvars}
    return [[(v.aval.shape, id(v) in reduced) for v in e.invars] for e in eqns
            if e.primitive.name == "optimization_barrier"]


@pytest.mark.usefixtures("every_platform_programs")
@pytest.mark.parametrize("shape", [(64, 256), (4, 16, 256)])
def test_tpu_quantizes_the_values_its_absmax_was_taken_from(shape):
    """On TPU each dynamic activation reaches its quantization pass together with its absmax through one
    optimization barrier (XLA:TPU would otherwise compute the previous dot's epilogue and gelu again inside that
    pass); CPU's program has none, and CUDA's only those that hand its GEMMs int8 codes (``int8_dot``)."""
    params = {"w1": np.ones((256, 256), np.float32), "b": np.ones(256, np.float32),
              "w2": np.ones((256, 128), np.float32)}
    x = jnp.ones(shape)
    jaxpr = jax.make_jaxpr(int8ify(_two_layers))(quantize_params(_two_layers, params, x), x)
    # the input and the hidden activation, each with its absmax; the weights were quantized once
    assert _barriers(jaxpr, "tpu") == [[(shape, False), (shape[:-1], True)]] * 2
    assert _barriers(jaxpr, "cpu") == []
    hidden = shape[:-1] + (256,)
    assert _barriers(jaxpr, "cuda") == [[(shape, False), ((256, 256), False)], [(hidden, False), ((256, 128), False)]]
    cuda_barriers = [e for e in platform_eqns(jaxpr, "cuda") if e.primitive.name == "optimization_barrier"]
    assert all(v.aval.dtype == np.int8 for e in cuda_barriers for v in e.invars)


@pytest.mark.parametrize("shape", [(64, 384), (4, 16, 384)])
def test_tpu_program_with_dynamic_scales_is_the_cpus_bit_for_bit(shape):
    rng = np.random.default_rng(3)
    params = {"w1": (rng.standard_normal((384, 512)) / 20).astype(np.float32),
              "b": rng.standard_normal(512).astype(np.float32),
              "w2": (rng.standard_normal((512, 256)) / 22).astype(np.float32)}
    x = rng.standard_normal(shape).astype(np.float32)
    x.flat[[5, 2000, 2001]] = np.nan, np.inf, -np.inf
    x.flat[3 * 384:4 * 384] = 0.0  # an all-zero row: scale 1
    x.flat[4 * 384 + 7] = 1e30  # a row whose other codes round to 0
    for weights in (params, quantize_params(_two_layers, params, x)):
        # both evaluated an operation at a time: compiled, XLA:CPU's fused gelu may round differently
        (want, got) = (np.asarray(evaluate_as(platform, int8ify(_two_layers), weights, x)[0])
                       for platform in ("cpu", "tpu"))
        assert_same_bits_but_nan(got, want)
        assert 0 < np.isnan(want).any(axis=-1).sum() < want.size // want.shape[-1]


def _output_barriers(jaxpr, platform, shape):
    """The optimization barriers of ``platform``'s program around one float32 array of ``shape`` (a dot's output)."""
    return [e for e in platform_eqns(jaxpr, platform) if e.primitive.name == "optimization_barrier"
            and [(v.aval.shape, v.aval.dtype) for v in e.invars] == [(shape, np.float32)]]


@pytest.mark.usefixtures("every_platform_programs")
def test_a_batched_dots_output_is_written_out_on_tpu_where_its_compiler_would_crash():
    """Attention's ``softmax(q . k)``: on TPU under JAX < 0.12 the batched dot's output passes one optimization
    barrier before the softmax reads it (that libtpu's compiler otherwise dies of a stack overflow fusing the two,
    docs/performance.md); JAX 0.12's program, CPU's and CUDA's, and an unbatched dot's keep their fusion."""
    q = jnp.ones((2, 16, 4, 32))
    attention = jax.make_jaxpr(int8ify(lambda q, k: jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)))
    jaxpr = attention(q, q)
    scores = (2, 4, 16, 16)
    assert len(_output_barriers(jaxpr, "tpu", scores)) == (1 if jax.__version_info__ < (0, 12) else 0)
    assert _output_barriers(jaxpr, "cpu", scores) == _output_barriers(jaxpr, "cuda", scores) == []
    dense = jax.make_jaxpr(int8ify(lambda x, w: jax.nn.softmax(x @ w, axis=-1)))
    dense = dense(jnp.ones((64, 256)), jnp.ones((256, 128)))
    assert _output_barriers(dense, "tpu", (64, 128)) == []
