"""The block-scaled backends ("mxfp8", "nvfp4", "auto"): jaxpr shape, numerics against a numpy reference of
the documented ``scaled_matmul`` formula, the quantizers' scale rules, padding, gradients, zeros and NaN/Inf.

The numpy reference never runs the library's matmul: it moves the operands to ``(B, M, K)`` with numpy,
pads K, takes codes and scales from the library's quantizer, and evaluates
``einsum('BMK,BNK->BMN', a * repeat(a_scales), b * repeat(b_scales))`` (times nvfp4's tensor scales) in
float64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

from helpers import evaluate_as, examples, first_device_is, run_fresh_python
from jaxpr_rewrite import Int8ifyError, int8ify
from jaxpr_rewrite._core.jaxprs import sub_jaxprs
from jaxpr_rewrite._backends import scaled_matmul as sm

FORMATS = {"mxfp8": sm.MXFP8, "nvfp4": sm.NVFP4}

# (lhs shape, rhs shape, dimension_numbers): plain matmul with K=40 (padded), a batched dot with two
# contracting dims listed out of order (K = 3 * 7 = 21), and a vector . matrix product (K = 33).
CASES = {
    "matmul": ((5, 40), (40, 7), (((1,), (0,)), ((), ()))),
    "batched": ((2, 3, 5, 7), (7, 2, 4, 3), (((1, 3), (3, 0)), ((0,), (1,)))),
    "vector": ((33,), (6, 33), (((0,), (1,)), ((), ()))),
}


def _dot(dimension_numbers):
    return lambda a, b: lax.dot_general(a, b, dimension_numbers)


@functools.lru_cache(maxsize=None)
def _rewritten(case: str, backend: str):
    """One int8ified function per (case, backend), so repeated calls reuse the compiled program."""
    return int8ify(_dot(CASES[case][2]), backend=backend)


def _walk(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from _walk(sub)


def _free(ndim, contract, batch):
    return [a for a in range(ndim) if a not in contract and a not in batch]


def np_to_bmk(x, contract, batch, block):
    """numpy: move to (B, M, K) and zero-pad K to a multiple of ``block``."""
    x = np.asarray(x, np.float32)
    free = _free(x.ndim, contract, batch)
    moved = np.transpose(x, [*batch, *free, *contract])
    b = int(np.prod([x.shape[a] for a in batch]))
    m = int(np.prod([x.shape[a] for a in free]))
    k = int(np.prod([x.shape[a] for a in contract]))
    flat = moved.reshape(b, m, k)
    kp = -(-k // block) * block
    return np.pad(flat, ((0, 0), (0, 0), (0, kp - k)))


_quantize = jax.jit(sm.quantize_blocks, static_argnums=1)


def reference_dot(lhs, rhs, dimension_numbers, fmt) -> np.ndarray:
    """The documented scaled_matmul formula in float64 from the library quantizer's codes and scales."""
    (lc, rc), (lb, rb) = dimension_numbers
    sides = []
    for x, c, b in ((lhs, lc, lb), (rhs, rc, rb)):
        q = _quantize(jnp.asarray(np_to_bmk(x, c, b, fmt.block_size)), fmt)
        codes = np.asarray(q.codes.astype(np.float32), np.float64)
        scales = np.asarray(q.scales.astype(np.float32), np.float64)
        scaled = codes * np.repeat(scales, fmt.block_size, axis=-1)
        g = 1.0 if q.tensor_scale is None else float(q.tensor_scale)
        sides.append((scaled, g))
    (a, ga), (b, gb) = sides
    out = np.einsum("BMK,BNK->BMN", a, b) * ga * gb
    out_shape = (
        *(lhs.shape[i] for i in lb),
        *(lhs.shape[i] for i in _free(lhs.ndim, lc, lb)),
        *(rhs.shape[i] for i in _free(rhs.ndim, rc, rb)),
    )
    return out.reshape(out_shape)


def _data(shape, seed, log_scale=0):
    rng = np.random.default_rng(seed)
    # a spread of magnitudes inside each block, and an overall scale
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-2, 2, shape))
    return (x * 2.0**log_scale).astype(np.float32)


# -- the rewritten jaxpr -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("case", ["matmul", "batched"])
def test_jaxpr_holds_scaled_matmul_with_format_dtypes(backend, case):
    fmt = FORMATS[backend]
    lhs_shape, rhs_shape, dn = CASES[case]
    jaxpr = jax.make_jaxpr(_rewritten(case, backend))(jnp.ones(lhs_shape), jnp.ones(rhs_shape)).jaxpr
    eqns = list(_walk(jaxpr))
    if sm._needs_inline_emulation():
        # a GPU older than Blackwell has no block-scaled matmul: the documented math is emitted inline, on codes
        # of the format's dtypes
        upcasts = [e for e in eqns if e.primitive.name == "convert_element_type"
                   and e.invars[0].aval.dtype == np.dtype(fmt.value_dtype)]
        assert len(upcasts) == 2
        return
    assert not [e for e in eqns if e.primitive is lax.dot_general_p], "a dot_general is left"
    calls = [e for e in eqns if e.primitive.name == "scaled_matmul_wrapper"]
    assert len(calls) == 1
    a, b, sa, sb = (v.aval for v in calls[0].invars)
    (lc, rc), (lb, rb) = dn
    bsz = int(np.prod([lhs_shape[i] for i in lb]))
    m = int(np.prod([lhs_shape[i] for i in _free(len(lhs_shape), lc, lb)]))
    n = int(np.prod([rhs_shape[i] for i in _free(len(rhs_shape), rc, rb)]))
    k = int(np.prod([lhs_shape[i] for i in lc]))
    kp = -(-k // fmt.block_size) * fmt.block_size
    assert (a.shape, b.shape) == ((bsz, m, kp), (bsz, n, kp))
    assert (sa.shape, sb.shape) == ((bsz, m, kp // fmt.block_size), (bsz, n, kp // fmt.block_size))
    assert a.dtype == b.dtype == np.dtype(fmt.value_dtype)
    assert sa.dtype == sb.dtype == np.dtype(fmt.scale_dtype)
    assert calls[0].outvars[0].aval.shape == (bsz, m, n)
    assert calls[0].outvars[0].aval.dtype == np.float32
    assert jaxpr.outvars[0].aval.shape == jax.eval_shape(_dot(dn), jnp.ones(lhs_shape), jnp.ones(rhs_shape)).shape


def test_mxfp8_dtypes_are_the_documented_ones():
    assert np.dtype(sm.MXFP8.value_dtype) == np.dtype(jnp.float8_e4m3fn)
    assert np.dtype(sm.MXFP8.scale_dtype) == np.dtype(jnp.float8_e8m0fnu) and sm.MXFP8.block_size == 32
    assert np.dtype(sm.NVFP4.value_dtype) == np.dtype(jnp.float4_e2m1fn)
    assert np.dtype(sm.NVFP4.scale_dtype) == np.dtype(jnp.float8_e4m3fn) and sm.NVFP4.block_size == 16


def test_output_dtype_and_jit_on_this_platform():
    x, w = jnp.asarray(_data((4, 40), 0), jnp.bfloat16), jnp.asarray(_data((40, 3), 1), jnp.bfloat16)
    for backend in FORMATS:
        out = jax.jit(int8ify(lambda a, b: a @ b, backend=backend))(x, w)
        assert out.dtype == jnp.bfloat16 and out.shape == (4, 3)
        assert np.all(np.isfinite(np.asarray(out, np.float32)))


# -- numerics against the numpy reference ---------------------------------------------------------------
@examples(12)
@given(
    case=st.sampled_from(sorted(CASES)),
    backend=st.sampled_from(sorted(FORMATS)),
    seed=st.integers(0, 2**16),
    log_scale=st.integers(-30, 30),
)
def test_matches_numpy_reference_of_documented_formula(case, backend, seed, log_scale):
    if case == "vector" and backend == "mxfp8" and jax.__version_info__ < (0, 10):
        # Before JAX 0.10 one block of this case comes out one fp8 step off inside the fused rewritten program,
        # although the quantized operands and jax.nn.scaled_matmul match the reference when run on their own.
        pytest.xfail("an mxfp8 block one fp8 step off inside the fused program before JAX 0.10")
    lhs_shape, rhs_shape, dn = CASES[case]
    lhs, rhs = _data(lhs_shape, seed, log_scale), _data(rhs_shape, seed + 1)
    out = np.asarray(_rewritten(case, backend)(lhs, rhs), np.float64)
    ref = reference_dot(lhs, rhs, dn, FORMATS[backend])
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6 * np.abs(ref).max())


@pytest.mark.parametrize("backend, bound", [("mxfp8", 0.08), ("nvfp4", 0.25)])
def test_error_against_float_is_format_sized(backend, bound):
    lhs_shape, rhs_shape, dn = CASES["batched"]
    lhs, rhs = _data(lhs_shape, 3), _data(rhs_shape, 4)
    out = np.asarray(_rewritten("batched", backend)(lhs, rhs), np.float64)
    exact = np.asarray(_dot(dn)(lhs.astype(np.float64), rhs.astype(np.float64)))
    assert np.linalg.norm(out - exact) / np.linalg.norm(exact) < bound


@pytest.fixture
def inline_emulation(monkeypatch):
    """The program a GPU older than Blackwell runs (the block-scaled math inline), traced afresh."""
    monkeypatch.setattr(sm, "_needs_inline_emulation", lambda: True)
    jax.clear_caches()
    yield
    monkeypatch.undo()
    jax.clear_caches()


@pytest.mark.parametrize("backend", sorted(FORMATS))
def test_inline_emulation_keeps_its_roundings_under_gpu_excess_precision(backend, inline_emulation):
    """XLA's GPU compiler drops ``float32 -> float8/float4 -> float32`` round trips (``xla_allow_excess_precision``):
    the codes and scales of the inline emulation must stay rounded to their formats (an H200 gave errors of 3%
    for mxfp8, and a zero nvfp4 block scale, before)."""
    lhs_shape, rhs_shape, dn = CASES["batched"]
    lhs, rhs = _data(lhs_shape, 0), _data(rhs_shape, 1)
    f = int8ify(_dot(dn), backend=backend)
    upcasts = [e for e in _walk(jax.make_jaxpr(f)(lhs, rhs).jaxpr) if e.primitive.name == "convert_element_type"
               and e.invars[0].aval.dtype == np.dtype(FORMATS[backend].value_dtype)]
    assert len(upcasts) == 2  # the inline emulation, not a scaled_matmul equation
    (out,) = evaluate_as("cuda", f, lhs, rhs, excess_precision=True)
    ref = reference_dot(lhs, rhs, dn, FORMATS[backend])
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=2e-5, atol=2e-6 * np.abs(ref).max())
    tiny, huge = np.float32(9 * 2.0**-126), np.float32(1e37)
    a = np.full((2, 16), tiny, np.float32)
    b = np.full((16, 2), huge, np.float32)
    b[:, 0] = huge / np.float32(6 * 448) * np.float32(2.0**-10)
    (out,) = evaluate_as("cuda", int8ify(lambda x, w: x @ w, backend="nvfp4"), a, b, excess_precision=True)
    np.testing.assert_allclose(np.asarray(out, np.float64), a.astype(np.float64) @ b.astype(np.float64), rtol=1e-6)


def test_nvfp4_epilogue_neither_overflows_nor_underflows_between_a_huge_and_a_tiny_operand():
    """A huge operand times a tiny one has an ordinary result, and the epilogue's two tensor scales (near float32's
    top and its bottom) must not overflow or underflow on the way to it. The plain ``out * g_lhs * g_rhs`` gave
    Inf with the huge operand on the left, and 0 with the tiny one on the left where the huge one's column lies far
    below its tensor scale. The values are exact in nvfp4 (blocks of ``6 * 448`` and ``6 * 1.5`` times their
    tensor scale, and ``0.5 * 2**-9``, the smallest), so the result is the float64 product."""
    tiny = np.float32(9 * 2.0**-126)  # tensor scale 2**-126 (the smallest), blocks 6 * 1.5 exactly
    huge = np.float32(1e37)
    small = huge / np.float32(6 * 448) * np.float32(2.0**-10)  # codes 0.5, block scale 2**-9 (the smallest)
    a = np.full((2, 16), tiny, np.float32)
    b = np.full((16, 2), huge, np.float32)
    b[:, 0] = small
    nvfp4 = jax.jit(int8ify(lambda x, w: x @ w, backend="nvfp4"))
    for x, w in ((a, b), (b.T.copy(), a.T.copy())):
        out = np.asarray(nvfp4(x, w), np.float64)
        exact = x.astype(np.float64) @ w.astype(np.float64)
        assert np.all(np.isfinite(out)) and np.all(out != 0), out
        np.testing.assert_allclose(out, exact, rtol=1e-6)
    # the reported cases (not exact in nvfp4: within its rounding)
    for x_value, w_value in ((1e37, 1e-37), (1e-37, 1e37), (1e34, 1.0)):
        x, w = np.full((1, 16), x_value, np.float32), np.full((16, 1), w_value, np.float32)
        out = np.asarray(nvfp4(x, w), np.float64)
        np.testing.assert_allclose(out, x.astype(np.float64) @ w.astype(np.float64), rtol=0.1)


# -- the quantizers against numpy -------------------------------------------------------------------------
def _blocks_for_scale_rule(block):
    """(1, 12, 2 * block) float32: random blocks of many magnitudes, exact 448 * 2**k edges, an all-zero
    block, float32 extremes."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 12, 2 * block)) * 2.0 ** rng.integers(-40, 40, (1, 12, 1))
    x[0, 0, :block] = 0.0  # all-zero block
    x[0, 1, :block] = 1.0
    x[0, 1, 3] = 448.0 * 2.0**5  # block amax exactly 448 * 2**5 -> scale 2**5
    x[0, 2, block:] = 1e-3
    x[0, 2, block + 1] = np.float32(448.0 * 2.0**-3) * np.float32(1 + 2**-23)  # just above -> 2**-2
    x[0, 3, 0] = 3e38  # near float32 max
    x[0, 4, :block] = 2.0**-120  # 2**ceil(log2(2**-120 / 448)) = 2**-128 clamps to 2**-126
    return x.astype(np.float32)


def test_mxfp8_scale_rule_and_round_trip():
    x = _blocks_for_scale_rule(32)
    q = sm.quantize_mxfp8(jnp.asarray(x))
    scales = np.asarray(q.scales.astype(np.float32), np.float64)
    codes = np.asarray(q.codes.astype(np.float32), np.float64)
    amax = np.abs(x.astype(np.float64)).reshape(1, 12, 2, 32).max(-1)
    with np.errstate(divide="ignore"):
        expo = np.clip(np.ceil(np.log2(amax / 448.0)), -126, 127)
    expected = np.where(amax == 0, 1.0, 2.0**expo)
    np.testing.assert_array_equal(scales, expected)
    assert scales[0, 1, 0] == 2.0**5 and scales[0, 2, 1] == 2.0**-2 and scales[0, 4, 0] == 2.0**-126
    # round trip: no clipping, error within half an e4m3 step (2**-4 relative; 2**-10 * scale subnormal)
    s = np.repeat(scales, 32, axis=-1)
    err = np.abs(codes * s - x)
    bound = np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * s)
    assert np.all(err <= bound)
    assert np.all(np.abs(codes) <= 448.0)
    assert np.all(codes[0, 0, :32] == 0.0)


def test_mxfp8_codes_of_float32s_top_binade_stay_finite():
    """A block whose absmax lies above 1.75 * 2**127 gets the scale 2**120, and a value near its top rounds to the
    code 256: 2**128, Inf in float32, which made a finite row's outputs all Inf. Codes stop at 240 there, the values
    within one step of the format, and the dot is finite and close to float64's."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    w = (rng.standard_normal((512, 256)) * 1e-30).astype(np.float32)
    for big in (3.3e38, 3.4e38, np.finfo(np.float32).max):
        x[1, 5] = np.float32(big)
        q = sm.quantize_mxfp8(jnp.asarray(x)[None])
        values = np.asarray(q.codes.astype(np.float32), np.float64) * np.repeat(
            np.asarray(q.scales.astype(np.float32), np.float64), 32, axis=-1)
        assert np.isfinite(values.astype(np.float32)).all()
        assert abs(values[0, 1, 5] - np.float64(np.float32(big))) <= 16 * 2.0**120  # one e4m3 step at 2**120
        got = np.asarray(jax.jit(int8ify(lambda x, w: x @ w, backend="mxfp8"))(x, w))
        want = x.astype(np.float64) @ w.astype(np.float64)
        assert np.isfinite(got).all()
        assert np.linalg.norm(got - want) <= 0.1 * np.linalg.norm(want)


def _e4m3_values():
    v = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return np.unique(v[np.isfinite(v) & (v >= 0)])


def test_nvfp4_scale_rule_and_round_trip():
    x = _blocks_for_scale_rule(16)[:, :, :32]
    x[0, 3, 0] = 1e30  # keep the tensor amax moderate so block scales span the e4m3 range
    q = sm.quantize_nvfp4(jnp.asarray(x))
    g = float(q.tensor_scale)
    np.testing.assert_allclose(g, np.abs(x).max() / (6 * 448), rtol=1e-6)
    scales = np.asarray(q.scales.astype(np.float32), np.float64)
    codes = np.asarray(q.codes.astype(np.float32), np.float64)
    xs = (x / np.float32(g)).astype(np.float64)
    amax = np.abs(xs).reshape(1, 12, 2, 16).max(-1)
    wanted = np.minimum(amax / 6.0, 448.0)
    grid = _e4m3_values()
    # the smallest e4m3 value >= amax / 6 (1 for an all-zero block)
    idx = np.searchsorted(grid, wanted * (1 - 1e-6))
    expected = np.where(amax == 0, 1.0, grid[np.minimum(idx, len(grid) - 1)])
    np.testing.assert_array_equal(scales, expected)
    # round trip: within half an e2m1 step of x / (g * s) (steps 0.5 below 2, 1 below 4, 2 up to 6)
    s = np.repeat(scales, 16, axis=-1)
    v = np.abs(xs / s)
    half_step = np.where(v < 2, 0.25, np.where(v < 4, 0.5, 1.0))
    assert np.all(v <= 6 * (1 + 1e-6))
    assert np.all(np.abs(codes - xs / s) <= half_step * (1 + 1e-6))
    assert np.all(codes[0, 0, :16] == 0.0)


@pytest.mark.parametrize("backend", ["mxfp8", "nvfp4"])
def test_non_finite_block_gets_nan_scale(backend):
    x = np.ones((1, 2, 64), np.float32)
    x[0, 0, 5] = np.nan
    x[0, 1, 40] = np.inf
    q = sm.quantize_blocks(jnp.asarray(x), FORMATS[backend])
    scales = np.asarray(q.scales.astype(np.float32))
    bs = FORMATS[backend].block_size
    assert np.isnan(scales[0, 0, 5 // bs]) and np.isnan(scales[0, 1, 40 // bs])
    assert np.isfinite(scales).sum() == scales.size - 2


# -- padding, zeros, NaN/Inf ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["mxfp8", "nvfp4"])
def test_padding_does_not_change_the_result(backend):
    # K = 40 is padded to a multiple of the block; zero columns appended to K must not change anything.
    lhs, rhs = _data((5, 40), 11), _data((40, 7), 12)
    lhs_p = np.concatenate([lhs, np.zeros((5, 24), np.float32)], 1)
    rhs_p = np.concatenate([rhs, np.zeros((24, 7), np.float32)], 0)
    out = np.asarray(_rewritten("matmul", backend)(lhs, rhs))
    out_p = np.asarray(jax.jit(int8ify(lambda a, b: a @ b, backend=backend))(lhs_p, rhs_p))
    np.testing.assert_array_equal(out, out_p)


@pytest.mark.parametrize("backend", ["mxfp8", "nvfp4"])
def test_all_zero_blocks_give_exact_zeros(backend):
    lhs, rhs = _data((5, 40), 13), _data((40, 7), 14)
    lhs[2] = 0.0
    out = np.asarray(_rewritten("matmul", backend)(lhs, rhs))
    assert np.all(out[2] == 0.0)
    assert np.all(np.asarray(_rewritten("matmul", backend)(np.zeros_like(lhs), rhs)) == 0.0)


@pytest.mark.parametrize("backend", ["mxfp8", "nvfp4"])
def test_nan_and_inf_stay_non_finite(backend):
    lhs, rhs = _data((5, 40), 15), _data((40, 7), 16)
    lhs[1, 3] = np.nan
    lhs[3, 39] = np.inf
    out = np.asarray(_rewritten("matmul", backend)(lhs, rhs))
    assert np.all(np.isnan(out[1])) and np.all(~np.isfinite(out[3]))
    assert np.all(np.isfinite(out[[0, 2, 4]]))


# -- gradients ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["mxfp8", "nvfp4"])
def test_gradient_is_straight_through(backend):
    lhs_shape, rhs_shape, dn = CASES["batched"]
    lhs, rhs = _data(lhs_shape, 17), _data(rhs_shape, 18)
    weight = _data(jax.eval_shape(_dot(dn), lhs, rhs).shape, 19)

    def loss(dot):
        return lambda a, b: jnp.sum(dot(a, b) * weight)

    got = jax.grad(loss(_rewritten("batched", backend)), argnums=(0, 1))(lhs, rhs)
    want = jax.grad(loss(_dot(dn)), argnums=(0, 1))(lhs, rhs)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


# -- transformations, backend choice, registration ------------------------------------------------------
def test_vmap_with_unbatched_weight():
    x, w = _data((3, 5, 40), 20), _data((40, 7), 21)
    f = _rewritten("matmul", "mxfp8")
    out = jax.vmap(f, (0, None))(x, w)
    np.testing.assert_allclose(out, np.stack([f(xi, w) for xi in x]), rtol=1e-6, atol=1e-6)


def test_auto_backend_resolves_at_rewrite_time(monkeypatch):
    x, w = jnp.ones((4, 64)), jnp.ones((64, 8))

    def prims(blackwell):
        monkeypatch.setattr(sm, "is_blackwell", lambda: blackwell)
        if blackwell:  # on an older GPU the format's math is emitted inline instead of scaled_matmul
            monkeypatch.setattr(sm, "_needs_inline_emulation", lambda: False)
        jaxpr = jax.make_jaxpr(int8ify(lambda a, b: a @ b, backend="auto"))(x, w).jaxpr
        return {e.primitive.name for e in _walk(jaxpr)}

    assert "scaled_matmul_wrapper" in prims(True)
    on_cpu = prims(False)
    assert "scaled_matmul_wrapper" not in on_cpu and "dot_general" in on_cpu  # the int8 dot


def test_blackwell_detection():
    class Dev:
        def __init__(self, platform, cc=None, kind=""):
            self.platform, self.compute_capability, self.device_kind = platform, cc, kind

    assert sm._device_is_blackwell(Dev("gpu", "10.0"))
    assert sm._device_is_blackwell(Dev("gpu", "12.0"))
    assert not sm._device_is_blackwell(Dev("gpu", "9.0", "NVIDIA H200"))
    assert not sm._device_is_blackwell(Dev("gpu", "gfx942"))
    assert sm._device_is_blackwell(Dev("gpu", None, "NVIDIA B200"))
    assert not sm._device_is_blackwell(Dev("cpu", None, "cpu"))
    assert not sm.is_blackwell()  # this test machine


def test_a_blackwell_hosts_work_put_on_its_cpu_gets_the_int8_contract(monkeypatch):
    """The ``auto`` backend is chosen for the device a program runs on: a Blackwell host's default GPU takes
    ``mxfp8``, its CPU under ``jax.default_device`` the int8 contract."""
    cpu = jax.devices("cpu")[0]

    class B200:
        platform, compute_capability, device_kind = "gpu", "10.0", "NVIDIA B200"

    first_device_is(monkeypatch, B200())
    assert sm.is_blackwell() and not sm._needs_inline_emulation() and sm.auto_backend() == "mxfp8"
    with jax.default_device(cpu):
        assert not sm.is_blackwell() and not sm._needs_inline_emulation() and sm.auto_backend() == "int8"
    # one int8ify'd function, its programs traced for each device in turn (kept apart: jax.jit's cache key, which
    # int8ify's takes, holds the default device)
    g = int8ify(lambda a, b: a @ b, backend="auto")
    x, w = jnp.ones((4, 64)), jnp.ones((64, 8))

    def prims():
        return {e.primitive.name for e in _walk(g.rewritten_jaxpr(x, w).jaxpr)}

    assert "scaled_matmul_wrapper" in prims()
    with jax.default_device(cpu):
        assert "scaled_matmul_wrapper" not in prims() and "dot_general" in prims()
    assert "scaled_matmul_wrapper" in prims()


def test_int8_only_options_are_rejected():
    with pytest.raises(Int8ifyError, match="fixed layout"):
        int8ify(lambda a, b: a @ b, backend="mxfp8", block_size=64)(jnp.ones((2, 8)), jnp.ones((8, 2)))


def test_importing_patches_nothing_and_registration_is_lazy_and_idempotent():
    """In a fresh process: importing the package leaves JAX's scaled_matmul rules alone; the first fp8 use
    registers the emulation where JAX has no rule (never replacing JAX's cuda/rocm rules), once."""
    script = """
        import jax, jax.numpy as jnp
        import jaxpr_rewrite
        from jaxpr_rewrite import _compat, int8ify
        from jaxpr_rewrite._backends import scaled_matmul as sm
        prim = _compat.scaled_matmul_primitive()
        cpu_before = _compat.has_lowering(prim, "cpu")
        assert _compat.emulated_platforms() == ()
        int8ify(lambda a, b: a @ b, backend="mxfp8")(jnp.ones((2, 32)), jnp.ones((32, 2)))
        assert _compat.has_lowering(prim, "cpu") and _compat.has_lowering(prim, "cuda")
        assert cpu_before or "cpu" in _compat.emulated_platforms()
        assert "cuda" not in _compat.emulated_platforms() and "rocm" not in _compat.emulated_platforms()
        assert sm.enable_emulation() == _compat.emulated_platforms()
        assert _compat.register_emulated_lowering(sm.emulated_scaled_matmul) == ()
        assert _compat.generalize_batchers() == ()
        print("ok")
    """
    assert run_fresh_python(script).strip() == "ok"


def test_jax_nn_scaled_matmul_runs_on_cpu_with_documented_value():
    sm.enable_emulation()
    a = jnp.array([1.0, 2, 3]).reshape(1, 1, 3)
    b = jnp.array([4.0, 5, 6]).reshape(1, 1, 3)
    s = jnp.array([0.5]).reshape(1, 1, 1)
    np.testing.assert_array_equal(jax.nn.scaled_matmul(a, b, s, s), [[[8.0]]])
