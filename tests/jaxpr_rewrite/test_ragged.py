"""ragged_dot / ragged_dot_general (mixture-of-experts grouped matmuls): rewritten to the int8 contract with one
scale per lhs row and one per group and column, listed by report, flagged by verify when left float."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from helpers import away_from_ties, dot_eqns, reference_codes, reference_scales
from jaxpr_rewrite import Int8ifyError, int8ify, quantize_params
from jaxpr_rewrite import report
from jaxpr_rewrite import verify
from jaxpr_rewrite import QuantizedArray
from jaxpr_rewrite import quantize
from jaxpr_rewrite._core.reasons import Why

rng = np.random.default_rng(5)
# a small mixture-of-experts layer: 32 tokens of width 16, 3 experts of 16 -> 8, tokens routed 10 / 12 / 10
MOE_X = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
MOE_W = jnp.asarray(rng.normal(size=(3, 16, 8)), jnp.float32)
MOE_GROUPS = jnp.array([10, 12, 10], jnp.int32)


def reference_ragged(x, w, group_sizes):
    """The contract per group: exact int64 sums of the codes, per-row x scales, per-group per-column w scales."""
    out, start = [], 0
    for g, size in enumerate(group_sizes):
        xq = reference_codes(x, (1,))[start:start + size].astype(np.int64)
        wq = reference_codes(w[g], (0,)).astype(np.int64)
        sx = reference_scales(x, (1,))[start:start + size]
        sw = reference_scales(w[g], (0,))
        out.append((xq @ wq) * sx[:, None] * sw[None, :])
        start += size
    return np.concatenate(out + [np.zeros((x.shape[0] - start, w.shape[2]))])


def test_the_int8_ragged_dot_keeps_the_default_precision_under_a_float32_default():
    """XLA:TPU's ragged dot kernel refuses an fp32 contraction of int8 codes: under
    ``jax_default_matmul_precision="float32"`` the int8 ragged dot asks for the default precision itself."""
    f = int8ify(lambda x, w, g: lax.ragged_dot(x, w, g))
    with jax.default_matmul_precision("float32"):
        (ragged,) = dot_eqns(jax.make_jaxpr(f)(MOE_X, MOE_W, MOE_GROUPS))
    assert [str(v.aval.dtype) for v in ragged.invars[:2]] == ["int8", "int8"]
    assert ragged.params["precision"] == (lax.Precision.DEFAULT, lax.Precision.DEFAULT)  # None reads as HIGHEST here


@pytest.mark.parametrize("sizes", [(40, 0, 60, 28), (128, 0, 0, 0), (10, 20, 30, 40)])
def test_moe_grouped_matmul_matches_the_reference(sizes):
    x = away_from_ties(rng.normal(size=(128, 64)), (1,))
    w = np.stack([away_from_ties(rng.normal(size=(64, 96)), (0,)) for _ in range(4)])
    group_sizes = np.array(sizes, np.int32)
    f = int8ify(lambda x, w, g: lax.ragged_dot(x, w, g))
    (ragged,) = dot_eqns(jax.make_jaxpr(f)(x, w, group_sizes))
    assert [str(v.aval.dtype) for v in ragged.invars] == ["int8", "int8", "int32"]
    assert str(ragged.outvars[0].aval.dtype) == "int32"
    got = np.asarray(jax.jit(f)(x, w, group_sizes), np.float64)
    np.testing.assert_allclose(got, reference_ragged(x, w, sizes), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("where", ["last group's weight", "row past the groups"])
def test_rows_past_the_groups_stay_zero_and_nan_reaches_its_own_group_only(where):
    """Rows past ``sum(group_sizes)`` belong to no group: 0, as the float ragged dot gives. They took the last
    group's column scales (NaN there made them NaN) and their own row scale (NaN for a row holding NaN)."""
    x = away_from_ties(rng.normal(size=(16, 512)), (1,))
    w = np.stack([away_from_ties(rng.normal(size=(512, 384)), (0,)) for _ in range(3)])
    group_sizes = np.array([4, 4, 4], np.int32)
    if where == "last group's weight":
        w[2, 3, 5] = np.nan
    else:
        x[13, 7] = np.nan
    got = np.asarray(jax.jit(int8ify(lambda x, w, g: lax.ragged_dot(x, w, g)))(x, w, group_sizes))
    with np.errstate(invalid="ignore"):  # the reference's codes of NaN
        want = reference_ragged(x, w, group_sizes)
    np.testing.assert_array_equal(got[12:], 0)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5 * np.abs(want[finite]).max())


def test_ragged_gradients_are_straight_through_and_weights_quantize_once():
    x, w, g = MOE_X, MOE_W, MOE_GROUPS

    def moe(params, x, g):
        return lax.ragged_dot(x, params["experts"], g)

    grad = jax.grad(lambda x: int8ify(moe)({"experts": w}, x, g).sum())(x)
    want = jax.grad(lambda x: moe({"experts": w}, x, g).sum())(x)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)
    q = quantize_params(moe, {"experts": w}, x, g)
    assert q["experts"].scales.shape == (3, 8)  # one per group and column
    f = jax.jit(int8ify(moe))
    np.testing.assert_array_equal(np.asarray(f(q, x, g)), np.asarray(f({"experts": w}, x, g)))


def test_smoothed_prequantized_experts_follow_the_dot_rule():
    """A pre-quantized weight with SmoothQuant factors stands for ``w``: its codes hold ``s * w``, so the ragged
    dot divides the activations by ``s`` first, as a plain dot does."""
    x = away_from_ties(rng.normal(size=(64, 32)), (1,))
    w = rng.normal(size=(4, 32, 48)).astype(np.float32)
    smooth = rng.uniform(0.5, 2.0, size=32).astype(np.float32)
    w_s = np.stack([away_from_ties(smooth[:, None] * w[g], (0,)) for g in range(4)])
    q = quantize(jnp.asarray(w_s), (1,))
    experts = QuantizedArray(q.codes, q.scales, q.exponents, q.contracting, np.float32, jnp.asarray(smooth))
    sizes = (20, 0, 30, 14)
    got = np.asarray(jax.jit(int8ify(lambda w, x, g: lax.ragged_dot(x, w, g)))(experts, x, np.array(sizes, np.int32)))
    x_s = (x * (np.float32(1) / smooth)).astype(np.float32)
    np.testing.assert_allclose(got, reference_ragged(x_s, w_s, sizes), rtol=1e-5, atol=1e-6)


def test_report_verify_and_assert_int8_know_ragged_dots():
    x, w, g = MOE_X, MOE_W, MOE_GROUPS

    def moe(x, w, g):
        return lax.ragged_dot(x, w, g)  # RAGGED

    rows = report(moe, x, w, g)
    assert len(rows) == 1 and rows[0].primitive == "ragged_dot_general" and rows[0].rewritten
    assert 0 < rows[0].error < 0.05
    assert "ragged_dot_general: f32[32,16] x f32[3,16,8]" in str(rows)
    findings = verify(moe, x, w, g)
    assert [f.code for f in findings] == ["JX101"] and "ragged_dot_general" in findings[0].message
    assert verify(int8ify(moe), x, w, g) == []


def test_unsupported_ragged_layout_is_an_error_not_a_float_matmul():
    """A ragged contracting dim (the weight-gradient form) has no int8 rule: an error naming it, unless skipped."""
    x = jnp.asarray(rng.normal(size=(8, 24)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(24, 5)), jnp.float32)
    g = jnp.array([10, 14], jnp.int32)
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (0,)), ((), ())), lhs_ragged_dimensions=(1,), rhs_group_dimensions=())

    def f(x, y, g):
        return lax.ragged_dot_general(x, y, g, dims)

    with pytest.raises(Int8ifyError, match=r"ragged_dot_general at .*test_ragged.py:\d+.*cannot be rewritten"):
        int8ify(f)(x, y, g)
    kept = int8ify(f, skip_if=lambda eqn: eqn.primitive.name == "ragged_dot_general")(x, y, g)
    np.testing.assert_allclose(kept, f(x, y, g), rtol=1e-6)
    reason = report(f, x, y, g)[0].reason
    assert reason.why is Why.UNSUPPORTED_RAGGED and "unsupported ragged layout" in str(reason)
