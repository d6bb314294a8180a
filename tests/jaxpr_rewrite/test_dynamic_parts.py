"""The rewritten program's dynamic quantization on CPU (``quantize_dynamic_parts``) against the contract's
(``quantize_parts``) and a numpy reference: the same codes and scales, bit for bit, for every finite slice; NaN
scales for a slice holding NaN or Inf."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import (assert_finite_slices_quantized_as_the_contract, is_max_reduction, platform_eqns,
                     with_zero_and_non_finite_rows)
from jaxpr_rewrite import int8ify

qz = importlib.import_module("jaxpr_rewrite.quantize")


@st.composite
def operands(draw):
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 300))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "quarters", "tiny", "huge", "zeros"]))
    x = {"normal": lambda: rng.normal(size=(rows, cols)),
         "quarters": lambda: rng.integers(-300, 300, size=(rows, cols)) / 4.0,  # rich in rounding ties
         "tiny": lambda: rng.normal(size=(rows, cols)) * 2.0**-120,
         "huge": lambda: rng.normal(size=(rows, cols)) * 2.0**120,
         "zeros": lambda: np.zeros((rows, cols))}[kind]().astype(np.float32)
    x[np.abs(x) < np.finfo(np.float32).tiny] = 0.0  # XLA reads subnormal inputs as zero (README)
    return with_zero_and_non_finite_rows(draw, x, max_bad=rows)


@settings(max_examples=100, deadline=None)
@given(operands(), st.booleans())
def test_codes_and_scales_match_the_contract_on_finite_slices(case, transposed):
    x, bad_rows = case
    x = x.T if transposed else x
    scales, factor, finite = assert_finite_slices_quantized_as_the_contract(
        qz.quantize_dynamic_parts, x, bad_rows, 0 if transposed else 1)
    assert np.isnan(scales[~finite]).all() and np.isnan(factor[~finite]).all()


def _absmax_producers(jaxpr, platform):
    eqns = list(platform_eqns(jaxpr, platform))
    made_by = {id(v): e.primitive.name for e in eqns for v in e.outvars}
    return [made_by.get(id(e.invars[0])) for e in eqns if is_max_reduction(e)]


def test_cpu_absmax_of_a_matrix_reads_the_operand_directly():
    """On CPU a matrix operand's absmax is ``reduce_max(abs(x))`` (fused into XLA's reduction), not of a NaN-to-Inf
    select that XLA:CPU writes out as a temporary as large as the operand; TPU keeps that select, and so do
    operands of higher rank on CPU (whose codes XLA's dot reads through a reshape); CUDA reduces the elements'
    scales, rounded on their bits (``float64_scales``)."""
    matrices = jax.make_jaxpr(int8ify(lambda a, b: a @ b))(jnp.ones((64, 256)), jnp.ones((256, 128)))
    assert _absmax_producers(matrices, "cpu") == ["abs", "abs"]  # both operands are float: one absmax each
    assert _absmax_producers(matrices, "tpu") == ["select_n", "select_n"]
    assert _absmax_producers(matrices, "cuda") == ["bitcast_convert_type", "bitcast_convert_type"]
    batched = jax.make_jaxpr(int8ify(lambda a, b: a @ b))(jnp.ones((4, 16, 256)), jnp.ones((256, 128)))
    assert _absmax_producers(batched, "cpu") == ["select_n", "abs"]  # the (4, 16, 256) activation, the weight
